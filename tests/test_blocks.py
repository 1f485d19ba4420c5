"""KV layout and WRITE plans (docs/protocol.md, 'Blocks', 'Topologies'): regions, block ids, trims,
descriptors, pairing, plans."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from pushactors.core.blocks import (
    KVLayout,
    KVRegion,
    LayoutError,
    PairedLayout,
    PlanError,
    RemoteLayout,
    capacity,
    count_merged,
    pair_regions,
    physical_block_ids,
    trim_to_remote,
)
from pushactors.core.topology import default_heads, rank_heads, registration_sources, write_heads
from pushactors.protocol import AgentInfo, ClockSample, MemoryRange, RegionInfo


# ============================================================================================
# Block ids
# ============================================================================================
def test_physical_block_ids_ratio_1_is_identity() -> None:
    out = physical_block_ids([5, 0, 3], 1)
    assert out.dtype == np.int64
    assert out.tolist() == [5, 0, 3]
    assert physical_block_ids([], 1).tolist() == []


def test_physical_block_ids_ratio_3_expands_in_order() -> None:
    out = physical_block_ids([0, 2, 1], 3)
    assert out.dtype == np.int64
    assert out.tolist() == [0, 1, 2, 6, 7, 8, 3, 4, 5]
    assert physical_block_ids(np.array([7]), 3).tolist() == [21, 22, 23]
    assert physical_block_ids([], 3).tolist() == []


@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 16])
def test_physical_block_ids_rule(ratio: int) -> None:
    logical = [9, 1, 4, 4, 0]
    expected = [b * ratio + i for b in logical for i in range(ratio)]
    assert physical_block_ids(logical, ratio).tolist() == expected


def test_trim_to_remote_keeps_the_last_blocks() -> None:
    p = (10, 11, 12, 13, 14)
    assert trim_to_remote(p, 2) == (13, 14)
    assert trim_to_remote(p, 1) == (14,)
    assert trim_to_remote(p, 5) == p
    assert trim_to_remote(p, 0) == ()
    assert trim_to_remote([], 0) == ()
    assert trim_to_remote([7, 8, 9], 2) == (8, 9)


def test_trim_to_remote_refuses_more_than_p_has() -> None:
    with pytest.raises(PlanError):
        trim_to_remote((1, 2), 3)
    with pytest.raises(PlanError):
        trim_to_remote((), 1)


# ============================================================================================
# KVLayout.from_tensors (CPU tensors)
# ============================================================================================
def test_from_tensors_one_region_per_layer() -> None:
    l0 = torch.zeros(6, 4, 8, dtype=torch.float16)
    l1 = torch.zeros(6, 4, 8, dtype=torch.float16)
    layout = KVLayout.from_tensors({"layers.0": l0, "layers.1": l1}, block_size=16)
    assert layout.mem_type == "DRAM"
    assert layout.block_size == 16
    assert layout.physical_blocks_per_logical == 1
    assert layout.num_groups == 1
    assert layout.regions == (
        KVRegion(l0.data_ptr(), 64, 64, 6, 0, ("layers.0",), 0),
        KVRegion(l1.data_ptr(), 64, 64, 6, 0, ("layers.1",), 0),
    )
    assert set(layout.memory) == {
        MemoryRange(l0.data_ptr(), 6 * 64, 0),
        MemoryRange(l1.data_ptr(), 6 * 64, 0),
    }
    assert len(layout.memory) == 2


def test_from_tensors_padded_blocks_have_a_stride_larger_than_their_length() -> None:
    storage = torch.zeros(5, 3, 8, dtype=torch.float32)
    t = storage[:, :2]  # each block is 2*8 floats, blocks 3*8 floats apart
    layout = KVLayout.from_tensors({"l": t}, block_size=8, num_blocks=5)
    (r,) = layout.regions
    assert (r.base_addr, r.block_len, r.stride, r.num_blocks) == (storage.data_ptr(), 64, 96, 5)
    assert layout.memory == (MemoryRange(storage.data_ptr(), 5 * 96, 0),)


def test_from_tensors_k_and_v_apart_are_two_regions() -> None:
    t = torch.zeros(2, 6, 4, 8, dtype=torch.bfloat16)
    layout = KVLayout.from_tensors({"attn": t}, block_size=16, num_blocks=6)
    k, v = layout.regions
    es = t.element_size()
    assert k == KVRegion(t.data_ptr(), 4 * 8 * es, 4 * 8 * es, 6, 0, ("attn[0]",), 0)
    assert v == KVRegion(t.data_ptr() + t.stride(0) * es, 4 * 8 * es, 4 * 8 * es, 6, 0, ("attn[1]",), 0)
    assert v.base_addr - k.base_addr == 6 * 4 * 8 * es
    assert layout.memory == (MemoryRange(t.data_ptr(), 2 * 6 * 4 * 8 * es, 0),)


def test_from_tensors_k_and_v_interleaved_per_block() -> None:
    """[num_blocks, 2, ...] storage seen as [2, num_blocks, ...]: V sits right after K in each block."""
    storage = torch.zeros(6, 2, 4, 8, dtype=torch.float16)
    t = storage.transpose(0, 1)
    layout = KVLayout.from_tensors({"x": t}, block_size=16, num_blocks=6)
    k, v = layout.regions
    assert (k.base_addr, k.block_len, k.stride, k.num_blocks) == (storage.data_ptr(), 64, 128, 6)
    assert (v.base_addr, v.block_len, v.stride, v.num_blocks) == (storage.data_ptr() + 64, 64, 128, 6)
    assert (k.members, v.members) == (("x[0]",), ("x[1]",))


def test_views_of_one_storage_at_different_offsets_share_one_memory_range() -> None:
    pool = torch.zeros(10, 4, 8, dtype=torch.float16)
    a, b = pool[:5], pool[5:]
    layout = KVLayout.from_tensors({"a": a, "b": b}, block_size=16)
    assert len(layout.regions) == 2
    ra, rb = layout.regions
    assert (ra.base_addr, ra.num_blocks, ra.members) == (pool.data_ptr(), 5, ("a",))
    assert (rb.base_addr, rb.num_blocks, rb.members) == (pool.data_ptr() + 5 * 64, 5, ("b",))
    # registered once, as a whole
    assert layout.memory == (MemoryRange(pool.data_ptr(), 10 * 64, 0),)


def test_identical_views_are_one_region_with_two_members() -> None:
    pool = torch.zeros(4, 16, dtype=torch.float32)
    layout = KVLayout.from_tensors({"layers.0": pool, "layers.3": pool.view(4, 16)}, block_size=16)
    assert layout.regions == (KVRegion(pool.data_ptr(), 64, 64, 4, 0, ("layers.0", "layers.3"), 0),)
    assert layout.memory == (MemoryRange(pool.data_ptr(), 4 * 64, 0),)


def test_identical_k_v_views_merge_per_half() -> None:
    t = torch.zeros(2, 3, 8, dtype=torch.float32)
    layout = KVLayout.from_tensors({"a": t, "b": t}, block_size=4, num_blocks=3)
    assert [r.members for r in layout.regions] == [("a[0]", "b[0]"), ("a[1]", "b[1]")]
    assert len(layout.memory) == 1


def test_from_tensors_groups() -> None:
    full = torch.zeros(4, 8)
    sliding = torch.zeros(4, 8)
    layout = KVLayout.from_tensors({"full": full, "swa": sliding}, block_size=16, groups={"swa": 1})
    assert [r.group for r in layout.regions] == [0, 1]
    assert layout.num_groups == 2


def test_from_tensors_same_view_in_two_groups_stays_two_regions() -> None:
    pool = torch.zeros(4, 8)
    layout = KVLayout.from_tensors({"a": pool, "b": pool}, block_size=16, groups={"b": 1})
    assert [(r.members, r.group) for r in layout.regions] == [(("a",), 0), (("b",), 1)]
    assert len(layout.memory) == 1


def test_from_tensors_carries_the_ratio() -> None:
    layout = KVLayout.from_tensors({"a": torch.zeros(8, 4)}, block_size=32, physical_blocks_per_logical=2)
    assert layout.physical_blocks_per_logical == 2
    assert layout.block_size == 32


def test_from_tensors_without_tensors() -> None:
    with pytest.raises(LayoutError):
        KVLayout.from_tensors({}, block_size=16)


@pytest.mark.parametrize(
    ("tensor", "num_blocks"),
    [
        (torch.zeros(8), None),  # no block dimension
        (torch.zeros(8), 8),
        (torch.zeros(()), None),
        (torch.zeros(5, 4), 6),  # block count not found
        (torch.zeros(2, 5, 4), 6),
        (torch.zeros(3, 6, 4), 6),  # [3, N, ...] is neither layout
        (torch.zeros(2, 6), 6),  # [2, N] without a block body
    ],
)
def test_from_tensors_without_the_block_dimension(tensor: torch.Tensor, num_blocks: int | None) -> None:
    with pytest.raises(LayoutError):
        KVLayout.from_tensors({"l": tensor}, block_size=16, num_blocks=num_blocks)


def test_from_tensors_non_contiguous_block() -> None:
    t = torch.zeros(6, 8, 4).transpose(1, 2)  # each block is [4, 8] with strides (1, 4)
    with pytest.raises(LayoutError):
        KVLayout.from_tensors({"l": t}, block_size=16)
    kv = torch.zeros(2, 6, 8, 4).transpose(2, 3)
    with pytest.raises(LayoutError):
        KVLayout.from_tensors({"l": kv}, block_size=16, num_blocks=6)
    sliced = torch.zeros(6, 4, 8)[:, :, :4]  # every row of a block cut short
    with pytest.raises(LayoutError):
        KVLayout.from_tensors({"l": sliced}, block_size=16)


@pytest.mark.parametrize(
    ("tensor", "num_blocks"),
    [
        (torch.zeros(1, 4, 8).expand(6, 4, 8), None),  # every block aliases one: stride 0
        (torch.zeros(2, 1, 4).expand(2, 6, 4), 6),  # the same, K/V apart
        (torch.zeros(200).as_strided((6, 4, 8), (16, 8, 1)), None),  # blocks overlap: stride < length
        (torch.zeros(0, 4, 8), None),  # no blocks at all
        (torch.zeros(6, 0), None),  # blocks of zero bytes
    ],
    ids=["expanded", "expanded-kv", "overlapping", "zero-blocks", "empty-blocks"],
)
def test_from_tensors_unservable_blocks_are_layout_errors(tensor: torch.Tensor, num_blocks: int | None) -> None:
    """Tensors whose blocks cannot be advertised (RegionInfo needs stride >= block_len >= 1 and
    at least one block) must fail at configuration with LayoutError, not later or otherwise."""
    with pytest.raises(LayoutError):
        KVLayout.from_tensors({"l": tensor}, block_size=16, num_blocks=num_blocks)


def test_from_tensors_one_bad_layer_fails_the_whole_layout() -> None:
    good = torch.zeros(6, 4, 8)
    bad = torch.zeros(6, 8, 4).transpose(1, 2)
    with pytest.raises(LayoutError):
        KVLayout.from_tensors({"good": good, "bad": bad}, block_size=16)


def test_from_tensors_mixed_or_unsupported_devices() -> None:
    cpu = torch.zeros(4, 8)
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(LayoutError, match="mixed"):
        KVLayout.from_tensors({"a": cpu, "b": meta}, block_size=16)
    with pytest.raises(LayoutError):
        KVLayout.from_tensors({"a": meta}, block_size=16)


def test_layout_invariants() -> None:
    with pytest.raises(LayoutError):
        KVLayout(regions=(), mem_type="DRAM", block_size=16)
    with pytest.raises(LayoutError):
        KVLayout(regions=(KVRegion(0, 8, 8, 1),), mem_type="DRAM", block_size=16, physical_blocks_per_logical=0)


def test_layout_region_infos_round_trip() -> None:
    region = KVRegion(0x1000, 64, 128, 7, device_id=1, members=("a", "b"), group=1)
    layout = KVLayout(regions=(region,), mem_type="VRAM", block_size=16)
    (info,) = layout.region_infos
    assert (info.base_addr, info.block_len, info.stride, info.num_blocks) == (0x1000, 64, 128, 7)
    assert (info.device_id, info.members, info.group) == (1, ("a", "b"), 1)
    assert KVRegion.from_info(info) == region


# ============================================================================================
# Descriptors
# ============================================================================================
REGIONS = (
    KVRegion(0x1000, 64, 64, 3, device_id=0),
    KVRegion(0x8000, 64, 256, 2, device_id=5),
)


def paired_with(
    local: tuple[KVRegion, ...],
    remote: tuple[KVRegion, ...],
    p: tuple[int, int] = (0, 1),
    d: tuple[int, int] = (0, 1),
    kv_heads: int | None = None,
    **remote_overrides: Any,
) -> PairedLayout:
    """P rank ``p`` = (tp_rank, tp_size) paired with D rank ``d``, writing what ``write_heads``
    says; opaque regions default to ``lcm(P_tp, D_tp)`` heads."""
    heads_total = default_heads(p[1], d[1]) if kv_heads is None else kv_heads
    heads = write_heads(p[0], p[1], d[0], d[1], heads_total)
    rl = remote_layout(remote, tp_size=d[1], tp_rank=d[0], **remote_overrides)
    return PairedLayout(local_layout(local), p, rl, heads, heads_total)


def test_descriptors_whole_blocks_are_region_major() -> None:
    paired = paired_with(REGIONS, REGIONS)
    for d in (paired.local_descriptors(), paired.remote_descriptors()):
        assert d.dtype == np.uint64
        assert d.tolist() == [
            [0x1000, 64, 0],
            [0x1040, 64, 0],
            [0x1080, 64, 0],
            [0x8000, 64, 5],
            [0x8100, 64, 5],
        ]
    assert [(k.local, k.remote, len(k.template)) for k in paired.links] == [(0, 0, 1), (1, 1, 1)]
    assert [k.local_base for k in paired.links] == [0, 3]
    assert [k.remote_base for k in paired.links] == [0, 3]
    assert (paired.local_rows, paired.remote_rows) == (5, 5)
    assert paired.descs_per_block == 2


def test_descriptors_head_slice() -> None:
    """P_tp=1 → D_tp=2 (2 opaque heads): P sends its second head, the second half of each block,
    to D rank 1."""
    half = tuple(KVRegion(0x40000 + 0x1000 * i, 32, 32, r.num_blocks) for i, r in enumerate(REGIONS))
    paired = paired_with(REGIONS, half, d=(1, 2))
    assert paired.heads == range(1, 2)
    assert paired.local_descriptors().tolist() == [
        [0x1020, 32, 0],
        [0x1060, 32, 0],
        [0x10A0, 32, 0],
        [0x8020, 32, 5],
        [0x8120, 32, 5],
    ]
    assert paired.remote_descriptors()[:, :2].tolist() == [
        [0x40000, 32],
        [0x40020, 32],
        [0x40040, 32],
        [0x41000, 32],
        [0x41020, 32],
    ]
    # P_tp=1 → D_tp=4, D rank 0: the first quarter of each block
    quarter = tuple(KVRegion(0x40000 + 0x1000 * i, 16, 16, r.num_blocks) for i, r in enumerate(REGIONS))
    d0 = paired_with(REGIONS, quarter, d=(0, 4)).local_descriptors()
    assert d0[:, 0].tolist() == [0x1000, 0x1040, 0x1080, 0x8000, 0x8100]
    assert set(d0[:, 1].tolist()) == {16}


def test_descriptors_large_addresses() -> None:
    base = 0x7F00_0000_0000
    region = (KVRegion(base, 1 << 20, 1 << 21, 3),)
    d = paired_with(region, region).local_descriptors()
    assert d[:, 0].tolist() == [base, base + (1 << 21), base + (2 << 21)]
    assert set(d[:, 1].tolist()) == {1 << 20}
    top = 2**64 - 3 * (1 << 21)  # the last bytes of a 64-bit address space: no wrap-around
    d = paired_with((KVRegion(top, 1 << 20, 1 << 21, 3),), region).local_descriptors()
    assert d[:, 0].tolist() == [top, top + (1 << 21), top + (2 << 21)]


def test_descriptors_empty() -> None:
    """MLA, P_tp=2 → D_tp=1: P rank 1 holds the head P rank 0 writes, so it writes nothing."""
    paired = paired_with(REGIONS, REGIONS, p=(1, 2), kv_heads=1)
    assert paired.heads == range(0)
    assert paired.links == ()
    assert paired.local_descriptors().shape == (0, 3)
    assert paired.remote_descriptors().shape == (0, 3)
    assert paired.local_descriptors().dtype == np.uint64
    plan = paired.plan(((0, 1),), ((1, 0),))
    assert (plan.nbytes, plan.num_descs, plan.merged_descs, plan.num_blocks) == (0, 0, 0, 0)


def test_link_bases() -> None:
    regions = tuple(KVRegion(0, 8, 8, n) for n in (4, 1, 7, 2))
    paired = paired_with(regions, regions)
    assert [k.local_base for k in paired.links] == [0, 4, 5, 12]
    assert [k.remote_base for k in paired.links] == [0, 4, 5, 12]
    assert len(paired.local_descriptors()) == paired.local_rows == 14


# ============================================================================================
# Region pairing
# ============================================================================================
def reg(*members: str, n: int = 8, base: int = 0, block_len: int = 64, group: int = 0) -> KVRegion:
    return KVRegion(base, block_len, block_len, n, 0, tuple(members), group)


def test_pair_by_index_when_names_are_absent() -> None:
    assert pair_regions([reg(), reg(), reg()], [reg(), reg(), reg()]) == (0, 1, 2)
    with pytest.raises(LayoutError):
        pair_regions([reg(), reg()], [reg(), reg(), reg()])


def test_pair_by_name_when_remote_orders_regions_differently() -> None:
    local = [reg("l0"), reg("l1"), reg("l2")]
    remote = [reg("l2"), reg("l0"), reg("l1")]
    assert pair_regions(local, remote) == (1, 2, 0)


def test_pair_pooled_regions_whose_representative_differs() -> None:
    local = [reg("a", "b"), reg("c")]
    remote = [reg("c"), reg("b", "a")]
    assert pair_regions(local, remote) == (1, 0)


def test_pair_ignores_remote_only_members() -> None:
    """PP: a stage owns a subset of the layers; the PP=1 remote advertises all of them."""
    local = [reg("l2"), reg("l3")]
    remote = [reg("l0"), reg("l1"), reg("l2"), reg("l3")]
    assert pair_regions(local, remote) == (2, 3)
    assert pair_regions([reg("l2")], [reg("l2", "l9"), reg("l3")]) == (0,)


def test_pair_remote_missing_a_local_member() -> None:
    with pytest.raises(LayoutError, match="l1"):
        pair_regions([reg("l0"), reg("l1")], [reg("l0"), reg("l2")])
    with pytest.raises(LayoutError):
        pair_regions([reg("a", "b")], [reg("a")])


def test_pair_remote_advertising_a_member_twice() -> None:
    with pytest.raises(LayoutError, match="two regions"):
        pair_regions([reg("l0"), reg("l1")], [reg("l0", "l1"), reg("l1")])


def test_pair_local_region_spanning_two_remote_regions() -> None:
    with pytest.raises(LayoutError):
        pair_regions([reg("a", "b")], [reg("a"), reg("b")])


def test_pair_local_named_remote_unnamed() -> None:
    with pytest.raises(LayoutError):
        pair_regions([reg("l2"), reg("l3")], [reg(), reg(), reg(), reg()])
    with pytest.raises(LayoutError):
        pair_regions([reg("l0"), reg("l1"), reg("l2")], [reg(), reg()])


# ============================================================================================
# PairedLayout.plan
# ============================================================================================
def local_layout(regions: tuple[KVRegion, ...], *, ratio: int = 1, block_size: int = 16) -> KVLayout:
    return KVLayout(regions=regions, mem_type="DRAM", block_size=block_size, physical_blocks_per_logical=ratio)


def remote_layout(regions: tuple[KVRegion, ...], **overrides: Any) -> RemoteLayout:
    fields: dict[str, Any] = {
        "engine_id": "engine-D",
        "agent_name": "D/0/0",
        "regions": regions,
        "block_size": 16,
        "physical_blocks_per_logical": 1,
        "tp_size": 1,
        "tp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "mem_type": "DRAM",
    }
    fields.update(overrides)
    return RemoteLayout(**fields)


def whole(local: KVLayout, remote: RemoteLayout) -> PairedLayout:
    """TP 1 → TP 1, opaque blocks: one head, written whole."""
    return PairedLayout(local, (0, 1), remote, range(0, 1), 1)


def expected_indices(offsets: list[int], region_order: list[int], ids: list[int], ratio: int = 1) -> list[int]:
    phys = [b * ratio + i for b in ids for i in range(ratio)]
    return [offsets[r] + p for r in region_order for p in phys]


def check_plan_against_descriptors(paired: PairedLayout, plan: Any) -> None:
    """The planned index pairs point at descriptors of equal length."""
    ld = paired.local_descriptors()[plan.local_idx]
    rd = paired.remote_descriptors()[plan.remote_idx]
    assert (ld[:, 1] == rd[:, 1]).all()
    assert int(ld[:, 1].sum()) == plan.nbytes


def test_plan_region_major_indices_with_reordered_remote() -> None:
    local = local_layout(
        (
            KVRegion(0x1000, 64, 64, 10, members=("l0",)),
            KVRegion(0x10000, 64, 128, 10, members=("l1",)),
        )
    )
    remote = remote_layout(
        (
            KVRegion(0x200000, 64, 64, 20, members=("l1",)),
            KVRegion(0x300000, 64, 64, 20, members=("l0",)),
        )
    )
    paired = whole(local, remote)
    assert pair_regions(local.regions, remote.regions) == (1, 0)
    assert [(k.local, k.remote) for k in paired.links] == [(0, 1), (1, 0)]
    # Both lists are link-major, in local region order: D's l0 (its region 1) comes first.
    assert [k.local_base for k in paired.links] == [0, 10]
    assert [k.remote_base for k in paired.links] == [0, 20]
    # P has 4 blocks, D's prefix cache holds the first two: P's last two are written
    plan = paired.plan(((0, 1, 2, 3),), ((5, 6),))
    assert plan.local_idx.tolist() == [2, 3, 12, 13]
    assert plan.remote_idx.tolist() == [5, 6, 25, 26]
    assert plan.nbytes == 4 * 64
    assert plan.num_descs == 4
    assert plan.num_blocks == 2
    # l0: contiguous on both sides → 1; l1: local stride 128 → 2
    assert plan.merged_descs == 3
    check_plan_against_descriptors(paired, plan)
    ld = paired.local_descriptors()[plan.local_idx]
    rd = paired.remote_descriptors()[plan.remote_idx]
    assert ld[:, 0].tolist() == [0x1000 + 2 * 64, 0x1000 + 3 * 64, 0x10000 + 2 * 128, 0x10000 + 3 * 128]
    assert rd[:, 0].tolist() == [0x300000 + 5 * 64, 0x300000 + 6 * 64, 0x200000 + 5 * 64, 0x200000 + 6 * 64]
    # D saying it had two blocks cached is the same plan; saying one picks P's blocks 1, 2
    same = paired.plan(((0, 1, 2, 3),), ((5, 6),), skips=(2,))
    assert (same.local_idx.tolist(), same.remote_idx.tolist()) == (plan.local_idx.tolist(), plan.remote_idx.tolist())
    assert paired.plan(((0, 1, 2, 3),), ((5, 6),), skips=(1,)).local_idx.tolist() == [1, 2, 11, 12]
    with pytest.raises(PlanError):
        paired.plan(((0, 1, 2, 3),), ((5, 6),), skips=(3,))  # 3 cached + 2 registered > P's 4
    with pytest.raises(PlanError):
        paired.plan(((0, 1, 2, 3),), ((5, 6),), skips=(2, 0))  # one count per group


def test_a_plans_merge_count_is_computed_once_and_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting merged descriptors costs a small plan as much again as its index arrays and
    only the WRITE's event reads it: a plan defers it, and counts once."""
    import pushactors.core.blocks as blocks_mod

    calls: list[int] = []
    real = blocks_mod.count_merged
    monkeypatch.setattr(blocks_mod, "count_merged", lambda *a: calls.append(1) or real(*a))
    paired = whole(local_layout((KVRegion(0x1000, 256, 256, 32),)), remote_layout((KVRegion(0x900000, 256, 256, 64),)))
    plan = paired.plan(((4, 5, 6, 7, 8),), ((40, 41, 42, 43, 44),))
    assert calls == []
    assert (plan.merged_descs, plan.merged_descs) == (1, 1)
    assert calls == [1]


