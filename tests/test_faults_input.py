"""Faults 25–29 (issue 5): input validation and security.

Over the fake fabric, one test per scenario; see docs/reliability.md for the table.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from scenario_kit import (
    D_AGENT,
    P_AGENT,
    TOKENS,
    actor,
    agent,
    assert_clean,
    assert_landed,
    legs,
    make_pair,
    posted,
    pump_all,
    stat,
    timed_pump,
)

from pushactors.logs import EventCapture
from pushactors.protocol import (
    ABORT_PREFIX,
    HEARTBEAT_PREFIX,
    PUSH_DIGEST_PREFIX,
    PUSH_FAIL_PREFIX,
    PUSH_REG_PREFIX,
    MalformedMessage,
    PushFailure,
    Registration,
    decode_notification,
    encode_completion,
    encode_push_failure,
    encode_registration,
    notification_kind,
)
from pushactors.testing import raw_registration, wait_until

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# 25–29: input validation and security
# =============================================================================================
def test_25_notification_for_an_unknown_request_is_ignored_and_counted(events: EventCapture) -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        d_agent = pair.fabric.get(D_AGENT)
        d_agent.inject_notif(P_AGENT, encode_completion("ghost-bbbbbbbb", 1))
        d_agent.inject_notif(P_AGENT, encode_push_failure(PushFailure(request_id="ghost2-bbbbbbbb", reason="x")))
        pair.fabric.get(P_AGENT).inject_notif(D_AGENT, encode_completion("ghost3-bbbbbbbb", 1))
        pair.pump(
            lambda: (
                stat(pair.decode, "reaper.notif_unknown_request") == 2
                and stat(pair.prefill, "reaper.notif_unknown_request") == 1
            ),
            what="the unknown notifications to be seen",
        )
        assert not pair.received and not pair.sent
        p_id, d_id = legs(pair, "r25")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        # A completion replayed after the request was reported is unknown too: no second report.
        d_agent.inject_notif(P_AGENT, encode_completion(d_id, 1))
        pair.pump(lambda: stat(pair.decode, "reaper.notif_unknown_request") == 3, what="the replay to be seen")
        assert stat(pair.decode, "recv.finished") == 1
        assert stat(pair.decode, "recv.failed") == 0
        assert len(events.named("notif.ignored")) == 4
        assert all(w.healthy for e in (pair.prefill, pair.decode) for w in e.workers)
        assert_clean(pair)


MALFORMED = [
    # PUSH_REG
    PUSH_REG_PREFIX + b"\xc1\xc1",
    PUSH_REG_PREFIX + msgspec.msgpack.encode([1, 2, 3]),
    raw_registration(request_id=None),
    raw_registration(request_id=7),
    raw_registration(local_block_ids=[1, -2]),
    raw_registration(local_block_ids=[[1], 2]),
    raw_registration(decode_tp_rank=3),
    # completion
    b"no-separator",
    b"rid:zero",
    b"rid:0",
    b":1",
    b"\xff\xfe:1",
    b"a\x01b:1",
    # heartbeat
    HEARTBEAT_PREFIX,
    HEARTBEAT_PREFIX + b",,,",
    HEARTBEAT_PREFIX + b"\xff",
    # push failure
    PUSH_FAIL_PREFIX + b"\xc1",
    PUSH_FAIL_PREFIX + msgspec.msgpack.encode({"type": "push_fail"}),
    PUSH_FAIL_PREFIX + msgspec.msgpack.encode({"type": "push_fail", "request_id": "a,b"}),
    # abort
    ABORT_PREFIX,
    ABORT_PREFIX + msgspec.msgpack.encode({"type": "push_abort", "request_id": ""}),
    ABORT_PREFIX + msgspec.msgpack.encode({"type": "push_abort", "request_id": "x", "decode_tp_rank": -1}),
    # push digest
    PUSH_DIGEST_PREFIX + b"\xc1",
    PUSH_DIGEST_PREFIX + msgspec.msgpack.encode({"type": "push_digest", "request_id": "r", "digest": [[-1, 0]]}),
    PUSH_DIGEST_PREFIX + msgspec.msgpack.encode({"type": "push_digest", "request_id": "r", "digest": [[1, 1]] * 65}),
    # garbage
    b"",
    b"\x00\x01\x02\x03",
    bytes(range(256)),
]


def test_26_malformed_notifications_of_every_kind_are_counted_and_dropped() -> None:
    for raw in MALFORMED:
        with pytest.raises(MalformedMessage):
            decode_notification(raw)
    kinds: dict[str, int] = {}
    for raw in MALFORMED:
        kinds[notification_kind(raw)] = kinds.get(notification_kind(raw), 0) + 1
    assert set(kinds) == {"push_reg", "completion", "heartbeat", "push_fail", "push_abort", "push_digest"}
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        targets = [(pair.prefill, P_AGENT, D_AGENT), (pair.decode, D_AGENT, P_AGENT)]
        for _, name, peer in targets:
            for i, raw in enumerate(MALFORMED):
                pair.fabric.get(name).inject_notif(peer if i % 2 else "stranger-pp0-tp0", raw)
        # D is decode-only: it drops every PUSH_REG unread (reg.not_producer), malformed or not.
        want = {P_AGENT: len(MALFORMED), D_AGENT: len(MALFORMED) - kinds["push_reg"]}
        pair.pump(
            lambda: all(stat(e, "notif.malformed") == want[name] for e, name, _ in targets),
            what="every malformed notification to be dropped",
        )
        assert stat(pair.decode, "reg.not_producer") == kinds["push_reg"]
        for engine, name, _ in targets:
            for kind, n in kinds.items():
                if kind == "push_reg" and name == D_AGENT:
                    continue
                assert stat(engine, f"notif.malformed.{kind}") == n, (engine.config.engine_id, kind)
            for a in ("writer", "matcher", "reaper", "handshake"):
                assert stat(engine, f"{a}.handler_error") == 0
            assert engine.workers[0].healthy
        assert not pair.sent and not pair.received
        assert posted(pair) == 0
        # The pipeline keeps working.
        p_id, d_id = legs(pair, "r26")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert_clean(pair)


def test_27_block_ids_beyond_d_capacity_are_refused_without_a_write(events: EventCapture) -> None:
    with make_pair(registration_timeout=30.0) as pair:
        p_id, d_id = "r27-aaaaaaaa", "r27-bbbbbbbb"
        params = pair.prefill.prefill(p_id, TOKENS, key="r27")
        capacity = pair.decode.spec.num_blocks
        # D's own staging refuses ids its memory does not have: the request fails at once with
        # a clear reason, and no registration leaves D.
        pair.decode.scheduler.stage_registration(d_id, [capacity - 2, capacity - 1, capacity], params)
        elapsed = timed_pump(pair, lambda: d_id in pair.received, what="D to refuse the staging")
        assert elapsed < 5.0
        assert "beyond" in (pair.received[d_id] or "")
        assert stat(pair.decode, "notif.kind.push_reg") == 0
        # A D that registers such ids anyway (its verified agent) is refused by P, which
        # checks them against what D advertised, and never plans the WRITE.
        good = "r27-cccccccc"
        pair.decode.expect(good, TOKENS, params, key="r27")
        pump_all([pair.prefill, pair.decode], lambda: good in pair.received, what="the good request")
        assert pair.received[good] is None
        assert_landed(pair.decode, good)
        over = Registration(
            request_id="r27-dddddddd",
            decode_engine_id="decode",
            decode_host=pair.d_endpoint.host,
            decode_port=pair.d_endpoint.port,
            decode_tp_size=1,
            local_block_ids=(capacity - 1, capacity),
            remote_engine_id="prefill",
            remote_host=pair.p_endpoint.host,
            remote_port=pair.p_endpoint.port,
            remote_tp_size=1,
        )
        pair.fabric.get(P_AGENT).inject_notif(D_AGENT, encode_registration(over))
        wait_until(lambda: stat(pair.prefill, "reg.over_capacity") == 1, what="P to refuse the registration")
        assert any("capacity" in str(e.get("reason")) for e in events.where(request_id="r27-dddddddd"))
        assert actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 0
        assert posted(pair) == 1
        assert pair.fabric.get(P_AGENT).calls["make_prepped_xfer"] == 1
        assert_clean(pair)


def test_28_push_reg_from_an_agent_of_another_engine_is_refused(events: EventCapture) -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        p_id, d_id = "r28-aaaaaaaa", "r28-bbbbbbbb"
        params = pair.prefill.prefill(p_id, TOKENS, key="r28")
        pair.prefill.step()
        rec = pair.decode.expect(d_id, TOKENS, params, key="r28")
        # Another engine's agent claims to be D's rank 0 and aims P's KV at D's blocks.
        forged = Registration(
            request_id="forged-bbbbbbbb",
            decode_engine_id="decode",
            decode_host=pair.d_endpoint.host,
            decode_port=pair.d_endpoint.port,
            decode_tp_size=1,
            local_block_ids=tuple(rec.blocks),
            remote_engine_id="prefill",
            remote_host=pair.p_endpoint.host,
            remote_port=pair.p_endpoint.port,
            remote_tp_size=1,
            remote_request_id=p_id,
        )
        pair.fabric.get(P_AGENT).inject_notif(agent("decode2"), encode_registration(forged))
        wait_until(lambda: stat(pair.prefill, "reg.rejected_sender") == 1, what="the forged registration")
        assert not [e for e in events.where(request_id="forged-bbbbbbbb") if e.get("actor") == "matcher"], (
            "the forged registration reached the matcher"
        )
        assert actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 0
        assert posted(pair) == 0
        assert p_id not in pair.sent
        # The legitimate registration still works.
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert posted(pair) == 1
        assert stat(pair.prefill, "reg.rejected_sender") == 1
        assert_clean(pair)


P_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill",
    "remote_host": "prefill-host",
    "remote_port": 20000,
    "remote_tp_size": 1,
}

BAD_PARAMS: list[tuple[object, str]] = [
    ({"do_remote_prefill": True}, "remote_engine_id"),
    ({**P_PARAMS, "remote_engine_id": None}, "remote_engine_id"),
    ({**P_PARAMS, "remote_port": "http"}, "remote_port"),
    ({**P_PARAMS, "remote_port": 70000}, "remote_port"),
    ({**P_PARAMS, "remote_tp_size": 0}, "remote_tp_size"),
    ({**P_PARAMS, "remote_engine_id": 5}, "remote_engine_id"),
    ({**P_PARAMS, "transfer_id": "a,b"}, "transfer_id"),
    ({**P_PARAMS, "do_remote_prefill": False}, "remote prefill"),
    ("not a mapping", "kv_transfer_params"),
    (None, "kv_transfer_params"),
]


def test_29_malformed_kv_transfer_params_fail_that_request_only() -> None:
    with make_pair(d_tp=2, registration_timeout=30.0, lease_duration=30.0) as pair:
        sched = pair.decode.scheduler
        for i, (params, field) in enumerate(BAD_PARAMS):
            with pytest.raises(ValueError, match=field):
                sched.stage_registration(f"bad{i}-bbbbbbbb", [1, 2], params)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="transfer_id"):
            pair.prefill.scheduler.request_finished("badp-aaaaaaaa", [1], {"do_remote_decode": True, "transfer_id": 7})
        assert pair.decode.scheduler.build_connector_meta().empty  # nothing was staged
        # The vLLM-style path: the connector rejects the request; every D rank reports it failed.
        d_id = "r29-bbbbbbbb"
        try:
            sched.stage_registration(d_id, [1, 2], {**P_PARAMS, "remote_port": "http"})
        except ValueError as exc:
            sched.reject_recv(d_id, str(exc))
        pair.pump(lambda: d_id in pair.received, what="the rejected request to be reported")
        assert "remote_port" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.failed") == 0  # reported by the workers without touching the actors
        assert not pair.decode.has_pending_push_work()
        # The engine keeps running.
        p_id, ok = legs(pair, "r29ok")
        pair.pump(lambda: ok in pair.received and p_id in pair.sent)
        assert pair.received[ok] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, ok)
        assert posted(pair) == 2  # one WRITE per D rank of the good request only
        assert_clean(pair)
