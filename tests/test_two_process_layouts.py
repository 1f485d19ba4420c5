"""KV layouts across two OS processes over real NIXL (UCX, DRAM here): a representative subset
of the fake-fabric matrix in ``test_topologies.py``, checked element by element on D."""

from __future__ import annotations

import pytest
from runs_kit import in_order_round_trip
from staged_kit import staged_round_trip

from pushactors.core.topology import rank_heads
from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec

pytestmark = pytest.mark.real_nixl

# (name, P layout, D layout, P TP, D TP, P PP, kv heads, P block size, D block size)
CASES = [
    ("nhd-tp2-to-hnd-tp1", "nhd", "hnd", 2, 1, 1, 4, 16, 16),
    ("cpu-tp1-to-blhnc-tp2", "cpu", "blhnc", 1, 2, 1, 4, 16, 16),
    ("bhlnc-pp2-to-nhd", "bhlnc", "nhd", 1, 1, 2, 4, 16, 16),
    ("mla-tp2-to-tp1", "mla", "mla_blhnc", 2, 1, 1, 1, 16, 16),
    ("mla-tp1-to-tp2", "mla_blhnc", "mla", 1, 2, 1, 1, 16, 16),
    ("gqa2-tp2-to-tp4", "split_nhd", "kv_hnd", 2, 4, 1, 2, 16, 16),
    ("bs16-to-bs32", "nhd", "blnhc", 1, 1, 1, 4, 16, 32),
    ("bs32-to-bs16", "blhnc", "cpu", 2, 1, 1, 4, 32, 16),
]


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_tp", "d_tp", "p_pp", "kv_heads", "p_bs", "d_bs"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_layouts_over_real_nixl(
    p_layout: str, d_layout: str, p_tp: int, d_tp: int, p_pp: int, kv_heads: int, p_bs: int, d_bs: int
) -> None:
    p_spec = SimSpec(layout=p_layout, num_layers=4, num_blocks=64, block_size=p_bs, kv_heads=kv_heads)
    d_spec = SimSpec(layout=d_layout, num_layers=4, num_blocks=64, block_size=d_bs, kv_heads=kv_heads)
    router = Dispatcher(seed=p_tp * 10 + d_tp)
    p = Node(
        NodeSpec(role="prefill", engine_id="prefill-0", tp_size=p_tp, pp_size=p_pp, sim=p_spec),
        on_event=router.on_event,
    )
    d = Node(NodeSpec(role="decode", engine_id="decode-0", tp_size=d_tp, sim=d_spec), on_event=router.on_event)
    try:
        p.wait_ready()
        d.wait_ready()
        requests = [(1, 0), (37, 0), (100, 0), (130, 1), (64, 2), (200, 3)]  # (tokens, cached D blocks)
        for i, (tokens, cached) in enumerate(requests):
            router.dispatch(p, d, i, tokens, order=("together", "prefill_first", "decode_first")[i % 3], cached=cached)
        assert router.wait_all(timeout=120), "not every request finished"
        kv = 1 if d_layout.startswith("mla") else 2
        heads = sum(len(rank_heads(r, d_tp, d_spec.model_heads)) for r in range(d_tp))
        for o in router.outcomes:
            assert o.sent is None, f"{o.p_id}: P failed: {o.sent}"
            assert o.received is None, f"{o.d_id}: D failed: {o.received}"
            assert o.wrong == 0, f"{o.d_id}: {o.wrong} wrong bytes"
            positions = o.tokens - o.cached * d_bs
            assert o.checked == positions * d_spec.num_layers * kv * heads * d_spec.head_dim * d_spec.elem_size
        p_quiet, p_stats = p.quiesce(timeout=30)
        d_quiet, d_stats = d.quiesce(timeout=30)
        assert p_quiet and d_quiet
        assert p_stats["held"] == 0 and p_stats["free_blocks"] == p_spec.num_blocks
        assert d_stats["free_blocks"] == d_spec.num_blocks
        assert p_stats["metrics"].get("push.failed", 0) == 0
    finally:
        p.stop()
        d.stop()
    assert p.error is None and d.error is None


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_tp", "d_tp", "chunk"), [("hnd", "hnd", 1, 1, 0), ("nhd", "blhnc", 2, 1, 64 << 10)]
)
def test_staged_pushes_over_real_nixl(p_layout: str, d_layout: str, p_tp: int, d_tp: int, chunk: int) -> None:
    """Staged pushes across processes: gathered into P's slot, WRITEn (in chunks, the
    completion after the last) into D's slot, scattered into D's blocks; checked by meaning."""
    config = {"staging_bytes": 16 << 20, "staging_min_runs": 1, "staging_min_bytes": 1, "staging_chunk_bytes": chunk}
    config["staging_gather_runs"] = 0  # gather however few runs P's pieces form
    p_spec = SimSpec(layout=p_layout, num_layers=4, num_blocks=128)
    d_spec = SimSpec(layout=d_layout, num_layers=4, num_blocks=128)
    staged_round_trip(p_spec, d_spec, p_tp, d_tp, config, [(300, 0), (37, 0), (500, 2), (200, 1)], seed=7)


@pytest.mark.parametrize("layout", ["hnd", "blhnc"])
def test_staged_pushes_with_p_blocks_in_order_go_straight_over_real_nixl(layout: str) -> None:
    """P's blocks in order, D's scattered, across processes: P WRITEs its runs straight into
    D's slot (no gather), D scatters; checked by meaning, every block and slot back."""
    config = {"staging_bytes": 16 << 20, "staging_min_runs": 1, "staging_min_bytes": 1, "staging_gather_runs": 64}
    p_spec = SimSpec(layout=layout, num_layers=4, num_blocks=128, shuffle_blocks=False)
    d_spec = SimSpec(layout=layout, num_layers=4, num_blocks=128)
    requests = [(300, 0), (37, 0), (500, 2), (200, 1)]
    staged_round_trip(p_spec, d_spec, 1, 1, config, requests, seed=9, p_gathers=False)


def test_two_processes_blocks_in_order_post_runs_per_layer() -> None:
    """DRAM twin of the VRAM test: blocks in order are posted as runs that land every element."""
    in_order_round_trip("hnd", "cpu")
