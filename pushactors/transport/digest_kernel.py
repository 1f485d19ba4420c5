"""The digest of :mod:`pushactors.transport.digest` in one fused pass on a GPU (Triton).

One program per few pages of D's address space that a piece touches: it reads the piece's words
in those pages once, multiplies each by its word weight and its page's weight (computed in the
kernel from the region's mixed id), and adds the sum into its chunk's accumulator. Nothing is
gathered or written but the chunk sums, so the cost is one read of the pushed bytes; the host
work is a few vectorised passes over the pieces (not their pages) and one host→device copy of
their table.

Every piece must be 8-byte aligned at both ends (the KV of every layout vLLM uses is); the torch
path in :class:`~pushactors.transport.digest.KVDigest` handles the rest. Pieces from several
tensors are read through one base pointer (offsets in words from the first tensor), so every
source must lie 8-byte aligned relative to it. Triton is optional: without it, or on a CPU
(unless ``TRITON_INTERPRET=1``, which the tests use), :func:`available` says no.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

PAGE_SHIFT = 12  # as digest.PAGE_SHIFT (imported by the caller's checks, not here: no cycle)
PIECE_PAGES = 16  # pieces longer than this many pages are cut, so programs stay balanced
# Pages one program reads (a loop), and its warps: more work per program, fewer atomics.
PAGES_PER_PROGRAM = 4
NUM_WARPS = 8

_kernel: Any = None
_failed = False


def available(device: torch.device) -> bool:
    """Whether the fused pass runs for tensors on ``device``."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _load() is not None


def _load() -> Any:
    global _kernel, _failed
    if _kernel is not None or _failed:
        return _kernel
    try:
        _kernel = _build()
    except Exception:  # no Triton, or one too old for these ops: the torch path serves
        _failed = True
    return _kernel


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
    def digest_pages(base, weights, table, out, n, BLOCK: tl.constexpr, PAGES: tl.constexpr):  # type: ignore[no-untyped-def]
        # Program (piece, g) reads pages g*PAGES .. g*PAGES+PAGES-1 of D's address space that
        # the piece touches, a page of words at a time, and adds one sum into its chunk.
        piece = tl.program_id(0)
        src = tl.load(table + piece)  # words from ``base``
        dst = tl.load(table + n + piece)  # bytes from D's region base
        length = tl.load(table + 2 * n + piece)
        mixed = tl.load(table + 3 * n + piece)  # the region's mixed id
        chunk = tl.load(table + 4 * n + piece)
        lane = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for j in range(PAGES):
            page = (dst >> 12) + tl.program_id(1).to(tl.int64) * PAGES + j
            start = tl.maximum(dst, page << 12)
            end = tl.minimum(dst + length, (page + 1) << 12)
            inside = lane < ((end - start) >> 3)  # none when the piece ends before this page
            x = tl.load(base + src + ((start - dst) >> 3) + lane, mask=inside, other=0)
            w = tl.load(weights + ((start >> 3) & 511) + lane, mask=inside, other=0)
            z = (mixed ^ page).to(tl.uint64, bitcast=True)
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
            z = (z ^ (z >> 27)) * 0x94D049BB133111EB
            z = z ^ (z >> 31)
            acc += x * w * (z | 1).to(tl.int64, bitcast=True)
        tl.atomic_add(out + chunk, tl.sum(acc, axis=0))

    return digest_pages


def cut_pieces(src: I64, dst: U64, lengths: U64, rest: list[I64]) -> tuple[I64, U64, U64, list[I64]]:
    """Pieces cut at D's page boundaries into parts of at most :data:`PIECE_PAGES` pages, so no
    program of the grid reads much more than another. ``src``: each piece's first byte (signed,
    from any origin); ``rest``: per-piece columns carried along."""
    span = np.uint64(PIECE_PAGES << PAGE_SHIFT)
    first = dst // span
    last = (dst + lengths - np.uint64(1)) // span
    count = (last - first + np.uint64(1)).astype(np.intp)
    if np.all(count == 1):
        return src, dst, lengths, rest
    piece = np.repeat(np.arange(len(src)), count)
    k = (np.arange(len(piece)) - np.repeat(np.cumsum(count) - count, count)).astype(np.uint64)
    start = np.maximum(dst[piece], (first[piece] + k) * span)
    end = np.minimum(dst[piece] + lengths[piece], (first[piece] + k + np.uint64(1)) * span)
    moved = (start - dst[piece]).astype(np.int64)
    return src[piece] + moved, start, end - start, [c[piece] for c in rest]


class FusedPass:
    """One fused pass made ready: the pieces cut and their table on the device, so that running
    it is one launch and one read of its sums (built ahead, off a push's critical path)."""

    __slots__ = ("base", "chunks", "grid", "n", "pages_per", "table", "weights")

    def __init__(
        self,
        base: torch.Tensor,
        weights: torch.Tensor,
        table: torch.Tensor,
        n: int,
        grid: tuple[int, int],
        per: int,
        chunks: int,
    ) -> None:
        self.base, self.weights, self.table = base, weights, table
        self.n, self.grid, self.pages_per, self.chunks = n, grid, per, chunks

    @property
    def nbytes(self) -> int:
        """Device bytes its table holds."""
        return int(self.table.numel()) * 8

    def run(self) -> list[int]:
        """Per chunk, the signed 64-bit sum of the pieces' digests. Waits for the device."""
        import torch

        out = torch.zeros(self.chunks, dtype=torch.int64, device=self.base.device)
        _load()[self.grid](
            self.base, self.weights, self.table, out, self.n, BLOCK=512, PAGES=self.pages_per, num_warps=NUM_WARPS
        )
        sums: list[int] = out.tolist()
        return sums


def fused_pass(
    base: torch.Tensor,
    weights: torch.Tensor,
    src: I64,
    dst: U64,
    lengths: U64,
    mixed: I64,
    chunk: I64,
    chunks: int,
) -> FusedPass:
    """The pass over the pieces, made ready: ``src`` each piece's first byte counted from
    ``base`` (an int64 tensor), ``dst``/``lengths`` in bytes (``dst`` from its region's base;
    all three multiples of 8), ``mixed`` the page weights' region term."""
    import torch

    src, dst, lengths, (mixed, chunk) = cut_pieces(src, dst, lengths, [mixed, chunk])
    n = len(dst)
    table = np.empty((5, n), dtype=np.int64)
    table[0] = src >> 3  # in words (exact: every src is a multiple of 8)
    table[1] = dst.view(np.int64)
    table[2] = lengths.view(np.int64)
    table[3] = mixed
    table[4] = chunk
    on = torch.from_numpy(table.reshape(-1)).to(base.device)
    pages = int(((dst & np.uint64((1 << PAGE_SHIFT) - 1)) + lengths + np.uint64((1 << PAGE_SHIFT) - 1)).max())
    pages >>= PAGE_SHIFT
    per = max(1, min(PAGES_PER_PROGRAM, pages))
    return FusedPass(base, weights, on, n, (n, -(-pages // per)), per, chunks)