def test_plan_contiguous_single_region_collapses_to_one_descriptor() -> None:
    paired = whole(local_layout((KVRegion(0x1000, 256, 256, 32),)), remote_layout((KVRegion(0x900000, 256, 256, 64),)))
    plan = paired.plan(((4, 5, 6, 7, 8),), ((40, 41, 42, 43, 44),))
    assert plan.local_idx.tolist() == [4, 5, 6, 7, 8]
    assert plan.remote_idx.tolist() == [40, 41, 42, 43, 44]
    assert plan.num_descs == 5
    assert plan.merged_descs == 1
    assert plan.nbytes == 5 * 256


@pytest.mark.parametrize(
    ("p_ids", "d_ids", "merged"),
    [
        ((1, 2, 3), (7, 9, 10), 2),  # a gap on D's side
        ((1, 3, 4), (7, 8, 9), 2),  # a gap on P's side
        ((3, 2, 1), (7, 8, 9), 3),  # descending on P
        ((1, 2, 3), (9, 8, 7), 3),  # descending on D
        ((1, 5, 9), (2, 4, 6), 3),
        ((0,), (31,), 1),
    ],
)
def test_plan_non_contiguous_blocks_do_not_merge(p_ids: tuple[int, ...], d_ids: tuple[int, ...], merged: int) -> None:
    paired = whole(local_layout((KVRegion(0x1000, 256, 256, 32),)), remote_layout((KVRegion(0x900000, 256, 256, 64),)))
    plan = paired.plan((p_ids,), (d_ids,))
    assert plan.num_descs == len(p_ids)
    assert plan.merged_descs == merged


