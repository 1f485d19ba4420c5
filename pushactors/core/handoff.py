"""Where the engine thread lends the interpreter to its rank's actors.

An engine thread that runs Python keeps CPython's interpreter lock; the actors, threads of the
same process, get it only when the engine blocks, or when CPython's switch interval (5 ms by
default) forces a hand-over. A push whose hops each wait for that takes milliseconds for
microseconds of work. The engine's connector hooks run on that thread every step, though, so a
hook can hand the lock over at a point of its own choosing: when the hot-path actors have work
(a message in a mailbox, a handler running) or the writer has WRITEs or answers outstanding,
the hook blocks here, without the lock and for at most a bound, until they are quiet, the
WRITEs it handed over have ended (NIXL's progress runs in the writer's polls: a WRITE whose
initiator does not poll does not end), or the writer has polled NIXL once after the hook came.
A step that gives the actors nothing and waits for nothing pays a few attribute reads of this
one object: a hot-path mailbox that takes a message marks it stirred, and only a stirred hand-
over looks at the members themselves (an engine thread back from a device wait finds them cold
in the CPU's caches, where each costs microseconds).

This changes *when* the actors run, never who owns what: every member keeps its mailbox, the
writer alone touches NIXL, and nothing is decided on what a wait saw (a wait that ends at its
bound only means the next hook looks again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lent:
    """What one hook's lending took: seconds blocked, and whether the actors got quiet (and
    polled, when a poll was due) before the bound."""

    waited_s: float = 0.0
    quiet: bool = True
    polled: bool = True
    settled: bool = True

    @property
    def lent(self) -> bool:
        return self.waited_s > 0.0


NOTHING = Lent()


class Handoff:
    """The rank's hand-over point between the engine thread and its hot-path actors.

    Actors ``join`` with a ``busy`` callable (messages waiting or a handler running) and call
    :meth:`idle` when they finish a message with an empty mailbox; the writer calls
    :meth:`poll_started` and :meth:`poll_ended` around each poll, keeps :attr:`in_flight`
    (WRITEs in progress) and :attr:`awaited` (answers D awaits) current, the matcher
    :attr:`held` (P's finished requests not pushed yet), and the writer sets
    :attr:`wake_writer` so a hook can bring its next poll forward. The engine thread calls
    :meth:`lend` from its hooks."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._members: list[Callable[[], bool]] = []
        self._waiting = 0  # hooks blocked in lend (one engine thread: 0 or 1)
        self._polls_started = 0
        self._polls_ended = 0
        # Written by the writer only, after each message and poll.
        self.in_flight = 0  # WRITEs in progress
        self.awaited = 0  # answers (completions, failures) D awaits
        self.held = 0  # written by the matcher: P's finished requests not pushed yet
        self.wake_writer: Callable[[], None] | None = None
        self.rouse_writer: Callable[[], None] | None = None
        self.deep = False  # written by the writer: it polls at its deep interval now
        self.roused = False  # set by an engine hook that roused a deep writer, cleared by it
        self.closed = False
        # Set (never cleared) by the members' mailboxes and handlers; cleared only by a hook
        # that then finds every member quiet. A member with work has left it set.
        self.stirred = False

    # --- the actors' side ------------------------------------------------------------------
    def join(self, busy: Callable[[], bool]) -> None:
        """Count an actor among the hot path: a hook waits while ``busy()`` says it has work.
        The member sets :attr:`stirred` whenever it takes a message or starts handling one."""
        self._members.append(busy)

    def stir(self) -> None:
        """A member got a message (called by its mailbox on every put)."""
        self.stirred = True

    def idle(self) -> None:
        """An actor finished a message and its mailbox is empty (cheap when no hook waits)."""
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def poll_started(self) -> None:
        self._polls_started += 1  # the writer's thread alone writes it

    def poll_ended(self) -> None:
        self._polls_ended += 1
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def close(self) -> None:
        """The actors are stopping: no hook waits for them any more."""
        self.closed = True
        with self._cond:
            self._cond.notify_all()

    # --- the engine's side -----------------------------------------------------------------
    def rouse(self) -> None:
        """The engine steps with work: a writer sleeping deep polls at its idle interval
        again, so what its peers send now is read within that (one attribute read otherwise)."""
        if self.deep:
            self.deep = False
            self.roused = True  # the writer's next poll counts it as traffic
            rouse = self.rouse_writer
            if rouse is not None:
                rouse()

    @property
    def waiting(self) -> bool:
        """A hook is blocked in :meth:`lend` now."""
        return self._waiting > 0

    def busy(self) -> bool:
        return any(member() for member in self._members)

    def _maybe_busy(self) -> bool:
        """:meth:`busy`, looked at only when a member was stirred since a look found all quiet.
        Cleared before the look: a message put during it stirs again, and one put before it
        is in a mailbox the look sees (or its handler has begun, which stirs too)."""
        if not self.stirred:
            return False
        self.stirred = False
        if self.busy():
            self.stirred = True
            return True
        return False

    def lend(self, bound: float, *, poll: bool = False, settle: bool = False) -> Lent:
        """Block (without the interpreter lock) until the hot-path actors are quiet; with
        ``settle``, until no WRITE is in progress either; with ``poll`` and a WRITE, an answer
        or a registration for held blocks outstanding, until the writer has run a poll that
        began after this call (and the actors are quiet again after it). At
        most ``bound`` seconds; at once when there is nothing to wait for."""
        if bound <= 0 or self.closed:
            return NOTHING
        want_poll = poll and (self.in_flight > 0 or self.awaited > 0 or self.held > 0)
        if not want_poll and not (settle and self.in_flight > 0) and not self._maybe_busy():
            return NOTHING
        began = time.monotonic()
        deadline = began + bound
        ticket = self._polls_started
        if want_poll and self.wake_writer is not None:
            self.wake_writer()
        quiet = polled = settled = False
        with self._cond:
            # Counted as waiting before looking: an actor that turns idle after the look sees
            # the count and rings, and the ring waits for this wait to begin (the lock).
            self._waiting += 1
            try:
                while not self.closed:
                    quiet = not self.busy()
                    polled = not want_poll or self._polls_ended > ticket
                    settled = not settle or self.in_flight == 0
                    if quiet and polled and settled:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            finally:
                self._waiting -= 1
        return Lent(waited_s=time.monotonic() - began, quiet=quiet, polled=polled, settled=settled)
