"""Layer-wise pushes between two node processes over real NIXL, shared by the DRAM test
(tests/test_layerwise_real.py) and the VRAM one (tests/test_vram.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Node


class Events:
    """The nodes' ``sent`` / ``received`` events, by kind and request id."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.got: dict[str, tuple[Any, ...]] = {}

    def __call__(self, event: tuple[Any, ...]) -> None:
        with self.cond:
            if event[0] in ("sent", "received"):
                self.got[f"{event[0]}:{event[1]}"] = event
            self.cond.notify_all()

    def wait(self, key: str, timeout: float = 60.0) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while key not in self.got:
                left = deadline - time.monotonic()
                assert left > 0, f"{key} never reported"
                self.cond.wait(min(left, 0.5))
            return self.got[key]


def layered_round_trip(
    p: Node, d: Node, events: Events, spec: SimSpec, tokens: int, key: str, work: dict[str, int], n: int
) -> None:
    """One layer-wise push, D's registration waiting at P before the forward (the steady
    state): P computes layer by layer (a kernel per layer, then its KV), D checks every byte."""
    p_id, d_id = f"lw-{n}-aaaaaaaa", f"lw-{n}-dddddddd"
    d.expect(d_id, tokens, p.decode_params(p_id), key, wait=True)
    p.wait_registrations_held(1)
    p.forward(p_id, tokens, key, layerwise=True, work={**work, "tokens": tokens})
    got = events.wait(f"received:{d_id}")
    sent = events.wait(f"sent:{p_id}")
    assert got[2] is None and sent[2] is None, (got, sent)
    blocks = -(-tokens // spec.block_size)
    assert got[3] == blocks * spec.block_bytes * 2 * spec.num_layers and got[4] == 0  # every byte, none wrong