def test_plan_strided_regions_never_merge() -> None:
    paired = whole(local_layout((KVRegion(0x1000, 64, 128, 16),)), remote_layout((KVRegion(0x900000, 64, 64, 16),)))
    plan = paired.plan(((1, 2, 3, 4),), ((1, 2, 3, 4),))
    assert plan.merged_descs == 4


def test_plan_expands_logical_to_physical_on_both_sides() -> None:
    local = local_layout(
        (KVRegion(0x1000, 32, 32, 40, members=("a",)), KVRegion(0x5000, 32, 32, 40, members=("b",))),
        ratio=2,
    )
    remote = remote_layout(
        (KVRegion(0x100000, 32, 32, 20, members=("a",)), KVRegion(0x200000, 32, 32, 20, members=("b",))),
        physical_blocks_per_logical=2,
    )
    paired = whole(local, remote)
    plan = paired.plan(((3, 4, 10),), ((0, 9, 1),))
    trimmed_p = [3, 4, 10]
    assert plan.local_idx.tolist() == expected_indices([0, 40], [0, 1], trimmed_p, 2)
    assert plan.remote_idx.tolist() == expected_indices([0, 20], [0, 1], [0, 9, 1], 2)
    assert plan.num_descs == 12
    assert plan.nbytes == 12 * 32
    assert plan.num_blocks == 3
    # per region: P phys 6,7,8,9,20,21 / D phys 0,1,18,19,2,3 → runs (6,7)(8,9)(20,21) → 3 each
    assert plan.merged_descs == 6
    check_plan_against_descriptors(paired, plan)


