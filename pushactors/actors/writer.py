"""The writer: the only code that touches the rank's NIXL agent.

It registers KV memory, loads remote agents, sends registrations, heartbeats and aborts (D),
posts WRITEs with their completion notification (P), polls transfer states and inbound
notifications, and routes what arrives: registrations, heartbeats and aborts to the matcher,
completions and push failures to the reaper's ledger.

Nothing here blocks on a handshake. Work that needs a remote agent not loaded yet is parked
under that peer; the handshake actor is asked once; its completion (a message) replays the
parked work, its failure fails it.

P-side safety rules enforced here:
* P's blocks are reported free only when nothing of the request is in flight;
* once a request is finished, expired or failed (tombstoned), no WRITE for it is posted again;
* every target D rank that will not be written is told so (push failure) when it is reachable.
"""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any

import numpy as np

from ..core.blocks import KVLayout, KVRegion, LayoutError, PairedLayout, PlanError, RemoteLayout, model_heads
from ..core.staging import grid_rows, grid_runs, grid_spans, image_of, spans
from ..core.topology import TopologyError, registration_sources, write_heads
from ..logs import wants
from ..protocol import (
    PUSH_REG_PREFIX,
    Abort,
    AbortArrived,
    AnswerAbort,
    CancelPush,
    ClearLease,
    Completion,
    Drain,
    EvictIdleEngines,
    ExpectTraffic,
    ExpireLease,
    FetchPeer,
    Forget,
    Gather,
    Gathered,
    HandshakeCompleted,
    HandshakeFailed,
    Heartbeat,
    HeartbeatArrived,
    MalformedMessage,
    MemoryRegistered,
    PeerDead,
    PeerGone,
    PeerKey,
    PostPush,
    PushFailure,
    RecvNotified,
    RecvUndelivered,
    RefuseRegistration,
    RegisterMemory,
    Registration,
    RegistrationArrived,
    RegistrationHeader,
    SendAbort,
    SendHeartbeats,
    SendRegistration,
    decode_notification,
    decode_registration_header,
    notification_kind,
    registration_limit,
)
from ..transport.agent import LOCAL_AGENT, AgentFactory, DlistHandle, NixlAgentLike, XferHandle
from ..transport.auth import AuthError, Keyring
from .base import Note, PushActor, RankContext, handles
from .outbound import Outbound
from .pushes import ChunkedWrite, PushBook, PushState, Target
from .remotes import AdmitReg, CheckDeath, DeliverPush, DeliverReg, Notify, RemotePeer, RemoteTable, Work, d_peer

MAX_BLOCKS_UNKNOWN = 1 << 16  # registration size bound before this rank's memory is known
# Registrations up to this size are decoded whole on the writer (well under a millisecond);
# larger ones are verified from their header and decoded by the matcher.
INLINE_REGISTRATION_BYTES = 64 * 1024


