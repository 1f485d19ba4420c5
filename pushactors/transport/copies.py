"""Device copies of many byte ranges at once, for staged pushes (gather on P, scatter on D).

Rows are (source address, destination address, length) inside memory torch owns (the KV
tensors and the staging buffer). Rows are batched per (source storage, destination storage,
length): both storages are viewed as ``[-1, unit]`` rows, where ``unit`` divides every offset
and the length of the batch, and one indexing kernel moves the whole batch. A side that is one
consecutive run (P's slot in a gather, D's image in a scatter) is a plain slice, not an index.
The same code runs on DRAM (torch CPU ops) and VRAM (a side CUDA stream, synchronised before
return).

The host work is what bounds a GPU gather (the kernels of a 512 MiB request take ~0.4 ms on an
H200), so it is vectorised over all rows: one sort (skipped when the rows come grouped, as a
staged push sends them), per-batch reductions with ``reduceat``, one host→device copy of every
index, and a Python loop that only slices and launches.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..core.rowgrid import RowGrid
from ..core.staging import grid_rows

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

# Rows proven inside a tensor together (ByteViews.locate): small enough that most groups of a
# layer's or a slot's rows lie in one tensor, large enough that the per-group work is small.
ROW_GROUP = 32


class ByteViews:
    """Flat ``uint8`` views of the storages behind some tensors, found by address."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        spans: dict[int, tuple[int, int, torch.Tensor]] = {}
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() in spans:
                continue
            flat = torch.empty(0, dtype=torch.uint8, device=t.device)
            flat.set_(st, 0, (st.nbytes(),), (1,))
            spans[st.data_ptr()] = (st.data_ptr(), st.nbytes(), flat)
        self.spans = sorted(spans.values(), key=lambda s: s[0])
        self.device = self.spans[0][2].device if self.spans else torch.device("cpu")
        self.bases = np.array([b for b, _, _ in self.spans], dtype=np.uint64)
        self.sizes = np.array([n for _, n, _ in self.spans], dtype=np.uint64)
        self._rows: dict[tuple[int, int], torch.Tensor] = {}
        self._elements: dict[int, torch.Tensor] = {}
        self._pinned: torch.Tensor | None = None
        # Seconds the last copy spent on the host before it waited for the device (all of it on
        # a CPU): the part of a staged copy's time that is not the kernels'.
        self.last_host_s = 0.0

    def locate(self, addrs: U64, lengths: U64) -> I64:
        """The span of each row ``[addr, addr + length)``; ValueError for a row not wholly inside
        one. Rows are proven a group at a time: a run of rows whose lowest start and highest end
        lie in one span all do (a staging slot is one group; a layer's blocks are a few). Only
        the rows of a group that straddles spans are searched one by one."""
        n = len(addrs)
        if not self.spans:
            raise ValueError("no registered tensors to copy between")
        if not n:
            return np.empty(0, dtype=np.int64)
        # Python ints: no uint64 wrap-around however long a row claims to be.
        top = int(addrs.max()) + int(lengths.max())
        lo = int(addrs.min())
        one = int(np.searchsorted(self.bases, lo, side="right")) - 1
        if one >= 0 and top <= int(self.bases[one]) + int(self.sizes[one]):
            return np.full(n, one, dtype=np.int64)
        if top >= 1 << 64 or n <= ROW_GROUP:
            return self._locate_rows(addrs, lengths)
        # No row's end wraps here (every end is at most top < 2**64).
        starts = np.arange(0, n, ROW_GROUP)
        first = np.minimum.reduceat(addrs, starts)
        last = np.maximum.reduceat(addrs + lengths, starts)
        which = np.searchsorted(self.bases, first, side="right").astype(np.int64) - 1
        inside = which >= 0
        k = np.where(inside, which, 0)
        inside &= last <= self.bases[k] + self.sizes[k]
        if inside.all():
            return np.repeat(which, ROW_GROUP)[:n]
        if 2 * np.count_nonzero(inside) < len(inside):  # mostly straddling: search every row
            return self._locate_rows(addrs, lengths)
        rows = np.repeat(which, ROW_GROUP)[:n]
        bad = np.repeat(~inside, ROW_GROUP)[:n]
        rows[bad] = self._locate_rows(addrs[bad], lengths[bad])
        return rows

    def _locate_rows(self, addrs: U64, lengths: U64) -> I64:
        """:meth:`locate` one row at a time."""
        which = np.searchsorted(self.bases, addrs, side="right").astype(np.int64) - 1
        below = which < 0  # before the first span
        which[below] = 0
        size = self.sizes[which]
        off = addrs - self.bases[which]  # wraps for rows below: caught by below
        outside = below | (off >= size)
        if outside.any():
            raise ValueError(f"address {int(addrs[outside][0]):#x} is outside the registered tensors")
        # 0 <= off < size here: comparing against size - length cannot wrap around.
        if not (np.all(lengths <= size) and np.all(off <= size - lengths)):
            raise ValueError("a row runs past the end of its tensor")
        return which

    def pinned(self, n: int) -> torch.Tensor:
        """``n`` int64 of page-locked host memory for a row table (reused: every copy
        synchronises before it returns, so the last one's table is no longer read)."""
        buf = self._pinned
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 1 << 12), dtype=torch.int64, pin_memory=True)
            self._pinned = buf
        return buf[:n]

    def elements(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        """The first span as one flat tensor of ``size``-byte elements (the fused kernel's base)."""
        view = self._elements.get(size)
        if view is None:
            flat = self.spans[0][2]
            view = self._elements[size] = flat[: flat.numel() // size * size].view(dtype)
        return view

    def rows(self, span: int, unit: int) -> torch.Tensor:
        """Span ``span`` as rows of ``unit`` bytes, in the widest element that divides them
        (indexing kernels move one element per thread: int64 moves 8x the bytes of uint8)."""
        view = self._rows.get((span, unit))
        if view is None:
            flat = self.spans[span][2]
            body = flat[: (flat.numel() // unit) * unit]
            if unit % 8 == 0 and flat.data_ptr() % 8 == 0:
                view = body.view(torch.int64).view(-1, unit // 8)
            else:
                view = body.view(-1, unit)
            self._rows[(span, unit)] = view
        return view


def copy_rows(views: ByteViews, src: U64, dst: U64, lengths: U64, stream: Any = None) -> int:
    """Copy every row; returns the bytes copied. Raises ValueError for a row outside the views."""
    n = len(src)
    started = time.monotonic()
    views.last_host_s = 0.0
    if not n:
        return 0
    # Addresses in uint64 whatever the caller built them in (no copy when they already are).
    src, dst, lengths = (np.asarray(a, dtype=np.uint64) for a in (src, dst, lengths))
    bases = views.bases
    si, di = views.locate(src, lengths), views.locate(dst, lengths)
    if views.device.type == "cuda" and FUSED and _fused_launch(views, src, dst, lengths, stream):
        views.last_host_s = time.monotonic() - started
        # The pinned row table is reused: the kernel must have read it before the next copy.
        if stream is not None:
            stream.synchronize()
        else:
            torch.cuda.synchronize(views.device)
        return int(lengths.sum())
    soff = (src - bases[si]).astype(np.int64)
    doff = (dst - bases[di]).astype(np.int64)
    length = lengths.astype(np.int64)
    # Batches: rows of one (source span, destination span, length), in their order. Rows of a
    # staged push arrive grouped already; anything else is sorted once.
    key = (si * len(bases) + di) * (int(length.max()) + 1) + length
    if n > 1 and bool(np.any(key[1:] < key[:-1])):
        order = np.argsort(key, kind="stable")
        key, soff, doff, length = key[order], soff[order], doff[order], length[order]
    starts = np.concatenate(([0], np.flatnonzero(key[1:] != key[:-1]) + 1))
    counts = np.diff(np.append(starts, n))
    unit = np.gcd(np.gcd.reduceat(soff, starts), np.gcd(np.gcd.reduceat(doff, starts), length[starts]))
    unit = np.maximum(unit, 1)
    # A side whose rows follow each other without a gap is one slice.
    step_s = np.ones(n, dtype=bool)
    step_d = np.ones(n, dtype=bool)
    if n > 1:
        step_s[1:] = soff[1:] - soff[:-1] == length[:-1]
        step_d[1:] = doff[1:] - doff[:-1] == length[:-1]
    step_s[starts] = True
    step_d[starts] = True
    s_run = np.logical_and.reduceat(step_s, starts)
    d_run = np.logical_and.reduceat(step_d, starts)
    row_unit = np.repeat(unit, counts)
    per = length[starts] // unit
    sq, dq = soff // row_unit, doff // row_unit
    # Every index any batch needs, in one array: [source rows | destination rows] per batch.
    pieces: list[I64] = []
    slots: list[tuple[int, int]] = []  # (where its source index starts, where its destination's does); -1: a slice
    at = 0
    for b, (s0, c) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        p = int(per[b])
        where = [-1, -1]
        for side, (q, run) in enumerate(((sq, s_run), (dq, d_run))):
            if run[b]:
                continue
            rows = q[s0 : s0 + c]
            idx = rows if p == 1 else (rows[:, None] + np.arange(p, dtype=np.int64)).ravel()
            pieces.append(idx)
            where[side] = at
            at += len(idx)
        slots.append((where[0], where[1]))
    pair = key[starts] // (int(length.max()) + 1)
    s_span, d_span = pair // len(bases), pair % len(bases)
    device = views.device
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        indices: Any = None
        if pieces:
            host = torch.from_numpy(np.concatenate(pieces) if len(pieces) > 1 else pieces[0])
            indices = host if device.type == "cpu" else host.to(device, non_blocking=True)
        for b, (s0, c) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
            u, p = int(unit[b]), int(per[b])
            sview, dview = views.rows(int(s_span[b]), u), views.rows(int(d_span[b]), u)
            s_at, d_at = slots[b]
            sidx = indices[s_at : s_at + c * p] if s_at >= 0 else None
            didx = indices[d_at : d_at + c * p] if d_at >= 0 else None
            s_first, d_first = int(sq[s0]), int(dq[s0])
            _copy_batch(sview, dview, c * p, s_first, sidx, d_first, didx, per=p)
    views.last_host_s = time.monotonic() - started
    if stream is not None:
        stream.synchronize()
    return int(lengths.sum())


class GridCopy:
    """A copy of every row of some grids, made ready to run: on a GPU with Triton, each grid's
    table on the device and its launch worked out (running it is a launch per grid); elsewhere,
    or when a link's rows cannot be proven inside one tensor at once, the rows built on the host
    for :func:`copy_rows`. Made ahead of time (D's scatter, while P still prefills), running it
    costs a launch instead of the checks, the table and its host→device copy."""

    def __init__(self, views: ByteViews, nbytes: int) -> None:
        self.views = views
        self.nbytes = nbytes
        self.rows: tuple[U64, U64, U64] | None = None  # the host path
        self.launches: list[tuple[Any, int, int, tuple[int, int], int]] = []  # table, K, J, grid, block
        self.elem: tuple[int, torch.dtype, int] = (1, torch.uint8, 1)  # element size, dtype, VEC

    @property
    def footprint(self) -> int:
        """Bytes this copy holds while it waits to run: the host's rows, or the device's
        tables (slices of one buffer per prepare, counted by their own size)."""
        if self.rows is not None:
            return sum(int(a.nbytes) for a in self.rows)
        return sum(int(t.numel()) * int(t.element_size()) for t, *_ in self.launches)

    def run(self, stream: Any = None) -> int:
        """Copy every row (the device's part synchronised before return); the bytes copied.
        ``views.last_host_s``: the part of it spent on the host."""
        started = time.monotonic()
        if self.rows is not None:
            return copy_rows(self.views, *self.rows, stream)
        if self.launches:
            _launch_only(self, stream)
            self.views.last_host_s = time.monotonic() - started
            _settle(self.views, stream)
        return self.nbytes


def prepare_grids(views: ByteViews, grids: Sequence[RowGrid], stream: Any = None, *, settle: bool = False) -> GridCopy:
    """:class:`GridCopy` of ``grids``; ValueError for a grid that fails :meth:`RowGrid.check`.
    A row outside the views is refused (nothing moved) here on the device path, when run on the
    host path. ``settle``: wait for the tables' host→device copy, so the copy may run long after
    (the pinned buffer they came from is reused by the next copy)."""
    grids = [g for g in grids if len(g)]
    out = GridCopy(views, sum(g.nbytes for g in grids))
    if not grids:
        return out
    if views.device.type == "cuda" and FUSED and _grid_tables(views, grids, stream, out):
        if settle:
            if stream is not None:
                stream.synchronize()
            else:
                torch.cuda.synchronize(views.device)
        return out
    src, dst, lengths = (a.view(np.uint64) for a in grid_rows(grids))  # never negative (checked)
    out.rows = (src, dst, lengths)
    return out


def copy_grids(views: ByteViews, grids: Sequence[RowGrid], stream: Any = None) -> int:
    """Copy every row of ``grids``; returns the bytes copied. Raises ValueError for a row outside
    the views. On a GPU with Triton each grid is one launch that builds its rows on the device
    from the grid's links and pieces; elsewhere, or when a link's rows cannot be proven inside
    one tensor at once, the rows are built here and go through :func:`copy_rows`."""
    started = time.monotonic()
    views.last_host_s = 0.0
    prepared = prepare_grids(views, grids, stream)
    built = time.monotonic() - started
    n = prepared.run(stream)
    views.last_host_s += built
    return n


def _launch_only(prepared: GridCopy, stream: Any) -> None:
    elem, dtype, vec = prepared.elem
    flat = prepared.views.elements(elem, dtype)
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        for table, links, pieces, launch, block in prepared.launches:
            _GRID_KERNEL[launch](flat, table, links, pieces, BLOCK=block, VEC=vec, num_warps=NUM_WARPS)


def _settle(views: ByteViews, stream: Any) -> None:
    if stream is not None:
        stream.synchronize()
    else:
        torch.cuda.synchronize(views.device)


def _copy_batch(
    sview: torch.Tensor, dview: torch.Tensor, rows: int, s_first: int, sidx: Any, d_first: int, didx: Any, *, per: int
) -> None:
    """Move ``rows`` unit-rows from ``sview`` to ``dview``; a side without an index is the
    slice starting at its ``first`` row."""
    row_bytes = per * dview.shape[1] * dview.element_size()
    cpu_scatter = dview.device.type == "cpu" and didx is not None and row_bytes >= 4096
    if rows <= 4 * per or cpu_scatter:
        # Few rows, or a scatter on CPU, where index_copy_ runs ~10x below memcpy speed: copy
        # row by row (one memcpy each).
        src = list(range(s_first, s_first + rows, per)) if sidx is None else sidx[::per].tolist()
        dst = list(range(d_first, d_first + rows, per)) if didx is None else didx[::per].tolist()
        for s, d in zip(src, dst, strict=True):
            dview[d : d + per].copy_(sview[s : s + per], non_blocking=True)
        return
    if didx is None:
        out = dview[d_first : d_first + rows]
        if sidx is None:
            out.copy_(sview[s_first : s_first + rows], non_blocking=True)
        else:
            torch.index_select(sview, 0, sidx, out=out)  # a gather into one run
        return
    source = sview[s_first : s_first + rows] if sidx is None else sview.index_select(0, sidx)
    dview.index_copy_(0, didx, source)  # from one run (D's image into its blocks): no temporary


# GPU rows go through one fused kernel (below) when Triton is there; tests turn it off to
# cover the torch path on a GPU too.
FUSED = True
_KERNEL: Any = None  # built on first use; False once Triton turned out to be missing
_GRID_KERNEL: Any = None
_ELEMENTS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
BLOCK_BYTES = 16 << 10  # bytes one program moves (at most: a shorter longest row uses less)
NUM_WARPS = 4


def fused_available() -> bool:
    """Whether the fused copy kernels can run here (Triton imports); built on first ask. Rows
    of a CUDA tensor go through them while :data:`FUSED` is on."""
    return _kernel() is not False


def _kernel() -> Any:
    global _KERNEL, _GRID_KERNEL
    if _KERNEL is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _KERNEL = False
            return _KERNEL

        @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
        def copy_rows_kernel(base, table, n_rows, BLOCK: tl.constexpr, VEC: tl.constexpr):  # type: ignore[no-untyped-def]
            # Program (row, part) moves elements [part*BLOCK, (part+1)*BLOCK) of one row. The
            # table holds every row's source, then every destination, then every length, as
            # element offsets from ``base`` (any registered tensor: the KV tensors and the
            # staging buffer are separate allocations, so an offset may be negative). VEC:
            # every offset and length is a multiple of VEC elements (16 bytes), so loads and
            # stores may be 16 bytes wide.
            row = tl.program_id(0)
            start = tl.program_id(1) * BLOCK
            n = tl.multiple_of(tl.load(table + 2 * n_rows + row), VEC)
            if start < n:
                s = tl.multiple_of(tl.load(table + row), VEC)
                d = tl.multiple_of(tl.load(table + n_rows + row), VEC)
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(base + d + offs, tl.load(base + s + offs, mask=mask), mask=mask)

        @triton.jit  # type: ignore[misc,untyped-decorator,unused-ignore]
        def copy_grid_kernel(base, table, n_links, n_pieces, BLOCK: tl.constexpr, VEC: tl.constexpr):  # type: ignore[no-untyped-def]
            # Program (row, part) of a RowGrid, row = link * n_pieces + piece. The table holds
            # the links' (source, source stride, destination, destination stride, length) as
            # five columns of n_links, then the pieces' (source block, source offset,
            # destination block, destination offset, length) as five of n_pieces; everything
            # but the blocks is in elements from ``base``.
            row = tl.program_id(0)
            k = row // n_pieces
            j = row - k * n_pieces
            start = tl.program_id(1) * BLOCK
            pieces = table + 5 * n_links
            n = tl.multiple_of(tl.load(table + 4 * n_links + k) + tl.load(pieces + 4 * n_pieces + j), VEC)
            if start < n:
                s = (
                    tl.load(table + k)
                    + tl.load(table + n_links + k) * tl.load(pieces + j)
                    + tl.load(pieces + n_pieces + j)
                )
                d = (
                    tl.load(table + 2 * n_links + k)
                    + tl.load(table + 3 * n_links + k) * tl.load(pieces + 2 * n_pieces + j)
                    + tl.load(pieces + 3 * n_pieces + j)
                )
                s = tl.multiple_of(s, VEC)
                d = tl.multiple_of(d, VEC)
                offs = start + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(base + d + offs, tl.load(base + s + offs, mask=mask), mask=mask)

        _KERNEL = copy_rows_kernel
        _GRID_KERNEL = copy_grid_kernel
    return _KERNEL


def _fused_launch(views: ByteViews, src: U64, dst: U64, lengths: U64, stream: Any) -> bool:
    """Every row in one kernel launch, whatever tensors they join: the host work is a few
    vector operations and one host→device copy of (source, destination, length) per row,
    instead of one launch per (tensor pair, length). Returns once launched (the caller
    waits); False when Triton is not installed."""
    kernel = _kernel()
    if kernel is False:
        return False
    base_t = views.spans[0][2]
    base = np.uint64(base_t.data_ptr())
    # Offsets from the base may be negative: take them as signed, modulo 2**64.
    soff = (src - base).view(np.int64)
    doff = (dst - base).view(np.int64)
    length = lengths.view(np.int64)  # every length fits a tensor (locate proved it)
    # The widest power-of-two alignment every offset and length shares (lowest set bit of
    # their OR), capped at 16 bytes: the element the kernel moves, and whether it may move 16.
    bits = int(np.bitwise_or.reduce(soff | doff | length))
    bits |= base_t.data_ptr()
    common = min(16, (bits | 16) & -(bits | 16))
    elem, dtype = next((e, t) for e, t in _ELEMENTS if common % e == 0)
    vec = 16 // elem if common == 16 else 1
    n = len(src)
    host = views.pinned(3 * n)
    table = host.numpy().reshape(3, n)
    shift = elem.bit_length() - 1  # elements are 1, 2, 4 or 8 bytes: a shift divides (negatives too)
    np.right_shift(soff, shift, out=table[0])
    np.right_shift(doff, shift, out=table[1])
    np.right_shift(length, shift, out=table[2])
    longest = int(table[2].max())
    block = max(vec, min(BLOCK_BYTES // elem, 1 << max(0, longest - 1).bit_length()))
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        table_dev = host.to(views.device, non_blocking=True)
        grid = (n, -(-longest // block))
        kernel[grid](views.elements(elem, dtype), table_dev, n, BLOCK=block, VEC=vec, num_warps=NUM_WARPS)
    return True


def _grid_bounds(grid: RowGrid, side: str) -> tuple[I64, I64]:
    """Per link, the lowest start and highest end of its rows on one side. The grid is checked
    first (:meth:`RowGrid.check`: no negative term, every end within int64), so nothing here
    can wrap around."""
    base, stride, block, off = (
        (grid.src, grid.src_stride, grid.src_block, grid.src_off)
        if side == "src"
        else (grid.dst, grid.dst_stride, grid.dst_block, grid.dst_off)
    )
    lo = base + stride * int(block.min()) + int(off.min())
    hi = base + stride * int(block.max()) + int((off + grid.piece_length).max()) + grid.length
    return lo, hi


def _grid_tables(views: ByteViews, grids: Sequence[RowGrid], stream: Any, out: GridCopy) -> bool:
    """Every grid's table on the device and its launch, into ``out``. ValueError (nothing
    prepared) for a grid that fails :meth:`RowGrid.check`; False (nothing prepared) when
    Triton is missing or a link's rows are not proven inside one tensor at once: every
    row of a link lies between its lowest start and highest end, so that range inside one
    tensor proves them all."""
    if _kernel() is False:
        return False
    base_t = views.spans[0][2]
    base = base_t.data_ptr()
    bits = base
    for g in grids:
        g.check()  # ValueError for a row that cannot exist, before anything is launched
        for side in ("src", "dst"):
            lo, hi = _grid_bounds(g, side)
            try:
                views.locate(lo.view(np.uint64), (hi - lo).view(np.uint64))
            except ValueError:
                return False
        for a in (g.src - base, g.dst - base):
            bits |= int(np.bitwise_or.reduce(a))
        for a in (g.src_stride, g.dst_stride, g.length, g.src_off, g.dst_off, g.piece_length):
            bits |= int(np.bitwise_or.reduce(a))
    common = min(16, (bits | 16) & -(bits | 16))
    elem, dtype = next((e, t) for e, t in _ELEMENTS if common % e == 0)
    vec = 16 // elem if common == 16 else 1
    shift = elem.bit_length() - 1
    sizes = [5 * (g.links + g.pieces) for g in grids]
    host = views.pinned(sum(sizes))
    table = host.numpy()
    at = 0
    for g in grids:
        k, j = g.links, g.pieces
        cols = (
            (g.src - base) >> shift,
            g.src_stride >> shift,
            (g.dst - base) >> shift,
            g.dst_stride >> shift,
            g.length >> shift,
            g.src_block,
            g.src_off >> shift,
            g.dst_block,
            g.dst_off >> shift,
            g.piece_length >> shift,
        )
        for c, col in enumerate(cols):
            width = k if c < 5 else j
            start = at + (c * k if c < 5 else 5 * k + (c - 5) * j)
            table[start : start + width] = col
        at += 5 * (k + j)
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        dev = host.to(views.device, non_blocking=True)
    out.elem = (elem, dtype, vec)
    at = 0
    for g, size in zip(grids, sizes, strict=True):
        longest = (int(g.length.max()) + int(g.piece_length.max())) >> shift
        block = max(vec, min(BLOCK_BYTES // elem, 1 << max(0, longest - 1).bit_length()))
        out.launches.append((dev[at : at + size], g.links, g.pieces, (len(g), -(-longest // block)), block))
        at += size
    return True


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
