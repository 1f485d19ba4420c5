"""Transport throughput: P pushes to D, two processes, real NIXL; DRAM here, VRAM on a GPU.

    .venv/bin/python bench/push_bench.py [--device cuda] [--block-bytes 16384,65536,262144,1048576]

The simulated engines skip per-request KV fill and checks (the two-process tests and the demo
verify every byte); what is timed is the push itself. For each block size and allocation
pattern (blocks in order, so descriptors merge, or scattered) it reports the aggregate push rate
(bytes pushed / wall time from first dispatch to last completion), and from P's mailbox log the
per-WRITE rate (bytes / time from posting to DONE), the time spent posting, and descriptors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec


def run_case(args: argparse.Namespace, block_bytes: int, scattered: bool, out: Path) -> dict[str, float | int | str]:
    blocks_per_req = args.blocks_per_request
    spec = SimSpec(
        num_layers=args.layers,
        num_blocks=blocks_per_req * (args.concurrency + 2),
        block_size=16,
        block_bytes=block_bytes,
        device=args.device,
        shuffle_blocks=scattered,
        fill_and_verify=False,
    )
    tag = f"{block_bytes // 1024}k-{'scattered' if scattered else 'inorder'}"
    logs = {role: out / f"{tag}-{role}.jsonl" for role in ("prefill", "decode")}
    for p in logs.values():
        p.unlink(missing_ok=True)
    router = Dispatcher(seed=block_bytes)
    nodes = [
        Node(
            NodeSpec(role=role, engine_id=f"{role}-bench", tp_size=args.tp, sim=spec, log_json=str(logs[role])),
            on_event=router.on_event,
        )
        for role in ("prefill", "decode")
    ]
    p, d = nodes
    try:
        for node in nodes:
            node.wait_ready(timeout=180)
        tokens = blocks_per_req * spec.block_size
        # Warm-up: handshakes and descriptor lists, outside the timing.
        router.dispatch(p, d, -1, tokens)
        router.wait_all(timeout=120)
        router.outcomes.clear()
        t0 = time.monotonic()
        for i in range(args.requests):
            router.wait_below(args.concurrency, timeout=120)
            router.dispatch(p, d, i, tokens)
        ok = router.wait_all(timeout=600)
        wall = time.monotonic() - t0
    finally:
        for node in nodes:
            node.stop()
    failed = [o for o in router.outcomes if not o.ok]
    per_request = blocks_per_req * args.layers * 2 * block_bytes
    total = per_request * (len(router.outcomes) - len(failed))
    events = [json.loads(line) for line in logs["prefill"].read_text().splitlines()]
    settled = [e for e in events if e.get("event") == "write.settled" and e.get("ms")]
    posted = [e for e in events if e.get("event") == "write.posted"]
    rates = [e["bytes"] / (e["ms"] / 1e3) / 1e9 for e in settled]
    return {
        "case": tag,
        "ok": ok and not failed,
        "requests": len(router.outcomes),
        "MiB/request": round(per_request / 2**20, 1),
        "aggregate GB/s": round(total / wall / 1e9, 2),
        "per-WRITE GB/s p50": round(statistics.median(rates), 2) if rates else 0.0,
        "WRITE ms p50": round(statistics.median(e["ms"] for e in settled), 2) if settled else 0.0,
        "post ms p50": round(statistics.median(e.get("post_ms", 0.0) for e in posted), 2) if posted else 0.0,
        "descs": int(statistics.median(e["descs"] for e in posted)) if posted else 0,
        "merged": int(statistics.median(e["merged_descs"] for e in posted)) if posted else 0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--block-bytes", default="16384,65536,262144")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--blocks-per-request", type=int, default=64)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default="runs/bench-push")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for bb in (int(x) for x in args.block_bytes.split(",")):
        for scattered in (False, True):
            row = run_case(args, bb, scattered, out)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    cols = list(rows[0])
    lines = [
        f"device={args.device} tp={args.tp} layers={args.layers} blocks/request={args.blocks_per_request} "
        f"requests={args.requests} in-flight={args.concurrency}",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
        *("| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows),
    ]
    text = "\n".join(lines)
    print(text)
    (out / f"results-{args.device}.md").write_text(text + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
