"""A recording actor that stands in for a peer in actor-level tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pykka

from ..actors.base import Peers, RankContext
from ..core.config import PushConfig
from ..engine.system import actor_of
from ..protocol.mailbox import Batch

T = TypeVar("T")


class Probe(pykka.ThreadingActor):
    """Records every message told to it; tests wait for the ones they expect."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[Any] = []
        self._cv = threading.Condition()

    def on_receive(self, message: Any) -> None:
        with self._cv:
            # A Batch is one mailbox hop for several messages: record each, as an actor
            # handles each.
            self.messages.extend(message.messages if isinstance(message, Batch) else (message,))
            self._cv.notify_all()

    def wait_for(self, kind: type[T], *, count: int = 1, timeout: float = 5.0, where: Any = None) -> list[T]:
        """Block until ``count`` messages of ``kind`` (matching ``where``) arrived; return them."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                found = [m for m in self.messages if isinstance(m, kind) and (where is None or where(m))]
                if len(found) >= count:
                    return found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    got = [type(m).__name__ for m in self.messages]
                    raise AssertionError(f"timed out waiting for {count} {kind.__name__}; got {got}")
                self._cv.wait(remaining)

    def of(self, kind: type[T]) -> list[T]:
        with self._cv:
            return [m for m in self.messages if isinstance(m, kind)]


class ProbeSet:
    """Probes for all four peers of a rank, and a :class:`RankContext` wired to them."""

    def __init__(self, config: PushConfig | None = None, **ctx: Any) -> None:
        config = config or PushConfig(engine_id="engine")
        self.refs = {name: Probe.start() for name in ("writer", "matcher", "reaper", "handshake")}
        self.ctx = RankContext(config=config, engine_id=config.engine_id, peers=Peers(**self.refs), **ctx)

    def probe(self, name: str) -> Probe:
        return actor_of(self.refs[name])  # type: ignore[return-value]

    def replace(self, name: str, ref: pykka.ActorRef[Any]) -> None:
        """Put a real actor in place of a probe."""
        self.refs[name].stop()
        self.refs[name] = ref
        setattr(self.ctx.peers, name, ref)

    def stop(self) -> None:
        for ref in self.refs.values():
            try:
                ref.stop(timeout=5)
            except pykka.ActorDeadError:
                pass


class ActorRig:
    """One real actor of a rank between probes for its siblings: the rig of actor-level tests.

    ``start`` builds the actor from the rig's :class:`RankContext` (``Matcher.start``, or
    ``lambda ctx: Writer.start(ctx, fabric)``). :meth:`settle` is the barrier every such test
    needs: the actor handled everything told to it so far, and every probe recorded everything
    sent to it meanwhile. :meth:`sizes` reads the actor's tables through its own mailbox.
    """

    def __init__(
        self,
        name: str,
        start: Callable[[RankContext], pykka.ActorRef[Any]],
        config: PushConfig,
        *,
        probes: dict[str, pykka.ActorRef[Any]] | None = None,
        **ctx: Any,
    ) -> None:
        self.name = name
        self.ps = ProbeSet(config=config, **ctx)
        for sibling, ref in (probes or {}).items():
            self.ps.replace(sibling, ref)
        self.ctx = self.ps.ctx
        self.metrics = self.ctx.metrics
        self.ref = start(self.ctx)
        self.ps.replace(name, self.ref)

    def probe(self, name: str) -> Probe:
        return self.ps.probe(name)

    def tell(self, *messages: Any) -> None:
        for m in messages:
            self.ref.tell(m)

    def sizes(self, timeout: float = 5.0) -> dict[str, int]:
        return self.ref.proxy().sizes().get(timeout=timeout)  # type: ignore[no-any-return]

    def settle(self, timeout: float = 5.0) -> None:
        self.ref.proxy().snapshot().get(timeout=timeout)
        for sibling, ref in self.ps.refs.items():
            if sibling != self.name:
                ref.ask("barrier", timeout=timeout)

    def stop(self) -> None:
        self.ps.stop()
