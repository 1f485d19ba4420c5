"""VRAM → VRAM between two processes (UCX cuda_ipc). Runs on a GPU machine, skips without one.

P and D must be separate processes: within one process UCX falls back to TCP for VRAM.
"""

from __future__ import annotations

import pytest
import torch
from runs_kit import in_order_round_trip
from staged_kit import staged_round_trip

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec

pytestmark = [pytest.mark.gpu, pytest.mark.real_nixl]

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: VRAM transfers need a GPU", allow_module_level=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_vram_two_processes_push_every_byte(tp: int) -> None:
    spec = SimSpec(num_layers=4, num_blocks=512, block_bytes=16384, device="cuda")
    router = Dispatcher(seed=tp)
    p = Node(NodeSpec(role="prefill", engine_id="prefill-gpu", tp_size=tp, sim=spec), on_event=router.on_event)
    d = Node(NodeSpec(role="decode", engine_id="decode-gpu", tp_size=tp, sim=spec), on_event=router.on_event)
    try:
        p.wait_ready()
        d.wait_ready()
        import random

        rng = random.Random(tp)
        for i in range(100):
            assert router.wait_below(16, timeout=60)
            router.dispatch(
                p,
                d,
                i,
                rng.randint(1, 24 * spec.block_size),
                order=rng.choice(["together", "prefill_first", "decode_first"]),
            )
        assert router.wait_all(timeout=120)
        for o in router.outcomes:
            assert o.ok, (o.d_id, o.sent, o.received, o.wrong)
            assert o.checked == -(-o.tokens // spec.block_size) * spec.block_bytes * 2 * spec.num_layers
        p_quiet, p_stats = p.quiesce(30)
        d_quiet, _ = d.quiesce(30)
        assert p_quiet and d_quiet
        assert p_stats["free_blocks"] == spec.num_blocks
        print(
            f"VRAM tp={tp}: {len(router.outcomes)} requests, "
            f"{sum(o.checked for o in router.outcomes):,} bytes verified, "
            f"p50 push {sorted(o.push_latency for o in router.outcomes)[50] * 1e3:.2f} ms"
        )
    finally:
        p.stop()
        d.stop()


# (name, P layout, D layout, P TP, D TP): NHD, HND and a block-outermost layout, hetero TP
VRAM_LAYOUTS = [
    ("nhd-tp2-to-nhd-tp1", "nhd", "nhd", 2, 1),
    ("hnd-tp1-to-hnd-tp2", "hnd", "hnd", 1, 2),
    ("nhd-tp2-to-hnd-tp1", "nhd", "hnd", 2, 1),
    ("blhnc-tp1-to-blhnc-tp1", "blhnc", "blhnc", 1, 1),
    ("bhlnc-tp2-to-blnhc-tp1", "bhlnc", "blnhc", 2, 1),
    ("mla-tp1-to-tp2", "mla", "mla_blhnc", 1, 2),
]


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_tp", "d_tp"), [c[1:] for c in VRAM_LAYOUTS], ids=[c[0] for c in VRAM_LAYOUTS]
)
def test_vram_layouts_verified_by_meaning(p_layout: str, d_layout: str, p_tp: int, d_tp: int) -> None:
    """Every element D holds encodes (layer, K/V, token, head, dim) and is checked on D's GPU."""
    from pushactors.core.topology import rank_heads

    kw = {"num_layers": 8, "num_blocks": 256, "kv_heads": 8, "head_dim": 64, "device": "cuda"}
    p_spec = SimSpec(layout=p_layout, **kw)  # type: ignore[arg-type]
    d_spec = SimSpec(layout=d_layout, **kw)  # type: ignore[arg-type]
    router = Dispatcher(seed=p_tp * 10 + d_tp)
    p = Node(NodeSpec(role="prefill", engine_id="prefill-gpu", tp_size=p_tp, sim=p_spec), on_event=router.on_event)
    d = Node(NodeSpec(role="decode", engine_id="decode-gpu", tp_size=d_tp, sim=d_spec), on_event=router.on_event)
    try:
        p.wait_ready()
        d.wait_ready()
        for i, tokens in enumerate([1, 15, 16, 17, 200, 511, 1000, 1024]):
            router.dispatch(p, d, i, tokens, order=("together", "prefill_first", "decode_first")[i % 3])
        assert router.wait_all(timeout=120)
        kv = 1 if d_layout.startswith("mla") else 2
        heads = sum(len(rank_heads(r, d_tp, d_spec.model_heads)) for r in range(d_tp))
        for o in router.outcomes:
            assert o.ok, (o.d_id, o.sent, o.received, o.wrong)
            assert o.checked == o.tokens * d_spec.num_layers * kv * heads * d_spec.head_dim * d_spec.elem_size
        print(
            f"VRAM {p_layout} tp{p_tp} -> {d_layout} tp{d_tp}: {len(router.outcomes)} requests, "
            f"{sum(o.checked for o in router.outcomes):,} bytes verified by meaning, "
            f"max push {max(o.push_latency for o in router.outcomes) * 1e3:.2f} ms"
        )
    finally:
        p.stop()
        d.stop()


