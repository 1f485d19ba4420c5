"""A push's WRITE while it is in flight: one NIXL WRITE, or one made of chunks.

:class:`DirectWrite` is a whole push's single WRITE; :class:`ChunkedWrite` is a staged push
WRITEn chunk by chunk as the stager gathers it, or a layer-wise push's WRITEs, one per layer
group. Both answer the same questions (what NIXL says of it, why it failed, whether parts are
still to post, how to stop and release it), so whoever holds one never asks which it is. Only
the writer's thread calls them, with the rank's agent (a NIXL agent is not thread-safe).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from ...transport.agent import NixlAgentLike, XferHandle

# What a released WRITE leaves to its owner: WRITEs made ahead and never posted, and the lists
# its chunks read (the owner releases both, logging what NIXL refuses).
Leftovers: TypeAlias = tuple[list[Any], list[Any]]


class DirectWrite:
    """A whole push's one WRITE."""

    __slots__ = ("xfer",)

    # One WRITE, posted whole: nothing of it fails apart from NIXL's word on it, no part is
    # still to post, and it touches D's memory from its post on.
    failed = ""
    parts_left = False
    untouched = False
    writing = True  # tracked only from its post until it ended

    def __init__(self, xfer: XferHandle) -> None:
        self.xfer = xfer

    def state(self, agent: NixlAgentLike) -> str:
        return str(agent.check_xfer_state(self.xfer))

    def stop(self, why: str) -> bool:
        """Nothing further to post, so nothing to stop: it runs to its end (False)."""
        return False

    def release(self, agent: NixlAgentLike) -> Leftovers:
        """Release it; raises NIXL's refusal."""
        agent.release_xfer_handle(self.xfer)
        return [], []

    def take_slot(self) -> int | None:
        return None

    def slowest_chunk(self) -> dict[str, Any]:
        return {}


