"""The package's layers import only downward, and core's, protocol's and the actors' modules
form no import cycle, not even through imports made only for the type checker; inside the
writer's package, too, modules import only downward (docs/architecture.md, "Layout"). Read from
the source, exactly: no module is imported."""

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


def _imports(*, type_checking: bool = False) -> dict[str, set[str]]:
    """Each module's pushactors imports (relative ones); those under ``if TYPE_CHECKING`` only
    with ``type_checking``."""
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
            if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
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
    """Imports made only for the type checker included: a lower layer never names a higher
    one's types (a mailbox message carries a higher layer's value as ``object``, and its reader
    checks it)."""
    upward = sorted(
        (m, t)
        for m, targets in _imports(type_checking=True).items()
        for t in targets
        if RANK[_layer(m)] < RANK[_layer(t)] and (m, t) not in ALLOWED_UP
    )
    assert upward == [], upward


def test_core_protocol_and_actor_modules_import_no_cycle() -> None:
    graph = {m: {t for t in ts if _layer(t) == _layer(m)} for m, ts in _imports(type_checking=True).items()}
    for layer in ("core", "protocol", "actors"):
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


WRITER = "pushactors.actors.writer"


def _writer_tier(module: str) -> int:
    """The writer's package, lowest first: its plain parts (NIXL calls, links, notifications);
    push/'s book, outcomes and posting surface; the push modes; the pusher that applies what
    they return; the actor."""
    name = module.removeprefix(WRITER + ".")
    if name == "actor":
        return 4
    if name == "push.pusher":
        return 3
    if name in ("push.direct", "push.staged", "push.layered"):
        return 2
    return 1 if name.startswith("push") else 0


def test_the_writers_modules_import_only_downward() -> None:
    """A push mode never imports the pusher or another mode (it returns what its post came to);
    nothing below push/ imports it, and nothing in the package imports the actor."""
    inside = WRITER + "."
    upward = sorted(
        (m, t)
        for m, targets in _imports(type_checking=True).items()
        if m.startswith(inside)
        for t in targets
        if t.startswith(inside)
        and not (_writer_tier(t) < _writer_tier(m) or (_writer_tier(t) == _writer_tier(m) and _writer_tier(m) <= 1))
    )
    assert upward == [], upward
