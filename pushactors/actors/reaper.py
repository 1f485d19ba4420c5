"""The lease-reaper: keeps time for one rank, on its own timer (docs/protocol.md,
'Generations and deadlines').

P side: leases on finished blocks, armed here before the blocks reach the matcher (so a
success can never clear a lease that is not armed yet), extended by heartbeats, reaped by
deadline order (heartbeats break insertion order).

D side: the registration watchdog and the completion ledger — D's request registry. A D
request settles when every P rank it registered with has answered (completion or push
failure) or can no longer answer; only then are its blocks reported. Answers count only from
the P ranks the request expects (the writer names the verified rank of each sender), once
each. A completion that lands its request on its own may be reported by the writer instead
(core/claims.py): the registry is used only under the claims' lock, the writer's takes absorbed
first. An aborted request's blocks stay quarantined while a WRITE may still land in them; a WRITE
that P reports it could not cancel keeps them past the quarantine until it settles or P is gone.
Heartbeats for awaited requests go out every ``lease/6``. An aborted request gets none, so
while a P rank owes one its final answer, that rank's side channel is probed about once a second
(the handshake actor judges the answer): a P that died before answering frees the blocks within
seconds instead of the whole quarantine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from ..core.ledger import DRegistry, DResult, FreeSlot, SendAbort, SendRegistration
from ..core.registry import DeadlineHeap
from ..protocol import (
    Abort,
    AbortRecv,
    ArmLease,
    ClearLease,
    EvictIdleEngines,
    ExpireLease,
    ExtendLeases,
    ForgetScatter,
    PeerDead,
    PeerGone,
    PrepareScatter,
    RecvNotified,
    RecvUndelivered,
    Scatter,
    SendHeartbeats,
    WatchRecv,
)
from ..protocol import SendAbort as SendAbortMsg
from ..protocol import SendRegistration as SendRegistrationMsg
from ..protocol.mailbox import ProbePeer
from .base import Note, PushActor, RankContext, handles

R = TypeVar("R")


class Reaper(PushActor):
    actor_name = "reaper"
    hot_path = True
    # Leases extended per mailbox message; the rest is told back to this mailbox, so a
    # heartbeat naming many live requests never holds up an ArmLease, a ClearLease or D's ledger.
    extend_slice: ClassVar[int] = 1024
    # D: the most seconds between two probes of a P rank owing an aborted request its answer
    # (``heartbeat_every`` when shorter). With the probe's own timeout and one more round for a
    # P still going down, D frees a dead P's blocks within about three of these.
    probe_every: ClassVar[float] = 1.0
    # A P rank NIXL has just reported gone is asked about by the writer's own death check (at
    # once, then 0.25, 0.5, 1 s apart): the probe joins in only this long after.
    probe_after_gone: ClassVar[float] = 2.0

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self._leases: dict[str, int] = {}  # P id -> serial of the leased incarnation
        self._lease_deadlines: DeadlineHeap[str] = DeadlineHeap()
        # D's request registry
        self._recvs = DRegistry(
            quarantine=ctx.config.abort_quarantine,
            pinned_limit=ctx.config.pinned_write_limit,
            reuse_wait=ctx.config.transfer_id_reuse_wait,
        )
        ctx.claims.attach(self._recvs)
        self._next_heartbeat = 0.0
        self._next_engine_sweep = 0.0
        self._probe_period = min(self.probe_every, ctx.config.heartbeat_every)
        self._next_probe = 0.0
        self._released: list[tuple[str, int]] = []  # cleared leases the writer hears of

    def on_start(self) -> None:
        now = self.ctx.clock()
        self._next_heartbeat = now + self.config.heartbeat_every
        self._next_engine_sweep = now + min(self.config.engine_ttl, 60.0)
        self._rearm(now)

    def sizes(self) -> dict[str, int]:
        return {
            "leases": len(self._leases),
            "lease_heap": self._lease_deadlines.heap_size(),
            **self._recvs.sizes(),
            # Aborted or failed, blocks held until no WRITE can land in them (an operator's gauge).
            "recv_quarantined": sum(1 for ledger in self._recvs.ledgers.values() if ledger.aborted),
        }

    def lease_deadline(self, request_id: str) -> float | None:
        """When P's lease on ``request_id`` expires (this rank's clock), None if not leased.
        Read on the actor's thread, or before it starts."""
        return self._lease_deadlines.get(request_id)

    # --- P leases ----------------------------------------------------------------------------
    @handles(ArmLease)
    def _arm(self, msg: ArmLease, note: Note) -> None:
        self._leases[msg.request_id] = msg.serial
        self._lease_deadlines.set(msg.request_id, msg.deadline)
        self._rearm(self.ctx.clock())
        note("lease.armed", expires_in=round(msg.deadline - self.ctx.clock(), 3))

    @handles(ClearLease)
    def _clear(self, msg: ClearLease, note: Note) -> None:
        serial = self._leases.get(msg.request_id)
        known = serial is not None and (not msg.serial or serial == msg.serial)
        if known:
            del self._leases[msg.request_id]
            self._lease_deadlines.discard(msg.request_id)
        note("lease.cleared", known=known)
        if msg.serial:
            self._released.append((msg.request_id, msg.serial))

    def after_message(self) -> None:
        self.tell_released(self._released, "reaper")

    @handles(ExtendLeases)
    def _extend(self, msg: ExtendLeases, note: Note) -> None:
        # Every slice extends to the target of the first: never further than the heartbeat asked.
        target = msg.target if msg.target is not None else self.ctx.clock() + self.config.lease_duration * 2 / 3
        ids = msg.request_ids
        start = max(0, msg.offset)
        end = min(len(ids), start + self.extend_slice)
        rest = len(ids) - end
        if rest > 0:
            self.ctx.metrics.incr("reaper.extend_requeued")
            self.requeue(ExtendLeases(request_ids=ids, offset=end, target=target))
        extended = 0
        for rid in ids[start:end]:
            old = self._lease_deadlines.get(rid)
            if old is None or old >= target:
                continue
            self._lease_deadlines.set(rid, target)
            extended += 1
        if rest > 0 or start:
            note.fields.update(offset=start, rest=rest)
        note("lease.extended", extended=extended, asked=end - start)

    # --- D ledger ----------------------------------------------------------------------------
    def _decide(self, decide: Callable[[DRegistry], R], *, applies: str | None = None) -> R:
        """Use D's registry, held against the writer's takes; the completions it took since are
        counted first (their requests reported by the writer, their other actions done here).
        ``applies``: the decision applies the engine's announced message about that request
        (core/claims.py), marked applied in the same hold."""
        absorbed: list[tuple[str, DResult]] = []
        try:
            with self.ctx.claims.owned(self.ctx.clock(), applies=applies) as absorbed:
                result = decide(self._recvs)
        finally:
            # Even if the decision raised: the takes it absorbed are out of the claims now.
            for rid, taken in absorbed:
                self._apply(taken, None, reported=rid)
        return result

    def _apply(self, result: DResult, note: Note | None, reported: str | None = None) -> None:
        """Carry out what D's registry decided, and say it as the message's event. ``reported``:
        a request the writer reported received already (its take, absorbed)."""
        for counter in result.counters:
            self.ctx.metrics.incr(counter)
        for action in result.actions:
            if isinstance(action, SendRegistration):
                reg = action.registration
                self.ctx.peers.to_writer(SendRegistrationMsg(registration=reg))
                if reg.staging_slot is not None:
                    # The push takes a prefill to come: make its scatter ready meanwhile.
                    self.ctx.peers.to_stager(PrepareScatter(request_id=reg.request_id, registration=reg))
            elif isinstance(action, SendAbort):
                reg = action.ledger.watch.registration
                self.ctx.peers.to_writer(
                    SendAbortMsg(
                        abort=Abort(
                            request_id=reg.request_id,
                            transfer_id=reg.transfer_id,
                            remote_request_id=reg.remote_request_id,
                            decode_tp_rank=reg.decode_tp_rank,
                            reason=action.reason,
                            generation=reg.generation,
                        ),
                        peers=action.ledger.watch.peers,
                    )
                )
            elif isinstance(action, FreeSlot):
                self._free_slot(action.registration)
            elif action.reason is not None:
                self._free_slot(action.registration)
                if action.request_id == reported:
                    # Cannot happen (a take is absorbed before any other change): say so loudly.
                    self.ctx.metrics.incr("recv.taken_conflict")
                    self.log.error("recv.taken_conflict", request_id=action.request_id, reason=action.reason)
                self.ctx.outbox.recv_failed(action.request_id, action.reason)
                self.ctx.metrics.incr("recv.failed")
                self.log.info("recv.failed", request_id=action.request_id, reason=action.reason)
            elif action.registration is not None and action.registration.staging_slot is not None:
                # Staged: the KV is in the slot; the stager copies it into the blocks and
                # only then reports the request.
                self.ctx.peers.to_stager(
                    Scatter(request_id=action.request_id, registration=action.registration, nbytes=action.nbytes)
                )
            else:
                by = "writer" if action.request_id == reported else "reaper"
                if by == "reaper":
                    self.ctx.received(action.request_id)
                self.ctx.metrics.incr("recv.finished")
                self.ctx.metrics.incr("bytes.received", action.nbytes)
                self.log.debug("recv.finished", request_id=action.request_id, by=by)
        if note is not None:
            note(result.event, level=result.level, **result.fields)
        self._rearm(self.ctx.clock())

    def _free_slot(self, registration: Any) -> None:
        """A failed request's staging slot goes back (no WRITE can land in it any more: the
        request is reported only once every P rank answered or can no longer write): the
        stager frees it, the only thread that frees D's slots, and drops the scatter made
        ready for it."""
        slot = getattr(registration, "staging_slot", None)
        if slot is not None and self.ctx.staging is not None:
            self.ctx.peers.to_stager(ForgetScatter(request_id=registration.request_id, registration=registration))

    @handles(WatchRecv)
    def _watch(self, msg: WatchRecv, note: Note) -> None:
        # Announced by the engine (core/claims.py): applied in the registry's hold, first thing.
        result = self._decide(lambda recvs: recvs.watch(msg, self.ctx.clock()), applies=msg.request_id)
        if msg.registration.transfer_id is not None:
            note.fields["transfer_id"] = msg.registration.transfer_id
        self._apply(result, note)

    @handles(RecvNotified)
    def _notified(self, msg: RecvNotified, note: Note) -> None:
        note.fields["sender"] = msg.sender
        if msg.taken:
            # The writer took it and reported the request: absorbed on this or an earlier use
            # of the registry (whichever came first), nothing left to decide.
            self._decide(lambda recvs: None)
            note("recv.notified", ok=True, taken=True)
            return
        result = self._decide(
            lambda recvs: recvs.notified(
                msg.request_id,
                ok=msg.ok,
                peer=msg.peer,
                final=msg.final,
                reason=msg.reason,
                now=self.ctx.clock(),
                generation=msg.generation,
            )
        )
        self._apply(result, note)

    @handles(RecvUndelivered)
    def _undelivered(self, msg: RecvUndelivered, note: Note) -> None:
        self._apply(self._decide(lambda recvs: recvs.undelivered(msg.request_id, msg.count, msg.reason)), note)

    @handles(PeerGone)
    def _peer_gone(self, msg: PeerGone, note: Note) -> None:
        res = self._decide(
            lambda recvs: recvs.peer_gone(msg.peer, msg.agent, msg.reason, self.ctx.clock(), delivered=msg.delivered)
        )
        self._apply(res, note)

    @handles(PeerDead)
    def _peer_dead(self, msg: PeerDead, note: Note) -> None:
        self._apply(self._decide(lambda recvs: recvs.peer_dead(msg.peer, msg.agent, msg.reason)), note)

    @handles(AbortRecv)
    def _abort(self, msg: AbortRecv, note: Note) -> None:
        # Announced by the engine (core/claims.py): applied in the registry's hold, first thing.
        result = self._decide(
            lambda recvs: recvs.abort(msg.request_id, "aborted by engine", self.ctx.clock()), applies=msg.request_id
        )
        self._apply(result, note)

    # --- time ----------------------------------------------------------------------------------
    def on_tick(self, now: float) -> None:
        now = self.ctx.clock()  # deadlines are kept on the rank's clock
        for rid in list(self._lease_deadlines.due(now)):
            serial = self._leases.pop(rid, None)
            if serial is None:
                continue
            self.ctx.metrics.incr("lease.expired")
            self.log.info("lease.expired", request_id=rid)
            self.ctx.peers.to_writer(ExpireLease(request_id=rid, serial=serial))
        result = self._decide(lambda recvs: recvs.due(now))
        for rid in result.held:
            self.log.warning("recv.quarantine_held", request_id=rid)
        for rid in result.quarantine_ended:
            self.log.warning("recv.quarantine_ended", request_id=rid)
        for rid in result.timed_out:
            self.log.warning("recv.timed_out", request_id=rid)
        for rid in result.pin_limit_passed:
            self.log.warning("recv.pinned_limit_passed", request_id=rid, limit_s=self.config.pinned_write_limit)
        if result.actions or result.counters:
            self._apply(result, None)
        if now >= self._next_heartbeat:
            self._send_heartbeats()
            self._next_heartbeat = now + self.config.heartbeat_every
        if now >= self._next_probe:
            self._probe_owing(now)
            self._next_probe = now + self._probe_period
        if now >= self._next_engine_sweep:
            self.ctx.peers.to_writer(EvictIdleEngines(idle_for=self.config.engine_ttl))
            self._next_engine_sweep = now + min(self.config.engine_ttl, 60.0)
        self._rearm(now)

    def _send_heartbeats(self) -> None:
        for (engine, host, port), (ids, peers) in self._decide(DRegistry.heartbeat_groups).items():
            self.ctx.peers.to_writer(
                SendHeartbeats(engine_id=engine, host=host, port=port, peers=peers, ids=tuple(ids))
            )

    def _probe_owing(self, now: float) -> None:
        """Ask the handshake actor about every P rank that owes an aborted request its final
        answer since the last round at least (one that answers at once is never asked)."""
        grace = self._probe_period / 2
        after_gone = self.probe_after_gone
        peers = self._decide(lambda recvs: recvs.probe_due(now, grace=grace, after_gone=after_gone))
        for peer in peers:
            self.ctx.peers.to_handshake(ProbePeer(peer=peer))
        if peers:
            self.ctx.metrics.incr("peer.probe_asked", len(peers))

    def _rearm(self, now: float) -> None:
        nxt = min(self._next_heartbeat, self._next_engine_sweep)
        if self._recvs.ledgers:
            nxt = min(nxt, self._next_probe)  # a sweep finds no owing rank without a ledger
        for heap in (self._lease_deadlines, self._recvs.deadlines):
            due = heap.next_deadline()
            if due is not None:
                nxt = min(nxt, due)
        self.arm_tick(max(0.0, nxt - now))

    # --- containment ---------------------------------------------------------------------------
    def on_handler_error(self, message: Any, exc: Exception) -> None:
        """Fail the request the message was about, through its ordinary failure path."""
        why = f"reaper error: {exc!r}"
        if isinstance(message, ArmLease):
            # The writer ends it: lease dropped, blocks reported once nothing is in flight.
            self.ctx.peers.to_writer(
                ExpireLease(request_id=message.request_id, reason=f"P {why}", failed=True, serial=message.serial),
            )
            return
        rid = getattr(message, "request_id", None)
        if not isinstance(rid, str):
            return
        if self._decide(lambda recvs: recvs.knows(rid)):
            self._apply(self._decide(lambda recvs: recvs.fail(rid, f"D {why}", self.ctx.clock())), None)
        elif isinstance(message, WatchRecv):
            self._free_slot(message.registration)
            self.ctx.outbox.recv_failed(rid, f"D {why}")  # nothing was sent for it