def test_plan_remote_capacity_boundary_with_ratio() -> None:
    paired = whole(
        local_layout((KVRegion(0, 16, 16, 100),), ratio=2),
        remote_layout((KVRegion(0, 16, 16, 20),), physical_blocks_per_logical=2),
    )
    ok = paired.plan(((0,),), ((9,),))  # physical 18, 19 of 20
    assert ok.remote_idx.tolist() == [18, 19]
    with pytest.raises(PlanError):
        paired.plan(((0,),), ((10,),))  # physical 20, 21: beyond D's capacity


def test_plan_block_beyond_remote_capacity() -> None:
    paired = whole(local_layout((KVRegion(0, 16, 16, 100),)), remote_layout((KVRegion(0, 16, 16, 8),)))
    assert paired.plan(((5, 6),), ((6, 7),)).remote_idx.tolist() == [6, 7]
    with pytest.raises(PlanError):
        paired.plan(((5, 6),), ((7, 8),))


def test_plan_capacity_is_per_region() -> None:
    """The second remote region is smaller: a block that fits the first must still be refused."""
    paired = whole(
        local_layout((KVRegion(0, 16, 16, 100, members=("a",)), KVRegion(0, 16, 16, 100, members=("b",)))),
        remote_layout((KVRegion(0, 16, 16, 50, members=("a",)), KVRegion(0, 16, 16, 10, members=("b",)))),
    )
    with pytest.raises(PlanError):
        paired.plan(((1,),), ((20,),))


