"""The plan of a staged push (:mod:`pushactors.core.staging`), apart from its posting.

D offered a staging slot for a request: :func:`plan_staged` decides how this P rank writes its
parts of D's image of that request, the way :meth:`PairedLayout.plan` decides a direct WRITE.
It is pure (no thread, no agent, no actor): the writer posts what it returns.

* :class:`Empty`: no piece to write here; only the completion goes.
* :class:`Straight`: our pieces go straight from our blocks into D's slot, one descriptor per
  run of them (when they already join into few runs, or when P has no room to gather them).
* :class:`OneChunk`: the pieces are gathered into our own slot by the stager from their row
  grids (no row is built on the host), and one WRITE covers the image's spans.
* :class:`Chunks`: the same gather cut into chunks of about ``chunk_bytes`` of the image, each
  chunk explicit rows, WRITEn once gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, TypeAlias

import numpy as np

from ..protocol import BlockGroups, StagingInfo
from .blocks import PairedLayout, PlanError, RemoteLayout
from .rowgrid import IndexArray, RowGrid
from .staging import U64, grid_rows, grid_runs, grid_spans, image_of

__all__ = ["Chunk", "Chunks", "Empty", "OneChunk", "StagedPlan", "Straight", "plan_staged"]


@dataclass(frozen=True)
class Empty:
    """Nothing of the image is ours to write: the completion alone settles the target."""


@dataclass(frozen=True, eq=False)
class Straight:
    """Write our pieces straight from our blocks into D's slot: row ``i`` copies
    ``local_rows[i, 1]`` bytes from our address ``local_rows[i, 0]`` to D's ``image_addrs[i]``."""

    local_rows: IndexArray  # (n, 2): (address here, length) per run
    image_addrs: IndexArray  # (n,): D's address of each run (its staging buffer + slot + image offset)
    pieces: int  # pieces before joining them into runs
    # True: only because P has no room to gather ("staging.direct"); False: the pieces already
    # run on, so a gather would only copy them once more ("staging.straight").
    direct: bool

    @property
    def nbytes(self) -> int:
        return int(self.local_rows[:, 1].sum()) if len(self.local_rows) else 0


@dataclass(frozen=True, eq=False)
class OneChunk:
    """Gather everything into our slot at once, then one WRITE of the image's spans. The
    stager builds the rows from ``grids_shifted`` (on the device, on a GPU)."""

    p_off: int  # our slot's offset in our staging buffer (the writer gives it back)
    grids_shifted: tuple[RowGrid, ...]  # our pieces' grids, destinations moved into our slot
    span_off: IndexArray  # image offsets of the spans the WRITE covers (sorted, disjoint)
    span_len: IndexArray
    nbytes: int  # bytes of the pieces
    pieces: int
    runs: int  # spans the pieces make in the image
    d_addr: int  # D's slot address (its staging buffer + slot offset)
    slot_base: int  # our slot's address (our staging buffer + p_off)


@dataclass(frozen=True, eq=False)
class Chunk:
    """One chunk's gather rows (``src`` → ``dst`` in our slot, ``lengths``) and the image
    range its WRITE covers (``img``, ``lens``: image offsets, sorted)."""

    src: U64
    dst: U64
    lengths: U64
    img: IndexArray
    lens: IndexArray


@dataclass(frozen=True, eq=False)
class Chunks:
    """Gather and WRITE chunk by chunk (chunk i+1 gathered while chunk i is in flight). The
    completion goes once every chunk is DONE: chunks may land in any order."""

    p_off: int
    chunks: tuple[Chunk, ...]
    nbytes: int
    pieces: int
    runs: int
    d_addr: int
    slot_base: int


StagedPlan: TypeAlias = Empty | Straight | OneChunk | Chunks


