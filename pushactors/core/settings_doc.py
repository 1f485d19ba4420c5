"""A settings Struct described from its own fields: each field carries
``Meta(description=..., extra={"group": ..., "vllm_only": True})``, and this module turns that
into the class's help() text, a short signature, and the rows of docs/settings.md. Nothing about
one setting is written twice."""

from __future__ import annotations

import inspect
import json
import math
import textwrap
import typing
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
from msgspec import inspect as mi

_NOTHING = msgspec.NODEFAULT


class SettingsMeta(msgspec.StructMeta):
    """The metaclass of a settings Struct: its signature names each field with its plain type
    and default. msgspec's own prints every ``Annotated`` metadata, descriptions included, which
    made help() open with thousands of characters."""

    @property
    def __signature__(cls) -> inspect.Signature:
        hints = typing.get_type_hints(cls)  # Annotated stripped
        params = []
        for field in _fields(cls):
            default = inspect.Parameter.empty if field.required else _default_of(field)
            kind = inspect.Parameter.KEYWORD_ONLY
            params.append(inspect.Parameter(field.name, kind, default=default, annotation=hints[field.name]))
        return inspect.Signature(params)


@dataclass(frozen=True)
class Setting:
    """One field as a reader sees it."""

    name: str
    group: str  # "" when the field names none
    kind: str  # type and range, e.g. "float > 0"
    required: bool
    default: object  # the Python default (None when required)
    description: str
    vllm_only: bool

    @property
    def default_json(self) -> str:
        """The default as it is written in JSON (``kv_connector_extra_config``)."""
        return "required" if self.required else msgspec.json.encode(self.default).decode()

    @property
    def default_note(self) -> str:
        """A byte count's default in binary units ("1 GiB"); empty for anything else."""
        value = self.default
        if self.name.endswith("_bytes") and isinstance(value, int) and value >= 1024:
            return _binary(value)
        return ""


def settings_of(cls: type[msgspec.Struct]) -> list[Setting]:
    """Every field of ``cls``, in declaration order."""
    out = []
    for field in _fields(cls):
        kind = field.type
        description, extra = "", {}
        if isinstance(kind, mi.Metadata):
            description = str((kind.extra_json_schema or {}).get("description", ""))
            extra = dict(kind.extra or {})
            kind = kind.type
        out.append(
            Setting(
                name=field.name,
                group=str(extra.get("group", "")),
                kind=describe_type(kind),
                required=field.required,
                default=None if field.required else _default_of(field),
                description=description,
                vllm_only=bool(extra.get("vllm_only", False)),
            )
        )
    return out


def grouped(settings: list[Setting], groups: Mapping[str, str]) -> list[tuple[str, str, list[Setting]]]:
    """(group, title, its settings) in the order of ``groups``; settings naming no known group
    come last, under "Other"."""
    out = [(name, title, [s for s in settings if s.group == name]) for name, title in groups.items()]
    rest = [s for s in settings if s.group not in groups]
    if rest:
        out.append(("", "Other", rest))
    return [entry for entry in out if entry[2]]


def settings_text(cls: type[msgspec.Struct], groups: Mapping[str, str], width: int = 88) -> str:
    """The settings as plain text for a docstring: per group, each field's type, default and
    description."""
    lines: list[str] = []
    for _, title, members in grouped(settings_of(cls), groups):
        lines += ["", title, "-" * len(title)]
        for s in members:
            default = "required" if s.required else f"default {s.default!r}"
            lines.append(f"{s.name}: {s.kind}; {default}" + ("  [vLLM only]" if s.vllm_only else ""))
            lines += textwrap.wrap(s.description, width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def describe_type(kind: object) -> str:
    """A msgspec type as a reader writes it: ``float > 0``, ``int 0-64``, ``str or null``."""
    if isinstance(kind, mi.Metadata):
        return describe_type(kind.type)
    if isinstance(kind, mi.UnionType):
        parts = [describe_type(t) for t in kind.types if not isinstance(t, mi.NoneType)]
        nullable = any(isinstance(t, mi.NoneType) for t in kind.types)
        return " or ".join(parts + (["null"] if nullable else []))
    if isinstance(kind, mi.LiteralType):
        return "one of " + ", ".join(json.dumps(v) for v in kind.values)
    if isinstance(kind, (mi.IntType, mi.FloatType)):
        name = "int" if isinstance(kind, mi.IntType) else "float"
        if kind.ge is not None and kind.le is not None:
            return f"{name} {_number(kind.ge)}–{_number(kind.le)}"
        bounds = ((">", kind.gt), ("≥", kind.ge), ("<", kind.lt), ("≤", kind.le))
        named = ", ".join(f"{op} {_number(v)}" for op, v in bounds if v is not None)
        return f"{name} {named}" if named else name
    if isinstance(kind, mi.StrType):
        if kind.min_length is not None or kind.max_length is not None:
            return f"str, {kind.min_length or 0}–{kind.max_length} characters"
        return "str"
    if isinstance(kind, mi.BoolType):
        return "bool"
    if isinstance(kind, mi.NoneType):
        return "null"
    if isinstance(kind, (mi.VarTupleType, mi.ListType)):
        return f"list of {describe_type(kind.item_type)}"
    if isinstance(kind, mi.DictType):
        return f"object of {describe_type(kind.key_type)} → {describe_type(kind.value_type)}"
    return type(kind).__name__


def _fields(cls: type) -> tuple[mi.Field, ...]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


def _default_of(field: mi.Field) -> object:
    if field.default_factory is not _NOTHING:
        return field.default_factory()
    return field.default


def _number(value: float | None) -> str:
    """``1 << 44`` reads as 2^44; other numbers as written."""
    if isinstance(value, int) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{int(math.log2(value))}"
    return repr(value)


def _binary(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"
