"""Field types, limits and the validation helpers every message family shares."""

from __future__ import annotations

import re
from typing import Annotated

from msgspec import Meta

# --------------------------------------------------------------------------------------------
# Field types. Ids are joined with "," in heartbeats, so they may not contain one.
# --------------------------------------------------------------------------------------------
# Request ids travel in ASCII completions and heartbeats: printable ASCII without ",", and never
# beginning with a wire prefix, with or without what follows its colon: a completion is
# ``<id>:<tp>``, so an id "HB:x" — or just "HB", whose completion is "HB:1" — would read as a
# heartbeat. ``\Z``, not ``$``: ``$`` also matches before a trailing newline.
RESERVED_ID_PREFIXES = ("HB:", "HB@", "PUSH_REG:", "PUSH_FAIL:", "PUSH_ABORT:", "PUSH_DIGEST:", "PAMAC1:")
Generation = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # a registration's generation (0: none)
REQUEST_ID_PATTERN = r"^(?!HB@|(?:HB|PUSH_REG|PUSH_FAIL|PUSH_ABORT|PUSH_DIGEST|PAMAC1)(?::|\Z))[\x20-\x2b\x2d-\x7e]+\Z"
MAX_REQUEST_ID_CHARS = 1024
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern=REQUEST_ID_PATTERN)]
# The same rule, compiled once: D checks each completion's id on its pick-up path, and
# msgspec.convert(..., RequestId) costs three times this compiled search there.
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
EngineId = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f]+\Z")]
BlockId = Annotated[int, Meta(ge=0, lt=2**31)]
Port = Annotated[int, Meta(ge=0, le=65535)]
Size = Annotated[int, Meta(ge=1, le=1 << 16)]
Rank = Annotated[int, Meta(ge=0, lt=1 << 16)]
Host = Annotated[str, Meta(max_length=256)]
Reason = Annotated[str, Meta(max_length=4096)]
BlockGroups = tuple[tuple[int, ...], ...]

MAX_KV_GROUPS = 64
# Blocks × regions one remote rank may advertise: P builds descriptor arrays of that many rows
# (24 bytes each) on its writer, so a peer must not be able to ask for gigabytes.
MAX_DESCRIPTOR_ROWS = 1 << 23
MAX_BLOCKS_PER_GROUP = 1 << 22


class MalformedMessage(ValueError):
    """A wire message did not decode; ``kind`` names what it claimed to be."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"malformed {kind}: {reason}")
        self.kind = kind
        self.reason = reason


class HandshakeError(Exception):
    """A handshake payload was refused. ``kind`` is a short machine-readable cause."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def check_request_id(request_id: object) -> str:
    """Raise ValueError unless ``request_id`` can travel in completions and heartbeats (the
    rule of :data:`RequestId`, which decoding a message applies)."""
    if not isinstance(request_id, str):
        raise ValueError(f"request id {request_id!r} cannot be sent: not a str but {type(request_id).__name__}")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request id {request_id[:64]!r}... cannot be sent: over {MAX_REQUEST_ID_CHARS} characters")
    if _REQUEST_ID.search(request_id) is None:  # also refuses "" (one character at least)
        raise ValueError(f"request id {request_id!r} cannot be sent: printable ASCII without ',' and not a wire prefix")
    return request_id


def normalize_block_groups(value: object, *, freed_prefix: bool = False) -> BlockGroups:
    """A flat list of block ids is one KV-cache group; a list of lists is one per group.

    ``freed_prefix``: P's own blocks, where a group may open with one id repeated (vLLM's null
    block standing for blocks freed behind a sliding window: never read, never a destination).
    Any other repeat is refused: D's blocks never repeat."""
    if not isinstance(value, (list, tuple)):
        raise ValueError("block ids must be a list")
    if not value:
        return ((),)
    nested = [isinstance(v, (list, tuple)) for v in value]
    if all(nested):
        if len(value) > MAX_KV_GROUPS:
            raise ValueError(f"more than {MAX_KV_GROUPS} KV-cache groups")
        return tuple(_checked_ids(g, freed_prefix) for g in value)  # type: ignore[arg-type]
    if any(nested):
        raise ValueError("block ids mix a flat list with nested lists")
    return (_checked_ids(value, freed_prefix),)


def _checked_ids(ids: list[object] | tuple[object, ...], freed_prefix: bool = False) -> tuple[int, ...]:
    if len(ids) > MAX_BLOCKS_PER_GROUP:
        raise ValueError("too many block ids")
    out: list[int] = []
    for b in ids:
        # bool is an int subclass; a block id of True is a bug, not a block.
        if not isinstance(b, int) or isinstance(b, bool):
            raise ValueError(f"block id {b!r} is not an int")
        if b < 0 or b >= 2**31:
            raise ValueError(f"block id {b} out of range")
        out.append(b)
    held = out
    if freed_prefix and len(out) > 1 and out[0] == out[1]:
        lead = 1
        while lead < len(out) and out[lead] == out[0]:
            lead += 1
        held = out[lead - 1 :]
    if len(set(held)) != len(held):
        # Two positions of one request in one block: one of them would be overwritten.
        raise ValueError("block ids are duplicated")
    return tuple(out)
