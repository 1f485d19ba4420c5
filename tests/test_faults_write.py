"""Faults 05–11 (issue 5): P cannot write, or the WRITE goes wrong.

Over the fake fabric, one test per scenario; see docs/reliability.md for the table.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from scenario_kit import (
    P_AGENT,
    TOKENS,
    actor,
    addr,
    agent,
    assert_clean,
    assert_landed,
    evict_d_from_p,
    is_write_from,
    is_write_to,
    legs,
    make_pair,
    posted,
    rank_bytes,
    stat,
    timed_pump,
    untouched,
)

from pushactors.logs import EventCapture
from pushactors.protocol import (
    ABORT_PREFIX,
    PUSH_REG_PREFIX,
)
from pushactors.testing import SimSpec, completion_of

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# 05–11: P cannot write, or the WRITE goes wrong
# =============================================================================================
@pytest.mark.parametrize("case", ["d_unreachable", "d_unreachable_after_match", "unpairable_layout"])
def test_05_p_to_d_handshake_fails_p_frees_and_d_is_told_when_it_can(case: str) -> None:
    if case == "d_unreachable":
        # D is up and registered, but P cannot reach D's side channel: P cannot verify (or
        # answer) the registration, so no WRITE; P's lease frees P (docs/protocol.md, 'Failures'); D's watchdog +
        # quarantine bound D (P cannot tell D anything).
        with make_pair(lease_duration=0.5, registration_timeout=1.0) as pair:
            pair.directory.refused.add(addr(pair.d_endpoint))
            p_id, d_id = legs(pair, "r5")
            t0 = time.monotonic()
            pair.pump(lambda: p_id in pair.sent, what="P to free its blocks")
            p_elapsed = time.monotonic() - t0
            pair.pump(lambda: d_id in pair.received, what="D to fail the receive")
            d_elapsed = time.monotonic() - t0
            assert "lease" in (pair.sent[p_id] or "")
            assert p_elapsed < 0.5 + 1.5
            assert stat(pair.prefill, "handshake.failed.refused") == 1
            assert stat(pair.prefill, "reg.unverified") == 1
            assert "registration timeout" in (pair.received[d_id] or "")
            assert 0.9 <= d_elapsed < 1.0 + 0.4 + 2.0
            assert posted(pair) == 0
            assert untouched(pair.decode, d_id)
            assert_clean(pair)
    elif case == "d_unreachable_after_match":
        # D's registration was admitted and waits for P's blocks; P then forgot D's agent (idle)
        # and D's side channel went away: when P's blocks finish, the push parks on a new
        # handshake with D, which fails. P fails the push and frees at once (no lease wait).
        with make_pair(lease_duration=30.0, registration_timeout=3.0, engine_ttl=0.2) as pair:
            p_id, d_id = "r5c-aaaaaaaa", "r5c-bbbbbbbb"
            pair.decode.expect(d_id, TOKENS, pair.prefill.scheduler.decode_params(p_id), key="r5c")
            pair.pump(
                lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1,
                what="D's registration to be admitted",
            )
            evict_d_from_p(pair)
            pair.directory.refused.add(addr(pair.d_endpoint))
            pair.prefill.prefill(p_id, TOKENS, key="r5c")
            elapsed = timed_pump(pair, lambda: p_id in pair.sent, what="P to fail the push")
            assert elapsed < 2.0, "P waited for its 30 s lease"
            assert "handshake with decode/pp0/tp0 failed (refused)" in (pair.sent[p_id] or "")
            assert not pair.prefill.held
            pair.pump(lambda: d_id in pair.received, what="D's watchdog")
            assert "registration timeout" in (pair.received[d_id] or "")
            assert posted(pair) == 0
            assert untouched(pair.decode, d_id)
            assert_clean(pair)
    else:
        # Same compatibility hash, but D's layout lacks layers P must write: the WRITE is
        # refused, D gets a push failure at once, P frees at once.
        with make_pair(
            registration_timeout=30.0, lease_duration=30.0, p_spec=SimSpec(num_layers=4), d_spec=SimSpec(num_layers=2)
        ) as pair:
            p_id, d_id = legs(pair, "r5")
            elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
            assert elapsed < 5.0
            assert "invalid WRITE" in (pair.received[d_id] or "")
            assert "invalid WRITE" in (pair.sent[p_id] or "")
            assert stat(pair.prefill, "write.refused") == 1
            assert stat(pair.prefill, "push_fail.sent") == 1
            assert posted(pair) == 0
            assert untouched(pair.decode, d_id)
            assert_clean(pair)


def test_06_write_submission_raises() -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        rule = pair.fabric.faults.raise_on_transfer(times=1)
        p_id, d_id = legs(pair, "r6")
        elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
        assert rule.hits == 1
        assert elapsed < 5.0
        assert "WRITE submission failed" in (pair.sent[p_id] or "")
        assert "WRITE submission failed" in (pair.received[d_id] or "")
        assert stat(pair.prefill, "write.submit_failed") == 1
        assert stat(pair.prefill, "push.pushed") == 0
        assert stat(pair.decode, "recv.finished") == 0
        assert posted(pair) == 0
        assert pair.fabric.get(P_AGENT).live_handles == 0
        assert untouched(pair.decode, d_id)
        # The pipeline goes on.
        p2, d2 = legs(pair, "r6b")
        pair.pump(lambda: d2 in pair.received and p2 in pair.sent)
        assert pair.received[d2] is None and pair.sent[p2] is None
        assert_landed(pair.decode, d2)
        assert_clean(pair)


def test_07_write_ends_in_err() -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        rule = pair.fabric.faults.err_transfer(times=1)
        p_id, d_id = legs(pair, "r7")
        elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
        assert rule.hits == 1
        assert elapsed < 5.0
        assert "ERR" in (pair.sent[p_id] or "")
        assert "ERR" in (pair.received[d_id] or "")
        assert pair.fabric.stats.transfers_err == 1
        assert stat(pair.prefill, "write.failed") == 1
        assert stat(pair.prefill, "push.pushed") == 0
        assert stat(pair.decode, "recv.finished") == 0
        assert pair.fabric.get(P_AGENT).live_handles == 0  # the handle was released
        assert untouched(pair.decode, d_id)
        p2, d2 = legs(pair, "r7b")
        pair.pump(lambda: d2 in pair.received and p2 in pair.sent)
        assert pair.received[d2] is None and pair.sent[p2] is None
        assert_landed(pair.decode, d2)
        assert_clean(pair)


def test_08_one_of_several_writes_fails_failure_reported_after_all_settle(events: EventCapture) -> None:
    """P TP=1 → D TP=2: one P rank writes two D ranks. The WRITE to D rank 1 ends in ERR while
    the one to D rank 0 is held: P reports (and frees) only once the held one settled."""
    with make_pair(p_tp=1, d_tp=2, registration_timeout=30.0, lease_duration=30.0) as pair:
        pair.fabric.faults.err_transfer(match=is_write_to(agent("decode", 1)))
        gate = pair.fabric.faults.hold_transfer(match=is_write_to(agent("decode", 0)))
        p_id, d_id = legs(pair, "r8")
        pair.pump(
            lambda: (
                pair.fabric.stats.transfers_err == 1
                and posted(pair) == 2
                and stat(pair.decode, "recv.failed", rank=1) == 1
            ),
            what="the ERR WRITE to settle and D rank 1 to hear it",
        )
        for _ in range(5):
            pair.step()
        assert p_id not in pair.sent, "P reported while a sibling WRITE is still in flight"
        assert pair.prefill.held, "P freed blocks a WRITE is still reading"
        assert actor(pair.prefill, "writer").sizes()["in_flight"] == 1
        assert d_id not in pair.received  # D rank 0 still waits
        gate.open()
        pair.pump(lambda: p_id in pair.sent and d_id in pair.received, what="the held WRITE to settle")
        assert "ERR" in (pair.sent[p_id] or "")
        assert "ERR" in (pair.received[d_id] or "")
        checked, wrong, _ = rank_bytes(pair.decode, d_id, 0)
        assert checked > 0 and wrong == 0  # the held WRITE landed whole
        assert rank_bytes(pair.decode, d_id, 1)[2] == 0  # the ERR one wrote nothing
        fin = [e for e in events.named("push.finished") if e.get("request_id") == p_id]
        assert len(fin) == 1 and fin[0]["outcome"] == "failed"
        assert_clean(pair)


@pytest.mark.parametrize("p_answers", [True, False], ids=["p_answers_abort", "p_silent"])
def test_09_lost_completion_is_failed_by_d_watchdog(p_answers: bool, events: EventCapture) -> None:
    """The WRITE landed but its completion was lost. D's watchdog fails the request: at once when
    P answers the watchdog's abort ("already pushed"), else when the quarantine ends."""
    quarantine = 3.0 if p_answers else 0.4
    with make_pair(registration_timeout=1.0, abort_quarantine=quarantine, lease_duration=30.0) as pair:
        p_id, d_id = "r9-aaaaaaaa", "r9-bbbbbbbb"
        dropped = pair.fabric.faults.drop_notif(match=completion_of(d_id, tp_size=1))
        if not p_answers:
            pair.fabric.faults.drop_notif(match=lambda c: c.notif.startswith(ABORT_PREFIX), times=None)
        params = pair.prefill.prefill(p_id, TOKENS, key="r9")
        pair.decode.expect(d_id, TOKENS, params, key="r9")
        elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
        assert dropped.hits == 1
        assert pair.sent[p_id] is None  # P's WRITE did succeed
        assert "registration timeout" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.timed_out") == 1
        if p_answers:
            assert events.where(event="abort.answered", actor="writer", rank="prefill/pp0/tp0")
            assert 0.9 <= elapsed < 1.0 + quarantine - 1.0, "P's answer did not end the quarantine"
        else:
            assert events.named("recv.quarantine_ended")
            assert elapsed >= 1.0 + quarantine - 0.05
        assert posted(pair) == 1
        assert_clean(pair)


