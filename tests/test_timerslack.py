"""``poll_timer_slack``: the writer thread's timer slack, so its tight polling interval is the
interval asked for (Linux lets a timed wait end up to the slack late, 50 µs by default)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pushactors.actors.writer.timerslack import set_timer_slack, timer_slack
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
    from pushactors.actors.writer.cadence import PollCadence

    mine = timer_slack()
    was, now = _in_thread(PollCadence(PushConfig(engine_id="e", poll_timer_slack=3e-6)).own_thread)
    assert was == pytest.approx(mine) and now == pytest.approx(3e-6)
    was, now = _in_thread(PollCadence(PushConfig(engine_id="e")).own_thread)
    assert was == pytest.approx(mine) and now == pytest.approx(mine)  # unset: untouched


@pytest.fixture
def kernel_slack() -> Iterator[None]:
    """This thread, and every thread it starts, with the kernel's default 50 µs slack, so a
    window of 1-3 µs is there to see whatever slack the process runs with; then back."""
    was = set_timer_slack(50e-6)
    assert was is not None
    try:
        yield
    finally:
        set_timer_slack(was)


@linux_only
@pytest.mark.usefixtures("kernel_slack")
def test_the_await_window_runs_with_its_own_slack_and_gives_the_thread_back_its_own() -> None:
    """While the writer polls at the await interval (an answer or a last layer is awaited) its
    thread runs with ``await_timer_slack``; any other interval gives it back the slack it had.
    One system call per change, none per poll."""
    from pushactors.actors.writer.cadence import PollCadence

    def run(config: PushConfig) -> list[tuple[float | None, int]]:
        c = PollCadence(config)
        c.own_thread()
        seen = []
        for awaiting in (True, True, False, False, True):
            c.delay(1.0, just_posted=False, awaiting=lambda a=awaiting: a, in_flight=True)
            seen.append((timer_slack(), c.switches))
        c.delay(1.0, just_posted=True, awaiting=lambda: False, in_flight=True)  # no wait: no change
        seen.append((timer_slack(), c.switches))
        return seen

    mine = timer_slack()
    got = _in_thread(lambda: run(PushConfig(engine_id="e", await_timer_slack=2e-6)))
    assert [s for s, _ in got] == pytest.approx([2e-6, 2e-6, mine, mine, 2e-6, 2e-6])
    assert [n for _, n in got] == [1, 1, 2, 2, 3, 3]
    off = _in_thread(lambda: run(PushConfig(engine_id="e", await_timer_slack=None)))
    assert [s for s, _ in off] == pytest.approx([mine] * 6) and off[-1][1] == 0
    # A thread already as tight as the await window asks never changes.
    tight = _in_thread(lambda: run(PushConfig(engine_id="e", poll_timer_slack=1e-6, await_timer_slack=2e-6)))
    assert [s for s, _ in tight] == pytest.approx([1e-6] * 6) and tight[-1][1] == 0


def test_a_cadence_that_owns_no_thread_never_touches_the_callers_slack() -> None:
    from pushactors.actors.writer.cadence import PollCadence

    mine = timer_slack()
    c = PollCadence(PushConfig(engine_id="e"))
    c.delay(1.0, just_posted=False, awaiting=lambda: True, in_flight=False)
    assert timer_slack() == mine and c.switches == 0


@pytest.mark.parametrize("bad", [0, -1e-6, 0.01, True, "1e-6"])
def test_the_await_setting_refuses_what_no_thread_should_get(bad: Any) -> None:
    with pytest.raises(ConfigError, match="await_timer_slack"):
        PushConfig(engine_id="e", await_timer_slack=bad)
    assert PushConfig(engine_id="e").await_timer_slack == 1e-6


def _thread_slack(tid: int) -> float:
    with open(f"/proc/{tid}/timerslack_ns") as f:  # a thread of this process, by its id
        return int(f.read()) / 1e9


@linux_only
@pytest.mark.usefixtures("kernel_slack")
def test_d_writer_thread_is_tight_only_while_it_awaits_its_answer() -> None:
    """End to end: D's writer thread runs with the await slack from its registration until
    P's completion arrives, then with its own again (read from /proc, not from our books)."""
    from pushactors.actors.pykka_internals import actor_object

    mine = timer_slack()
    spec = SimSpec(num_layers=2, num_blocks=8)
    with PushPair(p_spec=spec, await_timer_slack=3e-6, lease_duration=30.0) as pair:
        writer: Any = actor_object(pair.decode.workers[0].runtime.refs["writer"])
        assert writer is not None and writer.native_thread_id
        tid = writer.native_thread_id
        assert _thread_slack(tid) == pytest.approx(mine)  # nothing awaited yet
        params = pair.prefill.scheduler.decode_params("ts-1", None)
        pair.decode.expect("ts-1-dddddddd", 16, params, key="k")
        pair.pump(lambda: _thread_slack(tid) == pytest.approx(3e-6), what="D's writer tight while it awaits")
        pair.prefill.prefill("ts-1-aaaaaaaa", 16, key="k")
        pair.pump(lambda: "ts-1-dddddddd" in pair.received, what="the push")
        assert pair.received["ts-1-dddddddd"] is None
        pair.pump(lambda: _thread_slack(tid) == pytest.approx(mine), what="D's writer back to its own slack")
