"""``poll_timer_slack``: the writer thread's timer slack, so its tight polling interval is the
interval asked for (Linux lets a timed wait end up to the slack late, 50 µs by default)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from pushactors.actors.timerslack import set_timer_slack, timer_slack
from pushactors.core.config import ConfigError, PushConfig
from pushactors.testing import PushPair, SimSpec

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux setting")


def _in_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout=10)
    assert not t.is_alive()
    return out[0]


@linux_only
def test_the_slack_changes_the_calling_thread_only() -> None:
    mine = timer_slack()
    assert mine is not None and mine > 0

    def change() -> tuple[float | None, float | None]:
        was = set_timer_slack(2e-6)
        return was, timer_slack()

    was, now = _in_thread(change)
    assert was == pytest.approx(mine) and now == pytest.approx(2e-6)
    assert timer_slack() == pytest.approx(mine)  # this thread kept its own


@pytest.mark.parametrize("bad", [0.0, -1e-6, float("nan")])
def test_a_slack_of_zero_or_less_is_refused_not_read_as_the_default(bad: float) -> None:
    with pytest.raises(ValueError, match="above 0"):
        set_timer_slack(bad)


@pytest.mark.parametrize("bad", [0, -1e-6, 0.01, True, "1e-6"])
def test_the_setting_refuses_what_no_thread_should_get(bad: Any) -> None:
    with pytest.raises(ConfigError, match="poll_timer_slack"):
        PushConfig(engine_id="e", poll_timer_slack=bad)
    assert PushConfig(engine_id="e", poll_timer_slack=None).poll_timer_slack is None
    assert PushConfig(engine_id="e").poll_timer_slack is None  # the kernel's own, unless asked


@linux_only
@pytest.mark.parametrize("setting", [5e-6, None], ids=["set", "unset"])
def test_each_writer_thread_polls_with_the_configured_slack_and_no_other_thread_changes(
    setting: float | None,
) -> None:
    mine = timer_slack()
    spec = SimSpec(num_layers=2, num_blocks=8)
    with PushPair(p_spec=spec, poll_timer_slack=setting) as pair:
        for engine in (pair.prefill, pair.decode):
            writer = engine.workers[0].runtime.refs["writer"].proxy()
            assert writer.timer_slack_s.get(timeout=5) == pytest.approx(setting if setting else mine)
    assert timer_slack() == pytest.approx(mine)


@linux_only
def test_the_cadence_gives_its_thread_the_setting_and_says_what_it_had() -> None:
    from pushactors.actors.cadence import PollCadence

    mine = timer_slack()
    was, now = _in_thread(PollCadence(PushConfig(engine_id="e", poll_timer_slack=3e-6)).own_thread)
    assert was == pytest.approx(mine) and now == pytest.approx(3e-6)
    was, now = _in_thread(PollCadence(PushConfig(engine_id="e")).own_thread)
    assert was == pytest.approx(mine) and now == pytest.approx(mine)  # unset: untouched
