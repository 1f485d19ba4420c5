"""Verified pushes on the writer's thread (docs/protocol.md, "Verified push").

P: :class:`PushDigests` digests the pieces of a push's WRITE plans (its own source bytes, weighed by the
D address each lands at), per chunk of D's regions. The digest follows a push's (last) WRITE in a
:class:`~pushactors.protocol.PushDigest`, computed while that WRITE flies (its completion says
``:vf``); a layer-wise push adds its earlier groups' digests, made as each was posted.

D: :class:`Verifier` keeps the registrations that asked for a digest and adds up the digests
of their expected P ranks, carried by a completion or following it. Once every completion is in
(every byte landed) and every digest is, it digests the request's blocks and compares; until
then the last completion (and any second copy of one) is held. What it finds is returned: a
:class:`Verdict` for a completion, a :class:`Released` held completion for the digest that frees
it, each landing the request or naming why it fails.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from ...core.blocks import KVLayout, PairedLayout, RemoteLayout, WritePlan
from ...core.topology import registration_sources
from ...protocol import Completion, PeerKey, PushDigest, Registration
from ...transport.digest import (
    I64,
    U64,
    Digest,
    DigestError,
    KVDigest,
    PreparedSums,
    block_pieces,
    chunk_count,
    locate_regions,
    region_chunks,
    region_offsets,
)
from ..base import RankContext

MAX_VERIFYING = 1 << 16  # registrations awaiting their digests (oldest forgotten past it)
# Bytes of D's blocks made ready ahead for the registrations awaited (their pass's table, on
# the device for the fused pass: 40 bytes a block and region): past it, a request's blocks are
# located at its check instead, as they always can be.
LOCATED_BYTES = 64 << 20


# (source address, D region, offset there, length, chunk) of each piece of one WRITE plan
Pieces = tuple[U64, I64, U64, U64, I64]


@dataclass(frozen=True, eq=False)
class PendingDigest:
    """The pieces a verified WRITE carries, located and checked before it is posted, digested
    after (while it flies): per plan, (source, D region, offset there, length, chunk)."""

    request_id: str  # D's
    generation: int
    parts: tuple[Pieces, ...]
    chunks: int
    # The pass over every part, made ready ahead (:meth:`PushDigests.ready`); None: made at
    # compute time.
    prepared: PreparedSums | None = None


class PushDigests:
    """P: digests of what this rank's WRITEs carry, for registrations that ask (``verify``)."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        # Each pairing's (local, remote) descriptor rows, built once per pairing (it lives as
        # long as its remote stays loaded).
        self._rows: weakref.WeakKeyDictionary[PairedLayout, tuple[Any, Any]] = weakref.WeakKeyDictionary()

    def of(
        self, reg: Registration, plans: list[WritePlan], paired: PairedLayout, remote: RemoteLayout | None
    ) -> Digest:
        """The digest of the bytes ``plans`` write into D's rank, per chunk of its regions; ()
        when the registration asked for none or this rank has no tensors to read. Raises
        DigestError for pieces outside this rank's tensors or D's regions."""
        pending = self.prepare(reg, plans, paired, remote)
        return self.compute(pending) if pending is not None else ()

    def prepare(
        self, reg: Registration, plans: list[WritePlan], paired: PairedLayout, remote: RemoteLayout | None
    ) -> PendingDigest | None:
        """Where the bytes of ``plans`` land in D's regions (checked now: DigestError for a
        piece outside them), to digest later; None when no digest is asked for or this rank
        has no tensors to read."""
        if not reg.verify or remote is None:
            return None
        if self.ctx.kv_digest is None:
            self.ctx.metrics.incr("write.digest_unavailable")
            return None
        chunks = chunk_count(len(remote.regions))
        parts = tuple(self._locate(plan, paired, remote) for plan in plans if plan.num_descs)
        return PendingDigest(reg.request_id, reg.generation, parts, chunks)

    def ready(self, pending: PendingDigest) -> PendingDigest:
        """``pending`` with its pass made ready (the pieces cut, the fused pass's table on the
        device): for a push that opens ahead of its post, so computing it is one launch.
        DigestError for a piece outside this rank's tensors."""
        kv = self.ctx.kv_digest
        assert kv is not None  # prepare() checked
        parts = [p for p in pending.parts if len(p[0])]
        if not parts:
            return pending
        joined = parts[0] if len(parts) == 1 else join_pieces(parts)
        return replace(pending, prepared=kv.prepare(*joined, pending.chunks))

    def compute(self, pending: PendingDigest) -> Digest:
        """The digest of ``pending``'s pieces, every plan's in one pass (waits for the device)."""
        kv = self.ctx.kv_digest
        assert kv is not None  # prepare() checked
        self.ctx.metrics.incr("write.digested")
        zeros = tuple((0, 0) for _ in range(pending.chunks))
        prepared = pending.prepared
        if prepared is None:
            ready = self.ready(pending)
            if ready.prepared is None:
                return zeros  # nothing to read
            prepared = ready.prepared
        return add_digests([zeros, kv.run(prepared)])

    def _locate(self, plan: WritePlan, paired: PairedLayout, remote: RemoteLayout) -> Pieces:
        rows = self._rows.get(paired)
        if rows is None:
            rows = self._rows[paired] = (paired.local_descriptors(), paired.remote_descriptors())
        local, there = rows
        src = local[plan.local_idx, 0]
        dst = there[plan.remote_idx, 0]
        lengths = local[plan.local_idx, 1]
        owner = locate_regions(remote.regions, dst)
        if np.any(owner < 0):
            raise DigestError("a piece lands outside D's regions")
        offset = region_offsets(remote.regions, dst, owner)
        return src, owner, offset, lengths, region_chunks(len(remote.regions))[owner]


def d_pieces(reg: Registration, layout: KVLayout) -> Pieces:
    """D's side: every block the registration names, in every region of its group, as pieces
    (address, region, offset there, length, chunk) of the digest D checks."""
    regions = layout.regions
    addrs, lengths, owner = block_pieces(regions, reg.block_groups, layout.physical_blocks_per_logical)
    return addrs, owner, region_offsets(regions, addrs, owner), lengths, region_chunks(len(regions))[owner]


def join_pieces(parts: list[Pieces]) -> Pieces:
    """Several plans' pieces as one set (digested in one pass: the sums are additive)."""
    src, region, offset, lengths, chunk = (np.concatenate([p[i] for p in parts]) for i in range(5))
    return src, region, offset, lengths, chunk


def add_digests(parts: list[Digest]) -> Digest:
    """Per chunk, the sums of several digests of the same chunking (mod 2^64)."""
    if not parts:
        return ()
    return tuple(
        (sum(p[c][0] for p in parts) & ((1 << 64) - 1), sum(p[c][1] for p in parts)) for c in range(len(parts[0]))
    )


@dataclass
class _Awaited:
    registration: Registration
    expected: frozenset[PeerKey]  # the P ranks that answer it
    parts: list[Digest] = field(default_factory=list)
    seen: set[PeerKey] = field(default_factory=set)  # ranks whose completion came
    missing: int = 0  # answers without a digest (a P that predates it, or could not digest)
    owed: set[PeerKey] = field(default_factory=set)  # completions whose digest still follows
    early: dict[PeerKey, Digest] = field(default_factory=dict)  # digests ahead of their completion
    held: tuple[Completion, str, PeerKey] | None = None  # the last completion, waiting for digests
    # Where D's blocks of the request lie (address, region, offset, length, chunk), located
    # when the registration went out, off the critical path; with the layout they were read on.
    pieces: tuple[KVLayout, PreparedSums] | None = None
    # D's own digest of the blocks, made once every byte landed while P's digest was still on
    # its way (the two passes overlap); with the layout it was read on.
    ours: tuple[KVLayout, Digest] | None = None

    def add(self, digest: Digest) -> None:
        if digest:
            self.parts.append(digest)
        else:
            self.missing += 1


class Verdict(NamedTuple):
    """What a completion of a verified request comes to."""

    reason: str | None = None  # the request fails for it
    held: bool = False  # the last completion, held until the digests that follow it arrive
    owed: bool = False  # this completion's own digest follows: its rank still owes it


@dataclass(frozen=True)
class Released:
    """A held completion, checked now that the last digest came: land it (``reason`` None)
    or fail its request."""

    completion: Completion
    sender: str
    peer: PeerKey
    reason: str | None


class Verifier:
    """D: the digests of verified registrations, checked once every P rank answered."""

    def __init__(self, ctx: RankContext, log: Any) -> None:
        self.ctx = ctx
        self.log = log
        self._awaited: OrderedDict[str, _Awaited] = OrderedDict()  # D id -> its live registration
        self.located_bytes = 0  # of the pieces located ahead, held by the awaited

    def expect(self, reg: Registration, layout: KVLayout | None = None) -> None:
        """A registration that asks for a digest is being sent (a re-stage replaces the last);
        with ``layout``, the blocks it names are located now, not once its bytes landed."""
        if not reg.verify:
            return
        self._drop(reg.request_id)
        sources = registration_sources(reg.decode_tp_rank, reg.decode_tp_size, reg.remote_tp_size, reg.remote_pp_size)
        expected = frozenset(
            PeerKey(reg.remote_engine_id, reg.remote_host, reg.remote_port, pp, tp) for pp, tp in sources
        )
        awaited = _Awaited(reg, expected)
        kv = self.ctx.kv_digest
        if layout is not None and kv is not None and self.located_bytes < LOCATED_BYTES:
            try:
                prepared = kv.prepare(*d_pieces(reg, layout), chunk_count(len(layout.regions)))
            except DigestError:
                prepared = None  # blocks outside D's tensors: the check says so, in its place
            if prepared is not None and self.located_bytes + prepared.size <= LOCATED_BYTES:
                awaited.pieces = (layout, prepared)
                self.located_bytes += prepared.size
        self._awaited[reg.request_id] = awaited
        while len(self._awaited) > MAX_VERIFYING:
            self._drop(next(iter(self._awaited)))
            self.ctx.metrics.incr("recv.verify_forgotten")

    def forget(self, request_id: str, generation: int | None = None) -> None:
        """D gave up on the request (its abort of that generation): no check is owed. (A push
        failure forgets nothing: one from a rank the request does not expect must not turn
        the real completions' check off; the entry goes with a re-stage or the bound.)"""
        awaited = self._awaited.get(request_id)
        if awaited is not None and generation in (None, awaited.registration.generation):
            self._drop(request_id)

    def sizes(self) -> dict[str, int]:
        return {"verify_awaited": len(self._awaited), "verify_located_bytes": self.located_bytes}

    def _drop(self, request_id: str) -> None:
        """Forget the request's registration, and the blocks located for it."""
        awaited = self._awaited.pop(request_id, None)
        if awaited is not None:
            self._release(awaited)

    def _release(self, awaited: _Awaited) -> None:
        if awaited.pieces is not None:
            self.located_bytes -= awaited.pieces[1].size
            awaited.pieces = None

    def check(self, msg: Completion, peer: PeerKey | None, layout: KVLayout | None, sender: str = "") -> Verdict:
        """A completion arrived from ``peer`` (verified sender): whether its request fails,
        or waits for digests that follow; an empty verdict lets it through (not verified,
        waiting for more answers, or matched)."""
        awaited = self._awaited.get(msg.request_id)
        if awaited is None or peer is None or msg.generation != awaited.registration.generation:
            return Verdict()  # not verified here, an unknown sender or a stale one: the reaper judges
        if peer not in awaited.expected:
            return Verdict()  # a rank it does not expect: the reaper judges it
        if peer in awaited.seen:
            # A second copy while the request is still being checked: it must not land what
            # the first one holds (or let the reaper count a rank whose digest is owed).
            self.ctx.metrics.incr("recv.verify_duplicate")
            return Verdict(held=True, owed=peer in awaited.owed)
        awaited.seen.add(peer)
        owed = False
        if msg.digest_follows:
            if peer in awaited.early:
                awaited.add(awaited.early.pop(peer))
            else:
                awaited.owed.add(peer)
                owed = True
        else:
            awaited.add(msg.digest)
        if len(awaited.seen) < len(awaited.expected):
            return Verdict(owed=owed)
        if awaited.owed:
            # Every byte landed, but not every digest of it is here: land nothing yet. D's own
            # pass needs only the landed bytes: made now, while P still digests.
            awaited.held = (msg, sender, peer)
            kv = self.ctx.kv_digest
            if layout is not None and kv is not None and not awaited.missing:
                self._mark(awaited, "d.verify_start")
                awaited.ours = (layout, self._sums(awaited, layout, kv))
            return Verdict(held=True, owed=owed)
        self._awaited.pop(msg.request_id)
        try:
            return Verdict(reason=self._verify(awaited, layout))
        finally:
            self._release(awaited)

    def owes(self, request_id: str, peer: PeerKey) -> bool:
        """Whether ``peer``'s completion of the request came and its digest has not."""
        awaited = self._awaited.get(request_id)
        return awaited is not None and peer in awaited.owed

    def digest(
        self, msg: PushDigest, peer: PeerKey | None, layout: KVLayout | None, sender: str = ""
    ) -> Released | None:
        """A digest that follows a WRITE arrived from ``peer``: the held completion it frees,
        checked, or None (more to wait for, or dropped: counted and said)."""
        awaited = self._awaited.get(msg.request_id)
        why = None
        if awaited is None or msg.generation != awaited.registration.generation:
            why = "no verified registration of that generation awaits it"
        elif peer is None or peer not in awaited.expected:
            why = "from a rank the request does not expect"
        elif (msg.pp_rank, msg.tp_rank) != (peer.pp_rank, peer.tp_rank):
            why = "it names another rank than the one that sent it"
        elif (peer in awaited.seen and peer not in awaited.owed) or peer in awaited.early:
            why = "a duplicate"
        if why is not None or awaited is None or peer is None:
            self.ctx.metrics.incr("recv.digest_dropped")
            self.log.info(
                "recv.digest_dropped", request_id=msg.request_id, generation=msg.generation, sender=sender, reason=why
            )
            return None
        if peer not in awaited.seen:
            awaited.early[peer] = msg.digest  # its completion is still on the way
            return None
        awaited.owed.discard(peer)
        awaited.add(msg.digest)
        if awaited.owed or awaited.held is None:
            return None
        self._awaited.pop(msg.request_id)
        completion, sender, held_by = awaited.held
        try:
            return Released(completion, sender, held_by, self._verify(awaited, layout))
        finally:
            self._release(awaited)

    def _mark(self, awaited: _Awaited, step: str) -> None:
        timeline = self.ctx.timeline
        if timeline is not None:
            timeline.mark(awaited.registration.request_id, step, time.monotonic())

    def _sums(self, awaited: _Awaited, layout: KVLayout, kv: KVDigest) -> Digest:
        """D's digest of the request's blocks, per chunk of its regions (waits for the device)."""
        located = awaited.pieces
        if located is not None and located[0] is layout:
            return kv.run(located[1])
        return kv.sums(*d_pieces(awaited.registration, layout), chunk_count(len(layout.regions)))

    def _verify(self, awaited: _Awaited, layout: KVLayout | None) -> str | None:
        self._mark(awaited, "d.verify_start")  # the first stamp wins: an early pass keeps its own
        try:
            return self._compare(awaited, layout)
        finally:
            self._mark(awaited, "d.verified")

    def _compare(self, awaited: _Awaited, layout: KVLayout | None) -> str | None:
        metrics = self.ctx.metrics
        reg = awaited.registration
        kv = self.ctx.kv_digest
        if awaited.missing or layout is None or kv is None:
            # A P that sends no digest cannot be checked: landed as it is, and said.
            metrics.incr("recv.verify_unavailable")
            self.log.info("recv.verify_unavailable", request_id=reg.request_id, without_digest=awaited.missing)
            return None
        regions = layout.regions
        chunks = chunk_count(len(regions))
        theirs = add_digests(awaited.parts)
        if any(len(p) != chunks for p in awaited.parts):
            metrics.incr("recv.verify_unavailable")
            self.log.warning("recv.verify_unavailable", request_id=reg.request_id, reason="digest of other chunks")
            return None
        early = awaited.ours
        ours = early[1] if early is not None and early[0] is layout else self._sums(awaited, layout, kv)
        of_region = region_chunks(len(regions))
        uncovered = [c for c in range(chunks) if ours[c][1] != theirs[c][1]]
        if uncovered:
            # P's pieces do not cover exactly the bytes D reads (token offsets that differ
            # between block sizes, padding in D's blocks): nothing to compare against.
            metrics.incr("recv.verify_uncovered")
            self.log.warning(
                "recv.verify_uncovered",
                request_id=reg.request_id,
                ours=[ours[c][1] for c in uncovered],
                theirs=[theirs[c][1] for c in uncovered],
            )
            return None
        wrong = [c for c in range(chunks) if ours[c][0] != theirs[c][0]]
        if not wrong:
            metrics.incr("recv.verified")
            return None
        where = "; ".join(_where(regions, np.flatnonzero(of_region == c)) for c in wrong)
        metrics.incr("recv.verify_failed")
        self.log.warning(
            "recv.verify_failed", request_id=reg.request_id, generation=reg.generation, chunks=wrong, where=where
        )
        return f"KV digest mismatch after landing: {where}"


def _where(regions: Any, indices: Any) -> str:
    """The group(s) and layer range of some of D's regions, for a reason a person reads."""
    picked = [regions[int(i)] for i in indices]
    groups = sorted({r.group for r in picked})
    names = [m for r in picked for m in r.members]
    layers = f"layers {names[0]}..{names[-1]}" if names else f"regions {int(indices[0])}..{int(indices[-1])}"
    return f"group {','.join(map(str, groups))} {layers}"