def plan_staged(
    paired: PairedLayout,
    block_ids: BlockGroups,
    block_groups: BlockGroups,
    skip_blocks: Sequence[int],
    *,
    remote_layout: RemoteLayout,
    d_staging: StagingInfo | None,
    slot: tuple[int, int],
    gather_runs_limit: int,
    chunk_bytes: int,
    alloc: Callable[[int], int | None] | None,
    staging_addr: int,
) -> StagedPlan:
    """Plan the staged push of P's ``block_ids`` into the image of D's ``block_groups`` (after
    ``skip_blocks`` D had), in D's slot ``slot`` = (offset, bytes) of its buffer ``d_staging``.

    ``alloc(nbytes)`` takes a slot of our own staging buffer (at ``staging_addr``) and gives its
    offset, or None without room; ``alloc`` None: we have no staging buffer. It is called at most
    once, after every check: a plan that raises holds no slot. The slot of a :class:`OneChunk`
    or :class:`Chunks` is the caller's to give back.

    PlanError for a push that must not be posted (D advertises no staging buffer, a slot outside
    it or smaller than D's image, a row that cannot exist); LayoutError, TopologyError and
    ValueError of the pairing pass as they are.
    """
    if d_staging is None:
        raise PlanError("D offered a staging slot but advertises no staging buffer")
    if slot[0] + slot[1] > d_staging.length:
        raise PlanError(f"staging slot {slot} lies outside D's {d_staging.length}-byte buffer")
    image = image_of(remote_layout.regions, block_groups, remote_layout.physical_blocks_per_logical)
    if image.nbytes > slot[1]:
        raise PlanError(f"D's image needs {image.nbytes} bytes, its slot holds {slot[1]}")
    grids = [g for g in paired.staged_grids(block_ids, block_groups, skip_blocks, image.bases) if len(g)]
    for g in grids:
        try:
            g.check()  # a row that cannot exist (negative, past any address): refused here
        except ValueError as exc:
            raise PlanError(str(exc)) from exc
    if not grids:
        return Empty()
    d_addr = d_staging.addr + slot[0]
    pieces = sum(len(g) for g in grids)
    # Our pieces already in few runs (blocks in order here): write them straight into D's
    # slot. A gather would only copy them once more through the same memory.
    straight = grid_runs(grids, gather_runs_limit)
    p_off = alloc(image.nbytes) if straight is None and alloc is not None else None
    if straight is not None or p_off is None:
        # Straight from our blocks, one descriptor per run (without room here too).
        joined = straight if straight is not None else grid_runs(grids)
        assert joined is not None  # no limit: always the runs
        laddr, img, lens = joined
        return Straight(
            local_rows=np.stack([laddr, lens], axis=1),
            image_addrs=d_addr + img,
            pieces=pieces,
            direct=straight is None,
        )
    slot_base = staging_addr + p_off
    size = chunk_bytes
    if size <= 0 or image.nbytes <= size:
        # One chunk: the stager builds the rows from the grids (on the device, on a GPU), and
        # the WRITE covers the image's spans; no row is built here.
        off, length = grid_spans(grids)
        return OneChunk(
            p_off=p_off,
            grids_shifted=tuple(g.shifted(dst=slot_base) for g in grids),
            span_off=off,
            span_len=length,
            nbytes=sum(g.nbytes for g in grids),
            pieces=pieces,
            runs=len(off),
            d_addr=d_addr,
            slot_base=slot_base,
        )
    # Chunks: every row, here.
    laddr, img, lens = grid_rows(grids)
    if len(img) > 1 and bool(np.any(img[1:] < img[:-1])):  # pieces usually come in image order
        order = np.argsort(img, kind="stable")
        img, lens, laddr = img[order], lens[order], laddr[order]
    # Chunks are runs of pieces (img is sorted): slices, not index arrays. A piece belongs to
    # the chunk its start falls in.
    cuts = np.flatnonzero(np.diff(img // size)) + 1
    bounds = [0, *cuts.tolist(), len(img)]
    # Every chunk's arrays are built here, before the writer hands the stager any: numpy lets
    # go of the GIL on large arrays, and a stager already gathering would take it at each of
    # our calls (a GIL convoy that made the writer's handler and the gather each 2-4x slower).
    chunks = tuple(
        Chunk(
            src=_unsigned(laddr[lo:hi]),
            dst=_unsigned(img[lo:hi]) + np.uint64(slot_base),
            lengths=_unsigned(lens[lo:hi]),
            img=img[lo:hi],
            lens=lens[lo:hi],
        )
        for lo, hi in pairwise(bounds)
    )
    return Chunks(
        p_off=p_off,
        chunks=chunks,
        nbytes=int(lens.sum()),
        pieces=len(lens),
        # img is sorted here: a piece that does not start where the last one ended opens a span
        runs=1 + int(np.count_nonzero(img[1:] != img[:-1] + lens[:-1])),
        d_addr=d_addr,
        slot_base=slot_base,
    )


def _unsigned(a: Any) -> Any:
    """``a`` as uint64, without a copy for int64 (planned addresses, offsets and lengths are
    never negative)."""
    return a.view(np.uint64) if a.dtype == np.int64 else a.astype(np.uint64)
