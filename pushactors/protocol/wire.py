"""Wire: NIXL notifications (docs/protocol.md, 'Wire formats') — registration, completion, heartbeat, push failure,
abort, push digest — and their size limits. Decoding is validation: bad input raises MalformedMessage.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from .fields import (
    MAX_KV_GROUPS,
    BlockGroups,
    BlockId,
    EngineId,
    Generation,
    Host,
    MalformedMessage,
    Port,
    Rank,
    Reason,
    RequestId,
    Size,
    check_request_id,
    normalize_block_groups,
)

# ============================================================================================
# Wire: NIXL notifications (docs/protocol.md, 'Wire formats')
# ============================================================================================
PUSH_REG_PREFIX = b"PUSH_REG:"
HEARTBEAT_PREFIX = b"HB:"
# A heartbeat with D's promise: ``HB@<deadline>:`` + ids, the deadline on D's clock.
HEARTBEAT_DEADLINE_PREFIX = b"HB@"
PUSH_FAIL_PREFIX = b"PUSH_FAIL:"
ABORT_PREFIX = b"PUSH_ABORT:"
PUSH_DIGEST_PREFIX = b"PUSH_DIGEST:"
# Hard caps per kind (bytes); a registration's own limit is derived from the receiver's
# capacity (see ``registration_limit``) and never exceeds its cap.
MAX_NOTIF_BYTES = 1 << 22
MAX_CONTROL_NOTIF_BYTES = 16 * 1024  # completion, push failure, abort
MAX_HEARTBEAT_NOTIF_BYTES = 64 * 1024
# Chunks of D's regions a completion's digest names (each its own sum: a mismatch names its
# layers); 64 × 34 characters at most.
MAX_DIGEST_CHUNKS = 64


def registration_limit(capacity_blocks: int, groups: int = 1) -> int:
    """Largest PUSH_REG worth decoding for a receiver holding ``capacity_blocks`` logical blocks
    per group: a registration never lists more blocks than P holds for the request."""
    return min(MAX_NOTIF_BYTES, 4096 + 5 * max(1, groups) * max(1, capacity_blocks))


class Registration(Struct, frozen=True, kw_only=True, tag="push_reg"):
    """D → P: D's pre-allocated blocks for one request, from one D rank."""

    request_id: RequestId
    decode_engine_id: EngineId
    decode_host: Host
    decode_port: Port
    decode_tp_size: Size
    # The D rank that sent it: P writes into a D rank only after that rank registered.
    decode_tp_rank: Rank = 0
    local_block_ids: tuple[Union[BlockId, tuple[BlockId, ...]], ...]
    remote_engine_id: EngineId
    remote_host: Host
    remote_port: Port
    remote_tp_size: Size
    remote_pp_size: Size = 1
    transfer_id: Union[RequestId, None] = None
    # P's request id when D knows it (sequential legs); a matching hint, never required.
    remote_request_id: Union[RequestId, None] = None
    # Per KV group, D's blocks before the registered ones (its prefix hit). P aligns tokens
    # with it when the two block sizes differ; empty: the registered blocks are the last.
    skip_blocks: Annotated[tuple[BlockId, ...], Meta(max_length=MAX_KV_GROUPS)] = ()
    # D's pipeline rank and size: PP on D is not supported, so P refuses anything but 0 of 1.
    decode_pp_rank: Rank = 0
    decode_pp_size: Size = 1
    # (offset, bytes) of a slot in D's advertised staging buffer: every P source WRITEs its
    # parts into D's image there, and D copies the image into its blocks (a staged push).
    staging_slot: Union[tuple[Annotated[int, Meta(ge=0, lt=2**48)], Annotated[int, Meta(ge=1, lt=2**48)]], None] = None
    # Which registration this is: minted by the D rank for every staging and re-stage (its
    # incarnation in the high 32 bits, a counter below). Every answer names it, and D lands or
    # fails a request only on an answer naming its live generation (0: none, legacy peers).
    generation: Generation = 0
    # D's own deadline for it (D's monotonic clock, the one its handshake samples): D keeps the
    # blocks for P until then, and later only on P's word. P refuses to write past it, by its
    # estimate of D's clock (0: none given, P judges by arrival).
    deadline: Annotated[float, Meta(ge=0)] = 0.0
    # D asks for a digest of the bytes P writes for it, sent with the completion; D checks it
    # against the bytes it will read once they landed ("Verified push"). A P that predates
    # it ignores the field and sends none.
    verify: bool = False

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "local_block_ids", normalize_block_groups(self.local_block_ids))
        if self.decode_tp_rank >= self.decode_tp_size:
            raise ValueError("decode_tp_rank must be below decode_tp_size")
        if self.decode_pp_rank >= self.decode_pp_size:
            raise ValueError("decode_pp_rank must be below decode_pp_size")
        if self.skip_blocks and len(self.skip_blocks) != len(self.local_block_ids):
            raise ValueError("skip_blocks needs one count per KV group")

    @property
    def block_groups(self) -> BlockGroups:
        """D's block ids, one tuple per KV cache group."""
        return self.local_block_ids  # type: ignore[return-value]

    @property
    def num_blocks(self) -> int:
        """D's blocks over every KV cache group."""
        return sum(len(g) for g in self.block_groups)

    def header(self) -> RegistrationHeader:
        """Its routing fields (what P verifies the sender against)."""
        return RegistrationHeader(
            request_id=self.request_id,
            decode_engine_id=self.decode_engine_id,
            decode_host=self.decode_host,
            decode_port=self.decode_port,
            decode_tp_size=self.decode_tp_size,
            decode_tp_rank=self.decode_tp_rank,
        )


