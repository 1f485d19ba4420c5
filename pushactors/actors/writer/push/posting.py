"""What a push mode posts with: never the :class:`~.pusher.Pusher` itself.

A mode gets the rank's NIXL calls, its notification bytes, its settings and counters, D's
deadlines and a read-only look at the push book; what its post comes to it returns
(:mod:`.outcome`), and the pusher alone applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ....core.staging import StagingArea
from ....core.timeline import Timeline
from ....logs import wants
from ...base import Note, RankContext
from ..outbound import Outbound
from ..poster import Poster
from ..verify import PushDigests
from ..writes import Write
from .book import PushBook, Target


class Posting:
    """The narrow surface the push modes post through (see the module docstring)."""

    def __init__(
        self,
        ctx: RankContext,
        log: Any,
        poster: Poster,
        out: Outbound,
        book: PushBook,
        wake: Callable[[float], None],
    ) -> None:
        self._ctx = ctx
        self.config = ctx.config
        self.metrics = ctx.metrics
        self.log = log
        self.poster = poster
        self.out = out
        self.book = book  # read only here: which pushes are open, which WRITEs in flight
        self.wake = wake  # ask the writer to poll within this many seconds
        self.last_posted_at = 0.0  # when the last WRITE still running after its spin was posted
        self.digests = PushDigests(ctx)  # what a verified push's completion carries

    @property
    def staging(self) -> StagingArea | None:
        """P's staging buffer (set once the rank's KV memory is registered)."""
        return self._ctx.staging

    @property
    def timeline(self) -> Timeline | None:
        return self._ctx.timeline

    def past_deadline(self, target: Target, now: float) -> bool:
        """Whether D's deadline for the registration (its newest promise) passed by ``now``: D
        may have reused the blocks (its abort lost), so no WRITE of the push may go any more.
        Asked before every WRITE of a push, not only its first: a layer-wise push posts for as
        long as the forward runs, a staged one as its chunks are gathered."""
        key = (target.push.request_id, target.d_rank, target.registration.generation)
        return now >= max(target.deadline, self._ctx.promises.deadline(key))

    def stop_parts(self, write: Write, why: str) -> None:
        """No further part (layer group, chunk) of ``write`` is posted: the push fails once the
        parts already posted have ended (never reported pushed, D told then)."""
        if write.stop(why):
            self.wake(0.0)

    def emit(self, note: Note | None, event: str, request_id: str, *, level: str = "debug", **fields: Any) -> None:
        """Say what happened: as the handled message's event, or on its own when replayed."""
        if note is not None:
            note(event, level=level, **fields)
        elif wants(level):
            getattr(self.log, level)(event, request_id=request_id, replayed=True, **fields)
