"""KV layout and WRITE plans (docs/protocol.md, 'Blocks'): regions, logical→physical ids, descriptors.

A *region* is one strided run of equally sized physical blocks in registered memory: a layer's
page, its K or V half, or — in a block-outermost layout — every layer of a block. Its
:class:`~pushactors.core.layout.BlockShape` says what each byte of a block means; a region
without one is *opaque* (heads outermost, the CPU layout).

A :class:`PairedLayout` joins this rank's regions to one remote rank's by layer name and K/V
half (*links*), and each link to a :class:`~pushactors.core.layout.Template`: the descriptors
of one super-block. Descriptor lists are prepared once per pairing: the row of template entry
``e`` of physical block ``b`` of a link sits at ``base[link] + b × len(template) + e``, so a
WRITE is two index arrays.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from ..protocol import (
    MAX_DESCRIPTOR_ROWS,
    AgentInfo,
    AxisInfo,
    BlockGroups,
    MemoryRange,
    MemType,
    RegionInfo,
    ShapeInfo,
)
from .layout import Axis, BlockShape, ShapeError, Side, Template, Unit, pair_template
from .rowgrid import IndexArray, RowGrid
from .topology import TopologyError, check_heads, default_heads, rank_heads

if TYPE_CHECKING:
    import torch


class LayoutError(ValueError):
    """KV tensors or a remote layout that cannot be served; a configuration error."""


class PlanError(ValueError):
    """A WRITE that must not be posted (block ids out of range, counts that do not fit)."""


@dataclass(frozen=True)
class KVRegion:
    base_addr: int
    block_len: int
    stride: int
    num_blocks: int
    device_id: int = 0
    # Layer names. With a layer axis of size L > 1, name i is layer index i; otherwise every
    # name is an alias of the region's one layer (a physical allocation shared by layers).
    members: tuple[str, ...] = ()
    group: int = 0
    shape: BlockShape | None = None  # None: opaque (heads outermost)
    kv_part: int | None = None  # the region holds only K (0) or only V (1) of its layers

    def __post_init__(self) -> None:
        if self.shape is None:
            return
        if self.shape.extent > self.block_len:
            raise LayoutError(
                f"region {self.members or '?'}: shape spans {self.shape.extent} bytes, block is {self.block_len}"
            )
        layers = self.shape.size("layer")
        if layers > 1 and len(self.members) not in (0, layers):
            raise LayoutError(f"region has {layers} layers but names {len(self.members)}")
        if self.kv_part is not None and self.shape.axis("kv") is not None:
            raise LayoutError("a region of one K/V part cannot also have a kv axis")

    @property
    def layer_names(self) -> tuple[tuple[str, ...], ...]:
        """Names per layer-axis index."""
        if self.shape is not None and self.shape.size("layer") > 1:
            return (
                tuple((m,) for m in self.members)
                if self.members
                else tuple(() for _ in range(self.shape.size("layer")))
            )
        return (self.members,)

    @property
    def kv_indices(self) -> tuple[int | None, ...]:
        """The K/V halves a unit of this region can name (``None``: no K/V distinction)."""
        if self.shape is not None and self.shape.axis("kv") is not None:
            return tuple(range(self.shape.size("kv")))
        if self.kv_part is not None:
            return (self.kv_part,)
        return (None,)

    def info(self) -> RegionInfo:
        return RegionInfo(
            base_addr=self.base_addr,
            block_len=self.block_len,
            stride=self.stride,
            num_blocks=self.num_blocks,
            device_id=self.device_id,
            members=self.members,
            group=self.group,
            shape=None
            if self.shape is None
            else ShapeInfo(
                axes=tuple(AxisInfo(name=a.name, size=a.size, stride=a.stride) for a in self.shape.axes),
                elem_size=self.shape.elem_size,
            ),
            kv_part=self.kv_part,
        )

    @classmethod
    def from_info(cls, info: RegionInfo) -> KVRegion:
        shape = None
        if info.shape is not None:
            try:
                shape = BlockShape(tuple(Axis(a.name, a.size, a.stride) for a in info.shape.axes), info.shape.elem_size)
            except ShapeError as exc:
                raise LayoutError(f"remote region shape: {exc}") from None
        return cls(
            info.base_addr,
            info.block_len,
            info.stride,
            info.num_blocks,
            info.device_id,
            info.members,
            info.group,
            shape,
            info.kv_part,
        )


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV memory as the transport sees it."""

    regions: tuple[KVRegion, ...]
    mem_type: MemType
    block_size: int  # tokens per logical block
    physical_blocks_per_logical: int = 1
    memory: tuple[MemoryRange, ...] = ()  # unique allocations to register with NIXL
    num_groups: int = 1
    # KV heads of the whole model (all TP ranks); None for opaque layouts that do not say.
    # MLA's latent is one head, replicated on every rank.
    kv_heads: int | None = None

    def __post_init__(self) -> None:
        if not self.regions:
            raise LayoutError("a KV layout needs at least one region")
        if self.physical_blocks_per_logical < 1:
            raise LayoutError("physical_blocks_per_logical must be >= 1")
        if self.block_size % self.physical_blocks_per_logical:
            raise LayoutError(
                f"{self.physical_blocks_per_logical} kernel blocks do not split a block of {self.block_size} tokens"
            )
        structured = {r.shape is not None for r in self.regions}
        if len(structured) > 1:
            raise LayoutError("describe every region's shape or none")
        for r in self.regions:
            tok = r.shape.axis("token") if r.shape is not None else None
            if tok is not None and tok.size != self.tokens_per_block:
                raise LayoutError(
                    f"region {r.members or '?'}: {tok.size} tokens per block, the layout says {self.tokens_per_block}"
                )

    @property
    def tokens_per_block(self) -> int:
        """Tokens in one physical (kernel) block."""
        return self.block_size // self.physical_blocks_per_logical

    @property
    def structured(self) -> bool:
        return self.regions[0].shape is not None

    def check_heads(self, tp_rank: int, tp_size: int) -> None:
        """A structured layout's head axes must hold exactly this rank's share of the heads."""
        if not self.structured:
            return
        if self.kv_heads is None:
            raise LayoutError("a layout that describes its shape must say how many KV heads the model has")
        try:
            want = len(rank_heads(tp_rank, tp_size, self.kv_heads))
        except TopologyError as exc:
            raise LayoutError(str(exc)) from None
        for r in self.regions:
            assert r.shape is not None
            if r.shape.size("head") != want:
                raise LayoutError(
                    f"region {r.members or '?'} holds {r.shape.size('head')} heads; TP rank {tp_rank} of {tp_size} "
                    f"holds {want} of {self.kv_heads}"
                )

    @property
    def region_infos(self) -> tuple[RegionInfo, ...]:
        return tuple(r.info() for r in self.regions)

    @classmethod
    def from_tensors(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        block_size: int,
        num_blocks: int | None = None,
        physical_blocks_per_logical: int = 1,
        groups: Mapping[str, int] | None = None,
        dims: str | None = None,
        kv_heads: int | None = None,
    ) -> KVLayout:
        """Derive regions from per-layer KV tensors.

        Accepted per-layer shapes (block dimension found from ``num_blocks``, else dim 0):
        ``[num_blocks, ...]`` is one region; ``[2, num_blocks, ...]`` (K and V apart) is two.
        Layers that share one physical allocation become one region with several members.

        ``dims`` names the tensor's dims (see :meth:`BlockShape.from_dims`; ``B`` is the block
        dim and a leading ``K`` of size 2 means K and V apart), e.g. ``"BHNC"`` for vLLM's
        ``[blocks, heads, tokens, K|V]`` view whatever its strides, ``"KBNHD"`` for the older
        ``[2, blocks, tokens, heads, dim]``. With ``dims`` every region is described and
        ``kv_heads`` (the model's total) is required; without, regions are opaque.
        """
        if dims is not None:
            return cls._from_described(
                kv_caches,
                dims=dims,
                block_size=block_size,
                physical_blocks_per_logical=physical_blocks_per_logical,
                groups=groups,
                kv_heads=kv_heads,
            )
        if not kv_caches:
            raise LayoutError("no KV cache tensors to register")
        devices = {t.device.type for t in kv_caches.values()}
        if len(devices) != 1:
            raise LayoutError(f"KV tensors on mixed devices {sorted(devices)}: register one kind")
        device = devices.pop()
        if device == "cpu":
            mem_type: MemType = "DRAM"
        elif device == "cuda":
            mem_type = "VRAM"
        else:
            raise LayoutError(f"unsupported KV tensor device {device!r}")

        merged: dict[tuple[int, int, int, int, int], list[str]] = {}
        order: list[tuple[int, int, int, int, int]] = []
        storages: dict[int, MemoryRange] = {}
        for name, t in kv_caches.items():
            group = (groups or {}).get(name, 0)
            parts = _tensor_regions(name, t, num_blocks)
            for _, block_len, stride, _ in parts:
                if stride < block_len:
                    raise LayoutError(f"{name}: blocks of {block_len} bytes overlap (stride {stride})")
            for i, (base, block_len, stride, nblocks) in enumerate(parts):
                key = (base, block_len, stride, nblocks, group)
                if key not in merged:
                    merged[key] = []
                    order.append(key)
                # A layer split into K and V regions is routed by "name[0]" / "name[1]".
                merged[key].append(name if len(parts) == 1 else f"{name}[{i}]")
            storage = t.untyped_storage()
            dev = max(t.get_device(), 0)
            storages.setdefault(storage.data_ptr(), MemoryRange(storage.data_ptr(), storage.nbytes(), dev))
        regions = tuple(
            KVRegion(
                base,
                block_len,
                stride,
                nblocks,
                device_id=max(next(iter(kv_caches.values())).get_device(), 0),
                members=tuple(merged[(base, block_len, stride, nblocks, group)]),
                group=group,
            )
            for base, block_len, stride, nblocks, group in order
        )
        return cls(
            regions=regions,
            mem_type=mem_type,
            block_size=block_size,
            physical_blocks_per_logical=physical_blocks_per_logical,
            memory=tuple(storages.values()),
            num_groups=1 + max(r.group for r in regions),
            kv_heads=kv_heads,
        )

    @classmethod
    def _from_described(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        *,
        dims: str,
        block_size: int,
        physical_blocks_per_logical: int,
        groups: Mapping[str, int] | None,
        kv_heads: int | None,
    ) -> KVLayout:
        if not kv_caches:
            raise LayoutError("no KV cache tensors to register")
        if kv_heads is None:
            raise LayoutError("a described layout needs the model's KV head count (kv_heads)")
        if dims.count("B") != 1:
            raise LayoutError(f"dims {dims!r} must name exactly one block dim B")
        split = dims.startswith("KB")
        inner = dims.replace("B", "")[1:] if split else dims.replace("B", "")
        mem_type = _mem_type(kv_caches)
        regions: list[KVRegion] = []
        index: dict[tuple[int, int, int, int | None, int], int] = {}
        storages: dict[int, MemoryRange] = {}
        for name, t in kv_caches.items():
            if t.dim() != len(dims):
                raise LayoutError(f"{name}: dims {dims!r} do not name a tensor of shape {tuple(t.shape)}")
            es = t.element_size()
            group = (groups or {}).get(name, 0)
            b = dims.index("B")
            keep = [i for i, d in enumerate(dims) if d != "B" and not (split and i == 0)]
            try:
                shape = BlockShape.from_dims(inner, [t.shape[i] for i in keep], [t.stride(i) for i in keep], es)
            except ShapeError as exc:
                raise LayoutError(f"{name}: {exc}") from None
            parts = [(0, None)] if not split else [(kv, kv) for kv in range(t.shape[0])]
            for kv_off, kv_part in parts:
                base = t.data_ptr() + (kv_off * t.stride(0) * es if split else 0)
                stride = t.stride(b) * es
                extent = shape.extent
                if stride < extent and t.shape[b] > 1:
                    raise LayoutError(f"{name}: blocks of {extent} bytes overlap (stride {stride})")
                key = (base, stride, t.shape[b], kv_part, group)
                if key in index:  # another name for memory already described (shared layers)
                    i = index[key]
                    regions[i] = KVRegion(**{**regions[i].__dict__, "members": (*regions[i].members, name)})
                    continue
                index[key] = len(regions)
                regions.append(
                    KVRegion(
                        base,
                        extent,
                        max(stride, extent),
                        int(t.shape[b]),
                        device_id=max(t.get_device(), 0),
                        members=(name,),
                        group=group,
                        shape=shape,
                        kv_part=kv_part,
                    )
                )
            storage = t.untyped_storage()
            storages.setdefault(
                storage.data_ptr(), MemoryRange(storage.data_ptr(), storage.nbytes(), max(t.get_device(), 0))
            )
        return cls(
            regions=tuple(_coalesce_layers(regions)),
            mem_type=mem_type,
            block_size=block_size,
            physical_blocks_per_logical=physical_blocks_per_logical,
            memory=tuple(storages.values()),
            num_groups=1 + max(r.group for r in regions),
            kv_heads=kv_heads,
        )


