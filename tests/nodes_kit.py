"""The shared rig of the real-NIXL node tests (``tests/test_real_*.py``, ``tests/test_xpyd_nixl.py``):
engines in their own OS processes (:class:`~pushactors.testing.node.Node`), every ``sent`` (P) and
``received`` (D) report timestamped as it reaches the test, deadlines instead of sleeps, and the
checks those tests end with (every byte landed, every block back).

The ``rec`` and ``cluster`` fixtures (tests/conftest.py) hand each test a :class:`Recorder` and a
:class:`Cluster` that kills whatever node the test left running.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec

# A small model whose pushes take milliseconds: 4 layers of 2 KiB blocks, 256 of them.
SMALL = SimSpec(num_layers=4, num_blocks=256, block_bytes=2048)


@dataclass
class Report:
    why: str | None  # None: success
    at: float  # the test's monotonic clock when the report arrived
    latency: float  # measured in the node: request handed to the engine -> reported
    checked: int = 0  # D: bytes verified
    wrong: int = 0  # D: bytes verified wrong


class Recorder:
    """Every ``sent`` (P) and ``received`` (D) report of every node, timestamped, and a
    :class:`~pushactors.testing.node.Dispatcher` fed after it (so a test waiting on the router
    finds the report recorded)."""

    def __init__(self, seed: int = 0) -> None:
        self.router = Dispatcher(seed=seed)
        self.cond = threading.Condition()
        self.sent: dict[str, Report] = {}
        self.received: dict[str, Report] = {}

    def on_event(self, event: tuple[Any, ...]) -> None:
        with self.cond:
            now = time.monotonic()
            if event[0] == "sent":
                self.sent[event[1]] = Report(event[2], now, event[3])
            elif event[0] == "received":
                self.received[event[1]] = Report(event[2], now, event[5], event[3], event[4])
            self.cond.notify_all()
        self.router.on_event(event)

    def forget(self, d_id: str) -> None:
        """D finished ``d_id``: its id may be used again, and the next report is that use's."""
        with self.cond:
            self.received.pop(d_id, None)

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(min(remaining, 0.2))
        return True

    def wait_sent(self, ids: list[str], timeout: float) -> bool:
        return self.wait(lambda: all(r in self.sent for r in ids), timeout)

    def wait_received(self, ids: list[str], timeout: float) -> bool:
        return self.wait(lambda: all(r in self.received for r in ids), timeout)


class Cluster:
    """Starts nodes (each boots in parallel with the test) and guarantees none outlives it."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.nodes: list[Node] = []

    def start(
        self,
        role: str,
        engine_id: str,
        spec: SimSpec,
        config: dict[str, Any],
        *,
        tp: int = 1,
        faults: dict[str, Any] | None = None,
    ) -> Node:
        node_spec = NodeSpec(role=role, engine_id=engine_id, tp_size=tp, sim=spec, config=config, faults=faults)
        node = Node(node_spec, on_event=self.rec.on_event)
        self.nodes.append(node)
        return node

    def close(self) -> None:
        for node in self.nodes:  # a node left frozen (SIGSTOP) could not answer "stop"
            thaw(node)
        for node in self.nodes:
            try:
                node.stop(timeout=10)
            finally:
                if node.process.is_alive():
                    node.kill()
        leaked = [n.process.pid for n in self.nodes if n.process.is_alive()]
        assert not leaked, f"node processes still alive: {leaked}"


def ready(*nodes: Node) -> None:
    for node in nodes:
        node.wait_ready()


def poll(fn: Callable[[], Any], timeout: float, step: float = 0.02) -> Any:
    """fn() until truthy (returned) or the deadline (None); waits on an Event, never sleeps bare."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got or time.monotonic() >= deadline:
            return got or None
        pause.wait(step)


def metric(stats: dict[str, Any], name: str) -> int:
    return int(stats["metrics"].get(name, 0))


def injected(node: Node, kind: str) -> int:
    """Faults of ``kind`` the node's agents injected so far (NodeSpec.faults)."""
    return int(node.stats()["injected"].get(kind, 0))


def settled_blocks(node: Node, timeout: float) -> dict[str, Any]:
    """Poll the node until every block is free, nothing is held and no push work pends; its
    last stats (the caller asserts on them: a timeout returns the state it ended in)."""
    total = node.spec.sim.num_blocks
    last: dict[str, Any] = {}

    def done() -> bool:
        last.clear()
        last.update(node.stats())
        return last["free_blocks"] == total and last["held"] == 0 and not last["pending_push_work"]

    poll(done, timeout, 0.05)
    return last


def kv_bytes(blocks: int, spec: SimSpec) -> int:
    """Every byte of ``blocks`` blocks, K and V, every layer (what D verifies)."""
    return blocks * spec.block_bytes * 2 * spec.num_layers


