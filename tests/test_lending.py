"""The engine's hooks lend the interpreter to the actors (core/handoff.py), over the fake
fabric with bytes checked: what a hook hands over is done when the hook returns, and a hook
that reports what finished first lets the writer poll once.

The writer polls every half second here, so nothing below happens in time unless the hook
brings it about (with ``hook_lend_max=0`` both lending checks fail: the push handed over at
start_load_kv is not in that step's report, nor is D's landing in its first report after)."""

from __future__ import annotations

from typing import Any

import pytest

from pushactors.testing import PushPair, SimSpec
from pushactors.testing.pair import wait_until

pytestmark = pytest.mark.timeout(60)

P_ID, D_ID = "lend-1-aaaaaaaa", "lend-1-bbbbbbbb"
TOKENS = 32
SLOW_POLLS: dict[str, Any] = {
    "poll_interval_idle": 0.5,
    "poll_interval_busy": 0.5,
    "poll_interval_await": 0.5,
    "poll_busy_linger": 0.0,
    "poll_spin": 0.0,
    "poll_spin_in_flight": 0.0,
    "lease_duration": 30.0,
    "hook_lend_max": 1.0,  # a bound no step here reaches: only the actors' work ends the wait
    "layerwise_save_wait": 1.0,  # likewise for wait_for_save's wait for the push's end
    "reaper_tick": 0.5,
}


def _held(pair: PushPair) -> int:
    snap = pair.prefill.workers[0].runtime.snapshot("matcher")
    return int(snap["matcher"].get("pending_registrations", 0))


def _registered(pair: PushPair) -> None:
    params = pair.prefill.scheduler.decode_params(P_ID, None)
    pair.decode.expect(D_ID, TOKENS, params, key="k")
    pair.pump(lambda: _held(pair) == 1, what="D's registration held by P")


def test_a_whole_push_is_armed_during_its_forward_and_posted_by_its_end() -> None:
    """whole_push_start="forward_end" (the default): the request is announced before its
    forward; while the forward runs, the matcher matches it and the writer opens its push (one
    group of every layer, its WRITE made ahead); by the time wait_for_save returns, that WRITE
    is posted, in one piece. No step of anyone's is needed for either."""
    with PushPair(p_spec=SimSpec(num_layers=2, num_blocks=32), **SLOW_POLLS) as pair:
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")  # announced, as vLLM's scheduler does

        def armed() -> bool:
            writer = pair.prefill.workers[0].runtime.snapshot("writer")["writer"]
            return writer["layerwise_open"] == 1 and writer["in_flight"] == 1

        wait_until(armed, timeout=10, what="the push armed (matched, open, its WRITE made)")
        assert pair.fabric.stats.transfers_posted == 0  # nothing before the forward computed it
        prefill.finish()  # the last layers, then wait_for_save
        assert pair.fabric.stats.transfers_posted == 1  # every layer in one WRITE
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.sent[P_ID] is None
        assert pair.decode.verify(D_ID)[1] == 0  # every byte D will read is P's


def test_a_push_handed_over_at_start_load_kv_is_done_by_the_same_steps_report() -> None:
    """whole_push_start="next_step": the push starts at the next step's start_load_kv, which
    lends the interpreter until the matcher matched it and the writer posted it and saw it
    end; that step's get_finished then reports it sent."""
    with PushPair(p_spec=SimSpec(num_layers=2, num_blocks=32), whole_push_start="next_step", **SLOW_POLLS) as pair:
        _registered(pair)
        pair.prefill.prefill(P_ID, TOKENS, key="k")  # request_finished: handed over next step
        assert pair.fabric.stats.transfers_posted == 0
        report = pair.prefill.step()
        assert pair.fabric.stats.transfers_posted == 1
        assert P_ID in report.finished_sending and pair.sent[P_ID] is None
        stats = pair.prefill.workers[0].stats()
        assert stats["hook.lent"] >= 1 and stats.get("hook.lend_bound", 0) == 0, stats
        pair.pump(lambda: D_ID in pair.received, what="D's report")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0


def test_ds_first_report_after_the_landing_names_it() -> None:
    """D awaits an answer, so its get_finished lends with a poll: the writer's next poll comes
    at once (not up to half a second later), and the landing is in that call's report."""
    with PushPair(p_spec=SimSpec(num_layers=2, num_blocks=32), **SLOW_POLLS) as pair:
        _registered(pair)
        pair.prefill.prefill_layers(P_ID, TOKENS, key="k").finish()
        # No step of D's until the completion is in its agent: nothing polled it for D yet.
        wait_until(lambda: pair.fabric.stats.transfers_done == 1, timeout=10, what="the WRITE and its completion")
        report = pair.decode.step()
        assert D_ID in report.finished_recving and pair.received[D_ID] is None
        assert pair.decode.verify(D_ID)[1] == 0
        stats = pair.decode.workers[0].stats()
        assert stats["hook.lent"] >= 1, stats


def test_a_step_that_gives_the_actors_nothing_and_awaits_nothing_does_not_lend() -> None:
    with PushPair(p_spec=SimSpec(num_layers=2, num_blocks=32), **SLOW_POLLS) as pair:
        for _ in range(20):
            pair.step()
        for engine in (pair.prefill, pair.decode):
            assert engine.workers[0].stats().get("hook.lent", 0) == 0


def test_a_registration_that_comes_after_ps_blocks_is_read_and_pushed_in_ps_next_hook() -> None:
    """P holds finished blocks and no registration yet: its get_finished lends for one poll,
    so a registration that arrived since is read off NIXL, matched and posted before the hook
    returns (not when the writer next wins the interpreter)."""
    spec = SimSpec(num_layers=2, num_blocks=32)
    with PushPair(p_spec=spec, whole_push_start="next_step", **SLOW_POLLS) as pair:
        # A first push, so both sides know each other (handshakes are not lent for).
        params = pair.prefill.scheduler.decode_params("warm-1-aaaaaaaa", None)
        pair.decode.expect("warm-1-bbbbbbbb", TOKENS, params, key="w")
        pair.prefill.prefill("warm-1-aaaaaaaa", TOKENS, key="w")
        pair.pump(lambda: "warm-1-bbbbbbbb" in pair.received and "warm-1-aaaaaaaa" in pair.sent, what="warm-up")
        delivered = pair.fabric.stats.notifs_delivered

        pair.prefill.prefill(P_ID, TOKENS, key="k")
        pair.prefill.step()  # handed over: held, waiting for D
        assert pair.fabric.stats.transfers_posted == 1
        params = pair.prefill.scheduler.decode_params(P_ID, None)
        pair.decode.expect(D_ID, TOKENS, params, key="k")
        pair.decode.step()  # D's start_load_kv lends: its registration goes out
        wait_until(lambda: pair.fabric.stats.notifs_delivered > delivered, timeout=10, what="D's registration at P")
        pair.prefill.step()
        assert pair.fabric.stats.transfers_posted == 2
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
