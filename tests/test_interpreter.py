"""``switch_interval``: the engine's interpreter switch interval, set when a worker starts.

Every mailbox hop (and on the H200 every NIXL call) gives up the GIL; while an engine thread
runs Python, getting it back can take a whole switch interval. The setting is opt-in and
process-wide; these tests check that it validates, that a worker applies it and says so, and
that without it the interpreter is left alone. Its effect on latency is measured by
``pushactors bench small --engine-busy`` or ``--engine model`` (docs/performance.md), not timed here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from pushactors.core.config import ConfigError, PushConfig
from pushactors.logs import capture_events
from pushactors.testing import PushPair


@pytest.fixture
def restore_switch_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    try:
        yield before
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("value", [1e-5, 0.0002, 0.005, 0.1])
def test_switch_interval_in_range_accepted(value: float) -> None:
    assert PushConfig(engine_id="e", switch_interval=value).switch_interval == value
    assert PushConfig.from_dict({"engine_id": "e", "switch_interval": value}).switch_interval == value


@pytest.mark.parametrize("bad", [0, 0.0, -0.001, 0.5, True, "0.001", float("nan"), float("inf")])
def test_switch_interval_out_of_range_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match="switch_interval"):
        PushConfig(engine_id="e", switch_interval=bad)
    with pytest.raises(ConfigError, match="switch_interval"):
        PushConfig.from_dict({"engine_id": "e", "switch_interval": bad})


def test_a_worker_sets_the_interval_it_is_given_and_logs_it(restore_switch_interval: float) -> None:
    wanted = 0.00025 if restore_switch_interval != 0.00025 else 0.0003
    with capture_events() as events, PushPair(switch_interval=wanted):
        assert sys.getswitchinterval() == pytest.approx(wanted)
    (first, *_) = events.named("interpreter.switch_interval")  # the first worker changed it
    assert first["was_s"] == pytest.approx(restore_switch_interval) and first["now_s"] == wanted


def test_without_the_setting_the_interpreter_is_left_alone(restore_switch_interval: float) -> None:
    sys.setswitchinterval(0.0042)  # an engine's own choice
    with capture_events() as events, PushPair():
        assert sys.getswitchinterval() == pytest.approx(0.0042)
    assert not events.named("interpreter.switch_interval")


def test_a_later_worker_asking_another_interval_wins_and_says_what_it_replaced(restore_switch_interval: float) -> None:
    """Process-wide: the last worker to start sets it, and its event names the value it replaced;
    workers asking for the value already set change nothing and log nothing."""
    with PushPair(switch_interval=0.0003):
        pass
    with capture_events() as events, PushPair(switch_interval=0.0004):
        assert sys.getswitchinterval() == pytest.approx(0.0004)
    (changed,) = events.named("interpreter.switch_interval")  # the second worker of the pair asked the same
    assert changed["was_s"] == pytest.approx(0.0003) and changed["now_s"] == 0.0004
