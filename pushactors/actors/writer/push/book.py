"""P's pushes in progress, as plain state (no NIXL, no threads).

One :class:`PushState` per P request, one :class:`Target` per D rank it writes (each target
knows its push and its D rank). A target's status moves only through :class:`Target`'s methods
(waiting → in flight → done | failed), the targets whose WRITE is in flight change only through
:class:`PushBook`'s, and whether a request is over, and how, is decided in one place
(:meth:`PushBook.outcome`). The writer makes the NIXL calls and asks this book what follows
from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ....core.registry import Tombstones
from ....protocol import PeerKey, PostPush, Registration
from ..remotes import RemotePeer, d_peer
from ..writes import Write

TargetStatus = Literal["waiting", "in_flight", "done", "failed"]
# Why a WRITE is refused (and its push fails) when D's deadline passed before it could go.
PAST_DEADLINE = "D's deadline for the registration passed before the WRITE"


@dataclass(eq=False)
class Target:
    """One D rank of one push."""

    registration: Registration
    push: PushState
    d_rank: int
    status: TargetStatus = "waiting"
    handle: Write | None = None  # its WRITE while in flight
    remote: RemotePeer | None = None
    posted_at: float = 0.0
    nbytes: int = 0
    reason: str = ""
    fresh_at: float = 0.0  # when D last showed it waits for this registration
    deadline: float = float("inf")  # D's deadline for it on this rank's clock: never posted after
    sender: str = ""  # the agent that registered it (verified when it arrived)
    # Why P judged it stuck (in flight write_timeout past its first WRITE): no further part of
    # it is posted and D was told it may still land, but it stays in flight, polled until NIXL
    # says it ended (a release would not stop a copy already started), or pinned_write_limit.
    stuck: str = ""
    release_attempts: int = 0  # releases NIXL refused at pinned_write_limit (retried each pass)
    # D was told its WRITE "may still land" (a non-final push failure): it holds the blocks
    # until a final answer, so P must be able to repeat that answer when D asks again after
    # the request ended here (Forget.pinned: the matcher remembers such slots by time).
    pinned: bool = False
    # Since the latest post (of a layer, for a layer-wise push): how often P asked NIXL about
    # it, and the longest it went unasked (UCX moves it only while P progresses: a long gap is
    # time the WRITE stood still). ``posted_at`` is the push's first WRITE, whatever came after.
    checks: int = 0
    checked_at: float = 0.0
    check_gap: float = 0.0
    # A WRITE's own resources, released when it settles: (local dlist, remote dlist, offset
    # of P's staging slot or None), for a staged WRITE or one posted as runs.
    staged: Any = None

    def posted(self, handle: Write, remote: RemotePeer, nbytes: int, now: float) -> None:
        self.handle, self.remote, self.nbytes = handle, remote, nbytes
        self.reposted(now, first=True)
        self.status = "in_flight"
        remote.in_flight += 1
        remote.last_used = now

    def reposted(self, now: float, *, first: bool = False) -> None:
        """A (further) WRITE of it was posted at ``now``: its progress checks count from here.
        Only the push's ``first`` WRITE sets ``posted_at``: the stuck timer and the pin limit
        run from it, so a push that keeps posting layers is not thereby any less stuck."""
        if first:
            self.posted_at = now
        self.checked_at = now
        self.checks, self.check_gap = 0, 0.0

    def checked(self, now: float) -> None:
        """P asked NIXL about it at ``now``."""
        self.check_gap = max(self.check_gap, now - self.checked_at)
        self.checked_at = now
        self.checks += 1

    def end(self, *, ok: bool, reason: str = "") -> RemotePeer | None:
        """Settle or fail it; returns the remote whose in-flight count dropped (if any)."""
        released = None
        if self.remote is not None and self.status == "in_flight":
            self.remote.in_flight -= 1
            released = self.remote
        self.status = "done" if ok else "failed"
        if not ok:
            self.reason = reason
        return released


@dataclass
class PushState:
    """P: one request's push to its D ranks."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    expected: int
    started: float
    serial: int = 0
    targets: dict[int, Target] = field(default_factory=dict)
    expired: str = ""  # why no further WRITE may be posted (lease expired, shutdown)
    failed: bool = False  # ended by a failure (not a plain expiry)

    @property
    def in_flight(self) -> int:
        return sum(1 for t in self.targets.values() if t.status == "in_flight")

    @property
    def pinned_ranks(self) -> tuple[int, ...]:
        """The D ranks told a WRITE of this push "may still land" (owed a final answer)."""
        return tuple(sorted(d_rank for d_rank, t in self.targets.items() if t.pinned))

    @property
    def settled(self) -> int:
        return sum(1 for t in self.targets.values() if t.status in ("done", "failed"))


