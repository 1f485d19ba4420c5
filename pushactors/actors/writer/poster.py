"""The NIXL calls of one rank, in one plain class (no threads, no mailbox).

:class:`Poster` is what the writer actor drives: it owns the rank's NIXL agent, the registered
KV memory, the prepared descriptor lists, and turns a plan into a posted WRITE, a handle into
its state, and a finished handle back into nothing. Only the writer's thread calls it (a NIXL
agent is not thread-safe), so the rule "the writer is the only code that touches NIXL" holds
by construction, while everything here is testable against the fake agent without an actor.

Every method that makes NIXL objects releases what it made when a later call fails, so a
failed post leaves nothing behind for the caller to clean up.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...core.blocks import (
    KVLayout,
    KVRegion,
    LayoutError,
    PairedLayout,
    RemoteLayout,
    WritePlan,
    capacity,
    model_heads,
)
from ...core.topology import write_heads
from ...protocol import MemoryRegistered, RegisterMemory
from ...transport.agent import LOCAL_AGENT, AgentFactory, DlistHandle, NixlAgentLike, PeerDisconnected, XferHandle
from ..base import RankContext
from .remotes import Prepared, RemotePeer
from .writes import ChunkedWrite, Write


@dataclass
class Accepted:
    """A WRITE NIXL accepted: its handle, its status at post, what it owns until it settles
    (``resources``: local list, remote list, P's staging offset) and where the time went."""

    handle: Any
    status: str
    resources: Any = None
    times: dict[str, float] = field(default_factory=dict)


class Poster:
    """The rank's NIXL agent and what was prepared on it (see the module docstring)."""

    def __init__(self, ctx: RankContext, agent_factory: AgentFactory, log: Any) -> None:
        self.ctx = ctx
        self.log = log
        self._factory = agent_factory
        self.agent: NixlAgentLike | None = None
        self.agent_error = ""
        self.layout: KVLayout | None = None
        self.replicated = False  # this rank's KV is replicated across TP ranks (MLA)
        self._mem_registration: object = None
        self._local_dlists: dict[bytes, DlistHandle] = {}
        self._pairing_ids = itertools.count(1)  # names each pairing prepared (0: none)

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self.agent = self._factory(self.ctx.agent_name)
        except Exception as exc:  # surfaced by RegisterMemory, and every request fails
            self.agent_error = f"NIXL agent could not be created: {exc!r}"
            self.log.error("agent.failed", error=self.agent_error)

    def need_agent(self) -> NixlAgentLike:
        if self.agent is None:
            raise RuntimeError(self.agent_error or "NIXL agent not created")
        return self.agent

    def register(self, msg: RegisterMemory) -> tuple[MemoryRegistered, int]:
        """Register the rank's KV memory: the reply, and the logical capacity (0 on failure)."""
        if self.agent is None:
            return MemoryRegistered(error=self.agent_error or "no NIXL agent"), 0
        if self.layout is not None:
            return MemoryRegistered(error="KV memory is already registered for this rank"), 0
        try:
            descs = np.array([(m.addr, m.length, m.device_id) for m in msg.memory], dtype=np.uint64)
            self._mem_registration = self.agent.register_memory(descs, msg.mem_type)
            self.layout = KVLayout(
                regions=tuple(KVRegion.from_info(r) for r in msg.regions),
                mem_type=msg.mem_type,
                block_size=msg.block_size,
                physical_blocks_per_logical=msg.physical_blocks_per_logical,
                memory=msg.memory,
                num_groups=1 + max(r.group for r in msg.regions),
                kv_heads=msg.kv_heads,
            )
            self.replicated = msg.replicated_kv
            logical = max(capacity(msg.regions, msg.physical_blocks_per_logical))
            metadata = self.agent.get_agent_metadata()
        except Exception as exc:
            return MemoryRegistered(error=f"registering KV memory failed: {exc!r}"), 0
        return MemoryRegistered(agent_name=self.agent.name, agent_metadata=metadata), logical

    def close(self) -> None:
        """Release the local lists and the memory registration (at stop, remotes unloaded)."""
        agent = self.agent
        if agent is None:
            return
        for handle in self._local_dlists.values():
            self._release_list(handle)
        self._local_dlists.clear()
        if self._mem_registration is not None:
            try:
                agent.deregister_memory(self._mem_registration)
            except Exception as exc:
                self.log.warning("memory.deregister_failed", error=repr(exc))
            self._mem_registration = None

    # --- what is prepared per remote ---------------------------------------------------------
    def prepared(self, remote: RemotePeer, d_rank: int, d_tp: int) -> Prepared:
        """The pairing for WRITEs to this D rank and its prepared lists (none when this rank
        writes no heads there: a lower-ranked P source holds the same ones). Built once per
        loaded remote: neither side's layout changes while it stays loaded."""
        agent = self.need_agent()
        if self.layout is None:
            raise LayoutError("KV memory is not registered on this rank")
        known = remote.prepared.get((d_rank, d_tp))
        if known is not None:
            return known
        if remote.layout is None:
            remote.layout = RemoteLayout.from_info(remote.info, remote.agent_name, remote.clock_offset)
        if remote.layout.tp_size != d_tp:
            raise LayoutError(f"D advertises TP {remote.layout.tp_size} but registered with TP {d_tp}")
        tp_rank, tp_size = self.ctx.tp_rank, self.ctx.tp_size
        kv_heads = model_heads(self.layout, remote.layout, tp_size, d_tp, self.replicated)
        heads = write_heads(tp_rank, tp_size, d_rank, d_tp, kv_heads)
        key = (heads.start, heads.stop)
        paired = remote.pairings.get(key)
        if paired is None:
            paired = PairedLayout(self.layout, (tp_rank, tp_size), remote.layout, heads, kv_heads)
            remote.pairings[key] = paired
        prepared: Prepared
        if not paired.links:
            prepared = remote.prepared[(d_rank, d_tp)] = Prepared(paired, None, None, next(self._pairing_ids))
            return prepared
        local_h = self._local_dlists.get(paired.local_key)
        if local_h is None:
            local_h = agent.prep_xfer_dlist(LOCAL_AGENT, paired.local_descriptors(), self.layout.mem_type)
            self._local_dlists[paired.local_key] = local_h
        remote_h = remote.dlists.get(key)
        if remote_h is None:
            remote_h = agent.prep_xfer_dlist(remote.agent_name, paired.remote_descriptors(), remote.layout.mem_type)
            remote.dlists[key] = remote_h
        prepared = remote.prepared[(d_rank, d_tp)] = Prepared(paired, local_h, remote_h, next(self._pairing_ids))
        return prepared

    # --- posting -----------------------------------------------------------------------------
    def prep_runs(self, plan: WritePlan, remote: RemotePeer) -> tuple[DlistHandle, DlistHandle] | None:
        """The two lists a plan posted as runs needs, prepared ahead of its post (the caller
        owns and releases them); None for a plan posted by index into the prepared lists."""
        if plan.runs is None:
            return None
        agent = self.need_agent()
        assert self.layout is not None and remote.layout is not None
        runs_l = agent.prep_xfer_dlist(LOCAL_AGENT, plan.runs[0], self.layout.mem_type)
        try:
            runs_r = agent.prep_xfer_dlist(remote.agent_name, plan.runs[1], remote.layout.mem_type)
        except Exception:
            self._release_list(runs_l)
            raise
        return runs_l, runs_r

    def make_ahead(
        self, plan: WritePlan, prepared: Prepared, lists: tuple[DlistHandle, DlistHandle] | None
    ) -> XferHandle:
        """The WRITE of ``plan`` made now, without a notification, to be posted later by
        :meth:`post_plan` (``made``). The caller owns the handle until it posts it, and
        releases it if it never does."""
        return self._make(plan, prepared, lists, b"")

    def _make(
        self, plan: WritePlan, prepared: Prepared, lists: tuple[DlistHandle, DlistHandle] | None, notif: bytes
    ) -> XferHandle:
        """A WRITE of ``plan``: as runs over ``lists`` when the plan has runs, else by index
        into the pairing's prepared lists."""
        agent = self.need_agent()
        if plan.runs is not None:
            if lists is None:
                raise ValueError("a plan of runs is made over lists prepared for it")
            idx = np.arange(len(plan.runs[0]), dtype=np.int64)
            return agent.make_prepped_xfer("WRITE", lists[0], idx, lists[1], idx, notif)
        local_h, remote_h = prepared.local, prepared.remote
        assert local_h is not None and remote_h is not None
        return agent.make_prepped_xfer("WRITE", local_h, plan.local_idx, remote_h, plan.remote_idx, notif)

    def post_plan(
        self,
        plan: WritePlan,
        prepared: Prepared,
        remote: RemotePeer,
        notif: bytes,
        lists: tuple[DlistHandle, DlistHandle] | None = None,
        made: XferHandle | None = None,
    ) -> Accepted:
        """Post a planned WRITE of pieces (``plan.num_descs`` > 0). A plan of few runs is
        posted as lists of just those runs (``lists`` when prepared ahead, by :meth:`prep_runs`,
        and owned by the caller; else prepared here and released when it settles); otherwise
        by index into the prepared lists. ``made``: the WRITE made ahead by :meth:`make_ahead`
        (now the post's), only posted here, with ``notif``. Raises what NIXL raised, having
        released what it made."""
        agent = self.need_agent()
        assert self.layout is not None and remote.layout is not None
        handle = made
        resources: Any = None
        listing = time.monotonic()
        try:
            if made is None and plan.runs is not None and lists is None:
                runs_l = agent.prep_xfer_dlist(LOCAL_AGENT, plan.runs[0], self.layout.mem_type)
                resources = (runs_l, None, None)
                runs_r = agent.prep_xfer_dlist(remote.agent_name, plan.runs[1], remote.layout.mem_type)
                resources = (runs_l, runs_r, None)
                lists = (runs_l, runs_r)
            # Only lists prepared here count as preparing (a preemption is not a cost).
            prepped = time.monotonic() if resources is not None else listing
            if handle is None:
                handle = self._make(plan, prepared, lists, notif)
                making = time.monotonic()
            else:
                making = prepped  # made ahead: nothing is made at the post (a preemption is not a cost)
            # A handle made ahead has no notification of its own: this post names it.
            status = agent.transfer(handle, notif if made is not None else b"")
        except Exception:
            if handle is not None:
                self.release_xfer(handle)
            if resources is not None:
                self.release_resources(resources)
            raise
        posted = time.monotonic()
        times = {"prep_ms": prepped - listing, "make_ms": making - prepped, "transfer_ms": posted - making}
        return Accepted(handle, str(status), resources, times)

    def post_rows(
        self, local_rows: Any, remote_addrs: Any, remote: RemotePeer, notif: bytes, *, p_off: int | None
    ) -> Accepted:
        """Post one WRITE of explicit rows (address, length) from here (our blocks, or P's
        staging slot at ``p_off``) into D's staging image. Its lists are prepared for it and
        released when it settles (or now, with P's slot, if posting fails)."""
        agent = self.need_agent()
        assert self.layout is not None and remote.layout is not None
        mine = self.ctx.staging
        n = len(local_rows)
        ldesc = np.empty((n, 3), dtype=np.uint64)
        ldesc[:, 0] = local_rows[:, 0]
        ldesc[:, 1] = local_rows[:, 1]
        ldesc[:, 2] = mine.device_id if (mine is not None and p_off is not None) else self.layout.regions[0].device_id
        rdesc = np.empty((n, 3), dtype=np.uint64)
        rdesc[:, 0] = remote_addrs
        rdesc[:, 1] = local_rows[:, 1]
        rdesc[:, 2] = remote.info.staging.device_id if remote.info.staging is not None else 0
        local_h = remote_h = handle = None
        try:
            local_h = agent.prep_xfer_dlist(LOCAL_AGENT, ldesc, self.layout.mem_type)
            remote_h = agent.prep_xfer_dlist(remote.agent_name, rdesc, remote.layout.mem_type)
            idx = np.arange(n, dtype=np.int64)
            handle = agent.make_prepped_xfer("WRITE", local_h, idx, remote_h, idx, notif)
            status = agent.transfer(handle)
        except Exception:
            if handle is not None:
                self.release_xfer(handle)
            self.release_resources((local_h, remote_h, p_off))
            raise
        return Accepted(handle, str(status), (local_h, remote_h, p_off))

    def post_chunk(self, xfer: ChunkedWrite, off: Any, length: Any, d_addr: int, remote: RemotePeer) -> bool:
        """Post one gathered chunk of a staged push: the spans ``off``/``length`` of P's slot
        into D's slot at ``d_addr``. A push of one chunk carries its completion in its WRITE (D
        learns the image landed from NIXL, not from our next poll); a push of several sends it
        once every chunk is DONE (:meth:`state`). Failures are recorded on ``xfer``; True when
        NIXL said the peer is gone."""
        agent = self.need_agent()
        mine = self.ctx.staging
        staging = remote.info.staging
        assert mine is not None and xfer.p_off is not None and staging is not None
        assert self.layout is not None and remote.layout is not None
        n = len(off)
        ldesc = np.empty((n, 3), dtype=np.uint64)
        ldesc[:, 0] = mine.addr + xfer.p_off + off
        ldesc[:, 1] = length
        ldesc[:, 2] = mine.device_id
        rdesc = ldesc.copy()
        rdesc[:, 0] = d_addr + off
        rdesc[:, 2] = staging.device_id
        try:
            lh = agent.prep_xfer_dlist(LOCAL_AGENT, ldesc, self.layout.mem_type)
            xfer.dlists.append(lh)
            rh = agent.prep_xfer_dlist(remote.agent_name, rdesc, remote.layout.mem_type)
            xfer.dlists.append(rh)
            idx = np.arange(n, dtype=np.int64)
            notif = xfer.completion if xfer.chunks == 1 else b""
            handle = agent.make_prepped_xfer("WRITE", lh, idx, rh, idx, notif)
            try:
                posted = agent.transfer(handle)
            except Exception:
                # Never posted (NIXL gives nothing to poll): release it at once, so the chunks
                # that did post are waited for, not released with it.
                self.release_xfer(handle)
                raise
            xfer.add(handle, time.monotonic())
            xfer.notified = bool(notif)
            if posted == "ERR":
                xfer.failed = "WRITE ended in ERR at post"
        except Exception as exc:
            xfer.failed = f"WRITE submission failed: {exc!r}"
            self.ctx.metrics.incr("write.submit_failed")
            return isinstance(exc, PeerDisconnected)
        return False

    def post_layer(
        self,
        xfer: ChunkedWrite,
        plan: WritePlan,
        prepared: Prepared,
        remote: RemotePeer,
        notif: bytes,
        lists: tuple[DlistHandle, DlistHandle] | None = None,
        made: XferHandle | None = None,
    ) -> tuple[bool, dict[str, float]]:
        """Post one layer group's WRITE of a layer-wise push as a chunk of ``xfer`` (its lists,
        when posted as runs, are released with the push; ``lists``: prepared ahead and already
        in ``xfer.dlists``; ``made``: the WRITE made ahead, taken out of ``xfer.spare``).
        Failures are recorded on ``xfer``. Returns (whether NIXL said the peer is gone, where
        the post's time went)."""
        if made is not None:
            xfer.spare.remove(made)  # the post's now: posted, or released if the post fails
        try:
            posted = self.post_plan(plan, prepared, remote, notif, lists, made)
        except Exception as exc:
            xfer.failed = f"WRITE submission failed: {exc!r}"
            self.ctx.metrics.incr("write.submit_failed")
            return isinstance(exc, PeerDisconnected), {}
        xfer.add(posted.handle, time.monotonic())
        if posted.resources is not None:
            xfer.dlists.extend(h for h in posted.resources[:2] if h is not None)
        xfer.notified = xfer.notified or bool(notif)
        if posted.status == "ERR":
            xfer.failed = "WRITE ended in ERR at post"
        return False, posted.times

    def send(self, agent_name: str, payload: bytes) -> None:
        self.need_agent().send_notif(agent_name, payload)

    # --- state and release -------------------------------------------------------------------
    def state(self, write: Write) -> str:
        """What NIXL says of a push's WRITE: DONE, PROC or ERR (FAILING: a chunked one that
        failed while some chunk is still in flight; see :meth:`ChunkedWrite.state`)."""
        return write.state(self.need_agent())

    def all_landed(self, xfer: ChunkedWrite) -> bool:
        """Every chunk posted so far is DONE (none failed)."""
        return xfer.all_landed(self.need_agent())

    def release_or_raise(self, write: Write) -> None:
        """Release a push's WRITE; raises NIXL's refusal. NIXL aborts a transfer still active,
        but that does not stop a copy already started (cma, cuda_ipc, RDMA), and nothing says
        when it stopped: the writer releases a WRITE once NIXL reported it ended, never to
        cancel one (only at pinned_write_limit, or when the process goes down). What a chunked
        one made ahead and the lists its chunks read go with it, and P's slot once free."""
        spare, dlists = write.release(self.need_agent())
        for h in spare:  # made ahead, never posted: nothing of it can be running
            self.release_xfer(h)
        for h in dlists:
            self._release_list(h)
        self.maybe_free_slot(write)

    def release(self, write: Write) -> bool:
        """:meth:`release_or_raise`, logged and counted instead of raised; False if NIXL refused."""
        try:
            self.release_or_raise(write)
        except Exception as exc:
            self._release_failed(exc)
            return False
        return True

    def release_xfer(self, xfer: XferHandle) -> bool:
        """Release one NIXL WRITE (never posted, or made ahead), logged and counted instead of
        raised; False if NIXL refused."""
        try:
            self.need_agent().release_xfer_handle(xfer)
        except Exception as exc:
            self._release_failed(exc)
            return False
        return True

    def _release_failed(self, exc: Exception) -> None:
        self.ctx.metrics.incr("writer.release_failed")
        self.log.warning("xfer.release_failed", error=repr(exc))

    def release_resources(self, resources: Any) -> None:
        """Release a WRITE's own lists and give back P's staging slot."""
        local_h, remote_h, p_off = resources
        for h in (local_h, remote_h):
            if h is not None and self.agent is not None:
                self._release_list(h)
        if p_off is not None and self.ctx.staging is not None:
            self.ctx.staging.free(p_off)

    def maybe_free_slot(self, write: Write) -> None:
        """P's slot goes back once the chunks are released and no gather can write into it."""
        staging = self.ctx.staging
        if staging is not None:
            off = write.take_slot()
            if off is not None:
                staging.free(off)

    def _release_list(self, handle: DlistHandle) -> None:
        try:
            self.need_agent().release_dlist_handle(handle)
        except Exception as exc:
            self.log.warning("dlist.release_failed", error=repr(exc))

    # --- remote agents -----------------------------------------------------------------------
    def load(self, metadata: bytes) -> str:
        return self.need_agent().add_remote_agent(metadata)

    def unload_name(self, name: str) -> None:
        try:
            self.need_agent().remove_remote_agent(name)
        except Exception as exc:
            self.log.warning("remote.remove_failed", agent=name, error=repr(exc))

    def unload(self, remote: RemotePeer, *, shared: bool) -> None:
        """Release what was prepared for ``remote``, and unload its agent unless another
        entry (``shared``) still writes through the same name (NIXL holds one per name)."""
        if self.agent is None:
            return
        for handle in remote.dlists.values():
            self._release_list(handle)
        remote.dlists.clear()
        remote.pairings.clear()
        remote.prepared.clear()
        if not shared:
            self.unload_name(remote.agent_name)