def _mem_type(kv_caches: Mapping[str, torch.Tensor]) -> MemType:
    devices = {t.device.type for t in kv_caches.values()}
    if len(devices) != 1:
        raise LayoutError(f"KV tensors on mixed devices {sorted(devices)}: register one kind")
    device = devices.pop()
    if device == "cpu":
        return "DRAM"
    if device == "cuda":
        return "VRAM"
    raise LayoutError(f"unsupported KV tensor device {device!r}")


def _coalesce_layers(regions: list[KVRegion]) -> list[KVRegion]:
    """Per-layer views of one block-outermost allocation become one region with a layer axis.

    Layers qualify when they share block stride, block count, shape, group and K/V part and
    their bases step by one constant that fits inside a block: then a block's layers can be
    moved together (one descriptor per block where they are contiguous).
    """
    out: list[KVRegion] = []
    buckets: dict[tuple[object, ...], list[KVRegion]] = {}
    for r in regions:
        if len(r.members) != 1 or r.shape is None or r.shape.axis("layer") is not None:
            out.append(r)
            continue
        buckets.setdefault((r.stride, r.num_blocks, r.shape, r.group, r.kv_part, r.device_id), []).append(r)
    for rs in buckets.values():
        rs.sort(key=lambda r: r.base_addr)
        step = rs[1].base_addr - rs[0].base_addr if len(rs) > 1 else 0
        first = rs[0]
        assert first.shape is not None
        ok = (
            len(rs) > 1
            and step > 0
            and all(b.base_addr - a.base_addr == step for a, b in itertools.pairwise(rs))
            and step * (len(rs) - 1) + first.shape.extent <= first.stride
        )
        if not ok:
            out.extend(rs)
            continue
        try:
            shape = BlockShape((Axis("layer", len(rs), step), *first.shape.axes), first.shape.elem_size)
        except ShapeError:  # the layers interleave with each other: keep them apart
            out.extend(rs)
            continue
        out.append(
            KVRegion(
                first.base_addr,
                shape.extent,
                first.stride,
                first.num_blocks,
                first.device_id,
                tuple(r.members[0] for r in rs),
                first.group,
                shape,
                first.kv_part,
            )
        )
    return out


