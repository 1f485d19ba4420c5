"""TimedInbox and the PushActor base: one event per message, containment, ticks, ActorKilled."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pykka
import pytest

from pushactors.actors.base import ActorKilled, Note, PushActor, RankContext, Tick, TimedInbox, handles
from pushactors.actors.pykka_internals import Envelope
from pushactors.core.config import PushConfig
from pushactors.logs import EventCapture, capture_events
from pushactors.testing import Probe, wait_until


# ---------------------------------------------------------------------------------------------
# TimedInbox
# ---------------------------------------------------------------------------------------------
def get_within(inbox: TimedInbox, timeout: float = 2.0) -> Envelope[Any]:
    """inbox.get() that fails the test instead of hanging it."""
    box: list[Envelope[Any]] = []
    done = threading.Event()

    def take() -> None:
        box.append(inbox.get())
        done.set()

    threading.Thread(target=take, name="inbox-get", daemon=True).start()
    if not done.wait(timeout):
        inbox.put(Envelope("unblock"))  # release the reader so no thread is left behind
        done.wait(timeout)
        raise AssertionError(f"inbox.get() did not return within {timeout}s")
    return box[0]


def test_inbox_is_fifo() -> None:
    inbox = TimedInbox()
    assert inbox.empty()
    for m in ("a", "b", "c"):
        inbox.put(Envelope(m))
    assert len(inbox) == 3
    assert not inbox.empty()
    assert [get_within(inbox).message for _ in range(3)] == ["a", "b", "c"]
    assert inbox.empty()


def test_inbox_past_tick_comes_before_queued_messages() -> None:
    inbox = TimedInbox()
    inbox.put(Envelope("a"))
    inbox.put(Envelope("b"))
    due = time.monotonic() - 1.0
    inbox.arm(due)
    first = get_within(inbox)
    assert isinstance(first.message, Tick)
    assert first.message.due == due
    assert first.reply_to is None
    assert inbox.last_put_at == due
    assert [get_within(inbox).message for _ in range(2)] == ["a", "b"]


def test_inbox_a_tick_rearmed_at_once_alternates_with_queued_messages() -> None:
    """An actor polling flat out (re-arming its tick at once after each one) still takes its
    messages: each due tick is followed by a queued message before the next tick."""
    inbox = TimedInbox()
    for m in ("a", "b", "c"):
        inbox.put(Envelope(m))
    taken: list[Any] = []
    for _ in range(6):
        inbox.arm(time.monotonic() - 1.0)  # due at once, as after each tick
        env = get_within(inbox)
        taken.append("tick" if isinstance(env.message, Tick) else env.message)
    assert taken == ["tick", "a", "tick", "b", "tick", "c"]


def test_inbox_future_tick_waits_behind_queued_messages() -> None:
    inbox = TimedInbox()
    inbox.arm(time.monotonic() + 60.0)
    inbox.put(Envelope("a"))
    assert get_within(inbox).message == "a"


def test_inbox_future_tick_delivered_when_due_with_nothing_queued() -> None:
    inbox = TimedInbox()
    t0 = time.monotonic()
    inbox.arm(t0 + 0.02)
    env = get_within(inbox)
    assert isinstance(env.message, Tick)
    assert time.monotonic() - t0 >= 0.02
    # One armed tick is delivered once.
    inbox.put(Envelope("after"))
    assert get_within(inbox).message == "after"


def test_inbox_arm_wakes_a_blocked_get() -> None:
    inbox = TimedInbox()
    inbox.arm(time.monotonic() + 600.0)  # the reader will wait for this one
    box: list[Envelope[Any]] = []
    done = threading.Event()

    def take() -> None:
        box.append(inbox.get())
        done.set()

    threading.Thread(target=take, name="inbox-get", daemon=True).start()
    t0 = time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= 0.02, timeout=2)  # let it block
    assert not done.is_set()
    due = time.monotonic()
    inbox.arm(due)  # earlier: must wake the blocked reader
    if not done.wait(2):
        inbox.put(Envelope("unblock"))
        raise AssertionError("arm() did not wake a blocked get()")
    assert isinstance(box[0].message, Tick)
    assert box[0].message.due == due


def test_inbox_arm_only_moves_the_tick_earlier() -> None:
    inbox = TimedInbox()
    early = time.monotonic() - 1.0
    inbox.arm(early)
    inbox.arm(time.monotonic() + 600.0)  # later: ignored
    env = get_within(inbox)
    assert isinstance(env.message, Tick)
    assert env.message.due == early

    inbox.arm(time.monotonic() + 600.0)
    earlier = time.monotonic() - 0.5
    inbox.arm(earlier)  # earlier: wins
    env = get_within(inbox)
    assert isinstance(env.message, Tick)
    assert env.message.due == earlier


def test_inbox_loses_no_message_between_busy_producers_and_an_idling_reader() -> None:
    """Producers put while the reader keeps falling asleep and waking (its wait, the
    producers' rings and ticks armed from other threads interleave): every message arrives,
    each producer's in order, and the reader never sleeps through one."""
    inbox = TimedInbox()
    producers, per_producer = 4, 3000
    got: list[tuple[int, int]] = []
    ticks = 0
    finished = threading.Event()

    def read() -> None:
        nonlocal ticks
        while len(got) < producers * per_producer:
            env = inbox.get()
            if isinstance(env.message, Tick):
                ticks += 1
            else:
                got.append(env.message)
        finished.set()

    def produce(k: int) -> None:
        for i in range(per_producer):
            inbox.put(Envelope((k, i)))
            if i % 97 == 0:
                # Let the reader run dry (it then waits on the doorbell) before putting more.
                wait_until(inbox.empty, timeout=10, interval=0.0005, what="the reader to drain")
            if i % 500 == 0:
                inbox.arm(time.monotonic() + 0.001)

    reader = threading.Thread(target=read, name="inbox-reader", daemon=True)
    reader.start()
    workers = [threading.Thread(target=produce, args=(k,), name=f"producer-{k}") for k in range(producers)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    if not finished.wait(30):
        raise AssertionError(f"the reader got {len(got)} of {producers * per_producer} messages and stalled")
    for k in range(producers):
        assert [i for kk, i in got if kk == k] == list(range(per_producer))
    assert ticks >= 1  # armed from producers' threads, delivered on the reader's
    assert inbox.empty() and len(inbox) == 0


def test_inbox_last_put_at_stamps_put_time() -> None:
    inbox = TimedInbox()
    before = time.monotonic()
    inbox.put(Envelope("a"))
    after = time.monotonic()
    wait_until(lambda: time.monotonic() - after >= 0.01, timeout=2)
    inbox.put(Envelope("b"))
    assert get_within(inbox).message == "a"
    assert before <= inbox.last_put_at <= after  # when it was put, not when it was taken
    assert get_within(inbox).message == "b"
    assert inbox.last_put_at > after


# ---------------------------------------------------------------------------------------------
# A PushActor for the tests
# ---------------------------------------------------------------------------------------------
class Ping(msgspec.Struct, tag="test.ping"):
    request_id: str
    n: int = 0


class Nudge(msgspec.Struct, tag="test.nudge"):
    pass


class Boom(msgspec.Struct, tag="test.boom"):
    request_id: str


class Kill(msgspec.Struct, tag="test.kill"):
    pass


class Block(msgspec.Struct, tag="test.block"):
    arm_tick: bool = False


class Arm(msgspec.Struct, tag="test.arm"):
    delay: float


class Stranger(msgspec.Struct, tag="test.stranger"):
    request_id: str


class Echo(PushActor):
    actor_name = "echo"

    def __init__(
        self,
        ctx: RankContext,
        *,
        fallback_raises: bool = False,
        tick_mode: str = "ok",
        started: threading.Event | None = None,
        gate: threading.Event | None = None,
        box: list[Echo] | None = None,
    ) -> None:
        super().__init__(ctx)
        if box is not None:
            box.append(self)  # lets a test read the object after its death
        self.fallback_raises = fallback_raises
        self.tick_mode = tick_mode
        self.started = started or threading.Event()
        self.gate = gate or threading.Event()
        self.order: list[Any] = []
        self.ticks: list[float] = []
        self.handler_errors: list[tuple[Any, str]] = []

    @handles(Ping)
    def on_ping(self, msg: Ping, note: Note) -> int:
        self.order.append(("ping", msg.n))
        note("ping.done", level="info", n=msg.n, doubled=msg.n * 2)
        return msg.n * 2

    @handles(Nudge)
    def on_nudge(self, msg: Nudge, note: Note) -> str:
        self.order.append("nudge")
        return "nudged"

    @handles(Boom)
    def on_boom(self, msg: Boom, note: Note) -> None:
        note("boom.started", level="info")
        raise ValueError("boom")

    @handles(Kill)
    def on_kill(self, msg: Kill, note: Note) -> None:
        raise ActorKilled("killed by test")

    @handles(Block)
    def on_block(self, msg: Block, note: Note) -> None:
        if msg.arm_tick:
            self.arm_tick(0.0)
        self.started.set()
        assert self.gate.wait(5.0)
        self.order.append("block")

    @handles(Arm)
    def on_arm(self, msg: Arm, note: Note) -> None:
        self.arm_tick(msg.delay)
        note("tick.armed", delay=msg.delay)

    def on_tick(self, now: float) -> None:
        self.ticks.append(now)
        self.order.append("tick")
        if self.tick_mode == "fail_first" and len(self.ticks) == 1:
            raise RuntimeError("bad tick")
        if self.tick_mode == "kill":
            raise ActorKilled("killed on tick")

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        self.handler_errors.append((message, repr(exc)))
        if self.fallback_raises:
            raise RuntimeError("fallback broke too")


class Plain(pykka.ThreadingActor):
    """An unrelated actor: it must survive another actor's death."""

    def on_receive(self, message: Any) -> Any:
        return ("plain", message)


@pytest.fixture(autouse=True)
def no_leaked_actors() -> Iterator[None]:
    before = set(pykka.ActorRegistry.get_all())
    yield
    leaked = [r for r in pykka.ActorRegistry.get_all() if r not in before]
    assert not leaked, f"actors left running: {leaked}"


@pytest.fixture
def ctx() -> RankContext:
    return RankContext(config=PushConfig(engine_id="t", reaper_tick=0.01), engine_id="t", tp_rank=1)


@pytest.fixture
def spawn() -> Iterator[Callable[..., pykka.ActorRef[Any]]]:
    refs: list[pykka.ActorRef[Any]] = []

    def start(cls: type[pykka.ThreadingActor], *args: Any, **kw: Any) -> pykka.ActorRef[Any]:
        ref = cls.start(*args, **kw)
        refs.append(ref)
        return ref

    yield start
    for ref in refs:
        try:
            ref.stop(timeout=5)
        except pykka.ActorDeadError:
            pass


@pytest.fixture
def events() -> Iterator[EventCapture]:
    with capture_events() as ev:
        yield ev


def attr(ref: pykka.ActorRef[Any], name: str) -> Any:
    return getattr(ref.proxy(), name).get(timeout=5)


def of(events: EventCapture, actor: str = "echo") -> list[dict[str, Any]]:
    return events.where(actor=actor)


# ---------------------------------------------------------------------------------------------
# One event per message
# ---------------------------------------------------------------------------------------------
def test_one_event_per_message_with_context(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    ref = spawn(Echo, ctx)
    assert ref.ask(Ping("r1", 3), timeout=5) == 6
    evs = of(events)
    assert len(evs) == 1
    e = evs[0]
    assert e["event"] == "ping.done"
    assert e["level"] == "info"
    assert e["actor"] == "echo"
    assert e["rank"] == "t/pp0/tp1"
    assert e["msg"] == "test.ping"
    assert e["request_id"] == "r1"
    assert e["n"] == 3
    assert e["doubled"] == 6
    assert isinstance(e["wait_ms"], float) and e["wait_ms"] >= 0
    assert isinstance(e["handle_ms"], float) and e["handle_ms"] >= 0


def test_message_without_request_id_or_note(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    ref = spawn(Echo, ctx)
    assert ref.ask(Nudge(), timeout=5) == "nudged"
    evs = of(events)
    assert len(evs) == 1
    assert evs[0]["event"] == "test.nudge.handled"
    assert evs[0]["level"] == "debug"
    assert evs[0]["msg"] == "test.nudge"
    assert "request_id" not in evs[0]


def test_messages_handled_in_order_one_event_each(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    ref = spawn(Echo, ctx)
    for n in range(5):
        ref.tell(Ping(f"r{n}", n))
    ref.tell(Nudge())
    assert ref.ask(Ping("last", 9), timeout=5) == 18
    assert attr(ref, "order") == [("ping", n) for n in range(5)] + ["nudge", ("ping", 9)]
    evs = of(events)
    assert [e["msg"] for e in evs] == ["test.ping"] * 5 + ["test.nudge", "test.ping"]
    assert [e.get("request_id") for e in evs] == ["r0", "r1", "r2", "r3", "r4", None, "last"]
    assert attr(ref, "handled") == 7


def test_wait_and_handle_times_are_measured(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    started, gate = threading.Event(), threading.Event()
    ref = spawn(Echo, ctx, started=started, gate=gate)
    ref.tell(Block())
    assert started.wait(5)
    told = time.monotonic()
    ref.tell(Ping("waiting", 1))
    wait_until(lambda: time.monotonic() - told >= 0.03, timeout=2)
    gate.set()
    assert ref.ask(Nudge(), timeout=5) == "nudged"
    (block,) = events.where(actor="echo", msg="test.block")
    (ping,) = events.where(actor="echo", msg="test.ping")
    assert block["handle_ms"] >= 30
    assert ping["wait_ms"] >= 30
    assert ping["handle_ms"] < block["handle_ms"]


# ---------------------------------------------------------------------------------------------
# Containment
# ---------------------------------------------------------------------------------------------
def test_handler_exception_is_contained(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    ref = spawn(Echo, ctx)
    assert ref.ask(Boom("r-bad"), timeout=5) is None  # not raised into the caller either
    ref.tell(Boom("r-bad2"))
    assert ref.ask(Ping("r-ok", 2), timeout=5) == 4
    assert ref.is_alive()

    crashed = events.named("test.boom.crashed")
    assert [e["request_id"] for e in crashed] == ["r-bad", "r-bad2"]
    e = crashed[0]
    assert e["level"] == "error"
    assert e["actor"] == "echo"
    assert e["msg"] == "test.boom"
    assert "ValueError('boom')" in e["error"]
    assert "ValueError: boom" in e["exception"]
    assert "exc_info" not in e
    assert len(events.where(actor="echo", msg="test.boom")) == 2  # still one event per message

    assert ctx.metrics.get("echo.handler_error") == 2
    errs = attr(ref, "handler_errors")
    assert [(m.request_id, r) for m, r in errs] == [("r-bad", "ValueError('boom')"), ("r-bad2", "ValueError('boom')")]
    assert attr(ref, "errors") == 2


def test_exception_in_on_handler_error_is_contained(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    ref = spawn(Echo, ctx, fallback_raises=True)
    assert ref.ask(Boom("r-bad"), timeout=5) is None
    assert ref.is_alive()
    assert ref.ask(Ping("r-ok", 1), timeout=5) == 2
    (e,) = events.named("test.boom.crashed")
    assert "fallback broke too" in e["fallback_error"]
    assert ctx.metrics.get("echo.handler_error") == 1


def test_unknown_message_is_logged_not_fatal(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    ref = spawn(Echo, ctx)
    assert ref.ask(Stranger("r-x"), timeout=5) is None
    ref.tell("a plain string")
    assert ref.ask(Ping("r", 1), timeout=5) == 2
    assert ref.is_alive()
    unknown = events.named("mailbox.unknown_message")
    assert [e["msg"] for e in unknown] == ["test.stranger", "str"]
    assert unknown[0]["level"] == "warning"
    assert unknown[0]["request_id"] == "r-x"
    assert unknown[0]["actor"] == "echo"
    assert ctx.metrics.get("echo.unknown_message") == 2
    assert ctx.metrics.get("echo.handler_error") == 0


# ---------------------------------------------------------------------------------------------
# ActorKilled stops only its actor
# ---------------------------------------------------------------------------------------------
def test_actor_killed_stops_only_that_actor(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    other = spawn(Plain)
    probe_ref = spawn(Probe)
    box: list[Echo] = []
    ref = spawn(Echo, ctx, box=box)
    (actor,) = box  # read after death, when proxies no longer answer
    ref.tell(Kill())
    wait_until(lambda: not ref.is_alive(), timeout=5, what="killed actor to stop")

    assert isinstance(actor.died, ActorKilled)
    (died,) = events.named("actor.died")
    assert died["level"] == "critical"
    assert died["actor"] == "echo"
    assert "killed by test" in died["error"]
    assert ctx.metrics.get("echo.died") == 1

    # Pykka's default for a BaseException would have stopped every actor in the process.
    assert other.is_alive()
    assert probe_ref.is_alive()
    assert other.ask("hi", timeout=5) == ("plain", "hi")
    assert ref not in pykka.ActorRegistry.get_all()
    assert other in pykka.ActorRegistry.get_all()
    with pytest.raises(pykka.ActorDeadError):
        ref.tell(Ping("late", 1))


def test_actor_killed_via_ask_resolves_the_future(ctx: RankContext, spawn: Any) -> None:
    other = spawn(Plain)
    ref = spawn(Echo, ctx)
    future = ref.ask(Kill(), block=False)
    future.get(timeout=5)  # answered, not left hanging
    wait_until(lambda: not ref.is_alive(), timeout=5)
    assert other.is_alive()


# ---------------------------------------------------------------------------------------------
# Ticks
# ---------------------------------------------------------------------------------------------
def test_armed_tick_calls_on_tick_and_is_not_a_mailbox_event(
    ctx: RankContext, spawn: Any, events: EventCapture
) -> None:
    ref = spawn(Echo, ctx)
    before = time.monotonic()
    ref.ask(Arm(0.02), timeout=5)
    wait_until(lambda: len(attr(ref, "ticks")) >= 1, timeout=5, what="a tick")
    (now,) = attr(ref, "ticks")
    assert now - before >= 0.02
    evs = of(events)
    assert [e["event"] for e in evs] == ["tick.armed"]
    assert not [e for e in evs if e.get("msg") in ("Tick", "tick")]


def test_due_tick_runs_before_queued_messages(ctx: RankContext, spawn: Any) -> None:
    started, gate = threading.Event(), threading.Event()
    ref = spawn(Echo, ctx, started=started, gate=gate)
    ref.tell(Block(arm_tick=True))  # arms a tick due now, then blocks
    assert started.wait(5)
    for n in range(3):
        ref.tell(Ping(f"r{n}", n))
    gate.set()
    assert ref.ask(Nudge(), timeout=5) == "nudged"
    assert attr(ref, "order") == ["block", "tick", ("ping", 0), ("ping", 1), ("ping", 2), "nudge"]


def test_tick_exception_is_contained_and_ticking_continues(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    ref = spawn(Echo, ctx, tick_mode="fail_first")
    ref.ask(Arm(0.0), timeout=5)
    # Nobody re-arms but the base class after the crash: a second tick proves it did.
    wait_until(lambda: len(attr(ref, "ticks")) >= 2, timeout=5, what="a tick after the crashed one")
    assert ref.is_alive()
    (crashed,) = events.named("tick.crashed")
    assert crashed["level"] == "error"
    assert crashed["actor"] == "echo"
    assert "bad tick" in crashed["error"]
    assert ctx.metrics.get("echo.handler_error") == 1
    assert ref.ask(Ping("r", 4), timeout=5) == 8


def test_actor_killed_in_tick_stops_only_that_actor(ctx: RankContext, spawn: Any, events: EventCapture) -> None:
    other = spawn(Plain)
    box: list[Echo] = []
    ref = spawn(Echo, ctx, tick_mode="kill", box=box)
    (actor,) = box
    ref.tell(Arm(0.0))
    wait_until(lambda: not ref.is_alive(), timeout=5, what="actor killed on tick")
    assert isinstance(actor.died, ActorKilled)
    assert len(events.named("actor.died")) == 1
    assert other.is_alive()
    assert other.ask(1, timeout=5) == ("plain", 1)


# ---------------------------------------------------------------------------------------------
# Batches: one mailbox hop for what one hook or handler sends an actor
# ---------------------------------------------------------------------------------------------
class TellLog:
    """Stands in for an actor reference: records each tell, in the order they were made."""

    def __init__(self, name: str, told: list[tuple[str, Any]]) -> None:
        self.name, self.told = name, told

    def tell(self, message: Any) -> None:
        self.told.append((self.name, message))


def test_batched_sends_go_as_one_message_per_actor_in_first_sent_order() -> None:
    from pushactors.actors.base import Peers
    from pushactors.protocol import ArmLease, BlocksFinished, ClearLease
    from pushactors.protocol.mailbox import Batch

    told: list[tuple[str, Any]] = []
    peers = Peers(reaper=TellLog("reaper", told), matcher=TellLog("matcher", told))  # type: ignore[arg-type]
    lease = ArmLease(request_id="p-1", deadline=1.0, serial=1)
    blocks = BlocksFinished(request_id="p-1", block_ids=((1, 2),), serial=1)
    cleared = ClearLease(request_id="p-0", serial=0)
    with peers.batched():
        peers.to_reaper(lease)
        peers.to_matcher(blocks)
        peers.to_reaper(cleared)
        with peers.batched():  # an inner block is part of the outer one
            peers.to_matcher(blocks)
        assert told == []  # nothing is sent before the block ends
    # One message per actor, the reaper's first: a request's lease is queued before its blocks.
    assert told == [("reaper", Batch(messages=(lease, cleared))), ("matcher", Batch(messages=(blocks, blocks)))]
    with peers.batched():
        peers.to_matcher(blocks)
    assert told[-1] == ("matcher", blocks)  # one message alone goes as itself
    peers.to_reaper(cleared)  # outside a block: at once
    assert told[-1] == ("reaper", cleared)


def test_batched_sends_are_per_thread() -> None:
    from pushactors.actors.base import Peers
    from pushactors.protocol import ClearLease

    told: list[tuple[str, Any]] = []
    peers = Peers(reaper=TellLog("reaper", told))  # type: ignore[arg-type]
    cleared = ClearLease(request_id="p-0", serial=0)
    with peers.batched():
        other = threading.Thread(target=peers.to_reaper, args=(cleared,))
        other.start()
        other.join(5)
        assert told == [("reaper", cleared)]  # another thread's send is not held by this block


def test_a_batch_is_handled_item_by_item_each_with_its_own_event(
    ctx: RankContext, spawn: Any, events: EventCapture
) -> None:
    from pushactors.protocol.mailbox import Batch

    ref = spawn(Echo, ctx)
    ref.tell(Batch(messages=(Ping("r1", 1), Nudge(), Ping("r2", 2))))
    wait_until(lambda: len(of(events)) == 3, timeout=5, what="three events")
    assert [e["event"] for e in of(events)] == ["ping.done", "test.nudge.handled", "ping.done"]
    assert [e.get("request_id") for e in of(events)] == ["r1", None, "r2"]
    assert attr(ref, "order") == [("ping", 1), "nudge", ("ping", 2)]
    assert attr(ref, "handled") == 3