def test_plan_block_beyond_local_capacity() -> None:
    paired = whole(local_layout((KVRegion(0, 16, 16, 10),)), remote_layout((KVRegion(0, 16, 16, 100),)))
    assert paired.plan(((9,),), ((50,),)).local_idx.tolist() == [9]
    with pytest.raises(PlanError):
        paired.plan(((10,),), ((50,),))
    # P blocks D did not register are never read ...
    assert paired.plan(((7, 8, 3),), ((50,),)).local_idx.tolist() == [3]
    # ... but every P block is checked, read or not (the old plan trimmed before checking)
    with pytest.raises(PlanError):
        paired.plan(((99, 3),), ((50,),))


def simple_pair() -> PairedLayout:
    region = KVRegion(0, 16, 16, 10)
    return whole(local_layout((region,)), remote_layout((region,)))


@pytest.mark.parametrize(("p_ids", "d_ids"), [((-1,), (0,)), ((0,), (-1,)), ((2, -3), (4, 5))])
def test_plan_negative_block_ids_are_refused(p_ids: tuple[int, ...], d_ids: tuple[int, ...]) -> None:
    """A negative id is out of range: offset[r] + (-1) would name the previous region's last block."""
    regions = (KVRegion(0x1000, 16, 16, 10, members=("a",)), KVRegion(0x2000, 16, 16, 10, members=("b",)))
    paired = whole(local_layout(regions), remote_layout(regions))
    with pytest.raises(PlanError):
        paired.plan((p_ids,), (d_ids,))


