"""Whole pushes of one P rank, on the writer's thread: one WRITE straight into D's blocks.

The plan is the matcher's (:class:`~pushactors.protocol.PostPush` carries it when it was made
on the pairing this remote holds now) or one made here; the WRITE is posted by index into the
pairing's prepared lists, or as lists of a few runs. What the post came to is returned
(:mod:`.outcome`): the pusher records it.
"""

from __future__ import annotations

import time

from ....core.blocks import LayoutError, PlanError, WritePlan
from ....core.topology import TopologyError
from ....logs import wants
from ....protocol import PostPush
from ....transport.digest import DigestError
from ..remotes import RemotePeer
from ..writes import DirectWrite
from .book import Target
from .outcome import Complete, Outcome, Posted, Refused, SubmitFailed
from .posting import Posting


class DirectWrites:
    """Posts a push as one WRITE (see the module docstring)."""

    def __init__(self, posting: Posting) -> None:
        self.posting = posting

    def post(self, target: Target, remote: RemotePeer, started: float, planned: PostPush | None = None) -> Outcome:
        """Post the WRITE of ``target``: the plan ``planned`` carries when it was made on the
        pairing this remote holds now, else one made here. ``started``: when the post began."""
        posting = self.posting
        poster = posting.poster
        reg = target.registration
        request_id = target.push.request_id
        try:
            prepared = poster.prepared(remote, target.d_rank, reg.decode_tp_size)
            if (
                planned is not None
                and isinstance(planned.plan, WritePlan)
                and planned.pairing_id == prepared.pairing_id
            ):
                plan = planned.plan
                posting.metrics.incr("write.preplanned")
            else:
                cfg = posting.config
                plan = prepared[0].plan(
                    target.push.block_ids,
                    reg.block_groups,
                    reg.skip_blocks,
                    merge=cfg.post_runs,
                    min_pieces=cfg.post_runs_min_pieces,
                )
            # A verified push: the digest of exactly the bytes this WRITE carries, located now
            # and computed once the WRITE is on its way (it follows the WRITE). P's blocks are
            # final (leased, computed) and D reads them only after both arrived.
            pending = posting.digests.prepare(reg, [plan], prepared[0], remote.layout) if reg.verify else None
            if plan.num_descs == 0:
                # Nothing to copy (D had every block cached, or a lower P rank writes these
                # heads): the completion alone settles it, its (empty) digest inline.
                digest = posting.digests.compute(pending) if pending is not None else ()
                return Complete(remote, posting.out.completion(reg.request_id, reg.generation, digest))
        except (LayoutError, PlanError, TopologyError, DigestError) as exc:
            return Refused(exc)
        planned_at = time.monotonic()
        completion = posting.out.completion(reg.request_id, reg.generation, digest_follows=pending is not None)
        timeline = posting.timeline
        if timeline is not None:
            timeline.mark(request_id, "p.post_start", planned_at)
        try:
            accepted = poster.post_plan(plan, prepared, remote, completion)
        except Exception as exc:
            return SubmitFailed(remote, exc)
        if timeline is not None:
            timeline.mark(request_id, "p.post_end", time.monotonic())
        fields = None
        if wants("debug"):  # the event's fields are built only for a reader
            t = accepted.times
            fields = {
                "descs": plan.num_descs,
                "merged_descs": plan.merged_descs,
                "posted_descs": plan.posted_descs,  # runs, when posted as runs (plan.runs)
                "runs": plan.runs is not None,
                "blocks": plan.num_blocks,
                "post_ms": round((time.monotonic() - started) * 1e3, 3),
                "plan_ms": round((planned_at - started) * 1e3, 3),  # of post_ms; the rest is NIXL's:
                "prep_ms": round(t["prep_ms"] * 1e3, 3),  # the runs' own lists (0 without runs)
                "make_ms": round(t["make_ms"] * 1e3, 3),  # make_prepped_xfer
                "transfer_ms": round(t["transfer_ms"] * 1e3, 3),  # transfer (posts the WRITE)
            }
        kind = "write.runs" if plan.runs is not None else ""
        return Posted(
            DirectWrite(accepted.handle),
            remote,
            plan.nbytes,
            kind,
            fields,
            started,
            status=accepted.status,
            resources=accepted.resources,
            digest=pending,
        )
