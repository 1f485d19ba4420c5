"""P's pushes, carried out on the writer's thread: post, settle, expire, cancel.

:class:`Pusher` turns the decisions of :class:`~pushactors.actors.pushes.PushBook` (which
target may be posted, when a request is over and how) into NIXL calls through
:class:`~pushactors.actors.poster.Poster` and into the messages that end a request (the
reaper's ``ClearLease``, the matcher's ``Forget``, the engine's outbox, a push failure to D).

Safety rules held here:
* P's blocks are reported free only when nothing of the request is in flight;
* once a request is finished, expired or failed (tombstoned), no WRITE for it is posted again;
* every WRITE of a push (each layer group of a layer-wise push, each chunk of a staged one), not
  only its first, is posted only before D's deadline for the registration; a push with parts
  left stops at that deadline, at D's abort, at the end of P's lease, or when it is stuck, and
  is then never reported pushed;
* every target D rank that will not be written is told so (push failure) when it is reachable;
* a WRITE is never released to cancel it: NIXL's release returns while a copy already started
  may run on, and nothing tells when it stopped. A stuck or aborted WRITE is polled until NIXL
  reports it ended (D hears "may still land" meanwhile and keeps its blocks); only then is it
  released and D given the final word. One still running at ``pinned_write_limit`` (the bound
  D keeps such blocks by, too) is released then, counted and logged at error level.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..core.blocks import LayoutError, PlanError
from ..core.topology import TopologyError
from ..logs import wants
from ..protocol import ClearLease, ExpireLease, Forget, PostPush, Registration
from .base import Note, RankContext
from .layered import LayerWrites
from .links import Links
from .outbound import Outbound
from .poster import Poster, peer_gone
from .pushes import PAST_DEADLINE, ChunkedWrite, PushBook, PushState, Target
from .remotes import DeliverPush, Notify, RemotePeer, d_peer
from .staged import StagedWrites


class Pusher:
    """P's pushes of one rank (see the module docstring)."""

    def __init__(
        self,
        ctx: RankContext,
        log: Any,
        poster: Poster,
        links: Links,
        book: PushBook,
        out: Outbound,
        wake: Callable[[float], None],
    ) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.log = log
        self.poster = poster
        self.links = links
        self.book = book
        self.out = out
        self.wake = wake  # ask the writer to poll within this many seconds
        self.last_posted_at = 0.0  # when the last WRITE still running after its spin was posted
        self.staged = StagedWrites(self)
        self.layered = LayerWrites(self)

    # --- posting -----------------------------------------------------------------------------
    def post(
        self,
        state: PushState,
        d_rank: int,
        target: Target,
        remote: RemotePeer,
        note: Note | None,
        planned: PostPush | None = None,
    ) -> None:
        """Post the WRITE of ``target``: the plan ``planned`` carries when it was made on the
        pairing this remote holds now, else one made here."""
        started = time.monotonic()
        if self.refused_past_deadline(state, d_rank, target, started, note):
            return
        if self.layered.announced(state.request_id, state.serial):
            self.layered.post(state, d_rank, target, remote, note)
            return
        if target.registration.staging_slot is not None:
            self.staged.post(state, d_rank, target, remote, note)
            return
        reg = target.registration
        try:
            prepared = self.poster.prepared(remote, d_rank, reg.decode_tp_size)
            if planned is not None and planned.plan is not None and planned.pairing is prepared:
                plan = planned.plan
                self.ctx.metrics.incr("write.preplanned")
            else:
                cfg = self.config
                plan = prepared[0].plan(
                    state.block_ids,
                    reg.block_groups,
                    reg.skip_blocks,
                    merge=cfg.post_runs,
                    min_pieces=cfg.post_runs_min_pieces,
                )
        except (LayoutError, PlanError, TopologyError) as exc:
            self.refuse(state, d_rank, target, exc, note)
            return
        planned_at = time.monotonic()
        completion = self.out.completion(reg.request_id, reg.generation)
        if plan.num_descs == 0:
            # Nothing to copy (D had every block cached, or a lower P rank writes these heads):
            # the completion alone settles it.
            self.complete_only(state, d_rank, target, remote, completion, note)
            return
        timeline = self.ctx.timeline
        if timeline is not None:
            timeline.mark(state.request_id, "p.post_start", planned_at)
        try:
            posted = self.poster.post_plan(plan, prepared, remote, completion)
        except Exception as exc:
            self.submit_failed(state, d_rank, target, remote, exc, note)
            return
        if timeline is not None:
            timeline.mark(state.request_id, "p.post_end", time.monotonic())
        target.staged = posted.resources
        fields = None
        if wants("debug"):  # the event's fields are built only for a reader
            t = posted.times
            fields = {
                "descs": plan.num_descs,
                "merged_descs": plan.merged_descs,
                "posted_descs": plan.posted_descs,  # runs, when posted as runs (plan.runs)
                "runs": plan.runs is not None,
                "blocks": plan.num_blocks,
                "post_ms": round((time.monotonic() - started) * 1e3, 3),
                "plan_ms": round((planned_at - started) * 1e3, 3),  # of post_ms; the rest is NIXL's:
                "prep_ms": round(t["prep_ms"] * 1e3, 3),  # the runs' own lists (0 without runs)
                "make_ms": round(t["make_ms"] * 1e3, 3),  # make_prepped_xfer
                "transfer_ms": round(t["transfer_ms"] * 1e3, 3),  # transfer (posts the WRITE)
            }
        kind = "write.runs" if plan.runs is not None else ""
        self.record_posted(note, state, d_rank, target, posted.handle, remote, plan.nbytes, started, kind, fields)
        self.after_post(state, d_rank, target, posted.status)

    def past_deadline(self, state: PushState, d_rank: int, target: Target, now: float) -> bool:
        """Whether D's deadline for the registration (its newest promise) passed by ``now``: D
        may have reused the blocks (its abort lost), so no WRITE of the push may go any more.
        Asked before every WRITE of a push, not only its first: a layer-wise push posts for as
        long as the forward runs, a staged one as its chunks are gathered."""
        promise = self.ctx.promises.get((state.request_id, d_rank, target.registration.generation), 0.0)
        return now >= max(target.deadline, promise)

    def refused_past_deadline(
        self, state: PushState, d_rank: int, target: Target, now: float, note: Note | None
    ) -> bool:
        """A target not posted yet whose D deadline passed fails (D is told); True if it did."""
        if not self.past_deadline(state, d_rank, target, now):
            return False
        self.ctx.metrics.incr("write.past_deadline")
        self.fail_target(state, d_rank, target, PAST_DEADLINE)
        self.emit(note, "write.refused", state, level="warning", reason="past D's deadline")
        return True

    def stop_parts(self, xfer: ChunkedWrite, why: str) -> None:
        """No further part (layer group, chunk) of ``xfer`` is posted: the push fails once the
        parts already posted have ended (never reported pushed, D told then)."""
        xfer.failed = xfer.failed or why
        self.wake(0.0)

    def record_posted(
        self,
        note: Note | None,
        state: PushState,
        d_rank: int,
        target: Target,
        handle: Any,
        remote: RemotePeer,
        nbytes: int,
        at: float,
        kind: str,
        fields: dict[str, Any] | None,
    ) -> None:
        """A WRITE is on its way, however it was planned: the target holds it, it is counted
        (``write.posted``, and ``kind`` when given) and said once as ``write.posted`` (with
        ``fields``; None: nobody reads it, so nothing is built)."""
        target.posted(handle, remote, nbytes, at)
        self.ctx.metrics.incr("write.posted")
        if kind:
            self.ctx.metrics.incr(kind)
        if fields is not None:
            reg = target.registration
            self.emit(note, "write.posted", state, d_request_id=reg.request_id, d_rank=d_rank, bytes=nbytes, **fields)

    def refuse(self, state: PushState, d_rank: int, target: Target, exc: Exception, note: Note | None) -> None:
        self.ctx.metrics.incr("write.refused")
        self.fail_target(state, d_rank, target, f"invalid WRITE: {exc}")
        self.emit(note, "write.refused", state, level="warning", reason=str(exc))

    def complete_only(
        self, state: PushState, d_rank: int, target: Target, remote: RemotePeer, completion: bytes, note: Note | None
    ) -> None:
        """Nothing to copy into this D rank: the completion alone settles the target."""
        self.poster.send(remote.agent_name, completion)
        target.remote = remote
        self.settle(state, d_rank, target, ok=True, reason="")
        self.emit(note, "write.empty", state)

    def submit_failed(
        self, state: PushState, d_rank: int, target: Target, remote: RemotePeer, exc: Exception, note: Note | None
    ) -> None:
        if peer_gone(exc):
            self.links.forget(remote)
        self.ctx.metrics.incr("write.submit_failed")
        self.fail_target(state, d_rank, target, f"WRITE submission failed: {exc!r}")
        self.emit(note, "write.failed", state, level="warning", reason=repr(exc))

    def after_post(self, state: PushState, d_rank: int, target: Target, status: str) -> None:
        """A WRITE finished at post settles now; one still running is polled."""
        if status == "ERR":
            self.settle(state, d_rank, target, ok=False, reason="WRITE ended in ERR at post")
        elif status == "DONE":
            self.settle(state, d_rank, target, ok=True, reason="")
        else:
            self.book.in_flight.append((state, d_rank, target))
            self.last_posted_at = time.monotonic()
            self.spin(target)
            self.wake(0.0)

    def spin(self, target: Target) -> None:
        """Check a just-posted WRITE in a tight loop for up to ``poll_spin``: UCX moves a small
        WRITE (and sends its notification) only while the initiator progresses, so waiting for
        the next tick would add a whole poll interval to every small push."""
        spin = self.config.poll_spin
        if spin <= 0:
            return
        deadline = time.monotonic() + spin
        while target.handle is not None and time.monotonic() < deadline:
            if self.check_in_flight():
                break
        if target.handle is None:
            self.ctx.metrics.incr("write.spin_settled")  # seen ended before any tick

    def emit(self, note: Note | None, event: str, state: PushState, *, level: str = "debug", **fields: Any) -> None:
        """Say what happened: as the handled message's event, or on its own when replayed."""
        if note is not None:
            note(event, level=level, **fields)
        elif wants(level):
            getattr(self.log, level)(event, request_id=state.request_id, replayed=True, **fields)

    # --- settling ----------------------------------------------------------------------------
    def check_in_flight(self) -> int:
        """Settle the WRITEs that ended; how many did."""
        activity = 0
        if self.layered.open:
            for request_id, target in self.layered.advance_all():  # layers whose events completed since
                self.layered.await_end(request_id, target)
        if not self.book.in_flight:
            self.layered.checks_over()
            return 0
        still: list[tuple[PushState, int, Target]] = []
        now = time.monotonic()
        for state, d_rank, target in self.book.in_flight:
            target.checked(now)
            try:
                status = self.poster.state(target.handle)
            except Exception as exc:
                status = "ERR"
                target.reason = f"check_xfer_state raised {exc!r}"
                if target.remote is not None and peer_gone(exc):
                    self.links.forget(target.remote)
            if status in ("PROC", "FAILING"):
                # FAILING: a failed push in chunks ends once its live chunks have: releasing one
                # would not stop bytes already on their way into D's slot (see cancel). One
                # stuck past write_timeout is waited for all the same (expire_stuck).
                still.append((state, d_rank, target))
                continue
            failed = target.handle.failed if isinstance(target.handle, ChunkedWrite) else ""
            ended = f"{target.stuck}; then it ended in ERR" if target.stuck else "WRITE ended in ERR"
            reason = target.reason or failed or ended
            activity += 1
            self.settle(state, d_rank, target, ok=status == "DONE", reason=reason)
        # settle never appends to in_flight, so replacing the list loses nothing.
        self.book.in_flight = still
        self.layered.checks_over()
        return activity

    def settle(self, state: PushState, d_rank: int, target: Target, *, ok: bool, reason: str) -> None:
        if ok and self.ctx.timeline is not None:
            self.ctx.timeline.mark(state.request_id, "p.done", time.monotonic())
        if ok:
            # An engine in wait_for_save goes on once the push landed and its completion left,
            # not after the push is released and reported below.
            self.layered.wake_savers()
        slowest = _slowest_chunk(target.handle) if ok and wants("debug") else {}  # before the release
        if target.handle is not None:
            self.poster.release(target.handle)
            target.handle = None
        if target.staged is not None:
            self.poster.release_resources(target.staged)
            target.staged = None
        released = target.end(ok=ok, reason=reason)
        if released is not None:
            self.links.released(released)
        if ok:
            self.ctx.metrics.incr("write.done")
            self.ctx.metrics.incr("bytes.pushed", target.nbytes)
            if wants("debug"):
                self.log.debug(
                    "write.settled",
                    request_id=state.request_id,
                    d_request_id=target.registration.request_id,
                    ok=True,
                    bytes=target.nbytes,
                    ms=round((time.monotonic() - target.posted_at) * 1e3, 3) if target.posted_at else 0.0,
                    # since the (last layer's) post: NIXL asked this often, at most this long apart
                    checks=target.checks,
                    check_gap_ms=round(target.check_gap * 1e3, 3),
                    seen_ms=round((time.monotonic() - target.checked_at) * 1e3, 3),  # the check that saw it end
                    **slowest,
                )
            self.maybe_finish(state)
            return
        self.ctx.metrics.incr("write.failed")
        self.fail_target(state, d_rank, target, reason)

    def fail_target(self, state: PushState, d_rank: int, target: Target, reason: str, *, finish: bool = True) -> None:
        target.end(ok=False, reason=reason)
        self.tell_d(target.registration, reason)
        self.log.info(
            "write.failed", request_id=state.request_id, d_request_id=target.registration.request_id, reason=reason
        )
        if finish:
            self.maybe_finish(state)

    def fail_waiting(self, state: PushState, reason: str) -> None:
        """Every target not posted yet fails (the request is over for them); no finish here."""
        for d_rank, target in list(state.targets.items()):
            if target.status == "waiting":
                self.fail_target(state, d_rank, target, reason, finish=False)

    def maybe_finish(self, state: PushState) -> None:
        decided = self.book.outcome(state)
        if decided is None:
            return
        outcome, reason = decided
        # Always clear the lease: an expiry the reaper sent has popped it already (a no-op), but
        # one from elsewhere (the matcher's failure, a handler error, draining) has not, and a
        # lease left armed would outlive its request until its deadline.
        self.finish(state.request_id, outcome, reason, serial=state.serial, pinned=state.pinned_ranks)
        self.ctx.metrics.incr("push.latency_us_total", int((time.monotonic() - state.started) * 1e6))

    def finish(self, request_id: str, outcome: str, reason: str, *, serial: int, pinned: tuple[int, ...] = ()) -> None:
        """The request is over on P. ``pinned``: the D ranks told a WRITE "may still land"."""
        ok = outcome == "pushed"
        # Clean-up first, report last: once the engine sees the request finished, its lease and
        # matcher entry are already on their way out (and a reused id cannot overtake them).
        self.ctx.peers.to_reaper(ClearLease(request_id=request_id, serial=serial))
        self.ctx.peers.to_matcher(
            Forget(request_id=request_id, outcome=outcome, serial=serial, pinned=pinned)  # type: ignore[arg-type]
        )
        self.book.close(request_id, outcome, serial, time.monotonic())
        self.layered.forget(request_id, serial)
        self.ctx.outbox.sent(request_id, ok=ok, reason=reason)
        self.ctx.metrics.incr(f"push.{outcome}")
        if ok:
            if wants("debug"):
                self.log.debug("push.finished", request_id=request_id, outcome=outcome)
        else:
            self.log.info("push.finished", request_id=request_id, outcome=outcome, reason=reason)

    def tell_pinned(self, target: Target, reason: str) -> None:
        """Tell D its WRITE may still land (not an answer yet): D keeps the blocks until P's
        final answer, which P's matcher then keeps repeatable (``Target.pinned``)."""
        target.pinned = True
        self.tell_d(target.registration, reason, final=False)

    def tell_d(self, reg: Registration, reason: str, *, final: bool = True) -> None:
        """Send a push failure to the D rank of ``reg`` (now, or after a notif handshake)."""
        if not reg.decode_host and not reg.decode_port:
            return
        if not self.config.trusts(reg.decode_engine_id, reg.decode_host):
            return  # never contact an untrusted address, not even to refuse it
        payload = self.out.push_failure(reg.request_id, reason, final=final, generation=reg.generation)
        peer = d_peer(reg)
        remote = self.links.get(peer)
        if remote is None:
            if not self.links.draining:
                self.links.park(peer, full=False, work=Notify(payload, "push_fail", reg.request_id, peer))
            return
        if self.links.send(remote, payload) is None:
            self.ctx.metrics.incr("push_fail.sent")

    # --- ending early ------------------------------------------------------------------------
    def expire(self, msg: ExpireLease, note: Note) -> None:
        """P's lease on the request is over: no WRITE is posted for it again."""
        state = self.book.pushes.get(msg.request_id)
        if state is not None and msg.serial and state.serial != msg.serial:
            state = None if state.serial < msg.serial else state
            if state is not None:
                note("lease.expired_stale", serial=msg.serial)  # an older incarnation's expiry
                return
        if state is None:
            tomb = self.book.tombstones.get(msg.request_id)
            if tomb is not None and (not msg.serial or msg.serial <= tomb[1]):
                note("lease.expired_after_finish")
                return
            # Finished blocks that never met a registration: nothing in flight, free them.
            outcome = "failed" if msg.failed else "expired"
            self.finish(msg.request_id, outcome, msg.reason, serial=msg.serial)
            note("push.expired", level="info", reason=msg.reason, registered=False)
            return
        state.expired = msg.reason
        state.failed = state.failed or msg.failed
        self.fail_waiting(state, msg.reason)
        self.stop_open(state, msg.reason)
        note("push.expired", level="info", reason=msg.reason, in_flight=state.in_flight)
        self.maybe_finish(state)

    def stop_open(self, state: PushState, why: str) -> None:
        """P's lease on ``state`` is over: a push in flight with parts still to post (a layer-wise
        push whose forward goes on, a staged one still gathering) posts none of them. One fully
        posted settles as its parts end, like a whole WRITE posted before the lease ended."""
        for target in state.targets.values():
            xfer = target.handle
            if target.status == "in_flight" and isinstance(xfer, ChunkedWrite) and xfer.parts_left:
                self.ctx.metrics.incr("write.stopped_open")
                self.stop_parts(xfer, why)

    def fail_request(self, request_id: str, why: str, *, serial: int, expiry: bool) -> None:
        """A handler failed on a message about ``request_id``: end it through the ordinary
        failure path (waiting targets fail, in-flight ones settle, then it finishes)."""
        state = self.book.pushes.get(request_id)
        if state is not None:
            state.expired = state.expired or why
            state.failed = True
            self.fail_waiting(state, why)
            self.stop_open(state, why)
            self.maybe_finish(state)
        elif expiry and request_id not in self.book.tombstones:
            self.finish(request_id, "failed", why, serial=serial)

    # --- cancelling --------------------------------------------------------------------------
    def cancel(self, state: PushState, d_rank: int, target: Target, note: Note) -> None:
        """D aborted this target."""
        if target.status == "waiting":
            self.fail_target(state, d_rank, target, "aborted by decode")
            note("abort.cancelled", level="info")
        elif target.status == "in_flight" and target.handle is not None:
            # The WRITE is let run to its end, and D's blocks are safe only then. Releasing a
            # live handle does not stop bytes already on their way: NIXL's UCX backend cancels
            # the UCX requests (its own comment: "may not be enough"), and a cuda_ipc or RDMA
            # copy already started runs on, so P would tell D "cancelled" while bytes still
            # land in blocks D then reuses. A WRITE takes milliseconds; one still running at
            # pinned_write_limit is released by expire_stuck. D keeps the blocks past its
            # quarantine until P's final answer: the completion, or the failure after it ended.
            # D asks again while it holds them: this is said again each time (its first "may
            # still land" may have been lost).
            if isinstance(target.handle, ChunkedWrite):
                # No further layer or chunk is posted; the push fails once its live ones ended.
                self.stop_parts(target.handle, "aborted by decode")
            self.ctx.metrics.incr("write.abort_awaits_end")
            self.tell_pinned(target, "aborted while its WRITE is in flight; it may still land")
            note("abort.awaiting_write", level="info")
        else:
            note("abort.too_late", status=target.status)

    def expire_stuck(self, now: float) -> None:
        """WRITEs in flight too long, judged from their push's first WRITE (a layer-wise push
        keeps posting as its forward runs, and each layer must not restart the clock).

        Past ``write_timeout`` one is stuck (its peer is likely gone or frozen). It is not
        released for that: NIXL's release returns while a copy already started may run on, and
        nothing tells when it stopped, so D would free blocks a late copy then lands in. P
        posts no further part of the push, tells D the WRITE may still land (D keeps its blocks
        or slot until P's final word) and keeps polling it: the final word goes once NIXL
        reports it ended (check_in_flight). Past ``pinned_write_limit`` it is released anyway.
        """
        timeout = self.config.write_timeout
        limit = self.config.pinned_write_limit
        for state, d_rank, target in list(self.book.in_flight):
            xfer = target.handle
            if isinstance(xfer, ChunkedWrite) and xfer.layerwise and not xfer.handles:
                continue  # no layer written yet: nothing runs, nothing of D's is touched
            age = now - target.posted_at
            if age > timeout and not target.stuck:
                self.judge_stuck(state, target, f"WRITE not done after {timeout:g}s")
            if limit is not None and age >= limit:
                self.release_at_limit(state, d_rank, target, limit)

    def judge_stuck(self, state: PushState, target: Target, why: str) -> None:
        """``target``'s WRITE is stuck: no further part of its push goes, D hears it may still
        land, and it is polled on until NIXL reports it ended (see :meth:`expire_stuck`)."""
        target.stuck = why
        if isinstance(target.handle, ChunkedWrite):
            self.stop_parts(target.handle, why)
        self.ctx.metrics.incr("write.timed_out")
        self.tell_pinned(target, f"{why}; it may still land")
        self.log.warning(
            "write.stuck", request_id=state.request_id, d_request_id=target.registration.request_id, reason=why
        )

    def release_at_limit(self, state: PushState, d_rank: int, target: Target, limit: float) -> None:
        """A WRITE still running ``limit`` (``pinned_write_limit``) after its push's first post
        is released and fails: the explicit bound on how long any WRITE is assumed to run, the
        same D keeps blocks by for a WRITE said to "may still land". NIXL cannot say whether the
        copy stops, so it is counted and said at error level: it is what this bound leaves open."""
        if self.config.nixl_sgl:
            # nixl 1.5.1: a WRITE released in flight with NIXL_UCX_SGL_ENABLE crashes the
            # process soon after (docs/nixl.md). It stays pinned: D holds its blocks until its
            # own pinned_write_limit, P its own until the WRITE ends or P goes down.
            target.release_attempts += 1
            if target.release_attempts == 1:
                self.ctx.metrics.incr("write.cancel_unsafe")
                self.log.error("write.cancel_unsafe", request_id=state.request_id, reason="nixl_sgl is on")
            return
        try:
            self.poster.release_or_raise(target.handle)
        except Exception as exc:
            self.ctx.metrics.incr("write.release_refused")
            target.release_attempts += 1
            # Retried every housekeeping pass: say it once, then quietly.
            level = "error" if target.release_attempts == 1 else "debug"
            getattr(self.log, level)(
                "write.release_refused", request_id=state.request_id, attempts=target.release_attempts, error=repr(exc)
            )
            return
        target.handle = None
        self.book.stop_tracking(target)
        self.ctx.metrics.incr("write.released_at_pin_limit")
        self.log.error(
            "write.released_at_pin_limit",
            request_id=state.request_id,
            d_request_id=target.registration.request_id,
            limit_s=limit,
        )
        self.settle(state, d_rank, target, ok=False, reason=f"WRITE still running at pinned_write_limit {limit:g}s")

    # --- parked WRITEs -----------------------------------------------------------------------
    def parked(self, work: DeliverPush) -> tuple[PushState | None, Target | None]:
        """The push and target a parked WRITE belongs to: that incarnation of the P id, to that
        D address, or none (an ended incarnation's work never touches the next one's)."""
        state = self.book.pushes.get(work.request_id)
        if state is None or state.serial != work.serial:
            return None, None
        target = state.targets.get(work.d_rank)
        if target is None or (work.peer is not None and d_peer(target.registration) != work.peer):
            return None, None
        return state, target

    def replay(self, work: DeliverPush) -> None:
        """The handshake a WRITE waited for is done: post it, if it may still be posted."""
        state, target = self.parked(work)
        if state is None or target is None or target.status != "waiting":
            return  # expired or cancelled while the handshake ran: no WRITE
        if state.expired or self.book.ended(work.request_id, state.serial):
            self.fail_target(state, work.d_rank, target, state.expired or "request already finished on P")
            return
        if time.monotonic() - target.fresh_at > self.config.lease_duration * 2 / 3:
            # The handshake took long: D may have aborted meanwhile (its abort lost) and
            # reused the blocks after its quarantine. Re-check before writing.
            self.ctx.metrics.incr("write.stale_replay")
            self.fail_target(state, work.d_rank, target, "registration went stale while P handshook with D")
            return
        remote = self.links.get(d_peer(target.registration))
        if remote is None or (target.sender and remote.agent_name != target.sender):
            self.fail_target(state, work.d_rank, target, "D agent unavailable or changed")
            return
        self.post(state, work.d_rank, target, remote, None)
        if wants("debug"):
            self.log.debug("write.replayed", request_id=work.request_id, d_rank=work.d_rank, status=target.status)

    def unparkable(self, work: DeliverPush, reason: str) -> None:
        """D cannot be reached to be told; its watchdog and our lease bound it."""
        state, target = self.parked(work)
        if state is not None and target is not None and target.status == "waiting":
            target.end(ok=False, reason=reason)
            self.maybe_finish(state)

    # --- stopping ----------------------------------------------------------------------------
    def cancel_all_in_flight(self) -> int:
        """At shutdown, past the drain's deadline: cancel what is still in flight; how many."""
        cancelled = 0
        for state, d_rank, target in self.book.in_flight:
            cancelled += 1
            # The process is going down: a WRITE still running at the deadline is cancelled
            # and its request failed, so the engine's shutdown is bounded (fault 31). Unlike an
            # abort or a dead actor (whose engine keeps serving), nothing reuses these blocks
            # afterwards. Never release an SGL WRITE in flight (see release_at_limit); one NIXL
            # will not cancel may still read this request's blocks: neither is ever reported.
            if self.config.nixl_sgl or (target.handle is not None and not self.poster.release(target.handle)):
                self.ctx.unreleased.add(state.request_id)
                self.log.critical("write.unreleased_at_stop", request_id=state.request_id)
                why = "WRITE not cancellable at P's shutdown; it may still land"
                self.tell_pinned(target, why)
                self.book.pushes.pop(state.request_id, None)  # never finished: never reported
                target.handle = None
                continue
            target.handle = None
            self.settle(state, d_rank, target, ok=False, reason="cancelled at shutdown")
        self.book.in_flight = []
        return cancelled

    def release_in_flight(self) -> None:
        """The writer stops: release every WRITE still held, without settling it."""
        for state, _, target in self.book.in_flight:
            # D hears nothing from a stopped writer, so it never frees blocks on P's word: a
            # copy running on after a release lands only in blocks D still holds. What must
            # not happen is a WRITE NIXL refused to release (or an SGL one, never released in
            # flight) reading blocks the engine reused: such a request is never reported.
            if target.handle is not None and (self.config.nixl_sgl or not self.poster.release(target.handle)):
                self.ctx.unreleased.add(state.request_id)
                self.log.critical("write.unreleased_at_stop", request_id=state.request_id)
            target.handle = None
            if target.staged is not None:
                self.poster.release_resources(target.staged)
                target.staged = None
        self.book.in_flight = []


def _slowest_chunk(handle: Any) -> dict[str, Any]:
    """A WRITE of several chunks (a layer-wise or chunked staged push): the chunk that took
    longest from its post to being seen DONE, and how long."""
    if not isinstance(handle, ChunkedWrite) or len(handle.handles) < 2 or handle.slowest[1] < 0:
        return {}
    took, index = handle.slowest
    return {"slowest_chunk": index, "slowest_chunk_ms": round(took * 1e3, 3), "chunks": len(handle.handles)}
