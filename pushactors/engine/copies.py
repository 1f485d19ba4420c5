"""Device copies of many byte ranges at once, for staged pushes (gather on P, scatter on D).

Rows are (source address, destination address, length) inside memory torch owns (the KV
tensors and the staging buffer). Rows are batched per (source storage, destination storage,
length): both storages are viewed as ``[-1, unit]`` bytes, where ``unit`` divides every
offset and the length, and one ``index_select`` + ``index_copy_`` moves the whole batch — the
same code on DRAM (torch CPU ops) and VRAM (a side CUDA stream, synchronised before return).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

U64 = npt.NDArray[np.uint64]


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

    def index(self, addrs: U64) -> npt.NDArray[np.int64]:
        """Which span holds each address (-1: none)."""
        out = np.full(len(addrs), -1, dtype=np.int64)
        for i, (base, size, _) in enumerate(self.spans):
            out[(addrs >= base) & (addrs < base + size)] = i
        return out


def copy_rows(views: ByteViews, src: U64, dst: U64, lengths: U64, stream: Any = None) -> int:
    """Copy every row; returns the bytes copied. Raises ValueError for a row outside the views."""
    if not len(src):
        return 0
    bases = np.array([b for b, _, _ in views.spans], dtype=np.uint64)
    sizes = np.array([n for _, n, _ in views.spans], dtype=np.uint64)
    si, di = views.index(src), views.index(dst)
    for which, addrs in ((si, src), (di, dst)):
        if (which < 0).any():
            raise ValueError(f"address {int(addrs[which < 0][0]):#x} is outside the registered tensors")
        if not np.all(addrs - bases[which] + lengths <= sizes[which]):
            raise ValueError("a row runs past the end of its tensor")
    # One batch per (source span, destination span, length), grouped with one sort.
    _, length_id = np.unique(lengths, return_inverse=True)
    key = (si * len(bases) + di) * (int(length_id.max()) + 1) + length_id
    order = np.argsort(key, kind="stable")
    cuts = np.flatnonzero(np.diff(key[order])) + 1
    ctx = torch.cuda.stream(stream) if stream is not None else _null()
    with ctx:
        for rows in np.split(order, cuts):
            i, j, length = int(si[rows[0]]), int(di[rows[0]]), int(lengths[rows[0]])
            soff = (src[rows] - bases[i]).astype(np.int64)
            doff = (dst[rows] - bases[j]).astype(np.int64)
            _copy_batch(views.spans[i][2], soff, views.spans[j][2], doff, length)
    if stream is not None:
        stream.synchronize()
    return int(lengths.sum())


def _copy_batch(
    sflat: torch.Tensor, soff: npt.NDArray[np.int64], dflat: torch.Tensor, doff: npt.NDArray[np.int64], length: int
) -> None:
    n = len(soff)
    if n <= 4 or (dflat.device.type == "cpu" and length >= 4096 and not _consecutive(doff, length)):
        # Few rows, or a scatter on CPU, where index_copy_ runs ~10x below memcpy speed.
        for s, d in zip(soff.tolist(), doff.tolist(), strict=True):
            dflat[d : d + length].copy_(sflat[s : s + length], non_blocking=True)
        return
    unit = max(1, math.gcd(length, int(np.gcd.reduce(soff)), int(np.gcd.reduce(doff))))
    per = length // unit
    sview, dview = _rows_view(sflat, unit), _rows_view(dflat, unit)
    steps = np.arange(per, dtype=np.int64)
    sidx = torch.from_numpy(((soff // unit)[:, None] + steps).ravel()).to(sflat.device, non_blocking=True)
    if _consecutive(doff, length) and sflat.device == dflat.device:
        # A gather into one contiguous run: select straight into it.
        first = int(doff[0]) // unit
        torch.index_select(sview, 0, sidx, out=dview[first : first + n * per])
        return
    didx = torch.from_numpy(((doff // unit)[:, None] + steps).ravel()).to(dflat.device, non_blocking=True)
    dview.index_copy_(0, didx, sview.index_select(0, sidx).to(dflat.device, non_blocking=True))


def _rows_view(flat: torch.Tensor, unit: int) -> torch.Tensor:
    """``flat`` as rows of ``unit`` bytes, in the widest element that divides them: indexing
    kernels move one element per thread, so 8-byte elements move 8x the bytes of uint8."""
    body = flat[: (flat.numel() // unit) * unit]
    if unit % 8 == 0 and flat.data_ptr() % 8 == 0:
        return body.view(torch.int64).view(-1, unit // 8)
    return body.view(-1, unit)


def _consecutive(off: npt.NDArray[np.int64], length: int) -> bool:
    return bool(len(off)) and bool(np.all(np.diff(off) == length))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