@pytest.mark.parametrize("layout", ["hnd", "split_nhd", "blhnc"])
def test_vram_blocks_in_order_post_runs_inside_each_tensor(layout: str) -> None:
    """Blocks in order on both sides: every WRITE posted as runs, none across two per-layer
    tensors (NIXL refused such a descriptor here with NIXL_ERR_NOT_FOUND), every element right."""
    in_order_round_trip(layout, "cuda")


# (name, P layout, D layout, P TP, D TP, chunk bytes): one chunk (rows built on the GPU from
# grids), hetero TP with head slices, and chunks (rows built on the host)
VRAM_STAGED = [
    ("hnd-tp1-one-chunk", "hnd", "hnd", 1, 1, 0),
    ("nhd-tp2-to-blhnc-tp1", "nhd", "blhnc", 2, 1, 0),
    ("hnd-tp1-to-nhd-tp2", "hnd", "nhd", 1, 2, 0),
    ("nhd-tp2-to-blhnc-tp1-chunks", "nhd", "blhnc", 2, 1, 64 << 10),
]


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_tp", "d_tp", "chunk"), [c[1:] for c in VRAM_STAGED], ids=[c[0] for c in VRAM_STAGED]
)
def test_vram_staged_pushes_verified_by_meaning(p_layout: str, d_layout: str, p_tp: int, d_tp: int, chunk: int) -> None:
    """Staged pushes on the GPU: P's stager gathers into its slot with the fused kernel, one
    WRITE (or one per chunk) into D's slot, D's stager scatters into the blocks; every element
    D holds is checked by meaning on D's GPU, with a prefix cached on some requests."""
    config = {"staging_bytes": 64 << 20, "staging_min_runs": 1, "staging_min_bytes": 1, "staging_chunk_bytes": chunk}
    config["staging_gather_runs"] = 0  # gather however few runs P's pieces form
    kw = {"num_layers": 4, "num_blocks": 256, "kv_heads": 8, "head_dim": 64, "device": "cuda"}
    p_spec = SimSpec(layout=p_layout, **kw)  # type: ignore[arg-type]
    d_spec = SimSpec(layout=d_layout, **kw)  # type: ignore[arg-type]
    requests = [(300, 0), (37, 0), (500, 2), (200, 1), (1000, 0)]
    staged_round_trip(p_spec, d_spec, p_tp, d_tp, config, requests, seed=p_tp * 10 + d_tp, engine="gpu")


@pytest.mark.parametrize("layout", ["hnd", "blhnc"])
def test_vram_staged_pushes_with_p_blocks_in_order_go_straight(layout: str) -> None:
    """P's blocks in order, D's scattered, on the GPU: P WRITEs its runs straight from its KV
    tensors into D's slot (no gather), D's fused kernel scatters; every element checked. (Same
    layout on both sides: P's block-outermost blocks do not join into runs of D's per-layer
    image, so such a push is gathered.)"""
    config = {"staging_bytes": 64 << 20, "staging_min_runs": 1, "staging_min_bytes": 1, "staging_gather_runs": 64}
    kw = {"num_layers": 4, "num_blocks": 256, "kv_heads": 8, "head_dim": 64, "device": "cuda"}
    p_spec = SimSpec(layout=layout, shuffle_blocks=False, **kw)  # type: ignore[arg-type]
    d_spec = SimSpec(layout=layout, **kw)  # type: ignore[arg-type]
    requests = [(300, 0), (37, 0), (500, 2), (200, 1), (1000, 0)]
    staged_round_trip(p_spec, d_spec, 1, 1, config, requests, seed=3, engine="gpu", p_gathers=False)


@pytest.mark.parametrize("in_order", [True, False], ids=["runs", "scattered"])
def test_vram_layerwise_pushes_land_every_byte(in_order: bool) -> None:
    """Layer-wise over cuda_ipc: each layer's WRITE waits for the CUDA event recorded after its
    kernel, the completion only once every layer landed, every byte checked on D. Blocks in
    order post each layer as runs (the last one's lists prepared when the push opens);
    scattered blocks post by index into the lists prepared once per pairing."""
    from layers_kit import Events, layered_round_trip

    spec = SimSpec(num_layers=8, num_blocks=512, block_bytes=16384, device="cuda", shuffle_blocks=not in_order)
    cfg: dict[str, object] = {"push_mode": "layerwise"}
    if in_order:
        cfg["post_runs_min_pieces"] = 0
    events = Events()
    p = Node(NodeSpec(role="prefill", engine_id="prefill-gpu", sim=spec, config=cfg), on_event=events)
    d = Node(NodeSpec(role="decode", engine_id="decode-gpu", sim=spec, config=cfg), on_event=events)
    try:
        p.wait_ready()
        d.wait_ready()
        work = {"hidden": 1024, "width": 4096}
        for i, tokens in enumerate((1, 16, 17, 500, 2048, 4000)):
            layered_round_trip(p, d, events, spec, tokens, f"k{i}", work, i)
        stats = p.stats()["metrics"]
        assert stats["write.layerwise"] == 6 and stats.get("write.failed", 0) == 0
        if in_order:
            assert stats.get("write.prep_ahead_failed", 0) == 0
        p_quiet, p_stats = p.quiesce(30)
        assert p_quiet and p_stats["free_blocks"] == spec.num_blocks
    finally:
        p.stop()
        d.stop()
