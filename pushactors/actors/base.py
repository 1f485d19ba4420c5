"""What every pushactors actor shares.

* a timed mailbox: each envelope is stamped when it is put, so the time a message waited is
  known, and an actor can arm a *tick* that is delivered when due even while messages keep
  arriving (this is how the writer polls NIXL and the reaper keeps time on its own);
* one structured event per mailbox message: actor, message type, request id, time waited,
  time to handle, and whatever the handler noted (its verb, e.g. ``reg.matched``);
* containment: an exception while handling one message is logged and counted, the request it
  concerned is failed by the actor's ``on_handler_error``, and the actor keeps running. A timer
  (tick) that fails ``max_tick_failures`` times in a row kills its actor instead: a rank that
  cannot poll or keep time must turn unhealthy and fail what it holds, not look healthy.

:class:`ActorFaults` lets tests make a handler or a tick fail without patching internals.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import pykka

from ..core.batching import SendBatches
from ..core.claims import CompletionClaims
from ..core.config import PushConfig
from ..core.handoff import Handoff
from ..core.outbox import Metrics, Outbox
from ..core.promises import Promises
from ..core.staging import StagingArea
from ..core.timeline import Timeline
from ..logs import get_logger, wants
from ..protocol.mailbox import (
    HANDSHAKE_MESSAGES,
    MATCHER_MESSAGES,
    REAPER_MESSAGES,
    STAGER_MESSAGES,
    WRITER_MESSAGES,
    Batch,
    HandshakeMessage,
    MatcherMessage,
    ReaperMessage,
    Released,
    StagerMessage,
    WriterMessage,
)
from .inbox import Tick, TimedInbox
from .pykka_internals import HookedActor

if TYPE_CHECKING:
    from pykka import ActorRef

    from ..transport.digest import KVDigest

M = TypeVar("M")


@dataclass
class Peers:
    """Typed references to the actors of one rank, filled in once all of them have started.

    ``to_writer(message)`` and its siblings accept only the messages that actor handles (the
    per-actor unions of :mod:`pushactors.protocol.mailbox`), so a message sent to the wrong
    actor is a type error. A send to a dead actor is dropped: supervision reports dead actors
    and fails their work, and a sender must not crash.

    Inside :meth:`batched`, what a thread sends goes out when the block ends, one mailbox
    message per actor (:class:`~pushactors.protocol.mailbox.Batch` when there are several):
    an engine hook that hands a step's requests over, or a handler that answers many, costs
    each actor one hop. Actors are sent to in the order each was first sent to, so what one
    request sends to several actors keeps its order (the lease before the blocks)."""

    writer: ActorRef[Any] | None = None
    matcher: ActorRef[Any] | None = None
    reaper: ActorRef[Any] | None = None
    handshake: ActorRef[Any] | None = None
    stager: ActorRef[Any] | None = None
    # Per thread: the sends of an open ``batched`` block, by actor in first-sent order.
    _batches: SendBatches[ActorRef[Any], Any] = field(
        default_factory=SendBatches, init=False, repr=False, compare=False
    )

    def to_writer(self, message: WriterMessage) -> None:
        self._send(self.writer, "writer", WRITER_MESSAGES, message)

    def to_matcher(self, message: MatcherMessage) -> None:
        self._send(self.matcher, "matcher", MATCHER_MESSAGES, message)

    def to_reaper(self, message: ReaperMessage) -> None:
        self._send(self.reaper, "reaper", REAPER_MESSAGES, message)

    def to_handshake(self, message: HandshakeMessage) -> None:
        self._send(self.handshake, "handshake", HANDSHAKE_MESSAGES, message)

    def to_stager(self, message: StagerMessage) -> None:
        self._send(self.stager, "stager", STAGER_MESSAGES, message)

    def _send(self, ref: ActorRef[Any] | None, name: str, accepts: tuple[type, ...], message: Any) -> None:
        if not isinstance(message, accepts):
            raise TypeError(f"the {name} actor does not handle {type(message).__name__}")
        if ref is None:
            raise RuntimeError(f"{name} actor is not connected")
        self.send(ref, message)

    def send(self, ref: ActorRef[Any], message: Any) -> bool:
        """Send ``message`` to ``ref`` now, or at the end of this thread's open
        :meth:`batched` block. False: the actor is dead (the message is dropped)."""
        if self._batches.hold(ref, message):
            return True
        try:
            ref.tell(message)
        except pykka.ActorDeadError:
            return False
        return True

    def batched(self) -> AbstractContextManager[None]:
        """Hold this thread's sends until the block ends (see the class docstring); a block
        inside another is part of it. (A plain object, not a generator: every message an
        actor handles opens one.)"""
        return _Batched(self)

    def flush(self) -> bool:
        """Send what this thread's open :meth:`batched` block holds now (before the thread
        waits on what it sent). False: some actor was dead."""
        alive = True
        for ref, messages in self._batches.drain():
            try:
                ref.tell(messages[0] if len(messages) == 1 else Batch(messages=tuple(messages)))
            except pykka.ActorDeadError:
                alive = False
        return alive


class _Batched:
    """One :meth:`Peers.batched` block: the outermost delivers what it held, then closes."""

    __slots__ = ("_outermost", "_peers")

    def __init__(self, peers: Peers) -> None:
        self._peers = peers
        self._outermost = False

    def __enter__(self) -> None:
        self._outermost = self._peers._batches.enter()

    def __exit__(self, *exc: object) -> None:
        if self._outermost:
            try:
                self._peers.flush()
            finally:
                self._peers._batches.leave()


class InjectedFault(RuntimeError):
    """Raised by :class:`ActorFaults` in place of a handler or tick (tests)."""


class ActorFaults:
    """Failures to inject into one rank's actors, by actor name and message type (tests).

    ``fail_handler("matcher", BlocksFinished)`` makes the matcher's next BlocksFinished handler
    raise; ``kill=True`` kills the actor instead (supervision); ``fail_tick("writer",
    times=None)`` makes every writer tick raise; ``hold_handler("reaper", WatchRecv)`` makes
    the reaper's next WatchRecv wait before its handler until the returned event is set (a
    slow or busy actor: what waits behind it in its mailbox waits too); ``repeat_handler(
    "stager", Gather)`` runs the stager's next Gather handler twice (a replayed message: what
    it sends goes out twice). Thread-safe.
    """

    # A held handler goes on by itself after this long, so a test that forgets its gate
    # cannot hang an actor (and a rank's shutdown) forever.
    hold_limit: float = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holds: list[list[Any]] = []  # [actor, type, match, gate]
        self._handlers: list[list[Any]] = []  # [actor, type, match, remaining, kill]
        self._repeats: list[list[Any]] = []  # [actor, type, match, remaining]
        self._ticks: dict[str, int | None] = {}
        self.raised = 0

    def fail_handler(
        self,
        actor: str,
        message_type: type,
        *,
        times: int | None = 1,
        match: Callable[[Any], bool] | None = None,
        kill: bool = False,
    ) -> None:
        with self._lock:
            self._handlers.append([actor, message_type, match, times, kill])

    def repeat_handler(
        self, actor: str, message_type: type, *, times: int | None = 1, match: Callable[[Any], bool] | None = None
    ) -> None:
        """Run ``actor``'s handler of its next ``times`` matching messages (None: every one)
        a second time, right after the first."""
        with self._lock:
            self._repeats.append([actor, message_type, match, times])

    def repeats(self, actor: str, message: Any) -> bool:
        """Whether the handler that just ran for ``message`` runs again (:meth:`repeat_handler`)."""
        if not self._repeats:  # asked for every message: no lock when nothing is injected
            return False
        with self._lock:
            for entry in self._repeats:
                name, kind, match, remaining = entry
                if name == actor and isinstance(message, kind) and (match is None or match(message)):
                    if remaining is not None:
                        entry[3] = remaining - 1
                        if entry[3] <= 0:
                            self._repeats.remove(entry)
                    return True
        return False

    def fail_tick(self, actor: str, *, times: int | None = 1) -> None:
        with self._lock:
            self._ticks[actor] = times

    def hold_handler(
        self, actor: str, message_type: type, *, match: Callable[[Any], bool] | None = None
    ) -> threading.Event:
        """Hold ``actor``'s next matching message before its handler until the returned event
        is set (or ``hold_limit`` passed)."""
        gate = threading.Event()
        with self._lock:
            self._holds.append([actor, message_type, match, gate])
        return gate

    def clear(self) -> None:
        with self._lock:
            self._handlers.clear()
            self._repeats.clear()
            self._ticks.clear()
            for hold in self._holds:
                hold[3].set()
            self._holds.clear()

    def check_handler(self, actor: str, message: Any) -> None:
        if self._holds:
            self._wait_if_held(actor, message)
        if not self._handlers:  # asked for every message: no lock when nothing is injected
            return
        with self._lock:
            if not self._handlers:
                return
            for entry in self._handlers:
                name, kind, match, remaining, kill = entry
                if name == actor and isinstance(message, kind) and (match is None or match(message)):
                    if remaining is not None:
                        entry[3] = remaining - 1
                        if entry[3] <= 0:
                            self._handlers.remove(entry)
                    self.raised += 1
                    what = f"injected failure in {actor} handling {type(message).__name__}"
                    if kill:
                        raise ActorKilled(what)
                    raise InjectedFault(what)

    def _wait_if_held(self, actor: str, message: Any) -> None:
        gate = None
        with self._lock:
            for entry in self._holds:
                name, kind, match, held = entry
                if name == actor and isinstance(message, kind) and (match is None or match(message)):
                    self._holds.remove(entry)
                    gate = held
                    break
        if gate is not None:
            gate.wait(self.hold_limit)

    def check_tick(self, actor: str) -> None:
        if not self._ticks:
            return
        with self._lock:
            if actor not in self._ticks:
                return
            remaining = self._ticks[actor]
            if remaining is not None:
                if remaining <= 1:
                    del self._ticks[actor]
                else:
                    self._ticks[actor] = remaining - 1
            self.raised += 1
        raise InjectedFault(f"injected failure in {actor} tick")


@dataclass
class RankContext:
    """What the actors of one rank share: settings, identity, peers and result hand-over."""

    config: PushConfig
    engine_id: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    peers: Peers = field(default_factory=Peers)
    outbox: Outbox = field(default_factory=Outbox)
    metrics: Metrics = field(default_factory=Metrics)
    clock: Callable[[], float] = time.monotonic
    faults: ActorFaults = field(default_factory=ActorFaults)
    # The rank's staging buffer (staged pushes), set once when its KV memory is registered.
    staging: StagingArea | None = None
    # Digests over the rank's KV tensors (verified pushes), set once with its KV tensors;
    # None when registered without tensors: no digest is made or checked then.
    kv_digest: KVDigest | None = None
    # P ids whose WRITE the writer could not release when it stopped (NIXL refused to cancel,
    # or cancelling is unsafe): it may still read their blocks, so they are never reported.
    unreleased: set[str] = field(default_factory=set)
    # P: D's latest promise for each served registration (core/promises.py). Only the matcher
    # writes it; the writer reads it just before posting, so a WRITE that waited in its mailbox
    # is judged by D's newest word, not its first.
    promises: Promises = field(default_factory=Promises)
    # D: completions the writer reports itself, past the reaper's mailbox (core/claims.py);
    # the reaper attaches its registry and holds the claims' lock whenever it uses it.
    claims: CompletionClaims = field(default_factory=CompletionClaims)
    # Each push's critical steps, stamped in memory when PushConfig.timeline is on (else None).
    timeline: Timeline | None = None
    # Where the engine's hooks lend the interpreter to the hot-path actors (core/handoff.py).
    handoff: Handoff = field(default_factory=Handoff)
    # The names of the rank's actors that have stopped, each appended by its own thread as it
    # stops (then the bell rings): an engine hook looks at their refs only once this is
    # non-empty, and the rank's supervisor sleeps until the bell rings.
    stopped: list[str] = field(default_factory=list)
    stop_bell: threading.Event = field(default_factory=threading.Event)

    def received(self, request_id: str, *, polled: float | None = None, read: float | None = None) -> None:
        """Report a D request received: to the engine (the outbox), then on the timeline, with
        when the poll that read its completion began (``polled``) and read it (``read``). The
        engine first: the stamps are history, the first decode token waits on the report."""
        self.outbox.received(request_id)
        timeline = self.timeline
        if timeline is not None:
            at = time.monotonic()
            if polled is not None:
                timeline.mark(request_id, "d.poll", polled)
            if read is not None:
                timeline.mark(request_id, "d.read", read)
            timeline.mark(request_id, "d.received", at)

    @property
    def label(self) -> str:
        return f"{self.engine_id}/pp{self.pp_rank}/tp{self.tp_rank}"

    @property
    def agent_name(self) -> str:
        return f"{self.engine_id}-pp{self.pp_rank}-tp{self.tp_rank}"


class Note:
    """What a handler says about the message it handled; becomes that message's one event."""

    __slots__ = ("event", "fields", "level")

    def __init__(self) -> None:
        self.event: str | None = None
        self.level = "debug"
        self.fields: dict[str, Any] = {}

    def __call__(self, event: str, *, level: str | None = None, **fields: Any) -> None:
        self.event = event
        if level is not None:
            self.level = level
        self.fields.update(fields)


