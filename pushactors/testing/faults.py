"""Fault injection around any agent, real NIXL included.

:class:`FaultyAgent` wraps an agent and applies a :class:`~pushactors.testing.fabric.FaultPlan`
at the agent boundary: loading a remote agent fails, a WRITE raises or ends in ERR, an outgoing
notification fails to send, inbound notifications are dropped, duplicated or delayed. With the
fake fabric, faults can also be applied inside the fabric; this wrapper is what makes the same
faults possible over real NIXL (two-process soak).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ..transport.agent import AgentFactory, DescArray, DlistHandle, IndexList, NixlAgentLike, XferHandle, XferState
from .fabric import FakeNixlError, FaultContext, FaultPlan, Gate, Match


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


class FaultyAgent:
    """An agent whose calls go to ``inner`` unless ``plan`` injects a fault.

    Over a real agent, ``hold_transfer`` keeps a WRITE from being posted at all (it reads PROC
    until its gate opens), and ``release_continues`` then makes the release return while the
    WRITE is posted ``runs_on`` seconds later: the real bytes land after the caller let go, as
    a copy already started does when a backend's cancel does not stop it (all calls into
    ``inner`` stay on the caller's thread)."""

    def __init__(
        self,
        inner: NixlAgentLike,
        plan: FaultPlan,
        clock: Callable[[], float] = time.monotonic,
        recorder: NotifRecorder | None = None,
    ) -> None:
        self.inner = inner
        self.plan = plan
        self.clock = clock
        self.recorder = recorder
        self._targets: dict[int, tuple[str, bytes]] = {}  # handle id -> (remote, notif)
        self._forced_err: set[int] = set()
        self._held: dict[int, tuple[XferHandle, Gate | None]] = {}  # not posted to inner yet
        self._prepped: dict[int, tuple[str, DlistHandle, IndexList, DlistHandle, IndexList]] = {}
        self._late: list[tuple[float, XferHandle]] = []  # released, to be posted at the time
        self._late_running: list[XferHandle] = []  # posted after their release
        self._delayed: list[tuple[float, str, bytes]] = []
        self.injected: dict[str, int] = {}

    @property
    def name(self) -> str:
        return self.inner.name

    def _count(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

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
        return self.inner.prep_xfer_dlist(agent_name, descs, mem_type)

    def release_dlist_handle(self, handle: DlistHandle) -> None:
        self.inner.release_dlist_handle(handle)

    # --- faulty ------------------------------------------------------------------------------
    def add_remote_agent(self, metadata: bytes) -> str:
        if self.plan.take("fail_add_remote", FaultContext(self.name, "?")):
            self._count("fail_add_remote")
            raise FakeNixlError("NIXL_ERR_BACKEND", "injected: loading the remote agent failed")
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
        self._targets[id(handle)] = ("?", bytes(notif_msg))
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
        self._run_late()
        remote, notif = self._targets.get(id(handle), ("?", b""))
        if notif_msg:  # this post's notification replaces the one the handle was made with
            notif = bytes(notif_msg)
            self._targets[id(handle)] = (remote, notif)
        ctx = FaultContext(self.name, "?", notif, "WRITE")
        hold = self.plan.take("hold_transfer", ctx)
        if hold:
            self._count("hold_transfer")
            self._held[id(handle)] = (handle, hold.gate)
            return "PROC"
        if self.plan.take("raise_on_transfer", ctx):
            self._count("raise_on_transfer")
            raise FakeNixlError("NIXL_ERR_BACKEND", "injected: transfer raised")
        if self.plan.take("err_transfer", ctx):
            # Never posted: nothing lands, no notification; the writer sees ERR when it polls.
            self._count("err_transfer")
            self._forced_err.add(id(handle))
            return "PROC"
        return self.inner.transfer(handle, notif_msg)

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        self._run_late()
        if id(handle) in self._forced_err:
            return "ERR"
        held = self._held.get(id(handle))
        if held is not None:
            if held[1] is None or not held[1].is_open:
                return "PROC"
            del self._held[id(handle)]  # the gate opened: post it now
            return self.inner.transfer(handle, self._targets.get(id(handle), ("?", b""))[1])
        return self.inner.check_xfer_state(handle)

    def release_xfer_handle(self, handle: XferHandle) -> None:
        held = self._held.pop(id(handle), None)
        if held is not None:
            _, notif = self._targets.pop(id(handle), ("?", b""))
            rule = self.plan.take("release_continues", FaultContext(self.name, "?", notif, "WRITE"))
            prepped = self._prepped.pop(id(handle), None)
            self.inner.release_xfer_handle(handle)  # never posted: nothing of it can land
            if rule is not None and prepped is not None:
                # The caller let go; the copy "already started" lands later all the same, as
                # the same WRITE without its notification (a cancelled request sends none).
                self._count("release_continues")
                late = self.inner.make_prepped_xfer(*prepped, b"")
                self._late.append((self.clock() + max(0.0, rule.seconds), late))
            return
        if id(handle) not in self._forced_err and self.inner.check_xfer_state(handle) == "PROC":
            _, notif = self._targets.get(id(handle), ("?", b""))
            if self.plan.take("refuse_cancel", FaultContext(self.name, "?", notif, "WRITE")):
                self._count("refuse_cancel")
                raise FakeNixlError("NIXL_ERR_BACKEND", "injected: transfer could not be cancelled")
        self._forced_err.discard(id(handle))
        self._targets.pop(id(handle), None)
        self._prepped.pop(id(handle), None)
        self.inner.release_xfer_handle(handle)

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        if self.plan.take("fail_send_notif", FaultContext(self.name, agent_name, bytes(notif_msg), "NOTIF")):
            self._count("fail_send_notif")
            raise FakeNixlError("NIXL_ERR_BACKEND", "injected: send_notif failed")
        self.inner.send_notif(agent_name, notif_msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
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
                ctx = FaultContext(sender, self.name, payload, "NOTIF")
                if self.plan.take("drop_notif", ctx):
                    self._count("drop_notif")
                    continue
                delay = self.plan.take("delay_notif", ctx)
                if delay:
                    self._count("delay_notif")
                    self._delayed.append((now + delay.seconds, sender, payload))
                    continue
                copies = 1
                dup = self.plan.take("duplicate_notif", ctx)
                if dup:
                    self._count("duplicate_notif")
                    copies += dup.copies
                out.setdefault(sender, []).extend([payload] * copies)
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