@dataclass(eq=False)
class ChunkedWrite:
    """A push WRITEn as several NIXL WRITEs (see the module docstring).

    Each chunk is its own NIXL WRITE. One chunk carries the completion as its notification;
    several carry none, and the completion is sent once every chunk is DONE. P's staging slot
    goes back when the WRITEs are released *and* no gather can still write into it."""

    completion: bytes
    agent_name: str
    p_off: int | None
    chunks: int = 1
    gathered: int = 0  # Gathered replies received
    handles: list[Any] = field(default_factory=list)
    # Indices into ``handles`` of chunks seen DONE: a landed chunk stays landed, so each poll
    # asks NIXL only about the chunks still running (a layer-wise push has one per layer group).
    landed: set[int] = field(default_factory=set)
    dlists: list[Any] = field(default_factory=list)
    # WRITEs made ahead and not posted yet (a layer-wise push's last): released with the push
    spare: list[Any] = field(default_factory=list)
    failed: str = ""
    notified: bool = False
    released: bool = False
    # When each chunk was posted, and the chunk that took longest from its post to being seen
    # DONE (seconds, index): which layer held a layer-wise push up (write.settled).
    posted_times: list[float] = field(default_factory=list)
    slowest: tuple[float, int] = (0.0, -1)
    # A layer-wise push: its chunks wait on the forward, so until the first is posted nothing of
    # D's is touched and no WRITE can be stuck (D's deadline and P's lease bound that wait).
    layerwise: bool = False

    @property
    def parts_left(self) -> bool:
        """Some chunk is still to be posted (a later layer, a chunk still gathering)."""
        return len(self.handles) < self.chunks

    @property
    def writing(self) -> bool:
        """Some posted chunk was not seen to end yet (NIXL progresses it in the writer's polls)."""
        return len(self.landed) < len(self.handles)

    @property
    def untouched(self) -> bool:
        """A layer-wise push with no layer written yet: nothing runs, nothing of D's is touched."""
        return self.layerwise and not self.handles

    def add(self, handle: Any, now: float) -> None:
        """Chunk ``len(handles)`` was posted at ``now``."""
        self.handles.append(handle)
        self.posted_times.append(now)

    def seen_landed(self, index: int, now: float) -> None:
        """Chunk ``index`` was seen DONE at ``now``."""
        self.landed.add(index)
        took = now - self.posted_times[index] if index < len(self.posted_times) else 0.0
        if took > self.slowest[0]:
            self.slowest = (took, index)

    def stop(self, why: str) -> bool:
        """No further chunk is posted: the push fails once the chunks already posted ended
        (never reported pushed, D told then). True: the owner should poll soon. Once the
        completion is out (riding on the last chunk, or sent), nothing is left to stop: D hears
        "landed" when that chunk lands, so the push ends as its WRITEs do, never with a second
        final word."""
        if self.notified:
            return True
        self.failed = self.failed or why
        return True

    def state(self, agent: NixlAgentLike) -> str:
        """DONE once every chunk is (the completion of a push of several chunks is sent then).
        One that failed (a chunk ERR, a gather or post failure) is ERR only once no chunk can
        still land, FAILING while some are in flight: those must end (NIXL says so) before D
        may hear that the push is over."""
        live = self.running(agent)
        if self.failed:
            return "FAILING" if live else "ERR"
        if live or self.gathered < self.chunks or len(self.handles) < self.chunks:
            return "PROC"
        if not self.notified:
            agent.send_notif(self.agent_name, self.completion)  # every chunk landed
            self.notified = True
        return "DONE"

    def running(self, agent: NixlAgentLike) -> bool:
        """Whether some posted chunk may still land; asks NIXL only about chunks not seen DONE
        before. A chunk that ended in ERR, or cannot be asked (its peer went away, most likely),
        fails the push; the chunks that can still say they are running are waited for."""
        live = False
        now = time.monotonic()
        for i, h in enumerate(self.handles):
            if i in self.landed:
                continue
            try:
                s = agent.check_xfer_state(h)
            except Exception as exc:
                self.failed = self.failed or f"check_xfer_state raised {exc!r}"
                continue
            if s == "DONE":
                self.seen_landed(i, now)
            elif s == "ERR":
                self.failed = self.failed or "WRITE ended in ERR"
            else:
                live = True
        return live

    def all_landed(self, agent: NixlAgentLike) -> bool:
        """Every chunk posted so far is DONE (none failed)."""
        return not self.running(agent) and not self.failed and len(self.landed) == len(self.handles)

    def release(self, agent: NixlAgentLike) -> Leftovers:
        """Release every chunk WRITE; raises the first refusal. A chunk NIXL would not release
        is kept (it may still land), with the lists it reads, for the next try; only once none
        is left is it released, and what it made ahead and the lists go to the owner."""
        first: Exception | None = None
        kept: list[Any] = []
        for h in self.handles:
            try:
                agent.release_xfer_handle(h)
            except Exception as exc:
                first = first or exc
                kept.append(h)
        # A released push never settles as landed: its post times (the slowest-chunk reading
        # of write.settled) mean nothing now, and would no longer match ``handles``.
        self.handles, self.posted_times = kept, []
        self.landed.clear()  # the kept chunks are the ones NIXL would not release: still running
        if first is not None:
            raise first
        leftovers = (self.spare, self.dlists)
        self.spare, self.dlists = [], []
        self.released = True
        return leftovers

    def take_slot(self) -> int | None:
        """P's slot offset, once the chunks are released and no gather can write into it
        (then it is the caller's to give back); else None."""
        if self.released and self.gathered >= self.chunks and self.p_off is not None:
            off, self.p_off = self.p_off, None
            return off
        return None

    def slowest_chunk(self) -> dict[str, Any]:
        """A WRITE of several chunks: the chunk that took longest from its post to being seen
        DONE, and how long (write.settled's fields; none for fewer than two chunks)."""
        if len(self.handles) < 2 or self.slowest[1] < 0:
            return {}
        took, index = self.slowest
        return {"slowest_chunk": index, "slowest_chunk_ms": round(took * 1e3, 3), "chunks": len(self.handles)}


# A push's WRITE in flight, whichever kind.
Write: TypeAlias = DirectWrite | ChunkedWrite
