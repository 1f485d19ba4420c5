"""docs/protocol.md is the protocol's reference, and stays in step with the code: every message
Struct of ``pushactors.protocol`` is named there, the field tables of the messages that cross
processes (wire, handshake, engine meta) list exactly the Structs' fields, types, defaults and
tags, and nothing in the repository cites a protocol document that is not in it."""

from __future__ import annotations

import inspect
import math
import re
import types
import typing
from pathlib import Path

import msgspec
import pytest

from pushactors.protocol import fields, handshake, mailbox, meta, wire

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "protocol.md"

# The messages whose bytes cross a process boundary: their field tables must be exact.
TABLED = (wire, handshake, meta)
ALL_MODULES = (wire, handshake, meta, mailbox)

# The shared field types of protocol/fields.py, shown by name (docs/protocol.md, "Field types").
ALIASES = {
    name: getattr(fields, name)
    for name in (
        "RequestId",
        "EngineId",
        "Generation",
        "BlockId",
        "BlockGroups",
        "Port",
        "Size",
        "Rank",
        "Host",
        "Reason",
    )
}

# What no file may contain: a citation of the private protocol notes this page replaced (their
# name is spelled in pieces so this file does not cite them itself), or a path outside the repo.
_NOTE = "SP" + "EC"
_SECTION = "\u00a7"  # the section sign
CITATIONS = [
    re.compile(rf"\b{_NOTE}\s*{_SECTION}"),  # the note's name and a section
    re.compile(rf"\b{_NOTE}\.md\b"),
    re.compile(rf"{_SECTION}\s*\d"),  # a bare section sign with a number
    re.compile(r"(?:\.\./|/work/)shared/"),
    re.compile("push-mode-" + "design"),
]
# In prose (not Python, where SPEC is also a test's variable name) the bare name is a citation too.
PROSE_CITATION = re.compile(rf"\b{_NOTE}\b")
SCANNED_DIRS = ("pushactors", "tests", "docs", "examples", "bench", ".ci")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".txt", ".sh", ".yml", ".yaml", ".json", ".ini", ""}
SKIPPED_PARTS = {"__pycache__", ".venv", ".venv-vllm", "runs", "build", "dist", ".mypy_cache", ".ruff_cache"}


def _repo_files() -> list[Path]:
    files = [p for p in ROOT.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES and not p.name.startswith(".")]
    for top in SCANNED_DIRS:
        for path in (ROOT / top).rglob("*"):
            rel = path.relative_to(ROOT).parts
            if path.is_file() and path.suffix in TEXT_SUFFIXES and not SKIPPED_PARTS & set(rel):
                if not any(part.endswith(".egg-info") for part in rel):
                    files.append(path)
    return sorted(files)


def citations(path: Path, text: str) -> list[str]:
    """Lines of ``text`` (the file at ``path``) that cite a document outside the repository."""
    rules = CITATIONS if path.suffix == ".py" else [*CITATIONS, PROSE_CITATION]
    return [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
        for n, line in enumerate(text.splitlines(), 1)
        if any(rule.search(line) for rule in rules)
    ]


def test_no_file_cites_a_protocol_document_outside_the_repository() -> None:
    files = _repo_files()
    assert DOC in files and Path(__file__).resolve() in files, "the scan must cover docs/ and tests/"
    found = [hit for path in files for hit in citations(path, path.read_text(errors="replace"))]
    assert not found, "cite docs/protocol.md instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        f"# pairs them ({_NOTE} {_SECTION}3)",
        f"The behaviour follows {_NOTE}.md",
        f"see {_SECTION}7 for the table",
        ".." + "/shared/notes say",
    ],
)
def test_the_citation_check_catches_each_form(line: str) -> None:
    assert citations(ROOT / "x.py", line)


def test_the_citation_check_leaves_code_names_alone() -> None:
    assert not citations(ROOT / "x.py", f"{_NOTE} = SimSpec(num_layers=2)\nn = {_NOTE}.block_size")
    assert citations(ROOT / "x.md", f"The behaviour follows {_NOTE}")


# --- every message Struct is named, and the cross-process ones are tabled exactly ------------------
def _structs(module: types.ModuleType) -> list[type[msgspec.Struct]]:
    return [
        obj
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__
    ]


def _number(v: float) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    if isinstance(v, int) and v >= 1024:
        for k in range(10, 65):
            if v == 1 << k:
                return f"2^{k}"
            if v == (1 << k) - 1:
                return f"2^{k}-1"
    return repr(v)


