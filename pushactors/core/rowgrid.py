"""Copy rows described by their links and pieces (:class:`RowGrid`): plain arrays, no device.

The bottom of core's block arithmetic: :mod:`pushactors.core.blocks` builds grids for staged
pushes and :mod:`pushactors.core.staging` joins them into rows and spans, so this module imports
neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RowGrid:
    """Copy rows as every *link* (a region, or a run of one: ``K`` of them) × every *piece* (a
    block or a part of one: ``J`` of them). Row ``(k, j)`` copies ``length[k] +
    piece_length[j]`` bytes from ``src[k] + src_stride[k] * src_block[j] + src_off[j]`` to
    ``dst[k] + dst_stride[k] * dst_block[j] + dst_off[j]``. A staged copy's rows have this shape
    (every layer × every block), so a device can build them from ``K + J`` numbers instead of
    the host building ``K × J`` rows. Rows run link-major (``j`` fastest)."""

    src: IndexArray  # per link
    src_stride: IndexArray
    dst: IndexArray
    dst_stride: IndexArray
    length: IndexArray
    src_block: IndexArray  # per piece
    src_off: IndexArray
    dst_block: IndexArray
    dst_off: IndexArray
    piece_length: IndexArray

    @property
    def links(self) -> int:
        return len(self.src)

    @property
    def pieces(self) -> int:
        return len(self.src_block)

    def __len__(self) -> int:
        return self.links * self.pieces

    @property
    def nbytes(self) -> int:
        return self.pieces * int(self.length.sum()) + self.links * int(self.piece_length.sum())

    def shifted(self, *, src: int = 0, dst: int = 0) -> RowGrid:
        """The same rows with every source moved by ``src`` bytes and destination by ``dst``."""
        return RowGrid(
            self.src + src,
            self.src_stride,
            self.dst + dst,
            self.dst_stride,
            self.length,
            self.src_block,
            self.src_off,
            self.dst_block,
            self.dst_off,
            self.piece_length,
        )

    def check(self) -> None:
        """ValueError for a negative term or a row whose end does not fit int64 (building the
        rows would wrap around); every row is then computed exactly, here or on a device. A
        grid that passed is not checked again (its arrays are never changed once built)."""
        if self.__dict__.get("_checked"):
            return
        if len(self):
            lo = {n: int(getattr(self, n).min()) for n in self.__dataclass_fields__}
            if min(lo.values()) < 0:
                raise ValueError("a copy row has a negative address, stride, block or length")
            hi = {n: int(getattr(self, n).max()) for n in self.__dataclass_fields__}
            extra = hi["length"] + hi["piece_length"]
            for side in ("src", "dst"):
                if hi[side] + hi[f"{side}_stride"] * hi[f"{side}_block"] + hi[f"{side}_off"] + extra >= 1 << 63:
                    raise ValueError("a copy row ends beyond any address")
        object.__setattr__(self, "_checked", True)

    def rows(self) -> tuple[IndexArray, IndexArray, IndexArray]:
        """Every row: (source, destination, length), link-major; ValueError as :meth:`check`."""
        self.check()
        src = (self.src[:, None] + self.src_stride[:, None] * self.src_block[None, :] + self.src_off[None, :]).ravel()
        dst = (self.dst[:, None] + self.dst_stride[:, None] * self.dst_block[None, :] + self.dst_off[None, :]).ravel()
        length = (self.length[:, None] + self.piece_length[None, :]).ravel()
        return src, dst, length
