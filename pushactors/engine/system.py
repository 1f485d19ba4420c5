"""One rank's actor system: starts the four actors, wires them, and supervises them.

Supervision: a small thread (not an actor, so it cannot die with them) checks every actor each
``reaper_tick``. If one died, the rank is marked unhealthy at once (later work fails at once),
then stops its actors (releasing NIXL resources) and reports every request it still held as
failed. Stopping actors takes time, so it never runs on the caller's (the engine's) thread:
:meth:`RankRuntime.check` only looks. A rank never stalls silently.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pykka

from ..actors.base import RankContext
from ..actors.handshake import Handshake
from ..actors.inbox import TimedInbox
from ..actors.matcher import Matcher
from ..actors.pykka_internals import actor_object
from ..actors.reaper import Reaper
from ..actors.stager import Stager
from ..actors.writer.actor import Writer
from ..logs import get_logger
from ..protocol import Drain
from ..transport.agent import AgentFactory
from ..transport.directory import MetadataSource


class RankRuntime:
    def __init__(
        self,
        ctx: RankContext,
        *,
        agent_factory: AgentFactory,
        source: MetadataSource,
        compat_hash: str,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.log = get_logger(actor="supervisor", rank=ctx.label)
        self._on_death = on_death
        self.dead: str | None = None
        self.dead_reason: str | None = None
        # Each actor's tables as last read by supervision (every ``stats_interval``): the
        # operators' gauges read them here, never through a mailbox from the engine's thread.
        self.tables: dict[str, dict[str, int]] = {}
        self._stopping = threading.Event()
        self._stopped = False
        self.writer = Writer.start(ctx, agent_factory)
        self.handshake = Handshake.start(ctx, source, compat_hash)
        self.matcher = Matcher.start(ctx)
        self.reaper = Reaper.start(ctx)
        self.stager = Stager.start(ctx)
        peers = ctx.peers
        peers.writer, peers.handshake, peers.matcher, peers.reaper, peers.stager = (
            self.writer,
            self.handshake,
            self.matcher,
            self.reaper,
            self.stager,
        )
        self._supervisor = threading.Thread(
            target=self._supervise, name=f"pushactors-supervisor-{ctx.label}", daemon=True
        )
        self._supervisor.start()

    @property
    def refs(self) -> dict[str, pykka.ActorRef[Any]]:
        return {
            "writer": self.writer,
            "handshake": self.handshake,
            "matcher": self.matcher,
            "reaper": self.reaper,
            "stager": self.stager,
        }

    @property
    def healthy(self) -> bool:
        return self.dead is None and not self._stopped

    def snapshot(self, name: str | None = None, *, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """Each actor's table sizes and counters, read on the actor's own thread through its
        mailbox: safe while the actors run. Everything told to an actor before this call has
        been handled when its part returns (mailboxes are FIFO), so it doubles as a barrier."""
        names = [name] if name is not None else list(self.refs)
        futures = {n: self.refs[n].proxy().snapshot() for n in names}
        return {n: f.get(timeout=timeout) for n, f in futures.items()}

    def barrier(self, *, timeout: float = 5.0) -> None:
        """Return once every actor handled every message sent to it before this call."""
        self.snapshot(timeout=timeout)

    def view(self, name: str) -> ActorView:
        """A handle whose ``sizes()`` reads one actor's tables through its mailbox."""
        return ActorView(self, name)

    def check(self) -> str | None:
        """Detect a dead actor now (never blocks); returns its name if one died. The rank's
        actors are stopped and its requests failed on a thread of their own."""
        if self.dead is not None or self._stopped or not self.ctx.stopped:
            return self.dead
        for name, ref in self.refs.items():
            if not ref.is_alive():
                if self._mark_dead(name):
                    threading.Thread(
                        target=self._handle_death, name=f"pushactors-death-{self.ctx.label}", daemon=True
                    ).start()
                return name
        return None

    def _supervise(self) -> None:
        # Asleep until an actor stops (each rings the bell on every way it stops) or the next
        # stats are due; a slow look at the refs as well, should a stop ever go unrung.
        every = self.ctx.config.stats_interval
        next_stats = time.monotonic() + every
        bell = self.ctx.stop_bell
        while True:
            wait = SUPERVISOR_LOOK_S
            if every:
                wait = min(wait, max(0.0, next_stats - time.monotonic()))
            if bell.wait(wait):
                bell.clear()  # before the look below: a stop after it rings again
            if self._stopping.is_set() or self.dead is not None or self._stopped:
                return
            for name, ref in self.refs.items():
                if not ref.is_alive():
                    if self._mark_dead(name):
                        self._handle_death()
                    return
            if every and time.monotonic() >= next_stats:
                next_stats = time.monotonic() + every
                self._log_stats()

    def _log_stats(self) -> None:
        """One ``rank.stats`` event: each actor's mailbox depth (read without asking it), its
        tables and handled count (asked through its mailbox, so a wedged actor shows as missing
        rather than stalling supervision), and the rank's counters."""
        mailbox: dict[str, int] = {}
        futures = {}
        for name, ref in self.refs.items():
            inbox = getattr(actor_of(ref), "actor_inbox", None)
            mailbox[name] = len(inbox) if isinstance(inbox, TimedInbox) else -1
            futures[name] = ref.proxy().snapshot()
        deadline = time.monotonic() + min(1.0, self.ctx.config.stats_interval / 2)
        tables: dict[str, dict[str, int]] = {}
        unanswered = []
        for name, future in futures.items():
            try:
                tables[name] = future.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # busy past the deadline, or stopping
                unanswered.append(name)
        self.tables = {**self.tables, **tables}  # one reference swap: readers see a whole dict
        self.log.debug(
            "rank.stats",
            interval=self.ctx.config.stats_interval,
            mailbox=mailbox,
            tables=tables,
            unanswered=unanswered,
            counters=self.ctx.metrics.snapshot(),
        )

    def _mark_dead(self, name: str) -> bool:
        """Record the death (once); True for the caller that must handle it."""
        with _death_lock:
            if self.dead is not None:
                return False
            self.dead = name
        cause = repr(getattr(actor_of(self.refs[name]), "died", None))
        self.dead_reason = f"{name} actor died: {cause}"
        self.ctx.metrics.incr("rank.actor_died")
        self.log.critical("rank.unhealthy", dead_actor=name, cause=cause)
        return True

    def _handle_death(self) -> None:
        # Stop first, report after: a request is failed (its blocks freed) only once nothing
        # of this rank can still be writing from or into them.
        self._stop_actors(timeout=5.0)
        if self._on_death is not None and self.dead_reason is not None:
            self._on_death(self.dead_reason)

    def _stop_actors(self, timeout: float) -> None:
        for name in ("handshake", "matcher", "reaper", "stager", "writer"):
            ref = self.refs[name]
            try:
                ref.stop(block=True, timeout=timeout)
            except pykka.ActorDeadError:
                pass
            except pykka.Timeout:
                self.log.error("actor.stop_timeout", dead_actor=name)

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """Drain the writer (in-flight WRITEs settle or are cancelled), then stop every actor."""
        if self._stopped:
            return {}
        self._stopping.set()
        self.ctx.stop_bell.set()  # the supervisor wakes and leaves
        self.ctx.handoff.close()  # no engine hook waits on actors that are going away
        if self.ctx.config.stats_interval and self.dead is None:
            self._log_stats()  # the final gauges, so a reader's last numbers are exact
        summary: dict[str, int] = {}
        deadline = time.monotonic() + timeout * 0.8
        if self.writer.is_alive():
            try:
                summary = self.writer.ask(Drain(deadline=deadline), block=True, timeout=timeout)
            except (pykka.Timeout, pykka.ActorDeadError):
                self.log.error("writer.drain_timeout")
        self._stop_actors(timeout=max(1.0, timeout * 0.2))
        self._stopped = True
        self._supervisor.join(timeout=1.0)
        return summary or {}


class ActorView:
    """One actor's tables, read through its mailbox (see :meth:`RankRuntime.snapshot`)."""

    def __init__(self, runtime: RankRuntime, name: str) -> None:
        self._runtime = runtime
        self.name = name

    def sizes(self, timeout: float = 5.0) -> dict[str, int]:
        return self._runtime.snapshot(self.name, timeout=timeout)[self.name]


_death_lock = threading.Lock()
# How often the supervisor looks at its actors' refs when no stop has rung (a safety net only).
SUPERVISOR_LOOK_S = 1.0


def actor_of(ref: pykka.ActorRef[Any]) -> object:
    """The object behind an actor reference (introspection only; Pykka holds it weakly)."""
    return actor_object(ref)