def _tensor_regions(name: str, t: torch.Tensor, num_blocks: int | None) -> list[tuple[int, int, int, int]]:
    es = t.element_size()
    shape = tuple(t.shape)
    if len(shape) < 2:
        raise LayoutError(f"{name}: KV tensor of shape {shape} has no block dimension")
    if t.numel() == 0:
        raise LayoutError(f"{name}: KV tensor of shape {shape} is empty")
    if num_blocks is None or shape[0] == num_blocks:
        inner = t[0]
        if not inner.is_contiguous():
            raise LayoutError(f"{name}: a block of shape {tuple(inner.shape)} is not contiguous")
        return [(t.data_ptr(), inner.numel() * es, t.stride(0) * es, shape[0])]
    if shape[0] == 2 and shape[1] == num_blocks and len(shape) >= 3:
        inner = t[0, 0]
        if not inner.is_contiguous():
            raise LayoutError(f"{name}: a block of shape {tuple(inner.shape)} is not contiguous")
        block_len = inner.numel() * es
        return [(t.data_ptr() + kv * t.stride(0) * es, block_len, t.stride(1) * es, num_blocks) for kv in range(2)]
    raise LayoutError(
        f"{name}: cannot find {num_blocks} blocks in KV tensor of shape {shape} "
        "(expected [num_blocks, ...] or [2, num_blocks, ...])"
    )