class RegistrationHeader(Struct, frozen=True, kw_only=True, tag="push_reg"):
    """The routing fields of a :class:`Registration`, decoded without its block ids.

    P verifies who sent a registration from these alone (cheap whatever the size), and decodes
    the block ids off the writer only once the sender is known to be the D rank it names."""

    request_id: RequestId
    decode_engine_id: EngineId
    decode_host: Host
    decode_port: Port
    decode_tp_size: Size
    decode_tp_rank: Rank = 0

    def __post_init__(self) -> None:
        if self.decode_tp_rank >= self.decode_tp_size:
            raise ValueError("decode_tp_rank must be below decode_tp_size")


class Completion(Struct, frozen=True, tag="completion"):
    """P → D, attached to a WRITE: ASCII ``<D_request_id>:<P_tp_size>``, then ``:g<hex>``, the
    generation of the registration it answers (absent for generation 0), then, when the
    registration asked for a digest (``verify``), ``:v`` and the digest of the bytes written,
    or ``:vf``: the digest follows in a :class:`PushDigest` (P digests while the WRITE flies)."""

    request_id: str
    tp_size: int
    generation: int = 0
    # Per chunk of D's regions: (digest mod 2^64, bytes covered) of what this P rank wrote
    # there ("Verified push"); empty: none asked for, none computed, or it follows.
    digest: tuple[tuple[int, int], ...] = ()
    digest_follows: bool = False


DigestSum = Annotated[int, Meta(ge=0)]  # below 2^64: msgpack carries no larger integer
DigestBytes = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class PushDigest(Struct, frozen=True, kw_only=True, tag="push_digest"):
    """P → D, after a WRITE whose completion said ``:vf``: the digest of the bytes that WRITE
    carried, per chunk of D's regions. D lands the request only once it has every expected
    rank's completion and digest and they match its blocks."""

    request_id: RequestId
    generation: Generation = 0  # of the registration it answers
    tp_rank: Rank = 0
    pp_rank: Rank = 0
    digest: Annotated[tuple[tuple[DigestSum, DigestBytes], ...], Meta(max_length=MAX_DIGEST_CHUNKS)] = ()


class Heartbeat(Struct, frozen=True, tag="heartbeat"):
    """D → P: ``HB:`` + comma-joined P request ids or transfer ids still awaited, or
    ``HB@<deadline>:`` + ids: D keeps the blocks of those registrations until ``deadline``
    (D's clock)."""

    ids: tuple[str, ...]
    deadline: float = 0.0


class PushFailure(Struct, frozen=True, kw_only=True, tag="push_fail"):
    """P → D: P will not or could not write; D counts it in place of the completion."""

    request_id: RequestId
    reason: Reason = ""
    tp_rank: Rank = 0
    pp_rank: Rank = 0
    generation: Generation = 0  # of the registration it answers
    # False: not an answer yet. P could not cancel a WRITE D aborted; it may still land, so D
    # keeps the blocks until a final answer (or P's disconnect is certain).
    final: bool = True


