"""The package's layers import only downward, and core's plain modules form no import cycle
(docs/architecture.md, "Layout"). Read from the source, exactly: no module is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pushactors

ROOT = Path(pushactors.__file__).parent

# Lowest first; a module may import its own layer and those below it.
RANK = {
    "logs": 0,
    "protocol": 1,
    "core": 2,
    "transport": 3,
    "actors": 4,
    "engine": 5,
    "routing": 5,
    "logview": 5,
    "integrations": 6,
    "testing": 6,
    "apps": 7,
    "__main__": 8,
    "": 8,  # the package's own __init__ (lazy re-exports)
}
# Known upward imports, each local to one function and said why where it stands.
ALLOWED_UP = {("pushactors.core.config", "pushactors.transport.auth")}


def _imports() -> dict[str, set[str]]:
    """Each module's pushactors imports (relative ones), those under ``if TYPE_CHECKING`` left out."""
    out: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        module = ".".join(parts)
        package = parts if is_pkg else parts[:-1]
        tree = ast.parse(path.read_text())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and id(node) not in skip:
                base = package[: len(package) - (node.level - 1)]
                out[module].add(".".join(base + ([node.module] if node.module else [])))
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_layer_imports_only_its_own_and_lower_layers() -> None:
    upward = sorted(
        (m, t)
        for m, targets in _imports().items()
        for t in targets
        if RANK[_layer(m)] < RANK[_layer(t)] and (m, t) not in ALLOWED_UP
    )
    assert upward == [], upward


def test_core_and_protocol_modules_import_no_cycle() -> None:
    graph = {m: {t for t in ts if _layer(t) == _layer(m)} for m, ts in _imports().items()}
    for layer in ("core", "protocol"):
        nodes = {m for m in graph if _layer(m) == layer}
        done: set[str] = set()

        def visit(m: str, path: tuple[str, ...], nodes: set[str] = nodes, done: set[str] = done) -> None:
            assert m not in path, f"import cycle: {' -> '.join((*path[path.index(m) :], m))}"
            if m in done:
                return
            for t in graph.get(m, ()):
                if t in nodes:
                    visit(t, (*path, m))
            done.add(m)

        for m in sorted(nodes):
            visit(m, ())