class PushBook:
    """Every push of one P rank, the WRITEs in flight, and the P ids it is done with."""

    def __init__(self, *, tombstone_ttl: float) -> None:
        self.pushes: dict[str, PushState] = {}
        self._in_flight: list[Target] = []
        # P ids this rank is done with -> (outcome, serial): no WRITE for that incarnation again.
        # Kept until the matcher and the reaper have both released it (after which neither can
        # still send anything about it), or ``tombstone_ttl`` as a backstop.
        self.tombstones: Tombstones[str, tuple[str, int]] = Tombstones(tombstone_ttl)
        self._unreleased: dict[str, tuple[int, set[str]]] = {}  # P id -> (serial, who has not)

    def ended(self, request_id: str, serial: int) -> str | None:
        """The outcome of ``request_id`` if this incarnation (or a later one) already ended."""
        tomb = self.tombstones.get(request_id)
        return tomb[0] if tomb is not None and serial <= tomb[1] else None

    def open(self, msg: PostPush, now: float) -> tuple[PushState | None, Target | None, str]:
        """Add ``msg``'s D rank to its push: (state, target, "") or (.., .., why it is refused)."""
        outcome = self.ended(msg.request_id, msg.serial)
        if outcome is not None:
            return None, None, f"request already {outcome} on P"
        state = self.pushes.get(msg.request_id)
        if state is not None and state.serial != msg.serial:
            # Another incarnation of this id is still settling: never mix the two.
            return None, None, "request id is busy with an earlier incarnation on P"
        if state is None:
            state = PushState(msg.request_id, msg.block_ids, msg.expected_targets, now, msg.serial)
            self.pushes[msg.request_id] = state
        d_rank = msg.registration.decode_tp_rank
        if d_rank in state.targets:
            return state, None, "D rank already served for this request"
        target = Target(
            msg.registration, state, d_rank, fresh_at=msg.fresh_at or now, sender=msg.sender, deadline=msg.deadline
        )
        state.targets[d_rank] = target
        return state, target, ""

    @staticmethod
    def outcome(state: PushState) -> tuple[str, str] | None:
        """(outcome, reason) once nothing of ``state`` is in flight or can still be posted;
        None while it is not over. Outcomes: pushed, expired, failed."""
        if state.in_flight:
            return None
        waiting = any(t.status == "waiting" for t in state.targets.values())
        if not state.expired and (state.settled < state.expected or waiting):
            return None
        if state.settled >= state.expected and all(t.status == "done" for t in state.targets.values()):
            return "pushed", ""
        if state.expired and not state.failed and not any(t.status == "failed" for t in state.targets.values()):
            return "expired", state.expired
        reason = next((t.reason for t in state.targets.values() if t.status == "failed"), state.expired)
        return "failed", reason

    def close(self, request_id: str, outcome: str, serial: int, now: float) -> None:
        self.pushes.pop(request_id, None)
        self.tombstones.put(request_id, (outcome, serial), now)
        if serial:
            self._unreleased[request_id] = (serial, {"matcher", "reaper"})

    def prune(self, now: float) -> None:
        if self.tombstones.prune(now) and self._unreleased:
            for rid in [r for r in self._unreleased if r not in self.tombstones]:
                del self._unreleased[rid]

    def released(self, request_id: str, serial: int, by: str) -> bool:
        """``by`` dropped ``request_id``'s incarnation ``serial``; True once both did and its
        tombstone is gone."""
        waiting = self._unreleased.get(request_id)
        if waiting is None or waiting[0] != serial:
            return False  # another incarnation's, or an ending this rank did not close
        waiting[1].discard(by)
        if waiting[1]:
            return False
        del self._unreleased[request_id]
        tomb = self.tombstones.get(request_id)
        if tomb is not None and tomb[1] == serial:
            self.tombstones.pop(request_id)
        return True

    # --- the targets whose WRITE is in flight -------------------------------------------------
    @property
    def in_flight(self) -> Sequence[Target]:
        """The targets whose WRITE is in flight, polled until it ends (in posting order)."""
        return self._in_flight

    def track(self, target: Target) -> None:
        """``target``'s WRITE is in flight: poll it until it ends."""
        self._in_flight.append(target)

    def keep_polling(self, still: list[Target]) -> None:
        """A check of every WRITE in flight is over: only ``still`` are running."""
        self._in_flight = still

    def stop_tracking(self, target: Target) -> None:
        self._in_flight = [t for t in self._in_flight if t is not target]

    def take_in_flight(self) -> list[Target]:
        """Every target in flight, no longer tracked (the writer stops)."""
        taken, self._in_flight = self._in_flight, []
        return taken

    def busy_peers(self) -> set[PeerKey]:
        """D ranks a push still waits on or writes to (never evicted)."""
        return {
            d_peer(t.registration)
            for state in self.pushes.values()
            for t in state.targets.values()
            if t.status in ("waiting", "in_flight")
        }

    def sizes(self) -> dict[str, int]:
        return {
            "pushes": len(self.pushes),
            "in_flight": len(self._in_flight),
            "tombstones": len(self.tombstones),
            "unreleased": len(self._unreleased),
        }
