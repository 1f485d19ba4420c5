"""The whole pushactors message protocol.

Three families of messages live here, all msgspec tagged, frozen Structs:

* **wire** messages that cross processes as NIXL notifications (registration, completion,
  heartbeat, push failure, abort) and the side-channel handshake payload;
* the **engine meta** the scheduler hands its workers each step;
* **mailbox** messages between the actors of one rank.

Decoding is validation: anything that does not fit its schema raises
:class:`MalformedMessage` (or :class:`HandshakeError`) with a reason, and callers count and
drop it. Nothing here raises anything else for bad input.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 1

# --------------------------------------------------------------------------------------------
# Field types. Ids are joined with "," in heartbeats, so they may not contain one.
# --------------------------------------------------------------------------------------------
# Request ids travel in ASCII completions and heartbeats: printable ASCII without ",", and never
# beginning with a wire prefix (a completion is ``<id>:<tp>``, so an id "HB:x" would read as a
# heartbeat). ``\Z``, not ``$``: ``$`` also matches before a trailing newline.
RESERVED_ID_PREFIXES = ("HB:", "PUSH_REG:", "PUSH_FAIL:", "PUSH_ABORT:", "PAMAC1:")
RequestId = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=1024,
        pattern=r"^(?!HB:|PUSH_REG:|PUSH_FAIL:|PUSH_ABORT:|PAMAC1:)[\x20-\x2b\x2d-\x7e]+\Z",
    ),
]
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
    """Raise ValueError unless ``request_id`` can travel in completions and heartbeats."""
    try:
        return msgspec.convert(request_id, RequestId)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise ValueError(f"request id {request_id!r} cannot be sent: {exc}") from None


def normalize_block_groups(value: object) -> BlockGroups:
    """A flat list of block ids is one KV-cache group; a list of lists is one per group."""
    if not isinstance(value, (list, tuple)):
        raise ValueError("block ids must be a list")
    if not value:
        return ((),)
    nested = [isinstance(v, (list, tuple)) for v in value]
    if all(nested):
        if len(value) > MAX_KV_GROUPS:
            raise ValueError(f"more than {MAX_KV_GROUPS} KV-cache groups")
        return tuple(_checked_ids(g) for g in value)  # type: ignore[arg-type]
    if any(nested):
        raise ValueError("block ids mix a flat list with nested lists")
    return (_checked_ids(value),)


def _checked_ids(ids: list[object] | tuple[object, ...]) -> tuple[int, ...]:
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
    if len(set(out)) != len(out):
        # Two positions of one request in one block: one of them would be overwritten.
        raise ValueError("block ids are duplicated")
    return tuple(out)


# ============================================================================================
# Wire: NIXL notifications (SPEC §2)
# ============================================================================================
PUSH_REG_PREFIX = b"PUSH_REG:"
HEARTBEAT_PREFIX = b"HB:"
PUSH_FAIL_PREFIX = b"PUSH_FAIL:"
ABORT_PREFIX = b"PUSH_ABORT:"
# Hard caps per kind (bytes); a registration's own limit is derived from the receiver's
# capacity (see ``registration_limit``) and never exceeds its cap.
MAX_NOTIF_BYTES = 1 << 22
MAX_CONTROL_NOTIF_BYTES = 16 * 1024  # completion, push failure, abort
MAX_HEARTBEAT_NOTIF_BYTES = 64 * 1024


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

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "local_block_ids", normalize_block_groups(self.local_block_ids))
        if self.decode_tp_rank >= self.decode_tp_size:
            raise ValueError("decode_tp_rank must be below decode_tp_size")

    @property
    def block_groups(self) -> BlockGroups:
        return self.local_block_ids  # type: ignore[return-value]

    @property
    def num_blocks(self) -> int:
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
    """P → D, attached to a WRITE: ASCII ``<D_request_id>:<P_tp_size>``."""

    request_id: str
    tp_size: int


class Heartbeat(Struct, frozen=True, tag="heartbeat"):
    """D → P: ``HB:`` + comma-joined P request ids or transfer ids still awaited."""

    ids: tuple[str, ...]


class PushFailure(Struct, frozen=True, kw_only=True, tag="push_fail"):
    """P → D: P will not or could not write; D counts it in place of the completion."""

    request_id: RequestId
    reason: Reason = ""
    tp_rank: Rank = 0
    pp_rank: Rank = 0
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


Notification = Union[Registration, Completion, Heartbeat, PushFailure, Abort]

_reg_decoder = msgspec.msgpack.Decoder(Registration)
_reg_header_decoder = msgspec.msgpack.Decoder(RegistrationHeader)
_fail_decoder = msgspec.msgpack.Decoder(PushFailure)
_abort_decoder = msgspec.msgpack.Decoder(Abort)
_encoder = msgspec.msgpack.Encoder()


def encode_registration(reg: Registration) -> bytes:
    return PUSH_REG_PREFIX + _encoder.encode(reg)


def encode_completion(d_request_id: str, p_tp_size: int) -> bytes:
    return f"{d_request_id}:{p_tp_size}".encode()


def encode_heartbeat(ids: list[str] | tuple[str, ...]) -> bytes:
    return HEARTBEAT_PREFIX + ",".join(ids).encode()


def encode_push_failure(msg: PushFailure) -> bytes:
    return PUSH_FAIL_PREFIX + _encoder.encode(msg)


def encode_abort(msg: Abort) -> bytes:
    return ABORT_PREFIX + _encoder.encode(msg)


def notification_kind(raw: bytes) -> str:
    """The kind a raw notification claims to be, from its prefix alone (for counters)."""
    if raw.startswith(PUSH_REG_PREFIX):
        return "push_reg"
    if raw.startswith(HEARTBEAT_PREFIX):
        return "heartbeat"
    if raw.startswith(PUSH_FAIL_PREFIX):
        return "push_fail"
    if raw.startswith(ABORT_PREFIX):
        return "push_abort"
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
        if kind == "heartbeat":
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
    rid, sep, tp = text.rpartition(":")
    if not sep or not rid:
        raise MalformedMessage("completion", "expected <request_id>:<tp_size>")
    if not tp.isdigit() or not 1 <= int(tp) <= 1 << 16:
        raise MalformedMessage("completion", f"bad tp size {tp!r}")
    try:
        check_request_id(rid)
    except ValueError:
        raise MalformedMessage("completion", "bad request id") from None
    return Completion(rid, int(tp))


# ============================================================================================
# Wire: side-channel handshake (SPEC §2)
# ============================================================================================
MemType = Literal["DRAM", "VRAM"]


class ClockSample(Struct, frozen=True, tag="clock"):
    """One reading of a process's clocks, for rebasing deadlines across processes."""

    monotonic: float
    wall: float


