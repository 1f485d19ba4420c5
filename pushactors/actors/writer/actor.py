"""The writer: the only actor that touches the rank's NIXL agent.

A thin shell of handlers over plain classes that run on its thread:

* :class:`~.poster.Poster` — the NIXL agent itself: memory, prepared lists, posting, states,
  releases (of the WRITEs in :mod:`.writes`);
* :class:`~.links.Links` — remote ranks: handshakes applied, work parked behind them, peers
  forgotten and evicted;
* :class:`~.inbound.Inbound` — inbound notifications decoded and routed;
* :class:`~.push.pusher.Pusher` over :class:`~.push.book.PushBook` — P's pushes posted (direct,
  staged or layer-wise: :mod:`.push`), settled, expired, cancelled;
* :class:`~.answers.Answers` — what D awaits from which P rank.

Nothing here blocks on a handshake: work that needs a remote agent not loaded yet is parked
under that peer, the handshake actor is asked once, and its completion (a message) replays the
parked work; its failure fails it. The writer polls NIXL on its own tick: tightly while WRITEs
are in flight or an answer is awaited, backing off when idle.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...core.topology import TopologyError, registration_sources
from ...protocol import (
    AnswerAbort,
    CancelPush,
    Drain,
    EvictIdleEngines,
    ExpectTraffic,
    ExpireLease,
    Gathered,
    HandshakeCompleted,
    HandshakeFailed,
    LayersReady,
    MemoryRegistered,
    PeerKey,
    PostPush,
    RecvUndelivered,
    RefuseRegistration,
    RegisterMemory,
    Released,
    SendAbort,
    SendHeartbeats,
    SendRegistration,
)
from ...transport.agent import AgentFactory
from ...transport.auth import Keyring
from ..base import Note, PushActor, RankContext, handles
from ..inbox import Tick
from .answers import Answers
from .cadence import PollCadence
from .inbound import Inbound
from .links import Links
from .outbound import Outbound
from .poster import Poster
from .push.book import PushBook
from .push.pusher import Pusher
from .remotes import AdmitReg, CheckDeath, DeliverPush, DeliverReg, Notify, Work, d_peer


class Writer(PushActor):
    actor_name = "writer"
    hot_path = True

    def __init__(self, ctx: RankContext, agent_factory: AgentFactory) -> None:
        super().__init__(ctx)
        config = ctx.config
        self.poster = Poster(ctx, agent_factory, self.log)
        self.book = PushBook(tombstone_ttl=config.tombstone_ttl)
        self.answers = Answers(
            poll_await=config.poll_await, horizon=config.registration_timeout + config.abort_quarantine
        )
        self.out = Outbound(Keyring.from_config(config), tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, tp_size=ctx.tp_size)
        self.links = Links(ctx, self.log, self.poster, self.out, self.book.busy_peers, self.answers)
        self.links.replay, self.links.fail_work = self._replay, self._fail_work
        self.inbound = Inbound(ctx, self.log, self.out, self.links, self.answers, self.poster)
        self.pusher = Pusher(ctx, self.log, self.poster, self.links, self.book, self.out, self.arm_tick)
        self.cadence = PollCadence(config)
        self.timer_slack_s: float | None = None  # this thread's, once started (None: unknown)
        self.native_thread_id = 0  # the writer thread's, once started (top -H, /proc/<pid>/task)
        self._next_housekeeping = 0.0

    # --- lifecycle ---------------------------------------------------------------------------
    def on_start(self) -> None:
        self.native_thread_id = threading.get_native_id()
        was, self.timer_slack_s = self.cadence.own_thread()
        if was is not None and self.timer_slack_s is not None and was != self.timer_slack_s:
            self.log.info("writer.timer_slack", was_us=round(was * 1e6, 3), now_us=round(self.timer_slack_s * 1e6, 3))
        self.poster.start()
        self.ctx.handoff.wake_writer = self._poll_now
        self.ctx.handoff.rouse_writer = self._rouse
        self.arm_tick(self.config.poll_interval_idle)

    def _poll_now(self) -> None:
        """An engine hook lends the interpreter and waits for a poll: bring the next one
        forward (called from the engine's thread; arming a tick is safe from any thread)."""
        self.arm_tick(0.0)

    def _rouse(self) -> None:
        """The engine stepped with work while this writer slept deep: poll within the idle
        interval from now on (the engine's thread; arming a tick is safe from any thread)."""
        self.arm_tick(self.config.poll_interval_idle)

    def on_stop(self) -> None:
        self._release_all()

    def on_receive(self, message: Any) -> Any:
        if not isinstance(message, Tick) and self.cadence.stirred(time.monotonic()):
            # A message after a deep sleep: poll within the idle interval again.
            self.ctx.handoff.deep = False
            self.arm_tick(self.config.poll_interval_idle)
        return super().on_receive(message)

    @property
    def agent(self) -> Any:
        return self.poster.agent

    @handles(RegisterMemory)
    def _register_memory(self, msg: RegisterMemory, note: Note) -> MemoryRegistered:
        reply, capacity = self.poster.register(msg)
        if reply.error:
            note("memory.register_failed", level="error", error=reply.error)
            return reply
        assert self.poster.layout is not None
        self.inbound.sized(capacity, self.poster.layout.num_groups)
        note(
            "memory.registered",
            level="info",
            regions=len(msg.regions),
            bytes=sum(m.length for m in msg.memory),
            mem_type=msg.mem_type,
        )
        return reply

    # --- polling -------------------------------------------------------------------------------
    def _linger(self) -> None:
        """Poll at the busy interval for ``poll_busy_linger`` seconds: an answer is expected."""
        self.cadence.linger(time.monotonic())
        self.arm_tick(self.config.poll_interval_busy)

    def on_tick(self, now: float) -> None:
        handoff = self.ctx.handoff
        if handoff.roused:
            # An engine step with work roused this writer: quiet starts again from here, so it
            # polls at the idle interval while that work may bring traffic.
            handoff.roused = False
            self.cadence.stirred(now)
        handoff.poll_started()
        try:
            activity = self._poll()
        finally:
            self.after_message()
            handoff.poll_ended()
        if activity:
            self._linger()  # traffic comes in bursts (a registration, then its blocks)
        if now >= self._next_housekeeping:
            self._housekeeping(now)
            self._next_housekeeping = now + self.config.reaper_tick
        self.arm_tick(self.next_poll_delay(now, activity))
        handoff.deep = self.cadence.deep

    def after_message(self) -> None:
        # What an engine hook that lends the interpreter waits on (core/handoff.py).
        handoff = self.ctx.handoff
        # Posted WRITEs not seen to end: not a layer-wise push still waiting for its forward.
        handoff.in_flight = sum(1 for t in self.book.in_flight if t.handle is not None and t.handle.writing)
        handoff.awaited = len(self.answers.awaiting)

    def next_poll_delay(self, now: float, activity: int = 0) -> float:
        """Seconds to the next poll (:class:`~.cadence.PollCadence`)."""
        in_flight = bool(self.book.in_flight)
        return self.cadence.delay(
            now,
            just_posted=in_flight and now - self.pusher.last_posted_at < self.config.poll_spin_in_flight,
            awaiting=lambda: bool(self.answers.awaiting) or self.pusher.layered.awaiting_last(),
            in_flight=in_flight,
            activity=activity,
            holds_nothing=self._holds_nothing,
        )

    def _holds_nothing(self) -> bool:
        """No state of the writer's waits on a timer (its housekeeping has nothing to do), and
        the matcher holds no finished request whose registration may come in any moment (a
        hint it publishes for the engine's hooks: an engine that stops stepping while its
        push waits must not leave the registration to a deep sleep)."""
        return not (
            self.ctx.handoff.held
            or self.book.pushes
            or self.answers.awaiting
            or self.answers.death_retries
            or self.links.table.awaiting
            or any(self.pusher.layered.sizes().values())
        )

    def _poll(self) -> int:
        """Settle finished WRITEs, then route new notifications. A NIXL call that raises here
        propagates: the tick fails, and a rank whose ticks keep failing turns unhealthy."""
        agent = self.poster.agent
        if agent is None:
            return 0
        self.inbound.polling(time.monotonic())
        activity = self.pusher.check_in_flight()
        try:
            notifs = agent.get_new_notifs()
        except Exception:
            self.ctx.metrics.incr("writer.poll_error")
            raise
        if notifs:
            self.inbound.read(time.monotonic())
        return activity + self.inbound.route_all(notifs)

    def _housekeeping(self, now: float) -> None:
        self.pusher.expire_stuck(now)
        self.answers.prune(now)
        self.book.prune(now)
        self.pusher.layered.prune(now - 2 * self.config.lease_duration)
        if not self.links.draining:
            for check in self.answers.due_checks(now):
                self.links.park(check.peer, full=False, work=check)

    # --- D: registrations, heartbeats, aborts -------------------------------------------------
    @handles(SendRegistration)
    def _send_registration(self, msg: SendRegistration, note: Note) -> None:
        reg = msg.registration
        try:
            sources = registration_sources(
                reg.decode_tp_rank, reg.decode_tp_size, reg.remote_tp_size, reg.remote_pp_size
            )
        except TopologyError as exc:
            self.ctx.peers.to_reaper(RecvUndelivered(request_id=reg.request_id, count=1 << 30, reason=str(exc)))
            note("reg.unsendable", level="warning", reason=str(exc))
            return
        # Before it goes: no completion can answer it earlier.
        self.inbound.verifier.expect(reg, self.poster.layout)
        payload = self.out.registration(reg)
        sent = parked = failed = 0
        reason = ""
        for pp, tp in sources:
            peer = PeerKey(reg.remote_engine_id, reg.remote_host, reg.remote_port, pp, tp)
            remote = self.links.get(peer)
            if self.links.draining:
                failed, reason = failed + 1, "shutting down"
                continue
            if remote is None:
                self.links.park(peer, full=False, work=DeliverReg(reg, peer))
                parked += 1
                continue
            err = self.links.send(remote, payload)
            if err and remote.gone:
                # The agent we held for that P rank is gone (P restarted, or died): the
                # registration never reached it. Ask the rank again and resend it once.
                self.ctx.metrics.incr("reg.resent_after_peer_gone")
                self.links.park(peer, full=False, work=DeliverReg(reg, peer, retried=True))
                parked += 1
            elif err:
                failed += 1
                reason = f"sending PUSH_REG to {remote.agent_name} failed: {err}"
            else:
                sent += 1
                self.answers.sent(peer, reg.request_id, time.monotonic())
        if failed:
            self.ctx.peers.to_reaper(RecvUndelivered(request_id=reg.request_id, count=failed, reason=reason))
        if sent:
            self._linger()  # its completion is on the way: pick it up without idle back-off
        note("reg.sent" if not parked else "reg.parked", sent=sent, parked=parked, failed=failed)

    @handles(SendHeartbeats)
    def _send_heartbeats(self, msg: SendHeartbeats, note: Note) -> None:
        sent = skipped = 0
        promise = time.monotonic() + self.config.registration_keep  # D keeps their blocks until then
        for payload in self.out.heartbeats(msg.ids, promise):
            for peer in msg.peers:
                remote = self.links.get(peer)
                if remote is None or self.links.send(remote, payload):
                    skipped += 1
                else:
                    sent += 1
        self.ctx.metrics.incr("heartbeat.sent", sent)
        note("heartbeat.sent", ids=len(msg.ids), sent=sent, skipped=skipped)

    @handles(SendAbort)
    def _send_abort(self, msg: SendAbort, note: Note) -> None:
        self.answers.heard(msg.abort.request_id)  # D gave up: P's answer may never come
        self.inbound.verifier.forget(msg.abort.request_id, msg.abort.generation)
        payload = self.out.abort(msg.abort)
        sent = unparked = parked = 0
        for peer in msg.peers:
            dropped = self.links.table.unpark_registration(peer, msg.abort.request_id)
            if dropped:
                unparked += dropped
                continue
            remote = self.links.get(peer)
            if remote is None and not self.links.draining:
                # Its registration went out, and NIXL has since reported that agent gone. The
                # abort waits for the next handshake with the rank (the death check's): a P
                # alive behind a link that broke hears it and answers, which frees D's blocks
                # long before the quarantine ends; a dead one never will.
                self.links.park(peer, full=False, work=Notify(payload, "abort", msg.abort.request_id, peer))
                parked += 1
            elif remote is not None and not self.links.send(remote, payload):
                sent += 1
        if unparked:
            # Never delivered, so those P ranks will never answer: stop waiting for them.
            self.ctx.peers.to_reaper(
                RecvUndelivered(request_id=msg.abort.request_id, count=unparked, reason="aborted before delivery"),
            )
        note("abort.sent", sent=sent, unparked=unparked, parked=parked)

    # --- P: pushes -----------------------------------------------------------------------------
    @handles(PostPush)
    def _post_push(self, msg: PostPush, note: Note) -> None:
        reg = msg.registration
        d_rank = reg.decode_tp_rank
        note.fields.update(d_request_id=reg.request_id, d_rank=d_rank)
        state, target, refused = self.book.open(msg, time.monotonic())
        if state is None or target is None:
            self.pusher.tell_d(reg, refused)
            if state is not None:
                self.ctx.metrics.incr("writer.duplicate_push")
                note("write.duplicate", level="warning")
            else:
                note("write.refused", level="info", reason=refused)
            return
        if self.links.draining or state.expired:
            self.pusher.fail_target(target, state.expired or "shutting down")
            note("write.refused", level="info", reason=state.expired or "shutting down")
            return
        peer = d_peer(reg)
        remote = self.links.get(peer)
        if remote is not None and msg.sender and remote.agent_name != msg.sender:
            # The binding changed since the registration was verified (D restarted).
            self.pusher.fail_target(target, "D agent changed since it registered")
            note("write.refused", level="warning", reason="D agent changed since it registered")
        elif remote is None:
            self.links.park(peer, full=True, work=DeliverPush(msg.request_id, d_rank, state.serial, peer))
            note("write.parked", peer=f"{peer.engine_id}/tp{d_rank}")
        else:
            self.pusher.post(target, remote, note, msg)

    @handles(ExpectTraffic)
    def _expect(self, msg: ExpectTraffic, note: Note) -> None:
        self._linger()

    @handles(Released)
    def _released(self, msg: Released, note: Note) -> None:
        gone = sum(self.book.released(rid, serial, msg.by) for rid, serial in msg.requests)
        note("push.released", by=msg.by, requests=len(msg.requests), tombstones_dropped=gone)

    @handles(Gathered)
    def _gathered(self, msg: Gathered, note: Note) -> None:
        self.pusher.gathered(msg, note)

    @handles(LayersReady)
    def _layers_ready(self, msg: LayersReady, note: Note) -> None:
        self.pusher.layers_ready(msg, note)

    @handles(ExpireLease)
    def _expire(self, msg: ExpireLease, note: Note) -> None:
        self.pusher.expire(msg, note)

    @handles(CancelPush)
    def _cancel(self, msg: CancelPush, note: Note) -> None:
        state = self.book.pushes.get(msg.request_id)
        target = state.targets.get(msg.decode_tp_rank) if state else None
        if state is None or target is None or target.registration.request_id != msg.d_request_id:
            note("abort.nothing_to_cancel")
            return
        self.pusher.cancel(target, note)

    @handles(AnswerAbort)
    def _answer_abort(self, msg: AnswerAbort, note: Note) -> None:
        remote = self.links.table.by_agent(msg.sender)
        payload = self.out.push_failure(msg.d_request_id, msg.reason, generation=msg.generation)
        if remote is None or self.links.send(remote, payload):
            note("abort.unanswered", level="info", sender=msg.sender)
            return
        note("abort.answered", reason=msg.reason)

    @handles(RefuseRegistration)
    def _refuse(self, msg: RefuseRegistration, note: Note) -> None:
        self.pusher.tell_d(msg.registration, msg.reason)
        note("reg.refused", level="info", reason=msg.reason)

    # --- handshakes and the work parked behind them ------------------------------------------
    @handles(HandshakeCompleted)
    def _handshake_completed(self, msg: HandshakeCompleted, note: Note) -> None:
        note.fields["peer"] = f"{msg.peer.engine_id}/pp{msg.peer.pp_rank}/tp{msg.peer.tp_rank}"
        failed = self.links.apply(msg, note)
        if failed is not None:
            self._handshake_failed(failed, note)

    @handles(HandshakeFailed)
    def _handshake_failed(self, msg: HandshakeFailed, note: Note) -> None:
        failed = self.links.failed(msg)
        self.ctx.metrics.incr("handshake.failed")
        note("handshake.failed", level="warning", kind=msg.kind, reason=msg.reason, failed_work=failed)

    def _replay(self, work: Work) -> None:
        if isinstance(work, DeliverReg):
            remote = self.links.get(work.peer)
            rid = work.registration.request_id
            err = self.links.send(remote, self.out.registration(work.registration)) if remote else "agent not loaded"
            if err and remote is not None and remote.gone and not work.retried and not self.links.draining:
                self.ctx.metrics.incr("reg.resent_after_peer_gone")
                self.links.park(work.peer, full=False, work=DeliverReg(work.registration, work.peer, retried=True))
            elif err:
                why = f"sending PUSH_REG failed: {err}"
                self.ctx.peers.to_reaper(RecvUndelivered(request_id=rid, count=1, reason=why))
            if not err:
                self.answers.sent(work.peer, rid, time.monotonic())
            self.log.debug("reg.sent", request_id=rid, replayed=True, failed=bool(err))
        elif isinstance(work, AdmitReg):
            self.inbound.admit(work.header, work.payload, work.sender, work.registration)
        elif isinstance(work, CheckDeath):
            remote = self.links.get(work.peer)
            info = remote.info if remote is not None else None
            if info is not None and bytes(info.agent_metadata) != work.agent_metadata:
                self.links.peer_dead(work, "another incarnation answers at its address")
        elif isinstance(work, DeliverPush):
            self.pusher.replay(work)
        else:
            remote = self.links.get(work.peer)
            if remote is None or self.links.send(remote, work.payload):
                self.ctx.metrics.incr("writer.notify_undeliverable")

    def _fail_work(self, work: Work, reason: str, kind: str = "") -> None:
        """Work that waited for a remote agent that will not come: end it visibly."""
        if isinstance(work, CheckDeath):
            if kind == "refused":  # nothing listens where that P served its metadata
                self.links.peer_dead(work, "its side channel refuses connections")
            elif kind != "shutdown" and not self.links.draining:
                self.links.retry_death_check(work, reason)
        elif isinstance(work, DeliverReg):
            self.ctx.peers.to_reaper(RecvUndelivered(request_id=work.registration.request_id, count=1, reason=reason))
        elif isinstance(work, AdmitReg):
            # D cannot be verified or reached; its watchdog bounds the request.
            self.ctx.metrics.incr("reg.unverified")
            self.log.warning("reg.unverified", request_id=work.header.request_id, reason=reason)
        elif isinstance(work, DeliverPush):
            self.pusher.unparkable(work, reason)
        else:
            self.ctx.metrics.incr("writer.notify_undeliverable")

    @handles(EvictIdleEngines)
    def _evict(self, msg: EvictIdleEngines, note: Note) -> None:
        evicted = self.links.evict_idle(msg.idle_for)
        note("engines.evicted" if evicted else "engines.kept", evicted=evicted, remaining=len(self.links.table.remotes))

    # --- shutdown ----------------------------------------------------------------------------
    @handles(Drain)
    def _drain(self, msg: Drain, note: Note) -> dict[str, int]:
        self.links.draining = True
        parked = 0
        for key in list(self.links.table.awaiting):
            for work in self.links.table.take_parked(key):
                parked += 1
                if isinstance(work, DeliverReg):
                    rid = work.registration.request_id
                    self.ctx.peers.to_reaper(RecvUndelivered(request_id=rid, count=1, reason="shutting down"))
        for state in list(self.book.pushes.values()):
            state.expired = state.expired or "shutting down"
            for target in state.targets.values():
                if target.status == "waiting":
                    target.end(ok=False, reason="shutting down")
        # Let in-flight WRITEs settle, but never past the deadline.
        while self.book.in_flight and time.monotonic() < msg.deadline:
            if not self._poll():
                time.sleep(self.config.poll_interval_busy)
        cancelled = self.pusher.cancel_all_in_flight()
        for state in list(self.book.pushes.values()):
            self.pusher.maybe_finish(state)
        note("writer.drained", level="info", parked=parked, cancelled=cancelled)
        return {"parked": parked, "cancelled": cancelled}

    def _release_all(self) -> None:
        if self.poster.agent is not None:
            self.pusher.release_in_flight()
            self.links.close()

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        """Fail the request the message was about, through its ordinary failure path."""
        why = f"writer error: {exc!r}"
        if isinstance(message, (HandshakeCompleted, HandshakeFailed)):
            # The work parked on that peer would wait for a handshake that already came.
            for work in self.links.table.take_parked(message.peer):
                self._fail_work(work, why)
        elif isinstance(message, PostPush):
            state = self.book.pushes.get(message.request_id)
            d_rank = message.registration.decode_tp_rank
            target = state.targets.get(d_rank) if state else None
            if target is not None and target.status == "waiting":
                self.pusher.fail_target(target, why)
            elif target is None:
                self.pusher.tell_d(message.registration, why)
        elif isinstance(message, (ExpireLease, CancelPush)):
            serial = message.serial if isinstance(message, ExpireLease) else 0
            self.pusher.fail_request(message.request_id, why, serial=serial, expiry=isinstance(message, ExpireLease))
        elif isinstance(message, SendRegistration):
            rid = message.registration.request_id
            self.ctx.peers.to_reaper(RecvUndelivered(request_id=rid, count=1 << 30, reason=f"D {why}"))
        elif isinstance(message, SendAbort):
            # The abort may not have gone out: P's lease and D's quarantine still bound it.
            self.ctx.metrics.incr("abort.unsent")
        elif isinstance(message, RefuseRegistration):
            self.ctx.metrics.incr("writer.notify_undeliverable")

    # --- introspection (tests, stats) --------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        return {
            **self.book.sizes(),
            **self.links.table.sizes(),
            **self.answers.sizes(),
            **self.pusher.layered.sizes(),
            **self.inbound.verifier.sizes(),
        }
