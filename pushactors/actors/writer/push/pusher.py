"""P's pushes, carried out on the writer's thread: post, settle, expire, cancel.

:class:`Pusher` turns the decisions of :class:`~.book.PushBook` (which target may be posted,
when a request is over and how) into NIXL calls through
:class:`~pushactors.actors.writer.poster.Poster` and into the messages that end a request (the
reaper's ``ClearLease``, the matcher's ``Forget``, the engine's outbox, a push failure to D).
A push goes one of three ways (:mod:`.direct`, :mod:`.staged`, :mod:`.layered`); each returns
what its post came to (:mod:`.outcome`) and :meth:`Pusher.apply` alone records it.

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

from ....logs import wants
from ....protocol import ClearLease, ExpireLease, Forget, Gathered, LayersReady, PostPush, Registration
from ....transport.agent import PeerDisconnected
from ...base import Note, RankContext
from ..links import Links
from ..outbound import Outbound
from ..poster import Poster
from ..remotes import DeliverPush, Notify, RemotePeer, d_peer
from ..verify import PendingDigest
from .book import PAST_DEADLINE, PushBook, PushState, Target
from .direct import DirectWrites
from .layered import Advanced, LayerWrites
from .outcome import Complete, Outcome, Posted, Refused, SubmitFailed
from .posting import Posting
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
        self.posting = Posting(ctx, log, poster, out, book, wake)
        self.direct = DirectWrites(self.posting)
        self.staged = StagedWrites(self.posting)
        self.layered = LayerWrites(self.posting)

    @property
    def last_posted_at(self) -> float:
        """When the last WRITE still running after its spin was posted."""
        return self.posting.last_posted_at

    @last_posted_at.setter
    def last_posted_at(self, at: float) -> None:
        self.posting.last_posted_at = at

    # --- posting -----------------------------------------------------------------------------
    def post(self, target: Target, remote: RemotePeer, note: Note | None, planned: PostPush | None = None) -> None:
        """Post the WRITE of ``target``: the plan ``planned`` carries when it was made on the
        pairing this remote holds now, else one made here."""
        started = time.monotonic()
        if self.refused_past_deadline(target, started, note):
            return
        push = target.push
        if self.layered.announced(push.request_id, push.serial):
            self.apply(target, self.layered.post(target, remote, note), note)
            self.follow(self.layered.advance_opened(target), note)  # its computed layers go now
            self.spin_last()
        elif target.registration.staging_slot is not None:
            self.apply(target, self.staged.post(target, remote), note)
        else:
            self.apply(target, self.direct.post(target, remote, started, planned), note)

    def refused_past_deadline(self, target: Target, now: float, note: Note | None) -> bool:
        """A target not posted yet whose D deadline passed fails (D is told); True if it did."""
        if not self.posting.past_deadline(target, now):
            return False
        self.ctx.metrics.incr("write.past_deadline")
        self.fail_target(target, PAST_DEADLINE)
        self.emit(note, "write.refused", target, level="warning", reason="past D's deadline")
        return True

    def apply(self, target: Target, outcome: Outcome, note: Note | None) -> None:
        """Carry out what a push mode's post of ``target`` came to: the one place a post is
        recorded, a target settled by its completion alone, or failed for its post."""
        if isinstance(outcome, Posted):
            self._posted(target, outcome, note)
        elif isinstance(outcome, Complete):
            # Nothing to copy into this D rank: the completion alone settles the target.
            self.poster.send(outcome.remote.agent_name, outcome.completion)
            target.remote = outcome.remote
            self.settle(target, ok=True, reason="")
            self.emit(note, "write.empty", target)
        elif isinstance(outcome, Refused):
            self.ctx.metrics.incr("write.refused")
            self.fail_target(target, f"invalid WRITE: {outcome.exc}")
            self.emit(note, "write.refused", target, level="warning", reason=str(outcome.exc))
        elif isinstance(outcome, SubmitFailed):
            if isinstance(outcome.exc, PeerDisconnected):
                self.links.forget(outcome.remote)
            self.ctx.metrics.incr("write.submit_failed")
            self.fail_target(target, f"WRITE submission failed: {outcome.exc!r}")
            self.emit(note, "write.failed", target, level="warning", reason=repr(outcome.exc))
        # Pending: nothing posted yet, nothing to record.

    def _posted(self, target: Target, posted: Posted, note: Note | None) -> None:
        """A WRITE is on its way, however it was planned: the target holds it, it is counted
        (``write.posted``, and its kind) and said once as ``write.posted`` (when someone reads
        it). One that ended at its post settles now; one still running is polled."""
        target.staged = posted.resources
        target.posted(posted.handle, posted.remote, posted.nbytes, posted.at)
        self.ctx.metrics.incr("write.posted")
        if posted.kind:
            self.ctx.metrics.incr(posted.kind)
        if posted.fields is not None:
            said: dict[str, Any] = {"d_request_id": target.registration.request_id, "d_rank": target.d_rank}
            self.emit(note, "write.posted", target, **said, bytes=posted.nbytes, **posted.fields)
        if posted.digest is not None and posted.status != "ERR":
            self.send_digest(posted.digest, posted.remote, target.push.request_id)
        if posted.status == "ERR":
            self.settle(target, ok=False, reason="WRITE ended in ERR at post")
        elif posted.status == "DONE":
            self.settle(target, ok=True, reason="")
        else:
            self.book.track(target)
            if posted.spin:
                self.posting.last_posted_at = time.monotonic()
                self.spin(target)
            self.wake(0.0)
        for gather in posted.gathers:  # every array first, the stager's work last (a GIL convoy otherwise)
            self.ctx.peers.to_stager(gather)

    def send_digest(self, pending: PendingDigest, remote: RemotePeer, request_id: str) -> None:
        """A verified WRITE's digest, computed while the WRITE flies and sent after it. One
        that cannot be computed goes empty: D lands the request unverified, and says so."""
        try:
            digest = self.posting.digests.compute(pending)
        except Exception as exc:  # a piece outside the tensors, or the device failed
            self.ctx.metrics.incr("write.digest_failed")
            self.log.warning("write.digest_failed", request_id=pending.request_id, reason=repr(exc)[:200])
            digest = ()
        if self.links.send(remote, self.out.push_digest(pending.request_id, pending.generation, digest)) is None:
            self.ctx.metrics.incr("push_digest.sent")
        if self.ctx.timeline is not None:
            self.ctx.timeline.mark(request_id, "p.digested", time.monotonic())

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

    def spin_last(self) -> None:
        """Check the last layer WRITEs a handler just posted in a tight loop, as a whole push's
        WRITE is: UCX finishes one (and sends the completion riding on it) only while P
        progresses, and that end is what D, and an engine in wait_for_save, wait for. Called by
        message handlers only, never from a poll (a spin polls, and must not nest)."""
        while (target := self.layered.pop_last()) is not None:
            self.spin(target)

    def emit(self, note: Note | None, event: str, target: Target, *, level: str = "debug", **fields: Any) -> None:
        """Say what happened: as the handled message's event, or on its own when replayed."""
        self.posting.emit(note, event, target.push.request_id, level=level, **fields)

    # --- the parts of staged and layer-wise pushes -------------------------------------------
    def gathered(self, msg: Gathered, note: Note) -> None:
        """The stager gathered a chunk of a staged push: post it."""
        gone = self.staged.gathered(msg, note)
        if gone is not None:
            self.links.forget(gone)

    def layers_ready(self, msg: LayersReady, note: Note) -> None:
        """The forward computed more layer groups: post what became ready."""
        posted = 0
        held = False
        try:
            advanced = self.layered.mark(msg)
            posted = advanced.posted
            self.follow(advanced, None)
            held = self.layered.hold(msg)
            self.spin_last()
        finally:
            if msg.saved is not None and not held:
                msg.saved.set()  # nothing of this step is on its way: the engine goes on
        self.layered.said(msg, posted, note)

    def follow(self, advanced: Advanced, note: Note | None) -> None:
        """Carry out what posting layer groups left: peers NIXL said are gone are forgotten,
        and a staged push whose every layer is in posts its image (its first WRITE, checked
        against D's deadline as any first one is)."""
        for remote in advanced.gone:
            self.links.forget(remote)
        for remote, pending, request_id in advanced.digests:
            self.send_digest(pending, remote, request_id)
        for entry in advanced.due:
            target = entry.target
            if target.status == "waiting" and not self.refused_past_deadline(target, time.monotonic(), note):
                self.apply(target, self.staged.post(target, entry.remote), note)

    # --- settling ----------------------------------------------------------------------------
    def check_in_flight(self) -> int:
        """Settle the WRITEs that ended; how many did."""
        activity = 0
        layered = self.layered
        if layered.open:
            advanced = layered.advance_all()  # layers whose events completed since
            self.follow(advanced, None)
            for target in advanced.last:
                layered.await_end(target)
        if not self.book.in_flight:
            layered.checks_over()
            return 0
        still: list[Target] = []
        now = time.monotonic()
        for target in self.book.in_flight:
            target.checked(now)
            xfer = target.handle
            try:
                status = self.poster.state(xfer) if xfer is not None else "ERR"
            except Exception as exc:
                status = "ERR"
                target.reason = f"check_xfer_state raised {exc!r}"
                if target.remote is not None and isinstance(exc, PeerDisconnected):
                    self.links.forget(target.remote)
            if status in ("PROC", "FAILING"):
                # FAILING: a failed push in chunks ends once its live chunks have: releasing one
                # would not stop bytes already on their way into D's slot (see cancel). One
                # stuck past write_timeout is waited for all the same (expire_stuck).
                still.append(target)
                continue
            failed = xfer.failed if xfer is not None else ""
            ended = f"{target.stuck}; then it ended in ERR" if target.stuck else "WRITE ended in ERR"
            reason = target.reason or failed or ended
            activity += 1
            self.settle(target, ok=status == "DONE", reason=reason)
        # settle never tracks a WRITE, so replacing the list loses nothing.
        self.book.keep_polling(still)
        layered.checks_over()
        return activity

    def settle(self, target: Target, *, ok: bool, reason: str) -> None:
        push = target.push
        if ok and self.ctx.timeline is not None:
            self.ctx.timeline.mark(push.request_id, "p.done", time.monotonic())
        if ok:
            # An engine in wait_for_save goes on once the push landed and its completion left,
            # not after the push is released and reported below.
            self.layered.wake_savers()
        handle = target.handle
        slowest = handle.slowest_chunk() if ok and handle is not None and wants("debug") else {}  # before the release
        if handle is not None:
            self.poster.release(handle)
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
                    request_id=push.request_id,
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
            self.maybe_finish(push)
            return
        self.ctx.metrics.incr("write.failed")
        self.fail_target(target, reason)

    def fail_target(self, target: Target, reason: str, *, finish: bool = True) -> None:
        target.end(ok=False, reason=reason)
        self.tell_d(target.registration, reason)
        self.log.info(
            "write.failed",
            request_id=target.push.request_id,
            d_request_id=target.registration.request_id,
            reason=reason,
        )
        if finish:
            self.maybe_finish(target.push)

    def fail_waiting(self, state: PushState, reason: str) -> None:
        """Every target not posted yet fails (the request is over for them); no finish here."""
        for target in list(state.targets.values()):
            if target.status == "waiting":
                self.fail_target(target, reason, finish=False)

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
            if target.status == "in_flight" and xfer is not None and xfer.parts_left:
                self.ctx.metrics.incr("write.stopped_open")
                self.posting.stop_parts(xfer, why)

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
        elif expiry and self.book.ended(request_id, serial) is None:
            # This incarnation never ended (an earlier one's tombstone does not speak for it).
            self.finish(request_id, "failed", why, serial=serial)

    # --- cancelling --------------------------------------------------------------------------
    def cancel(self, target: Target, note: Note) -> None:
        """D aborted this target."""
        if target.status == "waiting":
            self.fail_target(target, "aborted by decode")
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
            # still land" may have been lost). No further layer or chunk is posted; a push in
            # parts fails once its live ones ended.
            self.posting.stop_parts(target.handle, "aborted by decode")
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
        for target in list(self.book.in_flight):
            xfer = target.handle
            if xfer is not None and xfer.untouched:
                continue  # no layer written yet: nothing runs, nothing of D's is touched
            age = now - target.posted_at
            if age > timeout and not target.stuck:
                self.judge_stuck(target, f"WRITE not done after {timeout:g}s")
            if limit is not None and age >= limit:
                self.release_at_limit(target, limit)

    def judge_stuck(self, target: Target, why: str) -> None:
        """``target``'s WRITE is stuck: no further part of its push goes, D hears it may still
        land, and it is polled on until NIXL reports it ended (see :meth:`expire_stuck`)."""
        target.stuck = why
        if target.handle is not None:
            self.posting.stop_parts(target.handle, why)
        self.ctx.metrics.incr("write.timed_out")
        self.tell_pinned(target, f"{why}; it may still land")
        self.log.warning(
            "write.stuck", request_id=target.push.request_id, d_request_id=target.registration.request_id, reason=why
        )

    def release_at_limit(self, target: Target, limit: float) -> None:
        """A WRITE still running ``limit`` (``pinned_write_limit``) after its push's first post
        is released and fails: the explicit bound on how long any WRITE is assumed to run, the
        same D keeps blocks by for a WRITE said to "may still land". NIXL cannot say whether the
        copy stops, so it is counted and said at error level: it is what this bound leaves open."""
        request_id = target.push.request_id
        if self.config.nixl_sgl:
            # nixl 1.5.1: a WRITE released in flight with NIXL_UCX_SGL_ENABLE crashes the
            # process soon after (docs/nixl.md). It stays pinned: D holds its blocks until its
            # own pinned_write_limit, P its own until the WRITE ends or P goes down.
            target.release_attempts += 1
            if target.release_attempts == 1:
                self.ctx.metrics.incr("write.cancel_unsafe")
                self.log.error("write.cancel_unsafe", request_id=request_id, reason="nixl_sgl is on")
            return
        try:
            if target.handle is not None:
                self.poster.release_or_raise(target.handle)
        except Exception as exc:
            self.ctx.metrics.incr("write.release_refused")
            target.release_attempts += 1
            # Retried every housekeeping pass: say it once, then quietly.
            level = "error" if target.release_attempts == 1 else "debug"
            getattr(self.log, level)(
                "write.release_refused", request_id=request_id, attempts=target.release_attempts, error=repr(exc)
            )
            return
        target.handle = None
        self.book.stop_tracking(target)
        self.ctx.metrics.incr("write.released_at_pin_limit")
        self.log.error(
            "write.released_at_pin_limit",
            request_id=request_id,
            d_request_id=target.registration.request_id,
            limit_s=limit,
        )
        self.settle(target, ok=False, reason=f"WRITE still running at pinned_write_limit {limit:g}s")

    # --- parked WRITEs -----------------------------------------------------------------------
    def parked(self, work: DeliverPush) -> Target | None:
        """The target a parked WRITE belongs to: of that incarnation of the P id, to that D
        address, or none (an ended incarnation's work never touches the next one's)."""
        state = self.book.pushes.get(work.request_id)
        if state is None or state.serial != work.serial:
            return None
        target = state.targets.get(work.d_rank)
        if target is None or (work.peer is not None and d_peer(target.registration) != work.peer):
            return None
        return target

    def replay(self, work: DeliverPush) -> None:
        """The handshake a WRITE waited for is done: post it, if it may still be posted."""
        target = self.parked(work)
        if target is None or target.status != "waiting":
            return  # expired or cancelled while the handshake ran: no WRITE
        state = target.push
        if state.expired or self.book.ended(work.request_id, state.serial):
            self.fail_target(target, state.expired or "request already finished on P")
            return
        if time.monotonic() - target.fresh_at > self.config.lease_duration * 2 / 3:
            # The handshake took long: D may have aborted meanwhile (its abort lost) and
            # reused the blocks after its quarantine. Re-check before writing.
            self.ctx.metrics.incr("write.stale_replay")
            self.fail_target(target, "registration went stale while P handshook with D")
            return
        remote = self.links.get(d_peer(target.registration))
        if remote is None or (target.sender and remote.agent_name != target.sender):
            self.fail_target(target, "D agent unavailable or changed")
            return
        self.post(target, remote, None)
        if wants("debug"):
            self.log.debug("write.replayed", request_id=work.request_id, d_rank=work.d_rank, status=target.status)

    def unparkable(self, work: DeliverPush, reason: str) -> None:
        """D cannot be reached to be told; its watchdog and our lease bound it."""
        target = self.parked(work)
        if target is not None and target.status == "waiting":
            target.end(ok=False, reason=reason)
            self.maybe_finish(target.push)

    # --- stopping ----------------------------------------------------------------------------
    def cancel_all_in_flight(self) -> int:
        """At shutdown, past the drain's deadline: cancel what is still in flight; how many."""
        cancelled = 0
        for target in self.book.take_in_flight():
            cancelled += 1
            request_id = target.push.request_id
            # The process is going down: a WRITE still running at the deadline is cancelled
            # and its request failed, so the engine's shutdown is bounded (fault 31). Unlike an
            # abort or a dead actor (whose engine keeps serving), nothing reuses these blocks
            # afterwards. Never release an SGL WRITE in flight (see release_at_limit); one NIXL
            # will not cancel may still read this request's blocks: neither is ever reported.
            if self.config.nixl_sgl or (target.handle is not None and not self.poster.release(target.handle)):
                self.ctx.unreleased.add(request_id)
                self.log.critical("write.unreleased_at_stop", request_id=request_id)
                why = "WRITE not cancellable at P's shutdown; it may still land"
                self.tell_pinned(target, why)
                self.book.pushes.pop(request_id, None)  # never finished: never reported
                target.handle = None
                continue
            target.handle = None
            self.settle(target, ok=False, reason="cancelled at shutdown")
        return cancelled

    def release_in_flight(self) -> None:
        """The writer stops: release every WRITE still held, without settling it."""
        for target in self.book.take_in_flight():
            # D hears nothing from a stopped writer, so it never frees blocks on P's word: a
            # copy running on after a release lands only in blocks D still holds. What must
            # not happen is a WRITE NIXL refused to release (or an SGL one, never released in
            # flight) reading blocks the engine reused: such a request is never reported.
            if target.handle is not None and (self.config.nixl_sgl or not self.poster.release(target.handle)):
                self.ctx.unreleased.add(target.push.request_id)
                self.log.critical("write.unreleased_at_stop", request_id=target.push.request_id)
            target.handle = None
            if target.staged is not None:
                self.poster.release_resources(target.staged)
                target.staged = None