class RegionInfo(Struct, frozen=True, kw_only=True, tag="region"):
    """One registered KV region as its owner advertises it."""

    base_addr: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    block_len: Annotated[int, Meta(ge=1, lt=2**40)]  # bytes of one physical block
    stride: Annotated[int, Meta(ge=1, lt=2**40)]  # bytes between consecutive blocks
    num_blocks: Annotated[int, Meta(ge=1, lt=2**31)]  # physical blocks (capacity)
    device_id: Annotated[int, Meta(ge=0, lt=1 << 16)] = 0
    members: tuple[str, ...] = ()  # layer names backed by this region
    group: Annotated[int, Meta(ge=0, lt=MAX_KV_GROUPS)] = 0

    def __post_init__(self) -> None:
        if self.stride < self.block_len:
            raise ValueError("region stride is smaller than its block length")


class AgentInfo(Struct, frozen=True, kw_only=True, tag="agent_info"):
    """What one rank advertises over the side channel."""

    engine_id: EngineId
    agent_name: Annotated[str, Meta(min_length=1, max_length=512)]
    agent_metadata: bytes
    mem_type: MemType
    tp_size: Size
    tp_rank: Rank
    pp_size: Size = 1
    pp_rank: Rank = 0
    block_size: Size  # tokens per logical block
    physical_blocks_per_logical: Size = 1
    regions: tuple[RegionInfo, ...]
    # True when KV is replicated across TP ranks (MLA latent): every rank writes whole blocks.
    replicated_kv: bool = False
    clock: ClockSample

    def __post_init__(self) -> None:
        if self.tp_rank >= self.tp_size or self.pp_rank >= self.pp_size:
            raise ValueError("rank outside its group size")
        if len(self.regions) > 1 << 14:
            raise ValueError("too many regions")
        # A peer sizes our descriptor lists: bound them (and keep every region addressable).
        if sum(r.num_blocks for r in self.regions) > MAX_DESCRIPTOR_ROWS:
            raise ValueError(f"more than {MAX_DESCRIPTOR_ROWS} blocks advertised")
        for r in self.regions:
            if r.base_addr + (r.num_blocks - 1) * r.stride + r.block_len >= 2**64:
                raise ValueError("region extends past the address space")

    @property
    def num_physical_blocks(self) -> int:
        return min((r.num_blocks for r in self.regions), default=0)