def _constraints(m: msgspec.Meta) -> str:
    parts = []
    for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
        v = getattr(m, attr)
        if v is not None:
            parts.append(f"{sign} {_number(v)}")
    if m.min_length is not None:
        parts.append(f"len ≥ {m.min_length}")
    if m.max_length is not None:
        parts.append(f"len ≤ {_number(m.max_length)}")
    if m.pattern is not None:
        parts.append("pattern")
    return ", ".join(parts)


def render_type(tp: object, named: tuple[str, ...] = ()) -> str:
    """A field's type as docs/protocol.md writes it: the shared field types in ``named`` (those
    the code's annotation spells by name) by name, anything else with its limits."""
    for name in named:
        if tp == ALIASES[name]:
            return name
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        base, *metas = args
        limits = "; ".join(_constraints(m) for m in metas if isinstance(m, msgspec.Meta))
        return f"{render_type(base, named)} ({limits})" if limits else render_type(base, named)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(render_type(a, named) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (tuple, list, dict):
        inner = ", ".join("..." if a is Ellipsis else render_type(a, named) for a in args)
        return f"{origin.__name__}[{inner}]"
    if tp is type(None):
        return "None"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


def _annotation(cls: type, field: str) -> str:
    """The annotation of ``field`` as the code spells it."""
    for klass in cls.__mro__:
        source = inspect.get_annotations(klass).get(field)
        if source is not None:
            return str(source)
    return ""


def field_type(cls: type[msgspec.Struct], field: msgspec.structs.FieldInfo) -> str:
    # Equal types are not always one named type (a region's address has Generation's limits),
    # so a shared type is named only where the code names it.
    source = _annotation(cls, field.name)
    return render_type(field.type, tuple(n for n in ALIASES if re.search(rf"\b{n}\b", source)))


def render_default(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    return (
        _number(field.default)
        if isinstance(field.default, (int, float)) and not isinstance(field.default, bool)
        else repr(field.default)
    )


def _cells(row: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _unquote(cell: str) -> str:
    return cell[1:-1] if len(cell) >= 2 and cell[0] == cell[-1] == "`" else cell


def _section(doc: str, name: str) -> tuple[str, list[str]]:
    """The heading line of ``name``'s field table and the table's rows (header rows dropped)."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"#### `{name}`")), None)
    assert start is not None, f"docs/protocol.md has no '#### `{name}`' heading"
    rows: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line)
    return lines[start], rows[2:]


def expected_rows(cls: type[msgspec.Struct]) -> list[tuple[str, str, str]]:
    return [(f.name, field_type(cls, f), render_default(f)) for f in msgspec.structs.fields(cls)]


@pytest.mark.parametrize("cls", [c for m in TABLED for c in _structs(m)], ids=lambda c: c.__name__)
def test_the_field_table_of_each_cross_process_message_is_exact(cls: type[msgspec.Struct]) -> None:
    heading, rows = _section(DOC.read_text(), cls.__name__)
    tag = cls.__struct_config__.tag
    if tag is not None:
        assert f"tag `{tag}`" in heading, f"{heading!r} should name tag `{tag}`"
    documented = [tuple(_unquote(c) for c in _cells(r)[:3]) for r in rows]
    want = expected_rows(cls)
    table = "\n".join(f"| `{n}` | `{t.replace('|', chr(92) + '|')}` | `{d}` | ... |" for n, t, d in want)
    assert documented == want, f"docs/protocol.md's table of {cls.__name__} is out of step; its fields:\n{table}"


@pytest.mark.parametrize("cls", [c for m in ALL_MODULES for c in _structs(m)], ids=lambda c: c.__name__)
def test_every_protocol_struct_is_named_in_the_doc(cls: type[msgspec.Struct]) -> None:
    assert f"`{cls.__name__}`" in DOC.read_text(), f"docs/protocol.md does not name {cls.__name__}"


def test_the_struct_scan_sees_the_protocol() -> None:
    """The checks above cover what they claim: the scan finds the known messages."""
    names = {c.__name__ for m in ALL_MODULES for c in _structs(m)}
    assert {"Registration", "Completion", "AgentInfo", "PushConnectorMeta", "PostPush", "Scatter"} <= names
    slot = next(f for f in msgspec.structs.fields(wire.Registration) if f.name == "staging_slot")
    assert field_type(wire.Registration, slot).endswith("| None")


def test_the_doc_is_linked_from_the_readme_and_the_architecture() -> None:
    for page in (ROOT / "README.md", ROOT / "docs" / "architecture.md"):
        assert "protocol.md" in page.read_text(), f"{page.name} does not link docs/protocol.md"
