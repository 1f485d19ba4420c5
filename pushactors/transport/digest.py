"""Digests of pushed KV bytes (docs/protocol.md, "Verified push"): one pass where the bytes are.

The digest of a set of bytes is defined over D's memory, the place the bytes are read from:
a byte's place is (its D region r, its offset o from the region's base), and

    digest = sum over every byte b at (r, o) of  W(r, o & ~7) * (b << 8 * (o & 7))   mod 2^64

with ``W(r, w) = (f(f(r + 1) ^ (w >> 12)) | 1) * V[(w >> 3) & 511]``, ``f`` splitmix64's
finalizer and ``V`` 512 fixed odd words: an odd weight per 8-byte word of each region, the
product of its 4 KiB page's (counted from the region's base, so blocks whose stride is a multiple
of 4 KiB start on a page) and its place in the page. For aligned words it is the sum of
``W * word`` (little-endian). It is additive, so P's ranks each digest what they wrote (reading
their own source bytes, weighing each by the place it lands at) and D checks the sum of their
digests against one pass over its blocks, whatever the layouts and TP sizes. Every single
changed byte changes it (an odd weight times a nonzero value below 2^64 is nonzero mod 2^64); a
block or head slice that lands in the wrong place, or stale content, changes it unless 64-bit
pseudo-random weights happen to cancel.

Sums are kept per *chunk* of D's regions (at most :data:`VERIFY_CHUNKS`, contiguous in D's
region order), with the bytes each covers: a mismatch names its layers, and D verifies only
when P's pieces cover exactly the bytes it digests.

On a GPU with Triton the sums are one fused pass (:mod:`.digest_kernel`): each byte is read
once. Elsewhere the arithmetic runs in torch int64 (wrapping) on the tensors' device: one
gather and a few elementwise passes per batch of words, never a copy of the whole request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..core.blocks import KVRegion
from . import digest_kernel

if TYPE_CHECKING:
    import torch

    from .copies import ByteViews

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

VERIFY_CHUNKS = 8  # chunks of D's regions per digest (fewer when D has fewer regions)
BATCH_WORDS = 1 << 22  # words per pass (32 MiB): bounds the temporaries, not the request
PAGE_SHIFT = 12  # weights are a page's times a word's within it: 4 KiB pages of 512 words
PAGE_BYTES = 1 << PAGE_SHIFT
PAGE_WORDS = PAGE_BYTES // 8
MASK64 = (1 << 64) - 1
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64's multipliers, as int64
_C2 = 0x94D049BB133111EB - (1 << 64)

Digest = tuple[tuple[int, int], ...]  # per chunk: (sum mod 2^64, bytes covered)


class DigestError(ValueError):
    """Bytes that cannot be digested here (outside the registered tensors)."""


def chunk_count(regions: int) -> int:
    return max(1, min(VERIFY_CHUNKS, regions))


def region_chunks(regions: int) -> I64:
    """The chunk of each of D's regions: contiguous runs in region order."""
    n = chunk_count(regions)
    return (np.arange(regions, dtype=np.int64) * n) // max(1, regions)


def locate_regions(regions: Sequence[KVRegion], addrs: U64) -> I64:
    """The index of the region holding each address (a byte inside one of its blocks), -1 for
    none. Regions that interleave (K and V halves of one allocation) are told apart by the
    offset inside the stride."""
    out = np.full(len(addrs), -1, dtype=np.int64)
    a = addrs.astype(np.uint64, copy=False)
    for i, r in enumerate(regions):
        base = np.uint64(r.base_addr)
        inside = (a >= base) & (a < base + np.uint64(r.stride * r.num_blocks))
        inside &= ((a - base) % np.uint64(r.stride)) < np.uint64(r.block_len)
        out[inside & (out < 0)] = i
    return out


def region_offsets(regions: Sequence[KVRegion], addrs: U64, owner: I64) -> U64:
    """Each address's offset from the base of its region (``owner``, as :func:`locate_regions`)."""
    bases = np.array([r.base_addr for r in regions], dtype=np.uint64)
    return addrs - bases[owner]


