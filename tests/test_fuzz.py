"""Fuzz: every wire input either decodes to a valid message or is refused; nothing crashes, and
no descriptor ever points outside registered memory (issue 5, "Soak and fuzz").

* ``decode_notification`` on arbitrary bytes, on structured-but-wrong registrations (random
  field types and values, extra and missing fields, nesting) and on random completions,
  heartbeats, push failures and aborts: a valid message or :class:`MalformedMessage`.
* the same bytes injected into live writer actors (both agents of a ``PushPair``): no actor dies,
  no handler error, and an ordinary request still lands afterwards.
* ``decode_handshake`` on arbitrary and mutated payloads: an ``AgentInfo`` or
  :class:`HandshakeError`, hash checked before the body.
* ``PairedLayout.plan`` on random layouts and block ids (negative, out of range, huge):
  ``PlanError``/``LayoutError``, or exactly the descriptors asked for, each inside its region.
* random block ids pushed end to end over the fake fabric (which checks every descriptor):
  refused with a push failure, never a WRITE outside registered memory.

Sizes: CI runs a few thousand examples; ``PUSHACTORS_LONG=1`` runs over 100,000 generated
notifications and handshake payloads. ``PUSHACTORS_FUZZ_SEED`` (printed) reproduces a run;
``PUSHACTORS_FUZZ_SCALE`` multiplies every example count.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from pushactors.core.blocks import (
    KVLayout,
    KVRegion,
    LayoutError,
    PairedLayout,
    PlanError,
    RemoteLayout,
    descriptor_array,
    region_offsets,
)
from pushactors.core.topology import Slice, TopologyError, write_slices
from pushactors.protocol import (
    ABORT_PREFIX,
    HEARTBEAT_PREFIX,
    PROTOCOL_VERSION,
    PUSH_FAIL_PREFIX,
    PUSH_REG_PREFIX,
    Abort,
    AgentInfo,
    ClockSample,
    CompatSpec,
    Completion,
    HandshakeError,
    HandshakeRequest,
    Heartbeat,
    MalformedMessage,
    PushFailure,
    RegionInfo,
    Registration,
    compatibility_hash,
    decode_handshake,
    decode_handshake_request,
    decode_notification,
    encode_abort,
    encode_completion,
    encode_handshake,
    encode_heartbeat,
    encode_push_failure,
    encode_registration,
)
from pushactors.testing import PushPair, RecvRecord, SimSpec, wait_until

LONG = os.environ.get("PUSHACTORS_LONG") == "1"
FUZZ_SEED = int(os.environ.get("PUSHACTORS_FUZZ_SEED", "5150"))
SCALE = float(os.environ.get("PUSHACTORS_FUZZ_SCALE", "1"))
GENERATED: Counter[str] = Counter()  # examples run, by target (printed at the end)
FINDINGS: Counter[str] = Counter()  # what the live actors did with the injected bytes

pack = msgspec.msgpack.encode
NOTIFICATION_TYPES = (Registration, Completion, Heartbeat, PushFailure, Abort)
MALFORMED_KINDS = {"push_reg", "push_fail", "push_abort", "heartbeat", "completion", "notification"}


def examples(short: int, long: int) -> int:
    return max(1, int((long if LONG else short) * SCALE))


def fuzz_settings(short: int, long: int) -> Callable[[Any], Any]:
    """Hypothesis settings for one target: fixed seed, no database, no deadline."""

    def wrap(fn: Any) -> Any:
        fn = settings(
            max_examples=examples(short, long),
            deadline=None,
            database=None,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        )(fn)
        return seed(FUZZ_SEED)(fn)

    return wrap


@pytest.fixture(scope="module", autouse=True)
def _summary() -> Iterator[None]:
    yield
    total = GENERATED["notification"] + GENERATED["handshake"]
    print(
        f"\nfuzz summary: seed={FUZZ_SEED} long={LONG} examples={dict(GENERATED)} "
        f"notifications+handshakes={total}; live actors: {dict(FINDINGS)}"
    )


# ============================================================================================
# Strategies
# ============================================================================================
BIG_INTS = st.sampled_from([-(2**63), -(2**31) - 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**64 - 1])
ints = st.one_of(st.integers(-(2**63), 2**64 - 1), BIG_INTS, st.integers(-3, 70))
leaf = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.binary(max_size=24),
    st.sampled_from(["", ",", "a,b", "\n", "r\n", "x\x00y", "é", "push_reg", "-1a2b3c4d", "0"]),
)


def _nest(depth: int, inner: object) -> object:
    """``depth`` one-element arrays around ``inner``, pre-encoded (too deep to build as lists)."""
    try:
        body = pack(inner)
    except (OverflowError, TypeError, ValueError):
        body = pack(None)
    return msgspec.Raw(b"\x91" * depth + body)


msgpack_value = st.one_of(
    st.recursive(
        leaf,
        lambda c: st.one_of(
            st.lists(c, max_size=6),
            st.dictionaries(st.one_of(st.text(max_size=12), st.integers(-5, 5)), c, max_size=6),
        ),
        max_leaves=24,
    ),
    st.builds(_nest, st.integers(1, 3000), leaf),
)
request_ids = st.one_of(
    st.text(max_size=40),
    st.from_regex(r"[a-z]{1,6}-[0-9]{1,4}-[0-9]-[0-9a-f]{8}", fullmatch=True),
    st.sampled_from(["r-0-aaaaaaaa", "x", "a,b", "trailing\n", "-", "\x7f", "x" * 1025, "café-0-1a2b3c4d"]),
)
block_lists = st.one_of(
    st.lists(ints, max_size=12),
    st.lists(st.lists(ints, max_size=6), max_size=5),
    st.lists(st.one_of(ints, st.lists(ints, max_size=3)), max_size=6),
    st.lists(st.lists(st.integers(0, 300), max_size=3), min_size=60, max_size=70),
    msgpack_value,
)

REG_BASE: dict[str, Any] = {
    "type": "push_reg",
    "request_id": "soak-000001-0-1a2b3c4d",
    "decode_engine_id": "decode",
    "decode_host": "decode-host",
    "decode_port": 20001,
    "decode_tp_size": 1,
    "decode_tp_rank": 0,
    "local_block_ids": [[1, 2, 3]],
    "remote_engine_id": "prefill",
    "remote_host": "prefill-host",
    "remote_port": 20000,
    "remote_tp_size": 1,
    "remote_pp_size": 1,
    "transfer_id": None,
    "remote_request_id": None,
}
FAIL_BASE: dict[str, Any] = {
    "type": "push_fail",
    "request_id": "r-0-aaaaaaaa",
    "reason": "x",
    "tp_rank": 0,
    "pp_rank": 0,
}
ABORT_BASE: dict[str, Any] = {
    "type": "push_abort",
    "request_id": "r-0-aaaaaaaa",
    "transfer_id": None,
    "remote_request_id": None,
    "decode_tp_rank": 0,
    "reason": "",
}
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "request_id": request_ids,
    "transfer_id": st.one_of(st.none(), request_ids),
    "remote_request_id": st.one_of(st.none(), request_ids),
    "local_block_ids": block_lists,
    "decode_tp_size": ints,
    "decode_tp_rank": ints,
    "remote_tp_size": ints,
    "remote_pp_size": ints,
    "tp_rank": ints,
    "pp_rank": ints,
    "decode_port": ints,
    "remote_port": ints,
    "reason": st.one_of(st.text(max_size=30), st.just("r" * 5000)),
    "type": st.one_of(st.sampled_from(["push_reg", "push_fail", "push_abort", "completion", ""]), leaf),
}


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    """A valid message map with 0–5 mutations (replace, drop, add, rename, wrap)."""
    value: dict[Any, Any] = dict(base)
    for _ in range(draw(st.integers(0, 5))):
        op = draw(st.sampled_from(["replace", "typed", "drop", "add", "wrap", "swap"]))
        key = draw(st.sampled_from(sorted(base)))
        if op == "replace":
            value[key] = draw(msgpack_value)
        elif op == "typed":
            value[key] = draw(FIELD_VALUES.get(key, leaf))
        elif op == "drop":
            value.pop(key, None)
        elif op == "add":
            value[draw(st.one_of(st.text(max_size=12), st.integers(-3, 3)))] = draw(msgpack_value)
        elif op == "wrap":
            value[key] = [value.get(key)] if draw(st.booleans()) else {"v": value.get(key)}
        else:
            other = draw(st.sampled_from(sorted(base)))
            value[key], value[other] = value.get(other), value.get(key)
    if draw(st.integers(0, 20)) == 0:
        return draw(st.sampled_from([list(value.values()), [value], {"x": value}, None, 7]))
    return value


def _pack(value: Any) -> bytes:
    try:
        return pack(value)
    except (OverflowError, TypeError, ValueError):
        return pack(repr(value))


def structured(prefix: bytes, base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    return mutated(base).map(lambda v: prefix + _pack(v))


def _completion(rid: str, sep: str, tp: str) -> bytes:
    return f"{rid}{sep}{tp}".encode("utf-8", "surrogatepass")


completions = st.one_of(
    st.builds(
        _completion,
        request_ids,
        st.sampled_from([":", "::", "", ";"]),
        st.one_of(
            st.integers(-5, 2**17).map(str),
            st.sampled_from(["", " 1", "1 ", "١", "²", "0" * 5000 + "1", "1e3", "+1", "65536", "65537"]),
            st.text(max_size=6),
        ),
    ),
    st.binary(max_size=64).map(lambda b: b + b":1"),
)
heartbeats = st.one_of(
    st.lists(request_ids, max_size=8).map(lambda ids: HEARTBEAT_PREFIX + ",".join(ids).encode("utf-8", "replace")),
    st.binary(max_size=64).map(lambda b: HEARTBEAT_PREFIX + b),
    st.just(HEARTBEAT_PREFIX + b"," * 100),
    st.just(HEARTBEAT_PREFIX + b"x" * 2000),
)
prefixes = st.sampled_from([PUSH_REG_PREFIX, PUSH_FAIL_PREFIX, ABORT_PREFIX, HEARTBEAT_PREFIX, b"", b"PUSH_", b"HB"])
notifications = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda p, b: p + b, prefixes, st.binary(max_size=128)),
    st.builds(lambda p, v: p + _pack(v), prefixes, msgpack_value),
    structured(PUSH_REG_PREFIX, REG_BASE),
    structured(PUSH_REG_PREFIX, REG_BASE),
    structured(PUSH_FAIL_PREFIX, FAIL_BASE),
    structured(ABORT_PREFIX, ABORT_BASE),
    completions,
    heartbeats,
)


# ============================================================================================
# decode_notification
# ============================================================================================
def check_notification(raw: bytes) -> object | None:
    """Decode ``raw``; a valid message must also be well-formed by every rule of SPEC §2."""
    try:
        msg = decode_notification(raw)
    except MalformedMessage as exc:
        assert exc.kind in MALFORMED_KINDS and isinstance(exc.reason, str)
        return None
    assert isinstance(msg, NOTIFICATION_TYPES), type(msg)
    if isinstance(msg, Registration):
        groups = msg.block_groups
        assert isinstance(groups, tuple) and 1 <= len(groups) <= 64
        for g in groups:
            assert all(type(b) is int and 0 <= b < 2**31 for b in g)
        assert 0 <= msg.decode_tp_rank < msg.decode_tp_size <= 1 << 16
        assert 1 <= msg.remote_tp_size and 1 <= msg.remote_pp_size
        assert decode_notification(encode_registration(msg)) == msg
        # Ids are joined with "," in heartbeats.
        for rid in (msg.request_id, msg.transfer_id, msg.remote_request_id):
            assert rid is None or ("," not in rid and rid)
    elif isinstance(msg, Completion):
        assert msg.request_id and 1 <= msg.tp_size <= 1 << 16
        assert not any(ord(c) < 0x20 for c in msg.request_id)
        assert decode_notification(encode_completion(msg.request_id, msg.tp_size)) == msg
    elif isinstance(msg, Heartbeat):
        assert msg.ids and all(i and "," not in i for i in msg.ids)
        assert decode_notification(encode_heartbeat(msg.ids)) == msg
    elif isinstance(msg, PushFailure):
        assert msg.request_id
        assert decode_notification(encode_push_failure(msg)) == msg
    else:
        assert msg.request_id
        assert decode_notification(encode_abort(msg)) == msg
    return msg


@fuzz_settings(1200, 50_000)
@given(raw=notifications)
def test_fuzz_decode_notification(raw: bytes) -> None:
    GENERATED["notification"] += 1
    check_notification(raw)


@fuzz_settings(300, 10_000)
@given(value=mutated(REG_BASE))
def test_fuzz_registration_fields(value: Any) -> None:
    """Every decoded registration has the fields its map said (nothing silently coerced)."""
    GENERATED["notification"] += 1
    msg = check_notification(PUSH_REG_PREFIX + _pack(value))
    if msg is None:
        return
    assert isinstance(value, dict) and isinstance(msg, Registration)
    for key in ("request_id", "decode_engine_id", "remote_engine_id", "decode_tp_size", "remote_tp_size"):
        assert getattr(msg, key) == value[key] and type(getattr(msg, key)) is type(value[key])


@fuzz_settings(300, 10_000)
@given(rid=request_ids, tid=st.one_of(st.none(), request_ids), rrid=st.one_of(st.none(), request_ids))
def test_fuzz_accepted_ids_come_back_in_completions_and_heartbeats(rid: str, tid: str | None, rrid: str | None) -> None:
    """P echoes D's id in the completion, D heartbeats by transfer id, P id or its own id: every
    id a registration accepts must survive those formats, or the push lands and D never knows."""
    GENERATED["notification"] += 1
    fields = {**REG_BASE, "request_id": rid, "transfer_id": tid, "remote_request_id": rrid}
    try:
        reg = decode_notification(PUSH_REG_PREFIX + pack(fields))
    except MalformedMessage:
        return
    assert isinstance(reg, Registration)
    try:
        echoed = decode_notification(encode_completion(reg.request_id, 1))
    except MalformedMessage as exc:
        raise AssertionError(f"registration accepted {reg.request_id!r}; its completion is refused: {exc}") from None
    assert echoed == Completion(reg.request_id, 1)
    ids = tuple(i for i in (reg.transfer_id, reg.remote_request_id, reg.request_id) if i is not None)
    try:
        beat = decode_notification(encode_heartbeat(ids))
    except MalformedMessage as exc:
        raise AssertionError(f"registration accepted {ids!r}; a heartbeat of them is refused: {exc}") from None
    assert beat == Heartbeat(ids)


# ============================================================================================
# Handshake payloads
# ============================================================================================
COMPAT = CompatSpec(model="sim", dtype="uint8", kv_shape=(512,))
HASH = compatibility_hash(COMPAT)
INFO = AgentInfo(
    engine_id="prefill",
    agent_name="prefill-agent-tp0",
    agent_metadata=b"\x00fake-metadata",
    mem_type="DRAM",
    tp_size=2,
    tp_rank=1,
    block_size=16,
    regions=(
        RegionInfo(base_addr=1 << 20, block_len=512, stride=512, num_blocks=64, members=("layer.0[0]",)),
        RegionInfo(base_addr=1 << 30, block_len=512, stride=1024, num_blocks=64, members=("layer.0[1]",)),
    ),
    clock=ClockSample(monotonic=1.0, wall=2.0),
)
VALID_PAYLOAD = encode_handshake(INFO, HASH)
INFO_MAP = msgspec.to_builtins(INFO)
REGION_MAP = INFO_MAP["regions"][0]


@st.composite
def flipped(draw: st.DrawFn, payload: bytes) -> bytes:
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[i : i + draw(st.integers(1, 8))]
    return bytes(data)


@st.composite
def info_maps(draw: st.DrawFn) -> Any:
    info = draw(mutated(INFO_MAP))
    if isinstance(info, dict) and draw(st.booleans()):
        regions = draw(st.lists(mutated(REGION_MAP), max_size=4))
        info["regions"] = regions
    return info


def envelope(version: Any, compat: Any, body: Any) -> bytes:
    return _pack([version, compat, body])


handshake_payloads = st.one_of(
    st.binary(max_size=256),
    flipped(VALID_PAYLOAD),
    msgpack_value.map(_pack),
    # Right version and hash, body anything: the body is decoded only after the hash matched.
    st.builds(envelope, st.just(PROTOCOL_VERSION), st.just(HASH), st.binary(max_size=200)),
    st.builds(envelope, st.just(PROTOCOL_VERSION), st.just(HASH), info_maps().map(_pack)),
    st.builds(envelope, st.just(PROTOCOL_VERSION), st.just(HASH), flipped(pack(INFO))),
    st.builds(envelope, msgpack_value, msgpack_value, msgpack_value),
    st.builds(envelope, ints, st.text(max_size=40), st.binary(max_size=16)),
)


def check_handshake(raw: bytes, expected_engine: str | None) -> AgentInfo | None:
    try:
        info = decode_handshake(raw, expected_hash=HASH, expected_engine=expected_engine)
    except HandshakeError as exc:
        assert exc.kind in {"garbage", "version", "incompatible", "wrong_engine"}, exc.kind
        return None
    assert isinstance(info, AgentInfo)
    env = msgspec.msgpack.decode(raw)
    assert env[0] == PROTOCOL_VERSION and env[1] == HASH  # never accepted without the hash
    if expected_engine is not None:
        assert info.engine_id == expected_engine
    assert 0 <= info.tp_rank < info.tp_size and 0 <= info.pp_rank < info.pp_size
    for r in info.regions:
        assert r.stride >= r.block_len >= 1 and r.num_blocks >= 1 and r.base_addr >= 0
    # What the writer does next with an accepted payload: a layout, paired or refused.
    remote = RemoteLayout.from_info(info, info.agent_name)
    if sum(r.num_blocks for r in info.regions) <= 4096:
        local = KVLayout(regions=tuple(KVRegion.from_info(r) for r in INFO.regions), mem_type="DRAM", block_size=16)
        try:
            pairing = PairedLayout(local, remote, Slice(), Slice())
        except (LayoutError, TopologyError):
            return info
        check_descriptors_inside(pairing, pairing.plan(((0, 1),), ((0,),)) if _fits(pairing) else None)
    return info


def _fits(pairing: PairedLayout) -> bool:
    return all(r.num_blocks >= 2 for r in pairing.local.regions) and all(
        pairing.remote.regions[j].num_blocks >= 1 for j in pairing.pairs
    )


@fuzz_settings(1000, 40_000)
@given(raw=handshake_payloads, engine=st.sampled_from(["prefill", None, "decode"]))
def test_fuzz_decode_handshake(raw: bytes, engine: str | None) -> None:
    GENERATED["handshake"] += 1
    try:
        check_handshake(raw, engine)
    except PlanError:
        pass  # a remote with fewer blocks than the probe write: refused, as it must be


@fuzz_settings(200, 5_000)
@given(
    raw=st.one_of(
        st.binary(max_size=64),
        msgpack_value.map(_pack),
        mutated(
            msgspec.to_builtins(
                HandshakeRequest(pp_rank=0, tp_rank=0, requester_engine_id="decode", requester_agent="a")
            )
        ).map(_pack),
    )
)
def test_fuzz_decode_handshake_request(raw: bytes) -> None:
    GENERATED["handshake"] += 1
    try:
        req = decode_handshake_request(raw)
    except MalformedMessage:
        return
    assert isinstance(req, HandshakeRequest) and req.pp_rank >= 0 and req.tp_rank >= 0


# ============================================================================================
# No descriptor outside registered memory
# ============================================================================================
HUGE = st.sampled_from([2**31 - 1, 2**31, 2**40, 2**61, 2**62, 2**63 - 1, 2**63, 2**64])
WIRE_MAX = st.sampled_from([2**31 - 1, 2**30, 2**20])  # the most a decoded registration carries
small_ids = st.one_of(st.integers(0, 12), st.integers(0, 12), st.integers(0, 12), st.integers(0, 90))
wire_ids = st.one_of(small_ids, st.integers(-5, -1), WIRE_MAX)
any_ids = st.one_of(small_ids, st.integers(-5, -1), WIRE_MAX, HUGE)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[KVLayout, RemoteLayout, Slice, Slice]:
    """A P rank's layout and one D rank's, mostly pairable (so plans get exercised)."""
    named = draw(st.booleans())
    n = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 2))
    names = [f"layer.{i}" for i in range(n)]
    p_tp, d_tp = draw(st.sampled_from([(1, 1), (1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1)]))
    p_rank, d_rank = draw(st.integers(0, p_tp - 1)), draw(st.integers(0, d_tp - 1))
    lslice, rslice = write_slices(p_rank, p_tp, d_rank, d_tp, replicated=draw(st.booleans()))
    unit = draw(st.sampled_from([8, 16, 24, 64]))  # bytes of one slice, equal on both sides
    odd = draw(st.integers(0, 19)) == 0  # a block length that does not pair

    def regions(ratio: int, order: list[int], parts: int) -> tuple[KVRegion, ...]:
        out = []
        base = draw(st.integers(0, 2**44))
        for i in order:
            block_len = unit * parts + (8 if odd and i == order[0] else 0)
            stride = block_len + draw(st.sampled_from([0, 0, 8, 64, 1000]))
            nblocks = draw(st.integers(1, 24)) * ratio
            out.append(
                KVRegion(
                    base_addr=base,
                    block_len=block_len,
                    stride=stride,
                    num_blocks=nblocks,
                    members=(names[i],) if named else (),
                    group=i % groups,
                )
            )
            base += stride * nblocks + draw(st.integers(0, 4096))
        return tuple(out)

    p_ratio, d_ratio = draw(st.sampled_from([(1, 1), (1, 1), (2, 2), (4, 4), (2, 1), (1, 4)]))
    local_regions = regions(p_ratio, list(range(n)), lslice.parts)
    order = draw(st.permutations(list(range(n)))) if named else list(range(n))
    if named and n > 1 and draw(st.integers(0, 9)) == 0:
        order = order[:-1]  # the remote omits a layer
    remote_regions = regions(d_ratio, order, rslice.parts)
    local = KVLayout(
        regions=local_regions, mem_type="DRAM", block_size=16, physical_blocks_per_logical=p_ratio, num_groups=groups
    )
    remote = RemoteLayout(
        engine_id="decode",
        agent_name="d",
        regions=remote_regions,
        block_size=16 if draw(st.integers(0, 19)) else 32,
        physical_blocks_per_logical=d_ratio,
        tp_size=d_tp,
        tp_rank=d_rank,
        pp_size=1,
        pp_rank=0,
        mem_type="DRAM",
    )
    return local, remote, lslice, rslice


@st.composite
def plan_inputs(draw: st.DrawFn, block_ids: st.SearchStrategy[int]) -> tuple[Any, Any, Any]:
    layout = draw(layouts())
    n = layout[0].num_groups if draw(st.integers(0, 9)) else draw(st.integers(1, 3))
    p_groups = tuple(tuple(draw(st.lists(block_ids, max_size=10))) for _ in range(n))
    if draw(st.integers(0, 9)):
        n = len(p_groups)
    d_groups = []
    for g in range(n):
        p = p_groups[g] if g < len(p_groups) else ()
        # Mostly D's uncached suffix of P's count, sometimes more blocks than P has.
        count = draw(st.integers(0, len(p))) if draw(st.integers(0, 7)) else draw(st.integers(0, 12))
        d_groups.append(tuple(draw(st.lists(block_ids, min_size=count, max_size=count))))
    return layout, p_groups, tuple(d_groups)


def _inside(descs: np.ndarray, regions: tuple[KVRegion, ...], idx: np.ndarray, piece: Slice) -> None:
    offsets = region_offsets(regions).tolist()
    for i, (addr, length, _dev) in zip(idx.tolist(), descs.tolist(), strict=True):
        r = max(k for k, off in enumerate(offsets) if off <= i)
        region = regions[r]
        lo = region.base_addr
        hi = region.base_addr + (region.num_blocks - 1) * region.stride + region.block_len
        assert lo <= int(addr) and int(addr) + int(length) <= hi, (i, addr, length, region)
        off, part = piece.span(region.block_len)
        assert int(length) == part and (int(addr) - lo - off) % region.stride == 0


def check_descriptors_inside(pairing: PairedLayout, plan: Any) -> None:
    if plan is None:
        return
    local_all = descriptor_array(pairing.local.regions, pairing.local_slice)
    remote_all = descriptor_array(pairing.remote.regions, pairing.remote_slice)
    li, ri = np.asarray(plan.local_idx), np.asarray(plan.remote_idx)
    assert li.shape == ri.shape
    assert ((li >= 0) & (li < len(local_all))).all() and ((ri >= 0) & (ri < len(remote_all))).all()
    src, dst = local_all[li], remote_all[ri]
    assert (src[:, 1] == dst[:, 1]).all()  # equal lengths, as NIXL requires
    _inside(src, pairing.local.regions, li, pairing.local_slice)
    _inside(dst, pairing.remote.regions, ri, pairing.remote_slice)


def expected_indices(pairing: PairedLayout, p_groups, d_groups) -> tuple[list[int], list[int]]:
    """The descriptor indices a plan must produce, in Python integers (no overflow)."""
    loc: list[int] = []
    rem: list[int] = []
    lr, rr = pairing.local.physical_blocks_per_logical, pairing.remote.physical_blocks_per_logical
    loff, roff = region_offsets(pairing.local.regions).tolist(), region_offsets(pairing.remote.regions).tolist()
    for i, (region, j) in enumerate(zip(pairing.local.regions, pairing.pairs, strict=True)):
        d = d_groups[region.group]
        p = p_groups[region.group][len(p_groups[region.group]) - len(d) :] if d else ()
        loc += [loff[i] + b * lr + k for b in p for k in range(lr)]
        rem += [roff[j] + b * rr + k for b in d for k in range(rr)]
    return loc, rem


@fuzz_settings(500, 25_000)
@given(inputs=plan_inputs(wire_ids))
def test_fuzz_plan_never_leaves_registered_memory(inputs) -> None:
    """Block ids as far as the wire lets them go (negative, beyond capacity, up to 2**31)."""
    check_plan(*inputs)


@fuzz_settings(300, 10_000)
@given(inputs=plan_inputs(any_ids))
def test_fuzz_plan_refuses_huge_block_ids(inputs) -> None:
    """Ids no registration can carry (P's come from its engine): refused, never wrapped around."""
    check_plan(*inputs)


def check_plan(layout, p_groups, d_groups) -> None:
    GENERATED["plan"] += 1
    local, remote, lslice, rslice = layout
    try:
        pairing = PairedLayout(local, remote, lslice, rslice)
    except (LayoutError, TopologyError):
        GENERATED["plan.layout_refused"] += 1
        return
    try:
        plan = pairing.plan(p_groups, d_groups)
    except (PlanError, LayoutError):
        GENERATED["plan.refused"] += 1
        return
    GENERATED["plan.planned"] += 1
    check_descriptors_inside(pairing, plan)
    # Exactly the blocks asked for: P's last ones into D's, expanded by each side's ratio.
    want_l, want_r = expected_indices(pairing, p_groups, d_groups)
    assert np.asarray(plan.local_idx).tolist() == want_l
    assert np.asarray(plan.remote_idx).tolist() == want_r


# ============================================================================================
# Live actors: the same bytes into a running pair's agents
# ============================================================================================
FUZZ_PAIR_CONFIG = {
    "lease_duration": 0.6,
    "registration_timeout": 1.0,
    "abort_quarantine": 0.8,
    "write_timeout": 0.3,
    "orphan_registration_ttl": 0.5,
    "reaper_tick": 0.02,
    "heartbeat_interval": 0.1,
    "handshake_timeout": 1.0,
}
SPEC = SimSpec(num_layers=2, num_blocks=64, block_bytes=512)


def _agent(engine: Any) -> Any:
    return engine.workers[0].runtime.writer.proxy().agent.get(timeout=5)


def _errors(pair: PushPair) -> dict[str, int]:
    out: Counter[str] = Counter()
    for engine in (pair.prefill, pair.decode):
        for w in engine.workers:
            out.update({k: v for k, v in w.stats().items() if k.endswith((".handler_error", ".died"))})
    return dict(out)


def _alive(pair: PushPair) -> bool:
    return all(
        w.healthy and all(ref.is_alive() for ref in w.runtime.refs.values())
        for engine in (pair.prefill, pair.decode)
        for w in engine.workers
    )


def _received(pair: PushPair) -> int:
    return sum(w.stats().get("notif.received", 0) for e in (pair.prefill, pair.decode) for w in e.workers)


def _one_request_lands(pair: PushPair, tag: str) -> None:
    p_id, d_id = f"{tag}-0-aaaaaaaa", f"{tag}-0-bbbbbbbb"
    params = pair.prefill.prefill(p_id, 5 * SPEC.block_size, key=tag)
    pair.decode.expect(d_id, 5 * SPEC.block_size, params, key=tag)
    pair.pump(lambda: d_id in pair.received and p_id in pair.sent, timeout=20, what=f"{tag} to land")
    assert pair.received[d_id] is None and pair.sent[p_id] is None, (pair.received[d_id], pair.sent[p_id])
    assert pair.decode.verify(d_id)[1] == 0
    pair.decode.finish_recv(d_id)


@pytest.fixture(scope="module")
def live_pair() -> Iterator[PushPair]:
    with PushPair(p_spec=SPEC, **FUZZ_PAIR_CONFIG) as pair:
        _one_request_lands(pair, "warm")  # both sides have handshaken: registrations get admitted
        yield pair


def live_registrations(pair: PushPair) -> st.SearchStrategy[bytes]:
    """Registrations that pass the sender check (D's real agent, D's real side channel)."""
    base = dict(REG_BASE)
    base.update(
        decode_host=pair.d_endpoint.host,
        decode_port=pair.d_endpoint.port,
        remote_host=pair.p_endpoint.host,
        remote_port=pair.p_endpoint.port,
    )
    return structured(PUSH_REG_PREFIX, base)


def test_fuzz_live_actors_survive_injected_notifications(live_pair: PushPair) -> None:
    pair = live_pair
    p_agent, d_agent = _agent(pair.prefill), _agent(pair.decode)
    fabric = pair.fabric
    senders = st.sampled_from([d_agent.name, p_agent.name, "stranger", ""])
    payloads = st.one_of(notifications, live_registrations(pair))
    before = _received(pair)
    injected = {"n": 0}

    @fuzz_settings(150, 4_000)
    @given(batch=st.lists(st.tuples(st.booleans(), senders, payloads), min_size=1, max_size=8))
    def inject(batch: list[tuple[bool, str, bytes]]) -> None:
        for to_p, sender, raw in batch:
            GENERATED["notification"] += 1
            GENERATED["live"] += 1
            injected["n"] += 1
            fabric.get(p_agent.name if to_p else d_agent.name).inject_notif(sender, raw)
        # Keep the engines stepping, as a real engine loop would while this goes on.
        pair.step()

    inject()
    wait_until(lambda: _received(pair) - before >= injected["n"], timeout=30, what="every injected notif polled")
    pair.pump(lambda: not pair.decode.has_pending_push_work(), timeout=10)
    stats: Counter[str] = Counter()
    for engine in (pair.prefill, pair.decode):
        for w in engine.workers:
            stats.update(w.stats())
    FINDINGS.update(
        {k: v for k, v in stats.items() if re.match(r"notif\.malformed$|reg\.|matcher\.|reaper\.|handshake\.", k)}
    )
    assert _alive(pair), "an actor died on injected notifications"
    assert not _errors(pair), f"handler errors on injected notifications: {_errors(pair)}"
    _one_request_lands(pair, "after-fuzz")
    pair.pump(pair.settled, timeout=10, what="the pair to settle after the fuzz")
    assert not pair.prefill.held


# ============================================================================================
# Random block ids end to end: refused with a push failure, never a WRITE outside memory
# ============================================================================================
def _poison(pair: PushPair) -> None:
    for t in pair.decode.kv[0].values():
        t.fill_(0xFF)


def _d_touched(pair: PushPair) -> bool:
    return any(bool((t != 0xFF).any()) for t in pair.decode.kv[0].values())


@pytest.fixture(scope="module")
def e2e_pair() -> Iterator[PushPair]:
    with PushPair(p_spec=SPEC, **FUZZ_PAIR_CONFIG) as pair:
        _one_request_lands(pair, "warm")
        yield pair


OUTSIDE = re.compile(r"outside registered memory|descriptor index out of range|not loaded|invalid param", re.I)


def test_fuzz_random_block_ids_end_to_end(e2e_pair: PushPair) -> None:
    pair = e2e_pair
    counter = {"i": 0}
    d_agent = _agent(pair.decode)
    p_fake = pair.fabric.get(_agent(pair.prefill).name)
    cap = SPEC.num_blocks

    @fuzz_settings(40, 500)
    @given(
        p_blocks=st.integers(1, 8),
        groups=st.lists(
            st.lists(
                st.one_of(st.integers(0, cap - 1), st.integers(cap, cap + 5), HUGE, st.integers(-3, -1)), max_size=9
            ),
            min_size=1,
            max_size=2,
        ),
        via_wire=st.booleans(),
    )
    def push(p_blocks: int, groups: list[list[int]], via_wire: bool) -> None:
        GENERATED["e2e"] += 1
        counter["i"] += 1
        i = counter["i"]
        p_id, d_id = f"e2e-{i}-0-aaaaaaaa", f"e2e-{i}-0-bbbbbbbb"
        _poison(pair)
        transfers = p_fake.calls["transfer"]
        params = pair.prefill.prefill(p_id, p_blocks * SPEC.block_size, key=p_id)
        block_groups: list[list[int]] = groups if len(groups) > 1 else groups[0]
        in_range = all(0 <= b < cap for g in groups for b in g)
        fits = len(groups) == 1 and len(groups[0]) <= p_blocks
        # Two positions in one D block would make one overwrite the other: refused everywhere
        # (D's scheduler, and P's decoding of the registration).
        distinct = all(len(set(g)) == len(g) for g in groups)
        wire_ok = all(0 <= b < 2**31 for g in groups for b in g) and distinct
        if via_wire:
            reg = dict(REG_BASE)
            reg.update(
                request_id=d_id,
                local_block_ids=block_groups,
                decode_host=pair.d_endpoint.host,
                decode_port=pair.d_endpoint.port,
                remote_host=pair.p_endpoint.host,
                remote_port=pair.p_endpoint.port,
            )
            p_fake.inject_notif(d_agent.name, PUSH_REG_PREFIX + _pack(reg))
        else:
            try:
                pair.decode.scheduler.stage_registration(d_id, block_groups, params)
            except ValueError:
                # Negative or non-int ids never leave D's scheduler.
                assert not wire_ok
                GENERATED["e2e.rejected_by_scheduler"] += 1
                pair.pump(lambda: p_id in pair.sent, timeout=10, what="P's lease to expire")
                return
            pair.decode.recvs[d_id] = RecvRecord(d_id, p_id, list(groups[0]), p_blocks - len(groups[0]))
        pair.pump(lambda: p_id in pair.sent and (via_wire or d_id in pair.received), timeout=10)
        why = pair.sent[p_id]
        assert why is None or not OUTSIDE.search(why), why
        if in_range and fits and wire_ok:
            # A valid registration: pushed, and exactly the right bytes landed.
            assert why is None, why
            if not via_wire:
                assert pair.received[d_id] is None
                assert pair.decode.verify(d_id)[1] == 0
            GENERATED["e2e.pushed"] += 1
        else:
            assert why is not None, f"P pushed into {groups} (capacity {cap}, P has {p_blocks} blocks)"
            assert not _d_touched(pair), "a refused push wrote into D's memory"
            if not wire_ok:
                assert via_wire and ("expire" in why or "lease" in why), why
                GENERATED["e2e.dropped_malformed"] += 1
            else:
                # Refused where it is first seen: D's staging (ids D does not have), P's admission
                # (ids beyond what D advertised; P's lease then ends it) or P's plan.
                assert "invalid WRITE" in why or "lease" in why, why
                assert p_fake.calls["transfer"] == transfers, "a WRITE was posted for a refused plan"
                GENERATED["e2e.refused"] += 1
            if not via_wire:
                assert pair.received[d_id], "D must fail a refused push with a reason"
        pair.decode.recvs.pop(d_id, None)

    push()
    pair.pump(pair.settled, timeout=10)
    assert _alive(pair) and not _errors(pair)
    assert not pair.prefill.held
    assert GENERATED["e2e.refused"] > 0 and GENERATED["e2e.pushed"] > 0
