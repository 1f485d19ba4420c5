"""Per-thread batches of sends: what one thread sends inside a scope goes out when the scope
ends, grouped by target in the order each target was first sent to.

A plain part with no actors in it: :class:`~pushactors.actors.base.Peers` asks :meth:`hold`
whether a send waits, and delivers what :meth:`drain` returns."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)
M = TypeVar("M")


class SendBatches(Generic[T, M]):
    """Held sends of each thread's open scope; scopes nest (an inner one is part of the outer)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _pending(self) -> dict[T, list[M]] | None:
        pending: dict[T, list[M]] | None = getattr(self._local, "pending", None)
        return pending

    @property
    def open(self) -> bool:
        """Whether this thread is inside a scope."""
        return self._pending() is not None

    def hold(self, target: T, message: M) -> bool:
        """Keep ``message`` for ``target`` until this thread's scope ends. False: no scope is
        open, so the caller sends it now."""
        pending = self._pending()
        if pending is None:
            return False
        held = pending.get(target)
        if held is None:
            pending[target] = [message]  # dicts keep insertion order: first-sent order
        else:
            held.append(message)
        return True

    def drain(self) -> list[tuple[T, list[M]]]:
        """What this thread's scope holds, by target in first-sent order; the scope stays open
        and empty."""
        pending = self._pending()
        if not pending:
            return []
        out = list(pending.items())
        pending.clear()
        return out

    def enter(self) -> bool:
        """Open this thread's scope: True for the outermost one (whose owner delivers what is
        left, then calls :meth:`leave`), False inside another (nothing to do at its end)."""
        local = self._local
        if getattr(local, "pending", None) is not None:
            return False
        local.pending = {}
        return True

    def leave(self) -> None:
        """Close this thread's outermost scope (its owner drained it first)."""
        self._local.pending = None

    @contextmanager
    def scope(self) -> Iterator[bool]:
        """:meth:`enter` and :meth:`leave` as a block; yields whether it is the outermost."""
        outermost = self.enter()
        try:
            yield outermost
        finally:
            if outermost:
                self.leave()
