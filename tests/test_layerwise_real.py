"""Layer-wise pushes between two processes over real NIXL (UCX on DRAM): each layer is written
as P's forward computes it, D verifies every byte, and ``pushactors logs --trace`` shows the
layers. (The H200 figures come from ``pushactors bench layerwise --device cuda``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from layers_kit import Events, layered_round_trip

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Node, NodeSpec

pytestmark = [pytest.mark.real_nixl, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
SPEC = SimSpec(num_layers=6, num_blocks=64, block_size=16, block_bytes=4096)
WORK = {"tokens": 64, "hidden": 64, "width": 256}  # a small kernel per layer


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Node, Node, Events, Path]]:
    events = Events()
    cfg = {"push_mode": "layerwise", "layers_per_write": 2}
    nodes = [
        Node(
            NodeSpec(role=r, engine_id=f"{r}-0", sim=SPEC, config=cfg, log_json=str(tmp_path / f"{r}.jsonl")),
            on_event=events,
        )
        for r in ("prefill", "decode")
    ]
    try:
        for n in nodes:
            n.wait_ready()
        yield nodes[0], nodes[1], events, tmp_path
    finally:
        for n in nodes:
            n.stop()


def test_layers_land_byte_exact_over_real_nixl_and_the_trace_shows_them(pair: Any) -> None:
    p, d, events, logs = pair
    for i, tokens in enumerate((64, 200, 16)):
        layered_round_trip(p, d, events, SPEC, tokens, f"k{i}", WORK, i)
    stats = p.stats()["metrics"]
    assert stats["write.layerwise"] == 3 and stats.get("write.failed", 0) == 0
    p.stop()
    d.stop()
    out = subprocess.run(
        [sys.executable, "-m", "pushactors", "logs", str(logs), "--trace", "lw-1-dddddddd", "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    assert out.returncode == 0, out.stderr
    trace = json.loads(out.stdout)
    assert trace["outcome"] == "landed"
    layers = trace["layers"]
    assert [layer["layer_group"] for layer in layers] == [0, 1, 2] and layers[0]["of"] == 3
    assert sum(layer["bytes"] for layer in layers) == 13 * SPEC.block_bytes * 2 * SPEC.num_layers
    assert [layer["at"] for layer in layers] == sorted(layer["at"] for layer in layers)
    assert {h["event"] for h in trace["hops"]} >= {"layers.ready", "write.layer_posted", "recv.finished"}
