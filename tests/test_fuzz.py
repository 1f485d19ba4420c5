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
    RUNS_SHARE,
    KVLayout,
    KVRegion,
    LayoutError,
    PairedLayout,
    PlanError,
    RemoteLayout,
    model_heads,
    physical_block_ids,
)
from pushactors.core.layout import BlockShape
from pushactors.core.topology import TopologyError, default_heads, rank_heads, write_heads, write_targets
from pushactors.protocol import (
    ABORT_PREFIX,
    HEARTBEAT_PREFIX,
    PROTOCOL_VERSION,
    PUSH_DIGEST_PREFIX,
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
    PushDigest,
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
    encode_push_digest,
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
NOTIFICATION_TYPES = (Registration, Completion, Heartbeat, PushFailure, Abort, PushDigest)
MALFORMED_KINDS = {"push_reg", "push_fail", "push_abort", "push_digest", "heartbeat", "completion", "notification"}


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
DIGEST_BASE: dict[str, Any] = {
    "type": "push_digest",
    "request_id": "r-0-aaaaaaaa",
    "generation": 1,
    "tp_rank": 0,
    "pp_rank": 0,
    "digest": [[5, 4096], [(1 << 64) - 1, 0]],
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
prefixes = st.sampled_from(
    [PUSH_REG_PREFIX, PUSH_FAIL_PREFIX, ABORT_PREFIX, PUSH_DIGEST_PREFIX, HEARTBEAT_PREFIX, b"", b"PUSH_", b"HB"]
)
notifications = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda p, b: p + b, prefixes, st.binary(max_size=128)),
    st.builds(lambda p, v: p + _pack(v), prefixes, msgpack_value),
    structured(PUSH_REG_PREFIX, REG_BASE),
    structured(PUSH_REG_PREFIX, REG_BASE),
    structured(PUSH_FAIL_PREFIX, FAIL_BASE),
    structured(ABORT_PREFIX, ABORT_BASE),
    structured(PUSH_DIGEST_PREFIX, DIGEST_BASE),
    completions,
    heartbeats,
)


# ============================================================================================
# decode_notification
# ============================================================================================
def check_notification(raw: bytes) -> object | None:
    """Decode ``raw``; a valid message must also be well-formed by every rule of docs/protocol.md, 'Wire formats'."""
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
        again = encode_completion(
            msg.request_id, msg.tp_size, msg.generation, msg.digest, digest_follows=msg.digest_follows
        )
        assert decode_notification(again) == msg
    elif isinstance(msg, Heartbeat):
        assert msg.ids and all(i and "," not in i for i in msg.ids)
        assert decode_notification(encode_heartbeat(msg.ids)) == msg
    elif isinstance(msg, PushFailure):
        assert msg.request_id
        assert decode_notification(encode_push_failure(msg)) == msg
    elif isinstance(msg, PushDigest):
        assert msg.request_id and len(msg.digest) <= 64
        assert all(0 <= d < 1 << 64 and 0 <= n < 1 << 63 for d, n in msg.digest)
        assert decode_notification(encode_push_digest(msg)) == msg
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
            # What the writer does as P rank 0 of 1, which writes every D rank.
            kv_heads = model_heads(local, remote, 1, remote.tp_size)
            heads = write_heads(0, 1, remote.tp_rank, remote.tp_size, kv_heads)
            pairing = PairedLayout(local, (0, 1), remote, heads, kv_heads)
        except (LayoutError, TopologyError):
            return info
        check_descriptors_inside(pairing, pairing.plan(((0, 1),), ((0,),)) if _fits(pairing) else None)
    return info


