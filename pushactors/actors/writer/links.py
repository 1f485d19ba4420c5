"""The writer's links to remote ranks: loading, binding, parking, forgetting (writer's thread).

:class:`Links` carries out what :class:`~pushactors.actors.writer.remotes.RemoteTable` decides
(which agent a handshake binds to which rank, which remote to evict, where work waits) with the
NIXL calls of :class:`~pushactors.actors.writer.poster.Poster`. Work parked behind a handshake is replayed
or failed through the two callbacks the writer gives it, so this class never needs to know
what the work is for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...protocol import FetchPeer, HandshakeCompleted, HandshakeFailed, PeerDead, PeerGone, PeerKey
from ...transport.agent import PeerDisconnected
from ..base import RankContext
from .answers import Answers
from .outbound import Outbound
from .poster import Poster
from .remotes import AdmitReg, CheckDeath, RemotePeer, RemoteTable, Work

Replay = Callable[[Work], None]
FailWork = Callable[[Work, str, str], None]


class Links:
    """Remote ranks of one writer (see the module docstring)."""

    def __init__(
        self,
        ctx: RankContext,
        log: Any,
        poster: Poster,
        out: Outbound,
        busy_peers: Callable[[], set[PeerKey]],
        answers: Answers,
    ) -> None:
        self.ctx = ctx
        self.log = log
        self.poster = poster
        self.out = out
        self.busy_peers = busy_peers  # D ranks a push still waits on or writes to (never evicted)
        self.answers = answers
        self.table = RemoteTable(
            max_remotes=ctx.config.max_remote_agents, max_parked_per_peer=ctx.config.max_parked_per_peer
        )
        self.draining = False
        self.replay: Replay = lambda work: None
        self.fail_work: FailWork = lambda work, reason, kind: None

    # --- sending and parking -----------------------------------------------------------------
    def get(self, peer: PeerKey) -> RemotePeer | None:
        return self.table.get(peer)

    def send(self, remote: RemotePeer, payload: bytes) -> str | None:
        """Send a notification (sealed when keys are set); the error, or None."""
        try:
            self.poster.send(remote.agent_name, self.out.seal(payload))
        except Exception as exc:
            self.ctx.metrics.incr("notif.send_failed")
            if isinstance(exc, PeerDisconnected):
                self.forget(remote)
            return repr(exc)
        remote.last_used = time.monotonic()
        return None

    def park(self, peer: PeerKey, *, full: bool, work: Work) -> None:
        """Hold ``work`` until ``peer``'s agent is loaded (asking the handshake actor once)."""
        verdict = self.table.park(peer, work)
        if verdict == "fetch":
            self.ctx.peers.to_handshake(FetchPeer(peer=peer, full=full))
        elif verdict != "joined":
            self.fail_work(work, verdict, "")

    # --- handshakes --------------------------------------------------------------------------
    def apply(self, msg: HandshakeCompleted, note: Any) -> HandshakeFailed | None:
        """Load the agent a handshake returned and replay what waited on it; a handshake that
        cannot bind is returned as the failure to apply instead."""
        key, table = msg.peer, self.table
        if table.unclaimed(key, msg.info.agent_name):
            # Only registrations asked for this address, and none came from the agent it
            # serves: an address binds an agent only on that agent's own word (a replayed
            # handshake payload must not re-bind a real peer's name). Nothing is loaded.
            dropped = table.take_parked(key)
            for work in dropped:
                assert isinstance(work, AdmitReg)
                self.ctx.metrics.incr("reg.rejected_sender")
                self.log.warning(
                    "reg.rejected",
                    request_id=work.header.request_id,
                    reason="sender is not the agent the named D address serves",
                    sender=work.sender,
                    expected=msg.info.agent_name,
                )
            self.ctx.metrics.incr("handshake.unclaimed")
            note("handshake.unclaimed", level="warning", agent=msg.info.agent_name, dropped=len(dropped))
            return None
        binding, holder = table.binding(key, msg.info.agent_name, self.busy())
        if binding == "move" and holder is not None:
            # The name moved (a peer restarted at a new address): NIXL holds one agent per name,
            # so the idle old binding goes. A busy one is never displaced.
            table.pop(holder.peer)
            self.drop(holder)
            self.ctx.metrics.incr("remote.moved")
            self.log.info("remote.moved", agent=holder.agent_name, to=f"{key.host}:{key.port}")
        elif binding == "conflict" and holder is not None:
            # That agent name speaks for another rank/address with work in flight: loading it
            # for a second one would let either impersonate the other.
            self.ctx.metrics.incr("handshake.failed.agent_conflict")
            why = f"agent {msg.info.agent_name!r} is already bound to {holder.peer.host}:{holder.peer.port}"
            return HandshakeFailed(peer=key, kind="agent_conflict", reason=why)
        if table.room_needed(key) and not self.evict_one():
            self.ctx.metrics.incr("handshake.failed.capacity")
            return HandshakeFailed(peer=key, kind="capacity", reason="remote agent table is full")
        stale = table.get(key)
        if stale is not None and stale.in_flight == 0:
            # A restarted peer keeps its agent name; NIXL refuses to load a name it still holds.
            table.pop(key)
            self.drop(stale)
        try:
            name = self.poster.load(msg.info.agent_metadata)
        except Exception as exc:
            self.ctx.metrics.incr("handshake.failed.add_remote_agent")
            return HandshakeFailed(peer=key, kind="add_remote_agent", reason=repr(exc))
        if name != msg.info.agent_name:
            # The metadata is another agent's (any side channel can hand out a peer's public
            # blob): every check above was about the name the reply claims, so nothing may be
            # bound on it. Unload what was just loaded only if no entry of ours uses that name
            # (the blob may be a real, loaded peer's: unloading it would cut that peer off).
            if not table.loaded(name):
                self.poster.unload_name(name)
            self.ctx.metrics.incr("handshake.failed.agent_mismatch")
            why = f"the reply names agent {msg.info.agent_name!r} but its metadata loads {name!r}"
            return HandshakeFailed(peer=key, kind="agent_mismatch", reason=why)
        old = table.get(key)
        if old is not None and old.agent_name != name and old.in_flight == 0:
            self.drop(old)
        table.add(key, name, msg.info, msg.clock_offset, time.monotonic(), clock_error=msg.clock_error)
        replayed = 0
        for work in table.take_parked(key):
            replayed += 1
            self.replay(work)
        note("handshake.applied", agent=name, replayed=replayed)
        return None

    def failed(self, msg: HandshakeFailed) -> int:
        """End every work parked on a peer whose handshake failed; how many."""
        peer = f"{msg.peer.engine_id}/pp{msg.peer.pp_rank}/tp{msg.peer.tp_rank}"
        reason = f"handshake with {peer} failed ({msg.kind}): {msg.reason}"
        parked = self.table.take_parked(msg.peer)
        for work in parked:
            self.fail_work(work, reason, msg.kind)
        return len(parked)

    # --- forgetting --------------------------------------------------------------------------
    def forget(self, remote: RemotePeer) -> None:
        """NIXL says the peer behind ``remote`` is gone: stop using it, so the next request for
        that rank handshakes again (a peer restarted under the same engine id has the same agent
        name but new memory and a new endpoint). Unloaded now, or when its last WRITE settles."""
        # What waited on it hears PeerGone below: exactly the requests whose registration
        # reached this agent. Any other request for that rank (parked while the agent was
        # forgotten, or not sent yet) goes to its next incarnation instead.
        owed = self.answers.owed_by(remote.peer)
        if self.table.forget(remote):
            self.ctx.metrics.incr("remote.gone")
            self.log.warning("remote.gone", agent=remote.agent_name, in_flight=remote.in_flight, owed=len(owed))
            why = "NIXL reports it disconnected"
            self.ctx.peers.to_reaper(PeerGone(peer=remote.peer, agent=remote.agent_name, reason=why, delivered=owed))
            if self.ctx.config.role != "producer" and not self.draining:
                # D: find out whether that P is dead for sure (then what waited on it can be
                # released now) or only unreachable (then the quarantine stands).
                metadata = bytes(getattr(remote.info, "agent_metadata", b""))
                self.answers.cancel_retry(remote.peer)
                check = CheckDeath(remote.peer, remote.agent_name, metadata, first_at=time.monotonic())
                self.park(remote.peer, full=False, work=check)
        if not remote.gone:
            remote.gone = True
            if remote.in_flight == 0:
                self.drop(remote)

    def released(self, remote: RemotePeer) -> None:
        """A WRITE to ``remote`` settled: a gone remote is unloaded with its last one."""
        if remote.gone and remote.in_flight == 0 and not self.table.loaded(remote.agent_name):
            self.drop(remote)

    def drop(self, remote: RemotePeer) -> None:
        shared = any(r is not remote and r.agent_name == remote.agent_name for r in self.table.remotes.values())
        self.poster.unload(remote, shared=shared)

    def retry_death_check(self, work: CheckDeath, reason: str) -> None:
        """No conclusive answer yet: ask again soon (0.25 s, doubling up to the heartbeat
        interval) while the quarantine it could shorten lasts."""
        now = time.monotonic()
        if now - work.first_at >= self.ctx.config.abort_quarantine:
            self.log.info("remote.death_unknown", agent=work.agent_name, attempts=work.attempts, reason=reason)
            return
        delay = min(0.25 * 2**work.attempts, self.ctx.config.heartbeat_every)
        again = CheckDeath(work.peer, work.agent_name, work.agent_metadata, work.first_at, work.attempts + 1)
        self.answers.retry_later(again, now + delay)
        self.ctx.metrics.incr("remote.death_check_retried")
        self.log.info(
            "remote.death_check_retried", agent=work.agent_name, attempt=again.attempts, delay=delay, reason=reason
        )

    def peer_dead(self, work: CheckDeath, reason: str) -> None:
        self.ctx.metrics.incr("remote.dead")
        self.log.warning("remote.dead", agent=work.agent_name, reason=reason)
        self.ctx.peers.to_reaper(PeerDead(peer=work.peer, agent=work.agent_name, reason=reason))

    def busy(self) -> set[PeerKey]:
        return set(self.table.awaiting) | self.busy_peers() | self.answers.busy()

    def evict_idle(self, idle_for: float) -> list[str]:
        evicted = []
        for key in self.table.idle(time.monotonic(), idle_for, self.busy()):
            remote = self.table.pop(key)
            if remote is not None:
                self.drop(remote)
            evicted.append(f"{key.engine_id}/pp{key.pp_rank}/tp{key.tp_rank}")
        return evicted

    def evict_one(self) -> bool:
        """Make room in a full remote table: drop the least recently used idle remote (never
        one with work in flight or waiting). False when every remote is busy."""
        key = self.table.least_recently_used_idle(self.busy())
        remote = self.table.pop(key) if key is not None else None
        if remote is None:
            return False
        self.drop(remote)
        self.ctx.metrics.incr("remote.evicted_for_room")
        return True

    def close(self) -> None:
        for remote in list(self.table.remotes.values()):
            self.drop(remote)
        self.table.remotes.clear()
        self.poster.close()