def test_capacity_is_the_smallest_region_of_each_group_in_logical_blocks() -> None:
    """One formula for every side that asks: P's plans, the matcher's check of what D
    advertised, D's check of its own registrations."""
    regions = (
        KVRegion(0x1000, 16, 16, 40, members=("a",)),
        KVRegion(0x2000, 16, 16, 36, members=("b",)),  # the smallest of group 0
        KVRegion(0x3000, 16, 16, 21, members=("m",), group=2),  # group 1 has no region
    )
    assert capacity(regions, 4) == (9, 0, 5)  # floor: a partial logical block is unusable
    assert capacity(regions, 1) == (36, 0, 21)
    assert capacity((), 1) == ()
    # What D advertises reads the same as what a layout holds.
    infos = [
        RegionInfo(base_addr=r.base_addr, block_len=16, stride=16, num_blocks=r.num_blocks, group=r.group)
        for r in regions
    ]
    assert capacity(infos, 4) == capacity(regions, 4)
    # A plan is refused past the same bound.
    paired = whole(local_layout(regions[:2], ratio=4), remote_layout(regions[:2], physical_blocks_per_logical=4))
    paired.plan(((8,),), ((8,),))
    with pytest.raises(PlanError):
        paired.plan(((9,),), ((8,),))
    with pytest.raises(PlanError):
        paired.plan(((8,),), ((9,),))


def test_plan_ratio_mismatch() -> None:
    """Kernel blocks of 16 tokens against 8: opaque blocks have no token axis to re-cut."""
    local = local_layout((KVRegion(0, 16, 16, 10),), ratio=1)
    remote = remote_layout((KVRegion(0, 16, 16, 10),), physical_blocks_per_logical=2)
    with pytest.raises(LayoutError, match="token"):
        whole(local, remote)


def test_plan_equal_kernel_blocks_under_different_block_sizes() -> None:
    """P: 16-token blocks; D: 32-token blocks of two 16-token kernel blocks. D's blocks are the
    last ones by token: P's 3 blocks fill 2 of D's, the last half of D's last block is empty."""
    local = local_layout((KVRegion(0x1000, 16, 16, 10),), block_size=16)
    remote = remote_layout((KVRegion(0x9000, 16, 16, 20),), block_size=32, physical_blocks_per_logical=2)
    paired = whole(local, remote)
    plan = paired.plan(((4, 5, 6),), ((3, 7),))
    assert plan.local_idx.tolist() == [4, 5, 6]
    assert plan.remote_idx.tolist() == [6, 7, 14]
    assert plan.num_blocks == 2
    # D registered only its last block: P's last block, token 32 on
    assert paired.plan(((4, 5, 6),), ((7,),)).local_idx.tolist() == [6]
    check_plan_against_descriptors(paired, plan)


def test_plan_d_asking_more_than_p_has() -> None:
    paired = simple_pair()
    with pytest.raises(PlanError):
        paired.plan(((1,),), ((1, 2),))


def test_plan_nothing_to_write() -> None:
    paired = simple_pair()
    plan = paired.plan(((1, 2),), ((),))
    assert plan.local_idx.tolist() == []
    assert plan.remote_idx.tolist() == []
    assert (plan.nbytes, plan.num_descs, plan.merged_descs, plan.num_blocks) == (0, 0, 0, 0)


def test_plan_group_count_mismatch() -> None:
    paired = simple_pair()
    with pytest.raises(PlanError):
        paired.plan(((1,), (2,)), ((1,),))
    with pytest.raises(PlanError):
        paired.plan(((1,),), ((1,), (2,)))


def test_plan_two_kv_groups() -> None:
    local = KVLayout(
        regions=(
            KVRegion(0x1000, 16, 16, 10, members=("full",), group=0),
            KVRegion(0x2000, 16, 16, 10, members=("swa",), group=1),
        ),
        mem_type="DRAM",
        block_size=16,
        num_groups=2,
    )
    remote = remote_layout(
        (
            KVRegion(0x9000, 16, 16, 30, members=("swa",), group=1),
            KVRegion(0x8000, 16, 16, 20, members=("full",), group=0),
        )
    )
    paired = whole(local, remote)
    plan = paired.plan(((1, 2, 3), (7,)), ((4, 5), (29,)))
    assert [(k.local, k.remote, k.local_base, k.remote_base) for k in paired.links] == [(0, 1, 0, 0), (1, 0, 10, 20)]
    assert plan.local_idx.tolist() == [2, 3, 10 + 7]
    assert plan.remote_idx.tolist() == [4, 5, 20 + 29]
    assert plan.num_descs == 3
    assert plan.num_blocks == 2
    # a region whose group D did not register
    with pytest.raises(PlanError):
        paired.plan(((1,),), ((1,),))


def test_plan_group_of_paired_regions_must_agree() -> None:
    local = local_layout((KVRegion(0, 16, 16, 10, members=("a",), group=0),))
    remote = remote_layout((KVRegion(0, 16, 16, 10, members=("a",), group=1),))
    with pytest.raises(LayoutError):
        whole(local, remote)


@pytest.mark.parametrize("d_block_size", [32, 8, 24])
def test_block_size_mismatch_at_construction(d_block_size: int) -> None:
    local = local_layout((KVRegion(0, 16, 16, 10),), block_size=16)
    remote = remote_layout((KVRegion(0, 16, 16, 10),), block_size=d_block_size)
    with pytest.raises(LayoutError):
        whole(local, remote)


def test_block_len_mismatch_at_construction() -> None:
    local = local_layout((KVRegion(0, 64, 64, 10),))
    remote = remote_layout((KVRegion(0, 128, 128, 10),))
    with pytest.raises(LayoutError):
        whole(local, remote)


def test_pairing_errors_surface_at_construction() -> None:
    local = local_layout((KVRegion(0, 64, 64, 10, members=("a",)),))
    with pytest.raises(LayoutError):
        whole(local, remote_layout((KVRegion(0, 64, 64, 10, members=("b",)),)))
    with pytest.raises(LayoutError):
        whole(local, remote_layout((KVRegion(0, 64, 64, 10), KVRegion(0, 64, 64, 10))))