class CompatSpec(Struct, frozen=True, kw_only=True, tag="compat"):
    """What two engines must agree on before any metadata is trusted."""

    protocol_version: int = PROTOCOL_VERSION
    model: str = ""
    dtype: str = ""
    kv_shape: tuple[int, ...] = ()  # per-layer shape without the block dimension
    num_layers: int = 0
    transfer_mode: Literal["push"] = "push"


def compatibility_hash(spec: CompatSpec) -> str:
    return hashlib.sha256(_encoder.encode(spec)).hexdigest()[:32]


class HandshakeEnvelope(Struct, frozen=True, array_like=True):
    """Versioned payload; ``body`` stays opaque until the hash has been checked."""

    version: int
    compat_hash: str
    body: bytes


class HandshakeRequest(Struct, frozen=True, kw_only=True, tag="hs_req"):
    """Side-channel request for one rank's :class:`AgentInfo`."""

    pp_rank: Rank
    tp_rank: Rank
    requester_engine_id: EngineId = "?"
    requester_agent: str = ""


_envelope_decoder = msgspec.msgpack.Decoder(HandshakeEnvelope)
_agent_decoder = msgspec.msgpack.Decoder(AgentInfo)
_hsreq_decoder = msgspec.msgpack.Decoder(HandshakeRequest)


def encode_handshake(info: AgentInfo, compat_hash: str) -> bytes:
    return _encoder.encode(HandshakeEnvelope(PROTOCOL_VERSION, compat_hash, _encoder.encode(info)))


def decode_handshake(raw: bytes, *, expected_hash: str, expected_engine: str | None) -> AgentInfo:
    """Validate and decode a handshake payload, hash first, then the body, then identity."""
    try:
        env = _envelope_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise HandshakeError("garbage", f"undecodable handshake envelope: {exc}") from None
    if env.version != PROTOCOL_VERSION:
        raise HandshakeError("version", f"protocol version {env.version} != {PROTOCOL_VERSION}")
    if env.compat_hash != expected_hash:
        raise HandshakeError("incompatible", f"compatibility hash {env.compat_hash!r} != {expected_hash!r}")
    try:
        info = _agent_decoder.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise HandshakeError("garbage", f"undecodable agent info: {exc}") from None
    if expected_engine is not None and info.engine_id != expected_engine:
        raise HandshakeError("wrong_engine", f"engine id {info.engine_id!r} != expected {expected_engine!r}")
    return info


def encode_handshake_request(req: HandshakeRequest) -> bytes:
    return _encoder.encode(req)


def decode_handshake_request(raw: bytes) -> HandshakeRequest:
    try:
        return _hsreq_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise MalformedMessage("handshake_request", str(exc)) from None


# ============================================================================================
# Engine meta: scheduler → workers, once per engine step
# ============================================================================================
class StagedRegistration(Struct, frozen=True, kw_only=True, tag="staged_reg"):
    """D side: blocks allocated for a remote prefill; each D rank registers them with P."""

    request_id: RequestId
    block_ids: BlockGroups
    remote_engine_id: EngineId
    remote_host: Host
    remote_port: Port
    remote_tp_size: Size
    remote_pp_size: Size = 1
    transfer_id: Union[RequestId, None] = None
    remote_request_id: Union[RequestId, None] = None
    deadline: float  # scheduler clock
    # D's own side channel, when the scheduler serves it (vLLM); else the worker's publisher.
    decode_host: Union[Host, None] = None
    decode_port: Union[Port, None] = None


