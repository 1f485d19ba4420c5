"""A hybrid model's KV cache groups (full attention + a sliding window) pushed and checked by
meaning: on the fake fabric over every layout family and TP pairing, and between two processes
over real NIXL (DRAM here; tests/test_vram.py's machine runs the VRAM case).

The simulated engine keeps vLLM's hybrid allocator's lists: odd layers form a sliding-window
group whose blocks behind the window are the null block (0) on P and D alike; D registers per
group without them. D checks each group's registered blocks in that group's layers, element by
element, and that its null block is still all zeros.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pushactors.core.topology import rank_heads
from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec
from pushactors.testing.pair import PushPair

WINDOW = 40
BLOCK = 16
PROMPTS = [(5, 0), (39, 0), (40, 0), (57, 0), (100, 0), (100, 2), (100, 5), (203, 1)]  # (tokens, cached D blocks)


def expected_bytes(spec: SimSpec, tp: int, tokens: int, cached: int) -> int:
    """Elements D checks: full layers from its prefix hit, window layers from the window's first block."""
    kv = 1 if spec.layout.startswith("mla") else 2
    heads = sum(len(rank_heads(r, tp, spec.model_heads)) for r in range(tp))
    per_token_layer = kv * heads * spec.head_dim * spec.elem_size
    layers = spec.num_layers // 2
    full = tokens - cached * spec.block_size
    window = tokens - max(cached, spec.behind_window(tokens)) * spec.block_size
    return (full + window) * layers * per_token_layer


def push(p_spec: SimSpec, d_spec: SimSpec, p_tp: int, d_tp: int, tokens: int, cached: int) -> PushPair:
    pair = PushPair(p_tp=p_tp, d_tp=d_tp, p_spec=p_spec, d_spec=d_spec)
    try:
        pair.prefill.prefill("p-1", tokens, key="prompt-H", transfer_id="t-1")
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": pair.p_endpoint.host,
            "remote_port": pair.p_endpoint.port,
            "remote_tp_size": p_tp,
            "transfer_id": "t-1",
        }
        pair.decode.expect("d-1", tokens, params, key="prompt-H", cached_blocks=cached)
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="the push to settle")
    except BaseException:
        pair.close()
        raise
    return pair


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_tp", "d_tp"),
    [("nhd", "nhd", 1, 1), ("cpu", "blhnc", 1, 2), ("blnhc", "kv_hnd", 2, 1), ("mla", "mla_blhnc", 1, 2)],
)
@pytest.mark.parametrize(("tokens", "cached"), PROMPTS)
def test_each_group_lands_what_d_reads_on_the_fake_fabric(
    p_layout: str, d_layout: str, p_tp: int, d_tp: int, tokens: int, cached: int
) -> None:
    p_spec = SimSpec(layout=p_layout, num_layers=4, num_blocks=64, block_size=BLOCK, sliding_window=WINDOW)
    d_spec = SimSpec(layout=d_layout, num_layers=4, num_blocks=64, block_size=BLOCK, sliding_window=WINDOW)
    pair = push(p_spec, d_spec, p_tp, d_tp, tokens, cached)
    try:
        assert pair.sent["p-1"] is None, pair.sent["p-1"]
        assert pair.received["d-1"] is None, pair.received["d-1"]
        checked, wrong = pair.decode.verify("d-1")
        assert wrong == 0, pair.decode.wrong_elements("d-1")
        assert checked == expected_bytes(d_spec, d_tp, tokens, cached)
    finally:
        pair.close()


