"""What the bytes of one KV block mean, and which bytes of P's block land where in D's
(docs/topologies.md, 'Layouts').

A :class:`BlockShape` names the axes inside one block of a region — ``layer``, ``kv`` (K or V),
``token``, ``head`` and ``dim`` — each with a size and a byte stride, so one element of a block
sits at ``sum(index × stride)``. Every vLLM layout is one of these: the CPU page
``[heads, tokens, K|V dims]``, GPU NHD/HND pages (K and V side by side in the last dim), the old
``[2, blocks, tokens, heads, dim]`` K/V tensors, MLA's latent (no ``kv`` axis, one head), and the
block-outermost ``BLHNC`` / ``BLNHC`` / ``BHLNC`` layouts where one block holds every layer.

:func:`pair_template` lines up a local and a remote block shape for a set of layers and global
heads, at the granularity both share, and merges runs contiguous on both sides into the fewest
descriptors. P and D may differ in layout (NHD against HND), in heads per rank (hetero TP,
GQA, MLA) and in tokens per block (an integer ratio): the template covers one *super-block*
of ``lcm`` tokens — ``kp`` local and ``kd`` remote blocks — and is computed once per pairing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

AxisName = Literal["layer", "kv", "token", "head", "dim"]
AXES: tuple[AxisName, ...] = ("layer", "kv", "token", "head", "dim")
IntArray = npt.NDArray[np.int64]
MAX_ATOMS = 1 << 22  # pieces one super-block template may be cut into


class ShapeError(ValueError):
    """A block shape that is inconsistent, or two that cannot be paired."""


@dataclass(frozen=True)
class Axis:
    name: AxisName
    size: int
    stride: int  # bytes


@dataclass(frozen=True)
class BlockShape:
    """Named axes of one block (absent axes have size 1), and the element size in bytes."""

    axes: tuple[Axis, ...]
    elem_size: int

    def __post_init__(self) -> None:
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names):
            raise ShapeError(f"axis named twice in {names}")
        if self.elem_size < 1:
            raise ShapeError("element size must be positive")
        for a in self.axes:
            if a.name not in AXES:
                raise ShapeError(f"unknown axis {a.name!r}")
            if a.size < 1 or a.stride < 0:
                raise ShapeError(f"axis {a.name}: size {a.size}, stride {a.stride}")
        if self.size("kv") > 2:
            raise ShapeError("a kv axis holds K and V: size 2 at most")
        # No two elements may share a byte: walking axes from the smallest stride out, each
        # stride must clear everything inside it.
        extent = self.elem_size
        for a in sorted((a for a in self.axes if a.size > 1), key=lambda a: a.stride):
            if a.stride < extent:
                raise ShapeError(f"axis {a.name} (stride {a.stride}) overlaps the axes inside it ({extent} bytes)")
            extent = a.stride * (a.size - 1) + extent

    def axis(self, name: AxisName) -> Axis | None:
        for a in self.axes:
            if a.name == name:
                return a
        return None

    def size(self, name: AxisName) -> int:
        a = self.axis(name)
        return a.size if a is not None else 1

    def stride(self, name: AxisName) -> int:
        a = self.axis(name)
        return a.stride if a is not None else 0

    @property
    def extent(self) -> int:
        """Bytes from a block's first byte to just past its last element."""
        return self.elem_size + sum(a.stride * (a.size - 1) for a in self.axes)

    @property
    def nbytes(self) -> int:
        """Bytes of KV one block holds (its elements, not the gaps between them)."""
        return self.elem_size * math.prod(a.size for a in self.axes)

    def describe(self) -> str:
        order = sorted(self.axes, key=lambda a: -a.stride)
        return "[" + ", ".join(f"{a.name}={a.size}" for a in order if a.size > 1) + f"] × {self.elem_size} B"

    @classmethod
    def from_dims(cls, dims: str, shape: Sequence[int], strides: Sequence[int], elem_size: int) -> BlockShape:
        """Build from a tensor's dims without its block dim: letters ``L`` layer, ``K`` K/V,
        ``N`` token, ``H`` head, ``D`` dim, ``C`` K and V side by side (``2 × dim``).
        ``shape`` in elements, ``strides`` in elements, as torch reports them."""
        if len(dims) != len(shape) or len(shape) != len(strides):
            raise ShapeError(f"dims {dims!r} do not name shape {tuple(shape)}")
        axes: list[Axis] = []
        names = {"L": "layer", "K": "kv", "N": "token", "H": "head", "D": "dim"}
        for letter, size, stride in zip(dims, shape, strides, strict=True):
            if letter == "C":
                if size % 2:
                    raise ShapeError(f"a K|V content dim of {size} elements does not split in two")
                half = size // 2
                axes.append(Axis("kv", 2, half * stride * elem_size))
                axes.append(Axis("dim", half, stride * elem_size))
            elif letter in names:
                axes.append(Axis(names[letter], int(size), int(stride) * elem_size))  # type: ignore[arg-type]
            else:
                raise ShapeError(f"unknown dim letter {letter!r} in {dims!r}")
        return cls(tuple(axes), elem_size)

    @classmethod
    def opaque(cls, block_len: int, heads: int) -> BlockShape:
        """A block described only by its length: heads outermost (the CPU layout), bytes inside."""
        if heads < 1 or block_len % heads:
            raise ShapeError(f"a block of {block_len} bytes does not split into {heads} head slices")
        per = block_len // heads
        return cls((Axis("head", heads, per), Axis("dim", per, 1)), 1)


