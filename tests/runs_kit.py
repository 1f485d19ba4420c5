"""Pushes of blocks in order between two node processes over real NIXL (DRAM or VRAM)."""

from __future__ import annotations

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec


def in_order_round_trip(layout: str, device: str) -> None:
    """Fresh pools hand out blocks in order, so P posts each WRITE as runs (``post_runs``):
    never one across two per-layer tensors, which are separate registrations even where the
    allocator put them back to back. Every element D holds is checked for what it means."""
    kw = {"num_layers": 8, "num_blocks": 256, "kv_heads": 8, "head_dim": 64, "device": device}
    spec = SimSpec(layout=layout, shuffle_blocks=False, **kw)  # type: ignore[arg-type]
    router = Dispatcher(seed=3)
    # Every WRITE as runs, the 17-token one too (small ones post by index by default).
    runs = {"post_runs_min_pieces": 0}
    p = Node(NodeSpec(role="prefill", engine_id="prefill-runs", sim=spec, config=runs), on_event=router.on_event)
    d = Node(NodeSpec(role="decode", engine_id="decode-runs", sim=spec), on_event=router.on_event)
    try:
        p.wait_ready()
        d.wait_ready()
        tokens = [1024, 17, 2000, 512, 4000]
        for i, n in enumerate(tokens):
            router.dispatch(p, d, i, n, order="prefill_first")
            assert router.wait_all(timeout=60)  # one at a time: each takes the next blocks in order
        for o in router.outcomes:
            assert o.ok, (o.d_id, o.sent, o.received, o.wrong)
            assert o.checked == o.tokens * spec.num_layers * 2 * spec.model_heads * spec.head_dim * spec.elem_size
        metrics = p.stats()["metrics"]
        assert metrics.get("write.runs", 0) == len(tokens), metrics
        assert metrics.get("write.submit_failed", 0) == 0, metrics
    finally:
        p.stop()
        d.stop()
