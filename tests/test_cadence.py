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
