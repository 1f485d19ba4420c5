"""Staged pushes across two node processes over real NIXL, checked by meaning: the body shared
by the DRAM test (``test_two_process_layouts.py``) and the VRAM one (``test_vram.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec

ORDERS = ("together", "prefill_first", "decode_first")


def staged_round_trip(
    p_spec: SimSpec,
    d_spec: SimSpec,
    p_tp: int,
    d_tp: int,
    config: dict[str, Any],
    requests: Sequence[tuple[int, int]],
    *,
    seed: int,
    engine: str = "0",
    p_gathers: bool = True,
) -> None:
    """Push every (tokens, cached blocks) request from a P node to a D node, staged: every
    request finishes on both sides with every element D holds right, both nodes end quiet with
    every block back, and both staged at least one push: P by gathering into its own slot, or
    (``p_gathers=False``) by writing its runs straight into D's slot and never gathering."""
    router = Dispatcher(seed=seed)
    p = Node(
        NodeSpec(role="prefill", engine_id=f"prefill-{engine}", tp_size=p_tp, sim=p_spec, config=config),
        on_event=router.on_event,
    )
    d = Node(
        NodeSpec(role="decode", engine_id=f"decode-{engine}", tp_size=d_tp, sim=d_spec, config=config),
        on_event=router.on_event,
    )
    try:
        p.wait_ready()
        d.wait_ready()
        for i, (tokens, cached) in enumerate(requests):
            router.dispatch(p, d, i, tokens, order=ORDERS[i % 3], cached=cached)
        assert router.wait_all(timeout=120), "not every request finished"
        for o in router.outcomes:
            assert o.ok, (o.d_id, o.sent, o.received, o.wrong)
            assert o.checked > 0
        p_quiet, p_stats = p.quiesce(timeout=30)
        d_quiet, d_stats = d.quiesce(timeout=30)
        assert p_quiet and d_quiet
        assert d_stats["metrics"].get("recv.staged", 0) > 0
        if p_gathers:
            assert p_stats["metrics"].get("write.staged", 0) > 0
        else:
            assert p_stats["metrics"].get("staging.straight", 0) > 0
            assert p_stats["metrics"].get("write.staged", 0) == 0
        assert p_stats["held"] == 0 and p_stats["free_blocks"] == p_spec.num_blocks
        assert d_stats["free_blocks"] == d_spec.num_blocks
    finally:
        p.stop()
        d.stop()
    assert p.error is None and d.error is None
