"""Wire: the side-channel handshake (docs/protocol.md, 'Side channel'): agent info, compatibility hash (checked before
the body is decoded), and the handshake request.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from .fields import (
    MAX_DESCRIPTOR_ROWS,
    MAX_KV_GROUPS,
    EngineId,
    HandshakeError,
    MalformedMessage,
    Rank,
    Size,
)

# ============================================================================================
# Wire: side-channel handshake (docs/protocol.md, 'Side channel')
# ============================================================================================
PROTOCOL_VERSION = 1
_encoder = msgspec.msgpack.Encoder()

MemType = Literal["DRAM", "VRAM"]


class ClockSample(Struct, frozen=True, tag="clock"):
    """One reading of a process's clocks, for rebasing deadlines across processes."""

    monotonic: float
    wall: float


class AxisInfo(Struct, frozen=True, kw_only=True, tag="axis"):
    """One named axis inside a block: its size and byte stride."""

    name: Literal["layer", "kv", "token", "head", "dim"]
    size: Annotated[int, Meta(ge=1, lt=2**31)]
    stride: Annotated[int, Meta(ge=0, lt=2**40)]


class ShapeInfo(Struct, frozen=True, kw_only=True, tag="shape"):
    """What the bytes of one block mean (docs/topologies.md, 'Layouts'); absent for an opaque region."""

    axes: Annotated[tuple[AxisInfo, ...], Meta(max_length=5)]
    elem_size: Annotated[int, Meta(ge=1, le=64)]


class StagingInfo(Struct, frozen=True, kw_only=True, tag="staging"):
    """A rank's registered staging buffer: staged pushes WRITE a request's image into a slot of it."""

    addr: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    length: Annotated[int, Meta(ge=1, lt=2**48)]
    device_id: Annotated[int, Meta(ge=0, lt=1 << 16)] = 0


class RegionInfo(Struct, frozen=True, kw_only=True, tag="region"):
    """One registered KV region as its owner advertises it."""

    base_addr: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    block_len: Annotated[int, Meta(ge=1, lt=2**40)]  # bytes of one physical block
    stride: Annotated[int, Meta(ge=1, lt=2**40)]  # bytes between consecutive blocks
    num_blocks: Annotated[int, Meta(ge=1, lt=2**31)]  # physical blocks (capacity)
    device_id: Annotated[int, Meta(ge=0, lt=1 << 16)] = 0
    members: tuple[str, ...] = ()  # layer names backed by this region
    group: Annotated[int, Meta(ge=0, lt=MAX_KV_GROUPS)] = 0
    shape: ShapeInfo | None = None
    kv_part: Annotated[int, Meta(ge=0, le=1)] | None = None  # only K (0) or only V (1)

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
    # The model's KV heads over all TP ranks (a described layout states it; MLA: 1).
    kv_heads: Annotated[int, Meta(ge=1, le=1 << 16)] | None = None
    staging: StagingInfo | None = None
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
