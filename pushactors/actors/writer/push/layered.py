"""Layer-wise pushes of one P rank, on the writer's thread (``push_mode = "layerwise"``).

The worker announces a request whose prefill ends in the step about to run, then marks how many
of its layer groups the forward has computed (:class:`~pushactors.protocol.LayersReady`). Once
the matcher pairs it with D's registration, each computed group's WRITE is posted at once and
each later one as its layers are marked, all into D's registered blocks: the push is one
:class:`~pushactors.actors.writer.writes.ChunkedWrite` of one chunk per group, settled, stopped
and failed like any other. The last group's WRITE carries the completion when every earlier one has
landed (else the completion is sent once all have). A staged registration waits for every layer
and then goes the staged way: its image is gathered from the whole request.

Safety: no group is posted before the worker marked it computed (and, on a GPU, before the CUDA
event recorded after its kernels completed); a request never announced is a whole push. Each
group's WRITE is checked against D's deadline for the registration just before it is posted, as
the push's first one is: the forward may run on past it (D's abort lost, its heartbeats gone),
and D may then have given the blocks to another request. A push stopped that way (or by D's
abort, P's lease, or being stuck since its first WRITE) posts nothing more and fails.

What opening a push came to is returned (:mod:`.outcome`), and what posting its groups left to
do (:class:`Advanced`): the pusher carries both out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ....core.blocks import LayoutError, PlanError, WritePlan
from ....core.layerwise import LayerGroups, LayerReadiness
from ....core.topology import TopologyError
from ....logs import wants
from ....protocol import LayersReady
from ....transport.digest import DigestError
from ...base import Note
from ..remotes import RemotePeer
from ..verify import PendingDigest
from ..writes import ChunkedWrite
from .book import PAST_DEADLINE, Target
from .outcome import Complete, Outcome, Pending, Posted, Refused
from .posting import Posting


@dataclass(eq=False)
class LayeredPush:
    """One target's layer-wise push: its plans per layer group and how far it is posted."""

    target: Target
    remote: RemotePeer
    xfer: ChunkedWrite | None  # None: a staged registration, posted whole once every layer is in
    plans: list[WritePlan] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)  # layer groups with pieces, in order
    prepared: Any = None
    next: int = 0  # index into ``groups`` of the next WRITE to post
    # The last WRITE's lists (posted as runs) and the WRITE itself, made when the push opened:
    # only that post is on the critical path, after the forward's last layer (both released
    # with the push; the WRITE is also in ``xfer.spare`` until posted).
    last_lists: Any = None
    last_made: Any = None
    # A verified push: where every layer group's bytes land in D's regions, located when the
    # push opens (off the critical path), digested in one pass once the last WRITE is posted
    # (every layer is computed by then, and P's blocks stay unchanged until the push ends): the
    # digest follows that WRITE. None: not verified, or this rank cannot digest.
    digest: PendingDigest | None = None


@dataclass
class Advanced:
    """What posting computed layer groups left to the pusher."""

    posted: int = 0  # layer groups' WRITEs posted
    # Staged registrations whose every layer is in: their image goes now, if still due
    due: list[LayeredPush] = field(default_factory=list)
    gone: list[RemotePeer] = field(default_factory=list)  # peers NIXL said are gone
    # Targets whose last WRITE went (a poll's, for it to check at once: :meth:`LayerWrites.await_end`)
    last: list[Target] = field(default_factory=list)
    # Verified pushes whose last WRITE went: their digest, to compute and send after it (with
    # P's request id, for the timeline)
    digests: list[tuple[RemotePeer, PendingDigest, str]] = field(default_factory=list)