def block_pieces(
    regions: Sequence[KVRegion], block_groups: Sequence[Sequence[int]], ratio: int
) -> tuple[U64, U64, I64]:
    """D's side: (address, length, region) of every physical block of ``block_groups`` (logical
    ids per KV group, ``ratio`` physical per logical) in every region of its group, region by
    region. Vectorised per group: a request's ids are converted once, not once per layer."""
    addrs: list[U64] = []
    lens: list[U64] = []
    owner: list[I64] = []
    group_of = np.array([r.group for r in regions], dtype=np.int64)
    bases = np.array([r.base_addr for r in regions], dtype=np.uint64)
    strides = np.array([r.stride for r in regions], dtype=np.uint64)
    block_lens = np.array([r.block_len for r in regions], dtype=np.uint64)
    for g in np.unique(group_of):
        if g >= len(block_groups) or not len(block_groups[g]):
            continue
        logical = np.asarray(block_groups[g], dtype=np.uint64)
        phys = (logical[:, None] * np.uint64(ratio) + np.arange(ratio, dtype=np.uint64)[None, :]).ravel()
        regs = np.flatnonzero(group_of == g)
        addrs.append((bases[regs][:, None] + phys[None, :] * strides[regs][:, None]).ravel())
        lens.append(np.repeat(block_lens[regs], len(phys)))
        owner.append(np.repeat(regs.astype(np.int64), len(phys)))
    if not addrs:
        return np.empty(0, np.uint64), np.empty(0, np.uint64), np.empty(0, np.int64)
    if len(owner) == 1:
        return addrs[0], lens[0], owner[0]
    all_owner = np.concatenate(owner)
    order = np.argsort(all_owner, kind="stable")  # region by region, as the regions come
    return np.concatenate(addrs)[order], np.concatenate(lens)[order], all_owner[order]


class PreparedSums:
    """A digest's pieces made ready (:meth:`KVDigest.prepare`): run it once the bytes are final."""

    __slots__ = ("fused", "nbytes", "pieces", "size")

    def __init__(
        self,
        nbytes: tuple[int, ...],
        fused: digest_kernel.FusedPass | None,
        pieces: tuple[U64, I64, U64, U64, I64] | None,
        size: int,
    ) -> None:
        self.nbytes = nbytes  # bytes covered, per chunk
        self.fused = fused
        self.pieces = pieces  # for the torch path
        self.size = size  # bytes it holds (its table on the device, or its pieces)


