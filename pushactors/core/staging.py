"""Staged pushes: scattered blocks travel as one contiguous image (issue 11).

A WRITE costs about 10 µs per descriptor on UCX, so a request scattered over thousands of
blocks is bound by descriptor count, not bytes. When D offers a *staging slot* in its
registration, the push goes through an image instead:

* D's image of a request is, for each of D's regions in order, the registered blocks of that
  region's KV group back to back, ``block_len`` bytes each: the bytes of (region ``j``, the
  ``i``-th registered block) sit at ``base[j] + i × block_len[j]``.
* Every P source writes its parts at the offsets they have inside D's blocks: P gathers them
  from its own blocks into a staging slot laid out the same way (holes where other sources
  write), then WRITEs the spans it covers — one descriptor per contiguous span.
* When every source has completed, D copies each region's slice of the image into its blocks
  (one strided copy per region) and only then reports the request.

Bytes of D's blocks no source writes (tokens past the prompt in the last block) come from the
slot: they are garbage either way.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..protocol import BlockGroups
from .blocks import KVRegion, run_starts
from .rowgrid import IndexArray, RowGrid

# Slots start on a 64 KiB boundary and image regions on 256 bytes (packed tightly, so one
# source's parts of consecutive regions merge into one span): the device copies then move rows
# as large as a block's page, their unit being the gcd of every offset and length.
SLOT_ALIGN = 64 << 10
ALIGN = 256
U64 = npt.NDArray[np.uint64]


class SlotPool:
    """First-fit allocator of byte ranges in one staging buffer (bounded, coalescing)."""

    def __init__(self, size: int, *, align: int = SLOT_ALIGN) -> None:
        self.size = size
        self.align = align
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []  # (offset, length), sorted
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def slots(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        """A slot of at least ``nbytes`` (offset), or None when none is free."""
        if nbytes <= 0:
            return None
        need = -(-nbytes // self.align) * self.align
        for i, (off, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (off + need, length - need)
                self._used[off] = need
                return off
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset, None)
        if length is None:
            return  # freeing twice is harmless: the slot was already back
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, length))
        # Coalesce with the neighbours.
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i][1] + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]


class StagingArea:
    """One rank's registered staging buffer and the slots taken from it. Thread-safe: D's
    worker takes slots when it stages a registration, the stager alone gives them back; P's
    writer takes and gives back its own."""

    def __init__(self, addr: int, size: int, device_id: int = 0) -> None:
        self.addr = addr
        self.size = size
        self.device_id = device_id
        self._pool = SlotPool(size)
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> int | None:
        with self._lock:
            return self._pool.alloc(nbytes)

    def free(self, offset: int) -> None:
        with self._lock:
            self._pool.free(offset)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"staging_slots": self._pool.slots, "staging_used": self._pool.used_bytes}


@dataclass(frozen=True)
class Image:
    """Where each of D's regions sits in a request's image."""

    bases: tuple[int, ...]  # per region; -1 for a region of a group the request does not use
    nbytes: int


def image_of(regions: Sequence[KVRegion], groups: BlockGroups, ratio: int = 1) -> Image:
    """D's image of a request: per region, its group's registered *physical* blocks
    (``ratio`` per logical block), ``block_len`` bytes each, back to back."""
    bases = []
    off = 0
    for r in regions:
        if r.group >= len(groups) or not groups[r.group]:
            bases.append(-1)
            continue
        off = -(-off // ALIGN) * ALIGN
        bases.append(off)
        off += len(groups[r.group]) * ratio * r.block_len
    return Image(tuple(bases), off)


def grid_rows(grids: Sequence[RowGrid]) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Every row of ``grids`` in order: (source, destination, length); ValueError as
    :meth:`RowGrid.check`."""
    if not grids:
        e = np.empty(0, dtype=np.int64)
        return e, e, e
    parts = [g.rows() for g in grids]
    if len(parts) == 1:
        return parts[0]
    src, dst, length = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return src, dst, length


def grid_spans(grids: Sequence[RowGrid]) -> tuple[IndexArray, IndexArray]:
    """:func:`spans` of every destination range of ``grids``. When a grid's links share one
    stride and one length (every grid a staging plan builds), the pieces' spans are merged once
    and shifted to each link: O(links + pieces) unless the pieces themselves are scattered."""
    offs: list[IndexArray] = []
    lens: list[IndexArray] = []
    for g in grids:
        if not len(g):
            continue
        stride, extra = int(g.dst_stride[0]), int(g.length[0])
        if np.all(g.dst_stride == stride) and np.all(g.length == extra):
            po, pl = spans(stride * g.dst_block + g.dst_off, g.piece_length + extra)
            offs.append((g.dst[:, None] + po[None, :]).ravel())
            lens.append(np.broadcast_to(pl, (g.links, len(pl))).ravel())
        else:
            _, dst, length = g.rows()
            offs.append(dst)
            lens.append(length)
    if not offs:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    return spans(np.concatenate(offs), np.concatenate(lens))


