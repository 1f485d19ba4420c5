"""The lease-reaper: keeps time for one rank, on its own timer (SPEC §6).

P side: leases on finished blocks, armed here before the blocks reach the matcher (so a
success can never clear a lease that is not armed yet), extended by heartbeats, reaped by
deadline order (heartbeats break insertion order).

D side: the registration watchdog and the completion ledger — D's request registry. A D
request settles when every P rank it registered with has answered (completion or push
failure) or can no longer answer; only then are its blocks reported. Answers count only from
the P ranks the request expects (the writer names the verified rank of each sender), once
each. An aborted request's blocks stay quarantined while a WRITE may still land in them; a WRITE
that P reports it could not cancel keeps them past the quarantine until it settles or P is gone.
Heartbeats for awaited requests go out every ``lease/6``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol import (
    Abort,
    AbortRecv,
    ArmLease,
    BlocksFinished,
    ClearLease,
    EvictIdleEngines,
    ExpireLease,
    ExtendLeases,
    PeerGone,
    PeerKey,
    RecvNotified,
    RecvUndelivered,
    SendAbort,
    SendHeartbeats,
    SendRegistration,
    WatchRecv,
)
from ..registry import DeadlineHeap
from .base import Note, PushActor, RankContext, handles


def _rank(peer: PeerKey) -> tuple[str, str, int, int, int]:
    return (peer.engine_id, peer.host, peer.port, peer.pp_rank, peer.tp_rank)


@dataclass
class RecvLedger:
    """D: what one request waits for."""

    watch: WatchRecv
    ok: int = 0
    failed: int = 0
    undelivered: int = 0
    reason: str = ""
    aborted: bool = False
    timed_out: bool = False
    quarantine_over: bool = False
    answered: set[tuple[str, str, int, int, int]] = field(default_factory=set)  # P ranks that answered
    pinned: set[tuple[str, str, int, int, int]] = field(default_factory=set)  # WRITE may still land
    gone: set[tuple[str, str, int, int, int]] = field(default_factory=set)

    @property
    def expected(self) -> set[tuple[str, str, int, int, int]]:
        return {_rank(p) for p in self.watch.peers}

    @property
    def answers(self) -> int:
        return self.ok + self.failed + self.undelivered

    @property
    def settled(self) -> bool:
        return self.answers >= self.watch.expected

    @property
    def held(self) -> bool:
        """A P rank said its WRITE may still land here and has neither finished nor gone."""
        return bool(self.pinned - self.answered - self.gone)


class Reaper(PushActor):
    actor_name = "reaper"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self._leases: dict[str, int] = {}  # P id -> serial of the leased incarnation
        self._lease_deadlines: DeadlineHeap[str] = DeadlineHeap()
        self._recvs: dict[str, RecvLedger] = {}
        self._recv_deadlines: DeadlineHeap[str] = DeadlineHeap()
        self._by_tid: dict[str, set[str]] = {}  # transfer id -> live D ids (must be one)
        self._next_heartbeat = 0.0
        self._next_engine_sweep = 0.0

    def on_start(self) -> None:
        now = self.ctx.clock()
        self._next_heartbeat = now + self.config.heartbeat_every
        self._next_engine_sweep = now + min(self.config.engine_ttl, 60.0)
        self._rearm(now)

    def sizes(self) -> dict[str, int]:
        return {
            "leases": len(self._leases),
            "recvs": len(self._recvs),
            "lease_heap": self._lease_deadlines.heap_size(),
            "recv_tids": len(self._by_tid),
        }

    # --- P leases ----------------------------------------------------------------------------
    @handles(ArmLease)
    def _arm(self, msg: ArmLease, note: Note) -> None:
        self._leases[msg.request_id] = msg.serial
        self._lease_deadlines.set(msg.request_id, msg.deadline)
        self.ctx.peers.to_matcher(
            BlocksFinished(
                request_id=msg.request_id, block_ids=msg.block_ids, transfer_id=msg.transfer_id, serial=msg.serial
            ),
        )
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

    @handles(ExtendLeases)
    def _extend(self, msg: ExtendLeases, note: Note) -> None:
        target = self.ctx.clock() + self.config.lease_duration * 2 / 3
        extended = 0
        for rid in msg.request_ids:
            old = self._lease_deadlines.get(rid)
            if old is None or old >= target:
                continue
            self._lease_deadlines.set(rid, target)
            extended += 1
        note("lease.extended", extended=extended, asked=len(msg.request_ids))

    # --- D ledger ----------------------------------------------------------------------------
    @handles(WatchRecv)
    def _watch(self, msg: WatchRecv, note: Note) -> None:
        rid = msg.request_id
        old = self._recvs.get(rid)
        if old is not None:
            if old.watch.registration == msg.registration and old.watch.peers == msg.peers:
                self.ctx.metrics.incr("reaper.duplicate_watch")
                note("recv.duplicate", level="info")
                return
            # The engine staged this request again with other blocks while the first
            # registration is live. P may already be writing the first blocks: neither can be
            # trusted to hold the right KV. Fail the request (once) after P answered.
            self.ctx.metrics.incr("recv.restaged")
            self._fail_ledger(rid, old, "re-staged with different blocks while its push was pending")
            note("recv.restaged", level="warning")
            return
        tid = msg.registration.transfer_id
        if tid is not None and self._by_tid.get(tid):
            # Two live requests with one transfer id: P cannot tell which one its KV is for.
            reason = f"transfer id {tid!r} is used by another live request on this engine"
            for other in sorted(self._by_tid[tid]):
                self._fail_ledger(other, self._recvs[other], reason)
            self.ctx.metrics.incr("recv.ambiguous")
            self.ctx.outbox.recv_failed(rid, reason)  # never registered: its blocks are untouched
            note("recv.ambiguous", level="warning", reason=reason)
            return
        ledger = RecvLedger(msg)
        self._recvs[rid] = ledger
        if tid is not None:
            self._by_tid.setdefault(tid, set()).add(rid)
        self._recv_deadlines.set(rid, msg.deadline)
        self.ctx.peers.to_writer(SendRegistration(registration=msg.registration))
        self._rearm(self.ctx.clock())
        note("recv.watching", expected=msg.expected, p_ranks=len(msg.peers))

    @handles(RecvNotified)
    def _notified(self, msg: RecvNotified, note: Note) -> None:
        ledger = self._recvs.get(msg.request_id)
        if ledger is None:
            self.ctx.metrics.incr("reaper.notif_unknown_request")
            note("notif.ignored", level="info", reason="unknown request", ok=msg.ok)
            return
        rank = _rank(msg.peer) if msg.peer is not None else None
        if rank is None or rank not in ledger.expected:
            # Not one of the P ranks this request registered with: it cannot speak for it.
            self.ctx.metrics.incr("reaper.notif_wrong_sender")
            note(
                "notif.rejected",
                level="warning",
                reason="sender is not a P rank this request expects",
                sender=msg.sender,
                ok=msg.ok,
            )
            return
        if rank in ledger.answered:
            # A duplicated answer must not stand in for another P rank's slice.
            self.ctx.metrics.incr("reaper.duplicate_notif")
            note("notif.duplicate", level="info", sender=msg.sender, ok=msg.ok)
            return
        if not msg.final:
            ledger.pinned.add(rank)
            self.ctx.metrics.incr("recv.write_pinned")
            note("recv.write_pinned", level="warning", sender=msg.sender, reason=msg.reason)
            return
        ledger.answered.add(rank)
        if msg.ok:
            ledger.ok += 1
        else:
            ledger.failed += 1
            ledger.reason = ledger.reason or msg.reason or "push failed"
        note("recv.notified", ok=msg.ok, answered=ledger.answers, expected=ledger.watch.expected)
        self._maybe_settle(msg.request_id, ledger)

    @handles(RecvUndelivered)
    def _undelivered(self, msg: RecvUndelivered, note: Note) -> None:
        ledger = self._recvs.get(msg.request_id)
        if ledger is None:
            note("recv.undelivered_unknown", level="info")
            return
        ledger.undelivered += msg.count
        ledger.reason = ledger.reason or msg.reason
        note("recv.undelivered", level="warning", count=msg.count, reason=msg.reason)
        self._maybe_settle(msg.request_id, ledger)

    @handles(PeerGone)
    def _peer_gone(self, msg: PeerGone, note: Note) -> None:
        affected = released = 0
        rank = _rank(msg.peer)
        for rid, ledger in list(self._recvs.items()):
            if rank not in ledger.expected or rank in ledger.answered:
                continue
            ledger.gone.add(rank)
            if ledger.aborted:
                if ledger.quarantine_over and not ledger.held:
                    released += 1
                    self._release(rid, ledger)
                continue
            # That P rank will not answer. It may still be alive behind a broken link, so the
            # blocks quarantine (P never writes past its lease) instead of being freed at once.
            affected += 1
            self._fail_ledger(rid, ledger, f"P rank {msg.agent} gone: {msg.reason}")
        if affected:
            self.ctx.metrics.incr("recv.peer_gone", affected)
        note(
            "peer.gone",
            level="warning" if affected else "info",
            agent=msg.agent,
            affected=affected,
            released=released,
        )

    @handles(AbortRecv)
    def _abort(self, msg: AbortRecv, note: Note) -> None:
        ledger = self._recvs.get(msg.request_id)
        if ledger is None:
            note("recv.abort_unknown", level="info")
            return
        self._fail_ledger(msg.request_id, ledger, "aborted by engine")
        note("recv.aborted", answered=ledger.answers, expected=ledger.watch.expected)

    def _fail_ledger(self, rid: str, ledger: RecvLedger, reason: str) -> None:
        """End a D request as failed: tell P to stand down, keep its blocks until every asked
        P rank answered or could no longer write, then report it (once)."""
        if not ledger.aborted:
            ledger.aborted = True
            ledger.reason = ledger.reason or reason
            self._send_abort(ledger, reason)
            until = self.ctx.clock() + self.config.abort_quarantine
            current = self._recv_deadlines.get(rid)
            if current is None or until < current:
                self._recv_deadlines.set(rid, until)
            self._rearm(self.ctx.clock())
        self._maybe_settle(rid, ledger)

    def _send_abort(self, ledger: RecvLedger, reason: str) -> None:
        reg = ledger.watch.registration
        self.ctx.peers.to_writer(
            SendAbort(
                abort=Abort(
                    request_id=reg.request_id,
                    transfer_id=reg.transfer_id,
                    remote_request_id=reg.remote_request_id,
                    decode_tp_rank=reg.decode_tp_rank,
                    reason=reason,
                ),
                peers=ledger.watch.peers,
            ),
        )

    def _maybe_settle(self, rid: str, ledger: RecvLedger) -> None:
        if ledger.settled:
            self._release(rid, ledger)

    def _release(self, rid: str, ledger: RecvLedger) -> None:
        """Report the request: its blocks go back to the engine."""
        if self._recvs.get(rid) is not ledger:
            return
        del self._recvs[rid]
        self._recv_deadlines.discard(rid)
        tid = ledger.watch.registration.transfer_id
        if tid is not None:
            bucket = self._by_tid.get(tid)
            if bucket is not None:
                bucket.discard(rid)
                if not bucket:
                    del self._by_tid[tid]
        if ledger.failed or ledger.undelivered or ledger.aborted or ledger.timed_out:
            self.ctx.outbox.recv_failed(rid, ledger.reason or "failed")
            self.ctx.metrics.incr("recv.failed")
            self.log.info("recv.failed", request_id=rid, reason=ledger.reason)
        else:
            self.ctx.outbox.received(rid)
            self.ctx.metrics.incr("recv.finished")
            self.ctx.metrics.incr("bytes.received", ledger.watch.nbytes)
            self.log.debug("recv.finished", request_id=rid)

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
        for rid in list(self._recv_deadlines.due(now)):
            ledger = self._recvs.get(rid)
            if ledger is None:
                continue
            if ledger.aborted:
                ledger.quarantine_over = True
                if ledger.held:
                    # A WRITE P could not cancel may still land: keep the blocks until it
                    # settles (P's final answer) or P is gone.
                    self.ctx.metrics.incr("recv.quarantine_held")
                    self.log.warning("recv.quarantine_held", request_id=rid, pinned=len(ledger.pinned))
                    continue
                # Quarantine over: P cannot write any more (its lease is past), free the blocks.
                self.log.warning(
                    "recv.quarantine_ended", request_id=rid, answered=ledger.answers, expected=ledger.watch.expected
                )
                self._release(rid, ledger)
                continue
            # The watchdog fails the request visibly: P is told to stand down, and the blocks
            # stay quarantined until P answered (or could no longer write).
            ledger.timed_out = True
            self.ctx.metrics.incr("recv.timed_out")
            self.log.warning("recv.timed_out", request_id=rid, answered=ledger.answers, expected=ledger.watch.expected)
            self._fail_ledger(rid, ledger, "push not completed before registration timeout")
        if now >= self._next_heartbeat:
            self._send_heartbeats()
            self._next_heartbeat = now + self.config.heartbeat_every
        if now >= self._next_engine_sweep:
            self.ctx.peers.to_writer(EvictIdleEngines(idle_for=self.config.engine_ttl))
            self._next_engine_sweep = now + min(self.config.engine_ttl, 60.0)
        self._rearm(now)

    def _send_heartbeats(self) -> None:
        groups: dict[tuple[str, str, int], tuple[list[str], tuple[PeerKey, ...]]] = {}
        for ledger in self._recvs.values():
            if ledger.aborted:
                continue
            reg = ledger.watch.registration
            key = (reg.remote_engine_id, reg.remote_host, reg.remote_port)
            ids, _ = groups.setdefault(key, ([], ledger.watch.peers))
            ids.append(ledger.watch.heartbeat_id)
        for (engine, host, port), (ids, peers) in groups.items():
            self.ctx.peers.to_writer(
                SendHeartbeats(engine_id=engine, host=host, port=port, peers=peers, ids=tuple(ids))
            )

    def _rearm(self, now: float) -> None:
        nxt = min(self._next_heartbeat, self._next_engine_sweep)
        for heap in (self._lease_deadlines, self._recv_deadlines):
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
        ledger = self._recvs.get(rid)
        if ledger is not None:
            self._fail_ledger(rid, ledger, f"D {why}")
        elif isinstance(message, WatchRecv):
            self.ctx.outbox.recv_failed(rid, f"D {why}")  # nothing was sent for it