def _fits(pairing: PairedLayout) -> bool:
    return all(r.num_blocks >= 2 for r in pairing.local.regions) and all(
        pairing.remote.regions[k.remote].num_blocks >= 1 for k in pairing.links
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
def layouts(draw: st.DrawFn) -> tuple[KVLayout, RemoteLayout, tuple[int, int], int]:
    """A P rank's layout, one D rank's, P's (tp_rank, tp_size) and the model's KV head count;
    mostly pairable (so plans get exercised). Regions are opaque: heads outermost."""
    named = draw(st.booleans())
    n = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 2))
    names = [f"layer.{i}" for i in range(n)]
    p_tp, d_tp = draw(st.sampled_from([(1, 1), (1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (8, 2)]))
    p_rank = draw(st.integers(0, p_tp - 1))
    targets = write_targets(p_rank, p_tp, d_tp)
    # Mostly a D rank this P rank writes; sometimes one it does not (refused).
    d_rank = draw(st.sampled_from(targets)) if draw(st.integers(0, 19)) else draw(st.integers(0, d_tp - 1))
    valid = [h for h in range(1, 17) if all(h % tp == 0 or tp % h == 0 for tp in (p_tp, d_tp))]
    kv_heads = draw(
        st.one_of(
            st.just(default_heads(p_tp, d_tp)),  # an opaque layout that does not say
            st.just(default_heads(p_tp, d_tp)),
            st.just(default_heads(p_tp, d_tp, replicated=True)),  # MLA
            st.sampled_from(valid),  # GQA and more heads than ranks
            st.integers(1, 16),  # mostly valid, sometimes not
        )
    )
    unit = draw(st.sampled_from([8, 16, 24, 64]))  # bytes of one head's slice of a block
    odd = draw(st.integers(0, 19)) == 0  # a block length that does not pair

    def rank_count(rank: int, tp: int) -> int:
        try:
            return len(rank_heads(rank, tp, kv_heads))
        except TopologyError:
            return 1

    def regions(ratio: int, order: list[int], heads: int) -> tuple[KVRegion, ...]:
        out = []
        base = draw(st.integers(0, 2**44))
        for i in order:
            block_len = unit * heads + (8 if odd and i == order[0] else 0)
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

    # (P kernel blocks per block, D's, D's block size): P's blocks are 16 tokens. Mostly equal
    # kernel blocks (opaque blocks pair only then), D's blocks as large, larger or smaller.
    p_ratio, d_ratio, d_block_size = draw(
        st.sampled_from(
            [(1, 1, 16)] * 4
            + [(2, 2, 16), (4, 4, 16), (1, 2, 32), (1, 2, 32), (2, 1, 8), (2, 1, 8)]
            + [(1, 1, 32), (2, 1, 16), (1, 4, 16)]
        )
    )
    local_regions = regions(p_ratio, list(range(n)), rank_count(p_rank, p_tp))
    order = draw(st.permutations(list(range(n)))) if named else list(range(n))
    if named and n > 1 and draw(st.integers(0, 9)) == 0:
        order = order[:-1]  # the remote omits a layer
    remote_regions = regions(d_ratio, order, rank_count(d_rank, d_tp))
    local = KVLayout(
        regions=local_regions, mem_type="DRAM", block_size=16, physical_blocks_per_logical=p_ratio, num_groups=groups
    )
    remote = RemoteLayout(
        engine_id="decode",
        agent_name="d",
        regions=remote_regions,
        block_size=d_block_size,
        physical_blocks_per_logical=d_ratio,
        tp_size=d_tp,
        tp_rank=d_rank,
        pp_size=1,
        pp_rank=0,
        mem_type="DRAM",
    )
    return local, remote, (p_rank, p_tp), kv_heads


@st.composite
def plan_inputs(draw: st.DrawFn, block_ids: st.SearchStrategy[int]) -> tuple[Any, Any, Any, Any]:
    layout = draw(layouts())
    local, remote = layout[0], layout[1]

    def ids(regions: tuple[KVRegion, ...], g: int, ratio: int) -> st.SearchStrategy[int]:
        """``block_ids``, or for most lists ids inside the group's capacity (so plans get made)."""
        cap = _capacity(regions, g, ratio)
        return st.integers(0, cap - 1) if cap and draw(st.integers(0, 3)) else block_ids

    n = local.num_groups if draw(st.integers(0, 9)) else draw(st.integers(1, 3))
    p_ids = [ids(local.regions, g, local.physical_blocks_per_logical) for g in range(n)]
    p_groups = tuple(tuple(draw(st.lists(p_ids[g], max_size=10))) for g in range(n))
    if draw(st.integers(0, 9)):
        n = len(p_groups)
    d_groups = []
    for g in range(n):
        p = p_groups[g] if g < len(p_groups) else ()
        # Mostly D's uncached suffix of P's count, sometimes more blocks than P has.
        count = draw(st.integers(0, len(p))) if draw(st.integers(0, 7)) else draw(st.integers(0, 12))
        d_ids = ids(remote.regions, g, remote.physical_blocks_per_logical)
        d_groups.append(tuple(draw(st.lists(d_ids, min_size=count, max_size=count))))
    # Mostly no prefix counts (D's blocks are the last ones); sometimes D says how many it had.
    skips: tuple[int, ...] = ()
    if not draw(st.integers(0, 3)):
        k = n if draw(st.integers(0, 9)) else draw(st.integers(1, 3))
        skips = tuple(draw(st.integers(-1, 12)) for _ in range(k))
    return layout, p_groups, tuple(d_groups), skips


def _row_table(pairing: PairedLayout, remote: bool) -> list[tuple[int, int, KVRegion, list[int], list[int]]]:
    """Per link: (first row, row count, region, entry offsets, entry lengths), in Python ints."""
    out = []
    for k in pairing.links:
        region = (pairing.remote.regions[k.remote]) if remote else pairing.local.regions[k.local]
        offs = (k.template.roff if remote else k.template.loff).tolist()
        out.append(
            (
                k.remote_base if remote else k.local_base,
                region.num_blocks * len(offs),
                region,
                offs,
                k.template.length.tolist(),
            )
        )
    return out


def _locate(table: list[tuple[int, int, KVRegion, list[int], list[int]]], i: int) -> tuple[int, int, int]:
    """Row ``i`` → (link, physical block, template entry)."""
    for link, (first, count, _, offs, _) in enumerate(table):
        if first <= i < first + count:
            b, e = divmod(i - first, len(offs))
            return link, b, e
    raise AssertionError(f"row {i} belongs to no link")


def _check_rows(descs: np.ndarray, table: list[tuple[int, int, KVRegion, list[int], list[int]]]) -> None:
    """Every prepared row is where the layout says: base + b*len(template) + e, inside block b."""
    rows = descs.tolist()
    assert len(rows) == sum(count for _, count, _, _, _ in table)
    for first, count, region, offs, lens in table:
        for b in range(region.num_blocks):
            for e, (off, length) in enumerate(zip(offs, lens, strict=True)):
                assert 0 <= off and 0 < length and off + length <= region.block_len, (region, off, length)
                row = rows[first + b * len(offs) + e]
                assert row == [region.base_addr + b * region.stride + off, length, region.device_id], (row, region)
        assert first + count <= len(rows)


def check_descriptors_inside(pairing: PairedLayout, plan: Any) -> None:
    local_all, remote_all = pairing.local_descriptors(), pairing.remote_descriptors()
    ltab, rtab = _row_table(pairing, False), _row_table(pairing, True)
    _check_rows(local_all, ltab)
    _check_rows(remote_all, rtab)
    assert (len(local_all), len(remote_all)) == (pairing.local_rows, pairing.remote_rows)
    if plan is None:
        return
    li, ri = np.asarray(plan.local_idx).tolist(), np.asarray(plan.remote_idx).tolist()
    assert len(li) == len(ri) == plan.num_descs
    nbytes = 0
    for i, j in zip(li, ri, strict=True):
        assert 0 <= i < len(local_all) and 0 <= j < len(remote_all), (i, j)
        (ll, lb, le), (rl, rb, re_) = _locate(ltab, i), _locate(rtab, j)
        # 1:1: the same entry of the same link on both sides, of equal length (as NIXL requires)
        assert (ll, le) == (rl, re_), (i, j)
        assert local_all[i][1] == remote_all[j][1]
        assert lb < ltab[ll][2].num_blocks and rb < rtab[rl][2].num_blocks
        nbytes += int(local_all[i][1])
    assert nbytes == plan.nbytes


def check_runs(pairing: PairedLayout, p_groups, d_groups, skips, plan: Any) -> None:
    """The plan asked to merge posts, as explicit rows, exactly the pieces of the indexed plan
    joined where they are contiguous on both sides (in Python integers, in plan order), and
    it does so exactly when the runs within links are at most RUNS_SHARE of the pieces."""
    merged = pairing.plan(p_groups, d_groups, skips, merge=True)
    assert (merged.nbytes, merged.num_descs, merged.num_blocks) == (plan.nbytes, plan.num_descs, plan.num_blocks)
    if plan.num_descs == 0:
        assert merged.runs is None
        return
    ltab = _row_table(pairing, False)
    local_all, remote_all = pairing.local_descriptors().tolist(), pairing.remote_descriptors().tolist()
    pieces = [
        (_locate(ltab, i)[0], local_all[i], remote_all[j])
        for i, j in zip(np.asarray(plan.local_idx).tolist(), np.asarray(plan.remote_idx).tolist(), strict=True)
    ]
    joined: list[list[int]] = []  # [local addr, remote addr, length, local dev, remote dev]
    prev_link = None
    for link, (la, n, ld), (ra, n2, rd) in pieces:
        assert n == n2
        last = joined[-1] if joined else None
        if (
            last is not None
            and link == prev_link  # never across regions: they may be separate registrations
            and last[0] + last[2] == la
            and last[1] + last[2] == ra
        ):
            last[2] += n
        else:
            joined.append([la, ra, n, ld, rd])
        prev_link = link
    assert merged.merged_descs == plan.merged_descs <= len(joined)
    if len(joined) > int(plan.num_descs * RUNS_SHARE):
        assert merged.runs is None and merged.posted_descs == plan.num_descs
        GENERATED["runs.declined"] += 1
        return
    assert merged.runs is not None and merged.posted_descs == len(joined)
    local, remote = merged.runs
    assert local.tolist() == [[la, n, ld] for la, _, n, ld, _ in joined]
    assert remote.tolist() == [[ra, n, rd] for _, ra, n, _, rd in joined]
    GENERATED["runs.posted"] += 1


def _capacity(regions: tuple[KVRegion, ...], group: int, ratio: int) -> int:
    caps = [r.num_blocks for r in regions if r.group == group]
    return (min(caps) if caps else 0) // ratio


def refusal_reason(pairing: PairedLayout, p_groups, d_groups, skips) -> str | None:
    """Why a plan must be refused, from the inputs alone (None: it must not be)."""
    local, remote = pairing.local, pairing.remote
    if len(p_groups) != len(d_groups) or (skips and len(skips) != len(d_groups)):
        return "group counts"
    bs_p, bs_d = local.block_size, remote.block_size
    for g, (p, d) in enumerate(zip(p_groups, d_groups, strict=True)):
        if any(not 0 <= b < _capacity(local.regions, g, local.physical_blocks_per_logical) for b in p):
            return "P block out of range"
        if any(not 0 <= b < _capacity(remote.regions, g, remote.physical_blocks_per_logical) for b in d):
            return "D block out of range"
        total = -(-len(p) * bs_p // bs_d)
        if not skips and bs_d % bs_p:
            return "D's blocks are smaller and it did not say its prefix"
        skip = skips[g] if skips else total - len(d)
        if skip < 0 or skip + len(d) > total:
            return "D asks for more than P has"
    if any(local.regions[k.local].group >= len(d_groups) for k in pairing.links):
        return "a linked region's group not registered"
    return None


def expected_indices(pairing: PairedLayout, p_groups, d_groups, skips) -> tuple[list[int], list[int]]:
    """The descriptor indices a plan must produce, in Python integers (no overflow): D's blocks
    at their token positions, each fed by P's physical block at the same tokens."""
    local, remote = pairing.local, pairing.remote
    lr, rr = local.physical_blocks_per_logical, remote.physical_blocks_per_logical
    t = local.tokens_per_block
    loc: list[int] = []
    rem: list[int] = []
    for k in pairing.links:
        n = len(k.template)
        assert n == 1  # an opaque block's heads are one contiguous run on both sides
        assert t == remote.tokens_per_block  # opaque blocks pair only at equal token counts
        g = local.regions[k.local].group
        p, d = p_groups[g], d_groups[g]
        lp = [b * lr + i for b in p for i in range(lr)]
        rp = [b * rr + i for b in d for i in range(rr)]
        total = -(-len(p) * local.block_size // remote.block_size)
        skip = skips[g] if skips else total - len(d)
        first = skip * remote.block_size // t
        for q, rb in enumerate(rp):
            if first + q < len(lp):
                loc.append(k.local_base + lp[first + q] * n)
                rem.append(k.remote_base + rb * n)
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


def check_plan(layout, p_groups, d_groups, skips) -> None:
    GENERATED["plan"] += 1
    local, remote, (p_rank, p_tp), kv_heads = layout
    try:
        heads = write_heads(p_rank, p_tp, remote.tp_rank, remote.tp_size, kv_heads)
        pairing = PairedLayout(local, (p_rank, p_tp), remote, heads, kv_heads)
    except (LayoutError, TopologyError):
        GENERATED["plan.layout_refused"] += 1
        return
    if not heads:
        GENERATED["plan.no_heads"] += 1
    try:
        plan = pairing.plan(p_groups, d_groups, skips)
    except (PlanError, LayoutError) as exc:
        GENERATED["plan.refused"] += 1
        assert refusal_reason(pairing, p_groups, d_groups, skips) is not None, f"refused without cause: {exc}"
        return
    GENERATED["plan.planned"] += 1
    assert refusal_reason(pairing, p_groups, d_groups, skips) is None
    check_descriptors_inside(pairing, plan)
    check_runs(pairing, p_groups, d_groups, skips, plan)
    # Exactly the blocks asked for: P's blocks at D's token positions, expanded by each side's ratio.
    want_l, want_r = expected_indices(pairing, p_groups, d_groups, skips)
    assert np.asarray(plan.local_idx).tolist() == want_l
    assert np.asarray(plan.remote_idx).tolist() == want_r


# --------------------------------------------------------------------------------------------
# Described (structured) layouts: every byte of the plan checked for what it means
# --------------------------------------------------------------------------------------------
# Per-layer pages with K|V side by side (vLLM NHD / HND), K and V in separate regions, and
# block-outermost (every layer in one block).
STRUCTURED_DIMS = ["NHC", "HNC", "NHD/split", "HND/split", "LNHC", "LHNC"]


def _side_regions(
    draw: st.DrawFn, dims: str, names: list[str], tokens: int, heads: int, dim: int, es: int, packed: bool = False
) -> tuple[KVRegion, ...]:
    split = dims.endswith("/split")
    dims = dims.removesuffix("/split")
    sizes = {"L": len(names), "N": tokens, "H": heads, "C": 2 * dim, "D": dim}
    shape_sizes = [sizes[c] for c in dims]
    strides = [int(np.prod(shape_sizes[i + 1 :], dtype=np.int64)) for i in range(len(dims))]
    shape = BlockShape.from_dims(dims, shape_sizes, strides, es)
    nblocks = draw(st.integers(4, 24))
    base = draw(st.integers(0, 2**44))
    out = []
    parts: list[tuple[tuple[str, ...], int | None]]
    if "L" in dims:
        parts = [(tuple(names), None)]
    else:
        parts = [((n,), kv) for n in names for kv in ((0, 1) if split else (None,))]
    for members, kv in parts:
        stride = shape.extent + (0 if packed else draw(st.sampled_from([0, 0, 16, 512])))
        out.append(KVRegion(base, shape.extent, stride, nblocks, members=members, shape=shape, kv_part=kv))
        base += stride * nblocks + draw(st.sampled_from([0, 0, 64]) if packed else st.integers(0, 4096))
    return tuple(out)


@st.composite
def structured_cases(draw: st.DrawFn, packed: bool = False) -> tuple[Any, ...]:
    """Two described layouts that must pair, and block ids D could register (distinct, in range).
    ``packed``: one layout on both sides, blocks back to back, regions often too, ids
    consecutive (a fresh pool)."""
    names = [f"layer.{i}" for i in range(draw(st.integers(1, 3)))]
    p_tp, d_tp = draw(st.sampled_from([(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4), (8, 2)]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if all(h % t == 0 or t % h == 0 for t in (p_tp, d_tp))]))
    p_rank = draw(st.integers(0, p_tp - 1))
    d_rank = draw(st.sampled_from(write_targets(p_rank, p_tp, d_tp)))
    dim, es = draw(st.sampled_from([2, 4, 8])), draw(st.sampled_from([1, 2]))
    # P: 16-token blocks of 1 or 2 kernel blocks; D: 8, 16 or 32 tokens of 1 or 2.
    p_ratio = draw(st.sampled_from([1, 2]))
    d_block_size, d_ratio = draw(st.sampled_from([(16, 1), (16, 2), (32, 1), (32, 2), (8, 1)]))
    p_dims = draw(st.sampled_from(STRUCTURED_DIMS))
    local = KVLayout(
        regions=_side_regions(
            draw,
            p_dims,
            names,
            16 // p_ratio,
            len(rank_heads(p_rank, p_tp, kv_heads)),
            dim,
            es,
            packed,
        ),
        mem_type="DRAM",
        block_size=16,
        physical_blocks_per_logical=p_ratio,
        kv_heads=kv_heads,
    )
    remote = RemoteLayout(
        engine_id="decode",
        agent_name="d",
        regions=_side_regions(
            draw,
            p_dims if packed else draw(st.sampled_from(STRUCTURED_DIMS)),
            names,
            d_block_size // d_ratio,
            len(rank_heads(d_rank, d_tp, kv_heads)),
            dim,
            es,
            packed,
        ),
        block_size=d_block_size,
        physical_blocks_per_logical=d_ratio,
        tp_size=d_tp,
        tp_rank=d_rank,
        pp_size=1,
        pp_rank=0,
        mem_type="DRAM",
        kv_heads=kv_heads,
    )
    p_cap = _capacity(local.regions, 0, p_ratio)
    d_cap = _capacity(remote.regions, 0, d_ratio)
    # Half the cases take consecutive ids on both sides (a fresh pool): pieces join into runs.
    in_order = packed or draw(st.booleans())
    if in_order:
        k = draw(st.integers(0, min(8, p_cap)))
        start = draw(st.integers(0, p_cap - k))
        p_ids = list(range(start, start + k))
    else:
        p_ids = draw(st.lists(st.integers(0, p_cap - 1), unique=True, max_size=min(8, p_cap)))
    total = -(-len(p_ids) * 16 // d_block_size)
    d_count = draw(st.integers(0, min(total, d_cap)))
    if in_order:
        start = draw(st.integers(0, d_cap - d_count))
        d_ids = list(range(start, start + d_count))
    else:
        d_ids = draw(st.lists(st.integers(0, d_cap - 1), unique=True, min_size=d_count, max_size=d_count))
    # D's blocks are the last ones unless it says how many it had cached (it must when smaller).
    skips: tuple[int, ...] = ()
    if d_block_size < 16 or draw(st.booleans()):
        skips = (draw(st.integers(0, total - d_count)),)
    return local, remote, (p_rank, p_tp), kv_heads, (tuple(p_ids),), (tuple(d_ids),), skips


def _decode(region: KVRegion, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """Element offsets in a block → index per axis (every axis, 0 where absent)."""
    shape = region.shape
    assert shape is not None
    rest = offsets.astype(np.int64)
    out = {a: np.zeros(len(rest), dtype=np.int64) for a in ("layer", "kv", "token", "head", "dim")}
    for a in sorted((a for a in shape.axes if a.size > 1), key=lambda a: -a.stride):
        idx = rest // a.stride
        assert (idx < a.size).all(), (a, offsets)
        out[a.name] = idx
        rest = rest - idx * a.stride
    assert (rest == 0).all(), "a descriptor starts inside an element"
    if region.kv_part is not None:
        out["kv"] = np.full(len(rest), region.kv_part, dtype=np.int64)
    return out


def _meaning(
    pairing: PairedLayout, remote: bool, rows: list[int], blocks: list[int], first_token: int, first_head: int
) -> list[tuple[str, int, int, int, int]]:
    """(layer, K/V, token, global head, dim) of every element the rows ``rows`` cover.
    ``blocks``: the side's physical block ids in token order, from token ``first_token``;
    ``first_head``: the global index of the side's head 0."""
    table = _row_table(pairing, remote)
    tokens = (pairing.remote if remote else pairing.local).tokens_per_block
    where = {b: i for i, b in enumerate(blocks)}
    out = []
    for i in rows:
        link, b, e = _locate(table, i)
        _, _, region, offs, lens = table[link]
        assert region.shape is not None
        es = region.shape.elem_size
        idx = _decode(region, offs[e] + np.arange(0, lens[e], es, dtype=np.int64))
        token0 = first_token + where[b] * tokens
        axes = (idx[a].tolist() for a in ("layer", "kv", "token", "head", "dim"))
        for layer, kv, tok, head, d in zip(*axes, strict=True):
            out.append((region.layer_names[layer][0], kv, token0 + tok, first_head + head, d))
    return out


@fuzz_settings(300, 10_000)
@given(case=structured_cases())
def test_fuzz_structured_plan_moves_each_element_once_to_its_place(case: tuple[Any, ...]) -> None:
    """Described layouts on both sides (NHD against HND, K/V together or apart, block-outermost;
    hetero TP, GQA, MLA; different tokens per block): the plan is accepted, its rows pair 1:1
    inside registered memory, and every element it writes into D is the element of the same
    layer, K/V half, token, head and dim in P — each element of D's share of the written heads
    for P's tokens exactly once, nothing else."""
    GENERATED["structured"] += 1
    local, remote, p_rank, kv_heads, p_groups, d_groups, skips = case
    heads = write_heads(p_rank[0], p_rank[1], remote.tp_rank, remote.tp_size, kv_heads)
    pairing = PairedLayout(local, p_rank, remote, heads, kv_heads)
    plan = pairing.plan(p_groups, d_groups, skips)
    check_descriptors_inside(pairing, plan)
    check_runs(pairing, p_groups, d_groups, skips, plan)
    if not heads:
        assert plan.num_descs == 0
        GENERATED["structured.no_heads"] += 1
        return
    (p,), (d,) = p_groups, d_groups
    total = -(-len(p) * local.block_size // remote.block_size)
    first = (skips[0] if skips else total - len(d)) * remote.block_size
    lp = physical_block_ids(p, local.physical_blocks_per_logical).tolist()
    rp = physical_block_ids(d, remote.physical_blocks_per_logical).tolist()
    li, ri = np.asarray(plan.local_idx).tolist(), np.asarray(plan.remote_idx).tolist()
    src = _meaning(pairing, False, li, lp, 0, rank_heads(p_rank[0], p_rank[1], kv_heads).start)
    dst = _meaning(pairing, True, ri, rp, first, rank_heads(remote.tp_rank, remote.tp_size, kv_heads).start)
    assert src == dst, "an element lands at another layer, K/V half, token, head or dim"
    # Exactly once: every element of the written heads, for the tokens D registered that P has.
    last = min(first + len(rp) * remote.tokens_per_block, len(p) * local.block_size)
    dim = remote.regions[0].shape.size("dim")  # type: ignore[union-attr]
    want = sorted(
        (name, kv, tok, h, x)
        for name in sorted({n for r in local.regions for names in r.layer_names for n in names})
        for kv in (0, 1)
        for tok in range(first, last)
        for h in heads
        for x in range(dim)
    )
    assert sorted(dst) == want
    GENERATED["structured.planned"] += 1


@fuzz_settings(300, 10_000)
@given(case=structured_cases(packed=True))
def test_fuzz_runs_are_the_indexed_pieces_joined(case: tuple[Any, ...]) -> None:
    """Blocks in order in packed regions (every TP pairing and layout): a WRITE posted as runs
    moves exactly the bytes of the one-descriptor-per-piece WRITE, piece for piece."""
    local, remote, p_rank, kv_heads, p_groups, d_groups, skips = case
    heads = write_heads(p_rank[0], p_rank[1], remote.tp_rank, remote.tp_size, kv_heads)
    pairing = PairedLayout(local, p_rank, remote, heads, kv_heads)
    check_runs(pairing, p_groups, d_groups, skips, pairing.plan(p_groups, d_groups, skips))
    GENERATED["runs"] += 1


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
