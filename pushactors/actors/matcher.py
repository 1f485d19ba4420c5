"""The matcher: pairs D's registrations with P's finished blocks, in either order (SPEC §3).

Key order: ``transfer_id`` when both sides carry it; else exact request id; else base id.
Every lookup is a dict access. An entry is stored under each of its keys and dropped from all
of them together. Once P is done with a request its keys are tombstoned, so a late or replayed
registration is answered (push failure) instead of waiting for a WRITE that will never come.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..ids import base_request_id
from ..protocol import (
    AbortArrived,
    AnswerAbort,
    BlockGroups,
    BlocksFinished,
    CancelPush,
    ExpireLease,
    ExtendLeases,
    Forget,
    HeartbeatArrived,
    PostPush,
    RefuseRegistration,
    Registration,
    RegistrationArrived,
)
from ..topology import TopologyError, write_targets
from .base import Note, PushActor, RankContext, handles


@dataclass
class FinishedEntry:
    """P's finished blocks for one request, and the D ranks they were handed to."""

    request_id: str
    block_ids: BlockGroups
    transfer_id: str | None
    base: str
    served: dict[int, str] = field(default_factory=dict)  # D rank -> D request id
    senders: dict[int, str] = field(default_factory=dict)  # D rank -> agent that registered


@dataclass
class PendingRegistration:
    registration: Registration
    sender: str
    base: str
    arrived_at: float
    refreshed_at: float = 0.0  # arrival or D's last heartbeat for it (D stops when it aborts)

    @property
    def slot(self) -> tuple[str, int]:
        return (self.registration.request_id, self.registration.decode_tp_rank)


@dataclass
class Tombstone:
    outcome: str
    at: float
    served: frozenset[str] = frozenset()
    request_id: str = ""
    transfer_id: str | None = None  # a tombstone never speaks for another transfer


def _compatible(a: str | None, b: str | None) -> bool:
    """Transfer ids decide only when both sides carry one."""
    return a is None or b is None or a == b


