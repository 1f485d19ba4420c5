"""The settings reference: every PushConfig field describes itself (``Meta(description=...)``) in
exactly one group; help(PushConfig) and docs/settings.md are built from that; and every settings
key the docs give is one the code accepts."""

from __future__ import annotations

import ast
import difflib
import inspect
import pydoc
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from pushactors.apps.settings import REGENERATE, settings_page
from pushactors.core.config import SETTING_GROUPS, ConfigError, PushConfig
from pushactors.core.settings_doc import settings_of

ROOT = Path(__file__).resolve().parent.parent
FIELDS = set(PushConfig.__struct_fields__)


# --- every field described, in one group ---------------------------------------------------------


def _group_metas(name: str) -> list[msgspec.Meta]:
    hint = typing.get_type_hints(PushConfig, include_extras=True)[name]
    metas = [m for m in typing.get_args(hint)[1:] if isinstance(m, msgspec.Meta)]
    return [m for m in metas if m.extra and "group" in m.extra]


def test_every_setting_has_a_description_and_exactly_one_known_group() -> None:
    problems = []
    for name in PushConfig.__struct_fields__:
        metas = _group_metas(name)
        if len(metas) != 1:
            problems.append(f"{name}: {len(metas)} group metadata (want exactly 1)")
            continue
        group = metas[0].extra["group"] if metas[0].extra else None
        if group not in SETTING_GROUPS:
            problems.append(f"{name}: group {group!r} is not one of {sorted(SETTING_GROUPS)}")
        if len(metas[0].description or "") < 20:
            problems.append(f"{name}: no description a reader can use ({metas[0].description!r})")
    assert not problems, "\n".join(problems)
    # Every group is used, so no heading of the page is empty.
    assert {s.group for s in settings_of(PushConfig)} == set(SETTING_GROUPS)


def test_settings_the_vllm_connector_alone_reads_are_marked_vllm_only() -> None:
    """A field read (as ``.name``) by the vLLM connector and by nothing a non-vLLM engine runs
    (core, transport, actors, engine) is marked vLLM only, and a marked one is such a field:
    elsewhere it would be accepted and silently do nothing."""

    def reads(paths: list[Path], name: str) -> bool:
        pattern = re.compile(rf"\.{name}\b")
        return any(pattern.search(p.read_text()) for p in paths)

    pkg = ROOT / "pushactors"
    below = [
        p
        for layer in ("protocol", "core", "transport", "actors", "engine")
        for p in (pkg / layer).rglob("*.py")
        if p.name not in ("config.py", "settings_doc.py")
    ]
    connector = [pkg / "integrations" / "vllm.py"]
    marked = {s.name for s in settings_of(PushConfig) if s.vllm_only}
    only_vllm = {name for name in FIELDS if reads(connector, name) and not reads(below, name)}
    assert marked == only_vllm, f"marked vLLM only: {sorted(marked)}; read by the connector alone: {sorted(only_vllm)}"
    assert {"kv_cache_layout", "debug_allow_noise", "log_json"} <= marked


# --- help() ---------------------------------------------------------------------------------------


def test_help_shows_every_setting_with_its_default_and_description() -> None:
    text = pydoc.render_doc(PushConfig, renderer=pydoc.plaintext)
    for s in settings_of(PushConfig):
        default = "required" if s.required else f"default {s.default!r}"
        assert f"{s.name}: {s.kind}; {default}" in text, s.name
        first_words = " ".join(s.description.split()[:6])
        assert first_words in text, f"{s.name}: description missing from help(): {first_words!r}"
    for _, title in SETTING_GROUPS.items():
        assert title in text
    assert "[vLLM only]" in text


def test_the_signature_names_types_and_defaults_not_metadata() -> None:
    """msgspec's own signature printed every Annotated metadata, descriptions included."""
    signature = str(inspect.signature(PushConfig))
    assert "Meta(" not in signature and "description" not in signature
    assert "lease_duration: float = 30.0" in signature
    assert signature.startswith("(*, engine_id: str, ")
    assert len(signature) < 3000, len(signature)


# --- docs/settings.md -----------------------------------------------------------------------------