class Writer(PushActor):
    actor_name = "writer"

    def __init__(self, ctx: RankContext, agent_factory: AgentFactory) -> None:
        super().__init__(ctx)
        self._factory = agent_factory
        self.agent: NixlAgentLike | None = None
        self.agent_error = ""
        self.layout: KVLayout | None = None
        self._replicated = False  # this rank's KV is replicated across TP ranks (MLA)
        self._mem_registration: object = None
        self._local_dlists: dict[bytes, DlistHandle] = {}
        self._linger_until = 0.0  # busy polling until then (an answer is expected)
        # D: requests whose registration went out and whose answer has not come in, with when
        # to stop waiting for it. While any is awaited the writer polls at the busy interval:
        # a prefill may take longer than any linger, and its push must be picked up at once.
        self._awaiting: dict[str, float] = {}
        # D: per P rank, the requests registered with it that it has not answered (and when):
        # that rank is busy (never evicted) and its agent name stays bound to it (a handshake
        # elsewhere claiming the name is an agent_conflict), or its completions would be
        # refused as a stranger's.
        self._expecting: dict[PeerKey, dict[str, float]] = {}
        # Chunks of staged pushes the stager is gathering: (P id, D rank, serial, chunk) ->
        # (the chunked WRITE, image offsets, lengths, D slot address).
        self._gathers: dict[tuple[str, int, int, int], tuple[ChunkedWrite, Any, Any, int]] = {}
        # Loaded remote ranks, verified agent names and work parked behind handshakes.
        self._table = RemoteTable(
            max_remotes=ctx.config.max_remote_agents, max_parked_per_peer=ctx.config.max_parked_per_peer
        )
        # P's pushes, the WRITEs in flight and the P ids this rank is done with.
        self._book = PushBook(tombstone_ttl=ctx.config.tombstone_ttl)
        self._out = Outbound(
            Keyring.from_config(ctx.config), tp_rank=ctx.tp_rank, pp_rank=ctx.pp_rank, tp_size=ctx.tp_size
        )
        self._reg_limit = registration_limit(MAX_BLOCKS_UNKNOWN)
        self._idle_polls = 0
        self._next_housekeeping = 0.0
        # D: death checks to ask again, by peer: (when, the check).
        self._death_retries: dict[PeerKey, tuple[float, CheckDeath]] = {}
        self._draining = False

    # --- lifecycle ---------------------------------------------------------------------------
    def on_start(self) -> None:
        try:
            self.agent = self._factory(self.ctx.agent_name)
        except Exception as exc:  # surfaced by RegisterMemory, and every request fails
            self.agent_error = f"NIXL agent could not be created: {exc!r}"
            self.log.error("agent.failed", error=self.agent_error)
        self.arm_tick(self.config.poll_interval_idle)

    def on_stop(self) -> None:
        self._release_all()

    def _need_agent(self) -> NixlAgentLike:
        if self.agent is None:
            raise RuntimeError(self.agent_error or "NIXL agent not created")
        return self.agent

    @handles(RegisterMemory)
    def _register_memory(self, msg: RegisterMemory, note: Note) -> MemoryRegistered:
        if self.agent is None:
            note("memory.register_failed", level="error", error=self.agent_error)
            return MemoryRegistered(error=self.agent_error or "no NIXL agent")
        if self.layout is not None:
            return MemoryRegistered(error="KV memory is already registered for this rank")
        try:
            descs = np.array([(m.addr, m.length, m.device_id) for m in msg.memory], dtype=np.uint64)
            self._mem_registration = self.agent.register_memory(descs, msg.mem_type)
            self.layout = KVLayout(
                regions=tuple(KVRegion.from_info(r) for r in msg.regions),
                mem_type=msg.mem_type,
                block_size=msg.block_size,
                physical_blocks_per_logical=msg.physical_blocks_per_logical,
                memory=msg.memory,
                num_groups=1 + max(r.group for r in msg.regions),
                kv_heads=msg.kv_heads,
            )
            self._replicated = msg.replicated_kv
            capacity = max(r.num_blocks for r in msg.regions) // max(1, msg.physical_blocks_per_logical)
            self._reg_limit = registration_limit(capacity, self.layout.num_groups)
            metadata = self.agent.get_agent_metadata()
        except Exception as exc:
            note("memory.register_failed", level="error", error=repr(exc))
            return MemoryRegistered(error=f"registering KV memory failed: {exc!r}")
        note(
            "memory.registered",
            level="info",
            regions=len(msg.regions),
            bytes=sum(m.length for m in msg.memory),
            mem_type=msg.mem_type,
        )
        return MemoryRegistered(agent_name=self.agent.name, agent_metadata=metadata)

    # --- polling -------------------------------------------------------------------------------
    def _linger(self) -> None:
        """Poll at the busy interval for ``poll_busy_linger`` seconds: an answer is expected."""
        self._linger_until = max(self._linger_until, time.monotonic() + self.config.poll_busy_linger)
        self.arm_tick(self.config.poll_interval_busy)

    def _await(self, request_id: str) -> None:
        """D sent a registration: poll busy until its answer comes, for ``poll_await`` at most."""
        if self.config.poll_await > 0:
            self._awaiting[request_id] = time.monotonic() + self.config.poll_await

    def on_tick(self, now: float) -> None:
        activity = self._poll()
        if activity:
            self._linger()  # traffic comes in bursts (a registration, then its blocks)
        if now >= self._next_housekeeping:
            self._housekeeping(now)
            self._next_housekeeping = now + self.config.reaper_tick
        self.arm_tick(self.next_poll_delay(now, activity))

    def next_poll_delay(self, now: float, activity: int = 0) -> float:
        """Seconds to the next poll. While D awaits an answer it polls at ``poll_interval_await``:
        picking a landed push up is on that push's critical path. While WRITEs are in flight,
        or traffic was recent, at ``poll_interval_busy``; otherwise backing off towards
        ``poll_interval_idle`` (each call without a reason to poll sooner is one back-off step)."""
        busy, idle = self.config.poll_interval_busy, self.config.poll_interval_idle
        if self._awaiting:
            self._idle_polls = 0
            return min(busy, self.config.poll_interval_await)
        if self._book.in_flight or activity or now < self._linger_until:
            self._idle_polls = 0
            return busy
        self._idle_polls = min(self._idle_polls + 1, 30)
        return float(min(idle, busy * (2**self._idle_polls)))

    def _poll(self) -> int:
        """Settle finished WRITEs, then route new notifications. A NIXL call that raises here
        propagates: the tick fails, and a rank whose ticks keep failing turns unhealthy."""
        if self.agent is None:
            return 0
        activity = self._check_in_flight()
        try:
            notifs = self.agent.get_new_notifs()
        except Exception:
            self.ctx.metrics.incr("writer.poll_error")
            raise
        for sender, messages in notifs.items():
            for raw in messages:
                activity += 1
                self._route(str(sender), raw)
        return activity

    def _check_in_flight(self) -> int:
        assert self.agent is not None
        activity = 0
        if self._book.in_flight:
            still: list[tuple[PushState, int, Target]] = []
            for state, d_rank, target in self._book.in_flight:
                try:
                    status = self._xfer_state(target.handle)
                except Exception as exc:
                    status = "ERR"
                    target.reason = f"check_xfer_state raised {exc!r}"
                    if target.remote is not None and _peer_gone(exc):
                        self._forget_remote(target.remote)
                if status == "PROC":
                    still.append((state, d_rank, target))
                    continue
                if status == "FAILING":
                    # A failed push in chunks ends once its live chunks have: releasing one
                    # would not stop bytes already on their way into D's slot (see _cancel).
                    # One stuck past write_timeout is cancelled by _expire_stuck_writes.
                    still.append((state, d_rank, target))
                    continue
                failed = target.handle.failed if isinstance(target.handle, ChunkedWrite) else ""
                reason = target.reason or failed or "WRITE ended in ERR"
                activity += 1
                self._settle(state, d_rank, target, ok=status == "DONE", reason=reason)
            # _settle never appends to _in_flight, so replacing the list loses nothing.
            self._book.in_flight = still
        return activity

    def _drop(self, counter: str, event: str, **fields: Any) -> None:
        """A counted, logged drop: bad input never raises into the loop."""
        self.ctx.metrics.incr(counter)
        self.log.warning(event, **fields)

    def _route(self, sender: str, raw: bytes) -> None:
        self.ctx.metrics.incr("notif.received")
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            self._drop("notif.malformed", "notif.dropped", sender=sender, reason=f"not bytes: {type(raw).__name__}")
            return
        raw = bytes(raw)
        if self._out.keyring is not None:
            try:
                raw = self._out.open(raw)
            except AuthError as exc:
                self.ctx.metrics.incr(f"notif.unauthenticated.{exc.kind}")
                self._drop("notif.unauthenticated", "notif.dropped", sender=sender, reason=str(exc)[:200])
                return
        kind = notification_kind(raw)
        try:
            if kind == "push_reg" and self.config.role == "consumer":
                # A decode engine never serves registrations: nobody may make it handshake.
                self._drop("reg.not_producer", "notif.dropped", sender=sender, reason="PUSH_REG to a consumer")
                return
            if kind == "push_reg" and len(raw) > INLINE_REGISTRATION_BYTES:
                # A large registration: only its routing fields here. Its block ids are decoded
                # by the matcher, and only for a sender verified as the D rank it names.
                header = decode_registration_header(raw, registration_bytes=self._reg_limit)
                self.ctx.metrics.incr("notif.kind.push_reg")
                self._admit(header, raw[len(PUSH_REG_PREFIX) :], sender)
                return
            notif = decode_notification(raw, registration_bytes=self._reg_limit)
        except MalformedMessage as exc:
            self.ctx.metrics.incr(f"notif.malformed.{exc.kind}")
            self._drop("notif.malformed", "notif.dropped", sender=sender, kind=exc.kind, reason=exc.reason[:200])
            return
        self.ctx.metrics.incr(f"notif.kind.{kind}")
        peers = self.ctx.peers
        if isinstance(notif, Registration):
            self._admit(notif.header(), b"", sender, notif)
        elif isinstance(notif, (Completion, PushFailure)):
            # Who sent it is known only through a handshake that bound the agent's name to a
            # P rank; the reaper counts it only if the request expects that rank.
            peer = self._table.identify(sender)
            if peer is not None:  # an unknown agent's answer must not end the busy polling
                self._awaiting.pop(notif.request_id, None)
                if isinstance(notif, Completion) or notif.final:
                    self._answered(peer, notif.request_id)
            if isinstance(notif, Completion):
                peers.to_reaper(RecvNotified(request_id=notif.request_id, ok=True, sender=sender, peer=peer))
            else:
                peers.to_reaper(
                    RecvNotified(
                        request_id=notif.request_id,
                        ok=False,
                        sender=sender,
                        reason=notif.reason,
                        peer=peer,
                        final=notif.final,
                    ),
                )
        elif isinstance(notif, Heartbeat):
            peers.to_matcher(HeartbeatArrived(ids=notif.ids, sender=sender))
        elif isinstance(notif, Abort):
            peers.to_matcher(AbortArrived(abort=notif, sender=sender))
        self.log.debug(
            "notif.routed", sender=sender, kind=type(notif).__name__, request_id=getattr(notif, "request_id", None)
        )

    def _admit(
        self, reg: RegistrationHeader, payload: bytes, sender: str, registration: Registration | None = None
    ) -> None:
        """Accept a registration only from the agent that D's own side channel advertises for
        the rank it names: verified against P's handshake with that address (done now, before
        the match, so the WRITE can be posted the moment P's blocks are ready). An address
        outside ``trusted_peers`` is never contacted on a registration's word."""
        if not self.config.trusts(reg.decode_engine_id, reg.decode_host):
            self._drop(
                "reg.untrusted",
                "reg.rejected",
                request_id=reg.request_id,
                reason="D address is not in trusted_peers",
                engine=reg.decode_engine_id,
                host=reg.decode_host,
                sender=sender,
            )
            return
        peer = d_peer(reg)
        remote = self._table.get(peer)
        if remote is None:
            if self._draining:
                self.ctx.metrics.incr("reg.dropped_shutdown")
                return
            self._park(peer, full=True, work=AdmitReg(reg, payload, sender, registration))
            return
        if remote.agent_name != sender:
            self._drop(
                "reg.rejected_sender",
                "reg.rejected",
                request_id=reg.request_id,
                reason="sender is not the agent D's side channel advertises for that rank",
                sender=sender,
                expected=remote.agent_name,
            )
            return
        self._warm(remote, reg)
        self.ctx.peers.to_matcher(
            RegistrationArrived(
                registration=registration,
                sender=sender,
                header=reg,
                payload=payload,
                capacity=advertised_capacity(remote.info),
            ),
        )

    def _warm(self, remote: RemotePeer, reg: RegistrationHeader) -> None:
        # Prepare the descriptor lists for this D rank ahead of the WRITE. A layout that cannot
        # pair is not an error here: the WRITE will be refused with a push failure to D.
        try:
            self._prepared(remote, reg.decode_tp_rank, reg.decode_tp_size)
        except (LayoutError, TopologyError) as exc:
            self.log.info("layout.unpairable", agent=remote.agent_name, reason=str(exc))
        except Exception as exc:
            self.log.warning("dlist.prep_failed", agent=remote.agent_name, error=repr(exc))

    def _expect_answer(self, peer: PeerKey, request_id: str) -> None:
        self._expecting.setdefault(peer, {})[request_id] = time.monotonic()

    def _answered(self, peer: PeerKey, request_id: str) -> None:
        waiting = self._expecting.get(peer)
        if waiting is not None:
            waiting.pop(request_id, None)
            if not waiting:
                del self._expecting[peer]

    def _prune_expecting(self, now: float) -> None:
        # Past its watchdog and quarantine a D request has ended whatever P did.
        horizon = now - (self.config.registration_timeout + self.config.abort_quarantine)
        for peer in list(self._expecting):
            waiting = self._expecting[peer]
            for rid in [r for r, at in waiting.items() if at < horizon]:
                del waiting[rid]
            if not waiting:
                del self._expecting[peer]

    def _housekeeping(self, now: float) -> None:
        self._expire_stuck_writes(now)
        if self._expecting:
            self._prune_expecting(now)
        for rid in [r for r, until in self._awaiting.items() if until <= now]:
            del self._awaiting[rid]  # back to idle polling; the reaper's watchdog bounds the request
        self._book.tombstones.prune(now)
        for peer, (due, check) in list(self._death_retries.items()):
            if now >= due and not self._draining:
                del self._death_retries[peer]
                self._park(peer, full=False, work=check)

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
        payload = self._out.registration(reg)
        sent = parked = failed = 0
        reason = ""
        for pp, tp in sources:
            peer = PeerKey(reg.remote_engine_id, reg.remote_host, reg.remote_port, pp, tp)
            remote = self._table.get(peer)
            if remote is None or self._draining:
                if self._draining:
                    failed += 1
                    reason = "shutting down"
                    continue
                self._park(peer, full=False, work=DeliverReg(reg, peer))
                parked += 1
                continue
            err = self._send(remote, payload)
            if err and remote.gone and not self._draining:
                # The agent we held for that P rank is gone (P restarted, or died): the
                # registration never reached it. Ask the rank again and resend it once.
                self.ctx.metrics.incr("reg.resent_after_peer_gone")
                self._park(peer, full=False, work=DeliverReg(reg, peer, retried=True))
                parked += 1
            elif err:
                failed += 1
                reason = f"sending PUSH_REG to {remote.agent_name} failed: {err}"
            else:
                sent += 1
                self._expect_answer(peer, reg.request_id)
        if failed:
            self.ctx.peers.to_reaper(RecvUndelivered(request_id=reg.request_id, count=failed, reason=reason))
        if sent:
            self._await(reg.request_id)
            self._linger()  # its completion is on the way: pick it up without idle back-off
        note("reg.sent" if not parked else "reg.parked", sent=sent, parked=parked, failed=failed)

    @handles(SendHeartbeats)
    def _send_heartbeats(self, msg: SendHeartbeats, note: Note) -> None:
        sent = skipped = 0
        for payload in self._out.heartbeats(msg.ids):
            for peer in msg.peers:
                remote = self._table.get(peer)
                if remote is None:
                    skipped += 1
                    continue
                if self._send(remote, payload):
                    skipped += 1
                else:
                    sent += 1
        self.ctx.metrics.incr("heartbeat.sent", sent)
        note("heartbeat.sent", ids=len(msg.ids), sent=sent, skipped=skipped)

    @handles(SendAbort)
    def _send_abort(self, msg: SendAbort, note: Note) -> None:
        self._awaiting.pop(msg.abort.request_id, None)  # D gave up: P's answer may never come
        payload = self._out.abort(msg.abort)
        sent = unparked = 0
        for peer in msg.peers:
            dropped = self._table.unpark_registration(peer, msg.abort.request_id)
            if dropped:
                unparked += dropped
                continue
            remote = self._table.get(peer)
            if remote is not None and not self._send(remote, payload):
                sent += 1
        if unparked:
            # Never delivered, so those P ranks will never answer: stop waiting for them.
            self.ctx.peers.to_reaper(
                RecvUndelivered(request_id=msg.abort.request_id, count=unparked, reason="aborted before delivery"),
            )
        note("abort.sent", sent=sent, unparked=unparked)

    # --- P: pushes -----------------------------------------------------------------------------
    @handles(PostPush)
    def _post_push(self, msg: PostPush, note: Note) -> None:
        reg = msg.registration
        d_rank = reg.decode_tp_rank
        note.fields.update(d_request_id=reg.request_id, d_rank=d_rank)
        state, target, refused = self._book.open(msg, time.monotonic())
        if state is None or target is None:
            self._tell_d(reg, refused)
            if state is not None:
                self.ctx.metrics.incr("writer.duplicate_push")
                note("write.duplicate", level="warning")
            else:
                note("write.refused", level="info", reason=refused)
            return
        if self._draining or state.expired:
            self._fail_target(state, d_rank, target, state.expired or "shutting down")
            note("write.refused", level="info", reason=state.expired or "shutting down")
            return
        peer = d_peer(reg)
        remote = self._table.get(peer)
        if remote is None or (msg.sender and remote.agent_name != msg.sender):
            if remote is not None:
                # The binding changed since the registration was verified (D restarted):
                # re-verify before writing.
                self._fail_target(state, d_rank, target, "D agent changed since it registered")
                note("write.refused", level="warning", reason="D agent changed since it registered")
                return
            self._park(peer, full=True, work=DeliverPush(msg.request_id, d_rank, state.serial, peer))
            note("write.parked", peer=f"{peer.engine_id}/tp{d_rank}")
            return
        self._post_write(state, d_rank, target, remote, note)

    def _post_write(self, state: PushState, d_rank: int, target: Target, remote: RemotePeer, note: Note | None) -> None:
        if target.registration.staging_slot is not None:
            self._stage(state, d_rank, target, remote, note)
            return
        agent = self._need_agent()
        reg = target.registration
        handle = None
        started = time.monotonic()
        try:
            paired, local_h, remote_h = self._prepared(remote, d_rank, reg.decode_tp_size)
            plan = paired.plan(state.block_ids, reg.block_groups, reg.skip_blocks, merge=self.config.post_runs)
            planned = time.monotonic()
            completion = self._out.completion(reg.request_id)
            if plan.num_descs == 0:
                # Nothing to copy (D had every block cached, or a lower P rank writes these heads):
                # the completion alone settles it.
                self._complete_only(state, d_rank, target, remote, completion, note)
                return
            assert local_h is not None and remote_h is not None
            assert self.layout is not None and remote.layout is not None
            if plan.runs is not None:
                # Few long runs: lists of just those, so NIXL walks a handful of descriptors
                # instead of one per piece. They are released when the WRITE settles.
                listing = time.monotonic()
                runs_l = agent.prep_xfer_dlist(LOCAL_AGENT, plan.runs[0], self.layout.mem_type)
                target.staged = (runs_l, None, None)
                runs_r = agent.prep_xfer_dlist(remote.agent_name, plan.runs[1], remote.layout.mem_type)
                target.staged = (runs_l, runs_r, None)
                idx = np.arange(len(plan.runs[0]), dtype=np.int64)
                prepped = time.monotonic()
                handle = agent.make_prepped_xfer("WRITE", runs_l, idx, runs_r, idx, completion)
            else:
                listing = prepped = time.monotonic()
                handle = agent.make_prepped_xfer(
                    "WRITE", local_h, plan.local_idx, remote_h, plan.remote_idx, completion
                )
            made = time.monotonic()
            status = agent.transfer(handle)
            posted_at = time.monotonic()
        except (LayoutError, PlanError, TopologyError) as exc:
            self.ctx.metrics.incr("write.refused")
            self._fail_target(state, d_rank, target, f"invalid WRITE: {exc}")
            self._emit(note, "write.refused", state, level="warning", reason=str(exc))
            return
        except Exception as exc:
            if handle is not None:
                self._release_handle(handle)
            if target.staged is not None:
                self._release_staged(target.staged)
                target.staged = None
            self._submit_failed(state, d_rank, target, remote, exc, note)
            return
        target.posted(handle, remote, plan.nbytes, started)
        self.ctx.metrics.incr("write.posted")
        if plan.runs is not None:
            self.ctx.metrics.incr("write.runs")
        self._emit(
            note,
            "write.posted",
            state,
            d_request_id=reg.request_id,
            d_rank=d_rank,
            bytes=plan.nbytes,
            descs=plan.num_descs,
            merged_descs=plan.merged_descs if wants("debug") else None,  # counted only for a reader
            posted_descs=plan.posted_descs,  # runs, when posted as runs (plan.runs)
            runs=plan.runs is not None,
            blocks=plan.num_blocks,
            post_ms=round((posted_at - started) * 1e3, 3),
            plan_ms=round((planned - started) * 1e3, 3),  # of post_ms; the rest is NIXL's:
            prep_ms=round((prepped - listing) * 1e3, 3),  # the runs' own lists (0 without runs)
            make_ms=round((made - prepped) * 1e3, 3),  # make_prepped_xfer
            transfer_ms=round((posted_at - made) * 1e3, 3),  # transfer (posts the WRITE)
        )
        self._after_post(state, d_rank, target, status)

    def _complete_only(
        self, state: PushState, d_rank: int, target: Target, remote: RemotePeer, completion: bytes, note: Note | None
    ) -> None:
        """Nothing to copy into this D rank: the completion alone settles the target."""
        self._need_agent().send_notif(remote.agent_name, completion)
        target.remote = remote
        self._settle(state, d_rank, target, ok=True, reason="")
        self._emit(note, "write.empty", state)

    def _submit_failed(
        self, state: PushState, d_rank: int, target: Target, remote: RemotePeer, exc: Exception, note: Note | None
    ) -> None:
        if _peer_gone(exc):
            self._forget_remote(remote)
        self.ctx.metrics.incr("write.submit_failed")
        self._fail_target(state, d_rank, target, f"WRITE submission failed: {exc!r}")
        self._emit(note, "write.failed", state, level="warning", reason=repr(exc))

    def _after_post(self, state: PushState, d_rank: int, target: Target, status: str) -> None:
        """A WRITE finished at post settles now; one still running is polled."""
        if status == "ERR":
            self._settle(state, d_rank, target, ok=False, reason="WRITE ended in ERR at post")
        elif status == "DONE":
            self._settle(state, d_rank, target, ok=True, reason="")
        else:
            self._book.in_flight.append((state, d_rank, target))
            self._spin(target)
            self.arm_tick(0.0)

    def _spin(self, target: Target) -> None:
        """Check a just-posted WRITE in a tight loop for up to ``poll_spin``: UCX moves a small
        WRITE (and sends its notification) only while the initiator progresses, so waiting for
        the next tick would add a whole poll interval to every small push."""
        spin = self.config.poll_spin
        if spin <= 0:
            return
        deadline = time.monotonic() + spin
        while target.handle is not None and time.monotonic() < deadline:
            if self._check_in_flight():
                return

    def _emit(self, note: Note | None, event: str, state: PushState, *, level: str = "debug", **fields: Any) -> None:
        """Say what happened: as the handled message's event, or on its own when replayed."""
        if note is not None:
            note(event, level=level, **fields)
        else:
            getattr(self.log, level)(event, request_id=state.request_id, replayed=True, **fields)

    def _prepared(
        self, remote: RemotePeer, d_rank: int, d_tp: int
    ) -> tuple[PairedLayout, DlistHandle | None, DlistHandle | None]:
        """The pairing for WRITEs to this D rank and its prepared lists (none when this rank
        writes no heads there: a lower-ranked P source holds the same ones)."""
        agent = self._need_agent()
        if self.layout is None:
            raise LayoutError("KV memory is not registered on this rank")
        known = remote.prepared.get((d_rank, d_tp))
        if known is not None:
            return known
        if remote.layout is None:
            remote.layout = RemoteLayout.from_info(remote.info, remote.agent_name, remote.clock_offset)
        if remote.layout.tp_size != d_tp:
            raise LayoutError(f"D advertises TP {remote.layout.tp_size} but registered with TP {d_tp}")
        tp_rank, tp_size = self.ctx.tp_rank, self.ctx.tp_size
        kv_heads = model_heads(self.layout, remote.layout, tp_size, d_tp, self._replicated)
        heads = write_heads(tp_rank, tp_size, d_rank, d_tp, kv_heads)
        key = (heads.start, heads.stop)
        paired = remote.pairings.get(key)
        if paired is None:
            paired = PairedLayout(self.layout, (tp_rank, tp_size), remote.layout, heads, kv_heads)
            remote.pairings[key] = paired
        if not paired.links:
            remote.prepared[(d_rank, d_tp)] = (paired, None, None)
            return paired, None, None
        local_h = self._local_dlists.get(paired.local_key)
        if local_h is None:
            local_h = agent.prep_xfer_dlist(LOCAL_AGENT, paired.local_descriptors(), self.layout.mem_type)
            self._local_dlists[paired.local_key] = local_h
        remote_h = remote.dlists.get(key)
        if remote_h is None:
            remote_h = agent.prep_xfer_dlist(remote.agent_name, paired.remote_descriptors(), remote.layout.mem_type)
            remote.dlists[key] = remote_h
        remote.prepared[(d_rank, d_tp)] = (paired, local_h, remote_h)
        return paired, local_h, remote_h

    # --- staged pushes (core/staging.py) ---------------------------------------------------
    def _stage(self, state: PushState, d_rank: int, target: Target, remote: RemotePeer, note: Note | None) -> None:
        """D offered a staging slot: write its image. Gather into our own slot on the stager
        (then :meth:`_gathered` posts a few large spans), or, without room here, write the
        pieces straight from our blocks into D's image."""
        reg = target.registration
        slot = reg.staging_slot
        assert slot is not None
        planning = time.monotonic()
        try:
            paired, _, _ = self._prepared(remote, d_rank, reg.decode_tp_size)
            d_staging = remote.info.staging
            if d_staging is None:
                raise PlanError("D offered a staging slot but advertises no staging buffer")
            if slot[0] + slot[1] > d_staging.length:
                raise PlanError(f"staging slot {slot} lies outside D's {d_staging.length}-byte buffer")
            assert remote.layout is not None
            image = image_of(remote.layout.regions, reg.block_groups, remote.layout.physical_blocks_per_logical)
            if image.nbytes > slot[1]:
                raise PlanError(f"D's image needs {image.nbytes} bytes, its slot holds {slot[1]}")
            grids = paired.staged_grids(state.block_ids, reg.block_groups, reg.skip_blocks, image.bases)
            grids = [g for g in grids if len(g)]
            for g in grids:
                g.check()  # a row that cannot exist (negative, past any address): refused here
        except (LayoutError, PlanError, TopologyError, ValueError) as exc:
            self.ctx.metrics.incr("write.refused")
            self._fail_target(state, d_rank, target, f"invalid WRITE: {exc}")
            self._emit(note, "write.refused", state, level="warning", reason=str(exc))
            return
        d_addr = d_staging.addr + slot[0]
        if not grids:
            self._post_rows(state, d_rank, target, remote, None, None, None, note, staged_bytes=0)
            return
        # Our pieces already in few runs (blocks in order here): write them straight into D's
        # slot. A gather would only copy them once more through the same memory.
        straight = grid_runs(grids, self.config.staging_gather_runs)
        mine = self.ctx.staging
        p_off = None
        if straight is None and mine is not None:
            p_off = mine.alloc(image.nbytes)
        if straight is not None or p_off is None:
            # Straight from our blocks, one descriptor per run (without room here too).
            self.ctx.metrics.incr("staging.straight" if straight is not None else "staging.direct")
            joined = straight if straight is not None else grid_runs(grids)
            assert joined is not None  # no limit: always the runs
            laddr, img, lens = joined
            locals_ = np.stack([laddr, lens], axis=1)
            image_addrs = d_addr + img
            pieces = sum(len(g) for g in grids)
            self._post_rows(
                state, d_rank, target, remote, locals_, image_addrs, None, note, staged_bytes=0, started=planning,
                pieces=pieces,
            )
            return
        assert mine is not None
        size = self.config.staging_chunk_bytes
        one_chunk = size <= 0 or image.nbytes <= size
        if not one_chunk:
            # Chunks: every row, here.
            laddr, img, lens = grid_rows(grids)
        # Gather and WRITE chunk by chunk: chunk i+1 is gathered while chunk i is in flight.
        # One chunk's WRITE carries the completion (see _gathered); several send it once all are DONE.
        completion = self._out.completion(reg.request_id)
        xfer = ChunkedWrite(completion=completion, agent_name=remote.agent_name, p_off=p_off)
        slot_base = mine.addr + p_off
        gathers: list[Gather] = []
        no_rows = np.empty(0, dtype=np.uint64)

        def chunk_gather(
            chunk: int, src: Any = no_rows, dst: Any = no_rows, lengths: Any = no_rows, grids: tuple[Any, ...] = ()
        ) -> Gather:
            return Gather(
                request_id=state.request_id,
                d_rank=d_rank,
                serial=state.serial,
                chunk=chunk,
                src=src,
                dst=dst,
                lengths=lengths,
                grids=grids,
            )

        if one_chunk:
            # One chunk: the stager builds the rows from the grids (on the device, on a GPU),
            # and the WRITE covers the image's spans; no row is built here.
            off, length = grid_spans(grids)
            runs = len(off)
            nbytes = sum(g.nbytes for g in grids)
            pieces = sum(len(g) for g in grids)
            self._gathers[(state.request_id, d_rank, state.serial, 0)] = (xfer, off, length, d_addr)
            gathers.append(chunk_gather(0, grids=tuple(g.shifted(dst=slot_base) for g in grids)))
            xfer.chunks = 1
        else:
            if len(img) > 1 and bool(np.any(img[1:] < img[:-1])):  # pieces usually come in image order
                order = np.argsort(img, kind="stable")
                img, lens, laddr = img[order], lens[order], laddr[order]
            # Chunks are runs of pieces (img is sorted): slices, not index arrays.
            cuts = np.flatnonzero(np.diff(img // size)) + 1
            bounds = [0, *cuts.tolist(), len(img)]
            xfer.chunks = len(bounds) - 1
            # Every array first, the stager's work last: numpy lets go of the GIL on large
            # arrays, and a stager already gathering would take it at each of our calls (a GIL
            # convoy that made this handler and the gather each 2-4x slower than alone).
            for c, (lo, hi) in enumerate(pairwise(bounds)):
                self._gathers[(state.request_id, d_rank, state.serial, c)] = (xfer, img[lo:hi], lens[lo:hi], d_addr)
                rows = (_unsigned(laddr[lo:hi]), _unsigned(img[lo:hi]) + np.uint64(slot_base), _unsigned(lens[lo:hi]))
                gathers.append(chunk_gather(c, *rows))
            # img is sorted here: a piece that does not start where the last one ended opens a span
            runs = 1 + int(np.count_nonzero(img[1:] != img[:-1] + lens[:-1]))
            nbytes = int(lens.sum())
            pieces = len(lens)
        target.posted(xfer, remote, nbytes, time.monotonic())
        self._book.in_flight.append((state, d_rank, target))
        self.ctx.metrics.incr("write.posted")
        self.ctx.metrics.incr("write.staged")
        self._emit(
            note,
            "write.posted",
            state,
            d_request_id=reg.request_id,
            d_rank=d_rank,
            bytes=nbytes,
            staged=True,
            chunks=xfer.chunks,
            pieces=pieces,
            descs=pieces,
            merged_descs=runs,
            plan_ms=round((time.monotonic() - planning) * 1e3, 3),  # rows, chunks and their Gathers
        )
        self.arm_tick(0.0)
        for gather in gathers:
            self.ctx.peers.to_stager(gather)

    @handles(ExpectTraffic)
    def _expect(self, msg: ExpectTraffic, note: Note) -> None:
        self._linger()

    @handles(Gathered)
    def _gathered(self, msg: Gathered, note: Note) -> None:
        entry = self._gathers.pop((msg.request_id, msg.d_rank, msg.serial, msg.chunk), None)
        if entry is None:
            note("write.gather_stale", level="warning")
            return
        xfer, img, lens, d_addr = entry
        xfer.gathered += 1
        mine = self.ctx.staging
        if xfer.released or xfer.failed or mine is None or xfer.p_off is None:
            # The push ended (or failed) while this chunk was gathered: nothing to send; the
            # slot goes back once no gather can still write into it.
            self._maybe_free_slot(xfer)
            note("write.gather_dropped", chunk=msg.chunk)
            return
        if msg.error:
            xfer.failed = msg.error
            self.arm_tick(0.0)
            note("write.gather_failed", level="warning", chunk=msg.chunk, error=msg.error)
            return
        off, length = spans(img, lens)
        n = len(off)
        agent = self._need_agent()
        ldesc = np.empty((n, 3), dtype=np.uint64)
        ldesc[:, 0] = mine.addr + xfer.p_off + off
        ldesc[:, 1] = length
        ldesc[:, 2] = mine.device_id
        rdesc = ldesc.copy()
        rdesc[:, 0] = d_addr + off
        state = self._book.pushes.get(msg.request_id)
        target = state.targets.get(msg.d_rank) if state is not None else None
        remote = target.remote if target is not None else None
        staging = remote.info.staging if remote is not None else None
        if remote is None or remote.layout is None or staging is None or self.layout is None:
            xfer.failed = "D agent is gone"
            self.arm_tick(0.0)
            return
        rdesc[:, 2] = staging.device_id
        started = time.monotonic()
        try:
            lh = agent.prep_xfer_dlist(LOCAL_AGENT, ldesc, self.layout.mem_type)
            xfer.dlists.append(lh)
            rh = agent.prep_xfer_dlist(remote.agent_name, rdesc, remote.layout.mem_type)
            xfer.dlists.append(rh)
            idx = np.arange(n, dtype=np.int64)
            # A push of one chunk carries its completion in its WRITE, as a direct push does: D
            # learns the image landed from NIXL, not from our next poll. Chunks may land in any
            # order, so a push of several sends it once every chunk is DONE.
            notif = xfer.completion if xfer.chunks == 1 else b""
            handle = agent.make_prepped_xfer("WRITE", lh, idx, rh, idx, notif)
            try:
                posted = agent.transfer(handle)
            except Exception:
                # Never posted (NIXL gives nothing to poll): release it at once, so the
                # chunks that did post are waited for, not released with it.
                self._release_handle(handle)
                raise
            xfer.handles.append(handle)
            xfer.notified = bool(notif)
            if posted == "ERR":
                xfer.failed = "WRITE ended in ERR at post"
        except Exception as exc:
            if _peer_gone(exc):
                self._forget_remote(remote)
            xfer.failed = f"WRITE submission failed: {exc!r}"
            self.ctx.metrics.incr("write.submit_failed")
        self.arm_tick(0.0)
        note(
            "write.chunk_posted",
            chunk=msg.chunk,
            descs=n,
            bytes=int(length.sum()),
            gather_ms=round(msg.gather_ms, 3),
            post_ms=round((time.monotonic() - started) * 1e3, 3),
            failed=xfer.failed or None,
        )

    def _xfer_state(self, handle: Any) -> str:
        """A WRITE's state; a chunked WRITE is DONE once every chunk is (the completion of a
        push of several chunks is sent then). One that failed (a chunk ERR, a gather or post
        failure) is ERR only once no chunk can still land, FAILING while some are in flight:
        those must be cancelled (or end) before D may hear that the push is over."""
        agent = self._need_agent()
        if not isinstance(handle, ChunkedWrite):
            return str(agent.check_xfer_state(handle))
        live = False
        for h in handle.handles:
            try:
                s = agent.check_xfer_state(h)
            except Exception as exc:
                # This chunk cannot be asked (its peer went away, most likely): fail the push,
                # but keep waiting for the chunks that can still say they are running.
                handle.failed = handle.failed or f"check_xfer_state raised {exc!r}"
                continue
            if s == "ERR":
                handle.failed = handle.failed or "WRITE ended in ERR"
            elif s != "DONE":
                live = True
        if handle.failed:
            return "FAILING" if live else "ERR"
        if live or handle.gathered < handle.chunks or len(handle.handles) < handle.chunks:
            return "PROC"
        if not handle.notified:
            agent.send_notif(handle.agent_name, handle.completion)  # every chunk landed
            handle.notified = True
        return "DONE"

    def _release_chunked(self, xfer: ChunkedWrite) -> None:
        """Release (cancel) every chunk WRITE and its lists; raises the first refusal. A chunk
        NIXL would not release is kept (it may still land), with the lists it reads, for the
        next try; only once none is left are the lists released and P's slot freed."""
        agent = self._need_agent()
        first: Exception | None = None
        kept: list[Any] = []
        for h in xfer.handles:
            try:
                agent.release_xfer_handle(h)
            except Exception as exc:
                first = first or exc
                kept.append(h)
        xfer.handles = kept
        if first is not None:
            raise first
        for h in xfer.dlists:
            try:
                agent.release_dlist_handle(h)
            except Exception as exc:
                self.log.warning("dlist.release_failed", error=repr(exc))
        xfer.dlists = []
        xfer.released = True
        self._maybe_free_slot(xfer)

    def _maybe_free_slot(self, xfer: ChunkedWrite) -> None:
        if xfer.released and xfer.gathered >= xfer.chunks and xfer.p_off is not None and self.ctx.staging is not None:
            self.ctx.staging.free(xfer.p_off)
            xfer.p_off = None

    def _post_rows(
        self,
        state: PushState,
        d_rank: int,
        target: Target,
        remote: RemotePeer,
        local_rows: Any,
        remote_addrs: Any,
        p_off: int | None,
        note: Note | None,
        *,
        staged_bytes: int,
        started: float | None = None,
        pieces: int | None = None,
    ) -> None:
        """Post one WRITE of explicit rows (address, length) into D's image; no rows: only the
        completion. Its descriptor lists are prepared for it and released when it settles.
        ``started``: when planning it began (post_ms then counts the plan, as plan_ms says)."""
        agent = self._need_agent()
        reg = target.registration
        completion = self._out.completion(reg.request_id)
        planned = time.monotonic()
        started = planned if started is None else started
        mine = self.ctx.staging
        if local_rows is None or not len(local_rows):
            self._complete_only(state, d_rank, target, remote, completion, note)
            return
        assert self.layout is not None and remote.layout is not None
        n = len(local_rows)
        ldesc = np.empty((n, 3), dtype=np.uint64)
        ldesc[:, 0] = local_rows[:, 0]
        ldesc[:, 1] = local_rows[:, 1]
        ldesc[:, 2] = mine.device_id if (mine is not None and p_off is not None) else self.layout.regions[0].device_id
        rdesc = np.empty((n, 3), dtype=np.uint64)
        rdesc[:, 0] = remote_addrs
        rdesc[:, 1] = local_rows[:, 1]
        rdesc[:, 2] = remote.info.staging.device_id if remote.info.staging is not None else 0
        local_h = remote_h = handle = None
        try:
            local_h = agent.prep_xfer_dlist(LOCAL_AGENT, ldesc, self.layout.mem_type)
            remote_h = agent.prep_xfer_dlist(remote.agent_name, rdesc, remote.layout.mem_type)
            idx = np.arange(n, dtype=np.int64)
            handle = agent.make_prepped_xfer("WRITE", local_h, idx, remote_h, idx, completion)
            status = agent.transfer(handle)
        except Exception as exc:
            if handle is not None:
                self._release_handle(handle)
            self._release_staged((local_h, remote_h, p_off))
            self._submit_failed(state, d_rank, target, remote, exc, note)
            return
        target.staged = (local_h, remote_h, p_off)
        nbytes = int(local_rows[:, 1].sum())
        target.posted(handle, remote, nbytes, started)
        self.ctx.metrics.incr("write.posted")
        self.ctx.metrics.incr("write.staged" if p_off is not None else "write.image_direct")
        self._emit(
            note,
            "write.posted",
            state,
            d_request_id=reg.request_id,
            d_rank=d_rank,
            bytes=nbytes,
            descs=n if pieces is None else pieces,  # pieces, as a direct push would post them
            merged_descs=n,
            posted_descs=n,  # the rows, joined where they run on
            staged=p_off is not None,
            gathered_bytes=staged_bytes,
            post_ms=round((time.monotonic() - started) * 1e3, 3),
            plan_ms=round((planned - started) * 1e3, 3),  # of post_ms: the staging plan and its runs
        )
        self._after_post(state, d_rank, target, status)

    def _release_staged(self, staged: Any) -> None:
        local_h, remote_h, p_off = staged
        agent = self.agent
        for h in (local_h, remote_h):
            if h is not None and agent is not None:
                try:
                    agent.release_dlist_handle(h)
                except Exception as exc:
                    self.log.warning("dlist.release_failed", error=repr(exc))
        if p_off is not None and self.ctx.staging is not None:
            self.ctx.staging.free(p_off)

    def _settle(self, state: PushState, d_rank: int, target: Target, *, ok: bool, reason: str) -> None:
        if target.handle is not None:
            self._release_handle(target.handle)
            target.handle = None
        if target.staged is not None:
            self._release_staged(target.staged)
            target.staged = None
        released = target.end(ok=ok, reason=reason)
        if released is not None and released.gone and released.in_flight == 0 and not self._loaded(released.agent_name):
            self._drop_remote(released)
        if ok:
            self.ctx.metrics.incr("write.done")
            self.ctx.metrics.incr("bytes.pushed", target.nbytes)
            self.log.debug(
                "write.settled",
                request_id=state.request_id,
                d_request_id=target.registration.request_id,
                ok=True,
                bytes=target.nbytes,
                ms=round((time.monotonic() - target.posted_at) * 1e3, 3) if target.posted_at else 0.0,
            )
            self._maybe_finish(state)
            return
        self.ctx.metrics.incr("write.failed")
        self._fail_target(state, d_rank, target, reason)

    def _fail_target(self, state: PushState, d_rank: int, target: Target, reason: str, *, finish: bool = True) -> None:
        target.end(ok=False, reason=reason)
        self._tell_d(target.registration, reason)
        self.log.info(
            "write.failed", request_id=state.request_id, d_request_id=target.registration.request_id, reason=reason
        )
        if finish:
            self._maybe_finish(state)

    def _maybe_finish(self, state: PushState) -> None:
        decided = self._book.outcome(state)
        if decided is None:
            return
        outcome, reason = decided
        # Always clear the lease: an expiry the reaper sent has popped it already (a no-op), but
        # one from elsewhere (the matcher's failure, a handler error, draining) has not, and a
        # lease left armed would outlive its request until its deadline.
        self._finish(state.request_id, outcome, reason, serial=state.serial)
        self.ctx.metrics.incr("push.latency_us_total", int((time.monotonic() - state.started) * 1e6))

    def _finish(self, request_id: str, outcome: str, reason: str, *, serial: int) -> None:
        ok = outcome == "pushed"
        # Clean-up first, report last: once the engine sees the request finished, its lease and
        # matcher entry are already on their way out (and a reused id cannot overtake them).
        self.ctx.peers.to_reaper(ClearLease(request_id=request_id, serial=serial))
        self.ctx.peers.to_matcher(Forget(request_id=request_id, outcome=outcome, serial=serial))  # type: ignore[arg-type]
        self._book.close(request_id, outcome, serial, time.monotonic())
        self.ctx.outbox.sent(request_id, ok=ok, reason=reason)
        self.ctx.metrics.incr(f"push.{outcome}")
        if ok:
            self.log.debug("push.finished", request_id=request_id, outcome=outcome)
        else:
            self.log.info("push.finished", request_id=request_id, outcome=outcome, reason=reason)

    @handles(ExpireLease)
    def _expire(self, msg: ExpireLease, note: Note) -> None:
        state = self._book.pushes.get(msg.request_id)
        if state is not None and msg.serial and state.serial != msg.serial:
            state = None if state.serial < msg.serial else state
            if state is not None:
                note("lease.expired_stale", serial=msg.serial)  # an older incarnation's expiry
                return
        if state is None:
            tomb = self._book.tombstones.get(msg.request_id)
            if tomb is not None and (not msg.serial or msg.serial <= tomb[1]):
                note("lease.expired_after_finish")
                return
            # Finished blocks that never met a registration: nothing in flight, free them.
            outcome = "failed" if msg.failed else "expired"
            self._finish(msg.request_id, outcome, msg.reason, serial=msg.serial)
            note("push.expired", level="info", reason=msg.reason, registered=False)
            return
        state.expired = msg.reason
        state.failed = state.failed or msg.failed
        for d_rank, target in list(state.targets.items()):
            if target.status == "waiting":
                self._fail_target(state, d_rank, target, msg.reason, finish=False)
        note("push.expired", level="info", reason=msg.reason, in_flight=state.in_flight)
        self._maybe_finish(state)

    @handles(CancelPush)
    def _cancel(self, msg: CancelPush, note: Note) -> None:
        state = self._book.pushes.get(msg.request_id)
        target = state.targets.get(msg.decode_tp_rank) if state else None
        if state is None or target is None or target.registration.request_id != msg.d_request_id:
            note("abort.nothing_to_cancel")
            return
        if target.status == "waiting":
            self._fail_target(state, msg.decode_tp_rank, target, "aborted by decode")
            note("abort.cancelled", level="info")
        elif target.status == "in_flight" and target.handle is not None:
            # The WRITE is let run to its end, and D's blocks are safe only then. Releasing a
            # live handle does not stop bytes already on their way: NIXL's UCX backend cancels
            # the UCX requests (its own comment: "may not be enough"), and a cuda_ipc or RDMA
            # copy already started runs on, so P would tell D "cancelled" while bytes still
            # land in blocks D then reuses. A WRITE takes milliseconds; one stuck past
            # write_timeout is cancelled by _expire_stuck_writes. D keeps the blocks past its
            # quarantine until P's final answer: the completion, or the failure below.
            if isinstance(target.handle, ChunkedWrite):
                # No further chunk is posted; the push fails once its live chunks ended.
                target.handle.failed = target.handle.failed or "aborted by decode"
            self.ctx.metrics.incr("write.abort_awaits_end")
            self._tell_d(target.registration, "aborted while its WRITE is in flight; it may still land", final=False)
            note("abort.awaiting_write", level="info")
        else:
            note("abort.too_late", status=target.status)

    def _try_cancel(self, state: PushState, d_rank: int, target: Target, reason: str) -> bool:
        """Release an in-flight WRITE (NIXL aborts it); True when NIXL agreed."""
        if self.config.nixl_sgl:
            # nixl 1.5.1: a WRITE cancelled in flight with NIXL_UCX_SGL_ENABLE crashes the
            # process soon after (docs/nixl.md). Refuse, like NIXL refusing a cancel: the WRITE
            # stays pinned, D keeps its blocks until it settles or P is gone.
            self.ctx.metrics.incr("write.cancel_unsafe")
            target.cancel_attempts += 1
            if target.cancel_attempts == 1:
                self.log.warning("write.cancel_unsafe", request_id=state.request_id, reason="nixl_sgl is on")
            return False
        try:
            if isinstance(target.handle, ChunkedWrite):
                self._release_chunked(target.handle)
            else:
                self._need_agent().release_xfer_handle(target.handle)
        except Exception as exc:
            self.ctx.metrics.incr("write.cancel_failed")
            target.cancel_attempts += 1
            # Retried every housekeeping pass while pinned: say it once, then quietly.
            level = "warning" if target.cancel_attempts == 1 else "debug"
            getattr(self.log, level)(
                "write.cancel_failed", request_id=state.request_id, attempts=target.cancel_attempts, error=repr(exc)
            )
            return False
        target.handle = None
        self._book.stop_tracking(target)
        self.ctx.metrics.incr("write.cancelled")
        self._settle(state, d_rank, target, ok=False, reason=reason)
        return True

    @handles(AnswerAbort)
    def _answer_abort(self, msg: AnswerAbort, note: Note) -> None:
        remote = self._table.by_agent(msg.sender)
        payload = self._out.push_failure(msg.d_request_id, msg.reason)
        if remote is None or self._send(remote, payload):
            note("abort.unanswered", level="info", sender=msg.sender)
            return
        note("abort.answered", reason=msg.reason)

    @handles(RefuseRegistration)
    def _refuse(self, msg: RefuseRegistration, note: Note) -> None:
        self._tell_d(msg.registration, msg.reason)
        note("reg.refused", level="info", reason=msg.reason)

    def _tell_d(self, reg: Registration, reason: str, *, final: bool = True) -> None:
        """Send a push failure to the D rank of ``reg`` (now, or after a notif handshake)."""
        payload = self._out.push_failure(reg.request_id, reason, final=final)
        if not reg.decode_host and not reg.decode_port:
            return
        if not self.config.trusts(reg.decode_engine_id, reg.decode_host):
            return  # never contact an untrusted address, not even to refuse it
        peer = d_peer(reg)
        remote = self._table.get(peer)
        if remote is None:
            if not self._draining:
                self._park(peer, full=False, work=Notify(payload, "push_fail", reg.request_id, peer))
            return
        if self._send(remote, payload) is None:
            self.ctx.metrics.incr("push_fail.sent")

    # --- handshakes --------------------------------------------------------------------------
    def _park(self, peer: PeerKey, *, full: bool, work: Work) -> None:
        verdict = self._table.park(peer, work)
        if verdict == "fetch":
            self.ctx.peers.to_handshake(FetchPeer(peer=peer, full=full))
        elif verdict != "joined":
            self._fail_work(work, verdict)

    @handles(HandshakeCompleted)
    def _handshake_completed(self, msg: HandshakeCompleted, note: Note) -> None:
        key = msg.peer
        note.fields["peer"] = f"{msg.peer.engine_id}/pp{msg.peer.pp_rank}/tp{msg.peer.tp_rank}"
        table = self._table
        if table.unclaimed(key, msg.info.agent_name):
            # Only registrations asked for this address, and none came from the agent it
            # serves: an address binds an agent only on that agent's own word (a replayed
            # handshake payload must not re-bind a real peer's name). Nothing is loaded.
            dropped = table.take_parked(key)
            for work in dropped:
                assert isinstance(work, AdmitReg)
                self._drop(
                    "reg.rejected_sender",
                    "reg.rejected",
                    request_id=work.header.request_id,
                    reason="sender is not the agent the named D address serves",
                    sender=work.sender,
                    expected=msg.info.agent_name,
                )
            self.ctx.metrics.incr("handshake.unclaimed")
            note("handshake.unclaimed", level="warning", agent=msg.info.agent_name, dropped=len(dropped))
            return
        binding, holder = table.binding(key, msg.info.agent_name, self._busy_remotes())
        if binding == "move" and holder is not None:
            # The name moved (a peer restarted at a new address): NIXL holds one agent per name,
            # so the idle old binding goes. A busy one is never displaced.
            table.pop(holder.peer)
            self._drop_remote(holder)
            self.ctx.metrics.incr("remote.moved")
            self.log.info("remote.moved", agent=holder.agent_name, to=f"{msg.peer.host}:{msg.peer.port}")
        elif binding == "conflict" and holder is not None:
            # That agent name speaks for another rank/address with work in flight: loading it
            # for a second one would let either impersonate the other.
            self.ctx.metrics.incr("handshake.failed.agent_conflict")
            self._handshake_failed(
                HandshakeFailed(
                    peer=msg.peer,
                    kind="agent_conflict",
                    reason=f"agent {msg.info.agent_name!r} is already bound to {holder.peer.host}:{holder.peer.port}",
                ),
                note,
            )
            return
        if table.room_needed(key) and not self._evict_one():
            self.ctx.metrics.incr("handshake.failed.capacity")
            self._handshake_failed(
                HandshakeFailed(peer=msg.peer, kind="capacity", reason="remote agent table is full"), note
            )
            return
        stale = table.get(key)
        if stale is not None and stale.in_flight == 0:
            # A restarted peer keeps its agent name; NIXL refuses to load a name it still holds.
            table.pop(key)
            self._drop_remote(stale)
        try:
            name = self._need_agent().add_remote_agent(msg.info.agent_metadata)
        except Exception as exc:
            self.ctx.metrics.incr("handshake.failed.add_remote_agent")
            self._handshake_failed(HandshakeFailed(peer=msg.peer, kind="add_remote_agent", reason=repr(exc)), note)
            return
        if name != msg.info.agent_name:
            # The metadata is another agent's (any side channel can hand out a peer's public
            # blob): every check above was about the name the reply claims, so nothing may be
            # bound on it. Unload what was just loaded only if no entry of ours uses that name
            # (the blob may be a real, loaded peer's: unloading it would cut that peer off).
            if not self._table.loaded(name):
                try:
                    self._need_agent().remove_remote_agent(name)
                except Exception as exc:
                    self.log.warning("remote.remove_failed", agent=name, error=repr(exc))
            self.ctx.metrics.incr("handshake.failed.agent_mismatch")
            reason = f"the reply names agent {msg.info.agent_name!r} but its metadata loads {name!r}"
            self._handshake_failed(HandshakeFailed(peer=msg.peer, kind="agent_mismatch", reason=reason), note)
            return
        old = table.get(key)
        if old is not None and old.agent_name != name and old.in_flight == 0:
            self._drop_remote(old)
        table.add(key, name, msg.info, msg.clock_offset, time.monotonic())
        replayed = 0
        for work in table.take_parked(key):
            replayed += 1
            self._replay(work)
        note("handshake.applied", agent=name, replayed=replayed)

    def _replay(self, work: Work) -> None:
        if isinstance(work, DeliverReg):
            remote = self._table.get(work.peer)
            rid = work.registration.request_id
            payload = self._out.registration(work.registration)
            err = self._send(remote, payload) if remote else "agent not loaded"
            if err and remote is not None and remote.gone and not work.retried and not self._draining:
                self.ctx.metrics.incr("reg.resent_after_peer_gone")
                self._park(work.peer, full=False, work=DeliverReg(work.registration, work.peer, retried=True))
            elif err:
                self.ctx.peers.to_reaper(
                    RecvUndelivered(
                        request_id=work.registration.request_id, count=1, reason=f"sending PUSH_REG failed: {err}"
                    ),
                )
            if not err:
                self._await(rid)
                self._expect_answer(work.peer, rid)
            self.log.debug("reg.sent", request_id=work.registration.request_id, replayed=True, failed=bool(err))
        elif isinstance(work, AdmitReg):
            self._admit(work.header, work.payload, work.sender, work.registration)
        elif isinstance(work, CheckDeath):
            remote = self._table.get(work.peer)
            info = remote.info if remote is not None else None
            if info is not None and bytes(info.agent_metadata) != work.agent_metadata:
                self._peer_dead(work, "another incarnation answers at its address")
        elif isinstance(work, DeliverPush):
            state, target = self._parked_push(work)
            if state is None or target is None or target.status != "waiting":
                return  # expired or cancelled while the handshake ran: no WRITE
            tomb = self._book.tombstones.get(work.request_id)
            if state.expired or (tomb is not None and state.serial <= tomb[1]):
                self._fail_target(state, work.d_rank, target, state.expired or "request already finished on P")
                return
            if time.monotonic() - target.fresh_at > self.config.lease_duration * 2 / 3:
                # The handshake took long: D may have aborted meanwhile (its abort lost) and
                # reused the blocks after its quarantine. Re-check before writing.
                self.ctx.metrics.incr("write.stale_replay")
                self._fail_target(state, work.d_rank, target, "registration went stale while P handshook with D")
                return
            reg = target.registration
            remote = self._table.get(d_peer(reg))
            if remote is None or (target.sender and remote.agent_name != target.sender):
                self._fail_target(state, work.d_rank, target, "D agent unavailable or changed")
                return
            self._post_write(state, work.d_rank, target, remote, None)
            self.log.debug("write.replayed", request_id=work.request_id, d_rank=work.d_rank, status=target.status)
        else:
            remote = self._table.get(work.peer)
            if remote is None or self._send(remote, work.payload):
                self.ctx.metrics.incr("writer.notify_undeliverable")

    @handles(HandshakeFailed)
    def _handshake_failed(self, msg: HandshakeFailed, note: Note) -> None:
        peer = f"{msg.peer.engine_id}/pp{msg.peer.pp_rank}/tp{msg.peer.tp_rank}"
        reason = f"handshake with {peer} failed ({msg.kind}): {msg.reason}"
        failed = 0
        for work in self._table.take_parked(msg.peer):
            failed += 1
            self._fail_work(work, reason, msg.kind)
        self.ctx.metrics.incr("handshake.failed")
        note("handshake.failed", level="warning", kind=msg.kind, reason=msg.reason, failed_work=failed)

    def _fail_work(self, work: Work, reason: str, kind: str = "") -> None:
        """Work that waited for a remote agent that will not come: end it visibly."""
        if isinstance(work, CheckDeath):
            if kind == "refused":  # nothing listens where that P served its metadata
                self._peer_dead(work, "its side channel refuses connections")
            elif kind != "shutdown" and not self._draining:
                self._retry_death_check(work, reason)
        elif isinstance(work, DeliverReg):
            self.ctx.peers.to_reaper(RecvUndelivered(request_id=work.registration.request_id, count=1, reason=reason))
        elif isinstance(work, AdmitReg):
            # D cannot be verified or reached; its watchdog bounds the request.
            self.ctx.metrics.incr("reg.unverified")
            self.log.warning("reg.unverified", request_id=work.header.request_id, reason=reason)
        elif isinstance(work, DeliverPush):
            state, target = self._parked_push(work)
            if state is not None and target is not None and target.status == "waiting":
                # D cannot be reached to be told; its watchdog and our lease bound it.
                target.end(ok=False, reason=reason)
                self._maybe_finish(state)
        else:
            self.ctx.metrics.incr("writer.notify_undeliverable")

    def _parked_push(self, work: DeliverPush) -> tuple[PushState | None, Target | None]:
        """The push and target a parked WRITE belongs to: that incarnation of the P id, to that
        D address, or none (an ended incarnation's work never touches the next one's)."""
        state = self._book.pushes.get(work.request_id)
        if state is None or state.serial != work.serial:
            return None, None
        target = state.targets.get(work.d_rank)
        if target is None or (work.peer is not None and d_peer(target.registration) != work.peer):
            return None, None
        return state, target

    def _retry_death_check(self, work: CheckDeath, reason: str) -> None:
        """No conclusive answer yet: ask again soon (0.25 s, doubling up to the heartbeat
        interval) while the quarantine it could shorten lasts."""
        now = time.monotonic()
        if now - work.first_at >= self.config.abort_quarantine:
            self.log.info("remote.death_unknown", agent=work.agent_name, attempts=work.attempts, reason=reason)
            return
        delay = min(0.25 * 2**work.attempts, self.config.heartbeat_every)
        again = CheckDeath(work.peer, work.agent_name, work.agent_metadata, work.first_at, work.attempts + 1)
        self._death_retries[work.peer] = (now + delay, again)
        self.ctx.metrics.incr("remote.death_check_retried")
        self.log.info(
            "remote.death_check_retried", agent=work.agent_name, attempt=again.attempts, delay=delay, reason=reason
        )

    def _peer_dead(self, work: CheckDeath, reason: str) -> None:
        self.ctx.metrics.incr("remote.dead")
        self.log.warning("remote.dead", agent=work.agent_name, reason=reason)
        self.ctx.peers.to_reaper(PeerDead(peer=work.peer, agent=work.agent_name, reason=reason))

    # --- remote engines ------------------------------------------------------------------------

    def _send(self, remote: RemotePeer, payload: bytes) -> str | None:
        try:
            self._need_agent().send_notif(remote.agent_name, self._out.seal(payload))
        except Exception as exc:
            self.ctx.metrics.incr("notif.send_failed")
            if _peer_gone(exc):
                self._forget_remote(remote)
            return repr(exc)
        remote.last_used = time.monotonic()
        return None

    def _forget_remote(self, remote: RemotePeer) -> None:
        """NIXL says the peer behind ``remote`` is gone: stop using it, so the next request for
        that rank handshakes again (a peer restarted under the same engine id has the same agent
        name but new memory and a new endpoint). Unloaded now, or when its last WRITE settles."""
        # What waited on it hears PeerGone below: exactly the requests whose registration
        # reached this agent. Any other request for that rank (parked while the agent was
        # forgotten, or not sent yet) goes to its next incarnation instead.
        owed = self._expecting.pop(remote.peer, {})
        if self._table.forget(remote):
            self.ctx.metrics.incr("remote.gone")
            self.log.warning("remote.gone", agent=remote.agent_name, in_flight=remote.in_flight, owed=len(owed))
            self.ctx.peers.to_reaper(
                PeerGone(
                    peer=remote.peer,
                    agent=remote.agent_name,
                    reason="NIXL reports it disconnected",
                    delivered=tuple(owed),
                )
            )
            if self.config.role != "producer" and not self._draining:
                # D: find out whether that P is dead for sure (then what waited on it can be
                # released now) or only unreachable (then the quarantine stands).
                info = remote.info
                self._death_retries.pop(remote.peer, None)
                self._park(
                    remote.peer,
                    full=False,
                    work=CheckDeath(
                        remote.peer,
                        remote.agent_name,
                        bytes(getattr(info, "agent_metadata", b"")),
                        first_at=time.monotonic(),
                    ),
                )
        if not remote.gone:
            remote.gone = True
            if remote.in_flight == 0:
                self._drop_remote(remote)

    def _loaded(self, agent_name: str) -> bool:
        """A current remote uses this agent name (a restarted peer re-loaded under it)."""
        return self._table.loaded(agent_name)

    def _busy_remotes(self) -> set[PeerKey]:
        return set(self._table.awaiting) | self._book.busy_peers() | set(self._expecting)

    @handles(EvictIdleEngines)
    def _evict(self, msg: EvictIdleEngines, note: Note) -> None:
        now = time.monotonic()
        evicted = []
        for key in self._table.idle(now, msg.idle_for, self._busy_remotes()):
            remote = self._table.pop(key)
            if remote is not None:
                self._drop_remote(remote)
            evicted.append(f"{key.engine_id}/pp{key.pp_rank}/tp{key.tp_rank}")
        note("engines.evicted" if evicted else "engines.kept", evicted=evicted, remaining=len(self._table.remotes))

    def _evict_one(self) -> bool:
        """Make room in a full remote table: drop the least recently used idle remote (never
        one with work in flight or waiting). False when every remote is busy."""
        key = self._table.least_recently_used_idle(self._busy_remotes())
        remote = self._table.pop(key) if key is not None else None
        if remote is None:
            return False
        self._drop_remote(remote)
        self.ctx.metrics.incr("remote.evicted_for_room")
        return True

    def _drop_remote(self, remote: RemotePeer) -> None:
        agent = self.agent
        if agent is None:
            return
        for handle in remote.dlists.values():
            try:
                agent.release_dlist_handle(handle)
            except Exception as exc:
                self.log.warning("dlist.release_failed", error=repr(exc))
        remote.dlists.clear()
        remote.pairings.clear()
        remote.prepared.clear()
        if any(r is not remote and r.agent_name == remote.agent_name for r in self._table.remotes.values()):
            return  # NIXL holds one agent per name: another entry of ours still writes through it
        try:
            agent.remove_remote_agent(remote.agent_name)
        except Exception as exc:
            self.log.warning("remote.remove_failed", agent=remote.agent_name, error=repr(exc))

    def _expire_stuck_writes(self, now: float) -> None:
        """A WRITE in flight past ``write_timeout`` is cancelled (its peer is likely gone).

        Only a WRITE NIXL agreed to cancel is settled: until then it may still read P's blocks,
        so the request keeps them (and this is retried on every housekeeping pass).
        """
        limit = self.config.write_timeout
        for state, d_rank, target in list(self._book.in_flight):
            if target.cancel_wanted:
                self._try_cancel(state, d_rank, target, target.cancel_wanted)
            elif now - target.posted_at > limit:
                if self._try_cancel(state, d_rank, target, f"WRITE not done after {limit:.0f}s: cancelled"):
                    self.ctx.metrics.incr("write.timed_out")
                else:
                    # Still in flight and not cancellable: D keeps its blocks until it settles.
                    target.cancel_wanted = f"WRITE not done after {limit:.0f}s: cancelled"
                    self._tell_d(target.registration, "WRITE stuck and not cancellable yet", final=False)

    def _release_handle(self, handle: XferHandle | ChunkedWrite) -> bool:
        """Release a WRITE's handle (NIXL cancels it if still active); False if it refused."""
        try:
            if isinstance(handle, ChunkedWrite):
                self._release_chunked(handle)
            else:
                self._need_agent().release_xfer_handle(handle)
        except Exception as exc:
            self.ctx.metrics.incr("writer.release_failed")
            self.log.warning("xfer.release_failed", error=repr(exc))
            return False
        return True

    # --- shutdown ----------------------------------------------------------------------------
    @handles(Drain)
    def _drain(self, msg: Drain, note: Note) -> dict[str, int]:
        self._draining = True
        parked = 0
        for key in list(self._table.awaiting):
            for work in self._table.take_parked(key):
                parked += 1
                if isinstance(work, DeliverReg):
                    self.ctx.peers.to_reaper(
                        RecvUndelivered(request_id=work.registration.request_id, count=1, reason="shutting down"),
                    )
        for state in list(self._book.pushes.values()):
            state.expired = state.expired or "shutting down"
            for target in state.targets.values():
                if target.status == "waiting":
                    target.end(ok=False, reason="shutting down")
        # Let in-flight WRITEs settle, but never past the deadline.
        while self._book.in_flight and time.monotonic() < msg.deadline:
            if not self._poll():
                time.sleep(self.config.poll_interval_busy)
        cancelled = 0
        for state, d_rank, target in self._book.in_flight:
            cancelled += 1
            # The process is going down: a WRITE still running at the deadline is cancelled
            # and its request failed, so the engine's shutdown is bounded (fault 31). Unlike an
            # abort or a dead actor (whose engine keeps serving), nothing reuses these blocks
            # afterwards. Never release an SGL WRITE in flight (see _try_cancel); one NIXL will
            # not cancel may still read this request's blocks: neither is ever reported.
            if self.config.nixl_sgl or (target.handle is not None and not self._release_handle(target.handle)):
                self.ctx.unreleased.add(state.request_id)
                self.log.critical("write.unreleased_at_stop", request_id=state.request_id)
                why = "WRITE not cancellable at P's shutdown; it may still land"
                self._tell_d(target.registration, why, final=False)
                self._book.pushes.pop(state.request_id, None)  # never finished: never reported
                target.handle = None
                continue
            target.handle = None
            self._settle(state, d_rank, target, ok=False, reason="cancelled at shutdown")
        self._book.in_flight = []
        for state in list(self._book.pushes.values()):
            self._maybe_finish(state)
        note("writer.drained", level="info", parked=parked, cancelled=cancelled)
        return {"parked": parked, "cancelled": cancelled}

    def _release_all(self) -> None:
        agent = self.agent
        if agent is None:
            return
        for state, _, target in self._book.in_flight:
            # D hears nothing from a stopped writer, so it never frees blocks on P's word: a
            # copy running on after a release lands only in blocks D still holds. What must
            # not happen is a WRITE NIXL refused to release (or an SGL one, never released in
            # flight) reading blocks the engine reused: such a request is never reported.
            if target.handle is not None and (self.config.nixl_sgl or not self._release_handle(target.handle)):
                self.ctx.unreleased.add(state.request_id)
                self.log.critical("write.unreleased_at_stop", request_id=state.request_id)
            target.handle = None
            if target.staged is not None:
                self._release_staged(target.staged)
                target.staged = None
        self._book.in_flight = []
        for remote in list(self._table.remotes.values()):
            self._drop_remote(remote)
        self._table.remotes.clear()
        for handle in self._local_dlists.values():
            try:
                agent.release_dlist_handle(handle)
            except Exception as exc:
                self.log.warning("dlist.release_failed", error=repr(exc))
        self._local_dlists.clear()
        if self._mem_registration is not None:
            try:
                agent.deregister_memory(self._mem_registration)
            except Exception as exc:
                self.log.warning("memory.deregister_failed", error=repr(exc))
            self._mem_registration = None

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        """Fail the request the message was about, through its ordinary failure path."""
        why = f"writer error: {exc!r}"
        if isinstance(message, (HandshakeCompleted, HandshakeFailed)):
            # The work parked on that peer would wait for a handshake that already came.
            for work in self._table.take_parked(message.peer):
                self._fail_work(work, why)
            return
        if isinstance(message, PostPush):
            state = self._book.pushes.get(message.request_id)
            target = state.targets.get(message.registration.decode_tp_rank) if state else None
            if state is not None and target is not None and target.status == "waiting":
                self._fail_target(state, message.registration.decode_tp_rank, target, why)
            elif target is None:
                self._tell_d(message.registration, why)
        elif isinstance(message, (ExpireLease, CancelPush)):
            state = self._book.pushes.get(message.request_id)
            if state is not None:
                state.expired = state.expired or why
                state.failed = True
                for d_rank, target in list(state.targets.items()):
                    if target.status == "waiting":
                        self._fail_target(state, d_rank, target, why, finish=False)
                self._maybe_finish(state)
            elif isinstance(message, ExpireLease) and message.request_id not in self._book.tombstones:
                self._finish(message.request_id, "failed", why, serial=message.serial)
        elif isinstance(message, SendRegistration):
            self.ctx.peers.to_reaper(
                RecvUndelivered(request_id=message.registration.request_id, count=1 << 30, reason=f"D {why}"),
            )
        elif isinstance(message, SendAbort):
            # The abort may not have gone out: P's lease and D's quarantine still bound it.
            self.ctx.metrics.incr("abort.unsent")
        elif isinstance(message, RefuseRegistration):
            self.ctx.metrics.incr("writer.notify_undeliverable")

    # --- introspection (tests, stats) --------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        return {
            **self._book.sizes(),
            **self._table.sizes(),
            "answers_awaited": len(self._awaiting),
            # Bounded by age, not emptied by every end: a request whose answer was lost is
            # dropped here after registration_timeout + abort_quarantine.
            "answers_expected": sum(len(w) for w in self._expecting.values()),
        }


def _unsigned(a: Any) -> Any:
    """``a`` as uint64, without a copy for int64 (planned addresses, offsets and lengths are
    never negative)."""
    return a.view(np.uint64) if a.dtype == np.int64 else a.astype(np.uint64)


def _peer_gone(exc: BaseException) -> bool:
    """True for NIXL's "remote agent disconnected" error (the peer process died or restarted)."""
    return "REMOTE_DISCONNECT" in f"{type(exc).__name__} {exc}" or type(exc).__name__ == "nixlRemoteDisconnectError"


def advertised_capacity(info: Any) -> tuple[int, ...]:
    """Logical blocks per KV group a D rank advertised (the smallest region of each group)."""
    caps: dict[int, int] = {}
    for region in info.regions:
        caps[region.group] = min(caps.get(region.group, region.num_blocks), region.num_blocks)
    ratio = max(1, int(info.physical_blocks_per_logical))
    return tuple(caps.get(g, 0) // ratio for g in range(max(caps) + 1)) if caps else ()
