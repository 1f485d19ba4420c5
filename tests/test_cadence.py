"""PollCadence: the writer's polling interval, thread-free."""

from __future__ import annotations

import pytest

from pushactors.actors.writer.cadence import PollCadence
from pushactors.core.config import PushConfig

CONFIG = PushConfig(
    engine_id="e",
    poll_interval_busy=0.0002,
    poll_interval_await=0.00005,
    poll_interval_idle=0.02,
    poll_busy_linger=0.05,
)


def _never() -> bool:
    raise AssertionError("asked whether anything is awaited while a tighter reason held")


def test_a_write_just_posted_goes_first_and_the_await_question_is_not_even_asked() -> None:
    c = PollCadence(CONFIG)
    assert c.delay(0.0, just_posted=True, awaiting=_never, in_flight=True) == 0.0


def test_each_reason_gives_its_interval_tightest_first() -> None:
    c = PollCadence(CONFIG)
    assert c.delay(0.0, just_posted=False, awaiting=lambda: True, in_flight=True) == CONFIG.poll_interval_await
    assert c.delay(0.0, just_posted=False, awaiting=lambda: False, in_flight=True) == CONFIG.poll_interval_busy
    assert c.delay(0.0, just_posted=False, awaiting=lambda: False, in_flight=False, activity=1) == 0.0002


def test_quiet_polls_back_off_step_by_step_to_idle_and_traffic_or_a_linger_resets_them() -> None:
    c = PollCadence(CONFIG)
    quiet = [c.delay(100.0, just_posted=False, awaiting=lambda: False, in_flight=False) for _ in range(10)]
    assert quiet[:3] == pytest.approx([0.0004, 0.0008, 0.0016])
    assert quiet == sorted(quiet) and quiet[-1] == CONFIG.poll_interval_idle
    c.linger(100.0)
    assert c.delay(100.01, just_posted=False, awaiting=lambda: False, in_flight=False) == CONFIG.poll_interval_busy
    # Past the linger the back-off starts again from its first step.
    assert c.delay(100.06, just_posted=False, awaiting=lambda: False, in_flight=False) == pytest.approx(0.0004)


def test_a_writer_quiet_long_enough_and_holding_nothing_sleeps_deeper_until_stirred() -> None:
    from pushactors.actors.writer.cadence import DEEP_AFTER_S, DEEP_FACTOR

    def quiet(c: PollCadence, now: float, holds_nothing: bool) -> float:
        return c.delay(
            now, just_posted=False, awaiting=lambda: False, in_flight=False, holds_nothing=lambda: holds_nothing
        )

    c = PollCadence(CONFIG)
    c.delay(10.0, just_posted=False, awaiting=lambda: False, in_flight=False, activity=1)  # traffic at t=10
    for _ in range(12):
        assert quiet(c, 10.5, True) <= CONFIG.poll_interval_idle  # quiet, but not long enough yet
    assert not c.deep
    # Quiet long enough, but holding something on a timer (a push, an answer, a retry): idle only.
    assert quiet(c, 10.0 + DEEP_AFTER_S, False) == CONFIG.poll_interval_idle and not c.deep
    assert quiet(c, 10.0 + DEEP_AFTER_S, True) == pytest.approx(DEEP_FACTOR * CONFIG.poll_interval_idle)
    assert c.deep
    # A message: quiet starts again, and the caller learns it must poll sooner.
    assert c.stirred(12.0) and not c.deep
    assert not c.stirred(12.0)  # not deep any more: nothing to bring forward
    assert quiet(c, 12.5, True) == CONFIG.poll_interval_idle
    assert quiet(c, 12.0 + DEEP_AFTER_S, True) == pytest.approx(DEEP_FACTOR * CONFIG.poll_interval_idle)
    # Anything awaited ends the deep sleep at once.
    assert c.delay(13.5, just_posted=False, awaiting=lambda: True, in_flight=False) == CONFIG.poll_interval_await
    assert not c.deep
