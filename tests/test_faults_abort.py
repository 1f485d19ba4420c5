"""Faults 18–20 (issue 5): aborts on either side.

Over the fake fabric, one test per scenario; see docs/reliability.md for the table.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from scenario_kit import (
    D_AGENT,
    P_AGENT,
    TOKENS,
    actor,
    addr,
    assert_clean,
    legs,
    make_pair,
    posted,
    stat,
    timed_pump,
    untouched,
)

from pushactors.logs import EventCapture
from pushactors.testing import wait_until

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# 18–20: aborts
# =============================================================================================
@pytest.mark.parametrize("when", ["before_meta", "parked_on_handshake"])
def test_18_d_abort_before_registration_went_out(when: str, events: EventCapture) -> None:
    with make_pair(registration_timeout=30.0, handshake_timeout=5.0) as pair:
        d_id = "r18-bbbbbbbb"
        params = pair.prefill.scheduler.decode_params("r18-aaaaaaaa")
        slow = 1.5
        if when == "parked_on_handshake":
            pair.directory.delays[addr(pair.p_endpoint)] = slow
        pair.decode.expect(d_id, TOKENS, params, key="r18")
        t0 = time.monotonic()
        if when == "parked_on_handshake":
            pair.decode.step()  # the registration reaches D's writer and parks on the handshake
            wait_until(lambda: actor(pair.decode, "writer").sizes()["awaiting"] == 1, what="the parked registration")
        assert pair.decode.scheduler.abort_recv(d_id)
        pair.pump(lambda: d_id in pair.received, what="D to report the aborted request")
        elapsed = time.monotonic() - t0
        assert pair.received[d_id] is not None
        if when == "before_meta":
            assert "aborted before registration" in (pair.received[d_id] or "")
            assert not pair.directory.fetches  # nothing was ever sent or fetched
        else:
            assert "aborted" in (pair.received[d_id] or "")
            assert elapsed < slow, "D waited for the handshake to report the abort"
            # The handshake completes later: nothing is left to replay, nothing is sent.
            pair.pump(
                lambda: bool(events.where(event="handshake.applied", rank="decode/pp0/tp0")),
                what="the slow handshake to complete",
            )
            assert events.where(event="handshake.applied", rank="decode/pp0/tp0")[0]["replayed"] == 0
        assert pair.fabric.stats.notifs_sent == 0, "a PUSH_REG (or anything) was sent for an aborted request"
        assert stat(pair.prefill, "notif.received") == 0
        assert posted(pair) == 0
        assert_clean(pair)


@pytest.mark.parametrize("write", ["settles_first", "outlives_quarantine"])
def test_19_d_abort_after_registration_quarantines_until_write_settled(write: str, events: EventCapture) -> None:
    """D aborts while P's WRITE into its blocks is in flight (held). D must not report (release)
    the blocks until that WRITE settled or P confirmed it will not write (docs/protocol.md, 'Failures').

    settles_first: the WRITE is released before the quarantine bound. outlives_quarantine: it is
    stuck longer than D's quarantine and than write_timeout while P is alive and knows it is in
    flight: P tells D it may still land (D holds the blocks past its quarantine), never releases
    it to cancel it (that would not stop a copy already started), and answers D once it ended."""
    quarantine = 3.0 if write == "settles_first" else 0.4
    with make_pair(
        registration_timeout=30.0, lease_duration=30.0, abort_quarantine=quarantine, write_timeout=1.5
    ) as pair:
        gate = pair.fabric.faults.hold_transfer()
        p_id, d_id = legs(pair, "r19")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE to be posted")
        released_in_flight: list[int] = []

        def reported() -> bool:
            """Also records whether D reported while the WRITE into its blocks could still land."""
            if d_id in pair.received and not released_in_flight:
                released_in_flight.append(pair.fabric.in_flight())
            return d_id in pair.received

        assert pair.decode.scheduler.abort_recv(d_id)
        t_abort = time.monotonic()
        pair.pump(
            lambda: reported() or bool(events.where(msg="cancel_push", rank="prefill/pp0/tp0")),
            what="P to see the abort",
        )
        for _ in range(5):
            reported()
            pair.step()
        if write == "settles_first":
            if pair.fabric.in_flight():
                assert not reported(), "D released blocks a WRITE may still land in"
            gate.open()
            t_open = time.monotonic()
            pair.pump(lambda: reported() and p_id in pair.sent, what="the WRITE to settle")
            assert time.monotonic() - t_open < 1.0
            assert time.monotonic() - t_abort < quarantine, "released by the quarantine bound, not by the settle"
        else:
            held_until = t_abort + 1.5 + 0.5  # past the quarantine and past write_timeout
            pair.pump(lambda: reported() or time.monotonic() > held_until, what="past write_timeout")
            assert not reported(), "D released blocks a stuck WRITE may still land in"
            assert pair.fabric.in_flight() == 1 and pair.fabric.stats.transfers_cancelled == 0
            assert stat(pair.decode, "recv.write_pinned") >= 1
            gate.open()
            pair.pump(lambda: reported() and p_id in pair.sent, what="the WRITE to end and both sides to settle")
        assert "aborted" in (pair.received[d_id] or "")
        assert released_in_flight == [0], "D released its blocks while P's WRITE into them was still in flight"
        if pair.sent[p_id] is not None:  # the WRITE was cancelled: nothing may have landed
            assert untouched(pair.decode, d_id)
        assert_clean(pair)


@pytest.mark.parametrize("order", ["registered_first", "cancelled_first"])
def test_20_p_request_aborted_tells_d_at_once(order: str) -> None:
    with make_pair(registration_timeout=30.0) as pair:
        p_id, d_id = "r20-aaaaaaaa", "r20-bbbbbbbb"
        params = pair.prefill.scheduler.decode_params(p_id)
        matcher = actor(pair.prefill, "matcher")
        if order == "registered_first":
            pair.decode.expect(d_id, TOKENS, params, key="r20")
            pair.pump(lambda: matcher.sizes()["pending_registrations"] == 1, what="the registration to reach P")
            assert pair.prefill.scheduler.request_cancelled(p_id, {"do_remote_decode": True})
        else:
            assert pair.prefill.scheduler.request_cancelled(p_id, {"do_remote_decode": True})
            pair.prefill.step()
            wait_until(lambda: matcher.sizes()["tombstones"] >= 1, what="P to tombstone the request")
            pair.decode.expect(d_id, TOKENS, params, key="r20")
        elapsed = timed_pump(pair, lambda: d_id in pair.received, what="D to hear the push failure")
        assert elapsed < 5.0
        assert "aborted on P" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.timed_out") == 0
        assert matcher.sizes()["pending_registrations"] == 0
        assert posted(pair) == 0
        assert_clean(pair)


# =============================================================================================
# Lost aborts and late copies never let P write into blocks D freed
# =============================================================================================
def _nonzero(engine: Any, blocks: list[int]) -> int:
    return sum(int(t[:, blocks].count_nonzero()) for t in engine.kv[0].values())


def test_a_lost_abort_with_a_sibling_heartbeating_never_lets_p_write_into_freed_blocks() -> None:
    """D aborts a waiting registration; its PUSH_ABORT is lost and D frees the blocks after
    its quarantine. D meanwhile heartbeats a retry of the same router request (its own
    PUSH_REG lost too). When P's prefill ends, the stale registration must be refused: no
    WRITE, no byte in the freed blocks, P's request failed visibly."""
    from pushactors.testing.faults import notif_contains

    with make_pair(
        lease_duration=3.0,
        write_timeout=0.5,
        abort_quarantine=2.6,
        allow_unsafe_quarantine=False,
        registration_timeout=30.0,
    ) as pair:
        p_a, d1 = "cmpl-x-0-aaaaaaaa", "cmpl-x-0-bbbbbbbb"
        matcher = actor(pair.prefill, "matcher")
        rec1 = pair.decode.expect(d1, TOKENS, pair.prefill.scheduler.decode_params(p_a), key="x")
        pair.pump(lambda: matcher.sizes()["pending_registrations"] == 1, what="d1 pending on P")
        pair.fabric.faults.drop_notif(match=notif_contains(b"PUSH_ABORT"), times=None)
        pair.fabric.faults.drop_notif(match=notif_contains(b"cmpl-x-0-dddddddd"), times=None)
        pair.decode.expect(
            "cmpl-x-0-dddddddd", TOKENS, pair.prefill.scheduler.decode_params("cmpl-x-0-cccccccc"), key="y"
        )
        assert pair.decode.scheduler.abort_recv(d1)
        pair.pump(lambda: d1 in pair.received, what="D to report d1 after its quarantine")
        assert pair.received[d1] is not None
        blocks = list(rec1.blocks)
        pair.decode.finish_recv(d1)  # the blocks are back in D's pool
        pair.prefill.prefill(p_a, TOKENS, key="x")
        pair.pump(lambda: p_a in pair.sent, what="P to end its request")
        pair.pump(lambda: pair.fabric.in_flight() == 0, what="nothing in flight")
        assert posted(pair) == 0
        assert _nonzero(pair.decode, blocks) == 0
        assert pair.sent[p_a] is not None
        # D's own deadline for it passed (it stopped promising when it aborted): refused by that
        # before the older rule (no heartbeat for 2/3 of a lease) would have.
        assert stat(pair.prefill, "matcher.expired") == 1


