"""VRAM → VRAM between two processes (UCX cuda_ipc). Runs on a GPU machine, skips without one.

P and D must be separate processes: within one process UCX falls back to TCP for VRAM.
"""

from __future__ import annotations

import pytest
import torch

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec
from pushactors.transport.nixl import nixl_available

pytestmark = [pytest.mark.gpu, pytest.mark.real_nixl]

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: VRAM transfers need a GPU", allow_module_level=True)
if not nixl_available():
    pytest.skip("NIXL is not installed", allow_module_level=True)


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
