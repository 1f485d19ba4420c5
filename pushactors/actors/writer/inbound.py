"""Inbound NIXL notifications: opened, decoded, checked and routed (writer's thread).

:class:`Inbound` takes the raw bytes the writer's poll returns and hands each to its owner:
registrations (admitted only from the agent D's own side channel advertises for the rank they
name) and heartbeats and aborts to the matcher, completions and push failures to the reaper's
ledger with the P rank the sender was verified as (a completion that alone lands its request is
also reported here at once: core/claims.py). Bad input is a counted, logged drop, never an
exception into the writer's loop.

Heartbeats are gathered over one poll (:meth:`Inbound.route_all`): every ``HB:`` one agent sent
that the poll read becomes one message to the matcher, its ids deduplicated, so a storm of
small heartbeats costs the matcher (and the reaper behind it) one message per agent and poll,
not one per notification. Agents are never merged: the matcher lets a heartbeat keep alive only
what its sender registered.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...core.blocks import LayoutError, capacity
from ...core.topology import TopologyError
from ...logs import wants
from ...protocol import (
    PUSH_REG_PREFIX,
    Abort,
    AbortArrived,
    Completion,
    Heartbeat,
    HeartbeatArrived,
    MalformedMessage,
    PeerKey,
    PushDigest,
    PushFailure,
    RecvNotified,
    Registration,
    RegistrationArrived,
    RegistrationHeader,
    decode_notification,
    decode_registration_header,
    notification_kind,
    registration_limit,
)
from ...transport.auth import AuthError
from ..base import RankContext
from .answers import Answers
from .links import Links
from .outbound import Outbound
from .poster import Poster
from .remotes import AdmitReg, Prepared, RemotePeer, d_peer
from .verify import Verdict, Verifier

MAX_BLOCKS_UNKNOWN = 1 << 16  # registration size bound before this rank's memory is known
# Registrations up to this size are decoded whole on the writer (well under a millisecond);
# larger ones are verified from their header and decoded by the matcher.
INLINE_REGISTRATION_BYTES = 64 * 1024


@dataclass(slots=True)
class _Beats:
    """One agent's heartbeats read in the current poll, gathered into one message."""

    ids: dict[str, None] = field(default_factory=dict)  # ordered, each id once
    # The earliest promise among them (on this rank's clock): D keeps every block they name at
    # least that long. None once one came without a promise: then the message makes none.
    deadline: float | None = None
    count: int = 0