class LayerWrites:
    """Posts pushes layer group by layer group (see the module docstring)."""

    def __init__(self, posting: Posting) -> None:
        self.posting = posting
        self.readiness = LayerReadiness()
        self.totals: dict[tuple[str, int], int] = {}  # announced requests -> their layer groups
        self.open: dict[tuple[str, int], list[LayeredPush]] = {}
        self._groups: LayerGroups | None = None
        # Engines in wait_for_save: (the pushes they wait for, the event to set, until when)
        self._savers: list[tuple[list[ChunkedWrite], Any, float]] = []
        # Targets whose last WRITE this message or poll posted: a handler spins on them before
        # it returns (:meth:`pop_last`), a poll checks them (:meth:`await_end`)
        self._last_posted: list[Target] = []
        # Pushes closed since the last check of WRITEs in flight, freed after it (checks_over):
        # freeing a push's plans (an H100 host, 4k tokens, 32 layer groups: 50-80 µs of the
        # writer's CPU) must not stand between the last post and the check its completion
        # leaves from.
        self._retired: list[LayeredPush] = []

    def groups(self) -> LayerGroups:
        layout = self.posting.poster.layout
        if layout is None:
            raise LayoutError("KV memory is not registered on this rank")
        if self._groups is None:
            self._groups = LayerGroups.of(layout, self.posting.config.layers_per_group)
        return self._groups

    # --- the worker's marks ------------------------------------------------------------------
    def announced(self, request_id: str, serial: int) -> bool:
        return (request_id, serial) in self.totals

    def mark(self, msg: LayersReady) -> Advanced:
        """The worker marked layer groups of ``msg``'s requests computed: post each open
        push's groups that became ready (the pusher carries out what is left)."""
        advanced = Advanced()
        for rid, serial in msg.requests:
            key = (rid, serial)
            if msg.total:
                self.totals[key] = msg.total
            elif key not in self.totals:
                continue  # its push ended already: nothing waits for these layers
            self.readiness.mark(rid, serial, msg.ready, msg.event)
            for entry in list(self.open.get(key, ())):
                self.advance(entry, advanced)
        return advanced

    def hold(self, msg: LayersReady) -> bool:
        """An engine in wait_for_save (``msg.saved``) waits until the pushes of ``msg``'s
        requests still in flight have landed and their completions are sent (vLLM: "block
        until all saves are done"); True if any is (the event is then set when they end)."""
        pushes = self._running(msg.requests) if msg.saved is not None else []
        if not pushes:
            return False
        until = time.monotonic() + self.posting.config.layerwise_save_wait
        self._savers.append((pushes, msg.saved, until))
        return True

    @staticmethod
    def said(msg: LayersReady, posted: int, note: Note) -> None:
        """``msg``'s one event."""
        ids = [rid for rid, _ in msg.requests]
        who: dict[str, Any] = {"request_id": ids[0]} if len(ids) == 1 else {"request_ids": ids}
        # handover: the engine's wait_for_save, waiting on these pushes (layerwise_save_wait)
        handover = True if msg.saved is not None else None
        note("layers.ready", ready=msg.ready, total=msg.total or None, posted=posted, handover=handover, **who)

    def _running(self, requests: tuple[tuple[str, int], ...]) -> list[ChunkedWrite]:
        """The layer-wise pushes of ``requests`` still in flight (posted in full or not)."""
        keys = set(requests)
        return [
            t.handle
            for t in self.posting.book.in_flight
            if (t.push.request_id, t.push.serial) in keys
            and isinstance(t.handle, ChunkedWrite)
            and not _ended(t.handle)
        ]

    def wake_savers(self) -> None:
        """Let an engine waiting in wait_for_save go on once every push it waits for has
        ended on P's side (landed and notified, failed or released), or its wait is over."""
        if not self._savers:
            return
        now = time.monotonic()
        waiting = []
        for pushes, event, until in self._savers:
            if now >= until or all(_ended(x) for x in pushes):
                event.set()
            else:
                waiting.append((pushes, event, until))
        self._savers = waiting

    def advance_all(self) -> Advanced:
        """Post what became ready since (a CUDA event completed): called on every poll. Its
        ``last``: the pushes whose last WRITE it posted, for the poll to check at once
        (:meth:`await_end`)."""
        advanced = Advanced()
        for entries in list(self.open.values()):
            for entry in list(entries):
                self.advance(entry, advanced)
        advanced.last, self._last_posted = self._last_posted, []
        return advanced

    def advance_opened(self, target: Target) -> Advanced:
        """Post the computed groups of ``target``'s push, just opened (:meth:`post`)."""
        advanced = Advanced()
        for entry in list(self.open.get((target.push.request_id, target.push.serial), ())):
            if entry.target is target:
                self.advance(entry, advanced)
        return advanced

    def pop_last(self) -> Target | None:
        """A target whose last WRITE a handler posted, for it to spin on (none: None)."""
        return self._last_posted.pop() if self._last_posted else None

    def awaiting_last(self) -> bool:
        """Some push waits only for its last layer group, computed on a device whose event has
        not yet completed: that WRITE is on the critical path, so the writer polls for it at
        ``poll_interval_await`` (not while earlier layers compute: the forward needs the
        interpreter more than their WRITEs need an early start)."""
        if self._savers:
            return True  # an engine waits in wait_for_save for these WRITEs to land
        if not self.readiness.pending_events():
            return False
        return any(e.xfer is not None and e.next == len(e.groups) - 1 for es in self.open.values() for e in es)

    def forget(self, request_id: str, serial: int) -> None:
        key = (request_id, serial)
        self.totals.pop(key, None)
        self.open.pop(key, None)
        self.readiness.forget(request_id, serial)

    def prune(self, older_than: float) -> int:
        """Forget announced requests no push holds that were announced before ``older_than``
        (their prefill never met a registration: the lease ended them)."""
        stale = []
        for key in self.totals:
            state = self.posting.book.pushes.get(key[0])
            if (state is None or state.serial != key[1]) and self.readiness.since(*key) < older_than:
                stale.append(key)
        for key in stale:
            self.forget(*key)
        return len(stale)

    # --- posting -----------------------------------------------------------------------------
    def post(self, target: Target, remote: RemotePeer, note: Note | None) -> Outcome:
        """Open the layer-wise push of ``target``; its computed groups go once it is recorded
        (:meth:`advance_opened`). A staged registration waits for every layer (Pending)."""
        reg = target.registration
        posting = self.posting
        key = (target.push.request_id, target.push.serial)
        if reg.staging_slot is not None:
            self.open.setdefault(key, []).append(LayeredPush(target, remote, None))
            posting.emit(note, "write.layers_awaited", key[0], d_request_id=reg.request_id, staged=True)
            return Pending()
        cfg = posting.config
        try:
            groups = self.groups()
            prepared = posting.poster.prepared(remote, target.d_rank, reg.decode_tp_size)
            paired = prepared[0]

            def plan(g: int, min_pieces: int) -> WritePlan:
                layer_group = (groups.group_of_region, g)
                return paired.plan(
                    target.push.block_ids,
                    reg.block_groups,
                    reg.skip_blocks,
                    merge=cfg.post_runs,
                    min_pieces=min_pieces,
                    layer_group=layer_group,
                )

            plans = [plan(g, cfg.post_runs_min_pieces) for g in range(groups.count)]
            with_pieces = [g for g, p in enumerate(plans) if p.num_descs]
            if with_pieces:
                # The last WRITE's lists are prepared now, off the critical path, so it goes
                # as runs whenever they are fewer than its pieces (post_runs_min_pieces weighs
                # a preparation made at the post itself). A whole push armed for its forward's
                # end is one group: its only WRITE is the last.
                plans[with_pieces[-1]] = plan(with_pieces[-1], 0)
            # A verified push's pieces are located now too, and its pass made ready (DigestError:
            # a piece outside D's regions or this rank's tensors).
            digest = (
                posting.digests.prepare(reg, [plans[g] for g in with_pieces], paired, remote.layout)
                if reg.verify and with_pieces
                else None
            )
            if digest is not None:
                digest = posting.digests.ready(digest)
        except (LayoutError, PlanError, TopologyError, DigestError, ValueError) as exc:
            return Refused(exc)
        if not with_pieces:
            # Nothing to write: the completion alone settles it (a verified one with a zero digest).
            zeros = posting.digests.of(reg, [], paired, remote.layout)
            return Complete(remote, posting.out.completion(reg.request_id, reg.generation, zeros))
        # A verified push's completion says its digest follows, when the last WRITE is posted.
        completion = posting.out.completion(reg.request_id, reg.generation)
        xfer = ChunkedWrite(
            completion=completion, agent_name=remote.agent_name, p_off=None, chunks=len(with_pieces), layerwise=True
        )
        entry = LayeredPush(target, remote, xfer, plans, with_pieces, prepared, digest=digest)
        if with_pieces:
            last = plans[with_pieces[-1]]
            try:
                entry.last_lists = posting.poster.prep_runs(last, remote)
                if entry.last_lists is not None:
                    xfer.dlists.extend(entry.last_lists)
                entry.last_made = posting.poster.make_ahead(last, prepared, entry.last_lists)
                xfer.spare.append(entry.last_made)
            except Exception as exc:  # the post makes what is missing then, and fails there if it must
                posting.metrics.incr("write.prep_ahead_failed")
                posting.log.warning("write.prep_ahead_failed", request_id=key[0], error=repr(exc))
        nbytes = sum(plans[g].nbytes for g in with_pieces)
        fields = {"layerwise": True, "writes": len(with_pieces), "descs": sum(p.num_descs for p in plans)}
        now = time.monotonic()
        self.open.setdefault(key, []).append(entry)
        # Its layers go as the forward computes them: spun on at the last one only.
        return Posted(xfer, remote, nbytes, "write.layerwise", fields, now, spin=False)

    def await_end(self, target: Target) -> None:
        """Ask NIXL about a last layer's WRITE that a poll just posted, in a tight loop for up
        to ``poll_spin``, until it is no longer running: its completion leaves from such a check,
        and a turn of the writer's loop (with a message handled in between) would come later.
        Only asks: the poll's check right after settles it. Never nests a poll (unlike a spin)."""
        posting = self.posting
        spin = posting.config.poll_spin
        deadline = time.monotonic() + spin
        while spin > 0 and target.handle is not None:
            now = time.monotonic()
            target.checked(now)
            try:
                status = posting.poster.state(target.handle)
                if status != "PROC":
                    if status == "DONE":
                        timeline = posting.timeline
                        if timeline is not None:
                            timeline.mark(target.push.request_id, "p.done", time.monotonic())
                        posting.metrics.incr("write.spin_settled")
                    return
            except Exception:
                return  # the poll's own check meets it again and fails the push there
            if now >= deadline:
                return

    def advance(self, entry: LayeredPush, advanced: Advanced) -> None:
        """Post every computed layer group of ``entry`` not posted yet (counted in
        ``advanced``). Each WRITE is its own ``write.layer_posted`` event (several may go in
        one message)."""
        target = entry.target
        request_id = target.push.request_id
        key = (request_id, target.push.serial)
        ready = self.readiness.ready(*key)
        xfer = entry.xfer
        posting = self.posting
        if xfer is None:  # staged: every layer first
            if ready >= self.totals.get(key, 0):
                self._close(key, entry)
                # Its first WRITE goes now, maybe long after the registration met the push.
                advanced.due.append(entry)
            return
        if xfer.released or xfer.failed or target.handle is not xfer or target.stuck:
            self._close(key, entry)  # aborted, stuck, failed or settled: nothing more goes
            return
        posted = 0
        poster = posting.poster
        while entry.next < len(entry.groups) and entry.groups[entry.next] < ready:
            g = entry.groups[entry.next]
            if posting.past_deadline(target, time.monotonic()):
                # D may have given up on the request (its abort lost) and reused the blocks:
                # neither this layer nor any later one is written, and the push fails.
                posting.metrics.incr("write.past_deadline")
                posting.stop_parts(xfer, f"{PAST_DEADLINE} of layer group {g}")
                posting.log.warning(
                    "write.refused",
                    request_id=request_id,
                    d_request_id=target.registration.request_id,
                    layer_group=g,
                    reason="past D's deadline",
                )
                break
            last = entry.next == len(entry.groups) - 1
            first = not xfer.handles
            pending = entry.digest if last else None
            if pending is not None:
                # Every group's digest is made while the last WRITE flies and follows it: nothing
                # is digested on the critical path, nor between the forward's layers.
                reg = target.registration
                xfer.completion = posting.out.completion(reg.request_id, reg.generation, digest_follows=True)
            # The completion rides on the last WRITE only if every earlier one landed: D must
            # not hear "landed" before all of them have.
            notif = xfer.completion if last and poster.all_landed(xfer) else b""
            started = time.monotonic()
            lists, made = (entry.last_lists, entry.last_made) if last else (None, None)
            gone, times = poster.post_layer(xfer, entry.plans[g], entry.prepared, entry.remote, notif, lists, made)
            timeline = posting.timeline
            if last and timeline is not None:
                timeline.mark(request_id, "p.post_start", started)
                timeline.mark(request_id, "p.post_end", time.monotonic())
            entry.next += 1
            xfer.gathered += 1
            posted += 1
            # Progress checks count from each layer's post; the stuck timer from the first one
            # only (a push that keeps posting past write_timeout is stuck all the same).
            target.reposted(started, first=first)
            if last:
                # Only the last WRITE's end is on anyone's critical path: poll flat out for
                # it, not for each layer while the engine's forward needs the interpreter.
                posting.last_posted_at = started
                self._last_posted.append(target)
            if wants("debug"):
                posting.log.debug(
                    "write.layer_posted",
                    request_id=request_id,
                    d_request_id=target.registration.request_id,
                    layer_group=g,
                    of=self.totals.get(key, 0),
                    descs=entry.plans[g].num_descs,
                    posted_descs=entry.plans[g].posted_descs,
                    bytes=entry.plans[g].nbytes,
                    notified=bool(notif),
                    post_ms=round((time.monotonic() - started) * 1e3, 3),
                    **{k: round(v * 1e3, 3) for k, v in times.items()},
                    failed=xfer.failed or None,
                )
            if gone:
                advanced.gone.append(entry.remote)
            if xfer.failed:
                break
            if pending is not None:
                advanced.digests.append((entry.remote, pending, entry.target.push.request_id))
        if entry.next >= len(entry.groups) or xfer.failed:
            self._close(key, entry)
        if posted:
            posting.wake(0.0)
        advanced.posted += posted

    def _close(self, key: tuple[str, int], entry: LayeredPush) -> None:
        entries = self.open.get(key)
        if entries is not None and entry in entries:
            entries.remove(entry)
            self._retired.append(entry)
            if not entries:
                del self.open[key]

    def checks_over(self) -> None:
        """A check of the WRITEs in flight is over: engines whose pushes ended go on, and the
        pushes closed since the last check are freed (see ``_retired``)."""
        self.wake_savers()
        self._retired.clear()

    def sizes(self) -> dict[str, int]:
        return {
            "layerwise_savers": len(self._savers),
            "layerwise_announced": len(self.totals),
            "layerwise_open": sum(len(v) for v in self.open.values()),
            "layerwise_marks": len(self.readiness),
            "layerwise_retired": len(self._retired),
        }


def _ended(xfer: ChunkedWrite) -> bool:
    """A layer-wise push can write no more and D has been told (or never will be)."""
    return xfer.released or bool(xfer.failed) or (xfer.notified and len(xfer.landed) >= xfer.chunks)