def test_settings_page_is_generated_from_the_code() -> None:
    page = ROOT / "docs" / "settings.md"
    want = settings_page()
    have = page.read_text() if page.exists() else ""
    if have != want:
        diff = "".join(
            list(
                difflib.unified_diff(
                    have.splitlines(keepends=True), want.splitlines(keepends=True), "docs/settings.md", "code"
                )
            )[:60]
        )
        pytest.fail(f"docs/settings.md differs from PushConfig's descriptions; regenerate it: {REGENERATE}\n{diff}")


def test_settings_page_has_one_row_per_setting_in_its_group() -> None:
    page = settings_page()
    sections = re.split(r"^## ", page, flags=re.M)
    rows: dict[str, str] = {}
    for section in sections[1:]:
        title = section.splitlines()[0]
        for name in re.findall(r"^\| `(\w+)` \|", section, re.M):
            assert name not in rows, f"{name} in two tables"
            rows[name] = title
    assert set(rows) == FIELDS
    for s in settings_of(PushConfig):
        assert rows[s.name] == SETTING_GROUPS[s.group]
    assert "| `staging_chunk_bytes` | int ≥ 0, < 2^44 | `1073741824` (1 GiB) |" in page
    assert "| `engine_id` | str, 1–256 characters | required |" in page
    assert re.search(r"^\| `kv_cache_layout` \|.*\*\*vLLM only\.\*\*", page, re.M)


# --- every settings key the docs give is accepted -------------------------------------------------


@dataclass(frozen=True)
class DocKey:
    key: str
    where: str  # file:line
    form: str


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _balanced(text: str, start: int, open_: str, close: str) -> str:
    """The text from ``start`` (an ``open_``) through its matching ``close``, nested content
    blanked out so only the top level remains."""
    depth, out = 0, []
    for ch in text[start:]:
        if ch == open_:
            depth += 1
        elif ch == close:
            depth -= 1
        out.append(ch if depth <= 1 or ch in (open_, close) else " ")
        if depth == 0:
            break
    return "".join(out)


_IDENT = r"[a-z_][a-z0-9_]*"
_CONFIG_FLAG = re.compile(rf"--(?:[pd]-)?config\s+({_IDENT})=", re.I)
_JSON_OBJECT = re.compile(r"(?:kv_connector_extra_config\\?\"?\s*[:=]\s*|from_dict\()\{")
_JSON_KEY = re.compile(rf"\\?\"({_IDENT})\\?\"\s*:", re.I)
_CALL = re.compile(r"(?:\bPushConfig|\bconfig\.replace)\(")
_KEYWORD = re.compile(rf"(?<![\w.])({_IDENT})\s*=(?!=)")
_SETTING_COLUMNS = ("key", "setting", "setting (`pushconfig`)", "what to set")
_SPAN = re.compile(r"`([^`\n]+)`")
_SPAN_KEY = re.compile(rf"^(?:--[pd]-config\s+|--config\s+)?({_IDENT})(?:\s*=.*)?$")


def doc_keys(text: str, where: str) -> list[DocKey]:
    """The settings keys a page gives: ``--config KEY=VALUE`` (and ``--p-config``/``--d-config``),
    keys of ``kv_connector_extra_config`` and ``PushConfig.from_dict`` objects (JSON, YAML
    flow, shell-escaped), keywords of ``PushConfig(...)`` and ``config.replace(...)``, and
    the names in the setting column of tables headed "key", "setting" or "what to set"."""
    out: list[DocKey] = []
    for m in _CONFIG_FLAG.finditer(text):
        if m.group(1) != "KEY":
            out.append(DocKey(m.group(1), f"{where}:{_line(text, m.start())}", "--config"))
    for m in _JSON_OBJECT.finditer(text):
        body = _balanced(text, m.end() - 1, "{", "}")
        for k in _JSON_KEY.finditer(body):
            out.append(DocKey(k.group(1), f"{where}:{_line(text, m.end() + k.start())}", "JSON object"))
    for m in _CALL.finditer(text):
        body = _balanced(text, m.end() - 1, "(", ")")
        body = re.sub(r"\"[^\"]*\"|'[^']*'", '""', body)  # values, not keywords
        for k in _KEYWORD.finditer(body):
            out.append(DocKey(k.group(1), f"{where}:{_line(text, m.end() + k.start())}", "keyword"))
    lines = text.splitlines()
    column = None
    for n, line in enumerate(lines, 1):
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:
            heads = [c.lower() for c in cells]
            column = next((i for i, h in enumerate(heads) if h in _SETTING_COLUMNS), -1)
            continue
        if column < 0 or set(line) <= set("|-: ") or column >= len(cells):
            continue
        for span in _SPAN.findall(cells[column]):
            k = _SPAN_KEY.match(span)
            if k:
                out.append(DocKey(k.group(1), f"{where}:{n}", "table"))
    return out