class Abort(Struct, frozen=True, kw_only=True, tag="push_abort"):
    """D → P: D gave up on a request; P may drop its lease and must not write."""

    request_id: RequestId
    transfer_id: Union[RequestId, None] = None
    remote_request_id: Union[RequestId, None] = None
    decode_tp_rank: Rank = 0
    reason: Reason = ""
    generation: Generation = 0  # of the registration D gives up (P cancels only that one)


Notification = Union[Registration, Completion, Heartbeat, PushFailure, Abort, PushDigest]

_reg_decoder = msgspec.msgpack.Decoder(Registration)
_reg_header_decoder = msgspec.msgpack.Decoder(RegistrationHeader)
_fail_decoder = msgspec.msgpack.Decoder(PushFailure)
_abort_decoder = msgspec.msgpack.Decoder(Abort)
_digest_decoder = msgspec.msgpack.Decoder(PushDigest)
_encoder = msgspec.msgpack.Encoder()


def encode_registration(reg: Registration) -> bytes:
    return PUSH_REG_PREFIX + _encoder.encode(reg)


def encode_completion(
    d_request_id: str,
    p_tp_size: int,
    generation: int = 0,
    digest: tuple[tuple[int, int], ...] = (),
    *,
    digest_follows: bool = False,
) -> bytes:
    text = f"{d_request_id}:{p_tp_size}:g{generation:x}" if generation else f"{d_request_id}:{p_tp_size}"
    if digest_follows:
        text += ":vf"
    elif digest:
        # ``:v`` + chunks joined by ``.``, each ``<digest hex>-<bytes hex>``.
        text += ":v" + ".".join(f"{d:x}-{n:x}" for d, n in digest)
    return text.encode()


def encode_push_digest(msg: PushDigest) -> bytes:
    return PUSH_DIGEST_PREFIX + _encoder.encode(msg)


def encode_heartbeat(ids: list[str] | tuple[str, ...], deadline: float = 0.0) -> bytes:
    body = ",".join(ids).encode()
    if deadline > 0:
        return HEARTBEAT_DEADLINE_PREFIX + repr(float(deadline)).encode() + b":" + body
    return HEARTBEAT_PREFIX + body


def encode_push_failure(msg: PushFailure) -> bytes:
    return PUSH_FAIL_PREFIX + _encoder.encode(msg)


def encode_abort(msg: Abort) -> bytes:
    return ABORT_PREFIX + _encoder.encode(msg)


def notification_kind(raw: bytes) -> str:
    """The kind a raw notification claims to be, from its prefix alone (for counters)."""
    if raw.startswith(PUSH_REG_PREFIX):
        return "push_reg"
    if raw.startswith((HEARTBEAT_PREFIX, HEARTBEAT_DEADLINE_PREFIX)):
        return "heartbeat"
    if raw.startswith(PUSH_FAIL_PREFIX):
        return "push_fail"
    if raw.startswith(ABORT_PREFIX):
        return "push_abort"
    if raw.startswith(PUSH_DIGEST_PREFIX):
        return "push_digest"
    return "completion"


def decode_registration(body: bytes) -> Registration:
    """Decode a registration's msgpack body (after ``PUSH_REG:``): MalformedMessage if bad."""
    try:
        return _reg_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise MalformedMessage("push_reg", str(exc)) from None


def decode_registration_header(raw: bytes, *, registration_bytes: int = MAX_NOTIF_BYTES) -> RegistrationHeader:
    """The routing fields of a whole ``PUSH_REG:`` notification, size-checked first."""
    limit = notification_limit("push_reg", registration_bytes)
    if len(raw) > limit:
        raise MalformedMessage("push_reg", f"{len(raw)} bytes is over the limit of {limit}")
    try:
        return _reg_header_decoder.decode(raw[len(PUSH_REG_PREFIX) :])
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise MalformedMessage("push_reg", str(exc)) from None


def notification_limit(kind: str, registration_bytes: int = MAX_NOTIF_BYTES) -> int:
    if kind == "push_reg":
        return min(registration_bytes, MAX_NOTIF_BYTES)
    if kind == "heartbeat":
        return MAX_HEARTBEAT_NOTIF_BYTES
    return MAX_CONTROL_NOTIF_BYTES


