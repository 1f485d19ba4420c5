"""A fake NIXL fabric that moves real bytes.

Like httpx's MockTransport, this is a working implementation of the agent interface, not a set
of mocks: agents register CPU memory, prepare descriptor lists, post WRITEs whose bytes are
copied between registered buffers, and receive notifications, which are delivered only after
the WRITE's bytes landed. Every check real NIXL makes that matters to the writer is made here
too (unknown remote agents, descriptors outside registered memory, lists invalidated by a
remote reload). Faults are injected on demand through :attr:`FakeFabric.faults`, a
:class:`~pushactors.testing.faults.FaultPlan` that only each agent's
:class:`~pushactors.testing.faults.FaultyAgent` reads: the fabric keeps the physics (latency,
a WRITE held in flight, a copy that runs on after its release, notifications delivered after
the bytes landed) and asks that reader what a fault does at each point.

Progress is lazy and deterministic: pending transfers and delayed notifications advance, in
submission order, whenever any agent of the fabric is polled.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np

from ..transport.agent import LOCAL_AGENT, DescArray, IndexList, XferState
from .errors import FakeNixlError
from .faults import FaultContext, FaultPlan, FaultyAgent, Gate


# --------------------------------------------------------------------------------------------
# Fabric
# --------------------------------------------------------------------------------------------
class _Metadata(msgspec.Struct, frozen=True, array_like=True):
    magic: str
    name: str
    generation: int
    ranges: tuple[tuple[int, int, int, str], ...]  # addr, length, device, mem type


_md_decoder = msgspec.msgpack.Decoder(_Metadata)
_MAGIC = "fake-nixl/1"


@dataclass
class FakeDlistHandle:
    id: int
    owner: str
    target: str  # LOCAL_AGENT or a remote agent name
    descs: DescArray
    mem_type: str
    generation: int
    released: bool = False


@dataclass
class FakeXferHandle:
    id: int
    owner: str
    target: str
    src: DescArray  # Kx3 rows actually copied
    dst: DescArray
    notif: bytes
    generation: int
    state: Literal["INIT", "PROC", "DONE", "ERR"] = "INIT"
    merged_descs: int = 0
    nbytes: int = 0
    released: bool = False
    seen_done: bool = False  # check_xfer_state already answered DONE once


@dataclass
class _Pending:
    xfer: FakeXferHandle
    due: float
    gate: Gate | None
    fail: bool
    orphaned: bool = False  # its handle was released while it ran on (release_continues)


@dataclass
class FabricStats:
    transfers_posted: int = 0
    transfers_done: int = 0
    transfers_err: int = 0
    transfers_cancelled: int = 0
    transfers_landed_after_release: int = 0
    bytes_moved: int = 0
    descriptors: int = 0
    merged_descriptors: int = 0
    notifs_sent: int = 0
    notifs_delivered: int = 0
    notifs_dropped: int = 0
    notifs_duplicated: int = 0
    # check_xfer_state asked again about a WRITE it had already answered DONE (a poll that
    # costs the writer a NIXL call for nothing: each poll should ask only what still runs)
    done_rechecks: int = 0
    per_transfer_merged: list[int] = field(default_factory=list)


class FakeFabric:
    """The wire between fake agents of one process."""

    def __init__(self, *, latency: float = 0.0, clock: Callable[[], float] = time.monotonic, copy: bool = True) -> None:
        self.latency = latency
        self.clock = clock
        # False: WRITEs move no bytes (control-plane benchmarks); every check, state change,
        # statistic and notification (still after the WRITE completes) is kept.
        self.copy = copy
        self.faults = FaultPlan()
        self.stats = FabricStats()
        self._lock = threading.RLock()
        self._agents: dict[str, FakeNixlAgent] = {}
        self._pending: deque[_Pending] = deque()
        self._delayed: list[tuple[float, str, str, bytes]] = []  # due, src, dst, payload
        self._ids = itertools.count(1)

    def agent(self, name: str) -> FakeNixlAgent:
        """Create the agent ``name`` on this fabric (an :data:`AgentFactory`)."""
        with self._lock:
            if name in self._agents:
                raise FakeNixlError("NIXL_ERR_INVALID_PARAM", f"agent {name!r} exists")
            agent = FakeNixlAgent(name, self)
            self._agents[name] = agent
            return agent

    def _faulty(self, name: str) -> FaultyAgent:
        return self._agents[name].faulty

    def __call__(self, name: str) -> FakeNixlAgent:
        return self.agent(name)

    def get(self, name: str) -> FakeNixlAgent:
        return self._agents[name]

    @property
    def agents(self) -> dict[str, FakeNixlAgent]:
        return dict(self._agents)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def next_id(self) -> int:
        return next(self._ids)

    # --- transfers ---------------------------------------------------------------------------
    def _submit(self, xfer: FakeXferHandle) -> XferState:
        ctx = FaultContext(xfer.owner, xfer.target, xfer.notif, "WRITE")
        with self._lock:
            fate = self._faulty(xfer.owner).write_fate(ctx)
            xfer.state = "PROC"
            self.stats.transfers_posted += 1
            self._pending.append(_Pending(xfer, self.clock() + self.latency + fate.delay, fate.gate, fate.fail))
            self.progress()
            return "PROC" if xfer.state == "PROC" else xfer.state  # type: ignore[return-value]

    def _cancel(self, xfer: FakeXferHandle) -> bool:
        """Stop a transfer in flight, unless a ``release_continues`` rule says it runs on.
        True when it was stopped (or had already ended)."""
        with self._lock:
            for p in list(self._pending):
                if p.xfer is xfer:
                    ctx = FaultContext(xfer.owner, xfer.target, xfer.notif, "WRITE")
                    rule = self._faulty(xfer.owner).runs_on_fate(ctx)
                    if rule:
                        p.orphaned = True
                        if rule.seconds >= 0:
                            p.due, p.gate = self.clock() + rule.seconds, None
                        return False
                    self._pending.remove(p)
                    self.stats.transfers_cancelled += 1
            return True

    def progress(self) -> None:
        """Complete every transfer and notification that is due, in submission order."""
        with self._lock:
            now = self.clock()
            kept: deque[_Pending] = deque()
            while self._pending:
                p = self._pending.popleft()
                if p.due > now or (p.gate is not None and not p.gate.is_open):
                    kept.append(p)
                    continue
                self._complete(p)
            self._pending = kept
            if self._delayed:
                due = [d for d in self._delayed if d[0] <= now]
                self._delayed = [d for d in self._delayed if d[0] > now]
                for _, src, dst, payload in sorted(due, key=lambda d: d[0]):
                    self._deliver_now(src, dst, payload)

    def _complete(self, p: _Pending) -> None:
        xfer = p.xfer
        if p.fail or xfer.target not in self._agents:
            xfer.state = "ERR"
            self.stats.transfers_err += 1
            return
        if self.copy:
            for (saddr, length, _), (daddr, _, _) in zip(xfer.src.tolist(), xfer.dst.tolist(), strict=True):
                ctypes.memmove(int(daddr), int(saddr), int(length))
            ctx = FaultContext(xfer.owner, xfer.target, xfer.notif, "WRITE")
            self._faulty(xfer.owner).landed_fate(ctx, xfer.dst)
        if p.orphaned:
            self.stats.transfers_landed_after_release += 1
            return  # nobody holds the handle: no state to set, no notification
        xfer.state = "DONE"
        self.stats.transfers_done += 1
        self.stats.bytes_moved += xfer.nbytes
        self.stats.descriptors += len(xfer.src)
        self.stats.merged_descriptors += xfer.merged_descs
        self.stats.per_transfer_merged.append(xfer.merged_descs)
        if xfer.notif:
            # Bytes first, then the notification: the receiver may read its blocks at once.
            self._notify(xfer.owner, xfer.target, xfer.notif)

    # --- notifications -----------------------------------------------------------------------
    def _notify(self, src: str, dst: str, payload: bytes) -> None:
        fate = self._faulty(src).notif_fate(FaultContext(src, dst, payload, "NOTIF"))
        self.stats.notifs_sent += 1
        if fate.drop:
            self.stats.notifs_dropped += 1
            return
        if fate.payload is not None:
            payload = fate.payload
        self.stats.notifs_duplicated += fate.copies - 1
        for _ in range(fate.copies):
            if fate.delay is not None:
                self._delayed.append((self.clock() + fate.delay, src, dst, payload))
            else:
                self._deliver_now(src, dst, payload)

    def _deliver_now(self, src: str, dst: str, payload: bytes) -> None:
        target = self._agents.get(dst)
        if target is None:
            return
        target._inbox[src].append(payload)
        self.stats.notifs_delivered += 1


class FakeNixlAgent:
    """One rank's agent on a :class:`FakeFabric`; implements :class:`~pushactors.transport.agent.NixlAgentLike`."""

    def __init__(self, name: str, fabric: FakeFabric) -> None:
        self._name = name
        self.fabric = fabric
        # The one reader of the fabric's fault plan for this agent; the fabric asks it what a
        # fault does and applies the physics (calls through it pass straight here).
        self.faulty = FaultyAgent(self, fabric.faults, clock=fabric.clock, physical=True)
        self._ranges: dict[int, tuple[int, int, int, str]] = {}  # reg id -> range
        self._remotes: dict[str, _Metadata] = {}
        self._generation = 0
        self._inbox: defaultdict[str, list[bytes]] = defaultdict(list)
        self._dlists: dict[int, FakeDlistHandle] = {}
        self._xfers: dict[int, FakeXferHandle] = {}
        self.calling_threads: set[str] = set()
        self.calls: defaultdict[str, int] = defaultdict(int)

    @property
    def name(self) -> str:
        return self._name

    def _enter(self, method: str) -> None:
        self.calling_threads.add(threading.current_thread().name)
        self.calls[method] += 1

    # --- memory ------------------------------------------------------------------------------
    def register_memory(self, descs: DescArray, mem_type: str) -> object:
        self._enter("register_memory")
        if mem_type != "DRAM":
            raise FakeNixlError("NIXL_ERR_NOT_SUPPORTED", "the fake fabric moves DRAM only")
        ids = []
        with self.fabric._lock:
            for addr, length, dev in np.asarray(descs, dtype=np.uint64).reshape(-1, 3).tolist():
                rid = self.fabric.next_id()
                self._ranges[rid] = (int(addr), int(length), int(dev), mem_type)
                ids.append(rid)
        return tuple(ids)

    def deregister_memory(self, registration: object) -> None:
        self._enter("deregister_memory")
        with self.fabric._lock:
            for rid in registration:  # type: ignore[attr-defined]
                self._ranges.pop(rid, None)

    def get_agent_metadata(self) -> bytes:
        self._enter("get_agent_metadata")
        with self.fabric._lock:
            self._generation += 1
            md = _Metadata(_MAGIC, self._name, self._generation, tuple(self._ranges.values()))
        return msgspec.msgpack.encode(md)

    # --- remote agents -----------------------------------------------------------------------
    def add_remote_agent(self, metadata: bytes) -> str:
        self._enter("add_remote_agent")
        try:
            md = _md_decoder.decode(metadata)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM", "undecodable agent metadata") from None
        if md.magic != _MAGIC:
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM", "not fake-nixl metadata")
        with self.fabric._lock:
            self.faulty.add_remote_fate(FaultContext(self._name, md.name))
            self._remotes[md.name] = md
        return md.name

    def remove_remote_agent(self, agent_name: str) -> None:
        self._enter("remove_remote_agent")
        with self.fabric._lock:
            if self._remotes.pop(agent_name, None) is None:
                raise FakeNixlError("NIXL_ERR_NOT_FOUND", f"no remote agent {agent_name!r}")

    @property
    def remote_agents(self) -> tuple[str, ...]:
        return tuple(self._remotes)

    # --- descriptor lists --------------------------------------------------------------------
    def prep_xfer_dlist(self, agent_name: str, descs: DescArray, mem_type: str) -> FakeDlistHandle:
        self._enter("prep_xfer_dlist")
        arr = np.array(descs, dtype=np.uint64).reshape(-1, 3)
        with self.fabric._lock:
            if agent_name in (LOCAL_AGENT, ""):
                target, generation = LOCAL_AGENT, 0
                ranges = list(self._ranges.values())
            else:
                md = self._remotes.get(agent_name)
                if md is None:
                    raise FakeNixlError("NIXL_ERR_NOT_FOUND", f"remote agent {agent_name!r} not loaded")
                target, generation, ranges = agent_name, md.generation, list(md.ranges)
            _check_inside(arr, ranges, mem_type)
            handle = FakeDlistHandle(self.fabric.next_id(), self._name, target, arr, mem_type, generation)
            self._dlists[handle.id] = handle
            return handle

    def release_dlist_handle(self, handle: object) -> None:
        self._enter("release_dlist_handle")
        assert isinstance(handle, FakeDlistHandle)
        handle.released = True
        self._dlists.pop(handle.id, None)

    def make_prepped_xfer(
        self,
        operation: str,
        local: object,
        local_indices: IndexList,
        remote: object,
        remote_indices: IndexList,
        notif_msg: bytes,
    ) -> FakeXferHandle:
        self._enter("make_prepped_xfer")
        assert isinstance(local, FakeDlistHandle) and isinstance(remote, FakeDlistHandle)
        if operation != "WRITE":
            raise FakeNixlError("NIXL_ERR_NOT_SUPPORTED", f"fake fabric does {operation!r}? only WRITE")
        if local.released or remote.released or local.target != LOCAL_AGENT:
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM", "bad descriptor list handle")
        li = np.asarray(local_indices, dtype=np.int64)
        ri = np.asarray(remote_indices, dtype=np.int64)
        if li.shape != ri.shape:
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM", "index lists differ in length")
        if len(li) and (li.min() < 0 or li.max() >= len(local.descs) or ri.min() < 0 or ri.max() >= len(remote.descs)):
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM", "descriptor index out of range")
        with self.fabric._lock:
            md = self._remotes.get(remote.target)
            if md is None or md.generation != remote.generation:
                raise FakeNixlError(
                    "NIXL_ERR_NOT_FOUND",
                    f"remote agent {remote.target!r} was invalidated or re-registered after prep",
                )
        src = local.descs[li]
        dst = remote.descs[ri]
        if (src[:, 1] != dst[:, 1]).any():
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM", "descriptor lengths differ")
        xfer = FakeXferHandle(
            id=self.fabric.next_id(),
            owner=self._name,
            target=remote.target,
            src=src,
            dst=dst,
            notif=bytes(notif_msg),
            generation=remote.generation,
            merged_descs=_merged(src, dst),
            nbytes=int(src[:, 1].sum()) if len(src) else 0,
        )
        self._xfers[xfer.id] = xfer
        return xfer

    # --- transfers ---------------------------------------------------------------------------
    def transfer(self, handle: object, notif_msg: bytes = b"") -> XferState:
        self._enter("transfer")
        assert isinstance(handle, FakeXferHandle)
        if handle.released:
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM", "transfer on a released handle")
        if handle.state == "PROC":
            raise FakeNixlError("NIXL_ERR_REPOST_ACTIVE", "transfer already in progress")
        if notif_msg:
            handle.notif = bytes(notif_msg)  # as NIXL: this post's notification replaces the handle's
        return self.fabric._submit(handle)

    def check_xfer_state(self, handle: object) -> XferState:
        self._enter("check_xfer_state")
        assert isinstance(handle, FakeXferHandle)
        self.fabric.progress()
        if handle.state == "INIT":
            raise FakeNixlError("NIXL_ERR_INVALID_PARAM", "transfer was never posted")
        if handle.state == "DONE":
            with self.fabric._lock:
                if handle.seen_done:
                    self.fabric.stats.done_rechecks += 1
                handle.seen_done = True
        return handle.state  # type: ignore[return-value]

    def release_xfer_handle(self, handle: object) -> None:
        self._enter("release_xfer_handle")
        assert isinstance(handle, FakeXferHandle)
        if handle.state == "PROC":
            self.faulty.cancel_fate(FaultContext(self.name, handle.target, handle.notif, "WRITE"))
            # Real NIXL tries to abort an active transfer on release; the fake cancels it
            # (or, under release_continues, lets it run on as a started copy does).
            self.fabric._cancel(handle)
            handle.state = "ERR"
        handle.released = True
        self._xfers.pop(handle.id, None)

    @property
    def live_handles(self) -> int:
        return len(self._xfers)

    @property
    def live_dlists(self) -> int:
        return len(self._dlists)

    # --- notifications -----------------------------------------------------------------------
    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        self._enter("send_notif")
        with self.fabric._lock:
            if agent_name not in self._remotes:
                raise FakeNixlError("NIXL_ERR_NOT_FOUND", f"remote agent {agent_name!r} not loaded")
            self.faulty.send_fate(FaultContext(self._name, agent_name, bytes(notif_msg)))
            self.fabric._notify(self._name, agent_name, bytes(notif_msg))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self._enter("get_new_notifs")
        with self.fabric._lock:
            self.fabric.progress()
            if not self._inbox:
                return {}
            out = dict(self._inbox)
            self._inbox = defaultdict(list)
            return out

    def inject_notif(self, sender: str, payload: bytes) -> None:
        """Deliver raw bytes as if ``sender`` had sent them (for malformed-input tests)."""
        with self.fabric._lock:
            self._inbox[sender].append(bytes(payload))

    def inject_notifs(self, sender: str, payloads: Iterable[bytes]) -> None:
        """Deliver several at once, in order, as if ``sender`` had sent them: the next
        ``get_new_notifs`` returns them all (one poll reads them together)."""
        with self.fabric._lock:
            self._inbox[sender].extend(bytes(p) for p in payloads)