@dataclass(frozen=True)
class Side:
    """One side of a pairing: a block shape and where it sits in the model."""

    shape: BlockShape
    first_head: int  # global index of the block's head 0
    tokens: int  # tokens per (physical) block
    kv_part: int | None = None  # the region holds only K (0) or only V (1)


@dataclass(frozen=True)
class Unit:
    """One (layer, K/V half) a local region writes into a remote one: layer-axis indices and
    K/V indices on each side (``None``: the side has no such distinction)."""

    local_layer: int
    local_kv: int | None
    remote_layer: int
    remote_kv: int | None


@dataclass(frozen=True)
class Template:
    """The descriptors of one super-block: ``kp`` local and ``kd`` remote blocks.

    Entry ``e`` copies ``length[e]`` bytes from offset ``loff[e]`` of local block ``lpos[e]``
    of the super-block to offset ``roff[e]`` of remote block ``rpos[e]``.
    """

    lpos: IntArray
    loff: IntArray
    rpos: IntArray
    roff: IntArray
    length: IntArray
    kp: int
    kd: int

    def __len__(self) -> int:
        return len(self.loff)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def key(self) -> bytes:
        return b"".join(a.tobytes() for a in (self.lpos, self.loff, self.length)) + bytes([self.kp & 255])

    @functools.cached_property
    def placement(self) -> bytes:
        """Where the entries sit in the super-block (not their offsets): templates with equal
        placements pick the same blocks for every entry."""
        return b"".join((self.lpos.tobytes(), self.rpos.tobytes(), repr((self.kp, self.kd)).encode()))