def test_10_duplicate_completion_is_counted_once(events: EventCapture) -> None:
    """P TP=2 → D TP=1: D waits for two completions. Rank 0's arrives twice while rank 1's
    WRITE is held; D must not count the copy as rank 1's and finish early."""
    with make_pair(p_tp=2, d_tp=1, registration_timeout=30.0, lease_duration=30.0) as pair:
        p_id, d_id = "r10-aaaaaaaa", "r10-bbbbbbbb"
        dup = pair.fabric.faults.duplicate_notif(
            match=lambda c: c.src == agent("prefill", 0) and completion_of(d_id, tp_size=2)(c)
        )
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(agent("prefill", 1)))
        params = pair.prefill.prefill(p_id, TOKENS, key="r10")
        pair.decode.expect(d_id, TOKENS, params, key="r10")
        pair.pump(lambda: stat(pair.decode, "reaper.duplicate_notif") == 1, what="the duplicate to be seen")
        assert dup.hits == 1
        for _ in range(5):
            pair.step()
        assert d_id not in pair.received, "D finished with only one P rank's slice written"
        assert rank_bytes(pair.decode, d_id, 0, 1024, 2048)[2] == 0  # rank 1's slice not there yet
        gate.open()
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert events.where(event="notif.duplicate", request_id=d_id)
        assert_clean(pair)