class Inbound:
    """Routes one rank's inbound notifications (see the module docstring)."""

    def __init__(
        self, ctx: RankContext, log: Any, out: Outbound, links: Links, answers: Answers, poster: Poster
    ) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.log = log
        self.out = out
        self.links = links
        self.answers = answers
        self.poster = poster
        self.reg_limit = registration_limit(MAX_BLOCKS_UNKNOWN)
        self.polled_at = 0.0  # when the writer's current poll began
        self.poll_gap = 0.0  # ... and how long after the one before it
        self.read_at = 0.0  # ... and when NIXL handed it the notifications it read
        self._beats: dict[str, _Beats] = {}  # sender -> its heartbeats of this poll
        self.verifier = Verifier(ctx, log)  # D: verified pushes' digests

    def polling(self, now: float) -> None:
        """The writer begins a poll at ``now``: the notifications it reads are stamped with it."""
        self.flush()  # nothing gathered may wait for a later poll (a route that raised)
        self.poll_gap = now - self.polled_at if self.polled_at else 0.0
        self.polled_at = self.read_at = now

    def route_all(self, notifs: Mapping[Any, Iterable[Any]]) -> int:
        """Route everything one poll read (``get_new_notifs``: sender -> raw notifications);
        the heartbeats among them go on once all are routed, one message per sender. Returns
        how many notifications there were."""
        count = 0
        try:
            for sender, messages in notifs.items():
                for raw in messages:
                    count += 1
                    self.route(str(sender), raw)
        finally:
            self.flush()
        return count

    def flush(self) -> None:
        """Hand the heartbeats gathered since the last flush to the matcher: one message per
        sender, its ids in arrival order, each once."""
        if not self._beats:
            return
        beats, self._beats = self._beats, {}
        for sender, got in beats.items():
            if got.count > 1:
                self.ctx.metrics.incr("heartbeat.coalesced", got.count - 1)
            self.ctx.peers.to_matcher(HeartbeatArrived(ids=tuple(got.ids), sender=sender, deadline=got.deadline))

    def _gather(self, sender: str, ids: tuple[str, ...], promised: float | None) -> None:
        got = self._beats.get(sender)
        if got is None:
            self._beats[sender] = _Beats(dict.fromkeys(ids), promised, 1)
            return
        got.ids.update(dict.fromkeys(ids))
        got.deadline = None if got.deadline is None or promised is None else min(got.deadline, promised)
        got.count += 1

    def read(self, now: float) -> None:
        """NIXL returned this poll's notifications at ``now`` (read only when there were some)."""
        self.read_at = now

    def sized(self, capacity: int, num_groups: int) -> None:
        """This rank's memory is known: registrations larger than it could hold are refused."""
        self.reg_limit = registration_limit(capacity, num_groups)

    def drop(self, counter: str, event: str, **fields: Any) -> None:
        """A counted, logged drop: bad input never raises into the loop."""
        self.ctx.metrics.incr(counter)
        self.log.warning(event, **fields)

    def route(self, sender: str, raw: Any) -> None:
        metrics = self.ctx.metrics
        metrics.incr("notif.received")
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            self.drop("notif.malformed", "notif.dropped", sender=sender, reason=f"not bytes: {type(raw).__name__}")
            return
        raw = bytes(raw)
        if self.out.keyring is not None:
            try:
                raw = self.out.open(raw)
            except AuthError as exc:
                metrics.incr(f"notif.unauthenticated.{exc.kind}")
                self.drop("notif.unauthenticated", "notif.dropped", sender=sender, reason=str(exc)[:200])
                return
        kind = notification_kind(raw)
        try:
            if kind == "push_reg" and self.config.role == "consumer":
                # A decode engine never serves registrations: nobody may make it handshake.
                self.drop("reg.not_producer", "notif.dropped", sender=sender, reason="PUSH_REG to a consumer")
                return
            if kind == "push_reg" and len(raw) > INLINE_REGISTRATION_BYTES:
                # A large registration: only its routing fields here. Its block ids are decoded
                # by the matcher, and only for a sender verified as the D rank it names.
                header = decode_registration_header(raw, registration_bytes=self.reg_limit)
                metrics.incr("notif.kind.push_reg")
                self.admit(header, raw[len(PUSH_REG_PREFIX) :], sender)
                return
            notif = decode_notification(raw, registration_bytes=self.reg_limit)
        except MalformedMessage as exc:
            metrics.incr(f"notif.malformed.{exc.kind}")
            self.drop("notif.malformed", "notif.dropped", sender=sender, kind=exc.kind, reason=exc.reason[:200])
            return
        metrics.incr(f"notif.kind.{kind}")
        peers = self.ctx.peers
        taken = False
        if isinstance(notif, Registration):
            self.admit(notif.header(), b"", sender, notif)
        elif isinstance(notif, (Completion, PushFailure)):
            # Who sent it is known only through a handshake that bound the agent's name to a
            # P rank; the reaper counts it only if the request expects that rank.
            peer = self.links.table.identify(sender)
            # A verified push is checked once its last expected completion is in (every byte
            # landed) and every digest that follows a WRITE is: a mismatch turns that answer
            # into the request's failure; until then the last completion is held.
            verdict = (
                self.verifier.check(notif, peer, self.poster.layout, sender)
                if isinstance(notif, Completion)
                else Verdict()
            )
            if verdict.reason is not None:
                self.failed(notif.request_id, sender, peer, verdict.reason, notif.generation)
            elif verdict.held:
                pass  # landed by the digest that frees it (or failed by D's deadline)
            elif isinstance(notif, Completion):
                taken = self.landed(notif, sender, peer)
            else:
                self.failed(notif.request_id, sender, peer, notif.reason, notif.generation, final=notif.final)
            # An unknown agent's answer must not end the busy polling; a rank whose digest
            # still follows has not answered yet (its death still ends the request early).
            if peer is not None and not verdict.owed:
                if not verdict.held:
                    self.answers.heard(notif.request_id)
                if isinstance(notif, Completion) or notif.final:
                    self.answers.answered(peer, notif.request_id)
        elif isinstance(notif, PushDigest):
            peer = self.links.table.identify(sender)
            owed = peer is not None and self.verifier.owes(notif.request_id, peer)
            released = self.verifier.digest(notif, peer, self.poster.layout, sender)
            if owed and peer is not None and not self.verifier.owes(notif.request_id, peer):
                self.answers.answered(peer, notif.request_id)  # its rank has answered in full
            if released is not None:
                self.answers.heard(notif.request_id)
                if released.reason is not None:
                    self.failed(notif.request_id, released.sender, released.peer, released.reason, notif.generation)
                else:
                    taken = self.landed(released.completion, released.sender, released.peer)
        elif isinstance(notif, Heartbeat):
            remote = self.links.table.by_agent(sender)
            promised = remote.local_time(notif.deadline) if remote is not None else 0.0
            self._gather(sender, notif.ids, promised or None)  # handed on at the poll's end
        elif isinstance(notif, Abort):
            peers.to_matcher(AbortArrived(abort=notif, sender=sender))
        if wants("debug"):
            self.log.debug(
                "notif.routed",
                sender=sender,
                kind=type(notif).__name__,
                request_id=getattr(notif, "request_id", None),
                taken=taken or None,  # the request was reported here (core/claims.py)
                # The writer's poll that read it: when it began, and how long after the poll
                # before it (a long gap: this notification may have waited that long unread).
                poll_gap_ms=round(self.poll_gap * 1e3, 3) if self.poll_gap else None,  # None: its first poll
                read_ms=round((time.monotonic() - self.polled_at) * 1e3, 3),
                # ... of which settling WRITEs and NIXL's read of its notifications took this
                nixl_ms=round((self.read_at - self.polled_at) * 1e3, 3),
            )

    def landed(self, notif: Completion, sender: str, peer: PeerKey | None) -> bool:
        """A completion lands its request (as far as this rank goes); True if it was taken here."""
        rid = notif.request_id
        # The first decode token waits on this: a completion that lands its request on its own
        # is reported here, first, not a thread hop later (core/claims.py).
        taken = self.ctx.claims.try_take(rid, peer=peer, generation=notif.generation)
        if taken:
            self.ctx.received(rid, polled=self.polled_at, read=self.read_at)
            self.ctx.metrics.incr("recv.taken")
        self.ctx.peers.to_reaper(
            RecvNotified(request_id=rid, ok=True, sender=sender, peer=peer, generation=notif.generation, taken=taken)
        )
        return taken

    def failed(
        self, request_id: str, sender: str, peer: PeerKey | None, reason: str, generation: int, *, final: bool = True
    ) -> None:
        """A rank's answer is a failure: a push failure (``final`` False: it may still land), or
        a verified request whose check failed."""
        self.ctx.peers.to_reaper(
            RecvNotified(
                request_id=request_id,
                ok=False,
                sender=sender,
                reason=reason,
                peer=peer,
                final=final,
                generation=generation,
            ),
        )

    def admit(
        self, reg: RegistrationHeader, payload: bytes, sender: str, registration: Registration | None = None
    ) -> None:
        """Accept a registration only from the agent that D's own side channel advertises for
        the rank it names: verified against P's handshake with that address (done now, before
        the match, so the WRITE can be posted the moment P's blocks are ready). An address
        outside ``trusted_peers`` is never contacted on a registration's word."""
        if not self.config.trusts(reg.decode_engine_id, reg.decode_host):
            self.drop(
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
        remote = self.links.get(peer)
        if remote is None:
            if self.links.draining:
                self.ctx.metrics.incr("reg.dropped_shutdown")
                return
            self.links.park(peer, full=True, work=AdmitReg(reg, payload, sender, registration))
            return
        if remote.agent_name != sender:
            self.drop(
                "reg.rejected_sender",
                "reg.rejected",
                request_id=reg.request_id,
                reason="sender is not the agent D's side channel advertises for that rank",
                sender=sender,
                expected=remote.agent_name,
            )
            return
        prepared = self._warm(remote, reg)
        self.ctx.peers.to_matcher(
            RegistrationArrived(
                registration=registration,
                sender=sender,
                header=reg,
                payload=payload,
                capacity=capacity(remote.info.regions, remote.info.physical_blocks_per_logical),
                pairing=None if prepared is None else prepared.paired,
                pairing_id=0 if prepared is None else prepared.pairing_id,
                clock=None if remote.clock_error is None else (remote.clock_offset, remote.clock_error),
            ),
        )

    def _warm(self, remote: RemotePeer, reg: RegistrationHeader) -> Prepared | None:
        # Prepare the descriptor lists for this D rank ahead of the WRITE, and hand the pairing
        # (its layout and id, not its lists) to the matcher, which plans on it. A layout that
        # cannot pair is not an error here: the WRITE will be refused with a push failure to D.
        try:
            return self.poster.prepared(remote, reg.decode_tp_rank, reg.decode_tp_size)
        except (LayoutError, TopologyError) as exc:
            self.log.info("layout.unpairable", agent=remote.agent_name, reason=str(exc))
        except Exception as exc:
            self.log.warning("dlist.prep_failed", agent=remote.agent_name, error=repr(exc))
        return None