def decode_notification(raw: bytes, *, registration_bytes: int = MAX_NOTIF_BYTES) -> Notification:
    """Decode one NIXL notification; raise :class:`MalformedMessage` if it does not fit.

    Sizes are checked before anything is decoded: a registration may be at most
    ``registration_bytes`` (derived from the receiver's capacity), other kinds have small caps."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise MalformedMessage("notification", f"not bytes but {type(raw).__name__}")
    raw = bytes(raw)
    kind = notification_kind(raw)
    limit = notification_limit(kind, registration_bytes)
    if len(raw) > limit:
        raise MalformedMessage(kind, f"{len(raw)} bytes is over the limit of {limit}")
    try:
        if kind == "push_reg":
            return _reg_decoder.decode(raw[len(PUSH_REG_PREFIX) :])
        if kind == "push_fail":
            return _fail_decoder.decode(raw[len(PUSH_FAIL_PREFIX) :])
        if kind == "push_abort":
            return _abort_decoder.decode(raw[len(ABORT_PREFIX) :])
        if kind == "push_digest":
            return _digest_decoder.decode(raw[len(PUSH_DIGEST_PREFIX) :])
        if kind == "heartbeat":
            if raw.startswith(HEARTBEAT_DEADLINE_PREFIX):
                stamp, sep, body = raw[len(HEARTBEAT_DEADLINE_PREFIX) :].partition(b":")
                deadline = float(stamp.decode("ascii")) if sep and len(stamp) <= 32 else -1.0
                if not 0 < deadline < 1e15:
                    raise MalformedMessage("heartbeat", "bad deadline")
                return msgspec.structs.replace(_decode_heartbeat(body), deadline=deadline)
            return _decode_heartbeat(raw[len(HEARTBEAT_PREFIX) :])
        return _decode_completion(raw)
    except MalformedMessage:
        raise
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, RecursionError) as exc:
        raise MalformedMessage(kind, str(exc)) from None


def _decode_heartbeat(body: bytes) -> Heartbeat:
    text = body.decode("ascii")
    ids = tuple(i for i in text.split(",") if i)
    if not ids:
        raise MalformedMessage("heartbeat", "no ids")
    if any(len(i) > 1024 for i in ids):
        raise MalformedMessage("heartbeat", "id too long")
    return Heartbeat(ids)


def _decode_completion(raw: bytes) -> Completion:
    text = raw.decode("ascii")
    generation = 0
    digest: tuple[tuple[int, int], ...] = ()
    follows = False
    head, sep, last = text.rpartition(":")
    if sep and last == "vf":
        follows, text = True, head  # no digest chunk is "f" (each has a "-")
    elif sep and last.startswith("v"):
        # A tp size is all digits and a generation starts with "g": "v" is the digest.
        digest, text = _decode_digest(last[1:]), head
    head, sep, last = text.rpartition(":")
    if sep and last.startswith("g"):
        # A tp size is all digits, so a last field starting with "g" is the generation.
        digits = last[1:]
        if not 0 < len(digits) <= 16 or digits.strip("0123456789abcdef") or int(digits, 16) >= 1 << 63:
            raise MalformedMessage("completion", f"bad generation {last[:20]!r}")
        generation, text = int(digits, 16), head
    rid, sep, tp = text.rpartition(":")
    if not sep or not rid:
        raise MalformedMessage("completion", "expected <request_id>:<tp_size>")
    if not tp.isdigit() or not 1 <= int(tp) <= 1 << 16:
        raise MalformedMessage("completion", f"bad tp size {tp!r}")
    try:
        check_request_id(rid)
    except ValueError:
        raise MalformedMessage("completion", "bad request id") from None
    return Completion(rid, int(tp), generation, digest, follows)


def _decode_digest(text: str) -> tuple[tuple[int, int], ...]:
    chunks = text.split(".")
    if not 0 < len(chunks) <= MAX_DIGEST_CHUNKS:
        raise MalformedMessage("completion", f"a digest of {len(chunks)} chunks")
    out: list[tuple[int, int]] = []
    for chunk in chunks:
        value, sep, nbytes = chunk.partition("-")
        if not sep or not _hex(value, 16) or not _hex(nbytes, 15):
            raise MalformedMessage("completion", f"bad digest chunk {chunk[:40]!r}")
        out.append((int(value, 16), int(nbytes, 16)))
    return tuple(out)


def _hex(text: str, digits: int) -> bool:
    return 0 < len(text) <= digits and not text.strip("0123456789abcdef")
