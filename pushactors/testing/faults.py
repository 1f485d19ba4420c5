"""Fault rules, and the one reader that applies them: :class:`FaultyAgent`.

A :class:`FaultPlan` holds rules, each matched on a :class:`FaultContext`. Only
:class:`FaultyAgent` reads a plan: its ``*_fate`` methods decide what a fault does to one call,
and either the wrapper acts on that over any agent (real NIXL included: a held WRITE stays
unposted, an ERR is never posted, inbound notifications are dropped, duplicated or delayed
on poll), or, over the fake fabric, the fabric asks the same methods at the points where the
physics happens (latency, a WRITE held in flight, a copy that runs on after its release,
notifications delivered after the bytes landed).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ..protocol import Completion, MalformedMessage, decode_notification
from ..transport.agent import AgentFactory, DescArray, DlistHandle, IndexList, NixlAgentLike, XferHandle, XferState
from .errors import FakeNixlError, FakePeerDisconnected

FaultKind = Literal[
    "fail_add_remote",
    "raise_on_transfer",
    "err_transfer",
    "slow_transfer",
    "hold_transfer",
    "drop_notif",
    "rewrite_notif",
    "delay_notif",
    "duplicate_notif",
    "fail_send_notif",
    "disconnect_notif",
    "refuse_cancel",
    "release_continues",
    "corrupt_transfer",
]


@dataclass(frozen=True)
class FaultContext:
    """What a fault rule sees: who talks to whom, and the notification bytes if any."""

    src: str
    dst: str
    notif: bytes = b""
    op: str = ""


Match = Callable[[FaultContext], bool]


class Gate:
    """Holds matching transfers in PROC until :meth:`open` is called."""

    def __init__(self) -> None:
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()


@dataclass
class Fault:
    kind: FaultKind
    match: Match
    times: int | None  # None: every match
    seconds: float = 0.0
    copies: int = 1
    gate: Gate | None = None
    hits: int = 0
    # corrupt_transfer: changes D's memory after the WRITE's bytes landed, before its
    # notification is delivered (given the WRITE's destination rows).
    corrupt: Callable[[Any], None] | None = None
    # rewrite_notif: the bytes the receiver gets instead (given the bytes sent).
    rewrite: Callable[[bytes], bytes] | None = None

    def take(self, ctx: FaultContext) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if not self.match(ctx):
            return False
        self.hits += 1
        return True


def _always(_: FaultContext) -> bool:
    return True


def notif_contains(needle: bytes | str) -> Match:
    """A match on notifications (or WRITE notifications) that contain ``needle``."""
    data = needle.encode() if isinstance(needle, str) else needle
    return lambda ctx: data in ctx.notif


def completion_of(d_request_id: str, *, tp_size: int | None = None) -> Match:
    """A match on the completion P attaches to a WRITE for D's ``d_request_id`` (whatever
    registration generation it names)."""

    def match(ctx: FaultContext) -> bool:
        notif = ctx.notif
        if not notif or notif.startswith((b"PUSH_", b"HB")):
            return False
        try:
            msg = decode_notification(notif)
        except MalformedMessage:
            return False
        return (
            isinstance(msg, Completion)
            and msg.request_id == d_request_id
            and (tp_size is None or msg.tp_size == tp_size)
        )

    return match


class FaultPlan:
    """Fault rules of a fabric. Each method adds a rule and returns it (``rule.hits`` counts)."""

    def __init__(self) -> None:
        self._rules: list[Fault] = []
        self._lock = threading.Lock()

    def _add(self, fault: Fault) -> Fault:
        with self._lock:
            self._rules.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def take(self, kind: FaultKind, ctx: FaultContext) -> Fault | None:
        if not self._rules:  # the common case: asked several times per WRITE
            return None
        with self._lock:
            for rule in self._rules:
                if rule.kind == kind and rule.take(ctx):
                    return rule
        return None

    def fail_add_remote(self, match: Match = _always, times: int | None = 1) -> Fault:
        """``add_remote_agent`` raises (ctx.src is the loading agent, ctx.dst the remote)."""
        return self._add(Fault("fail_add_remote", match, times))

    def raise_on_transfer(self, match: Match = _always, times: int | None = 1) -> Fault:
        """``transfer`` raises before anything moves."""
        return self._add(Fault("raise_on_transfer", match, times))

    def err_transfer(self, match: Match = _always, times: int | None = 1) -> Fault:
        """The transfer is accepted but ends in ERR; no bytes land, no notification."""
        return self._add(Fault("err_transfer", match, times))

    def slow_transfer(self, seconds: float, match: Match = _always, times: int | None = None) -> Fault:
        return self._add(Fault("slow_transfer", match, times, seconds=seconds))

    def hold_transfer(self, match: Match = _always, times: int | None = None) -> Gate:
        """Matching transfers stay in PROC until the returned gate is opened."""
        gate = Gate()
        self._add(Fault("hold_transfer", match, times, gate=gate))
        return gate

    def corrupt_transfer(self, corrupt: Callable[[Any], None], match: Match = _always, times: int | None = 1) -> Fault:
        """After a matching WRITE's bytes landed and before its notification goes, ``corrupt``
        is called with its destination rows (Nx3 address, length, device): a flipped byte, a
        stale block, a head slice landing in the wrong place, for a verifier to catch."""
        return self._add(Fault("corrupt_transfer", match, times, corrupt=corrupt))

    def drop_notif(self, match: Match = _always, times: int | None = 1) -> Fault:
        return self._add(Fault("drop_notif", match, times))

    def rewrite_notif(self, rewrite: Callable[[bytes], bytes], match: Match = _always, times: int | None = 1) -> Fault:
        """The receiver gets ``rewrite(notification)`` instead: a message changed on its way (a
        forged or stale registration from the right sender, as a peer without ``auth_keys``
        cannot tell apart)."""
        return self._add(Fault("rewrite_notif", match, times, rewrite=rewrite))

    def delay_notif(self, seconds: float, match: Match = _always, times: int | None = 1) -> Fault:
        return self._add(Fault("delay_notif", match, times, seconds=seconds))

    def duplicate_notif(self, match: Match = _always, times: int | None = 1, copies: int = 1) -> Fault:
        return self._add(Fault("duplicate_notif", match, times, copies=copies))

    def fail_send_notif(self, match: Match = _always, times: int | None = 1) -> Fault:
        """``send_notif`` raises (a standalone notification, not a WRITE's)."""
        return self._add(Fault("fail_send_notif", match, times))

    def disconnect_notif(self, match: Match = _always, times: int | None = 1) -> Fault:
        """``send_notif`` raises NIXL's "remote disconnected" error: the agent this side holds
        for that peer is gone (its process died or restarted)."""
        return self._add(Fault("disconnect_notif", match, times))

    def refuse_cancel(self, match: Match = _always, times: int | None = 1) -> Fault:
        """Releasing a transfer still in flight raises: NIXL would not cancel it, and it may
        still land (ctx.notif is the WRITE's notification)."""
        return self._add(Fault("refuse_cancel", match, times))

    def release_continues(
        self, match: Match = _always, times: int | None = 1, *, runs_on: float | None = None
    ) -> Fault:
        """Releasing a transfer still in flight returns, but the transfer runs on: its bytes land
        when it would have completed (or ``runs_on`` seconds after the release, whatever held
        it), and no notification is sent (the handle is gone). What a cuda_ipc or RDMA copy
        already started does when NIXL's UCX backend cancels its request."""
        return self._add(Fault("release_continues", match, times, seconds=-1.0 if runs_on is None else runs_on))


def random_match(rate: float, rng: random.Random, *, only: Callable[[FaultContext], bool] | None = None) -> Match:
    """Matches a fraction ``rate`` of the events ``only`` accepts (seeded: reproducible)."""
    lock = threading.Lock()

    def match(ctx: FaultContext) -> bool:
        if only is not None and not only(ctx):
            return False
        with lock:
            return rng.random() < rate

    return match


class NotifRecorder:
    """Keeps a copy of every inbound notification ``match`` accepts, as it arrived (sender and
    bytes), and re-delivers them on :meth:`replay`: a late duplicate, or a signed message an
    attacker captured and sends again from the same peer. Shared by the agents of one process;
    :meth:`replay` may be called from any thread, the copies go out on the agent's next poll."""

    def __init__(self, match: Match) -> None:
        self.match = match
        self._lock = threading.Lock()
        self.seen: list[tuple[str, bytes]] = []
        self._queued: dict[str, list[tuple[str, bytes]]] = {}  # agent name -> copies to deliver
        self.replayed = 0

    def note(self, agent: str, sender: str, payload: bytes) -> None:
        if self.match(FaultContext(sender, agent, payload, "NOTIF")):
            with self._lock:
                self.seen.append((sender, payload))
                self._queued.setdefault(agent, [])

    def replay(self) -> int:
        """Queue every recorded notification once more, for the agent that received it."""
        with self._lock:
            for agent in self._queued:
                self._queued[agent].extend(self.seen)
            self.replayed += len(self.seen)
            return len(self.seen)

    def take(self, agent: str) -> list[tuple[str, bytes]]:
        with self._lock:
            out = self._queued.get(agent) or []
            if out:
                self._queued[agent] = []
            return out


@dataclass(frozen=True)
class WriteFate:
    """What the plan does to one WRITE being posted (``raise_on_transfer`` raises instead)."""

    fail: bool = False  # accepted, then ERR: no bytes land, no notification (err_transfer)
    delay: float = 0.0  # seconds it runs longer (slow_transfer)
    gate: Gate | None = None  # stays in PROC until the gate opens (hold_transfer)


@dataclass(frozen=True)
class NotifFate:
    """What the plan does to one notification on its way."""

    drop: bool = False
    copies: int = 1  # 1 + duplicates
    delay: float | None = None  # seconds late, every copy
    payload: bytes | None = None  # what arrives instead (rewrite_notif)


_NO_WRITE_FAULT = WriteFate()
_NO_NOTIF_FAULT = NotifFate()


class FaultyAgent:
    """An agent whose calls go to ``inner`` unless ``plan`` injects a fault; the only reader of
    a :class:`FaultPlan`.

    The ``*_fate`` methods read the plan: each takes the matching rules for one call, counts
    them in :attr:`injected` and says what happens. Over a real agent the wrapper acts on that
    itself: ``hold_transfer`` keeps a WRITE from being posted at all (it reads PROC until its
    gate opens), and ``release_continues`` then makes the release return while the WRITE is
    posted ``runs_on`` seconds later: the real bytes land after the caller let go, as a copy
    already started does when a backend's cancel does not stop it (all calls into ``inner``
    stay on the caller's thread). With ``physical=True`` (what :class:`FakeFabric` hands its
    agents) the calls pass straight through: the fabric asks the fate methods where its
    physics happens, so a held WRITE is posted and in flight, and a released one lands."""

    def __init__(
        self,
        inner: NixlAgentLike,
        plan: FaultPlan,
        clock: Callable[[], float] = time.monotonic,
        recorder: NotifRecorder | None = None,
        *,
        physical: bool = False,
    ) -> None:
        self.inner = inner
        self.plan = plan
        self.clock = clock
        self.recorder = recorder
        self.physical = physical
        self._dlist_targets: dict[int, str] = {}  # remote dlist handle id -> agent name
        self._targets: dict[int, tuple[str, bytes]] = {}  # handle id -> (remote, notif)
        self._forced_err: set[int] = set()
        # not posted to inner yet: handle, gate, due time, ends in ERR
        self._held: dict[int, tuple[XferHandle, Gate | None, float, bool]] = {}
        self._prepped: dict[int, tuple[str, DlistHandle, IndexList, DlistHandle, IndexList]] = {}
        self._late: list[tuple[float, XferHandle]] = []  # released, to be posted at the time
        self._late_running: list[XferHandle] = []  # posted after their release
        self._delayed: list[tuple[float, str, bytes]] = []
        self._lock = threading.Lock()  # the fabric asks from any agent's caller thread
        self.injected: dict[str, int] = {}

    @property
    def name(self) -> str:
        return self.inner.name

    def _count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] = self.injected.get(kind, 0) + 1

    def _take(self, kind: FaultKind, ctx: FaultContext) -> Fault | None:
        rule = self.plan.take(kind, ctx)
        if rule is not None:
            self._count(kind)
        return rule

    # --- the plan, read here only ------------------------------------------------------------
    def add_remote_fate(self, ctx: FaultContext) -> None:
        """Raises when loading the remote agent ``ctx.dst`` fails (``fail_add_remote``)."""
        if self._take("fail_add_remote", ctx):
            raise FakeNixlError("NIXL_ERR_BACKEND", f"injected failure loading {ctx.dst!r}")

    def write_fate(self, ctx: FaultContext) -> WriteFate:
        """What happens to a WRITE being posted; raises for ``raise_on_transfer``."""
        if self._take("raise_on_transfer", ctx):
            raise FakeNixlError("NIXL_ERR_BACKEND", "injected transfer failure")
        fail = self._take("err_transfer", ctx) is not None
        slow = self._take("slow_transfer", ctx)
        hold = self._take("hold_transfer", ctx)
        if not fail and slow is None and hold is None:
            return _NO_WRITE_FAULT
        return WriteFate(fail, slow.seconds if slow else 0.0, hold.gate if hold else None)

    def landed_fate(self, ctx: FaultContext, rows: DescArray) -> None:
        """A WRITE's bytes landed, its notification not yet sent: ``corrupt_transfer`` acts."""
        rule = self._take("corrupt_transfer", ctx)
        if rule is not None and rule.corrupt is not None:
            rule.corrupt(rows)

    def cancel_fate(self, ctx: FaultContext) -> None:
        """Raises when releasing a WRITE in flight is refused (``refuse_cancel``)."""
        if self._take("refuse_cancel", ctx):
            raise FakeNixlError("NIXL_ERR_BACKEND", "injected: transfer could not be cancelled")

    def runs_on_fate(self, ctx: FaultContext) -> Fault | None:
        """The ``release_continues`` rule under which a released WRITE runs on, if any
        (``rule.seconds`` < 0: it lands when it would have completed)."""
        return self._take("release_continues", ctx)

    def send_fate(self, ctx: FaultContext) -> None:
        """Raises when a standalone notification fails to send (``fail_send_notif``) or finds
        the peer gone (``disconnect_notif``)."""
        if self._take("fail_send_notif", ctx):
            raise FakeNixlError("NIXL_ERR_BACKEND", "injected send_notif failure")
        if self._take("disconnect_notif", ctx):
            raise FakePeerDisconnected("injected: remote agent disconnected")

    def notif_fate(self, ctx: FaultContext) -> NotifFate:
        """What happens to a notification on its way (dropped, rewritten, duplicated, delayed)."""
        if self._take("drop_notif", ctx):
            return NotifFate(drop=True)
        rewrite = self._take("rewrite_notif", ctx)
        dup = self._take("duplicate_notif", ctx)
        delay = self._take("delay_notif", ctx)
        if dup is None and delay is None and rewrite is None:
            return _NO_NOTIF_FAULT
        return NotifFate(
            copies=1 + (dup.copies if dup else 0),
            delay=delay.seconds if delay else None,
            payload=rewrite.rewrite(ctx.notif) if rewrite is not None and rewrite.rewrite is not None else None,
        )

    # --- passthrough -------------------------------------------------------------------------
    def register_memory(self, descs: DescArray, mem_type: str) -> object:
        return self.inner.register_memory(descs, mem_type)

    def deregister_memory(self, registration: object) -> None:
        self.inner.deregister_memory(registration)

    def get_agent_metadata(self) -> bytes:
        return self.inner.get_agent_metadata()

    def remove_remote_agent(self, agent_name: str) -> None:
        self.inner.remove_remote_agent(agent_name)

    def prep_xfer_dlist(self, agent_name: str, descs: DescArray, mem_type: str) -> DlistHandle:
        handle = self.inner.prep_xfer_dlist(agent_name, descs, mem_type)
        if not self.physical:
            self._dlist_targets[id(handle)] = agent_name
        return handle

    def release_dlist_handle(self, handle: DlistHandle) -> None:
        self._dlist_targets.pop(id(handle), None)
        self.inner.release_dlist_handle(handle)

    # --- faulty ------------------------------------------------------------------------------
    def add_remote_agent(self, metadata: bytes) -> str:
        if not self.physical:  # the remote's name is known only once loaded: matched as "?"
            self.add_remote_fate(FaultContext(self.name, "?"))
        return self.inner.add_remote_agent(metadata)

    def make_prepped_xfer(
        self,
        operation: str,
        local: DlistHandle,
        local_indices: IndexList,
        remote: DlistHandle,
        remote_indices: IndexList,
        notif_msg: bytes,
    ) -> XferHandle:
        handle = self.inner.make_prepped_xfer(operation, local, local_indices, remote, remote_indices, notif_msg)
        if not self.physical:
            self._targets[id(handle)] = (self._dlist_targets.get(id(remote), "?"), bytes(notif_msg))
            self._prepped[id(handle)] = (operation, local, local_indices, remote, remote_indices)
        return handle

    def _run_late(self) -> None:
        """Post the released WRITEs whose time has come; let go of those that ended."""
        if not self._late and not self._late_running:
            return
        now = self.clock()
        due = [h for at, h in self._late if at <= now]
        self._late = [(at, h) for at, h in self._late if at > now]
        for handle in due:
            self._count("posted_after_release")
            if self.inner.transfer(handle) in ("DONE", "ERR"):
                self._end_late(handle)
            else:
                self._late_running.append(handle)
        for handle in list(self._late_running):
            if self.inner.check_xfer_state(handle) != "PROC":
                self._late_running.remove(handle)
                self._end_late(handle)

    def _end_late(self, handle: XferHandle) -> None:
        state = self.inner.check_xfer_state(handle)
        self._count("landed_after_release" if state == "DONE" else "failed_after_release")
        self.inner.release_xfer_handle(handle)

    def transfer(self, handle: XferHandle, notif_msg: bytes = b"") -> XferState:
        if self.physical:
            return self.inner.transfer(handle, notif_msg)
        self._run_late()
        remote, notif = self._targets.get(id(handle), ("?", b""))
        if notif_msg:  # this post's notification replaces the one the handle was made with
            notif = bytes(notif_msg)
            self._targets[id(handle)] = (remote, notif)
        fate = self.write_fate(FaultContext(self.name, remote, notif, "WRITE"))
        if fate.gate is not None or fate.delay > 0:
            self._held[id(handle)] = (handle, fate.gate, self.clock() + fate.delay, fate.fail)
            return "PROC"
        if fate.fail:
            # Never posted: nothing lands, no notification; the writer sees ERR when it polls.
            self._forced_err.add(id(handle))
            return "PROC"
        return self.inner.transfer(handle, notif_msg)

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        if self.physical:
            return self.inner.check_xfer_state(handle)
        self._run_late()
        if id(handle) in self._forced_err:
            return "ERR"
        held = self._held.get(id(handle))
        if held is not None:
            _, gate, due, fail = held
            if (gate is not None and not gate.is_open) or self.clock() < due:
                return "PROC"
            del self._held[id(handle)]  # the gate opened: post it now
            if fail:
                self._forced_err.add(id(handle))
                return "ERR"
            return self.inner.transfer(handle, self._targets.get(id(handle), ("?", b""))[1])
        return self.inner.check_xfer_state(handle)

    def release_xfer_handle(self, handle: XferHandle) -> None:
        if self.physical:
            self.inner.release_xfer_handle(handle)
            return
        held = self._held.pop(id(handle), None)
        if held is not None:
            remote, notif = self._targets.pop(id(handle), ("?", b""))
            rule = self.runs_on_fate(FaultContext(self.name, remote, notif, "WRITE"))
            prepped = self._prepped.pop(id(handle), None)
            self.inner.release_xfer_handle(handle)  # never posted: nothing of it can land
            if rule is not None and prepped is not None and not held[3]:
                # The caller let go; the copy "already started" lands later all the same, as
                # the same WRITE without its notification (a cancelled request sends none).
                late = self.inner.make_prepped_xfer(*prepped, b"")
                self._late.append((self.clock() + max(0.0, rule.seconds), late))
            return
        if id(handle) not in self._forced_err and self.inner.check_xfer_state(handle) == "PROC":
            remote, notif = self._targets.get(id(handle), ("?", b""))
            self.cancel_fate(FaultContext(self.name, remote, notif, "WRITE"))
        self._forced_err.discard(id(handle))
        self._targets.pop(id(handle), None)
        self._prepped.pop(id(handle), None)
        self.inner.release_xfer_handle(handle)

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        if not self.physical:
            self.send_fate(FaultContext(self.name, agent_name, bytes(notif_msg), "NOTIF"))
        self.inner.send_notif(agent_name, notif_msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        if self.physical:
            return self.inner.get_new_notifs()
        self._run_late()
        now = self.clock()
        out: dict[str, list[bytes]] = {}
        if self.recorder is not None:
            for sender, payload in self.recorder.take(self.name):
                self._count("replayed_notif")
                out.setdefault(sender, []).append(payload)
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, sender, payload in due:
            out.setdefault(sender, []).append(payload)
        for sender, messages in self.inner.get_new_notifs().items():
            for payload in messages:
                if self.recorder is not None:
                    self.recorder.note(self.name, sender, payload)
                fate = self.notif_fate(FaultContext(sender, self.name, payload, "NOTIF"))
                if fate.drop:
                    continue
                if fate.payload is not None:
                    payload = fate.payload
                if fate.delay is not None:
                    self._delayed.extend([(now + fate.delay, sender, payload)] * fate.copies)
                    continue
                out.setdefault(sender, []).extend([payload] * fate.copies)
        return out


class FaultyFactory:
    """An agent factory whose agents all share ``plan`` (and ``recorder``); keeps the agents it
    made so a test can read what was injected."""

    def __init__(self, inner: AgentFactory, plan: FaultPlan, recorder: NotifRecorder | None = None) -> None:
        self.inner = inner
        self.plan = plan
        self.recorder = recorder
        self.agents: list[FaultyAgent] = []

    def __call__(self, name: str) -> Any:
        agent = FaultyAgent(self.inner(name), self.plan, recorder=self.recorder)
        self.agents.append(agent)
        return agent

    def injected(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for agent in self.agents:
            for kind, n in agent.injected.items():
                total[kind] = total.get(kind, 0) + n
        return total


def faulty_factory(inner: AgentFactory, plan: FaultPlan, recorder: NotifRecorder | None = None) -> FaultyFactory:
    """An agent factory whose agents all share ``plan``."""
    return FaultyFactory(inner, plan, recorder)
