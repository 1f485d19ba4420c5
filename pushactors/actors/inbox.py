"""The actors' mailbox: a FIFO that stamps each envelope when it is put (so the time a message
waited is known) and interleaves one armed timer tick when it is due."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .pykka_internals import Envelope


class Tick:
    """A due timer, delivered by :class:`TimedInbox`; never logged as a mailbox message."""

    __slots__ = ("due",)

    def __init__(self, due: float) -> None:
        self.due = due


class TimedInbox:
    """A FIFO mailbox that stamps envelopes and interleaves one armed tick when it is due.

    Envelopes go into a deque; a taker that finds nothing to do waits on a doorbell (a
    :class:`queue.SimpleQueue`) that a putter or an earlier ``arm`` rings only while someone
    waits. Both sides of a message run in C: a ``threading.Condition`` ran a few microseconds
    of Python on each side of every message. A ring the taker no longer needs only makes its
    next wait return at once and look again."""

    def __init__(self) -> None:
        self._items: deque[tuple[float, Envelope[Any]]] = deque()
        self._bell: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._waiting = False
        self._lock = threading.Lock()  # the tick: armed from any thread, taken by the reader
        self._tick_at: float | None = None
        self._after_tick = False  # the last envelope taken was a tick
        self.last_put_at = 0.0
        self.on_put: Callable[[], None] | None = None  # told after each put (a hot-path mark)

    def put(self, envelope: Envelope[Any], /) -> None:
        self._items.append((time.monotonic(), envelope))
        on_put = self.on_put
        if on_put is not None:
            on_put()
        if self._waiting:  # read after the append: a reader that missed the item hears this
            self._bell.put(None)

    def get(self) -> Envelope[Any]:
        while True:
            if self._after_tick and self._items:
                # A message waiting behind the tick just delivered goes next: a tick re-armed
                # at once (the writer polling flat out after a post) must not starve the
                # mailbox, as a stream of messages must not starve a due tick.
                self._after_tick = False
                self.last_put_at, envelope = self._items.popleft()
                return envelope
            due = self._due_tick()
            if due is not None:
                self._after_tick = True
                return Envelope(Tick(due))
            self._after_tick = False
            if self._items:
                self.last_put_at, envelope = self._items.popleft()
                return envelope
            self._waiting = True
            try:
                # Look again after saying we wait: a put or arm before this is seen here, one
                # after it rings the bell.
                if self._items:
                    continue
                at = self._tick_at
                timeout = None if at is None else max(0.0, at - time.monotonic())
                try:
                    self._bell.get(timeout=timeout)
                except queue.Empty:
                    pass  # the tick is due
            finally:
                self._waiting = False

    def _due_tick(self) -> float | None:
        with self._lock:
            due = self._tick_at
            if due is None or time.monotonic() < due:
                return None
            self._tick_at = None
            self.last_put_at = due
            return due

    def empty(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return len(self._items)

    def arm(self, at: float) -> None:
        """Deliver a tick at ``at`` (monotonic), or earlier if one is already armed sooner."""
        with self._lock:
            if self._tick_at is not None and at >= self._tick_at:
                return
            self._tick_at = at
        if self._waiting:
            self._bell.put(None)
