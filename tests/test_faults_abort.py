"""Faults 18–20 (issue 5): aborts on either side.

Over the fake fabric, one test per scenario; see docs/reliability.md for the table.
"""

from __future__ import annotations

import time

import pytest
from scenario_kit import (
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
    the blocks until that WRITE settled or P confirmed it will not write (SPEC §7).

    settles_first: the WRITE is released before the quarantine bound. outlives_quarantine: it is
    stuck longer than D's quarantine while P is alive and knows it is in flight: P must cancel it
    when the abort arrives and answer D."""
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
            pair.pump(reported, what="D to report the aborted request")
            gate.open()
            pair.fabric.progress()
            pair.pump(lambda: p_id in pair.sent, what="P to settle")
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
