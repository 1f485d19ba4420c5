"""Tests go through the package's public seams: a constructor or keyword argument, a fault of the
testing kit, a snapshot field. This counts the places tests/ still patch or read a private name
of pushactors and fails when a change adds one, so such access only ever shrinks. Read from the
source: nothing is imported but the standard library."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

TESTS = Path(__file__).parent
PACKAGE = TESTS.parent / "pushactors"

# None left: a new need is a new public seam, never a raised bound.
MAX_PATCHES = 0
MAX_READS = 0
PATCHERS = {"setattr", "delattr"}  # monkeypatch.setattr(obj, "_x", ...), setattr(obj, "_x", ...)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_private_names() -> set[str]:
    """Private names pushactors defines: functions, classes, attributes and module globals."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if private(name):
                names.add(name)
    return names


class Finder(ast.NodeVisitor):
    """Private patches and reads in one file; inside a class the file defines, ``self._x`` and
    ``cls._x`` are a test helper's own state."""

    def __init__(self, filename: str, ours: set[str]) -> None:
        self.filename = filename
        self.ours = ours
        self.classes = 0
        self.patches: list[str] = []
        self.reads: list[str] = []

    def where(self, node: ast.expr) -> str:
        return f"{self.filename}:{node.lineno}: {ast.unparse(node)}"

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes += 1
        self.generic_visit(node)
        self.classes -= 1

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called in PATCHERS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and private(name.value):
                self.patches.append(self.where(node))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if private(node.attr) and node.attr in self.ours:
            own = self.classes and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not own:
                self.reads.append(self.where(node))
        self.generic_visit(node)


@functools.cache
def accesses() -> tuple[list[str], list[str]]:
    """(private patches, private reads) in tests/, each as ``file:line: code``. A read is any
    use of a private attribute pushactors defines (setting one on a package object included),
    other than a test helper's own state."""
    ours = package_private_names()
    patches: list[str] = []
    reads: list[str] = []
    for path in sorted(TESTS.glob("*.py")):
        finder = Finder(path.name, ours)
        finder.visit(ast.parse(path.read_text(), str(path)))
        patches += finder.patches
        reads += finder.reads
    return patches, reads


def test_tests_patch_no_more_private_names_than_today() -> None:
    patches, _ = accesses()
    assert len(patches) <= MAX_PATCHES, (
        f"{len(patches)} patches of private names in tests/ (at most {MAX_PATCHES}): give the code a public "
        "seam (a constructor or keyword argument, a fault, a snapshot field) and test through it:\n"
        + "\n".join(patches)
    )


def test_tests_read_no_more_private_names_than_today() -> None:
    _, reads = accesses()
    assert len(reads) <= MAX_READS, (
        f"{len(reads)} reads of pushactors' private attributes in tests/ (at most {MAX_READS}): read a "
        "public snapshot or property, or pass a constructor argument, instead:\n" + "\n".join(reads)
    )


def test_the_count_sees_a_private_patch_and_a_private_read() -> None:
    """The counter itself: a patch and a read it must find, and a helper's own state it must not."""
    finder = Finder("t.py", {"_step_layered"})
    finder.visit(
        ast.parse(
            'monkeypatch.setattr(mod, "_hidden", 1)\n'
            'monkeypatch.setattr(mod, "__all__", [])\n'
            "x = worker._step_layered\n"
            "class Helper:\n"
            "    def f(self):\n"
            "        return self._step_layered + self._other\n"
        )
    )
    assert finder.patches == ["t.py:1: monkeypatch.setattr(mod, '_hidden', 1)"]
    assert finder.reads == ["t.py:3: worker._step_layered"]
    assert "_step_layered" in package_private_names()