class FinishedPush(Struct, frozen=True, kw_only=True, tag="finished_push"):
    """P side: a finished prefill whose blocks stay leased until they are pushed."""

    request_id: RequestId
    block_ids: BlockGroups
    transfer_id: Union[RequestId, None] = None
    deadline: float  # scheduler clock
    # Test-only negative control: overwrite these blocks with noise before pushing. Honoured
    # only where the engine integration enables it explicitly.
    noise: bool = False


class AbortedRecv(Struct, frozen=True, kw_only=True, tag="aborted_recv"):
    """D side: the engine gave up on a request whose blocks may already be registered."""

    request_id: RequestId


class CancelledPush(Struct, frozen=True, kw_only=True, tag="cancelled_push"):
    """P side: a request that will not finish (aborted, failed): its registrations are refused."""

    request_id: RequestId
    transfer_id: Union[RequestId, None] = None
    reason: Reason = "aborted on P"


class RejectedRecv(Struct, frozen=True, kw_only=True, tag="rejected_recv"):
    """D side: the scheduler could not register a request (bad kv_transfer_params); every rank
    reports it as a failed receive so the engine ends it visibly."""

    request_id: RequestId
    reason: Reason


class PushConnectorMeta(Struct, frozen=True, kw_only=True, tag="push_meta"):
    registrations: tuple[StagedRegistration, ...] = ()
    finished: tuple[FinishedPush, ...] = ()
    aborted: tuple[AbortedRecv, ...] = ()
    rejected: tuple[RejectedRecv, ...] = ()
    cancelled: tuple[CancelledPush, ...] = ()
    clock: float  # the scheduler's time.monotonic() when this meta was built

    @property
    def empty(self) -> bool:
        return not (self.registrations or self.finished or self.aborted or self.rejected or self.cancelled)