def test_a_late_copy_of_an_aborted_registration_is_never_written() -> None:
    """A duplicated PUSH_REG that reaches P after D aborted it (and freed its blocks) is dropped:
    P's request, which that registration would have matched by base id, is never written into
    those blocks; it ends when its lease lapses."""
    with make_pair(lease_duration=2.0, registration_timeout=30.0) as pair:
        p_id, d_id = "cmpl-z-0-aaaaaaaa", "cmpl-z-0-bbbbbbbb"
        matcher = actor(pair.prefill, "matcher")
        seen: list[bytes] = []

        def record(ctx: Any) -> bool:  # drops nothing: keeps a copy of D's PUSH_REG
            if ctx.notif.startswith(b"PUSH_REG:"):
                seen.append(bytes(ctx.notif))
            return False

        pair.fabric.faults.drop_notif(match=record, times=None)
        params = pair.prefill.scheduler.decode_params(p_id)
        del params["remote_request_id"]  # named by engine and address only: a base-id match
        rec = pair.decode.expect(d_id, TOKENS, params, key="z")
        pair.pump(lambda: matcher.sizes()["pending_registrations"] == 1, what="registration pending on P")
        assert pair.decode.scheduler.abort_recv(d_id)
        pair.pump(lambda: d_id in pair.received, what="D reports the abort, P confirmed")
        blocks = list(rec.blocks)
        pair.decode.finish_recv(d_id)
        pair.fabric.get("prefill-pp0-tp0").inject_notif("decode-pp0-tp0", seen[0])
        pair.pump(lambda: stat(pair.prefill, "matcher.late_registration_dropped") == 1, what="the late copy dropped")
        pair.prefill.prefill(p_id, TOKENS, key="z")
        pair.pump(lambda: p_id in pair.sent, timeout=20, what="P's request to end")
        pair.pump(lambda: pair.fabric.in_flight() == 0, what="nothing in flight")
        assert posted(pair) == 0
        assert _nonzero(pair.decode, blocks) == 0
        assert pair.sent[p_id] is not None
        assert matcher.sizes()["pending_registrations"] == 0


