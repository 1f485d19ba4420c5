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
from .fabric import FakeNixlError, FaultContext, FaultPlan, Match


def random_match(rate: float, rng: random.Random, *, only: Callable[[FaultContext], bool] | None = None) -> Match:
    """Matches a fraction ``rate`` of the events ``only`` accepts (seeded: reproducible)."""
    lock = threading.Lock()

    def match(ctx: FaultContext) -> bool:
        if only is not None and not only(ctx):
            return False
        with lock:
            return rng.random() < rate

    return match


class FaultyAgent:
    """An agent whose calls go to ``inner`` unless ``plan`` injects a fault."""

    def __init__(self, inner: NixlAgentLike, plan: FaultPlan, clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.plan = plan
        self.clock = clock
        self._targets: dict[int, tuple[str, bytes]] = {}  # handle id -> (remote, notif)
        self._forced_err: set[int] = set()
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
        return handle

    def transfer(self, handle: XferHandle) -> XferState:
        _, notif = self._targets.get(id(handle), ("?", b""))
        ctx = FaultContext(self.name, "?", notif, "WRITE")
        if self.plan.take("raise_on_transfer", ctx):
            self._count("raise_on_transfer")
            raise FakeNixlError("NIXL_ERR_BACKEND", "injected: transfer raised")
        if self.plan.take("err_transfer", ctx):
            # Never posted: nothing lands, no notification; the writer sees ERR when it polls.
            self._count("err_transfer")
            self._forced_err.add(id(handle))
            return "PROC"
        return self.inner.transfer(handle)

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        if id(handle) in self._forced_err:
            return "ERR"
        return self.inner.check_xfer_state(handle)

    def release_xfer_handle(self, handle: XferHandle) -> None:
        if id(handle) not in self._forced_err and self.inner.check_xfer_state(handle) == "PROC":
            _, notif = self._targets.get(id(handle), ("?", b""))
            if self.plan.take("refuse_cancel", FaultContext(self.name, "?", notif, "WRITE")):
                self._count("refuse_cancel")
                raise FakeNixlError("NIXL_ERR_BACKEND", "injected: transfer could not be cancelled")
        self._forced_err.discard(id(handle))
        self._targets.pop(id(handle), None)
        self.inner.release_xfer_handle(handle)

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        if self.plan.take("fail_send_notif", FaultContext(self.name, agent_name, bytes(notif_msg), "NOTIF")):
            self._count("fail_send_notif")
            raise FakeNixlError("NIXL_ERR_BACKEND", "injected: send_notif failed")
        self.inner.send_notif(agent_name, notif_msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        now = self.clock()
        out: dict[str, list[bytes]] = {}
        due = [d for d in self._delayed if d[0] <= now]
        self._delayed = [d for d in self._delayed if d[0] > now]
        for _, sender, payload in due:
            out.setdefault(sender, []).append(payload)
        for sender, messages in self.inner.get_new_notifs().items():
            for payload in messages:
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


def faulty_factory(inner: AgentFactory, plan: FaultPlan) -> AgentFactory:
    """An agent factory whose agents all share ``plan``."""

    def make(name: str) -> Any:
        return FaultyAgent(inner(name), plan)

    return make