# --------------------------------------------------------------------------------------------
# Block ids
# --------------------------------------------------------------------------------------------
def physical_block_ids(logical: Sequence[int] | IndexArray, ratio: int) -> IndexArray:
    """Logical block b → physical b*r … b*r+r-1 (kernel blocks may be smaller)."""
    arr = np.asarray(logical, dtype=np.int64)
    if ratio == 1:
        return arr
    return (arr[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).ravel()


def trim_to_remote(p_blocks: Sequence[int], d_count: int) -> tuple[int, ...]:
    """D registers only its uncached suffix: keep P's *last* ``d_count`` blocks.

    Trimming from the front would hand D the KV of the wrong token positions.
    """
    if d_count > len(p_blocks):
        raise PlanError(f"D registered {d_count} blocks but P has only {len(p_blocks)}")
    if d_count == 0:
        return ()
    return tuple(p_blocks[len(p_blocks) - d_count :])


# --------------------------------------------------------------------------------------------
# Pairing a local layout with a remote rank's
# --------------------------------------------------------------------------------------------
def link_units(local: Sequence[KVRegion], remote: Sequence[KVRegion]) -> dict[tuple[int, int], list[Unit]]:
    """For each (local region, remote region) the units (layer, K/V half) it writes there.

    Routing is by layer name when both sides name their regions, so PP stages, pooled (HMA)
    regions and different layouts pair correctly; otherwise regions pair by position. Every
    locally owned layer must be advertised exactly once by the remote; there is no fallback.
    """
    links: dict[tuple[int, int], list[Unit]] = {}
    named = all(r.members for r in local) and all(r.members for r in remote)
    if not named:
        if all(r.members for r in local) and len(local) != len(remote):
            raise LayoutError("remote omits region members that this layout needs for routing")
        if len(local) != len(remote):
            raise LayoutError(f"{len(local)} local regions but {len(remote)} remote regions")
        for i, (lr, rr) in enumerate(zip(local, remote, strict=True)):
            if len(lr.layer_names) != len(rr.layer_names) or lr.kv_indices != rr.kv_indices:
                raise LayoutError(f"region {i}: layers or K/V halves differ from the remote's")
            links[(i, i)] = [Unit(n, k, n, k) for n in range(len(lr.layer_names)) for k in lr.kv_indices]
        return links
    # name → (region, layer index) on the remote, with the K/V halves each region holds there
    owner: dict[str, list[tuple[int, int]]] = {}
    for j, r in enumerate(remote):
        for li, names in enumerate(r.layer_names):
            for m in names:
                owner.setdefault(m, []).append((j, li))
    for i, r in enumerate(local):
        for li, names in enumerate(r.layer_names):
            for kv in r.kv_indices:
                found: set[tuple[int, int, int | None]] = set()
                for m in names:
                    places = owner.get(m)
                    if not places:
                        raise LayoutError(f"remote does not advertise layer {m!r}")
                    hits = [(j, rl, kv) for j, rl in places if _holds(remote[j], kv)]
                    if not hits:
                        raise LayoutError(f"remote advertises layer {m!r} without its {_half(kv)}")
                    if len(hits) > 1:
                        raise LayoutError(f"remote advertises layer {m!r} ({_half(kv)}) in two regions")
                    found.add(hits[0])
                if len(found) != 1:
                    raise LayoutError(f"local region {r.members} spans several remote regions")
                j, rl, rkv = found.pop()
                links.setdefault((i, j), []).append(Unit(li, kv, rl, rkv))
    return links


def _holds(r: KVRegion, kv: int | None) -> bool:
    if kv is None:
        return r.kv_indices == (None,)
    return kv in r.kv_indices


def _half(kv: int | None) -> str:
    return "KV" if kv is None else ("K", "V")[kv]


def pair_regions(local: Sequence[KVRegion], remote: Sequence[KVRegion]) -> tuple[int, ...]:
    """For each local region, the one remote region that holds its layers (a layout where a
    local region feeds several remote regions — K/V apart on one side only — has no answer)."""
    links = link_units(local, remote)
    out = []
    for i in range(len(local)):
        js = sorted(j for (li, j) in links if li == i)
        if len(js) != 1:
            raise LayoutError(f"local region {local[i].members or i} spans several remote regions")
        out.append(js[0])
    return tuple(out)


@dataclass(frozen=True)
class RemoteLayout:
    """A remote rank's layout as learned in the handshake."""

    engine_id: str
    agent_name: str
    regions: tuple[KVRegion, ...]
    block_size: int
    physical_blocks_per_logical: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    mem_type: MemType
    replicated_kv: bool = False
    clock_offset: float = 0.0  # remote monotonic − local monotonic, from the clock sample
    kv_heads: int | None = None

    @property
    def tokens_per_block(self) -> int:
        return self.block_size // self.physical_blocks_per_logical

    @classmethod
    def from_info(cls, info: AgentInfo, agent_name: str, clock_offset: float = 0.0) -> RemoteLayout:
        if info.block_size % info.physical_blocks_per_logical:
            raise LayoutError("remote kernel blocks do not split its blocks")
        return cls(
            engine_id=info.engine_id,
            agent_name=agent_name,
            regions=tuple(KVRegion.from_info(r) for r in info.regions),
            block_size=info.block_size,
            physical_blocks_per_logical=info.physical_blocks_per_logical,
            tp_size=info.tp_size,
            tp_rank=info.tp_rank,
            pp_size=info.pp_size,
            pp_rank=info.pp_rank,
            mem_type=info.mem_type,
            replicated_kv=info.replicated_kv,
            clock_offset=clock_offset,
            kv_heads=info.kv_heads,
        )


@dataclass
class WritePlan:
    """One WRITE: its cost, and either explicit runs or index arrays into the prepared lists.

    The index arrays (one entry per piece) are built on first use: a plan whose pieces join
    into few runs is posted as those runs and never needs them.
    """

    nbytes: int
    num_descs: int  # pieces, before any merging
    num_blocks: int  # logical blocks written (per region)
    indices: Callable[[], tuple[IndexArray, IndexArray]] = field(default=lambda: _NO_INDICES, repr=False, compare=False)
    count_merged: Callable[[], int] = field(default=lambda: 0, repr=False, compare=False)
    # Explicit (address, length, device) rows, here and there, of the runs the pieces join
    # into: set when the plan was asked to merge and merging pays (see :meth:`PairedLayout.plan`).
    runs: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None = None

    @functools.cached_property
    def _indices(self) -> tuple[IndexArray, IndexArray]:
        return self.indices()

    @property
    def local_idx(self) -> IndexArray:
        return self._indices[0]

    @property
    def remote_idx(self) -> IndexArray:
        return self._indices[1]

    @functools.cached_property
    def merged_descs(self) -> int:
        """Descriptors left after merging pieces contiguous on both sides, across regions
        too (what a backend that merges could reach): the WRITE's event reports it. Counted
        on first use: it costs a small plan as much again as its index arrays, and nothing
        but the event needs it."""
        return self.count_merged()

    @property
    def posted_descs(self) -> int:
        """Descriptors the WRITE hands NIXL: its runs, or one per piece."""
        return len(self.runs[0]) if self.runs is not None else self.num_descs


_NO_INDICES: tuple[IndexArray, IndexArray] = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))

# A plan posts explicit runs when they are at most this share of its pieces. Per push that
# costs preparing two short descriptor lists (and releasing them when it settles) instead of
# handing NIXL one index per piece; below half the pieces it is worth it (docs/performance.md).
RUNS_SHARE = 0.5


@dataclass(frozen=True)
class Link:
    """Local region ``local`` writes ``template`` into remote region ``remote``."""

    local: int
    remote: int
    template: Template
    local_base: int  # first row of this link in the local descriptor list
    remote_base: int