def test_an_abort_never_fails_a_later_request_reusing_the_p_id() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        p_id = "reuse-1"  # the client's X-Request-Id, not suffixed by the engine
        matcher = actor(pair.prefill, "matcher")
        pair.decode.expect("d-first", TOKENS, pair.prefill.scheduler.decode_params(p_id), key="a")
        pair.pump(lambda: matcher.sizes()["pending_registrations"] == 1, what="first registration on P")
        assert pair.decode.scheduler.abort_recv("d-first")
        pair.pump(lambda: "d-first" in pair.received, what="D reports the aborted request")
        assert pair.prefill.scheduler.request_cancelled(p_id, {"do_remote_decode": True})
        pair.pump(lambda: matcher.sizes()["tombstones"] >= 1, what="P to tombstone it")
        params = pair.prefill.prefill(p_id, TOKENS, key="b")
        pair.decode.expect("d-second", TOKENS, params, key="b")
        pair.pump(lambda: p_id in pair.sent and "d-second" in pair.received, what="the second request")
        assert pair.sent[p_id] is None, pair.sent[p_id]
        assert pair.received["d-second"] is None
        assert matcher.sizes()["aborted_keys"] == 0


def test_an_abort_near_the_watchdog_keeps_the_blocks_the_whole_quarantine() -> None:
    """P's WRITE is in flight and D's PUSH_ABORT is lost: D must hold the blocks for the full
    ``abort_quarantine`` after its abort, even when the registration's watchdog was due
    sooner, because the WRITE can still land in them."""
    from pushactors.testing.faults import notif_contains

    quarantine = 1.5
    with make_pair(
        lease_duration=30.0, write_timeout=30.0, registration_timeout=2.0, abort_quarantine=quarantine
    ) as pair:
        gate = pair.fabric.faults.hold_transfer()  # P's WRITE stays in flight
        pair.fabric.faults.drop_notif(notif_contains(b"PUSH_ABORT:"), times=None)
        t0 = time.monotonic()
        _, d_id = legs(pair, "q1")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE posted")
        pair.pump(lambda: time.monotonic() - t0 >= 1.6, what="0.4 s before the watchdog")
        assert pair.decode.scheduler.abort_recv(d_id)
        t_abort = time.monotonic()
        pair.pump(lambda: d_id in pair.received, timeout=10, what="D to report")
        held_for = time.monotonic() - t_abort
        assert pair.fabric.in_flight() == 1  # the WRITE could still land all that time
        gate.open()
        assert pair.received[d_id] is not None
        assert held_for >= quarantine


