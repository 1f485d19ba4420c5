"""Wire protocol (docs/protocol.md, 'Wire formats'): notifications, handshake payloads and kv_transfer_params.

Decoding is validation: every malformed input raises MalformedMessage / HandshakeError and
nothing else.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushactors.protocol import (
    ABORT_PREFIX,
    HEARTBEAT_PREFIX,
    MAX_NOTIF_BYTES,
    PROTOCOL_VERSION,
    PUSH_DIGEST_PREFIX,
    PUSH_FAIL_PREFIX,
    PUSH_REG_PREFIX,
    RESERVED_ID_PREFIXES,
    Abort,
    AgentInfo,
    ClockSample,
    CompatSpec,
    Completion,
    HandshakeEnvelope,
    HandshakeError,
    HandshakeRequest,
    Heartbeat,
    KVTransferParams,
    MalformedMessage,
    PushFailure,
    RegionInfo,
    Registration,
    RequestId,
    check_request_id,
    compatibility_hash,
    decode_handshake,
    decode_handshake_request,
    decode_notification,
    encode_abort,
    encode_completion,
    encode_handshake,
    encode_handshake_request,
    encode_heartbeat,
    encode_push_failure,
    encode_registration,
    notification_kind,
    parse_kv_transfer_params,
)

pack = msgspec.msgpack.encode

NOTIFICATION_TYPES = (Registration, Completion, Heartbeat, PushFailure, Abort)


def reg_fields(**overrides: Any) -> dict[str, Any]:
    """A valid registration as a plain map (what another implementation would send)."""
    fields: dict[str, Any] = {
        "request_id": "cmpl-abc-0-1a2b3c4d",
        "decode_engine_id": "engine-D",
        "decode_host": "10.0.0.2",
        "decode_port": 5601,
        "decode_tp_size": 2,
        "decode_tp_rank": 1,
        "local_block_ids": [3, 4, 5],
        "remote_engine_id": "engine-P",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_tp_size": 4,
        "remote_pp_size": 2,
    }
    fields.update(overrides)
    return fields


def make_reg(**overrides: Any) -> Registration:
    return Registration(**reg_fields(**overrides))


def raw_reg(**overrides: Any) -> bytes:
    return PUSH_REG_PREFIX + pack(reg_fields(**overrides))


def assert_skipped_or_malformed(decode: Any, plain: Any, depth: int, error: type[Exception] = MalformedMessage) -> None:
    """``decode()`` of a message with a deeply nested unknown field: the message as if the field
    were absent (``plain``), or ``error`` (always past 10,000 levels); nothing else escapes."""
    try:
        got = decode()
    except error:
        return
    assert depth < 10_000, f"{depth} levels were not refused"
    assert got == plain


def assert_malformed(raw: bytes, kind: str) -> MalformedMessage:
    with pytest.raises(MalformedMessage) as info:
        decode_notification(raw)
    assert info.value.kind == kind
    assert info.value.reason
    return info.value


# ============================================================================================
# Registration
# ============================================================================================
def test_registration_flat_list_is_one_group_and_round_trips() -> None:
    reg = make_reg(local_block_ids=[7, 8, 9])
    assert reg.block_groups == ((7, 8, 9),)
    assert reg.local_block_ids == ((7, 8, 9),)
    assert reg.num_blocks == 3
    wire = encode_registration(reg)
    assert wire.startswith(PUSH_REG_PREFIX)
    assert notification_kind(wire) == "push_reg"
    back = decode_notification(wire)
    assert isinstance(back, Registration)
    assert back == reg
    assert back.block_groups == ((7, 8, 9),)
    assert back.transfer_id is None
    assert back.remote_request_id is None


def test_registration_nested_lists_are_groups() -> None:
    reg = make_reg(local_block_ids=[[1, 2], [10, 11, 12], []])
    assert reg.block_groups == ((1, 2), (10, 11, 12), ())
    assert reg.num_blocks == 5
    back = decode_notification(encode_registration(reg))
    assert isinstance(back, Registration)
    assert back.block_groups == ((1, 2), (10, 11, 12), ())
    assert back == reg


def test_registration_empty_block_list_is_one_empty_group() -> None:
    reg = decode_notification(raw_reg(local_block_ids=[]))
    assert isinstance(reg, Registration)
    assert reg.block_groups == ((),)
    assert reg.num_blocks == 0


def test_registration_optional_ids_round_trip() -> None:
    reg = make_reg(transfer_id="xfer-1", remote_request_id="cmpl-abc-0-ffffeeee")
    back = decode_notification(encode_registration(reg))
    assert isinstance(back, Registration)
    assert back.transfer_id == "xfer-1"
    assert back.remote_request_id == "cmpl-abc-0-ffffeeee"
    assert back == reg


def test_registration_from_a_plain_map_decodes_with_defaults() -> None:
    """Another implementation sends a plain msgpack map, without our tag or optional fields."""
    fields = reg_fields()
    del fields["decode_tp_rank"]
    del fields["remote_pp_size"]
    fields["some_future_field"] = {"x": 1}
    reg = decode_notification(PUSH_REG_PREFIX + pack(fields))
    assert isinstance(reg, Registration)
    assert reg.request_id == "cmpl-abc-0-1a2b3c4d"
    assert reg.decode_tp_rank == 0
    assert reg.remote_pp_size == 1
    assert reg.decode_port == 5601
    assert reg.remote_tp_size == 4
    assert reg.block_groups == ((3, 4, 5),)


def test_registration_accepts_bytearray_and_memoryview() -> None:
    wire = encode_registration(make_reg())
    assert decode_notification(bytearray(wire)) == make_reg()
    assert decode_notification(memoryview(wire)) == make_reg()


def test_registration_block_ids_at_the_limit_are_accepted() -> None:
    reg = decode_notification(raw_reg(local_block_ids=[0, 2**31 - 1]))
    assert isinstance(reg, Registration)
    assert reg.block_groups == ((0, 2**31 - 1),)


def _without(field: str) -> bytes:
    fields = reg_fields()
    del fields[field]
    return PUSH_REG_PREFIX + pack(fields)


MALFORMED_REGISTRATIONS: dict[str, bytes] = {
    "not msgpack": PUSH_REG_PREFIX + b"\xc1\xc1\xc1",
    "truncated msgpack": raw_reg()[:-3],
    "empty body": PUSH_REG_PREFIX,
    "trailing bytes": raw_reg() + b"\x00",
    "msgpack list": PUSH_REG_PREFIX + pack([1, 2, 3]),
    "msgpack list of the fields": PUSH_REG_PREFIX + pack(list(reg_fields().values())),
    "msgpack int": PUSH_REG_PREFIX + pack(42),
    "msgpack str": PUSH_REG_PREFIX + pack("request"),
    "msgpack nil": PUSH_REG_PREFIX + pack(None),
    "msgpack bytes": PUSH_REG_PREFIX + pack(b"abc"),
    "missing request_id": _without("request_id"),
    "missing local_block_ids": _without("local_block_ids"),
    "missing decode_engine_id": _without("decode_engine_id"),
    "missing remote_engine_id": _without("remote_engine_id"),
    "missing decode_port": _without("decode_port"),
    "int request_id": raw_reg(request_id=12),
    "bytes request_id": raw_reg(request_id=b"cmpl"),
    "nil request_id": raw_reg(request_id=None),
    "list request_id": raw_reg(request_id=["cmpl"]),
    "empty request_id": raw_reg(request_id=""),
    "request_id with comma": raw_reg(request_id="a,b"),
    "request_id with newline": raw_reg(request_id="a\nb"),
    "request_id with NUL": raw_reg(request_id="a\x00b"),
    "request_id too long": raw_reg(request_id="r" * 1025),
    "transfer_id with comma": raw_reg(transfer_id="x,y"),
    "empty transfer_id": raw_reg(transfer_id=""),
    "negative block id": raw_reg(local_block_ids=[1, -1, 2]),
    "negative block id in a group": raw_reg(local_block_ids=[[1], [-5]]),
    "float block id": raw_reg(local_block_ids=[1.0]),
    "str block id": raw_reg(local_block_ids=["1"]),
    "bool block id": raw_reg(local_block_ids=[True]),
    "bool block id in a group": raw_reg(local_block_ids=[[0, False]]),
    "nil block id": raw_reg(local_block_ids=[None]),
    "block id 2**31": raw_reg(local_block_ids=[2**31]),
    "block id 2**63": raw_reg(local_block_ids=[2**63]),
    "block id 2**64-1": raw_reg(local_block_ids=[2**64 - 1]),
    "mixed flat and nested": raw_reg(local_block_ids=[1, [2, 3]]),
    "mixed nested and flat": raw_reg(local_block_ids=[[2, 3], 1]),
    "three levels": raw_reg(local_block_ids=[[[1]]]),
    "block ids not a list": raw_reg(local_block_ids=5),
    "block ids a map": raw_reg(local_block_ids={"0": [1]}),
    "too many groups": raw_reg(local_block_ids=[[i] for i in range(65)]),
    "decode_tp_rank == decode_tp_size": raw_reg(decode_tp_size=2, decode_tp_rank=2),
    "decode_tp_rank > decode_tp_size": raw_reg(decode_tp_size=1, decode_tp_rank=3),
    "decode_tp_size 0": raw_reg(decode_tp_size=0, decode_tp_rank=0),
    "negative decode_tp_rank": raw_reg(decode_tp_rank=-1),
    "str port": raw_reg(decode_port="5601"),
    "float port": raw_reg(remote_port=5600.0),
    "port over 65535": raw_reg(decode_port=65536),
    "negative port": raw_reg(remote_port=-1),
    "remote_tp_size 0": raw_reg(remote_tp_size=0),
    "remote_pp_size 0": raw_reg(remote_pp_size=0),
    "empty engine id": raw_reg(remote_engine_id=""),
    "wrong tag": raw_reg(type="push_fail"),
    "map with non-str keys": PUSH_REG_PREFIX + pack({1: 2, 3: 4}),
}


@pytest.mark.parametrize("raw", MALFORMED_REGISTRATIONS.values(), ids=MALFORMED_REGISTRATIONS.keys())
def test_malformed_registration_is_rejected(raw: bytes) -> None:
    assert notification_kind(raw) == "push_reg"
    assert_malformed(raw, "push_reg")


def test_registration_over_the_size_limit_is_rejected() -> None:
    # a valid registration padded with an ignored field to just over the limit
    pad = MAX_NOTIF_BYTES - len(raw_reg()) + 64
    raw = raw_reg(padding=b"\x00" * pad)
    assert len(raw) > MAX_NOTIF_BYTES
    err = assert_malformed(raw, "push_reg")
    assert "limit" in err.reason


def test_registration_just_under_the_size_limit_is_accepted() -> None:
    pad = MAX_NOTIF_BYTES - len(raw_reg()) - 64
    raw = raw_reg(padding=b"\x00" * pad)
    assert MAX_NOTIF_BYTES - 64 < len(raw) <= MAX_NOTIF_BYTES
    reg = decode_notification(raw)
    assert isinstance(reg, Registration)
    assert reg.block_groups == ((3, 4, 5),)


def test_registration_constructor_validates_block_groups() -> None:
    for bad in ([1, [2]], [-1], [True], ["a"], 7):
        with pytest.raises(ValueError):
            make_reg(local_block_ids=bad)
    with pytest.raises(ValueError):
        make_reg(decode_tp_size=1, decode_tp_rank=1)


def test_malformed_message_is_a_value_error_with_kind_and_reason() -> None:
    err = MalformedMessage("push_reg", "because")
    assert isinstance(err, ValueError)
    assert (err.kind, err.reason) == ("push_reg", "because")
    assert "push_reg" in str(err) and "because" in str(err)


def test_decode_notification_of_non_bytes_is_malformed() -> None:
    for bad in ("cmpl:1", None, 5, ["x"]):
        with pytest.raises(MalformedMessage):
            decode_notification(bad)  # type: ignore[arg-type]


def _deep(depth: int) -> bytes:
    """msgpack for [[[...[nil]...]]] nested ``depth`` deep, about ``depth`` bytes."""
    return b"\x91" * depth + b"\xc0"


def _with_extra_field(body: bytes, value: bytes) -> bytes:
    """Add one unknown key (which decoders skip) to an encoded msgpack map (fixmap or map16)."""
    if 0x80 <= body[0] < 0x8F:
        return bytes([body[0] + 1]) + body[1:] + pack("vendor_ext") + value
    if body[0] == 0x8F:  # 15 entries: the 16th needs a map16 header
        return b"\xde\x00\x10" + body[1:] + pack("vendor_ext") + value
    assert body[0] == 0xDE
    n = int.from_bytes(body[1:3], "big") + 1
    return b"\xde" + n.to_bytes(2, "big") + body[3:] + pack("vendor_ext") + value


@pytest.mark.parametrize("depth", [50, 1100, 20_000])
@pytest.mark.parametrize(
    ("prefix", "body"),
    [
        (PUSH_REG_PREFIX, pack(reg_fields())),
        (PUSH_FAIL_PREFIX, pack({"request_id": "r"})),
        (ABORT_PREFIX, pack({"request_id": "r"})),
        (PUSH_DIGEST_PREFIX, pack({"request_id": "r", "digest": [[1, 2]]})),
    ],
    ids=["push_reg", "push_fail", "push_abort", "push_digest"],
)
def test_deeply_nested_unknown_field_is_malformed_not_a_crash(prefix: bytes, body: bytes, depth: int) -> None:
    """A ~1 KB notification nesting an (ignored) field deep is skipped or dropped as malformed,
    never a crash: a RecursionError escaping decode_notification would reach the actor's loop.
    How deep msgspec skips before it refuses is the interpreter's (CPython 3.11 refuses at
    1,100 levels, 3.12 skips them); 20,000 is refused on every version tested."""
    raw = prefix + _with_extra_field(body, _deep(depth))
    assert len(raw) < MAX_NOTIF_BYTES
    assert_skipped_or_malformed(lambda: decode_notification(raw), decode_notification(prefix + body), depth)


@pytest.mark.parametrize("depth", [1100, 20_000])
def test_deeply_nested_block_ids_are_malformed(depth: int) -> None:
    fields = reg_fields()
    del fields["local_block_ids"]
    body = pack(fields)
    raw = PUSH_REG_PREFIX + bytes([body[0] + 1]) + body[1:] + pack("local_block_ids") + _deep(depth)
    assert_malformed(raw, "push_reg")


# ============================================================================================
# Completion
# ============================================================================================
@pytest.mark.parametrize(
    ("raw", "rid", "tp"),
    [
        (b"cmpl-abc-0-1a2b3c4d:1", "cmpl-abc-0-1a2b3c4d", 1),
        (b"r:4", "r", 4),
        (b"a:b:2", "a:b", 2),  # ids may contain ':'; the last one separates the tp size
        (b"urn:req:42::8", "urn:req:42:", 8),
        (b"x:65536", "x", 65536),
        (b"x:007", "x", 7),
    ],
)
def test_completion_parses(raw: bytes, rid: str, tp: int) -> None:
    assert notification_kind(raw) == "completion"
    msg = decode_notification(raw)
    assert isinstance(msg, Completion)
    assert (msg.request_id, msg.tp_size) == (rid, tp)


@pytest.mark.parametrize(("rid", "tp"), [("cmpl-1", 1), ("a:b:c", 2), ("chatcmpl-x-0-deadbeef", 8)])
def test_completion_round_trips(rid: str, tp: int) -> None:
    assert decode_notification(encode_completion(rid, tp)) == Completion(rid, tp)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"cmpl-1",  # no colon
        b"cmpl-1:",  # empty tp
        b":2",  # empty id
        b"cmpl-1:x",  # non-digit tp
        b"cmpl-1:-1",
        b"cmpl-1:+1",
        b"cmpl-1: 1",
        b"cmpl-1:1.0",
        b"cmpl-1:0",  # tp 0
        b"cmpl-1:65537",  # tp beyond any TP size
        b"cmpl-1:" + b"9" * 5000,  # would trip int()'s digit limit
        "caf\u00e9:1".encode(),  # non-ascii id
        "cmpl:\u0661".encode(),  # non-ascii (Arabic-Indic) digit
        b"\xff\xfe:1",
        b"cmpl\n1:1",  # control char in the id
        b"cmpl\x001:1",
        b"r" * 1025 + b":1",  # id too long
    ],
)
def test_bad_completion_is_rejected(raw: bytes) -> None:
    assert_malformed(raw, "completion")


# ============================================================================================
# Heartbeat
# ============================================================================================
def test_heartbeat_round_trip() -> None:
    wire = encode_heartbeat(["p-1", "xfer:2", "cmpl-abc-0-1a2b3c4d"])
    assert wire == b"HB:p-1,xfer:2,cmpl-abc-0-1a2b3c4d"
    assert notification_kind(wire) == "heartbeat"
    assert decode_notification(wire) == Heartbeat(("p-1", "xfer:2", "cmpl-abc-0-1a2b3c4d"))


def test_heartbeat_ignores_empty_items() -> None:
    assert decode_notification(b"HB:a,,b,") == Heartbeat(("a", "b"))


@pytest.mark.parametrize("raw", [b"HB:", b"HB:,", b"HB:,,,", "HB:caf\u00e9".encode(), b"HB:" + b"a" * 1025])
def test_bad_heartbeat_is_rejected(raw: bytes) -> None:
    assert_malformed(raw, "heartbeat")


# ============================================================================================
# Push failure and abort
# ============================================================================================
def test_push_failure_round_trip() -> None:
    msg = PushFailure(request_id="cmpl-1", reason="handshake failed", tp_rank=3, pp_rank=1)
    wire = encode_push_failure(msg)
    assert wire.startswith(PUSH_FAIL_PREFIX)
    assert notification_kind(wire) == "push_fail"
    assert decode_notification(wire) == msg
    minimal = decode_notification(PUSH_FAIL_PREFIX + pack({"request_id": "r"}))
    assert minimal == PushFailure(request_id="r")


def test_abort_round_trip() -> None:
    msg = Abort(request_id="d-1", transfer_id="t-1", remote_request_id="p-1", decode_tp_rank=2, reason="client gone")
    wire = encode_abort(msg)
    assert wire.startswith(ABORT_PREFIX)
    assert notification_kind(wire) == "push_abort"
    assert decode_notification(wire) == msg
    minimal = decode_notification(ABORT_PREFIX + pack({"request_id": "d"}))
    assert minimal == Abort(request_id="d")


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",
        pack([1, 2]),
        pack("r"),
        pack(7),
        pack({}),  # missing request_id
        pack({"request_id": ""}),
        pack({"request_id": 5}),
        pack({"request_id": "a,b"}),
        pack({"request_id": "r", "tp_rank": -1}),
        pack({"request_id": "r", "pp_rank": "0"}),
        pack({"request_id": "r", "reason": 5}),
        pack({"request_id": "r", "reason": "x" * 4097}),
    ],
)
def test_malformed_push_failure_is_rejected(body: bytes) -> None:
    assert_malformed(PUSH_FAIL_PREFIX + body, "push_fail")


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",
        pack([1]),
        pack(None),
        pack({}),
        pack({"request_id": ""}),
        pack({"request_id": True}),
        pack({"request_id": "r", "transfer_id": "a,b"}),
        pack({"request_id": "r", "remote_request_id": 3}),
        pack({"request_id": "r", "decode_tp_rank": 1 << 16}),
    ],
)
def test_malformed_abort_is_rejected(body: bytes) -> None:
    assert_malformed(ABORT_PREFIX + body, "push_abort")


# ============================================================================================
# Routing by prefix
# ============================================================================================
@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"PUSH_REG:", "push_reg"),
        (b"PUSH_REG:\x80", "push_reg"),
        (b"HB:a", "heartbeat"),
        (b"PUSH_FAIL:", "push_fail"),
        (b"PUSH_ABORT:xyz", "push_abort"),
        (b"PUSH_DIGEST:", "push_digest"),
        (b"cmpl-1:1", "completion"),
        (b"", "completion"),
        (b"PUSH_REG", "completion"),  # prefix without its colon
        (b"push_reg:\x80", "completion"),  # case matters
        (b"HB", "completion"),
        (b"PUSH_:", "completion"),
        (b"xHB:a", "completion"),
    ],
)
def test_notification_kind_routes_by_prefix(raw: bytes, kind: str) -> None:
    assert notification_kind(raw) == kind


_STEMS = ("HB", "PUSH_REG", "PUSH_FAIL", "PUSH_ABORT", "PUSH_DIGEST", "PAMAC1")


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=24),
        st.builds(lambda stem, rest: stem + rest, st.sampled_from(_STEMS), st.sampled_from(["", ":", ":x", "x", " "])),
    ),
    st.integers(min_value=1, max_value=1 << 16),
)
def test_every_id_that_may_travel_has_a_completion_read_as_a_completion(request_id: str, tp: int) -> None:
    """A completion is ``<D id>:<P TP size>``: whatever id the validator lets through, that
    text must route as a completion, never as a heartbeat, failure, abort or signed message
    (an id "HB" gave "HB:1", a heartbeat, and a push that landed was failed)."""
    try:
        check_request_id(request_id)
    except ValueError:
        return
    assert notification_kind(f"{request_id}:{tp}".encode()) == "completion"
    assert not f"{request_id}:".startswith(RESERVED_ID_PREFIXES)


@pytest.mark.parametrize("stem", _STEMS)
def test_an_id_equal_to_a_wire_prefix_without_its_colon_is_refused(stem: str) -> None:
    with pytest.raises(ValueError):
        check_request_id(stem)
    assert check_request_id(stem + "x") == stem + "x"  # only the prefix itself is reserved


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.text(max_size=40),
        st.text(alphabet=st.characters(min_codepoint=0x1F, max_codepoint=0x7F), max_size=40),
        st.builds(lambda stem, rest: stem + rest, st.sampled_from((*_STEMS, "HB@")), st.text(max_size=6)),
        st.integers(min_value=1019, max_value=1030).map(lambda n: "r" * n),
        st.sampled_from(["", "\n", "a\n", "ok", "a,b", "x" * 1024, "x" * 1025, "é", "HB@", "HB@1"]),
        st.binary(max_size=8),
        st.integers(),
        st.none(),
    )
)
def test_the_compiled_request_id_check_is_the_wire_rule(value: object) -> None:
    """check_request_id (D's completion path) accepts exactly what decoding a message with a
    RequestId field accepts."""
    try:
        msgspec.convert(value, RequestId)
        wire_ok = True
    except msgspec.ValidationError:
        wire_ok = False
    try:
        assert check_request_id(value) == value
        ok = True
    except ValueError as exc:
        assert "cannot be sent" in str(exc)
        ok = False
    assert ok == wire_ok, value


def test_each_kind_is_decoded_by_its_own_schema() -> None:
    """A push-failure body behind the registration prefix is not a registration, and so on."""
    fail_body = pack({"request_id": "r"})
    assert_malformed(PUSH_REG_PREFIX + fail_body, "push_reg")
    reg_body = pack(reg_fields())
    assert isinstance(decode_notification(PUSH_FAIL_PREFIX + reg_body), PushFailure)  # extra keys ignored
    assert isinstance(decode_notification(ABORT_PREFIX + reg_body), Abort)
    assert_malformed(PUSH_FAIL_PREFIX + pack({"request_id": "r", "type": "push_abort"}), "push_fail")
    assert_malformed(ABORT_PREFIX + pack({"request_id": "r", "type": "push_fail"}), "push_abort")


# ============================================================================================
# Fuzz: decode_notification raises MalformedMessage and nothing else
# ============================================================================================
PREFIXES = [PUSH_REG_PREFIX, HEARTBEAT_PREFIX, PUSH_FAIL_PREFIX, ABORT_PREFIX, b""]
FIELD_NAMES = sorted(set(reg_fields()) | {"transfer_id", "remote_request_id", "reason", "tp_rank", "pp_rank", "type"})

msgpack_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=8)), children, max_size=6),
    ),
    max_leaves=12,
)


def _check_decodes_or_malformed(raw: bytes) -> None:
    try:
        msg = decode_notification(raw)
    except MalformedMessage as exc:
        assert exc.kind == notification_kind(raw)
        return
    assert isinstance(msg, NOTIFICATION_TYPES)
    assert type(msg).__struct_config__.tag == notification_kind(raw)


FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(body=st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(body: bytes) -> None:
    for prefix in PREFIXES:
        _check_decodes_or_malformed(prefix + body)


@FUZZ
@given(value=msgpack_values)
def test_fuzz_arbitrary_msgpack(value: object) -> None:
    body = pack(value)
    for prefix in PREFIXES:
        _check_decodes_or_malformed(prefix + body)


@settings(max_examples=500, deadline=None)
@given(
    prefix=st.sampled_from([PUSH_REG_PREFIX, PUSH_FAIL_PREFIX, ABORT_PREFIX]),
    field=st.sampled_from(FIELD_NAMES),
    value=msgpack_values,
    drop=st.booleans(),
)
def test_fuzz_one_field_of_a_valid_message(prefix: bytes, field: str, value: object, drop: bool) -> None:
    """Near-valid messages reach the deep validators (block groups, ranks, post-init checks)."""
    fields = reg_fields(transfer_id="t", remote_request_id="p")
    if drop:
        fields.pop(field, None)
    else:
        fields[field] = value
    _check_decodes_or_malformed(prefix + pack(fields))


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=40), tail=st.binary(max_size=10))
def test_fuzz_text_completions(text: str, tail: bytes) -> None:
    _check_decodes_or_malformed(text.encode() + tail)


# ============================================================================================
# Handshake
# ============================================================================================
COMPAT = CompatSpec(model="llama-3-8b", dtype="bfloat16", kv_shape=(16, 8, 128), num_layers=32)
HASH = compatibility_hash(COMPAT)


def make_info(**overrides: Any) -> AgentInfo:
    fields: dict[str, Any] = {
        "engine_id": "engine-D",
        "agent_name": "engine-D/pp0/tp1",
        "agent_metadata": b"\x00nixl-metadata\xff",
        "mem_type": "VRAM",
        "tp_size": 2,
        "tp_rank": 1,
        "pp_size": 1,
        "pp_rank": 0,
        "block_size": 16,
        "physical_blocks_per_logical": 2,
        "regions": (
            RegionInfo(base_addr=0x7F0000000000, block_len=4096, stride=4096, num_blocks=100, members=("l0",)),
            RegionInfo(
                base_addr=0x7F0010000000,
                block_len=2048,
                stride=8192,
                num_blocks=50,
                device_id=1,
                members=("l1", "l2"),
                group=1,
            ),
        ),
        "replicated_kv": True,
        "clock": ClockSample(monotonic=123.5, wall=1.7e9),
    }
    fields.update(overrides)
    return AgentInfo(**fields)


def envelope(version: int, compat_hash: str, body: bytes) -> bytes:
    return pack(HandshakeEnvelope(version, compat_hash, body))


def handshake_kind(raw: bytes, *, expected_hash: str = HASH, expected_engine: str | None = "engine-D") -> str:
    with pytest.raises(HandshakeError) as info:
        decode_handshake(raw, expected_hash=expected_hash, expected_engine=expected_engine)
    assert info.value.detail
    return info.value.kind


def test_handshake_round_trip() -> None:
    info = make_info()
    raw = encode_handshake(info, HASH)
    back = decode_handshake(raw, expected_hash=HASH, expected_engine="engine-D")
    assert back == info
    assert back.regions[1].members == ("l1", "l2")
    assert back.regions[1].group == 1
    assert back.agent_metadata == b"\x00nixl-metadata\xff"
    assert back.num_physical_blocks == 50
    assert back.clock == ClockSample(monotonic=123.5, wall=1.7e9)
    # without an expected engine, any engine id is accepted
    assert decode_handshake(raw, expected_hash=HASH, expected_engine=None) == info


def test_handshake_hash_is_checked_before_the_body() -> None:
    garbage = b"\xc1 not an AgentInfo \xc1"
    assert handshake_kind(envelope(PROTOCOL_VERSION, "0" * 32, garbage)) == "incompatible"
    assert handshake_kind(envelope(PROTOCOL_VERSION, HASH, garbage)) == "garbage"
    # a well-formed body that is not an AgentInfo is garbage too
    assert handshake_kind(envelope(PROTOCOL_VERSION, HASH, pack({"engine_id": "engine-D"}))) == "garbage"
    # a valid body under the wrong hash is still refused
    good_body = pack(make_info())
    assert handshake_kind(envelope(PROTOCOL_VERSION, "f" * 32, good_body)) == "incompatible"
    assert handshake_kind(encode_handshake(make_info(), HASH), expected_hash="e" * 32) == "incompatible"


def test_handshake_wrong_version() -> None:
    good_body = pack(make_info())
    assert handshake_kind(envelope(PROTOCOL_VERSION + 1, HASH, good_body)) == "version"
    assert handshake_kind(envelope(0, HASH, b"garbage")) == "version"


def test_handshake_wrong_engine() -> None:
    raw = encode_handshake(make_info(engine_id="engine-X"), HASH)
    assert handshake_kind(raw, expected_engine="engine-D") == "wrong_engine"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        pack({"version": PROTOCOL_VERSION, "compat_hash": HASH, "body": b""}),  # a map, not an array
        pack([PROTOCOL_VERSION, HASH]),  # too short
        pack([PROTOCOL_VERSION, HASH, "body-as-str"]),
        pack(["1", HASH, b""]),
        pack([PROTOCOL_VERSION, 5, b""]),
        pack(None),
        envelope(PROTOCOL_VERSION, HASH, pack(make_info()))[:-1],  # truncated
    ],
)
def test_handshake_not_an_envelope_is_garbage(raw: bytes) -> None:
    assert handshake_kind(raw) == "garbage"


def test_handshake_body_failing_validation_is_garbage() -> None:
    def body(**overrides: Any) -> bytes:
        fields = msgspec.structs.asdict(make_info())
        fields.update(overrides)
        return pack(fields)

    assert decode_handshake(envelope(PROTOCOL_VERSION, HASH, body()), expected_hash=HASH, expected_engine=None)
    for bad in (
        body(tp_rank=2),  # rank outside its group
        body(pp_rank=1),
        body(mem_type="HBM"),
        body(block_size=0),
        body(regions=[{"base_addr": 0, "block_len": 8, "stride": 4, "num_blocks": 1}]),  # stride < len
        body(regions=[{"base_addr": -1, "block_len": 8, "stride": 8, "num_blocks": 1}]),
        body(engine_id=""),
        body(clock=None),
    ):
        assert handshake_kind(envelope(PROTOCOL_VERSION, HASH, bad), expected_engine=None) == "garbage"


@pytest.mark.parametrize("depth", [50, 1100, 20_000])
def test_handshake_deeply_nested_payload_is_garbage_not_a_crash(depth: int) -> None:
    body = pack(make_info())
    plain = decode_handshake(envelope(PROTOCOL_VERSION, HASH, body), expected_hash=HASH, expected_engine="engine-D")
    deep_body = _with_extra_field(body, _deep(depth))
    in_body = envelope(PROTOCOL_VERSION, HASH, deep_body)
    # Skipped (an unknown field) or refused, by the interpreter's depth (see the notifications').
    assert_skipped_or_malformed(
        lambda: decode_handshake(in_body, expected_hash=HASH, expected_engine="engine-D"), plain, depth, HandshakeError
    )
    # an extra trailing element in the (array-like) envelope
    in_envelope = b"\x94" + pack(PROTOCOL_VERSION) + pack(HASH) + pack(body) + _deep(depth)
    assert_skipped_or_malformed(
        lambda: decode_handshake(in_envelope, expected_hash=HASH, expected_engine="engine-D"),
        plain,
        depth,
        HandshakeError,
    )
    assert handshake_kind(_deep(depth)) == "garbage"


@pytest.mark.parametrize("depth", [50, 1100, 20_000])
def test_handshake_request_deeply_nested_is_malformed(depth: int) -> None:
    req = pack(HandshakeRequest(pp_rank=0, tp_rank=0))
    deep = _with_extra_field(req, _deep(depth))
    assert_skipped_or_malformed(lambda: decode_handshake_request(deep), decode_handshake_request(req), depth)


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=200))
def test_fuzz_decode_handshake_bytes(raw: bytes) -> None:
    try:
        decode_handshake(raw, expected_hash=HASH, expected_engine="engine-D")
    except HandshakeError as exc:
        assert exc.kind in {"garbage", "version", "incompatible", "wrong_engine"}


@settings(max_examples=200, deadline=None)
@given(value=msgpack_values, body=st.binary(max_size=100), version=st.integers(-5, 5))
def test_fuzz_decode_handshake_msgpack(value: object, body: bytes, version: int) -> None:
    for raw in (pack(value), pack([version, HASH, body]), envelope(PROTOCOL_VERSION, HASH, pack(value))):
        try:
            decode_handshake(raw, expected_hash=HASH, expected_engine="engine-D")
        except HandshakeError as exc:
            assert exc.kind in {"garbage", "version", "incompatible", "wrong_engine"}


def test_handshake_request_round_trip_and_malformed() -> None:
    req = HandshakeRequest(pp_rank=1, tp_rank=3, requester_engine_id="engine-P", requester_agent="a")
    assert decode_handshake_request(encode_handshake_request(req)) == req
    for bad in (b"", b"\xc1", pack([1, 2]), pack({"pp_rank": 0}), pack({"pp_rank": -1, "tp_rank": 0})):
        with pytest.raises(MalformedMessage):
            decode_handshake_request(bad)


# ============================================================================================
# Compatibility hash
# ============================================================================================
def test_compatibility_hash_is_stable() -> None:
    same = CompatSpec(model="llama-3-8b", dtype="bfloat16", kv_shape=(16, 8, 128), num_layers=32)
    assert compatibility_hash(same) == HASH
    assert compatibility_hash(COMPAT) == compatibility_hash(COMPAT)
    assert len(HASH) == 32
    int(HASH, 16)  # hex
    assert compatibility_hash(CompatSpec()) == compatibility_hash(CompatSpec())


@pytest.mark.parametrize(
    "change",
    [
        {"protocol_version": PROTOCOL_VERSION + 1},
        {"model": "llama-3-70b"},
        {"dtype": "float16"},
        {"kv_shape": (16, 8, 64)},
        {"kv_shape": (8, 16, 128)},
        {"kv_shape": (16, 8, 128, 1)},
        {"num_layers": 31},
        {"transfer_mode": "pull"},
    ],
)
def test_compatibility_hash_differs_when_a_field_differs(change: dict[str, Any]) -> None:
    fields = msgspec.structs.asdict(COMPAT)
    fields.update(change)
    assert compatibility_hash(CompatSpec(**fields)) != HASH


def test_compatibility_hash_fields_do_not_alias() -> None:
    assert compatibility_hash(CompatSpec(model="ab", dtype="")) != compatibility_hash(CompatSpec(model="a", dtype="b"))
    assert compatibility_hash(CompatSpec(model="x")) != compatibility_hash(CompatSpec(dtype="x"))


# ============================================================================================
# kv_transfer_params
# ============================================================================================
PUSH_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "engine-P",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "remote_tp_size": 4,
    "remote_pp_size": 2,
    "remote_request_id": "cmpl-abc-0-1a2b3c4d",
    "transfer_id": "xfer-1",
}


def test_parse_push_params() -> None:
    p = parse_kv_transfer_params(PUSH_PARAMS)
    assert isinstance(p, KVTransferParams)
    assert p.do_remote_prefill is True
    assert p.do_remote_decode is False
    assert (p.remote_engine_id, p.remote_host, p.remote_port) == ("engine-P", "10.0.0.1", 5600)
    assert (p.remote_tp_size, p.remote_pp_size) == (4, 2)
    assert p.remote_request_id == "cmpl-abc-0-1a2b3c4d"
    assert p.transfer_id == "xfer-1"


def test_parse_prefill_leg_and_empty_params() -> None:
    p = parse_kv_transfer_params({"do_remote_decode": True})
    assert p.do_remote_decode is True
    assert p.do_remote_prefill is False
    assert p.remote_engine_id is None
    assert p.remote_pp_size == 1
    assert parse_kv_transfer_params({}) == KVTransferParams()


def test_unknown_extra_keys_are_ignored() -> None:
    p = parse_kv_transfer_params({**PUSH_PARAMS, "remote_block_ids": [1, 2], "vendor_x": {"a": 1}})
    assert p.remote_engine_id == "engine-P"
    assert p.remote_block_ids == [1, 2]
    assert not hasattr(p, "vendor_x")


@pytest.mark.parametrize(
    "missing",
    [
        ("remote_engine_id",),
        ("remote_host",),
        ("remote_port",),
        ("remote_tp_size",),
        ("remote_host", "remote_port"),
        ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size"),
    ],
)
def test_do_remote_prefill_needs_p_coordinates(missing: tuple[str, ...]) -> None:
    params = {k: v for k, v in PUSH_PARAMS.items() if k not in missing}
    with pytest.raises(ValueError) as info:
        parse_kv_transfer_params(params)
    msg = str(info.value)
    for field in missing:
        assert field in msg
    for field in {"remote_engine_id", "remote_host", "remote_port", "remote_tp_size"} - set(missing):
        assert field not in msg


def test_explicit_none_counts_as_missing() -> None:
    with pytest.raises(ValueError, match="remote_host"):
        parse_kv_transfer_params({**PUSH_PARAMS, "remote_host": None})


@pytest.mark.parametrize(
    "change",
    [
        {"remote_port": "5600"},
        {"remote_port": 70000},
        {"remote_port": 5600.0},
        {"remote_port": True},
        {"remote_tp_size": 2.0},
        {"remote_tp_size": "4"},
        {"remote_tp_size": 0},
        {"remote_pp_size": 0},
        {"remote_engine_id": 7},
        {"remote_engine_id": ""},
        {"do_remote_prefill": "yes"},
        {"do_remote_prefill": 1},
        {"remote_request_id": "a,b"},
        {"transfer_id": ""},
        {"remote_block_ids": "1,2"},
    ],
)
def test_wrong_types_are_value_errors(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="kv_transfer_params"):
        parse_kv_transfer_params({**PUSH_PARAMS, **change})


@pytest.mark.parametrize("params", [None, 5, "do_remote_prefill", [("do_remote_prefill", True)], {1: 2}])
def test_params_that_are_not_a_map_are_value_errors(params: object) -> None:
    with pytest.raises(ValueError, match="kv_transfer_params"):
        parse_kv_transfer_params(params)
