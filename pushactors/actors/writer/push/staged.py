"""Staged pushes of one P rank, on the writer's thread (``staging_bytes`` > 0).

D offered a staging slot: P writes the image of D's blocks into it. The plan is
:func:`~pushactors.core.staged_plan.plan_staged`'s (pure); this class posts it: straight from
P's blocks as a few runs, or through P's own slot, gathered chunk by chunk on the stager, each
chunk's WRITE posted when its :class:`~pushactors.protocol.Gathered` comes back. Each chunk's
WRITE is checked against D's deadline for the registration just before it is posted, as the
push's first is: a push whose deadline passed while it gathered posts nothing more and fails.
What the first post came to is returned (:mod:`.outcome`): the pusher records it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ....core.blocks import LayoutError, PlanError
from ....core.staged_plan import Chunks, Empty, OneChunk, Straight, plan_staged
from ....core.staging import spans
from ....core.topology import TopologyError
from ....protocol import Gather, Gathered
from ...base import Note
from ..poster import Accepted
from ..remotes import RemotePeer
from ..writes import ChunkedWrite, DirectWrite
from .book import PAST_DEADLINE, Target
from .outcome import Complete, Outcome, Posted, Refused, SubmitFailed
from .posting import Posting


class StagedWrites:
    """Posts a push into D's staging slot (see the module docstring)."""

    def __init__(self, posting: Posting) -> None:
        self.posting = posting
        # Chunks of staged pushes the stager is gathering: (P id, D rank, serial, chunk) ->
        # (the chunked WRITE, image offsets, lengths, D slot address).
        self.gathers: dict[tuple[str, int, int, int], tuple[ChunkedWrite, Any, Any, int]] = {}

    def post(self, target: Target, remote: RemotePeer) -> Outcome:
        """D offered a staging slot: write its image. Straight from our blocks when the
        pieces run in order (or there is no room here), else gathered on the stager first
        (then :meth:`gathered` posts a few large spans)."""
        reg = target.registration
        slot = reg.staging_slot
        assert slot is not None
        posting = self.posting
        planning = time.monotonic()
        mine = posting.staging
        try:
            paired = posting.poster.prepared(remote, target.d_rank, reg.decode_tp_size)[0]
            assert remote.layout is not None
            plan = plan_staged(
                paired,
                target.push.block_ids,
                reg.block_groups,
                reg.skip_blocks,
                remote_layout=remote.layout,
                d_staging=remote.info.staging,
                slot=slot,
                gather_runs_limit=posting.config.staging_gather_runs,
                chunk_bytes=posting.config.staging_chunk_bytes,
                alloc=mine.alloc if mine is not None else None,
                staging_addr=mine.addr if mine is not None else 0,
            )
        except (LayoutError, PlanError, TopologyError, ValueError) as exc:
            return Refused(exc)
        if isinstance(plan, Empty):
            return Complete(remote, posting.out.completion(reg.request_id, reg.generation))
        if isinstance(plan, Straight):
            # Our pieces already in few runs: straight into D's slot; a gather would only copy
            # them once more through the same memory (or there is no room here to gather).
            posting.metrics.incr("staging.direct" if plan.direct else "staging.straight")
            return self._post_rows(target, remote, plan, planning)
        assert isinstance(plan, (OneChunk, Chunks))
        completion = posting.out.completion(reg.request_id, reg.generation)
        xfer = ChunkedWrite(completion=completion, agent_name=remote.agent_name, p_off=plan.p_off)
        rid, d_rank, serial = target.push.request_id, target.d_rank, target.push.serial
        key = (rid, d_rank, serial)
        gathers: list[Gather] = []
        if isinstance(plan, OneChunk):
            # The stager builds the rows from the grids (on the device, on a GPU); the WRITE
            # covers the image's spans. One chunk's WRITE carries the completion.
            xfer.chunks = 1
            self.gathers[rid, d_rank, serial, 0] = (xfer, plan.span_off, plan.span_len, plan.d_addr)
            gathers.append(self._gather(key, 0, grids=plan.grids_shifted))
        else:
            # Gather and WRITE chunk by chunk: chunk i+1 is gathered while chunk i is in flight.
            xfer.chunks = len(plan.chunks)
            for c, chunk in enumerate(plan.chunks):
                self.gathers[rid, d_rank, serial, c] = (xfer, chunk.img, chunk.lens, plan.d_addr)
                gathers.append(self._gather(key, c, src=chunk.src, dst=chunk.dst, lengths=chunk.lengths))
        fields = {
            "staged": True,
            "chunks": xfer.chunks,
            "pieces": plan.pieces,
            "descs": plan.pieces,
            "merged_descs": plan.runs,
            "plan_ms": round((time.monotonic() - planning) * 1e3, 3),  # rows, chunks and their Gathers
        }
        # Its chunks go as they are gathered: polled, not spun on. Every array first, the
        # stager's work last (``gathers``, sent once recorded: a GIL convoy otherwise).
        now = time.monotonic()
        return Posted(xfer, remote, plan.nbytes, "write.staged", fields, now, spin=False, gathers=tuple(gathers))

    @staticmethod
    def _gather(key: tuple[str, int, int], chunk: int, **rows: Any) -> Gather:
        request_id, d_rank, serial = key
        empty = np.empty(0, dtype=np.uint64)
        return Gather(
            request_id=request_id,
            d_rank=d_rank,
            serial=serial,
            chunk=chunk,
            src=rows.get("src", empty),
            dst=rows.get("dst", empty),
            lengths=rows.get("lengths", empty),
            grids=tuple(rows.get("grids", ())),
        )

    def _post_rows(self, target: Target, remote: RemotePeer, plan: Straight, started: float) -> Outcome:
        """One WRITE of explicit runs from our blocks into D's image."""
        reg = target.registration
        posting = self.posting
        completion = posting.out.completion(reg.request_id, reg.generation)
        planned = time.monotonic()
        try:
            rows, addrs = plan.local_rows, plan.image_addrs
            accepted: Accepted = posting.poster.post_rows(rows, addrs, remote, completion, p_off=None)
        except Exception as exc:
            return SubmitFailed(remote, exc)
        n = len(plan.local_rows)
        fields = {
            "descs": plan.pieces,  # pieces, as a direct push would post them
            "merged_descs": n,
            "posted_descs": n,  # the rows, joined where they run on
            "staged": False,
            "gathered_bytes": 0,
            "post_ms": round((time.monotonic() - started) * 1e3, 3),
            "plan_ms": round((planned - started) * 1e3, 3),  # of post_ms: the staging plan and its runs
        }
        nbytes = int(plan.local_rows[:, 1].sum())
        return Posted(
            DirectWrite(accepted.handle),
            remote,
            nbytes,
            "write.image_direct",
            fields,
            started,
            status=accepted.status,
            resources=accepted.resources,
        )

    def gathered(self, msg: Gathered, note: Note) -> RemotePeer | None:
        """Post the chunk the stager gathered, if its push may still post; returns the remote
        NIXL said is gone (for the pusher to forget), else None."""
        entry = self.gathers.pop((msg.request_id, msg.d_rank, msg.serial, msg.chunk), None)
        if entry is None:
            note("write.gather_stale", level="warning")
            return None
        xfer, off_or_img, len_or_lens, d_addr = entry
        xfer.gathered += 1
        posting = self.posting
        if xfer.released or xfer.failed or posting.staging is None or xfer.p_off is None:
            # The push ended (or failed) while this chunk was gathered: nothing to send; the
            # slot goes back once no gather can still write into it.
            posting.poster.maybe_free_slot(xfer)
            note("write.gather_dropped", chunk=msg.chunk)
            return None
        if msg.error:
            xfer.failed = msg.error
            posting.wake(0.0)
            note("write.gather_failed", level="warning", chunk=msg.chunk, error=msg.error)
            return None
        off, length = spans(off_or_img, len_or_lens)
        state = posting.book.pushes.get(msg.request_id)
        target = state.targets.get(msg.d_rank) if state is not None else None
        remote = target.remote if target is not None else None
        if remote is None or remote.layout is None or remote.info.staging is None or posting.poster.layout is None:
            xfer.failed = "D agent is gone"
            posting.wake(0.0)
            return None
        assert target is not None
        started = time.monotonic()
        if posting.past_deadline(target, started):
            # D may have given up on the request (its abort lost) and reused its slot: neither
            # this chunk nor a later one is written, and the push fails once the rest ended.
            posting.metrics.incr("write.past_deadline")
            posting.stop_parts(xfer, f"{PAST_DEADLINE} of chunk {msg.chunk}")
            note("write.refused", level="warning", chunk=msg.chunk, reason="past D's deadline")
            return None
        gone = posting.poster.post_chunk(xfer, off, length, d_addr, remote)
        posting.wake(0.0)
        note(
            "write.chunk_posted",
            chunk=msg.chunk,
            descs=len(off),
            bytes=int(length.sum()),
            gather_ms=round(msg.gather_ms, 3),
            post_ms=round((time.monotonic() - started) * 1e3, 3),
            failed=xfer.failed or None,
        )
        return remote if gone else None