def test_11_duplicate_push_reg_gives_one_write() -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        dup = pair.fabric.faults.duplicate_notif(match=lambda c: c.notif.startswith(PUSH_REG_PREFIX))
        p_id, d_id = "r11-aaaaaaaa", "r11-bbbbbbbb"
        params = pair.prefill.prefill(p_id, TOKENS, key="r11")
        pair.prefill.step()
        pair.decode.expect(d_id, TOKENS, params, key="r11")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert dup.hits == 1
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert stat(pair.prefill, "matcher.duplicate_registration") == 1
        assert stat(pair.prefill, "write.posted") == 1
        assert posted(pair) == 1
        assert_clean(pair)


def test_a_dead_writer_never_hands_back_blocks_an_uncancelled_write_still_reads() -> None:
    """P's writer dies while its WRITE is in flight and NIXL refuses to cancel it. The rank
    fails what it held, but that request's blocks are never handed back to the engine: reused
    for another prompt, they would be read by the WRITE still going, and D would report another
    prompt's KV as landed. Other requests of the rank are failed as before."""
    from pushactors.protocol import ExpectTraffic
    from pushactors.testing import wait_until

    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        pair.fabric.faults.refuse_cancel(times=None)
        p_id, d_id = legs(pair, "w1")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE in flight")
        idle = "w2-aaaaaaaa"
        pair.prefill.prefill(idle, TOKENS, key="idle")  # leased, its D leg not here yet
        pair.pump(lambda: actor(pair.prefill, "matcher").sizes()["finished"] == 2, what="both on P")
        w = pair.prefill.workers[0]
        w.ctx.faults.fail_handler("writer", ExpectTraffic, kill=True)
        w.runtime.writer.tell(ExpectTraffic())
        wait_until(lambda: not w.healthy, timeout=5, what="P's rank unhealthy")
        pair.pump(lambda: idle in pair.sent, what="the rank's other request failed")
        assert pair.sent[idle] is not None
        assert p_id not in pair.sent and p_id in pair.prefill.held  # held: the WRITE may still read them
        assert w.ctx.unreleased == {p_id}
        gate.open()  # the WRITE ends; its blocks were never reused
        pair.pump(lambda: d_id in pair.received, timeout=10, what="D's request reported")
        if pair.received[d_id] is None:
            assert_landed(pair.decode, d_id)  # its own prompt's KV, never another's


