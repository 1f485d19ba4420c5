"""Canary: the Pykka internals pushactors relies on (``pushactors.actors.pykka_internals``) are
still where this code expects them. A Pykka release that moves one fails here first, with the
name that moved, instead of as a hung actor somewhere else."""

from __future__ import annotations

import inspect
import threading
from typing import Any

import pykka
import pytest

from pushactors.actors import pykka_internals
from pushactors.actors.pykka_internals import Envelope, HookedActor, actor_object


def test_the_private_names_exist_with_the_shapes_we_use() -> None:
    assert list(inspect.signature(Envelope).parameters) == ["message", "reply_to"]
    env: Envelope[Any] = Envelope("m")
    assert env.message == "m" and env.reply_to is None
    assert callable(getattr(pykka.ThreadingActor, "_create_actor_inbox", None))
    assert callable(getattr(pykka.Actor, "_handle_receive", None))
    assert callable(getattr(pykka.Actor, "_stop", None))


def test_the_pinned_pykka_is_the_one_installed() -> None:
    from importlib.metadata import requires, version

    spec = next(r for r in requires("pushactors") or [] if r.lower().startswith("pykka"))
    installed = tuple(int(p) for p in version("pykka").split(".")[:2])
    assert ">=4.5" in spec and "<4.6" in spec, spec
    assert (4, 5) <= installed < (4, 6)


class _CountingInbox:
    """A mailbox of our own, as TimedInbox is: records every envelope Pykka puts."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._items: list[Envelope[Any]] = []
        self.puts = 0

    def put(self, envelope: Envelope[Any], /) -> None:
        with self._cv:
            self.puts += 1
            self._items.append(envelope)
            self._cv.notify()

    def get(self) -> Envelope[Any]:
        with self._cv:
            while not self._items:
                self._cv.wait()
            return self._items.pop(0)

    def empty(self) -> bool:
        with self._cv:
            return not self._items


class _Hooked(HookedActor):
    inbox_factory = _CountingInbox

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def handle_envelope_message(self, message: Any, default: Any) -> Any:
        if message == "die":
            self.stop_now()
            return None
        return default(message)

    def on_receive(self, message: Any) -> Any:
        self.seen.append(message)
        return len(self.seen)


def test_custom_inbox_hook_and_stop_from_a_handler_work() -> None:
    ref = _Hooked.start()
    try:
        assert ref.ask("a", timeout=5) == 1
        actor = actor_object(ref)
        assert isinstance(actor, _Hooked) and isinstance(actor.actor_inbox, _CountingInbox)
        assert actor.actor_inbox.puts >= 1
        ref.tell("die")
        with pytest.raises(pykka.ActorDeadError):
            for _ in range(1000):  # stops by itself, promptly
                ref.ask("b", timeout=5)
    finally:
        if ref.is_alive():
            ref.stop()
    assert actor_object(ref) is None or not ref.is_alive()  # the weak reference does not keep it
    assert set(pykka_internals.__all__) == {"Envelope", "HookedActor", "Inbox", "actor_object"}
