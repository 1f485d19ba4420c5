"""``pushactors demo``: push a batch of synthetic requests from P to D and verify every byte.

By default P and D run as two OS processes moving real bytes through NIXL (UCX): DRAM here, VRAM
when CUDA is available (``--device``). A router sends both legs of every request at once.
``--fabric fake`` runs both engines in this process over the fake fabric instead.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..logs import configure_logging, remove_sink
from .argtypes import positive_int, positive_seconds
from .progress import Progress


@dataclass
class DemoResult:
    requests: int = 0
    finished: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    bytes_verified: int = 0
    bytes_wrong: int = 0
    latencies: list[float] = field(default_factory=list)  # seconds, per request
    wall: float = 0.0
    log_paths: list[str] = field(default_factory=list)
    mode: str = ""

    @property
    def ok(self) -> bool:
        return self.finished == self.requests and not self.failed and self.bytes_wrong == 0

    def summary(self) -> str:
        lat = sorted(self.latencies)

        def pct(p: float) -> str:
            if not lat:
                return "n/a"
            return f"{lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3:.2f} ms"

        gbps = self.bytes_verified / self.wall / 1e9 if self.wall else 0.0
        lines = [
            f"pushactors demo ({self.mode})",
            f"  requests      {self.requests}   finished {self.finished}   failed {len(self.failed)}",
            f"  bytes         {self.bytes_verified:,} verified on D, {self.bytes_wrong:,} wrong",
            f"  throughput    {gbps:.3f} GB/s verified KV over {self.wall:.2f} s",
            f"  push latency  p50 {pct(0.50)}   p99 {pct(0.99)}   (registration staged → KV landed on D)",
        ]
        for rid, why in list(self.failed.items())[:10]:
            lines.append(f"  FAILED {rid}: {why}")
        for p in self.log_paths:
            lines.append(f"  mailbox log   {p}")
        lines.append("  RESULT        " + ("OK: every byte verified" if self.ok else "FAILED"))
        return "\n".join(lines)


def run_fake(args: argparse.Namespace, progress: Progress) -> DemoResult:
    """Both engines in this process over the fake fabric."""
    result = DemoResult(mode="in-process, fake NIXL fabric")
    sink = None
    if args.log_dir:
        path = Path(args.log_dir) / "mailbox-inprocess.jsonl"
        sink = configure_logging(json_path=path)
        result.log_paths.append(str(path))
    rng = random.Random(args.seed)
    # The engines (and torch) load only when a demo runs: the CLI's other commands start fast.
    from ..testing.engine import SimSpec
    from ..testing.pair import PushPair

    spec = SimSpec(num_layers=args.layers, num_blocks=args.blocks, block_bytes=args.block_bytes)
    started_at: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        with PushPair(p_spec=spec, seed=args.seed) as pair:
            todo = list(range(args.requests))
            inflight: set[str] = set()
            while todo or inflight:
                while todo and len(inflight) < args.concurrency:
                    i = todo.pop(0)
                    tokens = rng.randint(1, args.max_tokens)
                    if pair.prefill.blocks_for(tokens) > min(pair.prefill.free_blocks, pair.decode.free_blocks):
                        todo.insert(0, i)
                        break
                    base = f"demo-{i}"
                    d_id = f"{base}-{rng.getrandbits(32):08x}"
                    # Both legs at once: D needs only P's identity.
                    params = pair.prefill.scheduler.decode_params(base)
                    pair.decode.expect(d_id, tokens, params, key=base)
                    started_at[d_id] = time.monotonic()
                    pair.prefill.prefill(f"{base}-{rng.getrandbits(32):08x}", tokens, key=base)
                    inflight.add(d_id)
                    result.requests += 1
                pair.step()
                for d_id in [d for d in inflight if d in pair.received]:
                    inflight.discard(d_id)
                    why = pair.received[d_id]
                    if why is None:
                        result.latencies.append(time.monotonic() - started_at[d_id])
                        checked, wrong = pair.decode.verify(d_id)
                        result.bytes_verified += checked
                        result.bytes_wrong += wrong
                        result.finished += 1
                    else:
                        result.failed[d_id] = why
                    pair.decode.finish_recv(d_id)
                progress.update(result.finished + len(result.failed), f"{len(inflight)} in flight")
            pair.pump(pair.settled, timeout=30, what="leases to clear")
    finally:
        if sink is not None:
            remove_sink(sink)
            sink.close()
    result.wall = time.monotonic() - t0
    return result


def run_nixl(args: argparse.Namespace, progress: Progress) -> DemoResult:
    """P and D as separate processes, real NIXL, ZMQ side channel, a concurrent-legs router."""
    import math

    import torch

    from ..testing.node import Dispatcher, Node, NodeSpec

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    mem = "VRAM" if device == "cuda" else "DRAM"
    result = DemoResult(mode=f"two processes, real NIXL over UCX, {mem}, TP={args.tp}")
    per_request = math.ceil(args.max_tokens / 16)
    blocks = max(args.blocks, per_request * args.concurrency + 8)
    from ..testing.engine import SimSpec

    spec = SimSpec(num_layers=args.layers, num_blocks=blocks, block_bytes=args.block_bytes, device=device)
    router = Dispatcher(seed=args.seed)
    logs = {}
    if args.log_dir:
        for role in ("prefill", "decode"):
            logs[role] = str(Path(args.log_dir) / f"mailbox-{role}.jsonl")
            Path(logs[role]).unlink(missing_ok=True)
    nodes = [
        Node(
            NodeSpec(
                role=role, engine_id=f"{role}-0", tp_size=args.tp, sim=spec, log_json=logs.get(role), seed=args.seed
            ),
            on_event=router.on_event,
        )
        for role in ("prefill", "decode")
    ]
    p, d = nodes
    rng = random.Random(args.seed)

    def show_progress() -> None:
        in_flight = router.in_flight()
        progress.update(len(router.outcomes) - in_flight, f"{in_flight} in flight")

    try:
        progress.stage("demo: starting P and D")
        for node in nodes:
            node.wait_ready(timeout=180)
        progress.note(
            f"  P pid {p.info['pid']}, D pid {d.info['pid']}; side channels :{p.info['port']} :{d.info['port']}"
        )
        progress.stage("demo", total=args.requests)
        t0 = time.monotonic()
        last = 0.0
        for i in range(args.requests):
            if not router.wait_below(args.concurrency, timeout=args.timeout):
                break
            router.dispatch(p, d, i, rng.randint(1, args.max_tokens))
            now = time.monotonic()
            if now - last > 0.2:  # counting what is in flight walks every outcome
                last = now
                show_progress()
        deadline = time.monotonic() + args.timeout
        while not router.wait_all(timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            show_progress()
        show_progress()
        result.wall = time.monotonic() - t0
        for node in nodes:
            quiet, _ = node.quiesce(timeout=30)
            if not quiet:
                result.failed[node.spec.role] = "engine still had pending push work after the run"
    finally:
        for node in nodes:
            node.stop()
    for o in router.outcomes:
        result.requests += 1
        if o.ok:
            result.finished += 1
            result.latencies.append(o.push_latency)
        elif not o.done:
            result.failed[o.d_id] = "did not finish before the timeout"
        else:
            result.failed[o.d_id] = o.received or o.sent or f"{o.wrong} wrong bytes"
        result.bytes_verified += o.checked
        result.bytes_wrong += o.wrong
    result.requests = max(result.requests, args.requests)
    result.log_paths = list(logs.values())
    for node in nodes:
        if node.error:
            result.failed[node.spec.role] = node.error.strip().splitlines()[-1]
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--fabric",
        choices=["nixl", "fake"],
        default="nixl",
        help="nixl: P and D as two processes over real NIXL (default); fake: one process, fake fabric",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="where the KV lives (nixl)")
    p.add_argument("--tp", type=positive_int, default=1, help="TP size of both engines (nixl)")
    p.add_argument("--timeout", type=positive_seconds, default=300.0, help="seconds to wait for the run to finish")
    p.add_argument("--requests", type=positive_int, default=200)
    p.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight at once")
    p.add_argument("--max-tokens", type=positive_int, default=2048)
    p.add_argument("--layers", type=positive_int, default=8, help="KV layers (each a K and a V region)")
    p.add_argument(
        "--blocks",
        type=positive_int,
        default=1024,
        help="KV blocks per engine (raised to fit the concurrency)",
    )
    p.add_argument("--block-bytes", type=positive_int, default=16384, help="bytes of one layer's K (or V) block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="runs/demo", help="where the JSON mailbox logs go ('' for none)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pushactors demo", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def _refused(args: argparse.Namespace) -> str | None:
    """Why these sizes or paths cannot run, said before anything starts."""
    kv = 2 * args.layers * args.blocks * args.block_bytes * 2  # K and V, on P and on D
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    if memory and kv > memory // 2:
        need, have = kv / 2**30, memory / 2**30
        return (
            f"the KV caches take {need:.1f} GiB (2 x layers x blocks x block-bytes, on P and on D); "
            f"this machine has {have:.1f} GiB"
        )
    if args.log_dir:
        where = Path(args.log_dir)
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--log-dir {args.log_dir}: {exc.strerror or exc}"
    return None


def run(args: argparse.Namespace) -> int:
    why = _refused(args)
    if why is not None:
        print(f"pushactors demo: {why}", file=sys.stderr)
        return 2
    if args.fabric != "fake":
        from ..transport.nixl import nixl_available

        if not nixl_available():
            print("NIXL is not installed: pip install 'pushactors[nixl]', or use --fabric fake", file=sys.stderr)
            return 2
    # Progress on stderr, gone before the summary: stdout carries only the summary.
    with Progress("demo", total=args.requests, enabled=args.progress) as progress:
        result = run_fake(args, progress) if args.fabric == "fake" else run_nixl(args, progress)
    print(result.summary())
    return 0 if result.ok else 1