def test_the_check_sees_a_window_group_left_unwritten() -> None:
    """Negative control: D registered as a non-hybrid model (one group) cannot pair with P."""
    p_spec = SimSpec(layout="nhd", num_layers=4, num_blocks=64, block_size=BLOCK, sliding_window=WINDOW)
    d_spec = SimSpec(layout="nhd", num_layers=4, num_blocks=64, block_size=BLOCK)
    pair = PushPair(p_tp=1, d_tp=1, p_spec=p_spec, d_spec=d_spec)
    try:
        pair.prefill.prefill("p-1", 100, key="prompt-H", transfer_id="t-1")
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": pair.p_endpoint.host,
            "remote_port": pair.p_endpoint.port,
            "remote_tp_size": 1,
            "transfer_id": "t-1",
        }
        pair.decode.expect("d-1", 100, params, key="prompt-H")
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="the push to settle")
        assert pair.received["d-1"] is not None  # failed visibly: the layers' groups differ
        assert pair.decode.verify("d-1")[1] > 0
    finally:
        pair.close()


def _two_processes(device: str, p_layout: str, d_layout: str, p_tp: int, d_tp: int) -> None:
    # Every request is in flight at once: both ends hold all of them (250 blocks with the
    # window groups), so the pools never run short whatever order the pushes settle in.
    spec: dict[str, Any] = dict(num_layers=4, num_blocks=320, block_size=BLOCK, sliding_window=WINDOW, device=device)
    p_spec = SimSpec(layout=p_layout, **spec)
    d_spec = SimSpec(layout=d_layout, **spec)
    router = Dispatcher(seed=p_tp * 10 + d_tp)
    p = Node(NodeSpec(role="prefill", engine_id="prefill-0", tp_size=p_tp, sim=p_spec), on_event=router.on_event)
    d = Node(NodeSpec(role="decode", engine_id="decode-0", tp_size=d_tp, sim=d_spec), on_event=router.on_event)
    try:
        p.wait_ready()
        d.wait_ready()
        rng = random.Random(3)
        requests = [*PROMPTS, *((rng.randint(1, 300), rng.randint(0, 2)) for _ in range(12))]
        for i, (tokens, cached) in enumerate(requests):
            cached = min(cached, (tokens - 1) // BLOCK)
            router.dispatch(p, d, i, tokens, order=("together", "prefill_first", "decode_first")[i % 3], cached=cached)
        finished = router.wait_all(timeout=120)
        stuck = [(o.p_id, o.sent, o.d_id, o.received) for o in router.outcomes if not o.done]
        assert finished, f"not every request finished: {stuck}"
        for o in router.outcomes:
            assert o.sent is None, f"{o.p_id}: P failed: {o.sent}"
            assert o.received is None, f"{o.d_id}: D failed: {o.received}"
            assert o.wrong == 0, f"{o.d_id}: {o.wrong} wrong bytes"
            assert o.checked == expected_bytes(d_spec, d_tp, o.tokens, o.cached), (o.d_id, o.tokens, o.cached)
        p_quiet, p_stats = p.quiesce(timeout=30)
        d_quiet, _ = d.quiesce(timeout=30)
        assert p_quiet and d_quiet
        assert p_stats["free_blocks"] == p_spec.num_blocks - 1  # every block back but the null block
    finally:
        p.stop()
        d.stop()


@pytest.mark.real_nixl
@pytest.mark.parametrize(("p_layout", "d_layout", "p_tp", "d_tp"), [("nhd", "nhd", 1, 1), ("cpu", "blhnc", 1, 2)])
def test_hybrid_groups_over_real_nixl_dram(p_layout: str, d_layout: str, p_tp: int, d_tp: int) -> None:
    _two_processes("cpu", p_layout, d_layout, p_tp, d_tp)


@pytest.mark.gpu
@pytest.mark.real_nixl
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: VRAM transfers need a GPU")
@pytest.mark.parametrize(("p_layout", "d_layout", "p_tp", "d_tp"), [("nhd", "nhd", 1, 1), ("blnhc", "nhd", 2, 1)])
def test_hybrid_groups_over_real_nixl_vram(p_layout: str, d_layout: str, p_tp: int, d_tp: int) -> None:
    _two_processes("cuda", p_layout, d_layout, p_tp, d_tp)
