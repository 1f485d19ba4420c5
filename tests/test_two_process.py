"""P and D as separate OS processes: real NIXL over UCX (DRAM here), real ZMQ side channel."""

from __future__ import annotations

import os
import random

import pytest

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec

pytestmark = pytest.mark.real_nixl


def start_pair(spec: SimSpec, tp: int = 1, **config) -> tuple[Node, Node, Dispatcher]:
    router = Dispatcher(seed=tp)
    p = Node(
        NodeSpec(role="prefill", engine_id="prefill-0", tp_size=tp, sim=spec, config=config), on_event=router.on_event
    )
    d = Node(
        NodeSpec(role="decode", engine_id="decode-0", tp_size=tp, sim=spec, config=config), on_event=router.on_event
    )
    try:
        p.wait_ready()
        d.wait_ready()
    except BaseException:
        p.stop()
        d.stop()
        raise
    return p, d, router


def run_workload(p: Node, d: Node, router: Dispatcher, spec: SimSpec, count: int, seed: int) -> None:
    rng = random.Random(seed)
    max_blocks = 12
    window = spec.num_blocks // max_blocks - 1
    for i in range(count):
        assert router.wait_below(window, timeout=60), "requests stopped finishing"
        router.dispatch_mixed(p, d, i, rng, max_blocks=max_blocks, block_size=spec.block_size)
    assert router.wait_all(timeout=120), "not every request finished"


def check_outcomes(router: Dispatcher, spec: SimSpec) -> None:
    for o in router.outcomes:
        assert o.sent is None, f"{o.p_id}: P failed: {o.sent}"
        assert o.received is None, f"{o.d_id}: D failed: {o.received}"
        assert o.wrong == 0, f"{o.d_id}: {o.wrong} wrong bytes"
        blocks = -(-o.tokens // spec.block_size) - o.cached
        # Every byte of every registered block, K and V, every layer, all TP ranks together.
        assert o.checked == blocks * spec.block_bytes * 2 * spec.num_layers


@pytest.mark.parametrize("tp", [1, 2])
def test_two_processes_push_every_byte(tp: int) -> None:
    spec = SimSpec(num_layers=3, num_blocks=256, block_bytes=2048)
    count = 120 if tp == 1 else 48
    p, d, router = start_pair(spec, tp=tp, reaper_tick=0.02)
    try:
        run_workload(p, d, router, spec, count, seed=tp)
        check_outcomes(router, spec)
        p_quiet, p_stats = p.quiesce(timeout=30)
        d_quiet, d_stats = d.quiesce(timeout=30)
        assert p_quiet and d_quiet, "push work still pending"
        assert p_stats["held"] == 0 and p_stats["free_blocks"] == spec.num_blocks  # P's blocks freed
        assert d_stats["free_blocks"] == spec.num_blocks
        assert p_stats["metrics"]["push.pushed"] == count * tp  # every P rank pushed its slice
        assert p_stats["metrics"].get("push.failed", 0) == 0
        assert d_stats["metrics"]["recv.finished"] == count * tp
        assert p_stats["healthy"] and d_stats["healthy"]
    finally:
        p_final = p.stop()
        d_final = d.stop()
    assert p_final is not None and d_final is not None
    assert p.error is None and d.error is None


def test_a_node_that_dies_at_start_is_reported_with_its_exit_status() -> None:
    """A node process that dies in native code never sends "error": what the test run shows
    must still say how it ended (here a signal, long before its imports end), not only that
    its pipe closed."""
    import signal

    from pushactors.testing.node import exit_status

    node = Node(NodeSpec(role="decode", engine_id="dies-at-start", sim=SimSpec(num_layers=1, num_blocks=4)))
    os.kill(node.process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="decode node failed to start: killed by SIGKILL"):
        node.wait_ready(60)
    assert exit_status(-11) == "killed by SIGSEGV" and exit_status(3) == "exit code 3"