class Matcher(PushActor):
    actor_name = "matcher"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        # P side: finished entries under transfer id, exact id and base id.
        self._by_tid: dict[str, FinishedEntry] = {}
        self._by_id: dict[str, FinishedEntry] = {}
        self._by_base: dict[str, dict[str, FinishedEntry]] = {}
        # D side: registrations waiting for their blocks, keyed by (D id, D rank).
        self._regs_by_tid: dict[str, dict[tuple[str, int], PendingRegistration]] = {}
        self._regs_by_id: dict[str, dict[tuple[str, int], PendingRegistration]] = {}
        self._regs_by_base: dict[str, dict[tuple[str, int], PendingRegistration]] = {}
        self._regs_by_age: dict[tuple[str, int], PendingRegistration] = {}  # insertion order
        self._tombstones: dict[str, Tombstone] = {}  # "tid:…", "id:…", "base:…"

    def on_start(self) -> None:
        self.arm_tick(self.config.reaper_tick)

    # --- sizes, for tests and stats ---------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        return {
            "finished": len(self._by_id),
            "by_tid": len(self._by_tid),
            "by_base": sum(len(v) for v in self._by_base.values()),
            "pending_registrations": len(self._regs_by_age),
            "regs_by_id": sum(len(v) for v in self._regs_by_id.values()),
            "regs_by_tid": sum(len(v) for v in self._regs_by_tid.values()),
            "regs_by_base": sum(len(v) for v in self._regs_by_base.values()),
            "tombstones": len(self._tombstones),
        }

    # --- P: finished blocks arrive ------------------------------------------------------------
    @handles(BlocksFinished)
    def _blocks_finished(self, msg: BlocksFinished, note: Note) -> None:
        if msg.request_id in self._by_id:
            note("blocks.duplicate", level="warning")
            self.ctx.metrics.incr("matcher.duplicate_blocks")
            return
        tomb = self._tomb_for_entry(msg.request_id, msg.transfer_id)
        if tomb is not None and tomb.outcome == "aborted":
            # D gave up before P finished: nothing will be written, free P's blocks now.
            note("blocks.aborted_by_decode", level="info")
            self.ctx.peers.tell("writer", ExpireLease(request_id=msg.request_id, reason="aborted by decode"))
            return
        # A new incarnation under these keys: old tombstones no longer speak for it.
        for key in self._entry_keys(msg.request_id, msg.transfer_id):
            self._tombstones.pop(key, None)
        entry = FinishedEntry(msg.request_id, msg.block_ids, msg.transfer_id, base_request_id(msg.request_id))
        self._by_id[entry.request_id] = entry
        if entry.transfer_id is not None:
            self._by_tid[entry.transfer_id] = entry
        self._by_base.setdefault(entry.base, {})[entry.request_id] = entry
        matched = [p for p in self._pending_for(entry) if p.registration.decode_tp_rank not in entry.served]
        if not matched:
            note("blocks.stored", blocks=sum(len(g) for g in msg.block_ids))
            return
        for pending in matched:
            if pending.registration.decode_tp_rank in entry.served:
                # Two D requests for one D rank: the first wins, the other is refused.
                self._drop_pending(pending)
                self._refuse(pending.registration, "another registration was served for this request")
                continue
            self._drop_pending(pending)
            if time.monotonic() - pending.refreshed_at > self.config.lease_duration * 2 / 3:
                # D stopped heartbeating it: D may have aborted (its PUSH_ABORT lost) and
                # reused the blocks after its quarantine. Never write into them.
                self.ctx.metrics.incr("matcher.stale_registration")
                self._refuse(pending.registration, "registration went stale: no heartbeat from D")
                continue
            self._post(entry, pending.registration, pending.sender)
        note("reg.matched", order="blocks_last", d_request_id=matched[0].registration.request_id)

    def _pending_for(self, entry: FinishedEntry) -> list[PendingRegistration]:
        found: dict[tuple[str, int], PendingRegistration] = {}
        if entry.transfer_id is not None:
            found.update(self._regs_by_tid.get(entry.transfer_id, {}))
        if self.config.require_transfer_id:
            return list(found.values())  # only the transfer id may pair them
        for p in self._regs_by_id.get(entry.request_id, {}).values():
            if _compatible(entry.transfer_id, p.registration.transfer_id):
                found.setdefault(p.slot, p)
        for p in self._regs_by_base.get(entry.base, {}).values():
            if _compatible(entry.transfer_id, p.registration.transfer_id):
                found.setdefault(p.slot, p)
        return list(found.values())

    # --- D's registration arrives -------------------------------------------------------------
    @handles(RegistrationArrived)
    def _registration_arrived(self, msg: RegistrationArrived, note: Note) -> None:
        reg = msg.registration
        note.fields["d_rank"] = reg.decode_tp_rank
        if self.config.require_transfer_id and reg.transfer_id is None:
            self._refuse(reg, "transfer_id required")
            note("reg.refused", level="warning", reason="transfer_id required")
            return
        problem = self._misrouted(reg)
        if problem:
            self._refuse(reg, problem)
            note("reg.refused", level="warning", reason=problem)
            return
        entry = self._entry_for(reg)
        if entry is not None:
            served = entry.served.get(reg.decode_tp_rank)
            if served == reg.request_id:
                self.ctx.metrics.incr("matcher.duplicate_registration")
                note("reg.duplicate")
                return
            if served is not None:
                self._refuse(reg, "another registration was served for this request")
                note("reg.refused", level="warning", reason="rank already served")
                return
            self._post(entry, reg, msg.sender)
            note("reg.matched", order="registration_last", p_request_id=entry.request_id)
            return
        tomb = self._tomb_for_registration(reg)
        if tomb is not None:
            if reg.request_id in tomb.served:
                self.ctx.metrics.incr("matcher.duplicate_registration")
                note("reg.duplicate", after=tomb.outcome)
                return
            self._refuse(reg, f"request already {tomb.outcome} on P")
            note("reg.refused", level="info", reason=tomb.outcome, p_request_id=tomb.request_id)
            return
        slot = (reg.request_id, reg.decode_tp_rank)
        if slot in self._regs_by_age:
            self.ctx.metrics.incr("matcher.duplicate_registration")
            note("reg.duplicate", pending=True)
            return
        now = time.monotonic()
        pending = PendingRegistration(reg, msg.sender, base_request_id(reg.request_id), now, now)
        self._regs_by_age[slot] = pending
        self._regs_by_id.setdefault(reg.request_id, {})[slot] = pending
        self._regs_by_base.setdefault(pending.base, {})[slot] = pending
        if reg.transfer_id is not None:
            self._regs_by_tid.setdefault(reg.transfer_id, {})[slot] = pending
        if reg.remote_request_id is not None and reg.remote_request_id != reg.request_id:
            self._regs_by_id.setdefault(reg.remote_request_id, {})[slot] = pending
        note("reg.stored")

    def _misrouted(self, reg: Registration) -> str:
        ctx = self.ctx
        if reg.remote_engine_id != ctx.engine_id:
            return f"registration names engine {reg.remote_engine_id!r}, this is {ctx.engine_id!r}"
        if reg.remote_tp_size != ctx.tp_size or reg.remote_pp_size != ctx.pp_size:
            return "registration names a different P parallel layout"
        try:
            targets = write_targets(ctx.tp_rank, ctx.tp_size, reg.decode_tp_size)
        except TopologyError as exc:
            return str(exc)
        if reg.decode_tp_rank not in targets:
            return f"D rank {reg.decode_tp_rank} is not written by P rank {ctx.tp_rank}"
        return ""

    def _entry_for(self, reg: Registration) -> FinishedEntry | None:
        if reg.transfer_id is not None:
            entry = self._by_tid.get(reg.transfer_id)
            if entry is not None or self.config.require_transfer_id:
                return entry
        for rid in (reg.remote_request_id, reg.request_id):
            if rid is None:
                continue
            entry = self._by_id.get(rid)
            if entry is not None and _compatible(entry.transfer_id, reg.transfer_id):
                return entry
        for entry in self._by_base.get(base_request_id(reg.request_id), {}).values():
            if _compatible(entry.transfer_id, reg.transfer_id):
                return entry
        return None

    def _post(self, entry: FinishedEntry, reg: Registration, sender: str) -> None:
        entry.served[reg.decode_tp_rank] = reg.request_id
        entry.senders[reg.decode_tp_rank] = sender
        targets = write_targets(self.ctx.tp_rank, self.ctx.tp_size, reg.decode_tp_size)
        self.ctx.metrics.incr("matcher.matched")
        self.ctx.peers.tell(
            "writer",
            PostPush(
                request_id=entry.request_id,
                block_ids=entry.block_ids,
                registration=reg,
                expected_targets=len(targets),
                sender=sender,
            ),
        )

    def _refuse(self, reg: Registration, reason: str) -> None:
        self.ctx.metrics.incr("matcher.refused")
        self.ctx.peers.tell("writer", RefuseRegistration(registration=reg, reason=reason))

    def _drop_pending(self, pending: PendingRegistration) -> None:
        reg = pending.registration
        slot = pending.slot
        self._regs_by_age.pop(slot, None)
        for index, key in (
            (self._regs_by_id, reg.request_id),
            (self._regs_by_id, reg.remote_request_id),
            (self._regs_by_base, pending.base),
            (self._regs_by_tid, reg.transfer_id),
        ):
            if key is None:
                continue
            bucket = index.get(key)
            if bucket is not None:
                bucket.pop(slot, None)
                if not bucket:
                    del index[key]

    # --- P is done with a request --------------------------------------------------------------
    @handles(Forget)
    def _forget(self, msg: Forget, note: Note) -> None:
        entry = self._by_id.pop(msg.request_id, None)
        transfer_id = None
        if entry is not None:
            transfer_id = entry.transfer_id
            if transfer_id is not None and self._by_tid.get(transfer_id) is entry:
                del self._by_tid[transfer_id]
            bucket = self._by_base.get(entry.base)
            if bucket is not None:
                bucket.pop(entry.request_id, None)
                if not bucket:
                    del self._by_base[entry.base]
        else:
            transfer_id = msg.transfer_id
        tomb = Tombstone(msg.outcome, time.monotonic(), frozenset(msg.served), msg.request_id, transfer_id)
        for key in self._entry_keys(msg.request_id, transfer_id):
            # Re-insert so the dict stays ordered by age and pruning can stop early.
            self._tombstones.pop(key, None)
            self._tombstones[key] = tomb
        refused = 0
        if entry is None:
            # P gave up before its blocks ever got here: D's waiting registrations hear it now.
            probe = FinishedEntry(msg.request_id, (), transfer_id, base_request_id(msg.request_id))
            for pending in self._pending_for(probe):
                self._drop_pending(pending)
                self._refuse(pending.registration, f"request {msg.outcome} on P")
                refused += 1
        note("request.forgotten", outcome=msg.outcome, known=entry is not None, refused=refused)

    def _entry_keys(self, request_id: str, transfer_id: str | None) -> list[str]:
        keys = [f"id:{request_id}", f"base:{base_request_id(request_id)}"]
        if transfer_id is not None:
            keys.append(f"tid:{transfer_id}")
        return keys

    def _tomb_for_entry(self, request_id: str, transfer_id: str | None) -> Tombstone | None:
        for key in self._entry_keys(request_id, transfer_id):
            tomb = self._tombstones.get(key)
            if tomb is not None and _compatible(tomb.transfer_id, transfer_id):
                return tomb
        return None

    def _tomb_for_registration(self, reg: Registration) -> Tombstone | None:
        return self._tomb_for_d(reg.request_id, reg.transfer_id, reg.remote_request_id)

    def _tomb_for_d(
        self, d_request_id: str, transfer_id: str | None, remote_request_id: str | None
    ) -> Tombstone | None:
        """The tombstone speaking for what D names: transfer id, P's id if known, D's own id and base."""
        keys = []
        if transfer_id is not None:
            keys.append(f"tid:{transfer_id}")
        if remote_request_id is not None:
            keys.append(f"id:{remote_request_id}")
        keys += [f"id:{d_request_id}", f"base:{base_request_id(d_request_id)}"]
        for key in keys:
            tomb = self._tombstones.get(key)
            if tomb is not None and _compatible(tomb.transfer_id, transfer_id):
                return tomb
        return None

    # --- heartbeats and aborts from D ----------------------------------------------------------
    def _resolve(self, key: str) -> FinishedEntry | None:
        return (
            self._by_tid.get(key)
            or self._by_id.get(key)
            or next(iter(self._by_base.get(base_request_id(key), {}).values()), None)
        )

    @handles(HeartbeatArrived)
    def _heartbeat(self, msg: HeartbeatArrived, note: Note) -> None:
        found = []
        refreshed = 0
        now = time.monotonic()
        for key in msg.ids:
            entry = self._resolve(key)
            # Only the agents that registered for a request may keep its lease alive.
            if entry is not None and msg.sender in entry.senders.values():
                found.append(entry.request_id)
            elif self._refresh_pending(key, msg.sender, now):
                refreshed += 1
        unknown = len(msg.ids) - len(found) - refreshed
        if unknown:
            self.ctx.metrics.incr("matcher.heartbeat_unknown", unknown)
        if found:
            self.ctx.peers.tell("reaper", ExtendLeases(request_ids=tuple(found)))
        note("heartbeat.resolved", ids=len(msg.ids), extended=len(found), unknown=unknown)

    def _refresh_pending(self, key: str, sender: str, now: float) -> bool:
        """D still waits for these registrations: keep them eligible for a WRITE."""
        hit = False
        base = base_request_id(key)
        for bucket in (self._regs_by_tid.get(key), self._regs_by_id.get(key), self._regs_by_base.get(base)):
            for pending in (bucket or {}).values():
                if pending.sender == sender:
                    pending.refreshed_at = now
                    hit = True
        return hit

    @handles(AbortArrived)
    def _abort(self, msg: AbortArrived, note: Note) -> None:
        abort = msg.abort
        slot = (abort.request_id, abort.decode_tp_rank)
        pending = self._regs_by_age.get(slot)
        if pending is not None and pending.sender != msg.sender:
            self.ctx.metrics.incr("matcher.abort_wrong_sender")
            note("abort.ignored", level="warning", reason="not from the agent that registered")
            return
        if pending is not None:
            # Not matched yet: drop it and confirm to D that nothing will be written.
            self._drop_pending(pending)
            self._refuse(pending.registration, "aborted by decode")
            note("abort.dropped_registration")
            return
        entry = None
        for key in (abort.transfer_id, abort.remote_request_id, abort.request_id):
            if key is not None:
                entry = self._resolve(key)
                if entry is not None:
                    break
        if entry is not None and entry.served.get(abort.decode_tp_rank) == abort.request_id:
            if entry.senders.get(abort.decode_tp_rank) != msg.sender:
                self.ctx.metrics.incr("matcher.abort_wrong_sender")
                note("abort.ignored", level="warning", reason="not from the agent that registered")
                return
            self.ctx.peers.tell(
                "writer",
                CancelPush(
                    request_id=entry.request_id,
                    d_request_id=abort.request_id,
                    decode_tp_rank=abort.decode_tp_rank,
                ),
            )
            note("abort.cancel_push", p_request_id=entry.request_id)
            return
        done = self._tomb_for_d(abort.request_id, abort.transfer_id, abort.remote_request_id)
        if done is not None and done.outcome != "aborted":
            # P is already done with it: say so, so D can stop quarantining its blocks now.
            self.ctx.peers.tell(
                "writer",
                AnswerAbort(
                    d_request_id=abort.request_id, sender=msg.sender, reason=f"request already {done.outcome} on P"
                ),
            )
            note("abort.answered", outcome=done.outcome)
            return
        # P has not finished yet (or never will): remember, so its blocks are freed on arrival.
        tomb = Tombstone("aborted", time.monotonic(), frozenset(), abort.request_id, abort.transfer_id)
        keys = [f"id:{abort.request_id}", f"base:{base_request_id(abort.request_id)}"]
        if abort.transfer_id is not None:
            keys.append(f"tid:{abort.transfer_id}")
        if abort.remote_request_id is not None:
            keys.append(f"id:{abort.remote_request_id}")
        for key in keys:
            self._tombstones.setdefault(key, tomb)
        note("abort.remembered")

    # --- time ----------------------------------------------------------------------------------
    def on_tick(self, now: float) -> None:
        ttl = self.config.orphan_registration_ttl
        while self._regs_by_age:
            pending = next(iter(self._regs_by_age.values()))
            if now - pending.arrived_at < ttl:
                break
            self._drop_pending(pending)
            self.ctx.metrics.incr("matcher.orphan_registration_dropped")
            self.log.info("reg.orphan_dropped", request_id=pending.registration.request_id)
        cutoff = now - self.config.tombstone_ttl
        while self._tombstones:
            key, tomb = next(iter(self._tombstones.items()))
            if tomb.at >= cutoff:
                break
            del self._tombstones[key]
        self.arm_tick(self.config.reaper_tick)

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        reg = getattr(message, "registration", None)
        if isinstance(reg, Registration):
            self._refuse(reg, f"P matcher error: {exc!r}")