@pytest.mark.parametrize("why", ["cancel refused", "nixl_sgl"])
def test_a_shutdown_never_reports_a_push_whose_write_it_left_in_flight(why: str) -> None:
    """P shuts down with a WRITE in flight that NIXL will not cancel (or that must never be
    cancelled: SGL). The WRITE may still read the request's blocks, so the rank never reports
    that request (the engine would reuse the blocks under it); D is told it may still land."""
    config: dict[str, Any] = {"nixl_sgl": True} if why == "nixl_sgl" else {}
    with make_pair(registration_timeout=30.0, lease_duration=30.0, **config) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        if why == "cancel refused":
            pair.fabric.faults.refuse_cancel(times=None)
        p_id, _ = legs(pair, "s1")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE in flight")
        worker = pair.prefill.workers[0]
        report = worker.shutdown(timeout=0.5)
        try:
            assert pair.fabric.in_flight() == 1
            assert p_id not in report.finished_sending
            assert worker.ctx.unreleased == {p_id}
            pair.pump(lambda: stat(pair.decode, "recv.write_pinned") >= 1, what="D told it may still land")
        finally:
            gate.open()
            pair.fabric.progress()


@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_d_told_a_write_may_still_land_hears_the_final_answer_after_it_was_lost_and_p_moved_on(mode: str) -> None:
    """P judges a WRITE stuck at write_timeout and tells D it "may still land": D keeps the
    blocks until P's final answer, sent once NIXL reports the WRITE ended (here in ERR, after
    the timeout). That answer is lost, and P's memory of the newest
    endings (``tombstone_keep``, one here) has moved on. D's watchdog asks again (an abort): P
    must still answer from the slot it owes an answer to, so D ends the request and frees its
    blocks at once, not after ``pinned_write_limit`` (300 s by default)."""
    from pushactors.protocol import PushFailure, decode_notification

    def final_failure(c: Any) -> bool:
        if not c.notif.startswith(b"PUSH_FAIL:"):
            return False
        msg = decode_notification(c.notif)
        return isinstance(msg, PushFailure) and msg.final

    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    cfg: dict[str, Any] = dict(write_timeout=0.5, tombstone_keep=1, push_mode=mode)
    with make_pair(p_spec=spec, d_spec=spec, **cfg) as pair:
        gate = pair.fabric.faults.hold_transfer(is_write_from(P_AGENT), times=1)
        pair.fabric.faults.err_transfer(is_write_from(P_AGENT), times=1)  # the held one ends in ERR
        lost = pair.fabric.faults.drop_notif(final_failure, times=1)
        p_id, d_id = "pin-1-aaaaaaaa", "pin-1-bbbbbbbb"
        pair.decode.expect(d_id, TOKENS, pair.prefill.scheduler.decode_params(p_id, None), key="pin")
        if mode == "layerwise":
            pair.prefill.prefill_layers(p_id, TOKENS, key="pin").finish()
        else:
            pair.prefill.prefill(p_id, TOKENS, key="pin")
        pair.pump(lambda: stat(pair.decode, "recv.write_pinned") >= 1, timeout=10, what="P's word at write_timeout")
        assert p_id not in pair.sent  # the stuck WRITE is waited for, never released
        gate.open()
        pair.pump(lambda: p_id in pair.sent, timeout=10, what="the WRITE to end, and P with it")
        assert pair.sent[p_id] is not None and "not done after" in pair.sent[p_id]
        pair.pump(lambda: lost.hits == 1, timeout=10, what="P's final answer, lost")
        for i in range(3):  # other requests end on P: its memory of the newest endings moves on
            a, b = legs(pair, f"other-{i}")
            pair.pump(lambda a=a, b=b: a in pair.sent and b in pair.received, timeout=10, what="another request")
        pair.pump(lambda: d_id in pair.received, timeout=15, what="D's request to end")
        assert pair.received[d_id] is not None  # failed, visibly, never landed
        assert actor(pair.prefill, "matcher").sizes()["owed_slots"] == 1
        assert_clean(pair)
