"""The matcher: pairs D's registrations with P's finished blocks, in either order
(docs/protocol.md, 'Matching').

A thin actor over :class:`~pushactors.core.registry.PRegistry`, which holds every rule: key order
(transfer id, P's exact id, D's exact id, a unique base id), ambiguity (fail every request
involved, never guess), re-registrations, exact tombstones and aborts. This module checks that a
registration is meant for this rank, feeds the registry, and carries out what it asks: post a
WRITE, refuse a registration (push failure to D), fail a P request, cancel or answer.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any, ClassVar

from ..core.blocks import LayoutError, PairedLayout, PlanError, WritePlan
from ..core.registry import (
    Action,
    CancelServed,
    FailEntry,
    PendingRegistration,
    Post,
    PRegistry,
    Refuse,
    Result,
)
from ..core.registry import AnswerAbort as AnswerAbortAction
from ..core.topology import TopologyError, write_targets
from ..protocol import (
    AbortArrived,
    AnswerAbort,
    BlockGroups,
    BlocksFinished,
    CancelPush,
    ExpectTraffic,
    ExpireLease,
    ExtendLeases,
    Forget,
    HeartbeatArrived,
    MalformedMessage,
    PostPush,
    RefuseRegistration,
    Registration,
    RegistrationArrived,
    decode_registration,
)
from .base import Note, PushActor, RankContext, handles

IDLE_TICK = 1.0  # seconds between an idle matcher's ticks


class Matcher(PushActor):
    actor_name = "matcher"
    hot_path = True
    flush_each = True  # a matched push goes to the writer at once, not after the batch
    # Heartbeat ids resolved per mailbox message; the rest is told back to this mailbox, so a
    # heartbeat naming 100k ids (a noisy D) delays an unrelated registration by one slice.
    heartbeat_slice: ClassVar[int] = 1024

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.registry = PRegistry(
            lease_duration=cfg.lease_duration,
            tombstone_ttl=cfg.tombstone_ttl,
            orphan_ttl=cfg.orphan_registration_ttl,
            require_transfer_id=cfg.require_transfer_id,
            tombstone_keep=cfg.tombstone_keep,
        )
        self._released: list[tuple[str, int]] = []  # forgotten P requests the writer hears of

        # The writer's pairing per verified D rank (sender, rank, TP size) and its id, the latest
        # one each: a matched WRITE is planned here on it, so the writer only posts. Bounded:
        # senders are agents the writer loaded (at most max_remote_agents at a time), oldest
        # dropped first.
        self._pairings: OrderedDict[tuple[str, int, int], tuple[PairedLayout, int]] = OrderedDict()
        self._max_pairings = 4 * cfg.max_remote_agents

    def on_start(self) -> None:
        self.arm_tick(self.config.reaper_tick)

    def sizes(self) -> dict[str, int]:
        return {**self.registry.sizes(), "promises": len(self.ctx.promises)}

    def index_shape(self) -> dict[str, tuple[int, int]]:
        return self.registry.index_shape()

    # --- carrying out the registry's verdicts ----------------------------------------------------
    def _apply(self, result: Result, note: Note) -> None:
        for counter in result.counters:
            self.ctx.metrics.incr(counter)
        for action in result.actions:
            self._do(action)
        note(result.event, level=result.level, **result.fields)

    def _do(self, action: Action) -> None:
        peers = self.ctx.peers
        if isinstance(action, Post):
            reg = action.registration
            targets = write_targets(self.ctx.tp_rank, self.ctx.tp_size, reg.decode_tp_size)
            self.ctx.metrics.incr("matcher.posted")
            paired, pairing_id = self._pairings.get((action.sender, reg.decode_tp_rank, reg.decode_tp_size), (None, 0))
            peers.to_writer(
                PostPush(
                    request_id=action.p_request_id,
                    block_ids=action.block_ids,
                    registration=reg,
                    expected_targets=len(targets),
                    sender=action.sender,
                    serial=action.serial,
                    fresh_at=action.fresh_at,
                    deadline=action.deadline,
                    plan=self._plan(paired, action.block_ids, reg),
                    pairing_id=pairing_id,
                ),
            )
        elif isinstance(action, Refuse):
            self.ctx.metrics.incr("matcher.refused")
            peers.to_writer(RefuseRegistration(registration=action.registration, reason=action.reason))
        elif isinstance(action, FailEntry):
            self.ctx.metrics.incr("matcher.failed_entry")
            peers.to_writer(
                ExpireLease(request_id=action.p_request_id, reason=action.reason, failed=True, serial=action.serial),
            )
        elif isinstance(action, CancelServed):
            peers.to_writer(
                CancelPush(
                    request_id=action.p_request_id,
                    d_request_id=action.d_request_id,
                    decode_tp_rank=action.decode_tp_rank,
                ),
            )
        elif isinstance(action, AnswerAbortAction):
            peers.to_writer(
                AnswerAbort(
                    d_request_id=action.d_request_id,
                    sender=action.sender,
                    reason=action.reason,
                    generation=action.generation,
                )
            )

    # --- P: finished blocks arrive ------------------------------------------------------------
    @handles(BlocksFinished)
    def _blocks_finished(self, msg: BlocksFinished, note: Note) -> None:
        if msg.transfer_id is not None:
            note.fields["transfer_id"] = msg.transfer_id
        now = time.monotonic()
        result = self.registry.add_finished(msg.request_id, msg.block_ids, msg.transfer_id, now, msg.serial)
        self._apply(result, note)
        if not any(isinstance(a, Post) for a in result.actions):
            # The blocks wait for their registration, on its way (push mode sends both legs at
            # once): the writer polls busy to pick it up. A push posted lingers on its own, so
            # the matched path wakes the writer only once.
            self.ctx.peers.to_writer(ExpectTraffic())

    # --- D's registration arrives -------------------------------------------------------------
    @handles(RegistrationArrived)
    def _registration_arrived(self, msg: RegistrationArrived, note: Note) -> None:
        reg = msg.registration
        if reg is None:
            try:
                reg = decode_registration(msg.payload)
            except MalformedMessage as exc:
                self.ctx.metrics.incr("notif.malformed.push_reg")
                self.ctx.metrics.incr("notif.malformed")
                note("reg.dropped", level="warning", sender=msg.sender, reason=exc.reason[:200])
                return
            if msg.header is not None and reg.header() != msg.header:
                self.ctx.metrics.incr("notif.malformed")
                note("reg.dropped", level="warning", sender=msg.sender, reason="header does not match the body")
                return
        note.fields["d_rank"] = reg.decode_tp_rank
        if reg.transfer_id is not None:
            note.fields["transfer_id"] = reg.transfer_id
        over = _over_capacity(reg, msg.capacity)
        if over:
            # A verified D rank names blocks it does not have: refuse (D fails the request);
            # P never plans a WRITE outside D's memory.
            self.ctx.metrics.incr("reg.over_capacity")
            self._refuse_now(reg, over, note)
            return
        if self.config.require_transfer_id and reg.transfer_id is None:
            self._refuse_now(reg, "transfer_id required", note)
            return
        problem = self._misrouted(reg)
        if problem:
            self._refuse_now(reg, problem, note)
            return
        self._remember_pairing(msg, reg)
        deadline = math.inf
        if reg.deadline and msg.clock is not None:
            offset, error = msg.clock
            deadline = reg.deadline - offset - error  # D's clock, on ours, the error taken off
        self._apply(self.registry.add_registration(reg, msg.sender, time.monotonic(), deadline), note)
        if self.registry.pending:
            self.arm_tick(self.config.reaper_tick)  # it may be orphaned: keep time for it

    def _plan(self, paired: PairedLayout | None, block_ids: BlockGroups, reg: Registration) -> WritePlan | None:
        """The WRITE of ``block_ids`` into ``reg``'s blocks, planned on the writer's pairing;
        None when there is none (or the push is staged): the writer plans it, and refuses one
        that cannot be planned with the reason."""
        if paired is None or reg.staging_slot is not None:
            return None
        try:
            cfg = self.config
            plan = paired.plan(
                block_ids, reg.block_groups, reg.skip_blocks, merge=cfg.post_runs, min_pieces=cfg.post_runs_min_pieces
            )
        except (LayoutError, PlanError, TopologyError, ValueError):
            return None
        if plan.runs is None and plan.num_descs:
            plan.local_idx  # noqa: B018 -- the index arrays are built here, off the writer
        return plan

    def _remember_pairing(self, msg: RegistrationArrived, reg: Registration) -> None:
        if not isinstance(msg.pairing, PairedLayout):
            return
        key = (msg.sender, reg.decode_tp_rank, reg.decode_tp_size)
        self._pairings[key] = (msg.pairing, msg.pairing_id)
        self._pairings.move_to_end(key)
        while len(self._pairings) > self._max_pairings:
            self._pairings.popitem(last=False)

    def _refuse_now(self, reg: Registration, reason: str, note: Note) -> None:
        self.ctx.metrics.incr("matcher.refused_now")
        self._do(Refuse(reg, reason))
        note("reg.refused", level="warning", reason=reason)

    def _misrouted(self, reg: Registration) -> str:
        ctx = self.ctx
        if reg.remote_engine_id != ctx.engine_id:
            return f"registration names engine {reg.remote_engine_id!r}, this is {ctx.engine_id!r}"
        if reg.remote_tp_size != ctx.tp_size or reg.remote_pp_size != ctx.pp_size:
            return "registration names a different P parallel layout"
        if reg.decode_pp_size != 1:
            return f"D is pipeline-parallel (PP {reg.decode_pp_size}): PP on the decode side is not supported"
        try:
            targets = write_targets(ctx.tp_rank, ctx.tp_size, reg.decode_tp_size)
        except TopologyError as exc:
            return str(exc)
        if reg.decode_tp_rank not in targets:
            return f"D rank {reg.decode_tp_rank} is not written by P rank {ctx.tp_rank}"
        return ""

    # --- P is done with a request --------------------------------------------------------------
    @handles(Forget)
    def _forget(self, msg: Forget, note: Note) -> None:
        entry = self.registry.entries.get(msg.request_id)
        if entry is not None and (not msg.serial or entry.serial == msg.serial):
            self.ctx.promises.forget((msg.request_id, rank, entry.generations.get(rank, 0)) for rank in entry.senders)
        result = self.registry.forget(
            msg.request_id,
            msg.outcome,
            transfer_id=msg.transfer_id,
            serial=msg.serial,
            now=time.monotonic(),
            pinned=msg.pinned,
        )
        self._apply(result, note)
        if msg.serial:
            self._released.append((msg.request_id, msg.serial))

    def after_message(self) -> None:
        self.tell_released(self._released, "matcher")
        # A hook's lending polls once while P holds finished blocks: a registration that comes
        # after them is read off NIXL then, not at the next switch interval (core/handoff.py).
        self.ctx.handoff.held = len(self.registry.entries)

    # --- heartbeats and aborts from D ----------------------------------------------------------
    @handles(HeartbeatArrived)
    def _heartbeat(self, msg: HeartbeatArrived, note: Note) -> None:
        # As of when the heartbeat arrived (its mailbox stamp), never later: a slice resolved
        # after other messages ran must not make a registration look fresher than D made it.
        at = msg.at if msg.at is not None else self.actor_inbox.last_put_at
        start = max(0, msg.offset)
        end = min(len(msg.ids), start + self.heartbeat_slice)
        rest = len(msg.ids) - end
        if rest > 0:
            # First, so the rest is resolved even if this slice fails.
            self.ctx.metrics.incr("matcher.heartbeat_requeued")
            self.requeue(HeartbeatArrived(ids=msg.ids, sender=msg.sender, offset=end, at=at, deadline=msg.deadline))
        extend, refreshed, unknown = self.registry.heartbeat(msg.ids[start:end], msg.sender, at, msg.deadline)
        if msg.deadline is not None:
            for pid in extend:  # served registrations: the writer reads D's newest promise
                for rank, gen in self.registry.served_to(pid, msg.sender):
                    self.ctx.promises.renew((pid, rank, gen), msg.deadline)
        if unknown:
            self.ctx.metrics.incr("matcher.heartbeat_unknown", unknown)
        if extend:
            self.ctx.peers.to_reaper(ExtendLeases(request_ids=tuple(extend)))
        if rest > 0 or start:
            note.fields.update(offset=start, rest=rest)
        note("heartbeat.resolved", ids=end - start, extended=len(extend), refreshed=refreshed, unknown=unknown)

    @handles(AbortArrived)
    def _abort(self, msg: AbortArrived, note: Note) -> None:
        self._apply(self.registry.abort(msg.abort, msg.sender, time.monotonic()), note)

    # --- time ----------------------------------------------------------------------------------
    def on_tick(self, now: float) -> None:
        self.registry.prune(now, self._orphan)
        self.arm_tick(self._tick_every())

    def _tick_every(self) -> float:
        # Orphaned registrations are dropped on time; with none pending only tombstones age
        # (minutes), so an idle matcher wakes once a second, not twenty times.
        return self.config.reaper_tick if self.registry.pending else max(self.config.reaper_tick, IDLE_TICK)

    def _orphan(self, pending: PendingRegistration) -> None:
        # No P request claimed it in time: say so, so D fails now instead of at its watchdog.
        self.ctx.metrics.incr("matcher.orphan_registration_dropped")
        self.log.info("reg.orphan_dropped", request_id=pending.registration.request_id)
        self._do(Refuse(pending.registration, "no matching request on P before the orphan timeout"))

    # --- containment ---------------------------------------------------------------------------
    def on_handler_error(self, message: Any, exc: Exception) -> None:
        """Fail the request the message was about, through its ordinary failure path."""
        if isinstance(message, RegistrationArrived) and message.registration is not None:
            self._do(Refuse(message.registration, f"P matcher error: {exc!r}"))
        elif isinstance(message, RegistrationArrived) and message.payload:
            try:
                self._do(Refuse(decode_registration(message.payload), f"P matcher error: {exc!r}"))
            except MalformedMessage:
                pass
        elif isinstance(message, BlocksFinished):
            # The writer ends it (lease dropped, blocks freed once nothing is in flight) and
            # tells this actor to forget it.
            self._do(FailEntry(message.request_id, f"P matcher error: {exc!r}", message.serial))


def _over_capacity(reg: Registration, capacity: tuple[int, ...]) -> str:
    """Why ``reg`` names blocks D does not have (per what D advertised), or ""."""
    if not capacity:
        return ""
    for group, ids in enumerate(reg.block_groups):
        if not ids:
            continue
        if group >= len(capacity):
            return f"registration names KV group {group}; D advertises {len(capacity)} group(s)"
        top = max(ids)
        if top >= capacity[group]:
            return f"block id {top} is beyond D's capacity of {capacity[group]} blocks (group {group})"
    return ""