def handles(message_type: type[M]) -> Callable[[Callable[[Any, M, Note], Any]], Callable[[Any, M, Note], Any]]:
    """Mark a method as the handler of ``message_type``."""

    def mark(fn: Callable[[Any, M, Note], Any]) -> Callable[[Any, M, Note], Any]:
        fn._handles = message_type  # type: ignore[attr-defined]
        return fn

    return mark


def message_name(message: Any) -> str:
    config = getattr(type(message), "__struct_config__", None)
    tag = getattr(config, "tag", None)
    return str(tag) if tag else type(message).__name__


class ActorKilled(BaseException):
    """Raised inside a handler to kill its actor (tests use it to exercise supervision)."""


class PushActor(HookedActor):
    """Base of the writer, handshake, matcher and lease-reaper actors."""

    actor_name: ClassVar[str] = "actor"
    # On a push's path (matcher, reaper, writer): an engine hook that lends the interpreter
    # waits while this actor has messages (core/handoff.py). Not the handshake actor, whose
    # handlers may block on the network for seconds.
    hot_path: ClassVar[bool] = False
    _handlers: ClassVar[dict[type, Callable[[Any, Any, Note], Any]]] = {}
    actor_inbox: TimedInbox  # type: ignore[assignment]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        table: dict[type, Callable[[Any, Any, Note], Any]] = {}
        for base in reversed(cls.__mro__):
            for value in vars(base).values():
                target = getattr(value, "_handles", None)
                if target is not None:
                    table[target] = value
        cls._handlers = table

    @classmethod
    def message_types(cls) -> frozenset[type]:
        """The message types this actor has a handler for (``@handles``)."""
        return frozenset(cls._handlers)

    inbox_factory: ClassVar[Any] = TimedInbox

    def __init__(self, ctx: RankContext) -> None:
        super().__init__()
        self.ctx = ctx
        self.config = ctx.config
        self.log = get_logger(actor=self.actor_name, rank=ctx.label)
        self.handled = 0
        self.errors = 0
        self.tick_failures = 0  # in a row
        self.died: BaseException | None = None
        self.handling = False  # a message's handler runs (ticks excluded: the writer's polls count apart)
        self.in_batch = False  # a Batch's items are being handled
        if self.hot_path:
            ctx.handoff.join(self.has_work)
            self.actor_inbox.on_put = ctx.handoff.stir

    def has_work(self) -> bool:
        """Messages wait or one is being handled (read by an engine hook, from its thread)."""
        return self.died is None and (self.handling or self.in_batch or not self.actor_inbox.empty())

    # --- timers ------------------------------------------------------------------------------
    def arm_tick(self, delay: float) -> None:
        self.actor_inbox.arm(time.monotonic() + max(0.0, delay))

    def on_tick(self, now: float) -> None:
        """Handle a due tick; subclasses re-arm as they need."""

    def after_message(self) -> None:
        """Runs after every message and tick (whatever the handler did): a place to flush what
        a burst of messages gathered once the mailbox is empty. Keep it cheap."""

    def tell_released(self, released: list[tuple[str, int]], by: Literal["matcher", "reaper"]) -> None:
        """Once this mailbox is empty, tell the writer in one message which P requests this
        actor dropped (:class:`Released`): a burst of endings costs the writer one message."""
        if released and self.actor_inbox.empty():
            self.ctx.peers.to_writer(Released(requests=tuple(released), by=by))
            released.clear()

    def requeue(self, message: Any) -> None:
        """Put ``message`` at the back of this actor's own mailbox: work split into slices
        (one per message) lets whatever already waits there run in between. Dropped once the
        actor is stopping."""
        try:
            self.actor_ref.tell(message)
        except pykka.ActorDeadError:
            pass

    # --- handling ----------------------------------------------------------------------------
    def on_receive(self, message: Any) -> Any:
        # What a handler sends goes out when it is done (one hop per actor), before its event
        # is logged; a batch's items share one hop for all their sends, unless ``flush_each``.
        peers = self.ctx.peers
        if isinstance(message, Tick):
            with peers.batched():
                return self._run_tick(message)
        waited = time.monotonic() - self.actor_inbox.last_put_at
        with peers.batched():
            if not isinstance(message, Batch):
                return self._handle(message, waited, flush=True)
            self.in_batch = True  # has work until the batch's sends are out
            if self.hot_path:
                self.ctx.handoff.stir()  # after the flag: a hook that looks now sees it
            try:
                for item in message.messages:  # one mailbox hop, each handled and logged as its own
                    self._handle(item, waited, flush=self.flush_each)
            finally:
                peers.flush()
                self.in_batch = False
        return None

    # Hot-path actors whose answers start WRITEs send each message's at once, not after a
    # whole batch (one request must not wait for the matching of the step's others).
    flush_each: ClassVar[bool] = False

    def _handle(self, message: Any, waited: float, *, flush: bool) -> Any:
        started = time.monotonic()
        note = Note()
        handler = self._handlers.get(type(message))
        name = message_name(message)
        rid = getattr(message, "request_id", None)
        self.handling = True
        if self.hot_path:
            self.ctx.handoff.stir()  # after the flag: a hook that looks now sees it
        try:
            # Injected failures first: a test may kill an actor with a message of its own.
            self.ctx.faults.check_handler(self.actor_name, message)
            if handler is None:
                note("mailbox.unknown_message", level="warning")
                self.ctx.metrics.incr(f"{self.actor_name}.unknown_message")
                return None
            result = handler(self, message, note)
            if self.ctx.faults.repeats(self.actor_name, message):
                result = handler(self, message, note)
            return result
        except Exception as exc:
            self.errors += 1
            self.ctx.metrics.incr(f"{self.actor_name}.handler_error")
            note(f"{name}.crashed", level="error", error=repr(exc), exc_info=sys.exc_info())
            try:
                self.on_handler_error(message, exc)
            except Exception as again:  # the fallback must not take the actor down either
                note.fields["fallback_error"] = repr(again)
            return None
        except (KeyboardInterrupt, SystemExit, ActorKilled) as exc:
            note(f"{name}.killed", level="critical", error=repr(exc))
            self._die(exc)
            raise _Stopped from None
        finally:
            self.handled += 1
            self.after_message()
            if flush:  # while still "handling": an engine hook lending waits for what it sends
                self.ctx.peers.flush()
            self.handling = False
            if self.hot_path and self.actor_inbox.empty():
                self.ctx.handoff.idle()
            if wants(note.level):  # the message's one event, built only when someone reads it
                fields = note.fields
                fields.setdefault("msg", name)
                if rid is not None:
                    fields.setdefault("request_id", rid)
                fields["wait_ms"] = round(waited * 1e3, 3)
                fields["handle_ms"] = round((time.monotonic() - started) * 1e3, 3)
                getattr(self.log, note.level)(note.event or f"{name}.handled", **fields)

    def _run_tick(self, tick: Tick) -> None:
        try:
            self.ctx.faults.check_tick(self.actor_name)
            self.on_tick(time.monotonic())
            self.after_message()
            self.tick_failures = 0
        except Exception as exc:
            self.errors += 1
            self.tick_failures += 1
            self.ctx.metrics.incr(f"{self.actor_name}.handler_error")
            self.ctx.metrics.incr(f"{self.actor_name}.tick_error")
            self.log.error("tick.crashed", error=repr(exc), in_a_row=self.tick_failures, exc_info=sys.exc_info())
            if self.tick_failures >= self.config.max_tick_failures:
                # It keeps failing: nothing this actor owns moves. Die, so the rank is marked
                # unhealthy and every request it holds is failed (supervision).
                self._die(RuntimeError(f"{self.tick_failures} ticks in a row failed, last: {exc!r}"))
                raise _Stopped from None
            self.arm_tick(self.config.reaper_tick)  # keep time even after a bad tick
        except (KeyboardInterrupt, SystemExit, ActorKilled) as exc:
            self._die(exc)
            raise _Stopped from None

    def sizes(self) -> dict[str, int]:
        """The sizes of this actor's tables (overridden by actors that keep some)."""
        return {}

    def snapshot(self) -> dict[str, int]:
        """Table sizes and counters, computed on this actor's own thread: call it through the
        actor's mailbox (``RankRuntime.snapshot``), never directly from another thread."""
        return {**self.sizes(), "handled": self.handled, "errors": self.errors, "tick_failures": self.tick_failures}

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        """Fail whatever request ``message`` concerned; the default does nothing more."""

    def on_stopped(self) -> None:
        self.ctx.stopped.append(self.actor_name)
        self.ctx.stop_bell.set()

    def _die(self, exc: BaseException) -> None:
        # Stop this actor only. Letting a BaseException reach Pykka would stop every actor
        # in the process (ActorRegistry.stop_all), including other ranks' and engines'.
        self.died = exc
        self.ctx.metrics.incr(f"{self.actor_name}.died")
        self.log.critical("actor.died", error=repr(exc))

    def handle_envelope_message(self, message: Any, default: Any) -> Any:
        try:
            return default(message)
        except _Stopped:
            self.stop_now()
            return None


class _Stopped(Exception):
    """Internal: unwinds a dying actor's handler back to the loop."""
