"""The writer's table of remote ranks, as plain state (no NIXL, no threads).

Which remote agents are loaded (keyed by engine id, side-channel address and ranks), which agent
name a handshake verified as which rank, and the work parked behind a handshake in progress.
The writer asks it what to do and makes the NIXL calls itself.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Union

from ...core.blocks import PairedLayout, RemoteLayout
from ...protocol import PeerKey, Registration, RegistrationHeader
from ...transport.agent import DlistHandle

MAX_IDENTITIES = 1 << 14  # agent name -> verified rank bindings remembered (LRU)


class Prepared(NamedTuple):
    """The writer's pairing for one D rank and both prepared lists (none when this rank writes
    no heads there). ``pairing_id`` names it across mailboxes: only ``paired`` (a pure value)
    and the id leave the writer's thread, never the NIXL handles."""

    paired: PairedLayout
    local: DlistHandle | None
    remote: DlistHandle | None
    pairing_id: int


def d_peer(reg: Registration | RegistrationHeader) -> PeerKey:
    """The D rank a registration names (verified against its sender before any use)."""
    return PeerKey(reg.decode_engine_id, reg.decode_host, reg.decode_port, 0, reg.decode_tp_rank)


@dataclass
class RemotePeer:
    """A loaded remote agent and what was prepared for WRITEs to it."""

    peer: PeerKey
    agent_name: str
    info: Any  # AgentInfo
    clock_offset: float
    last_used: float
    in_flight: int = 0
    layout: RemoteLayout | None = None
    # Per head range written to this rank: its pairing and prepared remote descriptor list.
    pairings: dict[tuple[int, int], PairedLayout] = field(default_factory=dict)
    dlists: dict[tuple[int, int], DlistHandle] = field(default_factory=dict)
    # Per (D rank, D TP size): the writer's pairing and both prepared lists, once checked
    # (neither side's layout changes while the remote stays loaded).
    prepared: dict[tuple[int, int], Prepared] = field(default_factory=dict)
    gone: bool = False  # NIXL reported the peer disconnected: unloaded once nothing is in flight
    clock_error: float | None = None  # bound on clock_offset's error (None: no clock sample)

    def local_time(self, remote_time: float) -> float:
        """A deadline on the peer's clock, on ours, moved earlier by the estimate's error;
        0.0 when there is none or the peer's clock is unknown."""
        if remote_time <= 0 or self.clock_error is None:
            return 0.0
        return remote_time - self.clock_offset - self.clock_error


# --- work that waits for a remote agent ---------------------------------------------------------
@dataclass
class DeliverReg:
    """D: send this registration to that P rank once its agent is loaded."""

    registration: Registration
    peer: PeerKey
    retried: bool = False  # already re-sent once after the peer turned out to be gone


@dataclass
class DeliverPush:
    """P: post this push's WRITE to that D rank once its agent is loaded."""

    request_id: str
    d_rank: int
    serial: int = 0  # the incarnation of the P id it belongs to: never another's
    peer: PeerKey | None = None  # the D rank's address it waits for


@dataclass
class AdmitReg:
    """P: verify this registration's sender against the agent its D address serves."""

    header: RegistrationHeader
    payload: bytes  # a large registration's msgpack body, decoded by the matcher once verified
    sender: str
    registration: Registration | None = None  # a small one, decoded already


@dataclass
class Notify:
    """Send this notification once the peer's agent is loaded."""

    payload: bytes
    what: str
    request_id: str
    peer: PeerKey


@dataclass
class CheckDeath:
    """D: NIXL said this P rank's agent disconnected. Ask its side channel again: nothing
    listening, or another incarnation answering, means the old process is dead and can write
    nothing more (D's requests waiting only on it need not sit out their quarantine)."""

    peer: PeerKey
    agent_name: str
    agent_metadata: bytes
    # An inconclusive answer (a timeout, a connection dropped mid-reply: a process being
    # killed does both for a moment) is asked again, backing off, until the quarantine it could
    # cut short is over anyway.
    first_at: float = 0.0
    attempts: int = 0


Work = Union[DeliverReg, DeliverPush, AdmitReg, Notify, CheckDeath]
Binding = Literal["new", "move", "conflict"]