def _vllm_connector_keys() -> set[str]:
    """The extra keys the vLLM connector takes besides PushConfig's fields, read from its
    source (importing it needs vLLM): its aliases of vLLM's names, vLLM's keys it ignores, and
    its own."""
    tree = ast.parse((ROOT / "pushactors" / "integrations" / "vllm.py").read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name) and target.id in ("_VLLM_ALIASES", "_IGNORED", "_CONNECTOR_KEYS"):
                    assert node.value is not None
                    found[target.id] = set(ast.literal_eval(node.value))
    assert set(found) == {"_VLLM_ALIASES", "_IGNORED", "_CONNECTOR_KEYS"}, f"vllm.py's key tables moved: {found}"
    return set().union(*found.values())


def _doc_pages() -> list[Path]:
    return [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]


def test_every_settings_key_the_docs_give_is_accepted() -> None:
    accepted = FIELDS | _vllm_connector_keys()
    found = [k for page in _doc_pages() for k in doc_keys(page.read_text(), str(page.relative_to(ROOT)))]
    unknown = [f"{k.where}: {k.key!r} ({k.form})" for k in found if k.key not in accepted]
    assert not unknown, (
        "settings keys in the docs that neither PushConfig nor the vLLM connector accepts:\n" + "\n".join(unknown)
    )
    # The scan reads what the docs hold: every form, and the keys of the main settings tables.
    forms = {k.form for k in found}
    assert forms == {"--config", "JSON object", "keyword", "table"}, forms
    keys = {k.key for k in found}
    assert {"staging_bytes", "side_channel_port", "kv_lease_duration", "nixl_num_threads", "trusted_peers"} <= keys
    # Each field named in docs/settings.md's tables is found there, so the page is scanned too.
    assert FIELDS <= {k.key for k in found if k.where.startswith("docs/settings.md")}


def test_every_documented_key_is_really_accepted_by_from_dict() -> None:
    """The names the doc scan accepts load: a field through PushConfig.from_dict with its own
    default, so "accepted" above is the decoder's word, not a name list's."""
    for s in settings_of(PushConfig):
        if s.required:
            continue
        loaded = PushConfig.from_dict({"engine_id": "e", s.name: msgspec.to_builtins(s.default)})
        assert getattr(loaded, s.name) == s.default, s.name
    with pytest.raises(ConfigError, match="unknown field"):
        PushConfig.from_dict({"engine_id": "e", "stagin_bytes": 1})


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("pushactors bench big --config stagin_bytes=2147483648", "--config"),
        ("bench layerwise [--d-config\npoll_interval_awiat=1e-5]", "--config"),
        ('"kv_connector_extra_config": {"side_channel_port": 5600, "lease_duraton": 3}', "JSON object"),
        ('\\"kv_connector_extra_config\\":{\\"lease_duraton\\":5600}}"', "JSON object"),
        ('PushConfig(engine_id="d-0", lease_duraton=30.0, trusted_peers=("x",))', "keyword"),
        ("| setting | default |\n|---|---|\n| `lease_duraton` | 30 s |", "table"),
        ("| key | default |\n|---|---|\n| `lease_duration` (`kv_lease_duraton`) | 30 s |", "table"),
    ],
)
def test_the_doc_scan_catches_a_misspelled_key(text: str, form: str) -> None:
    accepted = FIELDS | _vllm_connector_keys()
    found = doc_keys(text, "t.md")
    bad = [k for k in found if k.key not in accepted]
    assert len(bad) == 1 and bad[0].form == form, found
    assert bad[0].where.startswith("t.md:")
