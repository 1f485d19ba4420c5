"""The lease-reaper: keeps time for one rank, on its own timer (SPEC §6).

P side: leases on finished blocks, armed here before the blocks reach the matcher (so a
success can never clear a lease that is not armed yet), extended by heartbeats, reaped by
deadline order from a heap (heartbeats break insertion order).

D side: the registration watchdog and the completion ledger. A D request settles when every P
rank that was asked has answered (completion or push failure) or can no longer answer; only
then are its blocks reported, so an aborted request's blocks stay quarantined while a WRITE
may still land in them. Heartbeats for awaited requests go out every ``lease/6``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
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
from .base import Note, PushActor, RankContext, handles


@dataclass
class RecvLedger:
    """D: what one request waits for."""

    watch: WatchRecv
    deadline: float
    ok: int = 0
    failed: int = 0
    undelivered: int = 0
    reason: str = ""
    aborted: bool = False
    timed_out: bool = False
    senders: set[str] = field(default_factory=set)  # each P rank answers once

    @property
    def answered(self) -> int:
        return self.ok + self.failed + self.undelivered

    @property
    def settled(self) -> bool:
        return self.answered >= self.watch.expected


class Reaper(PushActor):
    actor_name = "reaper"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self._leases: dict[str, float] = {}
        self._lease_heap: list[tuple[float, str]] = []
        self._cleared: OrderedDict[str, None] = OrderedDict()  # recently cleared, bounded
        self._recvs: dict[str, RecvLedger] = {}
        self._recv_heap: list[tuple[float, str]] = []
        self._next_heartbeat = 0.0
        self._next_engine_sweep = 0.0

    def on_start(self) -> None:
        now = self.ctx.clock()
        self._next_heartbeat = now + self.config.heartbeat_every
        self._next_engine_sweep = now + min(self.config.engine_ttl, 60.0)
        self._rearm(now)

    def sizes(self) -> dict[str, int]:
        return {"leases": len(self._leases), "recvs": len(self._recvs), "lease_heap": len(self._lease_heap)}

    # --- P leases ----------------------------------------------------------------------------
    @handles(ArmLease)
    def _arm(self, msg: ArmLease, note: Note) -> None:
        self._leases[msg.request_id] = msg.deadline
        heapq.heappush(self._lease_heap, (msg.deadline, msg.request_id))
        self._cleared.pop(msg.request_id, None)
        self.ctx.peers.tell(
            "matcher",
            BlocksFinished(request_id=msg.request_id, block_ids=msg.block_ids, transfer_id=msg.transfer_id),
        )
        self._rearm(self.ctx.clock())
        note("lease.armed", expires_in=round(msg.deadline - self.ctx.clock(), 3))

    @handles(ClearLease)
    def _clear(self, msg: ClearLease, note: Note) -> None:
        known = self._leases.pop(msg.request_id, None) is not None
        self._cleared[msg.request_id] = None
        while len(self._cleared) > 4096:
            self._cleared.popitem(last=False)
        note("lease.cleared", known=known)

    @handles(ExtendLeases)
    def _extend(self, msg: ExtendLeases, note: Note) -> None:
        now = self.ctx.clock()
        target = now + self.config.lease_duration * 2 / 3
        extended = 0
        for rid in msg.request_ids:
            old = self._leases.get(rid)
            if old is None or old >= target:
                continue
            self._leases[rid] = target
            heapq.heappush(self._lease_heap, (target, rid))
            extended += 1
        note("lease.extended", extended=extended, asked=len(msg.request_ids))

    # --- D ledger ----------------------------------------------------------------------------
    @handles(WatchRecv)
    def _watch(self, msg: WatchRecv, note: Note) -> None:
        if msg.request_id in self._recvs:
            note("recv.duplicate", level="warning")
            self.ctx.metrics.incr("reaper.duplicate_watch")
            return
        self._recvs[msg.request_id] = RecvLedger(msg, msg.deadline)
        heapq.heappush(self._recv_heap, (msg.deadline, msg.request_id))
        self.ctx.peers.tell("writer", SendRegistration(registration=msg.registration))
        self._rearm(self.ctx.clock())
        note("recv.watching", expected=msg.expected, p_ranks=len(msg.peers))

    @handles(RecvNotified)
    def _notified(self, msg: RecvNotified, note: Note) -> None:
        ledger = self._recvs.get(msg.request_id)
        if ledger is None:
            self.ctx.metrics.incr("reaper.notif_unknown_request")
            note("notif.ignored", level="info", reason="unknown request", ok=msg.ok)
            return
        if msg.sender in ledger.senders:
            # A duplicated completion must not stand in for another P rank's slice.
            self.ctx.metrics.incr("reaper.duplicate_notif")
            note("notif.duplicate", level="info", sender=msg.sender, ok=msg.ok)
            return
        ledger.senders.add(msg.sender)
        if msg.ok:
            ledger.ok += 1
        else:
            ledger.failed += 1
            ledger.reason = ledger.reason or msg.reason or "push failed"
        note("recv.notified", ok=msg.ok, answered=ledger.answered, expected=ledger.watch.expected)
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
        affected = 0
        for rid, ledger in list(self._recvs.items()):
            if msg.peer not in ledger.watch.peers or msg.agent in ledger.senders or ledger.aborted:
                continue
            # That P rank will not answer. It may still be alive behind a broken link, so the
            # blocks quarantine (P never writes past its lease) instead of being freed at once.
            affected += 1
            ledger.aborted = True
            ledger.reason = ledger.reason or f"P rank {msg.agent} gone: {msg.reason}"
            self._send_abort(ledger, "P rank gone")
            self._quarantine(rid, ledger)
        if affected:
            self.ctx.metrics.incr("recv.peer_gone", affected)
        note("peer.gone", level="warning" if affected else "info", agent=msg.agent, affected=affected)

    @handles(AbortRecv)
    def _abort(self, msg: AbortRecv, note: Note) -> None:
        ledger = self._recvs.get(msg.request_id)
        if ledger is None:
            note("recv.abort_unknown", level="info")
            return
        if not ledger.aborted:
            ledger.aborted = True
            ledger.reason = ledger.reason or "aborted by engine"
            self._send_abort(ledger, "aborted by engine")
            self._quarantine(msg.request_id, ledger)
        note("recv.aborted", answered=ledger.answered, expected=ledger.watch.expected)
        self._maybe_settle(msg.request_id, ledger)

    def _quarantine(self, rid: str, ledger: RecvLedger) -> None:
        """Keep the blocks until every asked P rank answered, or at most ``abort_quarantine``."""
        until = self.ctx.clock() + self.config.abort_quarantine
        if until < ledger.deadline:
            ledger.deadline = until
            heapq.heappush(self._recv_heap, (until, rid))
            self._rearm(self.ctx.clock())

    def _send_abort(self, ledger: RecvLedger, reason: str) -> None:
        reg = ledger.watch.registration
        self.ctx.peers.tell(
            "writer",
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
        if not ledger.settled:
            return
        del self._recvs[rid]
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
        while self._lease_heap and self._lease_heap[0][0] <= now:
            deadline, rid = heapq.heappop(self._lease_heap)
            if self._leases.get(rid) != deadline:
                continue  # superseded by an extension or cleared
            del self._leases[rid]
            self.ctx.metrics.incr("lease.expired")
            self.log.info("lease.expired", request_id=rid)
            self.ctx.peers.tell("writer", ExpireLease(request_id=rid))
        while self._recv_heap and self._recv_heap[0][0] <= now:
            deadline, rid = heapq.heappop(self._recv_heap)
            ledger = self._recvs.get(rid)
            if ledger is None or ledger.deadline != deadline:
                continue
            if ledger.aborted:
                # Quarantine over: P cannot write any more (its lease is past), free the blocks.
                del self._recvs[rid]
                self.ctx.outbox.recv_failed(rid, ledger.reason or "aborted")
                self.ctx.metrics.incr("recv.failed")
                self.log.warning(
                    "recv.quarantine_ended", request_id=rid, answered=ledger.answered, expected=ledger.watch.expected
                )
                continue
            # The watchdog fails the request visibly: P is told to stand down, and the blocks
            # stay quarantined until P answered (or could no longer write).
            ledger.timed_out = True
            ledger.aborted = True
            ledger.reason = ledger.reason or "push not completed before registration timeout"
            self.ctx.metrics.incr("recv.timed_out")
            self.log.warning("recv.timed_out", request_id=rid, answered=ledger.answered, expected=ledger.watch.expected)
            self._send_abort(ledger, "decode watchdog expired")
            ledger.deadline = now + self.config.abort_quarantine
            heapq.heappush(self._recv_heap, (ledger.deadline, rid))
        if now >= self._next_heartbeat:
            self._send_heartbeats()
            self._next_heartbeat = now + self.config.heartbeat_every
        if now >= self._next_engine_sweep:
            self.ctx.peers.tell("writer", EvictIdleEngines(idle_for=self.config.engine_ttl))
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
            self.ctx.peers.tell(
                "writer", SendHeartbeats(engine_id=engine, host=host, port=port, peers=peers, ids=tuple(ids))
            )

    def _rearm(self, now: float) -> None:
        nxt = min(self._next_heartbeat, self._next_engine_sweep)
        if self._lease_heap:
            nxt = min(nxt, self._lease_heap[0][0])
        if self._recv_heap:
            nxt = min(nxt, self._recv_heap[0][0])
        self.arm_tick(max(0.0, nxt - now))

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        rid = getattr(message, "request_id", None)
        if isinstance(message, WatchRecv):
            self.ctx.outbox.recv_failed(message.request_id, f"D reaper error: {exc!r}")
        elif isinstance(message, ArmLease) and rid is not None:
            self.ctx.outbox.sent(rid, ok=False, reason=f"P reaper error: {exc!r}")