def pair_template(local: Side, remote: Side, units: Sequence[Unit], heads: range) -> Template:
    """Descriptors that copy ``units`` × ``heads`` × every token × every dim from local to remote."""
    ls, rs = local.shape, remote.shape
    empty = np.empty(0, dtype=np.int64)
    if ls.elem_size != rs.elem_size:
        raise ShapeError(f"element size {ls.elem_size} != remote {rs.elem_size}")
    if ls.size("dim") != rs.size("dim"):
        raise ShapeError(f"head dim {ls.size('dim')} != remote {rs.size('dim')} elements")
    if not units or not len(heads):
        return Template(empty, empty, empty, empty, empty, 1, 1)
    for side, s in (("local", local), ("remote", remote)):
        if heads.start < s.first_head or heads.stop > s.first_head + s.shape.size("head"):
            held = range(s.first_head, s.first_head + s.shape.size("head"))
            raise ShapeError(f"{side} block holds heads {list(held)}, not {list(heads)}")
    l_tok, r_tok = ls.axis("token"), rs.axis("token")
    if ((l_tok is None) or (r_tok is None)) and local.tokens != remote.tokens:
        raise ShapeError("blocks of different token counts need a token axis on both sides")
    if (l_tok is not None and l_tok.size != local.tokens) or (r_tok is not None and r_tok.size != remote.tokens):
        raise ShapeError("token axis size differs from the block size")
    structured = l_tok is not None and r_tok is not None
    span = math.lcm(local.tokens, remote.tokens) if structured else 1
    lt = local.tokens if structured else 1
    rt = remote.tokens if structured else 1
    kp, kd = span // lt, span // rt

    # Atoms: one per (unit, token, head) — and per dim element unless dim is dense on both sides.
    dense = ls.stride("dim") == ls.elem_size and rs.stride("dim") == rs.elem_size
    ndim = 1 if dense else ls.size("dim")
    atoms = len(units) * span * len(heads) * ndim
    if atoms > MAX_ATOMS:
        # A peer's advertised shape sizes this work: bound it before allocating anything.
        raise ShapeError(f"pairing these blocks takes {atoms} pieces per super-block (limit {MAX_ATOMS})")
    atom = ls.elem_size * (ls.size("dim") if dense else 1)
    u_l = np.array([_unit_off(ls, u.local_layer, u.local_kv, local.kv_part, "local") for u in units], dtype=np.int64)
    u_r = np.array(
        [_unit_off(rs, u.remote_layer, u.remote_kv, remote.kv_part, "remote") for u in units], dtype=np.int64
    )
    tok = np.arange(span, dtype=np.int64)
    hd = np.arange(heads.start, heads.stop, dtype=np.int64)
    dm = np.arange(ndim, dtype=np.int64)
    shape = (len(units), span, len(hd), ndim)
    lpos = np.broadcast_to((tok // lt)[None, :, None, None], shape)
    rpos = np.broadcast_to((tok // rt)[None, :, None, None], shape)
    loff = (
        u_l[:, None, None, None]
        + ((tok % lt) * ls.stride("token"))[None, :, None, None]
        + ((hd - local.first_head) * ls.stride("head"))[None, None, :, None]
        + (dm * ls.stride("dim"))[None, None, None, :]
    )
    roff = (
        u_r[:, None, None, None]
        + ((tok % rt) * rs.stride("token"))[None, :, None, None]
        + ((hd - remote.first_head) * rs.stride("head"))[None, None, :, None]
        + (dm * rs.stride("dim"))[None, None, None, :]
    )
    lpos, rpos, loff, roff = (a.ravel() for a in (lpos, rpos, loff, roff))
    order = np.lexsort((loff, lpos))
    lpos, rpos, loff, roff = lpos[order], rpos[order], loff[order], roff[order]
    joins = (
        (lpos[1:] == lpos[:-1])
        & (rpos[1:] == rpos[:-1])
        & (loff[1:] == loff[:-1] + atom)
        & (roff[1:] == roff[:-1] + atom)
    )
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    counts = np.diff(np.concatenate((starts, [len(loff)])))
    return Template(
        lpos[starts].astype(np.int64),
        loff[starts].astype(np.int64),
        rpos[starts].astype(np.int64),
        roff[starts].astype(np.int64),
        (counts * atom).astype(np.int64),
        kp,
        kd,
    )


def _unit_off(shape: BlockShape, layer: int, kv: int | None, kv_part: int | None, side: str) -> int:
    if not 0 <= layer < shape.size("layer"):
        raise ShapeError(f"{side} layer index {layer} outside the block's {shape.size('layer')} layers")
    if kv is None:
        return layer * shape.stride("layer")
    if shape.axis("kv") is not None:
        if not 0 <= kv < shape.size("kv"):
            raise ShapeError(f"{side} K/V index {kv} outside the kv axis")
        return layer * shape.stride("layer") + kv * shape.stride("kv")
    if kv_part != kv:
        raise ShapeError(f"{side} region holds K/V part {kv_part}, not {kv}")
    return layer * shape.stride("layer")