def test_bad_head_splits_are_layout_errors() -> None:
    local = local_layout((KVRegion(0, 64, 64, 10),))
    remote = remote_layout((KVRegion(0, 64, 64, 10),))
    assert len(PairedLayout(local, (0, 1), remote, range(0, 2), 2).links) == 1  # 2 heads of 32 bytes
    with pytest.raises(LayoutError, match="head"):
        PairedLayout(local, (0, 1), remote, range(0, 3), 3)  # 64 bytes do not split in 3 heads
    with pytest.raises(LayoutError):
        PairedLayout(local, (0, 2), remote_layout((KVRegion(0, 64, 64, 10),)), range(0, 1), 3)  # 3 heads, TP 2
    with pytest.raises(LayoutError):
        PairedLayout(local, (0, 1), remote, range(0, 0), 0)


@pytest.mark.parametrize("p_rank", [0, 1])
def test_head_slice_plan_p_tp2_into_d_tp1(p_rank: int) -> None:
    kv_heads = default_heads(2, 1)
    heads = write_heads(p_rank, 2, 0, 1, kv_heads)
    assert heads == rank_heads(p_rank, 2, kv_heads) == range(p_rank, p_rank + 1)  # P's whole block
    # each P rank holds half the heads: its block is half of D's
    local = local_layout((KVRegion(0x1000, 64, 64, 16, members=("l0",)), KVRegion(0x2000, 64, 64, 16, members=("l1",))))
    remote = remote_layout(
        (KVRegion(0x100000, 128, 128, 16, members=("l0",)), KVRegion(0x200000, 128, 128, 16, members=("l1",)))
    )
    paired = PairedLayout(local, (p_rank, 2), remote, heads, kv_heads)
    plan = paired.plan(((2, 3),), ((5, 6),))
    assert plan.local_idx.tolist() == [2, 3, 16 + 2, 16 + 3]
    assert plan.remote_idx.tolist() == [5, 6, 16 + 5, 16 + 6]
    assert plan.nbytes == 4 * 64
    # half-length descriptors at this rank's head offset; D's halves are never adjacent
    assert plan.merged_descs == 4
    rd = paired.remote_descriptors()[plan.remote_idx]
    off = 64 * p_rank
    assert rd[:, 0].tolist() == [
        0x100000 + 5 * 128 + off,
        0x100000 + 6 * 128 + off,
        0x200000 + 5 * 128 + off,
        0x200000 + 6 * 128 + off,
    ]
    assert set(rd[:, 1].tolist()) == {64}
    ld = paired.local_descriptors()[plan.local_idx]
    assert ld[:, 0].tolist() == [0x1000 + 2 * 64, 0x1000 + 3 * 64, 0x2000 + 2 * 64, 0x2000 + 3 * 64]
    assert set(ld[:, 1].tolist()) == {64}
    check_plan_against_descriptors(paired, plan)


@pytest.mark.parametrize("d_rank", [0, 1])
def test_head_slice_plan_p_tp1_into_d_tp2(d_rank: int) -> None:
    kv_heads = default_heads(1, 2)
    heads = write_heads(0, 1, d_rank, 2, kv_heads)
    assert heads == rank_heads(d_rank, 2, kv_heads) == range(d_rank, d_rank + 1)  # D's whole block
    local = local_layout((KVRegion(0x1000, 128, 128, 16),))
    remote = remote_layout((KVRegion(0x900000, 64, 64, 16),), tp_size=2, tp_rank=d_rank)
    paired = PairedLayout(local, (0, 1), remote, heads, kv_heads)
    plan = paired.plan(((1, 2, 3),), ((7, 8, 9),))
    assert plan.nbytes == 3 * 64
    assert plan.merged_descs == 3  # P's halves are not adjacent
    ld = paired.local_descriptors()[plan.local_idx]
    assert ld[:, 0].tolist() == [0x1000 + b * 128 + 64 * d_rank for b in (1, 2, 3)]
    assert set(ld[:, 1].tolist()) == {64}
    rd = paired.remote_descriptors()[plan.remote_idx]
    assert rd[:, 0].tolist() == [0x900000 + b * 64 for b in (7, 8, 9)]
    check_plan_against_descriptors(paired, plan)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (4, 2), (1, 2), (2, 4), (2, 2), (4, 1), (1, 4), (8, 2)])
@pytest.mark.parametrize("kv_heads", [None, 1, 8])
def test_opaque_writes_tile_every_d_block_once(p_tp: int, d_tp: int, kv_heads: int | None) -> None:
    """All P sources of a D rank together write every byte of D's registered blocks exactly
    once, each from the bytes of the same heads in P's block (None: lcm heads; 1: MLA)."""
    total = default_heads(p_tp, d_tp) if kv_heads is None else kv_heads
    per_head = 48
    p_ids, d_ids = (3, 1, 4), (2, 7, 5)
    for d in range(d_tp):
        d_heads = rank_heads(d, d_tp, total)
        d_len = per_head * len(d_heads)
        remote = (KVRegion(0x100000, d_len, d_len + 16, 8, members=("l0",)),)
        written: Counter[int] = Counter()
        for _, p in registration_sources(d, d_tp, p_tp, 1):
            p_heads = rank_heads(p, p_tp, total)
            p_len = per_head * len(p_heads)
            local = (KVRegion(0x1000, p_len, p_len, 8, members=("l0",)),)
            paired = paired_with(local, remote, p=(p, p_tp), d=(d, d_tp), kv_heads=total)
            plan = paired.plan((p_ids,), (d_ids,))
            check_plan_against_descriptors(paired, plan)
            ld = paired.local_descriptors()[plan.local_idx].tolist()
            rd = paired.remote_descriptors()[plan.remote_idx].tolist()
            for (la, n, _), (ra, _, _) in zip(ld, rd, strict=True):
                lb, lo = divmod(la - 0x1000, p_len)
                rb, ro = divmod(ra - 0x100000, d_len + 16)
                assert d_ids[p_ids.index(lb)] == rb  # the same token positions
                assert lo + n <= p_len and ro + n <= d_len
                # the same global heads on both sides
                assert p_heads.start + lo // per_head == d_heads.start + ro // per_head
                assert lo % per_head == ro % per_head
                written.update(rb * (d_len + 16) + ro + i for i in range(n))
        assert sorted(written) == [b * (d_len + 16) + i for b in sorted(d_ids) for i in range(d_len)]
        assert set(written.values()) == {1}