def model_heads(local: KVLayout, remote: RemoteLayout, p_tp: int, d_tp: int, replicated: bool = False) -> int:
    """The model's KV head count as both sides state it (they must agree)."""
    if local.kv_heads is not None and remote.kv_heads is not None and local.kv_heads != remote.kv_heads:
        raise LayoutError(f"{local.kv_heads} KV heads here, {remote.kv_heads} on the remote")
    heads = local.kv_heads if local.kv_heads is not None else remote.kv_heads
    if heads is None:
        heads = default_heads(p_tp, d_tp, replicated or remote.replicated_kv)
    return heads


class PairedLayout:
    """This rank's regions paired with one remote rank's, for WRITEs of ``heads`` (global KV
    heads) from here into there. Built once per (remote rank, head range)."""

    def __init__(
        self, local: KVLayout, local_rank: tuple[int, int], remote: RemoteLayout, heads: range, kv_heads: int
    ) -> None:
        self.local = local
        self.remote = remote
        self.heads = heads
        if local.tokens_per_block != remote.tokens_per_block and (
            local.block_size % remote.block_size and remote.block_size % local.block_size
        ):
            raise LayoutError(
                f"block size {local.block_size} and remote {remote.block_size} tokens: neither divides the other"
            )
        if local.structured != all(r.shape is not None for r in remote.regions):
            raise LayoutError("one side describes its KV layout and the other does not: both must, or neither")
        try:
            for tp, side in ((local_rank[1], "local"), (remote.tp_size, "remote")):
                check_heads(kv_heads, tp, f"{side}: ")
            l_heads = rank_heads(local_rank[0], local_rank[1], kv_heads)
            r_heads = rank_heads(remote.tp_rank, remote.tp_size, kv_heads)
        except TopologyError as exc:
            raise LayoutError(str(exc)) from None
        links = link_units(local.regions, remote.regions) if len(heads) else {}
        built: list[Link] = []
        lrows = rrows = 0
        for (i, j), units in links.items():
            lr, rr = local.regions[i], remote.regions[j]
            if lr.group != rr.group:
                raise LayoutError(f"region {lr.members or '?'}: KV-cache group differs")
            lshape = lr.shape or _opaque(lr, len(l_heads), "local")
            rshape = rr.shape or _opaque(rr, len(r_heads), "remote")
            if lr.shape is not None and rr.shape is not None:
                for s, want, side in ((lshape, l_heads, "local"), (rshape, r_heads, "remote")):
                    if s.size("head") != len(want):
                        raise LayoutError(f"{side} region holds {s.size('head')} heads, its TP rank holds {len(want)}")
            try:
                template = pair_template(
                    Side(lshape, l_heads.start, local.tokens_per_block, lr.kv_part),
                    Side(rshape, r_heads.start, remote.tokens_per_block, rr.kv_part),
                    units,
                    heads,
                )
            except ShapeError as exc:
                raise LayoutError(f"region {lr.members or i}: {exc}") from None
            if not len(template):
                continue
            built.append(Link(i, j, template, lrows, rrows))
            lrows += lr.num_blocks * len(template)
            rrows += rr.num_blocks * len(template)
        if max(lrows, rrows) > MAX_DESCRIPTOR_ROWS:
            raise LayoutError(
                f"this pairing needs {max(lrows, rrows)} prepared descriptors (over {MAX_DESCRIPTOR_ROWS}): "
                "use a head-major (HND) or block-outermost layout for heterogeneous TP"
            )
        self.links = tuple(built)
        self.local_rows = lrows
        self.remote_rows = rrows

    @property
    def descs_per_block(self) -> float:
        """Descriptors per remote logical block, before merging across blocks."""
        r = self.remote.physical_blocks_per_logical
        return sum(len(k.template) * r / k.template.kd for k in self.links)

    @functools.cached_property
    def local_key(self) -> bytes:
        """Equal keys mean equal local descriptor lists (shared across remotes)."""
        return b"|".join(bytes(str((k.local, k.local_base)), "ascii") + k.template.key() for k in self.links)

    def local_descriptors(self) -> npt.NDArray[np.uint64]:
        return _rows([(self.local.regions[k.local], k.template.loff, k.template.length) for k in self.links])

    def remote_descriptors(self) -> npt.NDArray[np.uint64]:
        return _rows([(self.remote.regions[k.remote], k.template.roff, k.template.length) for k in self.links])

    @functools.cached_property
    def _capacities(self) -> tuple[dict[int, int], dict[int, int]]:
        """Logical blocks per KV group, here and there (:func:`capacity`)."""
        local, remote = self.local, self.remote
        return (
            dict(enumerate(capacity(local.regions, local.physical_blocks_per_logical))),
            dict(enumerate(capacity(remote.regions, remote.physical_blocks_per_logical))),
        )

    @functools.cached_property
    def _deepest_group(self) -> int:
        """The highest KV group a link writes (-1: none); D must register at least that many."""
        return max((self.local.regions[k.local].group for k in self.links), default=-1)

    @functools.cached_property
    def _batches(self) -> tuple[_LinkBatch, ...]:
        """Runs of consecutive links with equal templates in one KV group (every layer of a
        per-layer layout is one run): a plan computes each run with one broadcast instead of
        a handful of array operations per link, in the same descriptor order."""
        out: list[_LinkBatch] = []
        run: list[Link] = []

        def close() -> None:
            if run:
                out.append(_LinkBatch.of(run, self.local, self.remote))
                run.clear()

        for k in self.links:
            if run and not (
                self.local.regions[k.local].group == self.local.regions[run[0].local].group
                and _same_template(k.template, run[0].template)
            ):
                close()
            run.append(k)
        close()
        return tuple(out)

    @property
    def link_runs(self) -> int:
        """How many runs of links (one broadcast each) a whole-request plan computes."""
        return len(self._batches)

    def layer_batches(self, group_of_region: tuple[int, ...], g: int) -> tuple[_LinkBatch, ...]:
        """:attr:`_batches` of only the links whose local region is in layer group ``g``
        (``group_of_region[i]`` for local region ``i``). Built once per (mapping, group)."""
        key = (group_of_region, g)
        known = self._layer_batches.get(key)
        if known is not None:
            return known
        if len(group_of_region) != len(self.local.regions):
            raise PlanError(
                f"layer groups name {len(group_of_region)} regions, this rank has {len(self.local.regions)}"
            )
        out: list[_LinkBatch] = []
        run: list[Link] = []
        for k in self.links:
            if group_of_region[k.local] != g:
                continue
            if run and not (
                self.local.regions[k.local].group == self.local.regions[run[-1].local].group
                and _same_template(k.template, run[0].template)
            ):
                out.append(_LinkBatch.of(run, self.local, self.remote))
                run = []
            run.append(k)
        if run:
            out.append(_LinkBatch.of(run, self.local, self.remote))
        batches = self._layer_batches[key] = tuple(out)
        return batches

    @functools.cached_property
    def _layer_batches(self) -> dict[tuple[tuple[int, ...], int], tuple[_LinkBatch, ...]]:
        return {}

    def plan(
        self,
        p_groups: BlockGroups,
        d_groups: BlockGroups,
        skips: Sequence[int] = (),
        *,
        merge: bool = False,
        min_pieces: int = 0,
        layer_group: tuple[tuple[int, ...], int] | None = None,
    ) -> WritePlan:
        """Plan the WRITE of P's logical blocks into D's (both per KV-cache group).

        ``p_groups`` are all of P's blocks for the request, from token 0; ``d_groups`` are the
        blocks D registered, after ``skips[g]`` blocks D already had (a prefix hit). Without
        ``skips``, D's blocks are the last ones (the token counts agree at the end).

        With ``merge``, pieces contiguous on both sides are joined into runs (per link, from
        the shared block arithmetic, so no per-piece array is built), and if the runs are at
        most :data:`RUNS_SHARE` of the pieces the plan carries them as explicit rows. A plan of
        fewer than ``min_pieces`` pieces is never merged (posting it by index costs less).

        ``layer_group`` = (layer group of each local region, g): only the pieces of the regions
        in layer group ``g`` (a layer-wise push's WRITE of the layers computed so far); their
        indices point into the same prepared lists as a whole plan's.
        """
        batches = self._batches if layer_group is None else self.layer_batches(*layer_group)
        pieces = list(self._batch_pieces(p_groups, d_groups, skips, batches))
        num_blocks = max((len(d) for d in d_groups), default=0)
        if not pieces:
            return WritePlan(0, 0, num_blocks if self.links else 0)
        num_descs = sum(len(b.local_base) * len(rows[0]) for b, rows in pieces)
        nbytes = sum(len(b.local_base) * int(b.template.length[rows[3]].sum()) for b, rows in pieces)

        def indices() -> tuple[IndexArray, IndexArray]:
            lidx: list[IndexArray] = []
            ridx: list[IndexArray] = []
            for batch, (lb, rb, _, e) in pieces:
                n = len(batch.template)
                lidx.append((batch.local_base[:, None] + (lb * n + e)[None, :]).ravel())
                ridx.append((batch.remote_base[:, None] + (rb * n + e)[None, :]).ravel())
            return _joined(lidx), _joined(ridx)

        def merged() -> int:
            addrs = [_piece_addrs(batch, rows) for batch, rows in pieces]
            lens = _joined([_per_link(batch, batch.template.length[rows[3]]) for batch, rows in pieces])
            return count_merged(_joined([a for a, _ in addrs]), _joined([b for _, b in addrs]), lens)

        runs = _runs(pieces, int(num_descs * RUNS_SHARE)) if merge and num_descs >= min_pieces else None
        return WritePlan(
            nbytes=nbytes,
            num_descs=num_descs,
            num_blocks=num_blocks,
            indices=indices,
            count_merged=merged,
            runs=runs,
        )

    def staged_grids(
        self, p_groups: BlockGroups, d_groups: BlockGroups, skips: Sequence[int], image_bases: Sequence[int]
    ) -> list[RowGrid]:
        """Every piece this rank writes in a staged push (:mod:`pushactors.core.staging`): the
        same pieces as :meth:`plan`, from our blocks to their offsets in the image of D's
        registered blocks. One grid per run of links (the links' bases and strides × the
        pieces' blocks and offsets), so no row need be built on the host."""
        out: list[RowGrid] = []
        bases = np.asarray(image_bases, dtype=np.int64)
        for batch, (lb, _, q, e) in self._batch_pieces(p_groups, d_groups, skips):
            base = bases[batch.remote_region]
            if (base < 0).any():
                raise PlanError("D's image has no room for a region this push writes")
            t = batch.template
            out.append(
                RowGrid(
                    src=batch.local_addr,
                    src_stride=batch.local_stride,
                    dst=base,
                    dst_stride=batch.remote_block_len,
                    length=np.zeros(len(base), dtype=np.int64),
                    src_block=lb,
                    src_off=t.loff[e],
                    dst_block=q,
                    dst_off=t.roff[e],
                    piece_length=t.length[e],
                )
            )
        return out

    def _batch_pieces(
        self,
        p_groups: BlockGroups,
        d_groups: BlockGroups,
        skips: Sequence[int],
        batches: tuple[_LinkBatch, ...] | None = None,
    ) -> Iterator[tuple[_LinkBatch, tuple[IndexArray, IndexArray, IndexArray, IndexArray]]]:
        """Per run of links with pieces: the run and its block arithmetic."""
        rows_for = self.rows_source(p_groups, d_groups, skips)
        for batch in self._batches if batches is None else batches:
            rows = rows_for(batch.group, batch.template)
            if rows is not None:
                yield batch, rows

    def rows_source(
        self, p_groups: BlockGroups, d_groups: BlockGroups, skips: Sequence[int]
    ) -> Callable[[int, Template], tuple[IndexArray, IndexArray, IndexArray, IndexArray] | None]:
        """After every check of the request's blocks: a function giving the block arithmetic
        of (KV group, template), computed once per group and placement and shared by every
        link placed alike (every per-layer region of a layout)."""
        if len(d_groups) != len(p_groups):
            raise PlanError(f"D registered {len(d_groups)} KV groups, P has {len(p_groups)}")
        if skips and len(skips) != len(d_groups):
            raise PlanError(f"{len(skips)} prefix counts for {len(d_groups)} KV groups")
        local, remote = self.local, self.remote
        lratio, rratio = local.physical_blocks_per_logical, remote.physical_blocks_per_logical
        l_cap, r_cap = self._capacities
        for g, (p, d) in enumerate(zip(p_groups, d_groups, strict=True)):
            _check_logical("P", p, l_cap.get(g, 0))
            _check_logical("D", d, r_cap.get(g, 0))
        first = [
            self._first_token(len(p), len(d), skips[g] if skips else None)
            for g, (p, d) in enumerate(zip(p_groups, d_groups, strict=True))
        ]
        if self._deepest_group >= len(d_groups):
            raise PlanError(f"region in KV group {self._deepest_group} but only {len(d_groups)} groups")
        shared: dict[tuple[int, bytes], tuple[IndexArray, IndexArray, IndexArray, IndexArray] | None] = {}

        def rows_for(g: int, t: Template) -> tuple[IndexArray, IndexArray, IndexArray, IndexArray] | None:
            key = (g, t.placement)
            if key not in shared:
                shared[key] = self._rows_of(t, p_groups[g], d_groups[g], first[g], lratio, rratio)
            return shared[key]

        return rows_for

    def _rows_of(
        self, t: Template, p_ids: Sequence[int], d_ids: Sequence[int], first: int, lratio: int, rratio: int
    ) -> tuple[IndexArray, IndexArray, IndexArray, IndexArray] | None:
        lp = physical_block_ids(p_ids, lratio)
        rp = physical_block_ids(d_ids, rratio)
        if not len(rp):
            return None
        a = first // self.remote.tokens_per_block + np.arange(len(rp), dtype=np.int64)
        p_abs = (a // t.kd)[:, None] * t.kp + t.lpos[None, :]
        mask = ((a % t.kd)[:, None] == t.rpos[None, :]) & (p_abs < len(lp))
        q, e = np.nonzero(mask)
        if not len(q):
            return None
        return lp[p_abs[q, e]], rp[q], q.astype(np.int64), e.astype(np.int64)

    def _first_token(self, p_count: int, d_count: int, skip: int | None) -> int:
        """Token position of D's first registered block."""
        bs_p, bs_d = self.local.block_size, self.remote.block_size
        total = -(-p_count * bs_p // bs_d)  # D blocks P's tokens fill (exact when bs_p divides bs_d)
        if skip is None:
            if bs_d % bs_p:
                raise PlanError("D's blocks are smaller than P's: D must say how many blocks it had cached")
            skip = total - d_count
        if skip < 0 or skip + d_count > total:
            raise PlanError(f"D registered {d_count} blocks after {skip} cached, but P has only {total}")
        return skip * bs_d


def _same_template(a: Template, b: Template) -> bool:
    return a is b or (
        a.kp == b.kp
        and a.kd == b.kd
        and all(
            np.array_equal(x, y)
            for x, y in ((a.lpos, b.lpos), (a.loff, b.loff), (a.rpos, b.rpos), (a.roff, b.roff), (a.length, b.length))
        )
    )


@dataclass(frozen=True)
class _LinkBatch:
    """Consecutive links with one template: their bases and strides as arrays."""

    group: int
    template: Template
    local_base: IndexArray
    remote_base: IndexArray
    local_addr: IndexArray
    local_stride: IndexArray
    remote_addr: IndexArray
    remote_stride: IndexArray
    remote_region: IndexArray
    remote_block_len: IndexArray
    local_device: IndexArray
    remote_device: IndexArray

    @classmethod
    def of(cls, links: Sequence[Link], local: KVLayout, remote: RemoteLayout) -> _LinkBatch:
        lr = [local.regions[k.local] for k in links]
        rr = [remote.regions[k.remote] for k in links]

        def col(values: Iterable[int]) -> IndexArray:
            return np.fromiter(values, dtype=np.int64)

        return cls(
            group=lr[0].group,
            template=links[0].template,
            local_base=col(k.local_base for k in links),
            remote_base=col(k.remote_base for k in links),
            local_addr=col(r.base_addr for r in lr),
            local_stride=col(r.stride for r in lr),
            remote_addr=col(r.base_addr for r in rr),
            remote_stride=col(r.stride for r in rr),
            remote_region=col(k.remote for k in links),
            remote_block_len=col(r.block_len for r in rr),
            local_device=col(r.device_id for r in lr),
            remote_device=col(r.device_id for r in rr),
        )


def _opaque(r: KVRegion, heads: int, side: str) -> BlockShape:
    try:
        return BlockShape.opaque(r.block_len, heads)
    except ShapeError as exc:
        raise LayoutError(f"{side} region {r.members or '?'}: {exc}") from None


class GroupedRegion(Protocol):
    """What :func:`capacity` reads of a region: a :class:`KVRegion` or an advertised
    :class:`~pushactors.protocol.RegionInfo`."""

    @property
    def group(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...


def capacity(regions: Iterable[GroupedRegion], physical_blocks_per_logical: int) -> tuple[int, ...]:
    """Logical blocks per KV group (indexed by group) a side holds: the smallest region of the
    group, in logical blocks; 0 for a group below the highest that no region is in. The one
    formula for P's plans, its check of what D advertised, and its bound on a registration."""
    smallest: dict[int, int] = {}
    for r in regions:
        smallest[r.group] = min(smallest.get(r.group, r.num_blocks), r.num_blocks)
    ratio = max(1, int(physical_blocks_per_logical))
    return tuple(smallest.get(g, 0) // ratio for g in range(max(smallest) + 1)) if smallest else ()


def _rows(parts: Sequence[tuple[KVRegion, IndexArray, IndexArray]]) -> npt.NDArray[np.uint64]:
    """Nx3 (address, length, device) rows: per part, every block × every template entry."""
    out = []
    for r, off, length in parts:
        addrs = (
            np.uint64(r.base_addr)
            + np.arange(r.num_blocks, dtype=np.uint64)[:, None] * np.uint64(r.stride)
            + off.astype(np.uint64)[None, :]
        ).ravel()
        block = np.empty((len(addrs), 3), dtype=np.uint64)
        block[:, 0] = addrs
        block[:, 1] = np.tile(length.astype(np.uint64), r.num_blocks)
        block[:, 2] = r.device_id
        out.append(block)
    return np.concatenate(out) if out else np.empty((0, 3), dtype=np.uint64)


def _check_logical(side: str, ids: Sequence[int], capacity: int) -> None:
    if len(ids) and (min(ids) < 0 or max(ids) >= capacity):  # two C loops; the culprit only on failure
        bad = next(b for b in ids if not 0 <= b < capacity)
        raise PlanError(f"{side} block {bad} outside logical capacity {capacity}")


def _per_link(batch: _LinkBatch, length: IndexArray) -> IndexArray:
    """A run's piece lengths for each of its links, link-major (``np.tile``, in C)."""
    if len(batch.local_base) > 1:
        return length[None, :].repeat(len(batch.local_base), axis=0).ravel()
    return length


def _piece_addrs(
    batch: _LinkBatch, rows: tuple[IndexArray, IndexArray, IndexArray, IndexArray]
) -> tuple[IndexArray, IndexArray]:
    """Local and remote address of every piece of a run, link-major (what merging counts)."""
    lb, rb, _, e = rows
    t = batch.template
    local = (batch.local_addr[:, None] + lb[None, :] * batch.local_stride[:, None] + t.loff[e]).ravel()
    remote = (batch.remote_addr[:, None] + rb[None, :] * batch.remote_stride[:, None] + t.roff[e]).ravel()
    return local, remote


def _runs(
    pieces: Sequence[tuple[_LinkBatch, tuple[IndexArray, IndexArray, IndexArray, IndexArray]]], limit: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None:
    """The plan's pieces joined into runs contiguous on both sides, as (address, length,
    device) rows here and there, in the plan's own order (link-major); None if there would be
    more than ``limit``.

    Whether piece k+1 continues piece k depends only on the blocks, the template entries and
    the link's two strides, never on its base addresses: so the joins are found once per run
    of links (per distinct pair of strides), on arrays as long as one link's pieces, and only
    the runs are broadcast over the links.

    Runs never join across links, even where two regions touch: each region lies inside one
    registered allocation, but neighbours may be two (per-layer tensors back to back), and
    NIXL refuses a descriptor that crosses registrations (NIXL_ERR_NOT_FOUND at prep, seen
    on the H200 with per-layer tensors)."""
    if sum(len(batch.local_stride) for batch, _ in pieces) > limit:
        return None  # every link with pieces is at least one run: too many before any join
    cols: list[list[IndexArray]] = [[], [], [], [], []]
    count = 0
    for batch, (lb, rb, _, e) in pieces:
        t = batch.template
        plen, lo, ro = t.length[e], t.loff[e], t.roff[e]
        ls_all, rs_all = batch.local_stride, batch.remote_stride
        if len(ls_all) == 1 or ((ls_all == ls_all[0]).all() and (rs_all == rs_all[0]).all()):
            pairs, which = [(int(ls_all[0]), int(rs_all[0]))], np.zeros(len(ls_all), dtype=np.int64)
        else:
            uniq, inverse = np.unique(np.stack([ls_all, rs_all], axis=1), axis=0, return_inverse=True)
            pairs, which = [(int(a), int(b)) for a, b in uniq.tolist()], inverse.ravel()
        per_link: list[tuple[IndexArray, IndexArray, IndexArray]] = []
        for ls, rs in pairs:
            joins = ((lb[1:] - lb[:-1]) * ls + lo[1:] == lo[:-1] + plen[:-1]) & (
                (rb[1:] - rb[:-1]) * rs + ro[1:] == ro[:-1] + plen[:-1]
            )
            starts = run_starts(joins)
            per_link.append((lb[starts] * ls + lo[starts], rb[starts] * rs + ro[starts], np.add.reduceat(plen, starts)))
        count += (
            sum(len(per_link[w][0]) for w in which.tolist()) if len(pairs) > 1 else len(which) * len(per_link[0][0])
        )
        if count > limit:
            return None
        if len(pairs) == 1:  # every link strided alike (the usual case): one broadcast
            sl, sr, size = per_link[0]
            k = len(sl)
            cols[0].append((batch.local_addr[:, None] + sl[None, :]).ravel())
            cols[1].append((batch.remote_addr[:, None] + sr[None, :]).ravel())
            cols[2].append(np.tile(size, len(which)))
            cols[3].append(np.repeat(batch.local_device, k))
            cols[4].append(np.repeat(batch.remote_device, k))
            continue
        for j, w in enumerate(which.tolist()):
            sl, sr, size = per_link[w]
            cols[0].append(batch.local_addr[j] + sl)
            cols[1].append(batch.remote_addr[j] + sr)
            cols[2].append(size)
            cols[3].append(np.full(len(sl), batch.local_device[j]))
            cols[4].append(np.full(len(sl), batch.remote_device[j]))
    la, ra, n, ld, rd = (_joined(c) for c in cols)
    local = np.empty((len(la), 3), dtype=np.uint64)
    remote = np.empty((len(la), 3), dtype=np.uint64)
    local[:, 0], local[:, 1], local[:, 2] = la, n, ld
    remote[:, 0], remote[:, 1], remote[:, 2] = ra, n, rd
    return local, remote


def run_starts(joins: npt.NDArray[np.bool_]) -> IndexArray:
    """Where runs start, given whether each element continues the one before it."""
    head = np.empty(len(joins) + 1, dtype=np.bool_)
    head[0] = True
    np.logical_not(joins, out=head[1:])
    return np.flatnonzero(head)


def _joined(parts: list[IndexArray]) -> IndexArray:
    """One array of ``parts`` (most plans have one run: no copy)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def count_merged(laddr: IndexArray, raddr: IndexArray, lens: IndexArray) -> int:
    """Descriptors left after merging neighbours that are contiguous on both sides."""
    if len(laddr) == 0:
        return 0
    joins = (laddr[1:] == laddr[:-1] + lens[:-1]) & (raddr[1:] == raddr[:-1] + lens[:-1])
    return int(len(laddr) - np.count_nonzero(joins))