@pytest.mark.parametrize("how", ["aborted", "refused"])
def test_a_live_request_staged_again_and_dropped_is_reported_only_after_its_write(how: str) -> None:
    """The engine stages a live D request again, then aborts it before the new registration
    went out, or the new one is refused (a block id beyond capacity). P is still writing the
    first registration's blocks: the request must end through the reaper's quarantine and be
    reported once, after that WRITE ended, never at once nor at write_timeout (the engine would
    reuse blocks under it)."""
    from scenario_kit import P_AGENT, is_write_from

    config: dict[str, Any] = {"abort_quarantine": 0.5, "write_timeout": 1.0}
    with make_pair(registration_timeout=30.0, lease_duration=30.0, **config) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        p_id, d_id = "ra-aaaaaaaa", "ra-bbbbbbbb"
        params = pair.prefill.prefill(p_id, TOKENS, key="ra")
        rec = pair.decode.expect(d_id, TOKENS, params, key="ra")
        pair.pump(lambda: posted(pair) == 1, what="P's WRITE into D's first blocks in flight")
        if how == "aborted":
            pair.decode.scheduler.stage_registration(d_id, pair.decode.allocate(len(rec.blocks)), params)
            assert pair.decode.scheduler.abort_recv(d_id)
        else:
            pair.decode.scheduler.stage_registration(d_id, [10_000], params)
        out = pair.decode.step()
        assert d_id not in out.failed_recving and d_id not in pair.received  # not at once
        # D's abort reaches P, which lets the (stuck) WRITE run, past write_timeout too (it says
        # it may still land), and answers once it ended: only then is it reported.
        held_until = time.monotonic() + config["write_timeout"] + 0.5
        pair.pump(lambda: d_id in pair.received or time.monotonic() > held_until, what="past write_timeout")
        assert d_id not in pair.received, "reported while a WRITE into its blocks may still land"
        assert pair.fabric.in_flight() == 1
        gate.open()
        pair.pump(lambda: d_id in pair.received, what="D to report it")
        assert pair.fabric.in_flight() == 0
        assert pair.received[d_id] is not None
        pair.pump(lambda: p_id in pair.sent, what="P to end its push")
        for _ in range(20):
            pair.step()
        assert pair.decode.duplicate_reports == 0


