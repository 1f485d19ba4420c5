"""Faults 30–32 (issue 5): clocks, shutdown, slow handshakes.

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
    assert_landed,
    extra_decode,
    legs,
    make_pair,
    posted,
    pump_all,
    shifted_clock,
    untouched,
)

from pushactors.engine.scheduler import PushScheduler
from pushactors.logs import EventCapture

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# 30–32: clocks, shutdown, slow handshakes
# =============================================================================================
@pytest.mark.parametrize("case", ["scheduler_ahead_1000s", "scheduler_behind_1000s", "peer_clock_shifted"])
def test_30_clock_offset_between_processes(case: str, events: EventCapture) -> None:
    if case == "peer_clock_shifted":
        shift = 500.0
        with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
            pair.directory.tamper[addr(pair.p_endpoint)] = shifted_clock(shift)
            p_id, d_id = legs(pair, "r30")
            pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
            assert pair.received[d_id] is None and pair.sent[p_id] is None
            assert_landed(pair.decode, d_id)
            to_p = events.where(event="handshake.completed", rank="decode/pp0/tp0", peer="prefill/pp0/tp0")
            to_d = events.where(event="handshake.completed", rank="prefill/pp0/tp0", peer="decode/pp0/tp0")
            assert len(to_p) == 1 and len(to_d) == 1
            assert abs(to_p[0]["clock_offset_ms"] - shift * 1e3) < 200  # the peer runs 500 s ahead
            assert abs(to_d[0]["clock_offset_ms"]) < 200  # same process: no offset
            assert_clean(pair)
        return
    offset = 1000.0 if case == "scheduler_ahead_1000s" else -1000.0
    lease, reg_timeout = 0.6, 1.0
    with make_pair(lease_duration=lease, registration_timeout=reg_timeout, abort_quarantine=3.0) as pair:
        for engine in (pair.prefill, pair.decode):
            old = engine.scheduler
            engine.scheduler = PushScheduler(
                engine.config,
                side_channel_host=old.host,
                side_channel_port=old.port,
                tp_size=old.tp_size,
                clock=lambda: time.monotonic() + offset,
            )
        p_id, d_id = "r30-aaaaaaaa", "r30x-bbbbbbbb"  # different base ids: they never pair
        pair.prefill.prefill(p_id, TOKENS, key="r30")
        pair.decode.expect(d_id, TOKENS, pair.prefill.scheduler.decode_params("r30x-aaaaaaaa"), key="r30x")
        t0 = time.monotonic()
        pair.pump(lambda: p_id in pair.sent, what="P's lease to expire on the worker's clock")
        p_elapsed = time.monotonic() - t0
        pair.pump(lambda: d_id in pair.received, what="D's watchdog on the worker's clock")
        d_elapsed = time.monotonic() - t0
        assert lease * 0.8 <= p_elapsed < lease + 1.5, f"lease expired after {p_elapsed:.2f}s"
        assert "lease" in (pair.sent[p_id] or "")
        assert reg_timeout * 0.8 <= d_elapsed < reg_timeout + 1.5, f"watchdog fired after {d_elapsed:.2f}s"
        assert "registration timeout" in (pair.received[d_id] or "")
        assert_clean(pair)


def test_31_shutdown_with_transfers_in_flight_is_bounded_and_fails_them() -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        gate = pair.fabric.faults.hold_transfer()  # never opened before shutdown
        ids = [legs(pair, f"r31-{i}") for i in range(3)]
        pair.pump(lambda: posted(pair) == 3, what="three WRITEs in flight")
        waiting = "r31w-bbbbbbbb"
        pair.decode.expect(waiting, TOKENS, pair.prefill.scheduler.decode_params("r31w-aaaaaaaa"), key="w")
        pair.pump(lambda: actor(pair.decode, "reaper").sizes()["recvs"] == 4, what="D's fourth registration")
        timeout = 1.0
        t0 = time.monotonic()
        report = pair.prefill.workers[0].shutdown(timeout=timeout)
        elapsed = time.monotonic() - t0
        assert elapsed < timeout + 0.5, f"shutdown took {elapsed:.2f}s"
        p_ids = {p for p, _ in ids}
        assert p_ids <= set(report.finished_sending)
        assert all("shutdown" in report.failed_sending.get(p, "") for p in p_ids)
        pair.prefill.collect([report])
        assert not pair.prefill.held
        assert pair.fabric.in_flight() == 0
        assert pair.fabric.stats.transfers_cancelled == 3
        # P told D, which fails those requests at once; D's own shutdown fails what still waits.
        pair.pump(lambda: all(d in pair.received for _, d in ids), what="D to hear the cancellations")
        assert all("shutdown" in (pair.received[d] or "") for _, d in ids)
        t0 = time.monotonic()
        d_report = pair.decode.workers[0].shutdown(timeout=timeout)
        assert time.monotonic() - t0 < timeout + 0.5
        assert "shut down" in d_report.failed_recving.get(waiting, "")
        pair.decode.collect([d_report])
        gate.open()
        pair.fabric.progress()
        assert pair.fabric.stats.transfers_done == 0
        assert all(untouched(pair.decode, d) for _, d in ids)
        assert_clean(pair)


def test_32_one_slow_handshake_serves_many_requests_and_delays_no_other_engine(events: EventCapture) -> None:
    slow = 2.0
    with make_pair(lease_duration=15.0, registration_timeout=20.0, handshake_timeout=10.0) as pair:
        d2 = extra_decode(pair, lease_duration=15.0, registration_timeout=20.0)
        try:
            engines = [pair.prefill, pair.decode, d2]
            pair.directory.delays[addr(pair.d_endpoint)] = slow  # P's handshake with D is slow
            many = [legs(pair, f"r32-{i}") for i in range(30)]
            pump_all(
                engines,
                lambda: any(p.engine_id == "decode" for p, _ in pair.directory.fetches),
                what="P's slow fetch to start",
            )
            t0 = time.monotonic()
            others = []
            for i in range(5):
                p_id, d_id = f"r32o-{i}-aaaaaaaa", f"r32o-{i}-cccccccc"
                d2.expect(d_id, TOKENS, pair.prefill.prefill(p_id, TOKENS, key=f"o{i}"), key=f"o{i}")
                others.append((p_id, d_id))
            pump_all(engines, lambda: all(d in d2.received for _, d in others), what="D2's pushes")
            assert time.monotonic() - t0 < slow, "requests to another engine waited for the slow handshake"
            assert not any(d in pair.received for _, d in many)
            assert all(d2.received[d] is None for _, d in others)
            pump_all(
                engines,
                lambda: all(d in pair.received and p in pair.sent for p, d in many),
                timeout=20,
                what="the slow pushes, both sides' reports",
            )
            for p_id, d_id in many:
                assert pair.received[d_id] is None and pair.sent[p_id] is None
                assert_landed(pair.decode, d_id)
            for _, d_id in others:
                assert_landed(d2, d_id)
            to_d = [p for p, _ in pair.directory.fetches if p.engine_id == "decode"]
            assert len(to_d) == 1, f"{len(to_d)} fetches of the slow peer"
            applied = events.where(event="handshake.applied", rank="prefill/pp0/tp0", peer="decode/pp0/tp0")
            assert len(applied) == 1 and applied[0]["replayed"] == 30
            assert posted(pair) == 35
            assert_clean(pair, d2)
        finally:
            d2.shutdown()
