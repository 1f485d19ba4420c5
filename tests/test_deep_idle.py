"""An idle writer sleeps deeper, and wakes for the work that comes (fake fabric).

A writer quiet for a while that holds nothing on a timer polls at several idle intervals
(actors/writer/cadence.py). What must not wait for that: a message in its mailbox (D sending a
registration), and an engine step with work (P starting a prefill), which rouses it."""

from __future__ import annotations

import time

from pushactors.actors.writer.cadence import DEEP_AFTER_S
from pushactors.testing import PushPair, wait_until

TOKENS = 40


def deep(engine: object) -> bool:
    return bool(engine.workers[0].ctx.handoff.deep)  # type: ignore[attr-defined]


def test_idle_writers_sleep_deep_and_a_push_from_deep_sleep_lands() -> None:
    with PushPair() as pair:
        wait_until(lambda: deep(pair.prefill) and deep(pair.decode), timeout=10, what="both writers to sleep deep")
        # P's engine steps with a prefill: its writer is roused at that step, not at its next poll.
        params = pair.prefill.prefill("deep-1-aaaaaaaa", TOKENS, key="deep-1")
        pair.prefill.step()
        assert not deep(pair.prefill)
        # D's registration is a message to its writer: no deep sleep after it.
        pair.decode.expect("deep-1-bbbbbbbb", TOKENS, params, key="deep-1")
        pair.pump(lambda: "deep-1-bbbbbbbb" in pair.received, timeout=10, what="the push from deep sleep")
        assert pair.received["deep-1-bbbbbbbb"] is None
        checked, wrong = pair.decode.verify("deep-1-bbbbbbbb")
        assert checked > 0 and wrong == 0  # P's bytes, in the right blocks


def test_a_writer_holding_an_answer_never_sleeps_deep() -> None:
    # D registered and P never answers (no prefill): D awaits the answer, so it keeps polling.
    with PushPair() as pair:
        params = pair.prefill.scheduler.decode_params("held-1-aaaaaaaa", None)
        pair.decode.expect("held-1-bbbbbbbb", TOKENS, params, key="held-1")
        d_writer = pair.decode.workers[0].runtime.view("writer")
        pair.pump(lambda: d_writer.sizes()["answers_awaited"] == 1, timeout=10, what="D to send its registration")
        pair.pump(lambda: deep(pair.prefill), timeout=10, what="P's writer to sleep deep")
        assert not deep(pair.decode)
        assert d_writer.sizes()["answers_awaited"] == 1
        assert "held-1-bbbbbbbb" not in pair.received


def test_p_holding_a_finished_request_keeps_polling_for_its_registration() -> None:
    # P's prefill is over and its blocks wait for D's registration; P's engine stops stepping
    # (nothing else to do). Its writer must not sleep deep: the registration is read in time.
    with PushPair() as pair:
        params = pair.prefill.prefill("late-1-aaaaaaaa", TOKENS, key="late-1")
        matcher = pair.prefill.workers[0].runtime.view("matcher")
        pair.pump(lambda: matcher.sizes()["finished"] == 1, timeout=10, what="P's finished request held")
        quiet = time.monotonic()
        wait_until(lambda: deep(pair.decode), timeout=10, what="D's idle writer to sleep deep")
        # Well past the deep-sleep threshold since P's last message (a deadline, not a sleep).
        wait_until(
            lambda: deep(pair.prefill) or time.monotonic() - quiet > 2 * DEEP_AFTER_S + 0.5,
            timeout=10,
            what="P's writer to sleep deep, or the threshold to pass",
        )
        assert not deep(pair.prefill), "P sleeps deep while a finished request waits for its registration"
        pair.decode.expect("late-1-bbbbbbbb", TOKENS, params, key="late-1")
        pair.pump(lambda: "late-1-bbbbbbbb" in pair.received, timeout=10, what="the push")
        assert pair.received["late-1-bbbbbbbb"] is None