def test_remote_layout_from_agent_info() -> None:
    info = AgentInfo(
        engine_id="engine-D",
        agent_name="a",
        agent_metadata=b"",
        mem_type="VRAM",
        tp_size=2,
        tp_rank=1,
        pp_size=1,
        pp_rank=0,
        block_size=16,
        physical_blocks_per_logical=2,
        regions=(RegionInfo(base_addr=0x1000, block_len=64, stride=128, num_blocks=9, device_id=3, members=("x",)),),
        replicated_kv=True,
        clock=ClockSample(monotonic=1.0, wall=2.0),
    )
    rl = RemoteLayout.from_info(info, "agent-D", clock_offset=0.5)
    assert rl.regions == (KVRegion(0x1000, 64, 128, 9, 3, ("x",), 0),)
    assert (rl.engine_id, rl.agent_name) == ("engine-D", "agent-D")
    assert (rl.block_size, rl.physical_blocks_per_logical) == (16, 2)
    assert (rl.tp_size, rl.tp_rank, rl.mem_type, rl.replicated_kv, rl.clock_offset) == (2, 1, "VRAM", True, 0.5)


# ============================================================================================
# count_merged
# ============================================================================================
def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


@pytest.mark.parametrize(
    ("laddr", "raddr", "lens", "expected"),
    [
        ((), (), (), 0),
        ((0,), (1000,), (64,), 1),
        ((0, 64, 128), (1000, 1064, 1128), (64, 64, 64), 1),
        ((0, 64, 200), (1000, 1064, 1128), (64, 64, 64), 2),  # local gap
        ((0, 64, 128), (1000, 1064, 1200), (64, 64, 64), 2),  # remote gap
        ((0, 64, 128), (1000, 2000, 3000), (64, 64, 64), 3),
        ((128, 64, 0), (1128, 1064, 1000), (64, 64, 64), 3),  # descending
        ((0, 32, 96), (500, 532, 596), (32, 64, 10), 1),  # varying lengths
        ((0, 32, 96), (500, 532, 600), (32, 64, 10), 2),
        ((0, 64, 0, 64), (0, 64, 128, 192), (64, 64, 64, 64), 2),  # local restarts: two runs
        ((0, 0), (0, 0), (64, 64), 2),  # same block twice is not a run
    ],
)
def test_count_merged(laddr: tuple[int, ...], raddr: tuple[int, ...], lens: tuple[int, ...], expected: int) -> None:
    assert count_merged(arr(*laddr), arr(*raddr), arr(*lens)) == expected


@pytest.mark.parametrize("d", [(0, 1), (1, 2)])
def test_plan_broadcast_over_link_runs_equals_the_per_link_reference(d: tuple[int, int]) -> None:
    """A plan computes each run of links with one template in one broadcast; the descriptors
    (and their order) must be exactly what planning link by link gives. Regions of two sizes
    interleave, so templates change mid-list and runs are cut there."""
    local = tuple(KVRegion(0x100000 * (i + 1), 64 if i % 3 else 128, 128, 40, device_id=0) for i in range(7))
    remote = tuple(
        KVRegion(0x9000000 + 0x100000 * i, (64 if i % 3 else 128) // d[1], 128, 60, device_id=1) for i in range(7)
    )
    paired = paired_with(local, remote, d=d)
    assert 1 < paired.link_runs < len(paired.links)
    p_blocks = ((1, 2, 3, 9, 10, 30),)
    d_blocks = ((50, 4, 5, 6, 7, 59),)
    plan = paired.plan(p_blocks, d_blocks)
    rows_for = paired.rows_source(p_blocks, d_blocks, ())
    lidx, ridx, nbytes = [], [], 0
    for k in paired.links:
        rows = rows_for(0, k.template)
        assert rows is not None
        lb, rb, _, e = rows
        n = len(k.template)
        lidx.append(k.local_base + lb * n + e)
        ridx.append(k.remote_base + rb * n + e)
        nbytes += int(k.template.length[e].sum())
    assert plan.local_idx.tolist() == np.concatenate(lidx).tolist()
    assert plan.remote_idx.tolist() == np.concatenate(ridx).tolist()
    assert plan.nbytes == nbytes


def test_runs_stay_inside_each_region_even_where_regions_touch() -> None:
    """Two layers back to back in memory but registered apart (per-layer tensors; on the H200
    NIXL refused a descriptor across the seam with NIXL_ERR_NOT_FOUND): blocks in order post
    one run per layer, each inside its own registration, and the WRITE lands every byte."""
    from pushactors.testing.fabric import FakeFabric
    from pushactors.transport.agent import LOCAL_AGENT

    blocks, block = 8, 256
    src = (torch.arange(2 * blocks * block, dtype=torch.int64) % 251 + 1).to(torch.uint8)
    dst = torch.zeros(2 * blocks * block, dtype=torch.uint8)

    def regions(t: torch.Tensor) -> tuple[KVRegion, ...]:
        base = t.data_ptr()
        return tuple(
            KVRegion(base + i * blocks * block, block, block, blocks, members=(f"layer.{i}",)) for i in range(2)
        )

    def seams(t: torch.Tensor) -> np.ndarray:  # one registration per layer
        return np.array([[r.base_addr, blocks * block, 0] for r in regions(t)], dtype=np.uint64)

    fabric = FakeFabric()
    p, d = fabric.agent("P"), fabric.agent("D")
    p.register_memory(seams(src), "DRAM")
    d.register_memory(seams(dst), "DRAM")
    p.add_remote_agent(d.get_agent_metadata())
    paired = whole(local_layout(regions(src)), remote_layout(regions(dst), agent_name="D"))
    plan = paired.plan(((0, 1, 2, 3, 4, 5, 6, 7),), ((0, 1, 2, 3, 4, 5, 6, 7),), merge=True)
    assert plan.runs is not None
    assert plan.num_descs == 16 and plan.posted_descs == 2  # one per layer, not one across both
    assert plan.merged_descs == 1  # what merging across the seam would give: not postable
    local = p.prep_xfer_dlist(LOCAL_AGENT, plan.runs[0], "DRAM")
    remote = p.prep_xfer_dlist("D", plan.runs[1], "DRAM")
    h = p.make_prepped_xfer("WRITE", local, np.arange(2), remote, np.arange(2), b"req:1")
    p.transfer(h)
    assert p.check_xfer_state(h) == "DONE"
    assert torch.equal(dst, src)
