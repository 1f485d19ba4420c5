"""When the writer polls NIXL next: plain state, no threads, no NIXL.

The writer polls (settles WRITEs, reads notifications) on a timer whose interval follows what
is waiting on it. Tightest first: a WRITE just posted that still runs is polled without pause
(UCX finishes it, and sends the completion riding on it, only while P progresses); an answer D
awaits, or an engine waiting on its last layers, at ``poll_interval_await``; WRITEs in flight or
recent traffic at ``poll_interval_busy``; otherwise one back-off step per quiet poll, up to
``poll_interval_idle``. While it polls at the await interval its thread runs with
``await_timer_slack``, so those waits end when asked instead of up to the kernel's 50 µs late.

A writer that holds nothing on a timer (no push, answer, parked work or retry) and has been
quiet for ``DEEP_AFTER_S`` sleeps deeper, ``DEEP_FACTOR`` idle intervals between polls: an idle
rank then costs little more than NIXL's own threads. Anything in its mailbox, or an engine step
with work (``Handoff.rouse``), brings it back to the idle interval at once; only inbound traffic
to a rank whose engine is not stepping waits up to one deep interval.
"""

from __future__ import annotations

from collections.abc import Callable

from ...core.config import PushConfig
from .timerslack import set_timer_slack, timer_slack

DEEP_AFTER_S = 1.0  # quiet this long (and holding nothing timed) before sleeping deeper
DEEP_FACTOR = 5  # idle intervals between polls when deep


class PollCadence:
    """The writer's polling interval (see the module docstring)."""

    def __init__(self, config: PushConfig) -> None:
        self.config = config
        self.linger_until = 0.0  # busy polling until then: an answer is expected
        self.idle_polls = 0  # quiet polls in a row: the back-off step
        self.quiet_since = 0.0  # the last poll with anything to do, or the last message
        self.deep = False  # polling at the deep interval now
        # The owning thread's slack outside the await window (None: not owned, or unknown) and
        # whether it runs with ``await_timer_slack`` now; how often that changed.
        self.base_slack: float | None = None
        self.tight = False
        self.switches = 0

    def own_thread(self) -> tuple[float | None, float | None]:
        """Give the calling thread (the writer's) ``poll_timer_slack``, so its timed waits end
        when asked (timerslack.py); its slack (before, now), None where unknown. From now on
        :meth:`delay` also gives it ``await_timer_slack`` while it polls at the await interval
        (so it must only be called on this thread)."""
        slack = self.config.poll_timer_slack
        was = set_timer_slack(slack) if slack is not None else timer_slack()
        self.base_slack = now = timer_slack()
        return was, now

    def _await_slack(self, tight: bool) -> None:
        """Enter or leave the await window's timer slack (one system call per change)."""
        want = self.config.await_timer_slack
        base = self.base_slack
        if tight == self.tight or want is None or base is None or want >= base:
            return
        if set_timer_slack(want if tight else base) is not None:
            self.tight = tight
            self.switches += 1

    def linger(self, now: float) -> None:
        """Poll at the busy interval for ``poll_busy_linger`` from ``now``."""
        self.linger_until = max(self.linger_until, now + self.config.poll_busy_linger)

    def stirred(self, now: float) -> bool:
        """A message reached the writer: quiet starts again. True when it was sleeping deep
        (its next poll should come within the idle interval)."""
        self.quiet_since = now
        was, self.deep = self.deep, False
        return was

    def delay(
        self,
        now: float,
        *,
        just_posted: bool,
        awaiting: Callable[[], bool],
        in_flight: bool,
        activity: int = 0,
        holds_nothing: Callable[[], bool] = lambda: False,
    ) -> float:
        """Seconds to the next poll. ``just_posted``: a WRITE posted less than
        ``poll_spin_in_flight`` ago still runs; ``awaiting()``: an answer or the end of a last
        layer is awaited (asked only when nothing tighter holds); ``holds_nothing()``: no
        state of the writer's waits on a timer (asked only once quiet long enough)."""
        cfg = self.config
        busy = cfg.poll_interval_busy
        self.deep = False
        if just_posted:
            self.idle_polls = 0
            self.quiet_since = now
            return 0.0
        if awaiting():
            self.idle_polls = 0
            self.quiet_since = now
            self._await_slack(True)
            return min(busy, cfg.poll_interval_await)
        self._await_slack(False)
        if in_flight or activity or now < self.linger_until:
            self.idle_polls = 0
            self.quiet_since = now
            return busy
        self.idle_polls = min(self.idle_polls + 1, 30)
        idle = float(min(cfg.poll_interval_idle, busy * (2**self.idle_polls)))
        if idle >= cfg.poll_interval_idle and now - self.quiet_since >= DEEP_AFTER_S and holds_nothing():
            self.deep = True
            return idle * DEEP_FACTOR
        return idle
