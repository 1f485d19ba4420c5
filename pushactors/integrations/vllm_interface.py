"""Whether :class:`~pushactors.integrations.vllm.PushActorsConnector` fits a vLLM release's
connector interface: every abstract method of ``KVConnectorBase_V1`` (and of ``SupportsHMA``
where the connector declares it) implemented, and every method the connector overrides callable
the way the base declares it (parameter names and order, defaults vLLM may leave out, method
kind). Methods the release's base lacks are listed, never refused: that release never calls them.

    python -m pushactors.integrations.vllm_interface                  # the vLLM installed here
    python -m pushactors.integrations.vllm_interface --tree DIR       # a release's Python files
    python -m pushactors.integrations.vllm_interface --tree DIR --ast # its base read, not imported
    python -m pushactors.integrations.vllm_interface fetch 0.34.0 DIR # keep such files (pip download)

With ``--tree``, DIR's ``vllm`` package is imported over this environment's other packages (a
CUDA build's base module imports on a CPU machine; nothing of it runs). Where that import fails,
the base is read from its source with :mod:`ast` instead and the report says so (``mode``).
Exit status 1 when the connector does not fit. Stdlib only; importing this module needs no vLLM.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
BASE_FILE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CONNECTOR_MODULE = "pushactors.integrations.vllm"
CONNECTOR = "PushActorsConnector"
BASE = "KVConnectorBase_V1"
HMA = "SupportsHMA"

ParamKind = Literal["positional", "either", "keyword", "*args", "**kwargs"]
MemberKind = Literal["method", "classmethod", "staticmethod", "property"]


@dataclass(frozen=True)
class Param:
    name: str
    kind: ParamKind
    default: bool  # whether a caller may leave it out


@dataclass(frozen=True)
class Member:
    """A method of a class as callers see it (``self``/``cls`` left out)."""

    name: str
    kind: MemberKind
    params: tuple[Param, ...] = ()
    abstract: bool = False


Interface = dict[str, Member]


@dataclass
class Report:
    """The outcome of one check: ``problems`` empty when the connector fits."""

    version: str
    mode: Literal["import", "ast"]
    problems: list[str] = field(default_factory=list)
    not_in_base: list[str] = field(default_factory=list)  # ours only: this release never calls them
    hooks: dict[str, object] = field(default_factory=dict)  # what the connector answers this release
    note: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "mode": self.mode,
            "problems": self.problems,
            "not_in_base": self.not_in_base,
            "hooks": self.hooks,
            "note": self.note,
        }


# ============================================================================================
# Reading interfaces
# ============================================================================================
_KINDS: dict[inspect._ParameterKind, ParamKind] = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "either",
    inspect.Parameter.KEYWORD_ONLY: "keyword",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


def _member_of(name: str, raw: object) -> Member | None:
    """``raw`` as found in a class's ``__dict__``; None for what is not a method."""
    if isinstance(raw, property | functools.cached_property):
        fget = raw.fget if isinstance(raw, property) else raw.func
        return Member(name, "property", (), bool(getattr(fget, "__isabstractmethod__", False)))
    kind: MemberKind
    if isinstance(raw, classmethod):
        func, kind, bound = raw.__func__, "classmethod", True
    elif isinstance(raw, staticmethod):
        func, kind, bound = raw.__func__, "staticmethod", False
    elif inspect.isfunction(raw):
        func, kind, bound = raw, "method", True
    else:
        return None
    params = list(inspect.signature(func).parameters.values())
    if bound:
        params = params[1:]
    # A caller may leave out a parameter with a default, and *args / **kwargs.
    found = tuple(
        Param(p.name, _KINDS[p.kind], p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        for p in params
    )
    return Member(name, kind, found, bool(getattr(func, "__isabstractmethod__", False)))


def class_interface(cls: type, *, own_module_prefix: str | None = None) -> Interface:
    """The methods ``cls`` defines. With ``own_module_prefix``, those of every class of its MRO
    from such modules (the connector's own, not what it inherits from vLLM), the nearest
    definition of each."""
    classes = (
        [cls] if own_module_prefix is None else [c for c in cls.__mro__ if c.__module__.startswith(own_module_prefix)]
    )
    out: Interface = {}
    for klass in reversed(classes):
        for name, raw in vars(klass).items():
            member = _member_of(name, raw)
            if member is not None:
                out[name] = member
    return out


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            names.add(target.attr)
    return names


def _ast_params(args: ast.arguments, bound: bool) -> tuple[Param, ...]:
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    out = [
        Param(a.arg, "positional" if i < len(args.posonlyargs) else "either", i >= first_default)
        for i, a in enumerate(positional)
    ]
    if bound:
        out = out[1:]
    if args.vararg is not None:
        out.append(Param(args.vararg.arg, "*args", True))
    out += [Param(a.arg, "keyword", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg is not None:
        out.append(Param(args.kwarg.arg, "**kwargs", True))
    return tuple(out)


def _class_node(source: str, name: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"no class {name} in the source")


def source_interface(source: str, class_name: str) -> Interface:
    """The methods class ``class_name`` of ``source`` defines in its body, read with :mod:`ast`."""
    out: Interface = {}
    for node in _class_node(source, class_name).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        decorators = _decorators(node)
        if "setter" in decorators or "deleter" in decorators:
            continue
        kind: MemberKind = "method"
        for candidate in ("property", "cached_property", "classmethod", "staticmethod"):
            if candidate in decorators:
                kind = "property" if candidate == "cached_property" else candidate  # type: ignore[assignment]
                break
        params = () if kind == "property" else _ast_params(node.args, bound=kind != "staticmethod")
        out[node.name] = Member(node.name, kind, params, "abstractmethod" in decorators)
    return out


def source_bases(source: str, class_name: str) -> list[str]:
    """The names class ``class_name`` of ``source`` lists as its bases."""
    return [ast.unparse(b).rsplit(".", 1)[-1] for b in _class_node(source, class_name).bases]


def has_class(source: str, name: str) -> bool:
    try:
        _class_node(source, name)
    except LookupError:
        return False
    return True


# ============================================================================================
# Comparing
# ============================================================================================
def _param_problems(where: str, ours: tuple[Param, ...], base: tuple[Param, ...]) -> list[str]:
    """Whether every call the base's signature allows binds to ours the same way."""
    problems: list[str] = []
    o_pos = [p for p in ours if p.kind in ("positional", "either")]
    o_named = {p.name: p for p in ours if p.kind in ("either", "keyword")}
    o_var = any(p.kind == "*args" for p in ours)
    o_kw = any(p.kind == "**kwargs" for p in ours)
    b_pos = [p for p in base if p.kind in ("positional", "either")]
    for i, p in enumerate(b_pos):
        if i < len(o_pos):
            q = o_pos[i]
            if p.kind == "either" and (q.name != p.name or q.kind != "either"):
                problems.append(
                    f"{where}: parameter {i + 1} is {q.name!r}{'' if q.kind == 'either' else ' (positional-only)'}, "
                    f"the base's is {p.name!r}, which vLLM may pass by name"
                )
            elif p.default and not q.default:
                problems.append(f"{where}: {q.name!r} has no default; the base's has one, so vLLM may leave it out")
        elif o_var and (p.kind == "positional" or o_kw):
            continue
        else:
            problems.append(f"{where}: the base's parameter {p.name!r} is missing")
    for p in base:
        if p.kind == "keyword":
            named = o_named.get(p.name)
            if named is None and not o_kw:
                problems.append(f"{where}: the base's keyword parameter {p.name!r} is missing")
            elif named is not None and p.default and not named.default:
                problems.append(f"{where}: {p.name!r} has no default; the base's has one, so vLLM may leave it out")
        elif p.kind == "*args" and not o_var:
            problems.append(f"{where}: the base takes *{p.name}, ours takes no extra positional arguments")
        elif p.kind == "**kwargs" and not o_kw:
            problems.append(f"{where}: the base takes **{p.name}, ours takes no extra keyword arguments")
    base_names = {p.name for p in base}
    for i, q in enumerate(o_pos[len(b_pos) :], start=len(b_pos)):
        if not q.default:
            problems.append(f"{where}: parameter {i + 1} {q.name!r} is not in the base and has no default")
    for q in ours:
        if q.kind == "keyword" and q.name not in base_names and not q.default:
            problems.append(f"{where}: keyword parameter {q.name!r} is not in the base and has no default")
    return problems


def compare(ours: Interface, base: Interface, base_name: str = BASE) -> list[str]:
    """What keeps ``ours`` (the connector's own methods) from fitting ``base``."""
    problems = [
        f"{base_name}.{name} is abstract and {CONNECTOR} does not implement it"
        for name, member in sorted(base.items())
        if member.abstract and name not in ours
    ]
    for name, mine in sorted(ours.items()):
        theirs = base.get(name)
        if theirs is None:
            continue
        where = f"{CONNECTOR}.{name}"
        if mine.kind != theirs.kind:
            problems.append(f"{where} is a {mine.kind}, {base_name}'s a {theirs.kind}")
            continue
        if mine.kind != "property":
            problems += _param_problems(where, mine.params, theirs.params)
    return problems


# ============================================================================================
# Checking a release
# ============================================================================================
def check_imported(base_module: object, connector: type, version: str) -> Report:
    """Check the connector class against a base module both imported (``import`` mode)."""
    report = Report(version=version, mode="import")
    base_cls = getattr(base_module, BASE)
    ours = class_interface(connector, own_module_prefix="pushactors")
    base = class_interface(base_cls)
    report.problems += compare(ours, base)
    hma = getattr(base_module, HMA, None)
    bases = [base_cls]
    if hma is not None and issubclass(connector, hma):
        report.problems += compare(ours, class_interface(hma), HMA)
        bases.append(hma)
    if inspect.isabstract(connector):
        left = sorted(getattr(connector, "__abstractmethods__", ()))
        report.problems.append(f"{CONNECTOR} cannot be instantiated: abstract {', '.join(left)}")
    every = {n for b in bases for klass in b.__mro__ for n in vars(klass)}
    report.not_in_base = sorted(n for n in ours if n not in every and not n.startswith("_"))
    report.hooks = _hooks(connector, base)
    return report


def _hooks(connector: type, base: Interface) -> dict[str, object]:
    """What the connector's class-level hooks answer this release (those its base has)."""
    out: dict[str, object] = {}
    config = SimpleNamespace(kv_buffer_device="cuda", kv_connector_extra_config={}, kv_role="kv_producer")
    if "kv_cache_access" in base:
        access = connector.kv_cache_access(config)  # type: ignore[attr-defined]
        out["kv_cache_access"] = getattr(access, "name", None) or str(access)
        out["kv_cache_needs_single_chunk"] = bool(access.needs_single_chunk())
    if "supports_sleep_mode" in base:
        out["supports_sleep_mode"] = bool(connector.supports_sleep_mode(config))  # type: ignore[attr-defined]
    return out


def check_sources(base_source: str, connector_source: str, version: str, note: str = "") -> Report:
    """Check the connector's source against a base module's source (``ast`` mode)."""
    report = Report(version=version, mode="ast", note=note)
    ours = source_interface(connector_source, CONNECTOR)
    base = source_interface(base_source, BASE)
    report.problems += compare(ours, base)
    known = set(base)
    if HMA in source_bases(connector_source, CONNECTOR):
        if has_class(base_source, HMA):
            hma = source_interface(base_source, HMA)
            report.problems += compare(ours, hma, HMA)
            known |= set(hma)
        else:
            report.problems.append(f"{CONNECTOR} subclasses {HMA}, which this release's base module lacks")
    report.not_in_base = sorted(n for n in ours if n not in known and not n.startswith("_"))
    return report


def connector_source() -> str:
    """The connector module's source, found without importing it (it imports vLLM)."""
    spec = importlib.util.find_spec(CONNECTOR_MODULE)
    if spec is None or spec.origin is None:
        raise LookupError(f"{CONNECTOR_MODULE} not found")
    return Path(spec.origin).read_text()


def tree_version(tree: Path) -> str:
    """The release a kept tree holds: its VERSION file, else vllm/_version.py."""
    marker = tree / "VERSION"
    if marker.is_file():
        return marker.read_text().strip()
    found = re.search(r"__version__ = version = ['\"]([^'\"]+)", _read(tree / "vllm" / "_version.py"))
    return found.group(1) if found else "unknown"


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def check(tree: Path | None = None, *, use_ast: bool = False) -> Report:
    """Check the installed vLLM (``tree`` None) or the release kept in ``tree``."""
    version = tree_version(tree) if tree is not None else "installed"
    why = ""
    if not use_ast:
        if tree is not None:
            sys.path.insert(0, str(tree))
        try:
            base_module = importlib.import_module(BASE_MODULE)
            connector = getattr(importlib.import_module(CONNECTOR_MODULE), CONNECTOR)
            import vllm

            found = str(getattr(vllm, "__version__", version))
            if tree is not None and not str(Path(vllm.__file__ or "").resolve()).startswith(str(tree.resolve())):
                raise ImportError(f"vllm came from {vllm.__file__}, not {tree}")
            return check_imported(base_module, connector, found)
        except Exception as exc:  # any import-time failure of a foreign release: read its source
            if tree is None:
                raise
            why = f"importing the release failed ({type(exc).__name__}: {str(exc)[:300]}); its base was read with ast"
    if tree is None:
        raise ValueError("ast mode needs a tree")
    return check_sources((tree / BASE_FILE).read_text(), connector_source(), version, note=why)


# ============================================================================================
# Keeping a release's base module (CI caches it; the wheel itself is ~350 MB)
# ============================================================================================
def fetch(version: str, out: Path, *, python: str | None = None) -> Path:
    """Download vLLM ``version``'s wheel (no dependencies), keep only the Python files that
    importing its connector base module and this connector loads, plus the base module
    itself, in ``out``, with a VERSION file. The wheel is deleted again."""
    python = python or sys.executable
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        wheels = Path(tmp) / "wheels"
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                str(wheels),
                f"vllm=={version}",
            ],
            check=True,
        )
        (wheel,) = wheels.glob("vllm-*.whl")
        tree = Path(tmp) / "tree"
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    zf.extract(name, tree)
        wheel.unlink()
        probe = (
            "import json, sys, importlib\n"
            f"sys.path.insert(0, {str(tree)!r})\n"
            f"importlib.import_module({BASE_MODULE!r}); importlib.import_module({CONNECTOR_MODULE!r})\n"
            f"print(json.dumps(sorted(m.__file__ for m in list(sys.modules.values()) "
            f"if (getattr(m, '__file__', None) or '').startswith({str(tree)!r}))))\n"
        )
        ran = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False)
        keep = {tree / BASE_FILE, tree / "vllm" / "_version.py"}
        if ran.returncode == 0:
            keep |= {Path(p) for p in json.loads(ran.stdout.strip().splitlines()[-1])}
        if out.exists():
            shutil.rmtree(out)
        for path in keep:
            if path.is_file():
                dest = out / path.relative_to(tree)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)
        (out / "VERSION").write_text(version + "\n")
        if ran.returncode != 0:
            (out / "IMPORT_FAILED").write_text(ran.stderr[-4000:])
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["fetch"]:
        fp = argparse.ArgumentParser(prog="vllm_interface fetch", description="keep a vLLM release's base module")
        fp.add_argument("version")
        fp.add_argument("out", type=Path)
        f = fp.parse_args(args[1:])
        print(fetch(f.version, f.out))
        return 0
    parser = argparse.ArgumentParser(prog="vllm_interface", description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tree", type=Path, help="a vLLM release's kept Python files (fetch)")
    parser.add_argument("--ast", action="store_true", help="read the base's source instead of importing it")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    a = parser.parse_args(args)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the base's import logs nothing we need
    report = check(a.tree, use_ast=a.ast)
    if a.json:
        print(json.dumps(report.as_dict()))
    else:
        state = "fits" if not report.problems else f"does NOT fit ({len(report.problems)} problems)"
        print(f"vLLM {report.version} ({report.mode}): {CONNECTOR} {state}")
        for line in report.problems:
            print(f"  - {line}")
        if report.not_in_base:
            print(f"  defined here, not in this release's base: {', '.join(report.not_in_base)}")
        for key, value in report.hooks.items():
            print(f"  {key}: {value}")
        if report.note:
            print(f"  note: {report.note}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
