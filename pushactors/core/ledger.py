"""D's request registry: one ledger per request waiting for its KV (plain state, no threads).

A D request settles when every P rank it registered with has answered (completion or push
failure) or can no longer answer; only then is it reported and its blocks reused. Answers count
only from the P ranks the request expects, once each. An aborted (or timed-out) request keeps
its blocks quarantined while a WRITE may still land; a WRITE that P reports it could not cancel
holds them past the quarantine until it settles or P is gone. A re-stage of a live request with
other blocks fails it.

One transfer id names one P request, so at most one live D request may register under it. A
second that arrives while the first is live (a decode leg sent again after its client cancelled
the first, the cancel not yet through) waits, unregistered, for the first to end: if the
engine aborted the first, the second registers then (after the first's abort to P); if the first
landed or failed otherwise, or is still live after ``reuse_wait``, the second fails (with the
first, in that last case). Neither is ever registered beside the other.

The lease-reaper owns a :class:`DRegistry` and carries out what it asks (send the registration,
send an abort, report a result). The writer may report a completion that lands its request on
its own, under the rules of :mod:`pushactors.core.claims`; the reaper absorbs it first thing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

from ..protocol import PeerKey, Registration, WatchRecv
from .registry import DeadlineHeap

RankKey = tuple[str, str, int, int, int]  # engine id, host, port, pp rank, tp rank


def rank_key(peer: PeerKey) -> RankKey:
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
    cancelled: bool = False  # aborted by its engine (the client went away): its transfer id is free
    timed_out: bool = False
    quarantine_over: bool = False
    answered: set[RankKey] = field(default_factory=set)  # P ranks that answered
    pinned: set[RankKey] = field(default_factory=set)  # a WRITE of theirs may still land
    gone: set[RankKey] = field(default_factory=set)
    pinned_at: float | None = None  # when a P rank first said its WRITE may still land
    report_due: bool = False  # over, but reported once the engine's announced messages are applied

    @property
    def expected(self) -> set[RankKey]:
        return {rank_key(p) for p in self.watch.peers}

    @property
    def answers(self) -> int:
        return self.ok + self.failed + self.undelivered

    @property
    def settled(self) -> bool:
        return self.answers >= self.watch.expected

    @property
    def held(self) -> bool:
        """A P rank said its WRITE may still land here and has not finished. A rank that only
        went away (a NIXL disconnect: P may be alive behind a broken link, its WRITE running)
        still holds; one confirmed dead counts as answered (``peer_dead``)."""
        return bool(self.pinned - self.answered)

    def lands_with(self, rank: RankKey, generation: int) -> bool:
        """One completion from ``rank`` for ``generation`` lands this request, nothing else to
        do: the only answer it waits for, from a rank it expects, for its live registration,
        not aborted, and unstaged (a staged request still needs its scatter)."""
        reg = self.watch.registration
        return (
            not self.aborted
            and self.answers == 0
            and self.watch.expected == 1
            and reg.staging_slot is None
            and generation == reg.generation
            and rank in self.expected
        )

    @property
    def failed_reason(self) -> str | None:
        if self.failed or self.undelivered or self.aborted or self.timed_out:
            return self.reason or "failed"
        return None


# --- what the registry asks its actor to do --------------------------------------------------
@dataclass(frozen=True)
class SendRegistration:
    registration: Registration


@dataclass(frozen=True)
class SendAbort:
    """Tell the P ranks of ``ledger`` to stand down (they cancel or answer)."""

    ledger: RecvLedger
    reason: str


@dataclass(frozen=True)
class Report:
    """The request is over: ``reason`` None means its KV landed."""

    request_id: str
    reason: str | None
    nbytes: int = 0
    registration: Registration | None = None  # its staging slot is freed (or scattered) now


@dataclass(frozen=True)
class FreeSlot:
    """A staging slot taken for a registration that was never sent: no WRITE can land in it."""

    registration: Registration


DAction = Union[SendRegistration, SendAbort, Report, FreeSlot]


@dataclass
class DResult:
    event: str
    level: str = "debug"
    fields: dict[str, object] = field(default_factory=dict)
    actions: list[DAction] = field(default_factory=list)
    counters: list[str] = field(default_factory=list)
    # From the timer: requests whose quarantine is held by a pinned WRITE, whose quarantine
    # ended, and whose watchdog fired (each logged by the actor).
    held: list[str] = field(default_factory=list)
    quarantine_ended: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    pin_limit_passed: list[str] = field(default_factory=list)


class DRegistry:
    """Every D request of one rank that waits for its push."""

    def __init__(self, *, quarantine: float, pinned_limit: float | None = None, reuse_wait: float = 5.0) -> None:
        self.quarantine = quarantine
        # The longest blocks stay held for a WRITE P said may still land (None: no limit).
        self.pinned_limit = pinned_limit
        # How long a request repeating a live request's transfer id waits for it to end.
        self.reuse_wait = reuse_wait
        self.ledgers: dict[str, RecvLedger] = {}
        self.deadlines: DeadlineHeap[str] = DeadlineHeap()
        self._by_tid: dict[str, set[str]] = {}  # transfer id -> D ids registered under it
        self.waiting: dict[str, WatchRecv] = {}  # transfer id -> the request waiting for it
        self._waiting_tid: dict[str, str] = {}  # waiting D id -> its transfer id
        # D id -> the engine's messages about it (a re-stage, an abort) announced and not
        # applied here yet (core/claims.py keeps it). A request is never reported while the
        # engine has said more about it than this registry knows.
        self.behind: Mapping[str, int] = {}
        # P rank -> when a sweep first found it owing an aborted request (``probe_due``), and
        # when NIXL last reported it gone (the writer's own death check asks about it then)
        self._owing_since: dict[RankKey, float] = {}
        self._gone_at: dict[RankKey, float] = {}

    def _caught_up(self, rid: str, res: DResult) -> DResult:
        """An engine message about ``rid`` was applied: a report it held back goes now."""
        ledger = self.ledgers.get(rid)
        if ledger is not None and ledger.report_due and not self.behind.get(rid):
            self._release(rid, ledger, res)
        return res

    # --- a registration is staged ------------------------------------------------------------
    def watch(self, msg: WatchRecv, now: float) -> DResult:
        return self._caught_up(msg.request_id, self._watch(msg, now))

    def _watch(self, msg: WatchRecv, now: float) -> DResult:
        rid = msg.request_id
        if rid in self._waiting_tid:
            return self._rewatch_waiting(msg)
        old = self.ledgers.get(rid)
        if old is not None:
            res = DResult("recv.restaged", "warning", counters=["recv.restaged"])
            if old.watch.registration == msg.registration and old.watch.peers == msg.peers:
                res = DResult("recv.duplicate", "info", counters=["reaper.duplicate_watch"])
            else:
                # Staged again with other blocks while the first registration is live: P may be
                # writing the first blocks already, so neither can be trusted. Fail it (once).
                self._fail(rid, old, "re-staged with different blocks while its push was pending", now, res)
            slot = msg.registration.staging_slot
            if slot is not None and slot != old.watch.registration.staging_slot:
                res.actions.append(FreeSlot(msg.registration))  # the second one is never sent
            return res
        tid = msg.registration.transfer_id
        holders = self._holders(tid)
        if tid is not None and holders and not all(h.cancelled for h in holders):
            if tid not in self.waiting and any(not h.aborted for h in holders) and self.reuse_wait > 0:
                # A live request holds it: wait (unregistered) for that one to end.
                self.waiting[tid] = msg
                self._waiting_tid[rid] = tid
                self.deadlines.set(rid, now + self.reuse_wait)
                waits_for = [h.watch.request_id for h in holders]
                return DResult(
                    "recv.deferred", "info", {"transfer_id": tid, "waits_for": waits_for}, [], ["recv.deferred"]
                )
            res = DResult("recv.ambiguous", "warning", {"reason": _tid_used(tid)})
            self._ambiguous(tid, now, res)
            # never registered: its blocks are untouched
            res.actions.append(Report(rid, _tid_used(tid), registration=msg.registration))
            return res
        res = DResult("recv.watching", fields={"expected": msg.expected, "p_ranks": len(msg.peers)})
        self._start(msg, res)
        return res

    def _holders(self, tid: str | None) -> list[RecvLedger]:
        """The requests registered under ``tid`` (live, or aborted and not yet released)."""
        return [self.ledgers[o] for o in sorted(self._by_tid.get(tid, ()))] if tid is not None else []

    def _ambiguous(self, tid: str, now: float, res: DResult) -> None:
        """Requests under one transfer id that cannot be told apart (P could not tell which one
        its KV is for): the one waiting and every holder fail."""
        res.counters.append("recv.ambiguous")
        self._fail_waiting(tid, _tid_used(tid), res)
        for h in self._holders(tid):
            self._fail(h.watch.request_id, h, _tid_used(tid), now, res)

    def _start(self, msg: WatchRecv, res: DResult) -> None:
        """Register ``msg``'s request: its ledger, its watchdog, its registration sent."""
        rid, tid = msg.request_id, msg.registration.transfer_id
        self.ledgers[rid] = RecvLedger(msg)
        if tid is not None:
            self._by_tid.setdefault(tid, set()).add(rid)
        self.deadlines.set(rid, msg.deadline)
        res.actions.append(SendRegistration(msg.registration))

    def _rewatch_waiting(self, msg: WatchRecv) -> DResult:
        """A waiting request staged again: nothing was sent for it, so the newest one waits."""
        tid = self._waiting_tid[msg.request_id]
        old = self.waiting[tid]
        if old == msg:
            return DResult("recv.duplicate", "info", counters=["reaper.duplicate_watch"])
        self.waiting[tid] = msg
        res = DResult("recv.restaged", "info", counters=["recv.restaged"])
        if old.registration.staging_slot not in (None, msg.registration.staging_slot):
            res.actions.append(FreeSlot(old.registration))
        return res

    def _fail_waiting(self, tid: str, reason: str, res: DResult) -> None:
        """The request waiting for ``tid`` ends, never registered (its blocks untouched)."""
        msg = self.waiting.pop(tid, None)
        if msg is None:
            return
        del self._waiting_tid[msg.request_id]
        self.deadlines.discard(msg.request_id)
        res.actions.append(Report(msg.request_id, reason, registration=msg.registration))

    def _resume(self, tid: str | None, res: DResult, ended: RecvLedger | None = None) -> None:
        """A request registered under ``tid`` was aborted (or ``ended``): the one waiting for
        it registers now if every holder was cancelled by its engine, and fails if one landed
        or failed otherwise (the id is spent, or P refused it). A holder still live: it waits."""
        if tid is None or tid not in self.waiting:
            return
        holders = self._holders(tid)
        spent = ended is not None and not ended.cancelled  # it landed, or failed otherwise
        if not spent and any(not h.aborted for h in holders):
            return
        if not spent and all(h.cancelled for h in holders):
            msg = self.waiting.pop(tid)
            del self._waiting_tid[msg.request_id]
            self.deadlines.discard(msg.request_id)
            res.counters.append("recv.deferred_registered")
            self._start(msg, res)  # after the holders' aborts, which are earlier actions
            return
        self._fail_waiting(tid, _tid_used(tid), res)

    # --- answers from P --------------------------------------------------------------------------
    def notified(
        self,
        rid: str,
        *,
        ok: bool,
        peer: PeerKey | None,
        final: bool,
        reason: str,
        now: float,
        generation: int = 0,
        taken: bool = False,
    ) -> DResult:
        """An answer from P. ``taken``: the writer reported this completion already (a take
        absorbed): the request ends now, whatever the engine said since (core/claims.py
        refuses a take while the engine has said more, and announces nothing after one)."""
        ledger = self.ledgers.get(rid)
        if ledger is None:
            return DResult(
                "notif.ignored", "info", {"reason": "unknown request", "ok": ok}, [], ["reaper.notif_unknown_request"]
            )
        rank = rank_key(peer) if peer is not None else None
        if rank is None or rank not in ledger.expected:
            # Not one of the P ranks this request registered with: it cannot speak for it.
            return DResult(
                "notif.rejected",
                "warning",
                {"reason": "sender is not a P rank this request expects", "ok": ok},
                counters=["reaper.notif_wrong_sender"],
            )
        live = ledger.watch.registration.generation
        if generation != live:
            # It answers another registration of this id (a late or replayed answer to an
            # earlier use, or a forgery): it can neither land nor fail the live one.
            kind = "completion" if ok else "push_fail"
            return DResult(
                "notif.stale",
                "warning",
                {"reason": "answers another generation", "ok": ok, "generation": generation, "live": live},
                counters=["reaper.notif_stale_generation", f"reaper.notif_stale_generation.{kind}"],
            )
        if rank in ledger.answered:
            # A duplicated answer must not stand in for another P rank's slice.
            return DResult("notif.duplicate", "info", {"ok": ok}, counters=["reaper.duplicate_notif"])
        if not final:
            ledger.pinned.add(rank)
            if ledger.pinned_at is None:
                ledger.pinned_at = now
            return DResult("recv.write_pinned", "warning", {"reason": reason}, counters=["recv.write_pinned"])
        ledger.answered.add(rank)
        if ok:
            ledger.ok += 1
        else:
            ledger.failed += 1
            ledger.reason = ledger.reason or reason or "push failed"
        res = DResult("recv.notified", fields={"ok": ok, "answered": ledger.answers, "expected": ledger.watch.expected})
        if taken:
            self._release(rid, ledger, res, reported=True)
            return res
        self._maybe_settle(rid, ledger, res)
        return res

    def undelivered(self, rid: str, count: int, reason: str) -> DResult:
        ledger = self.ledgers.get(rid)
        if ledger is None:
            return DResult("recv.undelivered_unknown", "info")
        ledger.undelivered += count
        ledger.reason = ledger.reason or reason
        res = DResult("recv.undelivered", "warning", {"count": count, "reason": reason})
        self._maybe_settle(rid, ledger, res)
        return res

    def peer_gone(
        self,
        peer: PeerKey,
        agent: str,
        reason: str,
        now: float,
        *,
        delivered: tuple[str, ...] | None = None,
    ) -> DResult:
        """NIXL says that P rank's agent disconnected: the requests it owed an answer fail
        (quarantined). With ``delivered``, it owed an answer only to those: a request whose
        registration never reached that agent (its send found the agent gone, or it was
        parked for the rank's next incarnation) cannot have been written by it and keeps
        waiting."""
        rank = rank_key(peer)
        affected = released = kept = 0
        owed = None if delivered is None else frozenset(delivered)
        res = DResult("peer.gone", "info")
        self._gone_at[rank] = now
        for rid, ledger in list(self.ledgers.items()):
            if rank not in ledger.expected or rank in ledger.answered:
                continue
            if owed is not None and rid not in owed and not ledger.aborted:
                kept += 1
                continue
            ledger.gone.add(rank)
            if ledger.aborted:
                if ledger.quarantine_over and not ledger.held:
                    released += 1
                    self._release(rid, ledger, res)
                continue
            # That P rank will not answer. It may still be alive behind a broken link, so the
            # blocks quarantine (P never writes past its lease) instead of being freed at once.
            affected += 1
            self._fail(rid, ledger, f"P rank {agent} gone: {reason}", now, res)
        if affected:
            res.level = "warning"
            res.counters += ["recv.peer_gone"] * affected
        res.fields.update(agent=agent, affected=affected, released=released, kept=kept)
        return res

    def peer_dead(self, peer: PeerKey, agent: str, reason: str) -> DResult:
        """That P rank's old process is certainly dead: it will neither answer nor write. The
        failed requests that only waited on it (quarantine, a pinned WRITE) are released now
        (each counted as ``recv.peer_dead_released``); requests of other P ranks are untouched."""
        rank = rank_key(peer)
        released = 0
        res = DResult("peer.dead", "warning")
        for rid, ledger in list(self.ledgers.items()):
            if not ledger.aborted or rank not in ledger.expected or rank in ledger.answered:
                continue
            ledger.answered.add(rank)
            ledger.undelivered += 1
            ledger.gone.add(rank)
            if ledger.settled:
                released += 1
            self._maybe_settle(rid, ledger, res)
        res.counters += ["recv.peer_dead_released"] * released
        res.fields.update(agent=agent, reason=reason, released=released)
        return res

    def abort(self, rid: str, reason: str, now: float) -> DResult:
        """The engine aborted ``rid`` (its client went away)."""
        return self._caught_up(rid, self._abort(rid, reason, now))

    def _abort(self, rid: str, reason: str, now: float) -> DResult:
        tid = self._waiting_tid.get(rid)
        if tid is not None:
            res = DResult("recv.aborted", fields={"waiting": True})
            self._fail_waiting(tid, reason, res)
            return res
        ledger = self.ledgers.get(rid)
        if ledger is None:
            return DResult("recv.abort_unknown", "info")
        res = DResult("recv.aborted", fields={"answered": ledger.answers, "expected": ledger.watch.expected})
        if not ledger.aborted:
            ledger.cancelled = True  # not when it had failed already: then P may have refused its id
        self._fail(rid, ledger, reason, now, res)
        return res

    # --- time ------------------------------------------------------------------------------------
    def due(self, now: float) -> DResult:
        """Watchdogs and quarantines whose deadline passed."""
        res = DResult("recv.tick")
        for rid in list(self.deadlines.due(now)):
            tid = self._waiting_tid.get(rid)
            if tid is not None:
                # Waited reuse_wait and the request holding its transfer id is still live.
                self._ambiguous(tid, now, res)
                continue
            ledger = self.ledgers.get(rid)
            if ledger is None:
                continue
            if ledger.aborted:
                ledger.quarantine_over = True
                if ledger.held:
                    limit_at = self._pin_limit_at(ledger)
                    if now >= limit_at:
                        # P neither gave its final word nor is known dead by the configured
                        # bound on how long any WRITE runs (pinned_write_limit): reuse them.
                        res.counters.append("recv.pinned_limit_passed")
                        res.pin_limit_passed.append(rid)
                        self._release(rid, ledger, res)
                        continue
                    # A WRITE of P's may still land: keep the blocks until it settles (P's
                    # final answer) or P is gone. Ask again every quarantine: a P that has
                    # finished answers at once (its final word may have been lost), one whose
                    # WRITE still runs says so again.
                    res.counters.append("recv.quarantine_held")
                    res.held.append(rid)
                    self.deadlines.set(rid, min(now + self.quarantine, limit_at))
                    res.actions.append(SendAbort(ledger, ledger.reason or "aborted"))
                    continue
                # Quarantine over: P cannot write any more (its lease is past), free the blocks.
                res.quarantine_ended.append(rid)
                self._release(rid, ledger, res)
                continue
            # The watchdog fails the request visibly: P is told to stand down, and the blocks
            # stay quarantined until P answered (or could no longer write).
            ledger.timed_out = True
            res.counters.append("recv.timed_out")
            res.timed_out.append(rid)
            self._fail(rid, ledger, "push not completed before registration timeout", now, res)
        return res

    def probe_due(self, now: float, *, grace: float, after_gone: float = 0.0) -> tuple[PeerKey, ...]:
        """The P ranks to ask whether they are still alive: each owes an aborted request of
        this rank its final answer (the quarantine, or a pinned WRITE, waits on it) and has owed
        one since a sweep at least ``grace`` ago. Nothing else goes to a P rank for an aborted
        request (no heartbeat), so without asking, a P that died before answering would hold
        the blocks the whole quarantine. A rank that answers, or whose requests end, is
        forgotten here; asked about once per sweep, so the caller's sweep period is the rate.
        A rank NIXL reported gone less than ``after_gone`` ago is left to the writer's own
        death check, which asks at once and again soon after (two askers would only race)."""
        owing: dict[RankKey, PeerKey] = {}
        for ledger in self.ledgers.values():
            if not ledger.aborted:
                continue
            for peer in ledger.watch.peers:
                rank = rank_key(peer)
                if rank not in ledger.answered:
                    owing.setdefault(rank, peer)
        since, gone_at = self._owing_since, self._gone_at
        for table in (since, gone_at):
            for rank in [r for r in table if r not in owing]:
                del table[rank]
        due = []
        for rank, peer in owing.items():
            if now - since.setdefault(rank, now) < grace:
                continue
            if now - gone_at.get(rank, -math.inf) < after_gone:
                continue
            due.append(peer)
        return tuple(due)

    def heartbeat_groups(self) -> dict[tuple[str, str, int], tuple[list[str], tuple[PeerKey, ...]]]:
        """Heartbeat ids per P engine address, for requests still waiting (not aborted)."""
        groups: dict[tuple[str, str, int], tuple[list[str], tuple[PeerKey, ...]]] = {}
        for ledger in self.ledgers.values():
            if ledger.aborted:
                continue
            reg = ledger.watch.registration
            ids, _ = groups.setdefault(
                (reg.remote_engine_id, reg.remote_host, reg.remote_port), ([], ledger.watch.peers)
            )
            ids.append(ledger.watch.heartbeat_id)
        return groups

    def _pin_limit_at(self, ledger: RecvLedger) -> float:
        if self.pinned_limit is None or ledger.pinned_at is None:
            return float("inf")
        return ledger.pinned_at + self.pinned_limit

    # --- internals -------------------------------------------------------------------------------
    def _fail(self, rid: str, ledger: RecvLedger, reason: str, now: float, res: DResult) -> None:
        """End a D request as failed: tell P to stand down, keep its blocks until every asked
        P rank answered or could no longer write, then report it (once)."""
        if not ledger.aborted:
            ledger.aborted = True
            ledger.reason = ledger.reason or reason
            res.actions.append(SendAbort(ledger, reason))
            # The full quarantine from now, whatever was armed before: the registration's
            # watchdog may be due sooner, but a WRITE P posted can land until P hears the
            # abort or its lease lapses, so the blocks are not D's to reuse before then.
            self.deadlines.set(rid, now + self.quarantine)
        self._maybe_settle(rid, ledger, res)
        self._resume(ledger.watch.registration.transfer_id, res)

    def _maybe_settle(self, rid: str, ledger: RecvLedger, res: DResult) -> None:
        if ledger.settled:
            self._release(rid, ledger, res)

    def _release(self, rid: str, ledger: RecvLedger, res: DResult, *, reported: bool = False) -> None:
        if self.ledgers.get(rid) is not ledger:
            return
        if self.behind.get(rid) and not reported:
            # The engine re-staged or aborted it meanwhile (not applied yet): a report now
            # would be judged on blocks the engine no longer expects. Report after that.
            if not ledger.report_due:
                ledger.report_due = True
                res.counters.append("recv.report_deferred")
            return
        del self.ledgers[rid]
        self.deadlines.discard(rid)
        tid = ledger.watch.registration.transfer_id
        if tid is not None:
            bucket = self._by_tid.get(tid)
            if bucket is not None:
                bucket.discard(rid)
                if not bucket:
                    del self._by_tid[tid]
        res.actions.append(Report(rid, ledger.failed_reason, ledger.watch.nbytes, ledger.watch.registration))
        self._resume(tid, res, ended=ledger)

    def knows(self, rid: str) -> bool:
        """``rid`` is registered here or waits for its transfer id."""
        return rid in self.ledgers or rid in self._waiting_tid

    def fail(self, rid: str, reason: str, now: float) -> DResult:
        """Fail a live request from outside the message flow (an actor error)."""
        ledger = self.ledgers.get(rid)
        res = DResult("recv.failed_by_error", "warning")
        if rid in self._waiting_tid:
            self._fail_waiting(self._waiting_tid[rid], reason, res)
        elif ledger is not None:
            self._fail(rid, ledger, reason, now, res)
        return res

    def sizes(self) -> dict[str, int]:
        return {"recvs": len(self.ledgers), "recv_tids": len(self._by_tid), "recv_waiting": len(self.waiting)}


def _tid_used(tid: str) -> str:
    return f"transfer id {tid!r} is used by another live request on this engine"