def serve(rec: Recorder, p: Node, d: Node, index: int, blocks: int, spec: SimSpec, timeout: float = 30.0) -> float:
    """One router request end to end; asserts success and every byte verified on D."""
    t0 = time.monotonic()
    o = rec.router.dispatch(p, d, index, blocks * spec.block_size)
    assert rec.router.wait(lambda: o.done, timeout), f"request {index} not finished within {timeout}s: {o}"
    assert o.sent is None, f"P failed request {index}: {o.sent}"
    assert o.received is None, f"D failed request {index}: {o.received}"
    assert o.wrong == 0, f"{o.wrong} wrong bytes"
    assert o.checked == kv_bytes(blocks, spec)
    return time.monotonic() - t0


def ids(tag: str, i: int) -> tuple[str, str, str]:
    """(base, P id, D id): the engines' per-request suffixes differ, the base id matches."""
    base = f"{tag}-{i}"
    return base, f"{base}-{0xA0000000 + i:08x}", f"{base}-{0xD0000000 + i:08x}"


def registered_on_p(p: Node, before: int, count: int) -> None:
    """Wait until P has taken ``count`` more notifications from D than ``before``.

    Heartbeats count too, but D heartbeats only requests it already registered, through the same
    writer and endpoint, so the first registration staged is surely on P when this returns."""
    assert poll(lambda: metric(p.stats(), "notif.received") >= before + count, 10), "registrations never reached P"


def freeze(node: Node) -> None:
    """SIGSTOP a node: its NIXL agent stops progressing, so a WRITE into it stays in flight."""
    signal_node(node, signal.SIGSTOP)


def thaw(node: Node) -> None:
    if node.process.is_alive():
        signal_node(node, signal.SIGCONT)


def signal_node(node: Node, signum: signal.Signals) -> None:
    pid = node.process.pid
    assert pid is not None, f"{node.spec.engine_id} was never started"
    os.kill(pid, signum)


def write_in_flight(p: Node, timeout: float = 30.0) -> bool:
    """Poll P until its own stats show a WRITE posted and not settled."""
    return bool(poll(lambda: writes_in_flight(p), timeout, 0.005))


def writes_in_flight(p: Node) -> int:
    m = p.stats()
    return metric(m, "write.posted") - metric(m, "write.done") - metric(m, "write.failed")


def in_flight_or_reported(rec: Recorder, p: Node, p_id: str) -> bool:
    return writes_in_flight(p) > 0 or p_id in rec.sent


@dataclass
class Caught:
    """A push whose WRITE P shows in flight into a frozen D."""

    base: str
    p_id: str
    d_id: str
    staged_at: float  # the test's monotonic clock just before D staged it
    prefilled_at: float  # ... just before P's prefill ended (its WRITE was posted after)
    attempts: int  # pushes tried (the others finished inside their post)


def push_caught_in_flight(rec: Recorder, p: Node, d: Node, tag: str, blocks: int, spec: SimSpec) -> Caught:
    """D registers a push of ``blocks`` blocks with P, D is frozen (SIGSTOP), P's prefill ends:
    returns once P shows the push's WRITE in flight, D still frozen (the caller thaws it, or
    the cluster does at teardown).

    On one host UCX may finish even a long WRITE inside its post (cma writes into a stopped
    process): nothing is in flight then. That push is let land on both sides, and another
    tried, three times at most."""
    for attempt in range(1, 4):
        base, p_id, d_id = ids(f"{tag}-try{attempt}", 0)
        before = metric(p.stats(), "notif.received")
        staged_at = time.monotonic()
        d.expect(d_id, blocks * spec.block_size, p.decode_params(base), key=base, wait=True)
        registered_on_p(p, before, 1)
        freeze(d)
        prefilled_at = time.monotonic()
        p.prefill(p_id, blocks * spec.block_size, key=base, wait=True)
        # P reports a push whose WRITE ended inside its post at once: no need to wait longer.
        seen = poll(functools.partial(in_flight_or_reported, rec, p, p_id), 10.0, 0.005)
        # Still in flight a while later (longer than a cma copy of it takes): caught, not racing.
        if seen and not rec.wait_sent([p_id], 0.5) and writes_in_flight(p) > 0:
            return Caught(base, p_id, d_id, staged_at, prefilled_at, attempt)
        thaw(d)
        assert rec.wait_sent([p_id], 30) and rec.wait_received([d_id], 30), f"{d_id}: the push never ended"
        why = rec.sent[p_id].why or "pushed"
        print(f"REAL-NIXL {d_id}: not caught in flight (P: {why}; D: {rec.received[d_id].why or 'landed'})", flush=True)
    raise AssertionError("three long WRITEs in a row finished inside their post: none was caught in flight")