def grid_runs(grids: Sequence[RowGrid], limit: int | None = None) -> tuple[IndexArray, IndexArray, IndexArray] | None:
    """Every row of ``grids`` with neighbours that are contiguous on both sides joined: (source,
    destination, length) per run; None as soon as there would be more than ``limit`` runs.

    Runs never join across links (a link's rows lie in one of the source's regions, which NIXL
    may hold as separate registrations). When a grid's links share their strides and length
    (every grid a staging plan builds) the joins are found once over its pieces and repeated
    per link, so the count is known from O(links + pieces) work before any run is built."""
    parts: list[tuple[IndexArray, IndexArray, IndexArray]] = []
    count = 0
    for g in grids:
        if not len(g):
            continue
        uniform = all(bool(np.all(a == a[0])) for a in (g.src_stride, g.dst_stride, g.length))
        if uniform:
            g.check()
            plen = g.piece_length + int(g.length[0])
            ps = int(g.src_stride[0]) * g.src_block + g.src_off
            pd = int(g.dst_stride[0]) * g.dst_block + g.dst_off
            joins = (ps[1:] == ps[:-1] + plen[:-1]) & (pd[1:] == pd[:-1] + plen[:-1])
            heads = run_starts(joins)
            count += g.links * len(heads)
            if limit is not None and count > limit:
                return None
            rl = np.add.reduceat(plen, heads)
            src = (g.src[:, None] + ps[heads][None, :]).ravel()
            dst = (g.dst[:, None] + pd[heads][None, :]).ravel()
            parts.append((src, dst, np.broadcast_to(rl, (g.links, len(rl))).ravel()))
            continue
        src, dst, length = g.rows()
        link = np.repeat(np.arange(g.links), g.pieces)
        joins = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1]) & (link[1:] == link[:-1])
        heads = run_starts(joins)
        count += len(heads)
        if limit is not None and count > limit:
            return None
        parts.append((src[heads], dst[heads], np.add.reduceat(length, heads)))
    if not parts:
        e = np.empty(0, dtype=np.int64)
        return e, e, e
    return tuple(np.concatenate([p[i] for p in parts]).astype(np.int64) for i in range(3))  # type: ignore[return-value]


def scatter_grids(regions: Sequence[KVRegion], groups: BlockGroups, ratio: int, slot_addr: int) -> list[RowGrid]:
    """The rows that copy an image at ``slot_addr`` into D's blocks: per run of regions of one
    KV group (every layer at once), regions × the group's registered physical blocks."""
    from .blocks import physical_block_ids

    image = image_of(regions, groups, ratio)
    used = [(r, base) for r, base in zip(regions, image.bases, strict=True) if base >= 0]
    out: list[RowGrid] = []
    phys_of: dict[int, IndexArray] = {}
    start = 0
    while start < len(used):
        g = used[start][0].group
        end = start
        while end < len(used) and used[end][0].group == g:
            end += 1
        run = used[start:end]
        phys = phys_of.get(g)
        if phys is None:
            phys = phys_of[g] = np.asarray(physical_block_ids(groups[g], ratio), dtype=np.int64)
        blen = np.array([r.block_len for r, _ in run], dtype=np.int64)
        out.append(
            RowGrid(
                src=np.array([slot_addr + b for _, b in run], dtype=np.int64),
                src_stride=blen,
                dst=np.array([r.base_addr for r, _ in run], dtype=np.int64),
                dst_stride=np.array([r.stride for r, _ in run], dtype=np.int64),
                length=blen,
                src_block=np.arange(len(phys), dtype=np.int64),
                src_off=np.zeros(len(phys), dtype=np.int64),
                dst_block=phys,
                dst_off=np.zeros(len(phys), dtype=np.int64),
                piece_length=np.zeros(len(phys), dtype=np.int64),
            )
        )
        start = end
    return out


def scatter_rows(regions: Sequence[KVRegion], groups: BlockGroups, ratio: int, slot_addr: int) -> tuple[U64, U64, U64]:
    """(image address, block address, length) rows that copy an image into D's blocks."""
    src, dst, length = grid_rows(scatter_grids(regions, groups, ratio, slot_addr))
    return src.view(np.uint64), dst.view(np.uint64), length.view(np.uint64)  # never negative


def spans(offsets: IndexArray, lengths: IndexArray) -> tuple[IndexArray, IndexArray]:
    """Merge byte ranges into sorted, disjoint, maximal spans (offsets, lengths)."""
    if not len(offsets):
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    order = np.argsort(offsets, kind="stable")
    start = offsets[order]
    end = start + lengths[order]
    reach = np.maximum.accumulate(end)
    new = np.concatenate(([True], start[1:] > reach[:-1]))
    first = np.flatnonzero(new)
    last = np.concatenate((first[1:], [len(start)])) - 1
    s = start[first]
    return s.astype(np.int64), (reach[last] - s).astype(np.int64)


def chunked(offsets: IndexArray, lengths: IndexArray, chunk: int) -> list[tuple[IndexArray, IndexArray]]:
    """Split spans into groups of about ``chunk`` bytes each (spans are cut at boundaries)."""
    if chunk <= 0 or not len(offsets):
        return [(offsets, lengths)]
    out: list[tuple[IndexArray, IndexArray]] = []
    cur_o: list[int] = []
    cur_l: list[int] = []
    room = chunk
    for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
        while n > 0:
            take = min(n, room)
            cur_o.append(o)
            cur_l.append(take)
            o += take
            n -= take
            room -= take
            if room == 0:
                out.append((np.array(cur_o, dtype=np.int64), np.array(cur_l, dtype=np.int64)))
                cur_o, cur_l, room = [], [], chunk
    if cur_o:
        out.append((np.array(cur_o, dtype=np.int64), np.array(cur_l, dtype=np.int64)))
    return out