def _check_inside(arr: DescArray, ranges: list[tuple[int, int, int, str]], mem_type: str) -> None:
    if not len(arr):
        return
    starts = np.array([r[0] for r in ranges if r[3] == mem_type], dtype=np.uint64)
    ends = np.array([r[0] + r[1] for r in ranges if r[3] == mem_type], dtype=np.uint64)
    if not len(starts):
        raise FakeNixlError("NIXL_ERR_NOT_FOUND", "no registered memory of that type")
    a, n = arr[:, 0], arr[:, 1]
    inside = (a[:, None] >= starts[None, :]) & (a[:, None] + n[:, None] <= ends[None, :])
    bad = ~inside.any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FakeNixlError(
            "NIXL_ERR_NOT_FOUND", f"descriptor {i} ({int(a[i]):#x}+{int(n[i])}) is outside registered memory"
        )


def _merged(src: DescArray, dst: DescArray) -> int:
    if not len(src):
        return 0
    s = src.view(np.int64)  # addresses and lengths fit int64; a view copies nothing
    d = dst.view(np.int64)
    joins = (s[1:, 0] == s[:-1, 0] + s[:-1, 1]) & (d[1:, 0] == d[:-1, 0] + d[:-1, 1])
    return int(len(s) - np.count_nonzero(joins))