class KVTransferParams(Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The kv_transfer_params of one engine request (vLLM-compatible field names)."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: Union[EngineId, None] = None
    remote_host: Union[Host, None] = None
    remote_port: Union[Port, None] = None
    remote_tp_size: Union[Size, None] = None
    remote_pp_size: Size = 1
    remote_request_id: Union[RequestId, None] = None
    transfer_id: Union[RequestId, None] = None
    remote_block_ids: Union[list[object], None] = None
    # vLLM's own connectors name P's sizes tp_size / pp_size; accepted as aliases.
    tp_size: Union[Size, None] = None
    pp_size: Union[Size, None] = None


def parse_kv_transfer_params(params: object) -> KVTransferParams:
    """Validate a request's kv_transfer_params; raise ValueError with a clear reason."""
    try:
        parsed = msgspec.convert(params, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid kv_transfer_params: {exc}") from None
    if parsed.remote_tp_size is None and parsed.tp_size is not None:
        parsed = msgspec.structs.replace(parsed, remote_tp_size=parsed.tp_size)
    if parsed.pp_size is not None and isinstance(params, dict) and "remote_pp_size" not in params:
        parsed = msgspec.structs.replace(parsed, remote_pp_size=parsed.pp_size)
    if parsed.do_remote_prefill:
        missing = [
            f
            for f in ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size")
            if getattr(parsed, f) is None
        ]
        if missing:
            raise ValueError("invalid kv_transfer_params: do_remote_prefill needs " + ", ".join(missing))
    return parsed


# ============================================================================================
# Mailbox messages between the actors of one rank
# ============================================================================================
class PeerKey(Struct, frozen=True, array_like=True):
    """One remote rank: engine id plus its (pp_rank, tp_rank), and where to ask for it."""

    engine_id: str
    host: str
    port: int
    pp_rank: int
    tp_rank: int


class MemoryRange(Struct, frozen=True, array_like=True):
    addr: int
    length: int
    device_id: int


# --- writer ---------------------------------------------------------------------------------
class RegisterMemory(Struct, frozen=True, kw_only=True, tag="register_memory"):
    """Worker → writer (ask): register the KV memory; the reply is :class:`MemoryRegistered`."""

    regions: tuple[RegionInfo, ...]
    memory: tuple[MemoryRange, ...]
    mem_type: MemType
    block_size: int
    physical_blocks_per_logical: int = 1
    replicated_kv: bool = False


class MemoryRegistered(Struct, frozen=True, kw_only=True, tag="memory_registered"):
    agent_name: str = ""
    agent_metadata: bytes = b""
    error: str = ""


class SendRegistration(Struct, frozen=True, kw_only=True, tag="send_registration"):
    registration: Registration

    @property
    def request_id(self) -> str:
        return self.registration.request_id


class PostPush(Struct, frozen=True, kw_only=True, tag="post_push"):
    """Matcher → writer: P's finished blocks paired with one D rank's registration."""

    request_id: str  # P's id: what P reports and frees
    block_ids: BlockGroups
    registration: Registration
    expected_targets: int  # D ranks this P rank writes to
    sender: str = ""  # the agent the registration came from (verified by the writer)
    serial: int = 0  # the incarnation of the P id (a reused id's old tombstone does not apply)
    # When D last showed it waits for this registration (monotonic, this process): a WRITE
    # replayed after a handshake re-checks that it is still fresh.
    fresh_at: float = 0.0


class CancelPush(Struct, frozen=True, kw_only=True, tag="cancel_push"):
    """Matcher → writer: D aborted; do not post what is not posted yet, confirm to D."""

    request_id: str  # P's id
    d_request_id: str
    decode_tp_rank: int


class RefuseRegistration(Struct, frozen=True, kw_only=True, tag="refuse_registration"):
    registration: Registration
    reason: str

    @property
    def request_id(self) -> str:
        return self.registration.request_id


class AnswerAbort(Struct, frozen=True, kw_only=True, tag="answer_abort"):
    """Matcher → writer: D aborted a request P is already done with; tell D so it can stop
    quarantining its blocks at once."""

    d_request_id: str
    sender: str
    reason: str

    @property
    def request_id(self) -> str:
        return self.d_request_id


class HandshakeCompleted(Struct, frozen=True, kw_only=True, tag="handshake_completed"):
    peer: PeerKey
    info: AgentInfo
    full: bool
    # The peer's monotonic clock minus ours, estimated from the payload's clock sample and the
    # midpoint of the exchange (as NTP does); used to rebase deadlines across processes.
    clock_offset: float = 0.0


class HandshakeFailed(Struct, frozen=True, kw_only=True, tag="handshake_failed"):
    peer: PeerKey
    kind: str
    reason: str


class ExpireLease(Struct, frozen=True, kw_only=True, tag="expire_lease"):
    request_id: str
    reason: str = "lease_expired"
    serial: int = 0  # the incarnation whose lease this is (0: whichever is live)
    failed: bool = False  # a failure (ambiguity, an actor error), not a plain expiry


class SendHeartbeats(Struct, frozen=True, kw_only=True, tag="send_heartbeats"):
    engine_id: str
    host: str
    port: int
    peers: tuple[PeerKey, ...]
    ids: tuple[str, ...]


class SendAbort(Struct, frozen=True, kw_only=True, tag="send_abort"):
    abort: Abort
    peers: tuple[PeerKey, ...]

    @property
    def request_id(self) -> str:
        return self.abort.request_id


class EvictIdleEngines(Struct, frozen=True, kw_only=True, tag="evict_idle_engines"):
    idle_for: float


class Drain(Struct, frozen=True, kw_only=True, tag="drain"):
    """Shutdown: fail what waits, settle what is in flight, release NIXL resources."""

    deadline: float


# --- matcher --------------------------------------------------------------------------------
class RegistrationArrived(Struct, frozen=True, kw_only=True, tag="registration_arrived"):
    """Writer → matcher: a registration from a verified sender. The writer decodes only its
    header; the block ids (``payload``, the msgpack body) are decoded here, off the writer."""

    registration: Union[Registration, None] = None
    sender: str
    payload: bytes = b""
    header: Union[RegistrationHeader, None] = None
    # Logical blocks per KV group that D advertised (checked before any WRITE is planned).
    capacity: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        if self.registration is not None:
            return self.registration.request_id
        return self.header.request_id if self.header is not None else "?"


class BlocksFinished(Struct, frozen=True, kw_only=True, tag="blocks_finished"):
    request_id: str
    block_ids: BlockGroups
    transfer_id: Union[str, None] = None
    serial: int = 0


Outcome = Literal["pushed", "expired", "failed", "aborted", "shutdown"]


class Forget(Struct, frozen=True, kw_only=True, tag="forget"):
    """Writer → matcher: a P request is over; drop it under every key and tombstone it."""

    request_id: str
    outcome: Outcome
    transfer_id: Union[str, None] = None  # for requests the matcher never saw (P aborted early)
    serial: int = 0  # the incarnation that ended (0: whichever is live)


class HeartbeatArrived(Struct, frozen=True, kw_only=True, tag="heartbeat_arrived"):
    ids: tuple[str, ...]
    sender: str


class AbortArrived(Struct, frozen=True, kw_only=True, tag="abort_arrived"):
    abort: Abort
    sender: str

    @property
    def request_id(self) -> str:
        return self.abort.request_id


# --- lease-reaper ---------------------------------------------------------------------------
class ArmLease(Struct, frozen=True, kw_only=True, tag="arm_lease"):
    """Worker → reaper: lease P's finished blocks, then hand them to the matcher."""

    request_id: str
    deadline: float  # this worker's clock
    block_ids: BlockGroups
    transfer_id: Union[str, None] = None
    # Which incarnation of the P id this is (the worker numbers them): a late message about an
    # earlier request under a reused id never touches the live one.
    serial: int = 0


class ClearLease(Struct, frozen=True, kw_only=True, tag="clear_lease"):
    request_id: str
    serial: int = 0


class ExtendLeases(Struct, frozen=True, kw_only=True, tag="extend_leases"):
    request_ids: tuple[str, ...]


class WatchRecv(Struct, frozen=True, kw_only=True, tag="watch_recv"):
    """D side: arm the registration watchdog and the completion ledger for one request."""

    request_id: str
    expected: int
    deadline: float  # this worker's clock
    registration: Registration
    peers: tuple[PeerKey, ...]  # the P ranks this D rank registers with
    heartbeat_id: str
    nbytes: int = 0  # bytes this rank receives when the push completes (for metrics)


class RecvNotified(Struct, frozen=True, kw_only=True, tag="recv_notified"):
    """A completion (ok) or push failure (not ok) arrived for a D request."""

    request_id: str
    ok: bool
    sender: str
    reason: str = ""
    # The P rank the sending agent was verified as (a handshake bound its name); None when the
    # sender is no agent this rank handshook with. Only the ranks a request expects count.
    peer: Union[PeerKey, None] = None
    final: bool = True


class RecvUndelivered(Struct, frozen=True, kw_only=True, tag="recv_undelivered"):
    """D's registration never reached ``count`` P ranks: they will never write or answer."""

    request_id: str
    count: int
    reason: str


class PeerGone(Struct, frozen=True, kw_only=True, tag="peer_gone"):
    """Writer → reaper: NIXL reports this remote rank disconnected (its process died or
    restarted). D requests waiting on it stop waiting for the watchdog: they quarantine."""

    peer: PeerKey
    agent: str
    reason: str


class AbortRecv(Struct, frozen=True, kw_only=True, tag="abort_recv"):
    request_id: str


# --- handshake ------------------------------------------------------------------------------
class FetchPeer(Struct, frozen=True, kw_only=True, tag="fetch_peer"):
    peer: PeerKey
    full: bool  # full (P→D: memory layout needed) or notif-only (D→P)


class FetchSettled(Struct, frozen=True, kw_only=True, tag="fetch_settled"):
    """Internal to the handshake actor: a background fetch returned bytes or an error."""

    peer: PeerKey
    full: bool
    payload: Union[bytes, None] = None
    error_kind: str = ""
    error: str = ""
    sent_at: float = 0.0  # this process's monotonic clock around the exchange
    received_at: float = 0.0


MailboxMessage = Union[
    RegisterMemory,
    SendRegistration,
    PostPush,
    CancelPush,
    AnswerAbort,
    RefuseRegistration,
    HandshakeCompleted,
    HandshakeFailed,
    ExpireLease,
    SendHeartbeats,
    SendAbort,
    EvictIdleEngines,
    Drain,
    RegistrationArrived,
    BlocksFinished,
    Forget,
    HeartbeatArrived,
    AbortArrived,
    ArmLease,
    ClearLease,
    ExtendLeases,
    WatchRecv,
    RecvNotified,
    RecvUndelivered,
    PeerGone,
    AbortRecv,
    FetchPeer,
    FetchSettled,
]
