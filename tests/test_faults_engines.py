"""Faults 23–24 (issue 5): remote engines and actors.

Over the fake fabric, one test per scenario; see docs/reliability.md for the table.
"""

from __future__ import annotations

import time

import pytest
from scenario_kit import (
    D_AGENT,
    P_AGENT,
    TOKENS,
    actor,
    agent,
    assert_clean,
    assert_landed,
    extra_decode,
    is_write_to,
    legs,
    make_pair,
    posted,
    pump_all,
    stat,
    untouched,
)

from pushactors.actors.handshake import Handshake
from pushactors.actors.matcher import Matcher
from pushactors.actors.reaper import Reaper
from pushactors.actors.writer.actor import Writer
from pushactors.logs import EventCapture
from pushactors.testing import wait_until

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# 23–24: engines and actors
# =============================================================================================
def test_23_engine_ttl_eviction_skips_engines_with_transfers_in_flight(events: EventCapture) -> None:
    ttl = 0.3
    with make_pair(engine_ttl=ttl, lease_duration=30.0, registration_timeout=30.0) as pair:
        d2 = extra_decode(pair, engine_ttl=ttl, lease_duration=30.0, registration_timeout=30.0)
        try:
            engines = [pair.prefill, pair.decode, d2]
            p_agent = pair.fabric.get(P_AGENT)
            gate = pair.fabric.faults.hold_transfer(match=is_write_to(D_AGENT))
            p1, d1 = legs(pair, "r23a")
            p2, d2_id = "r23b-aaaaaaaa", "r23b-cccccccc"
            d2.expect(d2_id, TOKENS, pair.prefill.prefill(p2, TOKENS, key="r23b"), key="r23b")
            pump_all(engines, lambda: d2_id in d2.received and posted(pair) == 2, what="D2's push and D's WRITE")
            assert d2.received[d2_id] is None
            assert_landed(d2, d2_id)
            assert set(p_agent.remote_agents) == {D_AGENT, agent("decode2")}
            pump_all(engines, lambda: agent("decode2") not in p_agent.remote_agents, what="idle D2 to be evicted")
            # A sweep after both engines were idle past the TTL keeps the one with a WRITE in flight.
            mark = time.time() + ttl + 0.05
            pump_all(
                engines,
                lambda: any(
                    e["ts"] > mark
                    for e in events.where(actor="writer", rank="prefill/pp0/tp0")
                    if e.get("event") in ("engines.kept", "engines.evicted")
                ),
                what="a later eviction sweep",
            )
            assert D_AGENT in p_agent.remote_agents, "evicted an engine with a transfer in flight"
            assert p1 not in pair.sent and d1 not in pair.received
            gate.open()
            pump_all(engines, lambda: p1 in pair.sent and d1 in pair.received)
            assert pair.sent[p1] is None and pair.received[d1] is None
            assert_landed(pair.decode, d1)
            # Now idle too: cleaned up on both sides.
            pump_all(engines, lambda: not p_agent.remote_agents, what="D to be evicted once idle")
            pump_all(engines, lambda: not pair.fabric.get(agent("decode2")).remote_agents, what="D2 to evict idle P")
            assert any("decode2/pp0/tp0" in e.get("evicted", []) for e in events.named("engines.evicted"))
            assert_clean(pair, d2)
        finally:
            d2.shutdown()


class _Kill:
    """A message only these tests send: the injected fault kills the actor that gets it."""

    request_id = None


ACTORS = {"writer": Writer, "matcher": Matcher, "reaper": Reaper, "handshake": Handshake}


@pytest.mark.parametrize(
    ("side", "name"),
    [
        ("prefill", "writer"),
        ("prefill", "matcher"),
        ("prefill", "reaper"),
        ("prefill", "handshake"),
        ("decode", "reaper"),
        ("decode", "writer"),
    ],
)
def test_24_actor_crash_fails_its_requests_and_marks_the_rank_unhealthy(side: str, name: str) -> None:
    with make_pair(registration_timeout=1.0, abort_quarantine=0.4, lease_duration=30.0) as pair:
        engine = getattr(pair, side)
        worker = engine.workers[0]
        worker.ctx.faults.fail_handler(name, _Kill, kill=True)  # the actor dies on a _Kill
        waiting = "r24w-bbbbbbbb"  # D waits for a prefill that never ends
        pair.decode.expect(waiting, TOKENS, pair.prefill.scheduler.decode_params("r24w-aaaaaaaa"), key="w")
        if side == "prefill":
            gate = pair.fabric.faults.hold_transfer()
            a_p, a_d = legs(pair, "r24a")  # its WRITE stays in flight
            b_p = "r24b-aaaaaaaa"  # finished, never registered
            pair.prefill.prefill(b_p, TOKENS, key="r24b")
            pair.pump(lambda: posted(pair) == 1, what="A's WRITE to be posted")
        else:
            pair.pump(
                lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1,
                what="D's registration to reach P",
            )
        worker.runtime.refs[name].tell(_Kill())
        wait_until(lambda: not worker.healthy, timeout=5, what="the supervisor to notice")
        assert f"{name} actor died" in (worker.unhealthy_reason or "")
        if side == "prefill":
            pair.pump(lambda: a_p in pair.sent and b_p in pair.sent, what="P's requests to be failed")
            assert all(f"{name} actor died" in (pair.sent[r] or "") for r in (a_p, b_p))
            assert not pair.prefill.held
            assert pair.fabric.in_flight() == 0, "the rank's WRITE kept running after it was failed"
            # D is bounded by its watchdog and quarantine: P cannot answer any more.
            pair.pump(lambda: a_d in pair.received and waiting in pair.received, what="D's watchdog")
            assert "registration timeout" in (pair.received[a_d] or "")
            gate.open()
            pair.fabric.progress()
            assert pair.fabric.stats.transfers_done == 0
            assert untouched(pair.decode, a_d)
            late = "r24c-aaaaaaaa"
            pair.prefill.prefill(late, TOKENS, key="late")
            pair.pump(lambda: late in pair.sent, timeout=5, what="new work on the dead rank to fail")
            assert "actor died" in (pair.sent[late] or "")
        else:
            pair.pump(lambda: waiting in pair.received, timeout=5, what="D's request to be failed")
            assert f"{name} actor died" in (pair.received[waiting] or "")
            late = "r24c-bbbbbbbb"
            pair.decode.expect(late, TOKENS, pair.prefill.scheduler.decode_params("r24c-aaaaaaaa"), key="late")
            pair.pump(lambda: late in pair.received, timeout=5, what="new work on the dead rank to fail")
            assert "actor died" in (pair.received[late] or "")
        assert stat(engine, "rank.actor_died") == 1
        other = pair.decode if side == "prefill" else pair.prefill
        assert other.workers[0].healthy
        assert_clean(pair)
