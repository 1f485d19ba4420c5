"""KV layout and WRITE plans (SPEC §4): regions, logical→physical ids, trims, descriptors.

A *region* is one strided run of equally sized physical blocks in registered memory (a layer's
K cache, or its fused KV). Descriptor lists are *region-major*: the descriptor of physical
block ``b`` of region ``r`` sits at index ``offset[r] + b``, so a WRITE is two index arrays into
lists prepared once per remote rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..protocol import AgentInfo, BlockGroups, MemoryRange, MemType, RegionInfo
from .topology import Slice, TopologyError

if TYPE_CHECKING:
    import torch

IndexArray = npt.NDArray[np.int64]


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
    members: tuple[str, ...] = ()
    group: int = 0

    def info(self) -> RegionInfo:
        return RegionInfo(
            base_addr=self.base_addr,
            block_len=self.block_len,
            stride=self.stride,
            num_blocks=self.num_blocks,
            device_id=self.device_id,
            members=self.members,
            group=self.group,
        )

    @classmethod
    def from_info(cls, info: RegionInfo) -> KVRegion:
        return cls(
            info.base_addr,
            info.block_len,
            info.stride,
            info.num_blocks,
            info.device_id,
            info.members,
            info.group,
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

    def __post_init__(self) -> None:
        if not self.regions:
            raise LayoutError("a KV layout needs at least one region")
        if self.physical_blocks_per_logical < 1:
            raise LayoutError("physical_blocks_per_logical must be >= 1")

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
    ) -> KVLayout:
        """Derive regions from per-layer KV tensors.

        Accepted per-layer shapes (block dimension found from ``num_blocks``, else dim 0):
        ``[num_blocks, ...]`` is one region; ``[2, num_blocks, ...]`` (K and V apart) is two.
        Layers that share one physical allocation become one region with several members.
        """
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
        )


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
# Descriptor lists and region pairing
# --------------------------------------------------------------------------------------------
def descriptor_array(regions: Sequence[KVRegion], piece: Slice) -> npt.NDArray[np.uint64]:
    """Nx3 (address, length, device) rows, region-major, one per physical block."""
    rows = []
    for r in regions:
        off, length = piece.span(r.block_len)
        addrs = r.base_addr + off + np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.stride)
        block = np.empty((r.num_blocks, 3), dtype=np.uint64)
        block[:, 0] = addrs
        block[:, 1] = length
        block[:, 2] = r.device_id
        rows.append(block)
    return np.concatenate(rows) if rows else np.empty((0, 3), dtype=np.uint64)


def region_offsets(regions: Sequence[KVRegion]) -> IndexArray:
    counts = np.array([r.num_blocks for r in regions], dtype=np.int64)
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def pair_regions(local: Sequence[KVRegion], remote: Sequence[KVRegion]) -> tuple[int, ...]:
    """For each local region, the index of the remote region that holds the same layers.

    Routing is by layer name (``members``) when both sides advertise them, so PP stages and
    pooled (HMA) regions pair correctly even when region orders or representatives differ.
    Every invariant violation is an error; there is no silent fallback.
    """
    local_named = all(r.members for r in local)
    remote_named = all(r.members for r in remote)
    if not (local_named and remote_named):
        if local_named and len(local) != len(remote):
            raise LayoutError("remote omits region members that this layout needs for routing")
        if len(local) != len(remote):
            raise LayoutError(f"{len(local)} local regions but {len(remote)} remote regions")
        return tuple(range(len(local)))
    owner: dict[str, int] = {}
    for j, r in enumerate(remote):
        for m in r.members:
            if m in owner and owner[m] != j:
                raise LayoutError(f"remote advertises layer {m!r} in two regions")
            owner[m] = j
    pairs = []
    for r in local:
        found = {owner.get(m) for m in r.members}
        if None in found:
            missing = [m for m in r.members if m not in owner]
            raise LayoutError(f"remote does not advertise layers {missing}")
        if len(found) != 1:
            raise LayoutError(f"local region {r.members} spans several remote regions")
        pairs.append(found.pop())
    return tuple(pairs)  # type: ignore[arg-type]


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

    @classmethod
    def from_info(cls, info: AgentInfo, agent_name: str, clock_offset: float = 0.0) -> RemoteLayout:
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
        )


@dataclass
class WritePlan:
    """Index arrays into the prepared local/remote lists for one WRITE, plus its cost."""

    local_idx: IndexArray
    remote_idx: IndexArray
    nbytes: int
    num_descs: int
    merged_descs: int  # after merging runs contiguous on both sides
    num_blocks: int  # logical blocks written (per region)


@dataclass
class PairedLayout:
    """Local and one remote rank's regions, paired and sliced for WRITEs to it."""

    local: KVLayout
    remote: RemoteLayout
    local_slice: Slice
    remote_slice: Slice
    pairs: tuple[int, ...] = field(init=False)
    local_offsets: IndexArray = field(init=False)
    remote_offsets: IndexArray = field(init=False)

    def __post_init__(self) -> None:
        if self.local.block_size != self.remote.block_size:
            raise LayoutError(f"block size {self.local.block_size} != remote {self.remote.block_size} tokens")
        if self.local.mem_type != self.remote.mem_type:
            # Not fatal for NIXL, but a DRAM↔VRAM mix is almost always a misconfiguration.
            pass
        self.pairs = pair_regions(self.local.regions, self.remote.regions)
        for r, j in zip(self.local.regions, self.pairs, strict=True):
            rr = self.remote.regions[j]
            _, llen = self.local_slice.span(r.block_len)
            _, rlen = self.remote_slice.span(rr.block_len)
            if llen != rlen:
                raise LayoutError(
                    f"region {r.members or '?'}: {llen} local bytes per block slice != {rlen} remote bytes"
                )
            if r.group != rr.group:
                raise LayoutError(f"region {r.members or '?'}: KV-cache group differs")
        self.local_offsets = region_offsets(self.local.regions)
        self.remote_offsets = region_offsets(self.remote.regions)

    def local_descriptors(self) -> npt.NDArray[np.uint64]:
        return descriptor_array(self.local.regions, self.local_slice)

    def remote_descriptors(self) -> npt.NDArray[np.uint64]:
        return descriptor_array(self.remote.regions, self.remote_slice)

    def plan(self, p_groups: BlockGroups, d_groups: BlockGroups) -> WritePlan:
        """Plan the WRITE of P's logical blocks into D's (both per KV-cache group)."""
        if len(d_groups) != len(p_groups):
            raise PlanError(f"D registered {len(d_groups)} KV groups, P has {len(p_groups)}")
        local_parts: list[IndexArray] = []
        remote_parts: list[IndexArray] = []
        laddr_parts: list[IndexArray] = []
        raddr_parts: list[IndexArray] = []
        lens: list[IndexArray] = []
        num_logical = 0
        trimmed = [trim_to_remote(p, len(d)) for p, d in zip(p_groups, d_groups, strict=True)]
        for i, (r, j) in enumerate(zip(self.local.regions, self.pairs, strict=True)):
            if r.group >= len(d_groups):
                raise PlanError(f"region in KV group {r.group} but only {len(d_groups)} groups")
            rr = self.remote.regions[j]
            # Check logical ids as Python ints first: expanding a huge id in int64 wraps around.
            _check_logical("P", trimmed[r.group], r.num_blocks // self.local.physical_blocks_per_logical)
            _check_logical("D", d_groups[r.group], rr.num_blocks // self.remote.physical_blocks_per_logical)
            lp = physical_block_ids(trimmed[r.group], self.local.physical_blocks_per_logical)
            rp = physical_block_ids(d_groups[r.group], self.remote.physical_blocks_per_logical)
            if len(lp) != len(rp):
                raise PlanError(
                    f"{len(lp)} local physical blocks for {len(rp)} remote ones (physical-per-logical ratios differ)"
                )
            rr = self.remote.regions[j]
            if (len(lp) and int(lp.min()) < 0) or (len(rp) and int(rp.min()) < 0):
                raise PlanError("negative block id")
            if len(lp) and int(lp.max()) >= r.num_blocks:
                raise PlanError(f"P block {int(lp.max())} beyond local capacity {r.num_blocks}")
            if len(rp) and int(rp.max()) >= rr.num_blocks:
                raise PlanError(f"D block {int(rp.max())} beyond remote capacity {rr.num_blocks}")
            num_logical = max(num_logical, len(trimmed[r.group]))
            local_parts.append(self.local_offsets[i] + lp)
            remote_parts.append(self.remote_offsets[j] + rp)
            loff, length = self.local_slice.span(r.block_len)
            roff, _ = self.remote_slice.span(rr.block_len)
            laddr_parts.append(r.base_addr + loff + lp * r.stride)
            raddr_parts.append(rr.base_addr + roff + rp * rr.stride)
            lens.append(np.full(len(lp), length, dtype=np.int64))
        if not local_parts:
            empty = np.empty(0, dtype=np.int64)
            return WritePlan(empty, empty, 0, 0, 0, 0)
        local_idx = np.concatenate(local_parts)
        remote_idx = np.concatenate(remote_parts)
        length_arr = np.concatenate(lens)
        return WritePlan(
            local_idx=local_idx,
            remote_idx=remote_idx,
            nbytes=int(length_arr.sum()),
            num_descs=len(local_idx),
            merged_descs=count_merged(np.concatenate(laddr_parts), np.concatenate(raddr_parts), length_arr),
            num_blocks=num_logical,
        )


def _check_logical(side: str, ids: Sequence[int], capacity: int) -> None:
    for b in ids:
        if not 0 <= b < capacity:
            raise PlanError(f"{side} block {b} outside logical capacity {capacity}")


def count_merged(laddr: IndexArray, raddr: IndexArray, lens: IndexArray) -> int:
    """Descriptors left after merging neighbours that are contiguous on both sides."""
    if len(laddr) == 0:
        return 0
    joins = (laddr[1:] == laddr[:-1] + lens[:-1]) & (raddr[1:] == raddr[:-1] + lens[:-1])
    return int(len(laddr) - np.count_nonzero(joins))


def check_pairable(local: KVLayout, remote: RemoteLayout, local_slice: Slice, remote_slice: Slice) -> PairedLayout:
    """Build a :class:`PairedLayout`, turning topology errors into layout errors."""
    try:
        return PairedLayout(local, remote, local_slice, remote_slice)
    except TopologyError as exc:
        raise LayoutError(str(exc)) from None