class RemoteTable:
    """Loaded remote ranks, verified agent names, and parked work, with their bounds."""

    def __init__(self, *, max_remotes: int, max_parked_per_peer: int, max_identities: int = MAX_IDENTITIES) -> None:
        self.max_remotes = max_remotes
        self.max_parked_per_peer = max_parked_per_peer
        self.max_identities = max_identities
        self.remotes: dict[PeerKey, RemotePeer] = {}
        self.awaiting: dict[PeerKey, list[Work]] = {}
        self._identity: OrderedDict[str, PeerKey] = OrderedDict()

    # --- lookups -----------------------------------------------------------------------------
    def get(self, peer: PeerKey) -> RemotePeer | None:
        return self.remotes.get(peer)

    def identify(self, agent_name: str) -> PeerKey | None:
        """The rank a handshake verified ``agent_name`` as (who a notification is from)."""
        return self._identity.get(agent_name)

    def by_agent(self, agent_name: str) -> RemotePeer | None:
        peer = self._identity.get(agent_name)
        remote = self.remotes.get(peer) if peer is not None else None
        return remote if remote is not None and remote.agent_name == agent_name else None

    def loaded(self, agent_name: str) -> bool:
        """A current remote uses this agent name (a restarted peer re-loaded under it)."""
        return any(r.agent_name == agent_name for r in self.remotes.values())

    # --- parked work ---------------------------------------------------------------------------
    def park(self, peer: PeerKey, work: Work) -> str:
        """Queue ``work`` behind ``peer``'s handshake: "fetch" (start one), "joined", or why
        it was refused (the caller fails it)."""
        waiting = self.awaiting.get(peer)
        if waiting is None:
            if len(self.awaiting) >= self.max_remotes:
                return "too many handshakes pending on this rank"
            self.awaiting[peer] = [work]
            return "fetch"
        if len(waiting) >= self.max_parked_per_peer:
            return "too much work parked behind one handshake"
        waiting.append(work)
        return "joined"

    def take_parked(self, peer: PeerKey) -> list[Work]:
        return self.awaiting.pop(peer, [])

    def unclaimed(self, peer: PeerKey, agent_name: str) -> bool:
        """Only registrations wait for this (not yet loaded) address, and none came from the
        agent it serves: an address binds an agent only on that agent's own word."""
        waiting = self.awaiting.get(peer)
        return (
            peer not in self.remotes
            and bool(waiting)
            and all(isinstance(w, AdmitReg) and w.sender != agent_name for w in waiting or ())
        )

    def unpark_registration(self, peer: PeerKey, request_id: str) -> int:
        """Drop a D registration still waiting to be sent to ``peer``; how many were dropped."""
        waiting = self.awaiting.get(peer)
        if not waiting:
            return 0
        keep = [w for w in waiting if not (isinstance(w, DeliverReg) and w.registration.request_id == request_id)]
        self.awaiting[peer] = keep
        return len(waiting) - len(keep)

    # --- binding -------------------------------------------------------------------------------
    def binding(self, peer: PeerKey, agent_name: str, busy: set[PeerKey]) -> tuple[Binding, RemotePeer | None]:
        """How loading ``agent_name`` for ``peer`` relates to the name's current binding: new,
        a move (the idle old holder must go: a peer restarted elsewhere), or a conflict (the
        holder has work in flight: never displaced)."""
        bound = self._identity.get(agent_name)
        if bound is None or bound == peer:
            return "new", None
        holder = self.remotes.get(bound)
        if holder is None or holder.gone or holder.agent_name != agent_name:
            return "new", None
        if holder.in_flight or bound in busy:
            return "conflict", holder
        return "move", holder

    def room_needed(self, peer: PeerKey) -> bool:
        return peer not in self.remotes and len(self.remotes) >= self.max_remotes

    def least_recently_used_idle(self, busy: set[PeerKey]) -> PeerKey | None:
        idle = [(r.last_used, k) for k, r in self.remotes.items() if not r.in_flight and k not in busy]
        return min(idle, key=lambda item: item[0])[1] if idle else None

    def idle(self, now: float, idle_for: float, busy: set[PeerKey]) -> list[PeerKey]:
        return [
            k
            for k, r in self.remotes.items()
            if not r.in_flight and now - r.last_used >= idle_for and k not in busy and k not in self.awaiting
        ]

    def add(
        self,
        peer: PeerKey,
        agent_name: str,
        info: Any,
        clock_offset: float,
        now: float,
        clock_error: float | None = None,
    ) -> RemotePeer:
        remote = RemotePeer(peer, agent_name, info, clock_offset, now, clock_error=clock_error)
        self.remotes[peer] = remote
        self._identity.pop(agent_name, None)
        self._identity[agent_name] = peer
        while len(self._identity) > self.max_identities:
            self._identity.popitem(last=False)
        return remote

    def pop(self, peer: PeerKey) -> RemotePeer | None:
        return self.remotes.pop(peer, None)

    def forget(self, remote: RemotePeer) -> bool:
        """Stop using ``remote`` (NIXL says its peer is gone); True if it was the current one."""
        if self.remotes.get(remote.peer) is remote:
            del self.remotes[remote.peer]
            return True
        return False

    def sizes(self) -> dict[str, int]:
        return {
            "remotes": len(self.remotes),
            "awaiting": sum(len(w) for w in self.awaiting.values()),
            "identities": len(self._identity),
        }
