"""Every Pykka internal pushactors relies on, in one place (checked by ``tests/test_pykka_internals.py``).

Pykka's public API has no hook for a custom mailbox or for catching a stop request raised from a
handler, and no way to reach the actor object behind a reference. pushactors needs all three:

* a timed mailbox (:class:`~pushactors.actors.base.TimedInbox`) that stamps each envelope and
  interleaves timer ticks — Pykka builds it through ``ThreadingActor._create_actor_inbox`` and
  puts ``pykka._envelope.Envelope`` objects into it;
* a way for a dying actor to stop only itself — done around ``Actor._handle_receive``;
* the actor object behind a reference, for introspection — ``ActorRef._actor_weakref``.

Nothing else in the package touches a private Pykka name. The Pykka versions these were
checked against are pinned in ``setup.cfg``; the canary test fails first if a release moves them.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, ClassVar, Protocol

import pykka
from pykka._envelope import Envelope

__all__ = ["Envelope", "HookedActor", "Inbox", "actor_object"]


class Inbox(Protocol):
    """What Pykka needs of a mailbox: a queue of envelopes."""

    def put(self, envelope: Envelope[Any], /) -> None: ...

    def get(self) -> Envelope[Any]: ...

    def empty(self) -> bool: ...


class HookedActor(pykka.ThreadingActor):
    """A ThreadingActor whose mailbox comes from ``inbox_factory`` and whose message handling
    goes through :meth:`handle_envelope_message`, both overridable without private names."""

    inbox_factory: ClassVar[Any] = None  # a zero-argument callable returning an Inbox

    @classmethod
    def _create_actor_inbox(cls) -> Any:  # type: ignore[override]
        factory = cls.inbox_factory
        return factory() if factory is not None else pykka.ThreadingActor._create_actor_inbox()

    def _handle_receive(self, message: Any) -> Any:
        return self.handle_envelope_message(message, super()._handle_receive)

    def handle_envelope_message(self, message: Any, default: Any) -> Any:
        """Handle one message from the mailbox; ``default(message)`` is Pykka's own handling."""
        return default(message)

    def stop_now(self) -> None:
        """Stop this actor from inside one of its handlers (Pykka's own stop path)."""
        self._stop()

    def on_stopped(self) -> None:
        """Runs on this actor's thread once Pykka has marked it stopped, whichever way it
        stopped: a stop, a kill, or a failure that Pykka handled itself (``on_stop`` misses
        those)."""

    def _stop(self) -> None:
        try:
            super()._stop()
        finally:
            self.on_stopped()

    def _handle_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            super()._handle_failure(exception_type, exception_value, traceback)
        finally:
            self.on_stopped()


def actor_object(ref: pykka.ActorRef[Any]) -> object | None:
    """The actor behind ``ref`` (None once it is gone). Introspection only: never call into it
    from another thread."""
    return ref._actor_weakref()  # type: ignore[attr-defined,no-any-return]
