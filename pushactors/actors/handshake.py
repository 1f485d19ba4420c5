"""The handshake actor: fetches and validates remote ranks' metadata off the writer.

Each fetch runs on its own daemon thread, so an unreachable peer (a fetch that blocks up to
``handshake_timeout``) delays only the requests waiting on that peer's address:

* the same :class:`PeerKey` is fetched once however many requests wait on it (the writer parks
  those; a full fetch answers a notif-only waiter too);
* at most :data:`PER_ADDRESS_IN_FLIGHT` fetches run at once per side-channel address
  ``(host, port)``; further ranks of that address queue behind it, and only behind it;
* at most ``max_handshakes_in_flight`` fetches run at once in all; past that, fetches queue and
  are started round-robin by address, so one address with many ranks cannot starve others;
* a fetch that waited ``handshake_timeout`` in a queue fails with kind ``timeout`` without
  running, so a caller waits at most ``handshake_timeout`` queued plus ``handshake_timeout``
  on the wire;
* on stop, every fetch not yet answered fails with kind ``shutdown``; running threads are
  daemons and their late answers are dropped.

``handshake_workers`` is accepted for compatibility but unused: the thread-per-fetch design has
no worker pool to size (``max_handshakes_in_flight`` bounds the threads).

A fetch's outcome comes back to this actor as a :class:`FetchSettled` message, is validated
here (hash before body, then engine id and rank), and goes to the writer as
:class:`HandshakeCompleted` or :class:`HandshakeFailed`.

Liveness probes (D): the reaper asks about a P rank that owes an aborted request its final
answer (:class:`ProbePeer`, about once a second per rank while it owes one). A probe is one fetch
from that rank's side channel on its own daemon thread, with a short timeout
(:data:`PROBE_TIMEOUT`), at most one per rank and ``max_handshakes_in_flight`` in all, outside the
handshake slots above (a probe never delays a handshake). Its outcome (:class:`ProbeSettled`) is
judged against the incarnation this actor last verified for that rank: a refused connection, or
another incarnation's metadata served there, means the process D registered with is dead, and
the reaper hears :class:`PeerDead`; the same incarnation answering, or anything inconclusive (a
timeout, a dropped connection, an unreachable host, a reply that does not validate), changes
nothing.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import pykka

from ..protocol import (
    FetchPeer,
    FetchSettled,
    HandshakeCompleted,
    HandshakeError,
    HandshakeFailed,
    HandshakeRequest,
    PeerDead,
    PeerKey,
    decode_handshake,
)
from ..protocol.mailbox import ProbePeer, ProbeSettled
from ..transport.directory import MetadataSource, SideChannelError
from .base import Note, PushActor, RankContext, handles

# One exchange at a time per side channel: its ranks are cheap to fetch in turn, and a dead
# address then holds one thread, not many, of the global bound.
PER_ADDRESS_IN_FLIGHT = 1
# How many peer labels one log event lists (the count is always exact).
_LABELS_LOGGED = 8
# The longest a liveness probe waits for a P rank's side channel (``handshake_timeout`` when
# that is shorter). A killed process's port refuses at once; one that only lingers for a moment
# (accepts, then drops the connection) is asked again at the next probe, about a second later.
PROBE_TIMEOUT = 1.0
# Verified P ranks whose incarnation a probe can compare against (LRU; one forgotten is judged
# by a refused connection alone).
MAX_INCARNATIONS = 4096

Address = tuple[str, int]


@dataclass(eq=False)
class _Queued:
    """A fetch waiting for a slot; ``done`` once started or failed (lazily dropped from queues)."""

    peer: PeerKey
    queued_at: float
    done: bool = False


class Handshake(PushActor):
    actor_name = "handshake"

    def __init__(self, ctx: RankContext, source: MetadataSource, compat_hash: str) -> None:
        super().__init__(ctx)
        self._source = source
        self._compat_hash = compat_hash
        # Peers asked for and not yet answered (queued or running) -> full fetch wanted.
        self._inflight: dict[PeerKey, bool] = {}
        self._running: dict[Address, int] = {}
        self._running_total = 0
        # Per-address FIFO of waiting fetches, and the round-robin order of addresses that have
        # waiting fetches and a free per-address slot (a dict keeps insertion order).
        self._queues: dict[Address, deque[_Queued]] = {}
        self._ready: dict[Address, None] = {}
        # Every waiting fetch in arrival order; one timeout for all makes this deadline order.
        self._arrivals: deque[_Queued] = deque()
        self._waiting = 0  # live entries in the queues
        # D: the incarnation last verified per P rank (agent name, digest of its NIXL metadata),
        # what a liveness probe's answer is judged against; and the ranks being probed now.
        self._incarnations: OrderedDict[PeerKey, tuple[str, bytes]] = OrderedDict()
        self._probing: set[PeerKey] = set()

    # --- mailbox -------------------------------------------------------------------------------
    @handles(FetchPeer)
    def _fetch(self, msg: FetchPeer, note: Note) -> None:
        peer = msg.peer
        note.fields.update(peer=_peer_label(peer), full=msg.full)
        if peer in self._inflight:
            # A full fetch answers a notif-only waiter too; upgrade if needed.
            self._inflight[peer] = self._inflight[peer] or msg.full
            self.ctx.metrics.incr("handshake.joined")
            note("handshake.joined")
            return
        self._inflight[peer] = msg.full
        addr = _address(peer)
        if self._has_slot(addr):
            # No live work can be queued for an address with a free slot (dispatch would have
            # started it), so starting now keeps FIFO order.
            error = self._start(peer)
            if error:
                self._fail(peer, "error", error, note)
            else:
                note("handshake.started", running=self._running_total)
            return
        entry = _Queued(peer, time.monotonic())
        self._queues.setdefault(addr, deque()).append(entry)
        self._arrivals.append(entry)
        self._waiting += 1
        if self._running.get(addr, 0) < PER_ADDRESS_IN_FLIGHT:
            self._ready.setdefault(addr)
        self._arm_expiry()
        self.ctx.metrics.incr("handshake.queued")
        note(
            "handshake.queued",
            reason="address busy" if addr not in self._ready else "in-flight bound",
            running=self._running_total,
            queued=self._waiting,
        )

    @handles(FetchSettled)
    def _settled(self, msg: FetchSettled, note: Note) -> None:
        note.fields.update(peer=_peer_label(msg.peer))
        # Free the slot first: whatever happens below, the next fetch may start.
        try:
            self._release(_address(msg.peer))
            self._validate(msg, note)
        finally:
            started, expired = self._dispatch()
            if started:
                note.fields["started_next"] = started
            if expired:
                note.fields["expired"] = len(expired)
                note.fields["expired_peers"] = expired[:_LABELS_LOGGED]

    def _validate(self, msg: FetchSettled, note: Note) -> None:
        full = self._inflight.pop(msg.peer, msg.full)
        if msg.payload is None:
            self._fail(msg.peer, msg.error_kind or "error", msg.error, note)
            return
        try:
            info = decode_handshake(msg.payload, expected_hash=self._compat_hash, expected_engine=msg.peer.engine_id)
        except HandshakeError as exc:
            self._fail(msg.peer, exc.kind, exc.detail, note)
            return
        if (info.pp_rank, info.tp_rank) != (msg.peer.pp_rank, msg.peer.tp_rank):
            self._fail(
                msg.peer,
                "wrong_rank",
                f"asked for pp{msg.peer.pp_rank}/tp{msg.peer.tp_rank}, got pp{info.pp_rank}/tp{info.tp_rank}",
                note,
            )
            return
        offset = info.clock.monotonic - (msg.sent_at + msg.received_at) / 2 if msg.received_at else 0.0
        # The peer's wall clock against ours at the exchange's midpoint: what a log reader needs
        # to put both processes' events on one time line (``pushactors logs``).
        wall_offset = 0.0
        if msg.received_at:
            mid_wall = time.time() - (time.monotonic() - (msg.sent_at + msg.received_at) / 2)
            wall_offset = info.clock.wall - mid_wall
        self._remember(msg.peer, info.agent_name, bytes(info.agent_metadata))
        self.ctx.metrics.incr("handshake.completed")
        error = (msg.received_at - msg.sent_at) / 2 if msg.received_at else None
        self.ctx.peers.to_writer(
            HandshakeCompleted(peer=msg.peer, info=info, full=full, clock_offset=offset, clock_error=error)
        )
        note(
            "handshake.completed",
            agent=info.agent_name,
            regions=len(info.regions),
            rtt_ms=round((msg.received_at - msg.sent_at) * 1e3, 3),
            clock_offset_ms=round(offset * 1e3, 3),
            wall_offset_ms=round(wall_offset * 1e3, 3),
        )

    # --- liveness probes (D) ---------------------------------------------------------------------
    @handles(ProbePeer)
    def _probe(self, msg: ProbePeer, note: Note) -> None:
        peer = msg.peer
        note.fields["peer"] = _peer_label(peer)
        if peer in self._probing:
            note("peer.probe_running")  # its answer comes; the next round asks again
            return
        if len(self._probing) >= self.config.max_handshakes_in_flight:
            self.ctx.metrics.incr("peer.probe_skipped")
            note("peer.probe_skipped", level="info", reason="probe bound", probing=len(self._probing))
            return
        timeout = min(PROBE_TIMEOUT, self.config.handshake_timeout)
        thread = threading.Thread(
            target=_probe_and_report,
            args=(self.actor_ref, self._source, peer, self._request(peer)),
            kwargs={"timeout": timeout},
            name=f"pushactors-probe-{self.ctx.label}-{peer.host}:{peer.port}/pp{peer.pp_rank}/tp{peer.tp_rank}",
            daemon=True,  # a side channel that never answers must not keep the process alive
        )
        try:
            thread.start()
        except RuntimeError as exc:  # out of threads: asked again next round
            self.ctx.metrics.incr("peer.probe_skipped")
            note("peer.probe_skipped", level="warning", reason=repr(exc))
            return
        self._probing.add(peer)
        self.ctx.metrics.incr("peer.probe_sent")
        note("peer.probe_sent", timeout=timeout)

    @handles(ProbeSettled)
    def _probe_settled(self, msg: ProbeSettled, note: Note) -> None:
        peer = msg.peer
        self._probing.discard(peer)
        note.fields["peer"] = _peer_label(peer)
        known = self._incarnations.get(peer)
        agent = known[0] if known is not None else _peer_label(peer)
        verdict, why = self._judge(msg, known)
        self.ctx.metrics.incr(f"peer.probe_{verdict}")
        if verdict == "dead":
            self.ctx.peers.to_reaper(PeerDead(peer=peer, agent=agent, reason=why))
            note("peer.probe_dead", level="warning", agent=agent, reason=why)
        else:
            note(f"peer.probe_{verdict}", agent=agent, reason=why)

    def _judge(self, msg: ProbeSettled, known: tuple[str, bytes] | None) -> tuple[str, str]:
        """("dead" | "alive" | "inconclusive", why). Dead only on proof that the process D
        registered with is gone: nothing listens where it served its metadata, or another
        incarnation (the same engine id and rank, other NIXL metadata) is served there."""
        if msg.payload is None:
            if msg.error_kind == "refused":
                return "dead", "its side channel refuses connections"
            # A timeout, an unreachable host, a dropped connection: a live P behind a broken
            # link looks the same as a dying one. Asked again next round.
            return "inconclusive", f"{msg.error_kind}: {msg.error}"[:300]
        try:
            info = decode_handshake(msg.payload, expected_hash=self._compat_hash, expected_engine=msg.peer.engine_id)
        except HandshakeError as exc:
            return "inconclusive", f"its reply does not validate ({exc.kind}): {exc.detail}"[:300]
        if (info.pp_rank, info.tp_rank) != (msg.peer.pp_rank, msg.peer.tp_rank):
            asked, got = f"pp{msg.peer.pp_rank}/tp{msg.peer.tp_rank}", f"pp{info.pp_rank}/tp{info.tp_rank}"
            return "inconclusive", f"asked for {asked}, got {got}"
        if known is None:
            return "inconclusive", "no incarnation of it verified here to compare with"
        if _digest(bytes(info.agent_metadata)) != known[1]:
            return "dead", "another incarnation answers at its address"
        return "alive", "it answers as itself"

    def _remember(self, peer: PeerKey, agent: str, metadata: bytes) -> None:
        self._incarnations.pop(peer, None)
        self._incarnations[peer] = (agent, _digest(metadata))
        while len(self._incarnations) > MAX_INCARNATIONS:
            self._incarnations.popitem(last=False)

    def _request(self, peer: PeerKey) -> HandshakeRequest:
        return HandshakeRequest(
            pp_rank=peer.pp_rank,
            tp_rank=peer.tp_rank,
            requester_engine_id=self.ctx.engine_id,
            requester_agent=self.ctx.agent_name,
        )

    def on_tick(self, now: float) -> None:
        # Ticks are armed only for queued fetches' deadlines; expire those that are due.
        expired = self._expire_due(now)
        self._arm_expiry()
        if expired:
            self.log.warning(
                "handshake.queue_expired",
                expired=len(expired),
                expired_peers=expired[:_LABELS_LOGGED],
                running=self._running_total,
                queued=self._waiting,
            )

    def on_stop(self) -> None:
        # Everything not yet answered fails now: the writer must not wait for answers that a
        # stopped actor can no longer deliver. Running threads are daemons; their tell fails.
        pending = list(self._inflight)
        self._inflight.clear()
        self._queues.clear()
        self._ready.clear()
        self._arrivals.clear()
        self._waiting = 0
        for peer in pending:
            self.ctx.metrics.incr("handshake.failed.shutdown")
            try:
                self.ctx.peers.to_writer(HandshakeFailed(peer=peer, kind="shutdown", reason="handshake stopped"))
            except RuntimeError:
                pass  # no writer connected: nobody to tell
        if pending:
            self.log.info(
                "handshake.stopped", failed=len(pending), peers=[_peer_label(p) for p in pending[:_LABELS_LOGGED]]
            )

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        if isinstance(message, (ProbePeer, ProbeSettled)):
            # A probe is no handshake: nothing waits on it, and the rank is asked again next round.
            self._probing.discard(message.peer)
            return
        peer = getattr(message, "peer", None)
        if isinstance(peer, PeerKey) and self._inflight.pop(peer, None) is not None:
            self.ctx.peers.to_writer(HandshakeFailed(peer=peer, kind="error", reason=repr(exc)))

    # --- scheduling ----------------------------------------------------------------------------
    def _has_slot(self, addr: Address) -> bool:
        return (
            self._running_total < self.config.max_handshakes_in_flight
            and self._running.get(addr, 0) < PER_ADDRESS_IN_FLIGHT
        )

    def _release(self, addr: Address) -> None:
        left = self._running.get(addr, 0) - 1
        if left > 0:
            self._running[addr] = left
        else:
            self._running.pop(addr, None)
        self._running_total = max(0, self._running_total - 1)
        if self._queues.get(addr):
            self._ready.setdefault(addr)

    def _dispatch(self) -> tuple[int, list[str]]:
        """Start waiting fetches while slots are free, one per ready address in turn.

        Returns how many started and the labels of those that expired instead.
        """
        now = time.monotonic()
        timeout = self.config.handshake_timeout
        started = 0
        expired: list[str] = []
        while self._ready and self._running_total < self.config.max_handshakes_in_flight:
            addr = next(iter(self._ready))
            del self._ready[addr]
            entry = self._pop_live(addr)
            if entry is None:
                continue
            self._take(entry)
            if now - entry.queued_at >= timeout:
                # Waited its whole budget: fail it rather than start a second timeout's worth.
                self._expire(entry.peer)
                expired.append(_peer_label(entry.peer))
            else:
                error = self._start(entry.peer)
                if error:
                    self._inflight.pop(entry.peer, None)
                    self._tell_failed(entry.peer, "error", error)
                else:
                    started += 1
            # Back of the rotation, so every other ready address goes before its next rank.
            if self._queues.get(addr) and self._running.get(addr, 0) < PER_ADDRESS_IN_FLIGHT:
                self._ready[addr] = None
        self._arm_expiry()
        return started, expired

    def _pop_live(self, addr: Address) -> _Queued | None:
        queue = self._queues.get(addr)
        while queue:
            entry = queue.popleft()
            if not entry.done:
                if not queue:
                    del self._queues[addr]
                return entry
        self._queues.pop(addr, None)
        return None

    def _expire_due(self, now: float) -> list[str]:
        timeout = self.config.handshake_timeout
        expired: list[str] = []
        while self._arrivals and (self._arrivals[0].done or now - self._arrivals[0].queued_at >= timeout):
            entry = self._arrivals.popleft()
            if entry.done:
                continue
            self._take(entry)  # its per-address queue drops it lazily
            self._expire(entry.peer)
            expired.append(_peer_label(entry.peer))
        return expired

    def _arm_expiry(self) -> None:
        while self._arrivals and self._arrivals[0].done:
            self._arrivals.popleft()
        if self._arrivals:
            due = self._arrivals[0].queued_at + self.config.handshake_timeout
            self.arm_tick(due - time.monotonic())

    def _take(self, entry: _Queued) -> None:
        entry.done = True
        self._waiting -= 1

    def _expire(self, peer: PeerKey) -> None:
        self._inflight.pop(peer, None)
        self.ctx.metrics.incr("handshake.queue_expired")
        self._tell_failed(
            peer, "timeout", f"waited {self.config.handshake_timeout}s for a handshake slot (not attempted)"
        )

    def _tell_failed(self, peer: PeerKey, kind: str, reason: str) -> None:
        self.ctx.metrics.incr(f"handshake.failed.{kind}")
        self.ctx.peers.to_writer(HandshakeFailed(peer=peer, kind=kind, reason=reason))

    def _fail(self, peer: PeerKey, kind: str, reason: str, note: Note) -> None:
        self._inflight.pop(peer, None)
        self._tell_failed(peer, kind, reason)
        note("handshake.failed", level="warning", kind=kind, reason=reason)

    def _start(self, peer: PeerKey) -> str | None:
        """Run one fetch on its own daemon thread; returns an error if no thread could start."""
        addr = _address(peer)
        thread = threading.Thread(
            target=_fetch_and_report,
            args=(self.actor_ref, self._source, peer, self._inflight.get(peer, True), self._request(peer)),
            kwargs={"timeout": self.config.handshake_timeout},
            name=f"pushactors-hs-{self.ctx.label}-{peer.host}:{peer.port}/pp{peer.pp_rank}/tp{peer.tp_rank}",
            daemon=True,  # a peer that never answers must not keep the process alive
        )
        try:
            thread.start()
        except RuntimeError as exc:  # out of threads
            return repr(exc)
        self._running[addr] = self._running.get(addr, 0) + 1
        self._running_total += 1
        self.ctx.metrics.incr("handshake.started")
        return None


def _fetch_and_report(
    me: pykka.ActorRef[Any],
    source: MetadataSource,
    peer: PeerKey,
    full: bool,
    request: HandshakeRequest,
    *,
    timeout: float,
) -> None:
    """Thread body: one side-channel exchange, answered to the actor as :class:`FetchSettled`."""
    sent_at = time.monotonic()
    settled: FetchSettled
    try:
        payload = source.fetch(peer, request, timeout)
        received_at = time.monotonic()
        # A source that knows when its request left (after connecting) gives a tighter bracket
        # around the peer's clock sample.
        last_sent = getattr(source, "last_sent", None)
        sent = last_sent() if callable(last_sent) else None
        if isinstance(sent, float) and sent_at <= sent <= received_at:
            sent_at = sent
        settled = FetchSettled(peer=peer, full=full, payload=payload, sent_at=sent_at, received_at=received_at)
    except SideChannelError as exc:
        settled = FetchSettled(peer=peer, full=full, error_kind=exc.kind, error=exc.detail)
    except BaseException as exc:  # every started fetch must settle, or its slot leaks
        settled = FetchSettled(peer=peer, full=full, error_kind="error", error=repr(exc))
    try:
        me.tell(settled)
    except pykka.ActorDeadError:
        pass  # stopped while the fetch ran: nobody waits for it any more


def _probe_and_report(
    me: pykka.ActorRef[Any], source: MetadataSource, peer: PeerKey, request: HandshakeRequest, *, timeout: float
) -> None:
    """Thread body: one liveness probe, answered to the actor as :class:`ProbeSettled`."""
    settled: ProbeSettled
    try:
        settled = ProbeSettled(peer=peer, payload=source.fetch(peer, request, timeout))
    except SideChannelError as exc:
        settled = ProbeSettled(peer=peer, error_kind=exc.kind, error=exc.detail)
    except BaseException as exc:  # every started probe must settle, or its rank is never asked again
        settled = ProbeSettled(peer=peer, error_kind="error", error=repr(exc))
    try:
        me.tell(settled)
    except pykka.ActorDeadError:
        pass  # stopped while the probe ran: nobody waits for it any more


def _digest(metadata: bytes) -> bytes:
    return hashlib.blake2b(metadata, digest_size=16).digest()


def _address(peer: PeerKey) -> Address:
    return (peer.host, peer.port)


def _peer_label(peer: PeerKey) -> str:
    return f"{peer.engine_id}/pp{peer.pp_rank}/tp{peer.tp_rank}"
