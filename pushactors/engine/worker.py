"""The worker-side API: one :class:`PushWorker` per rank (vLLM's worker connector role).

Every call returns without waiting on an actor, except :meth:`PushWorker.register_kv_caches`,
which runs once at start-up and surfaces registration errors to the caller.

Each request handed to the rank is reported exactly once by :meth:`PushWorker.get_finished`:
the worker keeps the ids it owes a report for, and a second report of an id (a late actor
message, the death timer racing a success) is counted and dropped — engines such as vLLM
assert on finished ids they do not know.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import pykka

from ..actors.base import RankContext
from ..core.blocks import KVLayout, LayoutError, capacity
from ..core.config import ConfigError, PushConfig
from ..core.generations import GenerationMint
from ..core.layerwise import LayerGroups, StepLayers
from ..core.outbox import FinishedReport, HandOverClock
from ..core.staging import StagingArea, image_of
from ..core.timeline import Timeline
from ..core.topology import TopologyError, expected_completions, registration_sources
from ..logs import get_logger
from ..protocol import (
    AbortRecv,
    AgentInfo,
    ArmLease,
    BlocksFinished,
    ClockSample,
    CompatSpec,
    FinishedPush,
    Forget,
    LayersReady,
    MemoryRange,
    MemoryRegistered,
    PeerKey,
    PushConnectorMeta,
    RegisterMemory,
    Registration,
    StagingInfo,
    UseMemory,
    WatchRecv,
    compatibility_hash,
)
from ..transport.agent import AgentFactory
from ..transport.directory import MetadataPublisher, MetadataSource
from .system import RankRuntime

if TYPE_CHECKING:
    import torch


class PushWorker:
    """The push transport of one worker rank."""

    def __init__(
        self,
        config: PushConfig,
        *,
        agent_factory: AgentFactory,
        source: MetadataSource,
        publisher: MetadataPublisher,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        compat: CompatSpec | None = None,
    ) -> None:
        if pp_size > 1 and config.role == "consumer":
            raise ConfigError(
                "pipeline parallelism on the decode side is not supported: use pp_size=1 on D "
                "(docs/protocol.md, 'Topologies')"
            )
        self.config = config
        self.publisher = publisher
        self.compat = compat or CompatSpec()
        self.compat_hash = compatibility_hash(self.compat)
        self.ctx = RankContext(
            config=config,
            engine_id=config.engine_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            timeline=Timeline() if config.timeline else None,
        )
        self.log = get_logger(actor="worker", rank=self.ctx.label)
        for warning in config.safety_warnings():
            self.log.warning("config.unsafe", reason=warning)
        for warning in config.deprecations():
            self.log.warning("config.deprecated", reason=warning)
        # CPython stores the interval rounded (0.0002 reads back as 0.00019999999999999998).
        if config.switch_interval is not None and not math.isclose(sys.getswitchinterval(), config.switch_interval):
            # The engine's interpreter, set at its own request (PushConfig.switch_interval says why).
            self.log.info("interpreter.switch_interval", was_s=sys.getswitchinterval(), now_s=config.switch_interval)
            sys.setswitchinterval(config.switch_interval)
        self._lock = threading.Lock()
        self._sending: set[str] = set()  # P ids handed to the actors, not yet reported
        self._recving: set[str] = set()  # D ids handed to the actors, not yet reported
        # D ids re-staged after the transport had ended them: their report is a failure.
        self._overruled: dict[str, str] = {}
        self._unhealthy: str | None = None
        self._handed_at = HandOverClock(self.ctx.metrics)  # the latency histograms' start marks
        self._serials = itertools.count(1)  # incarnations of P ids handed to the actors
        self._generations = GenerationMint()  # D: one per registration this rank sends
        self._capacity: dict[int, int] = {}  # KV group -> logical blocks on this rank
        self.layout: KVLayout | None = None
        # Layer-wise pushes (push_mode): this rank's layer groups, and the step under way.
        self.layer_groups: LayerGroups | None = None
        self._step_layered: tuple[tuple[str, int], ...] = ()
        self._step_layers: StepLayers | None = None
        self._unknown_layers: set[str] = set()
        self._deferred: list[tuple[FinishedPush, int, float]] = []  # announced, not layer-wise here
        self.agent_info: AgentInfo | None = None
        self.runtime = RankRuntime(
            self.ctx, agent_factory=agent_factory, source=source, compat_hash=self.compat_hash, on_death=self._on_death
        )

    # --- start-up ----------------------------------------------------------------------------
    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        block_size: int,
        num_blocks: int | None = None,
        physical_blocks_per_logical: int = 1,
        groups: Mapping[str, int] | None = None,
        replicated_kv: bool = False,
        dims: str | None = None,
        kv_heads: int | None = None,
        timeout: float = 60.0,
    ) -> AgentInfo:
        """Register this rank's KV tensors with NIXL and publish its handshake metadata.

        ``dims`` and ``kv_heads`` describe what the tensors hold (:meth:`KVLayout.from_tensors`)
        so head slices follow the layout; without them a block is opaque, heads outermost."""
        layout = KVLayout.from_tensors(
            kv_caches,
            block_size=block_size,
            num_blocks=num_blocks,
            physical_blocks_per_logical=physical_blocks_per_logical,
            groups=groups,
            dims=dims,
            kv_heads=kv_heads,
        )
        # Verified pushes read the KV where it lives: P digests what it writes whenever a
        # registration asks, D what landed when its ``verify`` picks the request.
        from ..transport.copies import ByteViews
        from ..transport.digest import KVDigest

        self.ctx.kv_digest = KVDigest(ByteViews(kv_caches.values()))
        staging = None
        if self.config.staging_bytes:
            import torch

            # The staging buffer lives beside the KV (same device) and is registered with it.
            device = next(iter(kv_caches.values())).device
            staging = torch.empty(self.config.staging_bytes, dtype=torch.uint8, device=device)
        info = self.register_layout(layout, replicated_kv=replicated_kv, timeout=timeout, staging=staging)
        if staging is not None:
            self.runtime.stager.ask(
                UseMemory(tensors=list(kv_caches.values()), staging=staging, layout=layout), block=True, timeout=timeout
            )
        return info

    def register_layout(
        self,
        layout: KVLayout,
        *,
        replicated_kv: bool = False,
        timeout: float = 60.0,
        staging: torch.Tensor | None = None,
    ) -> AgentInfo:
        """Register KV memory described by ``layout`` (:class:`~pushactors.core.layout.KVLayout`:
        regions, block size, dims) instead of tensors (:meth:`register_kv_caches` builds one
        from tensors). ``replicated_kv``: every TP rank holds all KV heads (MLA);
        ``staging``: a buffer for staged pushes. Returns what this rank publishes."""
        layout.check_heads(self.ctx.tp_rank, self.ctx.tp_size)
        extra: tuple[MemoryRange, ...] = ()
        staging_info = None
        if staging is not None:
            dev = max(staging.get_device(), 0)
            extra = (MemoryRange(staging.data_ptr(), staging.numel(), dev),)
            staging_info = StagingInfo(addr=staging.data_ptr(), length=staging.numel(), device_id=dev)
        reply = self.runtime.writer.ask(
            RegisterMemory(
                regions=layout.region_infos,
                memory=layout.memory + extra,
                mem_type=layout.mem_type,
                block_size=layout.block_size,
                physical_blocks_per_logical=layout.physical_blocks_per_logical,
                replicated_kv=replicated_kv,
                kv_heads=layout.kv_heads,
            ),
            block=True,
            timeout=timeout,
        )
        if not isinstance(reply, MemoryRegistered):
            raise LayoutError(f"unexpected reply from the writer: {reply!r}")
        if reply.error:
            raise LayoutError(reply.error)
        self.layout = layout
        if self.config.push_mode == "layerwise" or self.config.whole_push_start == "forward_end":
            # A whole push announced before its forward is a layer-wise push of one group:
            # matched and its WRITE made ahead while the forward runs, posted once the last
            # layer is computed (one hand-off after the forward, no matcher turn, no plan).
            self.layer_groups = LayerGroups.of(layout, self.config.layers_per_group)
        if staging_info is not None:
            self.ctx.staging = StagingArea(staging_info.addr, staging_info.length, staging_info.device_id)
            self._staging_tensor = staging
        self._capacity = dict(enumerate(capacity(layout.regions, layout.physical_blocks_per_logical)))
        self.agent_info = AgentInfo(
            engine_id=self.ctx.engine_id,
            agent_name=reply.agent_name,
            agent_metadata=reply.agent_metadata,
            mem_type=layout.mem_type,
            tp_size=self.ctx.tp_size,
            tp_rank=self.ctx.tp_rank,
            pp_size=self.ctx.pp_size,
            pp_rank=self.ctx.pp_rank,
            block_size=layout.block_size,
            physical_blocks_per_logical=layout.physical_blocks_per_logical,
            regions=layout.region_infos,
            replicated_kv=replicated_kv,
            kv_heads=layout.kv_heads,
            staging=staging_info,
            clock=ClockSample(monotonic=time.monotonic(), wall=time.time()),
        )
        self.publisher.publish(self.agent_info, self.compat_hash)
        self.log.info(
            "rank.registered",
            regions=len(layout.regions),
            mem_type=layout.mem_type,
            side_channel=f"{self.publisher.host}:{self.publisher.port}",
        )
        return self.agent_info

    # --- every engine step ---------------------------------------------------------------------
    def start_load_kv(self, meta: PushConnectorMeta) -> None:
        """Hand this step's registrations (D) and finished blocks (P) to the actors: one
        mailbox message per actor for the whole step (``Peers.batched``)."""
        if meta.empty:
            return
        self.ctx.handoff.rouse()  # this step has work: a writer sleeping deep polls sooner
        peers = self.ctx.peers
        with peers.batched():
            pushes = self._hand_over_step(meta)
            if not peers.flush():
                self.runtime.check()  # an actor died: this rank is unhealthy
        # What this step handed over goes out now, not at a switch interval: registrations and
        # pushes of requests that finished. An announced push is not waited for: it has the
        # forward to be matched and made ahead, and wait_for_save waits for its WRITE.
        if pushes or meta.registrations or meta.aborted or meta.cancelled:
            self._lend(settle=pushes)

    def _hand_over_step(self, meta: PushConnectorMeta) -> bool:
        """start_load_kv's hand-over; True when it handed over pushes to start now."""
        # Deadlines were computed on the scheduler's clock: rebase them onto ours.
        offset = time.monotonic() - meta.clock
        peers = self.ctx.peers
        layered: list[tuple[str, int]] = []
        now = time.monotonic()
        for fin in meta.finished:
            with self._lock:
                down = self.unhealthy_reason
                self._sending.add(fin.request_id)
            self._handed_at.handed(fin.request_id, now)
            if down is not None:
                self.ctx.outbox.sent(fin.request_id, ok=False, reason=down)
                continue
            serial = next(self._serials)
            if fin.announced:
                if self.layer_groups is None:
                    # Announced before its forward, and this rank pushes whole requests: its
                    # blocks go to the matcher once the forward is over (wait_for_save).
                    self._deferred.append((fin, serial, offset))
                    continue
                # The writer knows it is layer-wise before any push of it can reach it.
                total = self.layer_groups.count
                self._tell(peers.writer, LayersReady(requests=((fin.request_id, serial),), ready=0, total=total))
                layered.append((fin.request_id, serial))
            self._hand_over(fin, serial, offset)
        if layered:
            assert self.layer_groups is not None
            self._step_layered = tuple(layered)
            self._step_layers = StepLayers(self.layer_groups)
        for staged in meta.registrations:
            with self._lock:
                down = self.unhealthy_reason
                live = staged.request_id in self._recving
                self._recving.add(staged.request_id)
            self._handed_at.handed(staged.request_id, now)
            if down is not None:
                self.ctx.outbox.recv_failed(staged.request_id, down)
                continue
            try:
                watch = self._watch(staged, offset)
            except (TopologyError, ValueError) as exc:
                self._fail_recv(staged.request_id, f"cannot register: {exc}", live=live)
                self.log.warning("recv.rejected", request_id=staged.request_id, reason=str(exc))
                continue
            if not self._tell_reaper(watch.request_id, watch, live=live):
                # Re-staged after the transport ended it (its report not drained yet): the
                # new blocks get nothing, so that report, whatever it says, is a failure.
                with self._lock:
                    self._overruled[staged.request_id] = "re-staged after its push had ended"
                self.ctx.metrics.incr("recv.restaged_after_end")
                self.log.warning("recv.restaged_after_end", request_id=staged.request_id)
        for aborted in meta.aborted:
            self._tell_reaper(aborted.request_id, AbortRecv(request_id=aborted.request_id))
        for rejected in meta.rejected:
            with self._lock:
                live = rejected.request_id in self._recving
                self._recving.add(rejected.request_id)
            self._fail_recv(rejected.request_id, rejected.reason, live=live)
        for cancelled in meta.cancelled:
            self._tell(
                peers.matcher,
                Forget(request_id=cancelled.request_id, outcome="aborted", transfer_id=cancelled.transfer_id),
            )
        return any(not fin.announced for fin in meta.finished)

    def _hand_over(self, fin: FinishedPush, serial: int, offset: float) -> None:
        """The lease first: whatever the push sends the reaper later queues behind it. Then
        the blocks go straight to the matcher, one mailbox hop from the WRITE."""
        peers = self.ctx.peers
        self._tell(peers.reaper, ArmLease(request_id=fin.request_id, deadline=fin.deadline + offset, serial=serial))
        self._tell(
            peers.matcher,
            BlocksFinished(
                request_id=fin.request_id, block_ids=fin.block_ids, transfer_id=fin.transfer_id, serial=serial
            ),
        )

    def save_kv_layer(self, layer_name: str, event: Callable[[], Any] | None = None) -> None:
        """The forward saved ``layer_name``'s KV (vLLM's save_kv_layer). When that completes a
        layer group, the writer may WRITE it for this step's layer-wise requests. ``event``
        makes the device event to wait on (a CUDA event recorded now); None: computed already."""
        step = self._step_layers
        if step is None:
            return
        if step.groups.group_of(layer_name) is None and layer_name not in self._unknown_layers:
            # Not a layer of this rank's KV layout: its group is only complete at wait_for_save.
            self._unknown_layers.add(layer_name)
            self.log.warning("layers.unknown_name", layer=layer_name, known=list(step.groups.names[:3]))
        ready = step.saved(layer_name)
        if ready is not None:
            msg = LayersReady(requests=self._step_layered, ready=ready, event=event() if event else None)
            self._tell(self.ctx.peers.writer, msg)

    def wait_for_save(self, event: Callable[[], Any] | None = None) -> None:
        """The step's forward is over (vLLM's wait_for_save): every layer is computed, named
        or not; requests announced to a rank that pushes whole requests go to the matcher
        once the forward's kernels are done (``event``), and the hook lends the interpreter
        while their WRITEs are posted (``hook_lend_max``).

        With layer-wise requests in the step and ``layerwise_save_wait`` > 0, this waits for
        the forward's last kernels, hands the last layers to the writer as computed, and
        waits (at most ``layerwise_save_wait``) until the step's pushes have ended on P's side
        (landed, completion sent): the engine thread leaves the interpreter to the WRITE that
        ends each push instead of holding it while sampling."""
        step, self._step_layers = self._step_layers, None
        layered, self._step_layered = self._step_layered, ()
        if step is not None and layered:
            wait = self.config.layerwise_save_wait
            if wait > 0:
                self._hand_over_last_layers(layered, step.groups.count, event, wait)
            elif step.ready < step.groups.count:
                msg = LayersReady(requests=layered, ready=step.groups.count, event=event() if event else None)
                self._tell(self.ctx.peers.writer, msg)
        deferred, self._deferred = self._deferred, []
        synced = step is not None and bool(layered) and self.config.layerwise_save_wait > 0
        if deferred and event is not None and not synced:
            # The WRITE reads what the forward's kernels write: wait for them (lock released)
            # unless the layer-wise hand-over above just did.
            event().synchronize()
        peers = self.ctx.peers
        with peers.batched():
            for fin, serial, offset in deferred:
                self._hand_over(fin, serial, offset)
            if not peers.flush():
                self.runtime.check()
        if deferred:
            self._lend(settle=True)

    def _hand_over_last_layers(
        self, layered: tuple[tuple[str, int], ...], total: int, event: Callable[[], Any] | None, wait: float
    ) -> None:
        began = time.monotonic()
        if event is not None:
            # Every layer of the forward is queued: wait for its kernels here (without the
            # interpreter lock), so the mark needs no polling of its event by the writer.
            event().synchronize()
        saved = threading.Event()
        self._tell(self.ctx.peers.writer, LayersReady(requests=layered, ready=total, saved=saved))
        if saved.wait(wait):
            self.ctx.metrics.incr("layers.save_waited")
        else:
            self.ctx.metrics.incr("layers.save_wait_timeout")
            self.log.warning("layers.save_wait_timeout", requests=len(layered), waited_s=wait)
        self.ctx.metrics.incr("layers.save_wait_us", int((time.monotonic() - began) * 1e6))  # a sum

    def _fail_recv(self, request_id: str, reason: str, *, live: bool) -> None:
        """Fail a D request this step refused (a re-stage with bad blocks, an abort before its
        new registration went out). One already registered once is still live in the reaper,
        and P may be writing its first blocks: the reaper ends it, after its quarantine, and
        reports it once. Only one never registered is reported now."""
        if live:
            self._tell_reaper(request_id, AbortRecv(request_id=request_id))
        else:
            self.ctx.outbox.recv_failed(request_id, reason)

    def _watch(self, staged: Any, offset: float) -> WatchRecv:
        ctx = self.ctx
        if ctx.pp_size > 1:
            raise ValueError("this rank is pipeline-parallel: PP on the decode side is not supported")
        for group, ids in enumerate(staged.block_ids):
            if not ids:
                continue
            cap = self._capacity.get(group)
            if cap is None and self._capacity:
                raise ValueError(f"block ids name KV group {group}; this rank has {len(self._capacity)}")
            if cap is not None and max(ids) >= cap:
                raise ValueError(f"block id {max(ids)} is beyond this rank's {cap} blocks (group {group})")
        sources = registration_sources(ctx.tp_rank, ctx.tp_size, staged.remote_tp_size, staged.remote_pp_size)
        reg = Registration(
            request_id=staged.request_id,
            decode_engine_id=ctx.engine_id,
            decode_host=staged.decode_host if staged.decode_host is not None else self.publisher.host,
            decode_port=staged.decode_port if staged.decode_port is not None else self.publisher.port,
            decode_tp_size=ctx.tp_size,
            decode_tp_rank=ctx.tp_rank,
            local_block_ids=staged.block_ids,
            remote_engine_id=staged.remote_engine_id,
            remote_host=staged.remote_host,
            remote_port=staged.remote_port,
            remote_tp_size=staged.remote_tp_size,
            remote_pp_size=staged.remote_pp_size,
            transfer_id=staged.transfer_id,
            remote_request_id=staged.remote_request_id,
            skip_blocks=staged.skip_blocks,
            decode_pp_rank=ctx.pp_rank,
            decode_pp_size=ctx.pp_size,
            generation=self._generations.next(),
            deadline=time.monotonic() + self.config.registration_keep,
        )
        expected = expected_completions(ctx.tp_size, staged.remote_tp_size, staged.remote_pp_size)
        # The slot is taken last, once nothing above can refuse the request: a refusal never
        # strands one (from here on the reaper frees it when the request is reported).
        slot = self._staging_slot(staged.block_ids)
        if slot is not None:
            reg = msgspec.structs.replace(reg, staging_slot=slot)
        elif ctx.kv_digest is not None and self.config.verifies(staged.request_id):
            # A staged push lands in the slot first: its blocks are checked by nobody (yet).
            reg = msgspec.structs.replace(reg, verify=True)
        return WatchRecv(
            request_id=staged.request_id,
            expected=expected,
            deadline=staged.deadline + offset,
            registration=reg,
            peers=tuple(
                PeerKey(staged.remote_engine_id, staged.remote_host, staged.remote_port, pp, tp) for pp, tp in sources
            ),
            heartbeat_id=staged.transfer_id or staged.remote_request_id or staged.request_id,
            nbytes=self._recv_bytes(staged.block_ids),
        )

    def _staging_slot(self, groups: tuple[tuple[int, ...], ...]) -> tuple[int, int] | None:
        """D: a staging slot for a request whose blocks are scattered enough to be worth it
        (``staging_min_runs``, ``staging_min_bytes``), when the buffer has room; else None."""
        staging, layout, config = self.ctx.staging, self.layout, self.config
        if staging is None or layout is None:
            return None
        runs = sum(1 + sum(1 for a, b in itertools.pairwise(g) if b != a + 1) for g in groups if g)
        if runs <= config.staging_min_runs:
            return None
        image = image_of(layout.regions, groups, layout.physical_blocks_per_logical)
        if image.nbytes < config.staging_min_bytes:
            return None
        offset = staging.alloc(image.nbytes)
        if offset is None:
            self.ctx.metrics.incr("staging.full")  # the push goes direct
            return None
        return (offset, image.nbytes)

    def _recv_bytes(self, groups: tuple[tuple[int, ...], ...]) -> int:
        layout = self.layout
        if layout is None:
            return 0
        per_block = layout.physical_blocks_per_logical
        return sum(len(groups[r.group]) * per_block * r.block_len for r in layout.regions if r.group < len(groups))

    def _tell_reaper(self, request_id: str, message: WatchRecv | AbortRecv, *, live: bool = False) -> bool:
        """Tell the reaper of a staging or an abort, announced first: neither the writer's take
        of a completion nor the registry decides that request while this waits in the reaper's
        mailbox (core/claims.py). False, nothing sent: ``live`` (the engine still waits for
        it) but the transport has ended it already."""
        if not self.ctx.claims.announce(request_id, live=live):
            return False
        self._tell(self.ctx.peers.reaper, message)
        return True

    def _lend(self, *, poll: bool = False, settle: bool = False) -> None:
        """Lend the interpreter to the rank's actors while they have what this step gave them
        (with ``settle``, until its WRITEs ended: NIXL progresses them in the writer's polls;
        with ``poll``, until the writer polled once), bounded (core/handoff.py)."""
        lent = self.ctx.handoff.lend(self.config.hook_lend_max, poll=poll, settle=settle)
        if lent.lent:
            metrics = self.ctx.metrics
            metrics.incr("hook.lent")
            metrics.incr("hook.lent_us", int(lent.waited_s * 1e6))  # a sum
            if not (lent.quiet and lent.polled and lent.settled):
                metrics.incr("hook.lend_bound")

    def _tell(self, ref: pykka.ActorRef[Any] | None, message: Any) -> None:
        if ref is None:
            raise RuntimeError("rank actors are not running")
        if not self.ctx.peers.send(ref, message):
            self.runtime.check()

    def get_finished(self) -> FinishedReport:
        """What finished since the last call, each request exactly once. Blocks only while
        a WRITE or an answer is outstanding, for at most ``hook_lend_max``: the writer polls
        once first, so what landed by now is in this report."""
        self.runtime.check()
        self._lend(poll=True)
        report = self.ctx.outbox.drain()
        if report.empty and not report.failed_sending:
            return report
        with self._lock:
            sending = frozenset(r for r in report.finished_sending if r in self._sending)
            self._sending.difference_update(sending)
            failed = {r: why for r, why in report.failed_recving.items() if r in self._recving}
            for rid in report.finished_recving:
                why = self._overruled.pop(rid, None)
                if why is not None and rid in self._recving:
                    failed[rid] = why  # it landed in blocks the engine has since replaced
            for rid in failed:
                self._overruled.pop(rid, None)
            self._recving.difference_update(failed)
            recving = frozenset(r for r in report.finished_recving if r in self._recving and r not in failed)
            self._recving.difference_update(recving)
        dropped = (
            len(report.finished_sending)
            - len(sending)
            + len(report.failed_recving)
            - len(failed)
            + len(report.finished_recving)
            - len(recving)
        )
        if dropped:
            self.ctx.metrics.incr("report.duplicate", dropped)
            self.log.warning("report.duplicate_dropped", count=dropped)
        finished = FinishedReport(
            sending,
            recving,
            failed,
            {r: why for r, why in report.failed_sending.items() if r in sending},
            {r: t for r, t in report.ended_at.items() if r in recving or r in failed},
            {r: t for r, t in report.sent_at.items() if r in sending},
        )
        self._handed_at.settle(finished)
        return finished

    def _on_death(self, reason: str) -> None:
        # The rank's actors are stopped: whatever they held will never finish. Fail it all.
        with self._lock:
            self._unhealthy = reason
            sending, recving = set(self._sending), set(self._recving)
        for rid in sending:
            if rid in self.ctx.unreleased:
                # A WRITE NIXL would not cancel may still read its blocks: never hand them back
                # (the engine would reuse them under it). They stay held until the process ends.
                self.log.critical("push.blocks_held_after_death", request_id=rid, reason=reason)
                continue
            self.ctx.outbox.sent(rid, ok=False, reason=reason)

        # P may still be writing into D's blocks and can no longer be told to stop: report D's
        # requests (letting the engine reuse their blocks) only after the quarantine bound.
        # Only those still unreported then: a success already in the outbox stands.
        def fail_recving() -> None:
            with self._lock:
                still = [rid for rid in recving if rid in self._recving]
            for rid in still:
                self.ctx.outbox.recv_failed(rid, reason)

        if recving:
            timer = threading.Timer(self.config.abort_quarantine, fail_recving)
            timer.daemon = True
            timer.start()
        self.log.critical(
            "rank.failed_requests",
            sending=len(sending),
            recving=len(recving),
            recving_reported_in_s=self.config.abort_quarantine,
            reason=reason,
        )

    # --- state -------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """False once an actor died or the rank was shut down: new requests fail at once."""
        return self._unhealthy is None and self.runtime.healthy

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the rank is unhealthy (which actor died, with its error), else None."""
        return self._unhealthy or self.runtime.dead_reason

    @property
    def step_layered(self) -> tuple[tuple[str, int], ...]:
        """This step's layer-wise pushes, as (request id, push serial) the writer knows them by;
        empty outside a step that pushes layer by layer."""
        return self._step_layered

    def pending(self) -> tuple[int, int]:
        """(P requests, D requests) handed to the actors and not reported yet."""
        with self._lock:
            return len(self._sending), len(self._recving)

    def stats(self) -> dict[str, int]:
        """The rank's counters (``push.pushed``, ``bytes.pushed``, ``recv.failed``, ...)."""
        return self.ctx.metrics.snapshot()

    def gauges(self) -> dict[str, int]:
        """This rank's operators' gauges, read without waiting on an actor: health and the
        requests handed over and not reported now; the actors' tables as of supervision's last
        read (every ``stats_interval``; absent when that is 0)."""
        sending, recving = self.pending()
        gauges = {
            "healthy": int(self.healthy),
            "pushes_in_flight": sending,
            "recvs_awaiting": recving,
            "push_blocks_held": len(self.ctx.unreleased),
        }
        tables = self.runtime.tables
        writer, reaper = tables.get("writer", {}), tables.get("reaper", {})
        for name, table, key in (
            ("writes_in_flight", writer, "in_flight"),
            ("tombstones", writer, "tombstones"),
            ("recv_quarantined", reaper, "recv_quarantined"),
        ):
            if key in table:
                gauges[name] = table[key]
        return gauges

    def shutdown(self, timeout: float = 10.0) -> FinishedReport:
        """Stop the rank: in-flight WRITEs settle or are cancelled within ``timeout``.

        Returns what finished meanwhile, including every request failed by the shutdown.
        """
        self.runtime.stop(timeout=timeout)
        with self._lock:
            sending, recving = set(self._sending), set(self._recving)
        report = self.ctx.outbox.drain()
        held = self.ctx.unreleased  # a WRITE may still read these blocks: never handed back
        for rid in sending - report.finished_sending - held:
            self.ctx.outbox.sent(rid, ok=False, reason="shut down")
        for rid in recving - report.finished_recving - set(report.failed_recving):
            self.ctx.outbox.recv_failed(rid, "shut down")
        rest = self.ctx.outbox.drain()
        with self._lock:
            self._sending.clear()
            self._recving.clear()
        self._handed_at.clear()
        return FinishedReport(
            report.finished_sending | rest.finished_sending,
            report.finished_recving | rest.finished_recving,
            {**report.failed_recving, **rest.failed_recving},
            {**report.failed_sending, **rest.failed_sending},
            {**report.ended_at, **rest.ended_at},
        )