class KVDigest:
    """Digests over one rank's KV tensors (:class:`~pushactors.transport.copies.ByteViews`)."""

    def __init__(self, views: ByteViews) -> None:
        self.views = views
        self._words: dict[int, torch.Tensor] = {}
        self._v: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None  # gathered words, reused batch after batch
        # One fused pass where a GPU and Triton allow it (tests turn it off to compare paths).
        self.fused = True

    def sums(self, src: U64, region: I64, dst: U64, lengths: U64, chunk: I64, chunks: int) -> Digest:
        """Per chunk, (digest, bytes) of the pieces ``[src, src + length)`` of this rank's memory
        as they land in D's ``region`` at offset ``dst`` from its base. ``chunk`` gives each
        piece's chunk, below ``chunks``. Waits for the device: the result is on the host."""
        return self.run(self.prepare(src, region, dst, lengths, chunk, chunks))

    def prepare(self, src: U64, region: I64, dst: U64, lengths: U64, chunk: I64, chunks: int) -> PreparedSums:
        """:meth:`sums` made ready to :meth:`run` later: the pieces checked (DigestError for one
        outside this rank's tensors) and, for the fused pass, cut and on the device, so that
        what is left is one launch. The bytes are read when it runs, not now."""
        nbytes = tuple(round(n) for n in np.bincount(chunk, weights=lengths.astype(np.float64), minlength=chunks))
        if not len(src):
            return PreparedSums(nbytes, None, None, 0)
        try:
            self.views.locate(src, lengths)
        except ValueError as exc:
            raise DigestError(str(exc)) from None
        fused = self._fused(src, region, dst, lengths, chunk, chunks)
        if fused is not None:
            return PreparedSums(nbytes, fused, None, fused.nbytes)
        pieces = (src, region, dst, lengths, chunk)
        return PreparedSums(nbytes, None, pieces, sum(int(p.nbytes) for p in pieces))

    def run(self, prepared: PreparedSums) -> Digest:
        """The sums of :meth:`prepare`'s pieces as the bytes are now. Waits for the device."""
        nbytes = prepared.nbytes
        if prepared.fused is not None:
            values = prepared.fused.run()
        elif prepared.pieces is not None:
            values = self._torch_sums(*prepared.pieces, len(nbytes))
        else:
            values = [0] * len(nbytes)
        return tuple((v & MASK64, n) for v, n in zip(values, nbytes, strict=True))

    def _torch_sums(self, src: U64, region: I64, dst: U64, lengths: U64, chunk: I64, chunks: int) -> list[int]:
        import torch

        span = self.views.locate(src, lengths)
        # Cut pieces where D's pages begin: each part then has one page weight.
        src, dst, lengths, piece = _split_at_pages(src, dst, lengths)
        span, chunk = span[piece], chunk[piece]
        # Each part's page weight, made from its region and its page there.
        page = _mix_np(_mix_np(region[piece].astype(np.uint64) + np.uint64(1)) ^ (dst >> np.uint64(PAGE_SHIFT)))
        device = self.views.device
        per_part = torch.zeros(len(src), dtype=torch.int64, device=device)
        for s in np.unique(span):
            base, _, flat = self.views.spans[int(s)]
            off = src - np.uint64(base)
            aligned = (off % np.uint64(8) == 0) & (dst % np.uint64(8) == 0) & (lengths % np.uint64(8) == 0)
            aligned &= flat.data_ptr() % 8 == 0
            in_span = span == s
            for width, rows_of in ((8, in_span & aligned), (1, in_span & ~aligned)):
                rows = np.flatnonzero(rows_of)
                data = self._view(int(s), flat) if width == 8 else flat
                units = lengths[rows] // np.uint64(width)
                # Parts of one length (and, aligned, one first word in their page) at a time, as
                # rows of a matrix whose row sums are theirs: their word weights are one row.
                word = (dst[rows] >> np.uint64(3)) & np.uint64(PAGE_WORDS - 1) if width == 8 else 0 * units
                key = units * np.uint64(PAGE_WORDS) + word
                for k in np.unique(key):
                    same = rows[key == k]
                    n = int(k) // PAGE_WORDS
                    step = max(1, BATCH_WORDS // n)
                    for i in range(0, len(same), step):
                        part = same[i : i + step]
                        sums = self._row_sums(data, off[part] // np.uint64(width), dst[part], n, width)
                        sums *= torch.from_numpy((page[part] | np.uint64(1)).view(np.int64)).to(device)
                        per_part[torch.from_numpy(part).to(device)] = sums
        acc = torch.zeros(chunks, dtype=torch.int64, device=device)
        acc.index_add_(0, torch.from_numpy(np.ascontiguousarray(chunk, dtype=np.int64)).to(device), per_part)
        values: list[int] = acc.tolist()
        return values

    def _fused(
        self, src: U64, region: I64, dst: U64, lengths: U64, chunk: I64, chunks: int
    ) -> digest_kernel.FusedPass | None:
        """The sums as one fused pass (a GPU with Triton), made ready, or None where it does not
        apply: no kernel, or a piece not 8-byte aligned (read through the torch path below)."""
        device = self.views.device
        if not self.fused or not digest_kernel.available(device):
            return None
        origin, _, flat = self.views.spans[0]
        rel = src.astype(np.int64) - np.int64(origin)  # user-space addresses fit int64
        if np.any((rel | dst.view(np.int64) | lengths.view(np.int64)) & 7) or flat.data_ptr() % 8:
            return None
        # The page weights' region term, mixed once per region, not once per piece.
        mixed = _mix_np(np.arange(1, int(region.max()) + 2, dtype=np.uint64)).view(np.int64)[region]
        return digest_kernel.fused_pass(
            self._view(0, flat), self._word_weights(device), rel, dst, lengths, mixed, chunk, chunks
        )

    def _row_sums(self, data: torch.Tensor, first: U64, dst: U64, units: int, width: int) -> torch.Tensor:
        """The sum of each part, weighed by place in its page: ``units`` units of ``width`` bytes
        from unit ``first`` of ``data``, landing at offset ``dst`` of D's region, inside one
        page; one row per part."""
        import torch

        device = data.device
        starts = first.astype(np.int64)
        if width == 8 and np.all(np.diff(starts) == units):
            # One run (blocks in order): read in place, never copied first (nor written).
            x = data[int(starts[0]) : int(starts[0]) + len(starts) * units].view(len(starts), units)
            ours = False
        else:
            ours = True
            # Gather in rows as wide as every part's start and length allow: a small index.
            g = int(np.gcd.reduce(np.append(starts, units)))
            rows = data[: data.numel() // g * g].view(-1, g)
            step = torch.arange(units // g, dtype=torch.int64, device=device)
            idx = torch.from_numpy(starts // g).to(device)[:, None] + step[None, :]
            if width == 8:
                # Into a buffer kept for it: a fresh one each time costs its page faults on a CPU.
                out = self._scratch(len(first) * units, device)
                x = torch.index_select(rows, 0, idx.view(-1), out=out.view(-1, g)).view(len(first), units)
            else:
                x = rows.index_select(0, idx.view(-1)).view(len(first), units).to(torch.int64)
        word = (dst >> np.uint64(3)) & np.uint64(PAGE_WORDS - 1)  # the first unit's word in its page
        v = self._word_weights(device)
        if width == 8:
            w0 = int(word[0])  # the same for every part here (sums groups them so)
            if device.type == "cpu":
                return x @ v[w0 : w0 + units]  # one pass, nothing written (no int64 matmul on CUDA)
            if ours:
                x *= v[w0 : w0 + units]
            else:
                x = x * v[w0 : w0 + units]  # ``x`` is the KV itself: never written
        else:
            at = torch.from_numpy(word.astype(np.int64)).to(device)[:, None]
            lane = torch.arange(units, dtype=torch.int64, device=device)[None, :]
            shift = torch.from_numpy((dst & np.uint64(7)).astype(np.int64)).to(device)[:, None] + lane
            x <<= (shift & 7) * 8
            x *= v[at + (shift >> 3)]
        return x.sum(dim=1)

    def _scratch(self, words: int, device: torch.device) -> torch.Tensor:
        import torch

        buf = self._buf
        if buf is None or buf.numel() < words:
            buf = self._buf = torch.empty(max(words, BATCH_WORDS), dtype=torch.int64, device=device)
        return buf[:words]

    def _word_weights(self, device: torch.device) -> torch.Tensor:
        import torch

        if self._v is None:
            self._v = torch.tensor(
                [_signed(word_weight(i)) for i in range(PAGE_WORDS)], dtype=torch.int64, device=device
            )
        return self._v

    def _view(self, span: int, flat: torch.Tensor) -> torch.Tensor:
        import torch

        view = self._words.get(span)
        if view is None:
            view = self._words[span] = flat[: flat.numel() // 8 * 8].view(torch.int64)
        return view


def _split_at_pages(src: U64, dst: U64, lengths: U64) -> tuple[U64, U64, U64, npt.NDArray[np.intp]]:
    """Pieces cut where a page of D's address space begins: (src, dst, length, piece of each)."""
    page = np.uint64(PAGE_BYTES)
    first = dst // page
    last = (dst + lengths - np.uint64(1)) // page
    count = (last - first + np.uint64(1)).astype(np.intp)
    if np.all(count == 1):
        return src, dst, lengths, np.arange(len(src))
    piece = np.repeat(np.arange(len(src)), count)
    k = (np.arange(len(piece)) - np.repeat(np.cumsum(count) - count, count)).astype(np.uint64)
    start = np.maximum(dst[piece], (first[piece] + k) * page)
    end = np.minimum(dst[piece] + lengths[piece], (first[piece] + k + np.uint64(1)) * page)
    return src[piece] + (start - dst[piece]), start, end - start, piece


def _mix_np(z: U64) -> U64:
    """splitmix64's finalizer on uint64 arrays (wrapping)."""
    with np.errstate(over="ignore"):
        z = z ^ (z >> np.uint64(30))
        z = z * np.uint64(0xBF58476D1CE4E5B9)
        z = z ^ (z >> np.uint64(27))
        z = z * np.uint64(0x94D049BB133111EB)
        out: U64 = z ^ (z >> np.uint64(31))
        return out


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def mix64(z: int) -> int:
    """splitmix64's finalizer, in Python ints."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def word_weight(word: int) -> int:
    """The odd weight of word ``word`` (0-511) of any page."""
    return mix64((word + 1) * 0x9E3779B97F4A7C15) | 1


def weight(region: int, offset: int) -> int:
    """``W`` of the 8-byte word at ``offset`` of D's region ``region`` (tests and references)."""
    page = mix64(mix64(region + 1) ^ (offset >> PAGE_SHIFT)) | 1
    return (page * word_weight((offset >> 3) & (PAGE_WORDS - 1))) & MASK64


def reference_digest(data: bytes, region: int, offset: int) -> int:
    """The digest of ``data`` landing at ``offset`` of region ``region``, byte by byte in
    Python ints (tests)."""
    total = 0
    for i, b in enumerate(data):
        o = offset + i
        total += weight(region, o & ~7) * (b << (8 * (o & 7)))
    return total & MASK64
