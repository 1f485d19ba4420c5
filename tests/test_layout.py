"""The layout model: block shapes, their pairing templates and described KV tensors."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from pushactors.core.blocks import KVLayout, KVRegion, LayoutError, PairedLayout, PlanError, RemoteLayout
from pushactors.core.layout import MAX_ATOMS, Axis, BlockShape, ShapeError, Side, Unit, pair_template
from pushactors.protocol import AxisInfo, RegionInfo, Registration, ShapeInfo
from pushactors.testing.engine import SimSpec, build_kv

N, H, D, ES = 4, 2, 3, 2  # tokens, heads, dim, element size: small enough to count by hand


def hnd() -> BlockShape:  # [kv, head, token, dim]
    return BlockShape(
        (Axis("kv", 2, H * N * D * ES), Axis("head", H, N * D * ES), Axis("token", N, D * ES), Axis("dim", D, ES)), ES
    )


def nhd() -> BlockShape:  # [kv, token, head, dim]
    return BlockShape(
        (Axis("kv", 2, N * H * D * ES), Axis("token", N, H * D * ES), Axis("head", H, D * ES), Axis("dim", D, ES)), ES
    )


KV_UNITS = [Unit(0, 0, 0, 0), Unit(0, 1, 0, 1)]


# --- BlockShape -------------------------------------------------------------------------------
def test_shapes_know_their_extent_and_bytes() -> None:
    s = hnd()
    assert s.extent == s.nbytes == 2 * H * N * D * ES
    assert s.size("layer") == 1 and s.stride("layer") == 0
    assert "kv=2" in s.describe() and s.describe().index("kv") < s.describe().index("dim")


def test_overlapping_axes_are_refused() -> None:
    with pytest.raises(ShapeError, match="overlaps"):
        BlockShape((Axis("head", 2, 4), Axis("dim", 4, 2)), 2)  # head stride 4 < 4 dims × 2 bytes
    with pytest.raises(ShapeError, match="twice"):
        BlockShape((Axis("head", 2, 8), Axis("head", 2, 16)), 1)
    with pytest.raises(ShapeError, match="size 2"):
        BlockShape((Axis("kv", 3, 8), Axis("dim", 4, 2)), 2)


def test_from_dims_splits_k_and_v_content() -> None:
    t = torch.zeros(5, H, N, 2 * D, dtype=torch.int16)  # [B, H, N, C]
    s = BlockShape.from_dims("HNC", t.shape[1:], t.stride()[1:], 2)
    assert s.size("kv") == 2 and s.stride("kv") == D * ES and s.size("dim") == D
    assert s.stride("head") == N * 2 * D * ES
    with pytest.raises(ShapeError, match="split in two"):
        BlockShape.from_dims("HNC", (H, N, 5), (N * 5, 5, 1), 2)
    with pytest.raises(ShapeError, match="unknown dim"):
        BlockShape.from_dims("HNX", (H, N, 4), (N * 4, 4, 1), 2)


def test_opaque_block_is_heads_outermost_bytes() -> None:
    s = BlockShape.opaque(64, 4)
    assert (s.size("head"), s.stride("head"), s.size("dim"), s.elem_size) == (4, 16, 16, 1)
    with pytest.raises(ShapeError):
        BlockShape.opaque(64, 3)


# --- pair_template --------------------------------------------------------------------------
def test_whole_block_same_layout_is_one_descriptor() -> None:
    t = pair_template(Side(hnd(), 0, N), Side(hnd(), 0, N), KV_UNITS, range(H))
    assert len(t) == 1 and t.nbytes == hnd().nbytes and (t.kp, t.kd) == (1, 1)


def test_head_slice_of_hnd_is_one_run_per_kv_half() -> None:
    # P holds heads 0..1 (whole), D holds head 1 only (TP 1 → 2): K and V runs of head 1.
    d = BlockShape(
        (Axis("kv", 2, N * D * ES), Axis("head", 1, N * D * ES), Axis("token", N, D * ES), Axis("dim", D, ES)), ES
    )
    t = pair_template(Side(hnd(), 0, N), Side(d, 1, N), KV_UNITS, range(1, 2))
    assert len(t) == 2
    assert t.loff.tolist() == [N * D * ES, H * N * D * ES + N * D * ES]
    assert t.roff.tolist() == [0, N * D * ES]
    assert t.length.tolist() == [N * D * ES] * 2


def test_head_slice_of_nhd_is_one_run_per_token_and_kv_half() -> None:
    d = BlockShape(
        (Axis("kv", 2, N * D * ES), Axis("token", N, D * ES), Axis("head", 1, D * ES), Axis("dim", D, ES)), ES
    )
    t = pair_template(Side(nhd(), 0, N), Side(d, 1, N), KV_UNITS, range(1, 2))
    assert len(t) == 2 * N and set(t.length.tolist()) == {D * ES}
    # token 2 of K, head 1 on P → token 2 of K on D
    i = int(np.flatnonzero(t.loff == 2 * H * D * ES + D * ES)[0])
    assert t.roff[i] == 2 * D * ES


def test_nhd_into_hnd_pairs_every_token_head_and_half() -> None:
    t = pair_template(Side(nhd(), 0, N), Side(hnd(), 0, N), KV_UNITS, range(H))
    # One run per (kv, token, head), except where a run happens to continue on both sides
    # (the last K head row meets the first V one here).
    assert len(t) == 2 * N * H - 1 and t.nbytes == nhd().nbytes
    # Every element lands where its (kv, token, head) lives on D.
    for kv in range(2):
        for tok in range(N):
            for h in range(H):
                src = kv * N * H * D * ES + tok * H * D * ES + h * D * ES
                dst = kv * H * N * D * ES + h * N * D * ES + tok * D * ES
                i = int(np.flatnonzero((t.loff <= src) & (src < t.loff + t.length))[0])
                assert t.roff[i] + (src - t.loff[i]) == dst


def test_block_size_ratio_builds_a_super_block() -> None:
    big = BlockShape(
        (
            Axis("kv", 2, H * 2 * N * D * ES),
            Axis("head", H, 2 * N * D * ES),
            Axis("token", 2 * N, D * ES),
            Axis("dim", D, ES),
        ),
        ES,
    )
    t = pair_template(Side(hnd(), 0, N), Side(big, 0, 2 * N), KV_UNITS, range(H))
    assert (t.kp, t.kd) == (2, 1)
    # Local block 1 (tokens N..2N-1) fills the second half of each head row of the D block.
    assert set(t.rpos.tolist()) == {0}
    second = t.lpos == 1
    assert np.all(t.roff[second] % (2 * N * D * ES) == N * D * ES)
    assert t.nbytes == big.nbytes


def test_template_refuses_mismatches_and_huge_work() -> None:
    other_dim = BlockShape((Axis("head", H, 8 * ES), Axis("dim", 8, ES)), ES)
    with pytest.raises(ShapeError, match="head dim"):
        pair_template(Side(hnd(), 0, N), Side(other_dim, 0, N), KV_UNITS, range(H))
    with pytest.raises(ShapeError, match="holds heads"):
        pair_template(Side(hnd(), 0, N), Side(hnd(), 2, N), KV_UNITS, range(H))
    many = BlockShape((Axis("token", 1 << 20, D * ES), Axis("head", 8, (1 << 20) * D * ES), Axis("dim", D, ES)), ES)
    with pytest.raises(ShapeError, match="limit"):
        pair_template(Side(many, 0, 1 << 20), Side(many, 0, 1 << 20), [Unit(0, None, 0, None)] * 2, range(8))
    assert MAX_ATOMS >= 1 << 20


def test_empty_heads_or_units_is_an_empty_template() -> None:
    assert len(pair_template(Side(hnd(), 0, N), Side(hnd(), 0, N), KV_UNITS, range(0))) == 0
    assert len(pair_template(Side(hnd(), 0, N), Side(hnd(), 0, N), [], range(H))) == 0


# --- described KV tensors -----------------------------------------------------------------------
def layout_of(layout: str, tp_rank: int = 0, tp: int = 1, **kw: object) -> KVLayout:
    spec = SimSpec(layout=layout, **{"num_blocks": 16, **kw})  # type: ignore[arg-type]
    kv, dims = build_kv(spec, [f"layer.{i}" for i in range(spec.num_layers)], tp_rank, tp)
    lay = KVLayout.from_tensors(kv, block_size=spec.block_size, dims=dims, kv_heads=spec.model_heads)
    lay.check_heads(tp_rank, tp)
    return lay


@pytest.mark.parametrize("layout", ["blhnc", "blnhc", "bhlnc", "mla_blhnc"])
def test_block_outermost_views_coalesce_into_one_region(layout: str) -> None:
    lay = layout_of(layout)
    assert len(lay.regions) == 1
    r = lay.regions[0]
    assert r.shape is not None and r.shape.size("layer") == 4
    assert r.members == ("layer.0", "layer.1", "layer.2", "layer.3")
    assert r.block_len == r.stride  # one block holds every layer, no gaps


@pytest.mark.parametrize("layout", ["cpu", "nhd", "kv_hnd", "kv_nhd", "mla"])
def test_per_layer_layouts_stay_one_region_per_layer(layout: str) -> None:
    lay = layout_of(layout)
    assert len(lay.regions) == 4 and all(r.shape is not None and r.shape.size("layer") == 1 for r in lay.regions)


def test_split_k_and_v_are_two_regions_with_parts() -> None:
    lay = layout_of("split_nhd")
    assert len(lay.regions) == 8 and {r.kv_part for r in lay.regions} == {0, 1}


def test_layout_must_state_heads_and_hold_this_ranks_share() -> None:
    spec = SimSpec(layout="cpu", num_blocks=4)
    kv, dims = build_kv(spec, ["a"], 0, 2)  # built for TP 2: 2 of 4 heads
    with pytest.raises(LayoutError, match="KV head count"):
        KVLayout.from_tensors(kv, block_size=16, dims=dims)
    lay = KVLayout.from_tensors(kv, block_size=16, dims=dims, kv_heads=4)
    lay.check_heads(1, 2)
    with pytest.raises(LayoutError, match="holds 2 heads"):
        lay.check_heads(0, 1)
    with pytest.raises(LayoutError, match="divides"):
        KVLayout.from_tensors(kv, block_size=16, dims=dims, kv_heads=3).check_heads(0, 2)


# --- hostile shapes from a peer ---------------------------------------------------------------
def region_info(axes: tuple[AxisInfo, ...], block_len: int = 4096) -> RegionInfo:
    return RegionInfo(
        base_addr=1 << 20, block_len=block_len, stride=block_len, num_blocks=4, shape=ShapeInfo(axes=axes, elem_size=2)
    )


def test_a_peer_shape_that_overlaps_or_overruns_its_block_is_refused() -> None:
    overlap = (AxisInfo(name="head", size=4, stride=2), AxisInfo(name="dim", size=8, stride=2))
    with pytest.raises(LayoutError, match="overlaps"):
        KVRegion.from_info(region_info(overlap))
    big = (AxisInfo(name="head", size=4, stride=4096), AxisInfo(name="dim", size=8, stride=2))
    with pytest.raises(LayoutError, match="spans"):
        KVRegion.from_info(region_info(big))
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"name": "bogus", "size": 1, "stride": 1}, AxisInfo)


def test_shape_round_trips_through_the_wire() -> None:
    r = layout_of("nhd").regions[0]
    back = KVRegion.from_info(msgspec.msgpack.decode(msgspec.msgpack.encode(r.info()), type=RegionInfo))
    assert back == r


# --- plans across block sizes and prefixes ---------------------------------------------------
def remote_of(lay: KVLayout, tp_rank: int = 0, tp: int = 1) -> RemoteLayout:
    return RemoteLayout(
        engine_id="d",
        agent_name="d-agent",
        regions=lay.regions,
        block_size=lay.block_size,
        physical_blocks_per_logical=lay.physical_blocks_per_logical,
        tp_size=tp,
        tp_rank=tp_rank,
        pp_size=1,
        pp_rank=0,
        mem_type="DRAM",
        kv_heads=lay.kv_heads,
    )


def test_plan_aligns_tokens_across_block_sizes() -> None:
    p = layout_of("hnd", block_size=16)
    d = layout_of("hnd", block_size=32)
    paired = PairedLayout(p, (0, 1), remote_of(d), range(4), 4)
    # 5 P blocks = 80 tokens = 3 D blocks (the last one half full); D had 1 cached.
    plan = paired.plan(((10, 11, 12, 13, 14),), ((3, 4),), (1,))
    # D block 3 ← P blocks 12, 13 (tokens 32..63); D block 4 ← P block 14 only (tokens 64..79).
    assert plan.nbytes == 3 * p.regions[0].block_len * 4
    with pytest.raises(PlanError, match="only 3"):
        paired.plan(((10, 11, 12, 13, 14),), ((3, 4, 5),), (1,))
    # Without a prefix count P aligns D's blocks with its own last tokens.
    assert paired.plan(((10, 11, 12, 13, 14),), ((3, 4),)).nbytes == plan.nbytes
    small = PairedLayout(d, (0, 1), remote_of(p), range(4), 4)
    with pytest.raises(PlanError, match="cached"):
        small.plan(((1, 2),), ((1, 2, 3),))  # D blocks smaller than P's: D must say its prefix


def test_block_sizes_without_a_ratio_do_not_pair() -> None:
    with pytest.raises(LayoutError, match="neither divides"):
        PairedLayout(layout_of("hnd", block_size=16), (0, 1), remote_of(layout_of("hnd", block_size=24)), range(4), 4)


def test_described_and_opaque_do_not_pair() -> None:
    spec = SimSpec(num_blocks=6)
    opaque = KVLayout.from_tensors({"layer.0": torch.zeros(6, 2, 64, dtype=torch.uint8)}, block_size=spec.block_size)
    with pytest.raises(LayoutError, match="both must"):
        PairedLayout(layout_of("hnd"), (0, 1), remote_of(opaque), range(4), 4)


def test_registration_carries_prefix_counts_and_pp_rank() -> None:
    base = dict(
        request_id="r",
        decode_engine_id="d",
        decode_host="h",
        decode_port=1,
        decode_tp_size=1,
        local_block_ids=((1, 2), (3,)),
        remote_engine_id="p",
        remote_host="h",
        remote_port=2,
        remote_tp_size=1,
    )
    reg = Registration(**base, skip_blocks=(2, 0))  # type: ignore[arg-type]
    assert reg.skip_blocks == (2, 0) and reg.decode_pp_rank == 0 and reg.decode_pp_size == 1
    with pytest.raises(ValueError, match="one count per KV group"):
        Registration(**base, skip_blocks=(1,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_pp_rank"):
        Registration(**base, decode_pp_rank=1)  # type: ignore[arg-type]