def test_an_abort_mid_write_waits_for_the_write_even_when_release_would_not_stop_it() -> None:
    """D aborts while P's WRITE into its blocks runs. Releasing the handle would not stop the
    copy (NIXL's UCX backend cancels the UCX requests; a cuda_ipc or RDMA copy already started
    runs on: the fake's ``release_continues``). So P never releases it: it lets the WRITE end,
    and only then do D free its blocks and P hand its own back. Before, P released it, told D
    "cancelled", and both sides freed blocks the copy was still reading and writing."""
    config: dict[str, Any] = {"abort_quarantine": 0.3, "allow_unsafe_quarantine": True}
    with make_pair(registration_timeout=30.0, lease_duration=30.0, **config) as pair:
        gate = pair.fabric.faults.hold_transfer()
        pair.fabric.faults.release_continues(times=None)
        p_id, d_id = legs(pair, "rc1")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE in flight")
        assert pair.decode.scheduler.abort_recv(d_id)
        # D's quarantine (0.3 s) runs out while the WRITE is live: P's word that it is in flight
        # keeps the blocks held past it.
        t0 = time.monotonic()
        freed = lambda: d_id in pair.received or p_id in pair.sent  # noqa: E731
        pair.pump(lambda: freed() or time.monotonic() - t0 > 0.9, what="past D's quarantine")
        assert not freed(), f"blocks freed under a live WRITE: D {pair.received}, P {pair.sent}"
        assert stat(pair.decode, "recv.write_pinned") >= 1  # said again on each re-sent abort
        assert pair.fabric.in_flight() == 1
        gate.open()
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent, what="both sides to end it")
        assert pair.fabric.in_flight() == 0
        assert pair.fabric.stats.transfers_landed_after_release == 0  # nothing ran on unowned
        assert stat(pair.prefill, "write.abort_awaits_end") >= 1  # once per abort D sent
        assert_clean(pair)


def test_a_lost_final_answer_to_a_pinned_abort_is_asked_for_again() -> None:
    """D aborted mid-WRITE and P said the WRITE may still land, so D holds the blocks past its
    quarantine until P's final word. That word (the WRITE's completion) is lost. D asks again
    each quarantine; P, done with the request, answers, and D frees the blocks. Before, D held
    them until P went away."""
    from pushactors.testing.faults import FaultContext

    def completion(ctx: FaultContext) -> bool:  # the WRITE's own notification, P -> D
        return ctx.op == "NOTIF" and ctx.src == P_AGENT and b"PUSH_FAIL" not in ctx.notif

    config: dict[str, Any] = {"abort_quarantine": 0.3, "allow_unsafe_quarantine": True}
    with make_pair(registration_timeout=30.0, lease_duration=30.0, **config) as pair:
        gate = pair.fabric.faults.hold_transfer()
        p_id, d_id = legs(pair, "lost1")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE in flight")
        assert pair.decode.scheduler.abort_recv(d_id)
        pair.pump(lambda: stat(pair.decode, "recv.write_pinned") >= 1, what="D told the WRITE may still land")
        pair.fabric.faults.drop_notif(completion, times=None)
        gate.open()
        pair.pump(lambda: p_id in pair.sent, what="P done with it (the WRITE ended)")
        assert pair.fabric.stats.notifs_dropped >= 1
        pair.pump(lambda: d_id in pair.received, timeout=10, what="D to free the blocks after asking again")
        assert "abort" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.quarantine_held") >= 1
        assert_clean(pair)


def test_a_pinned_abort_outlives_a_broken_link_to_a_live_p() -> None:
    """D holds an aborted request's blocks because P said its WRITE may still land. Then D's
    next send to P fails with a disconnect: P may be alive behind a broken link, its WRITE
    running, so the blocks stay held (only a P confirmed dead, or its final answer, frees them).
    Before, the disconnect alone released them."""
    config: dict[str, Any] = {"abort_quarantine": 0.3, "allow_unsafe_quarantine": True}
    with make_pair(registration_timeout=30.0, lease_duration=30.0, **config) as pair:
        gate = pair.fabric.faults.hold_transfer()
        try:
            _, d_id = legs(pair, "pg1")
            pair.pump(lambda: posted(pair) == 1, what="the WRITE in flight")
            assert pair.decode.scheduler.abort_recv(d_id)
            pair.pump(lambda: stat(pair.decode, "recv.quarantine_held") >= 1, what="D holding past its quarantine")
            pair.fabric.faults.disconnect_notif(match=lambda c: c.src == D_AGENT, times=1)  # the re-sent abort
            t0 = time.monotonic()
            pair.pump(lambda: d_id in pair.received or time.monotonic() - t0 > 1.5, what="a report, or 1.5 s")
            assert d_id not in pair.received, f"released under a live WRITE: {pair.received[d_id]!r}"
            assert pair.fabric.in_flight() == 1
        finally:
            gate.open()
        pair.pump(lambda: d_id in pair.received, timeout=15, what="D to free the blocks once the WRITE ended")
        assert pair.fabric.in_flight() == 0
