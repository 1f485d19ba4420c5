"""Layer-wise against whole-request pushes: from the end of P's forward to D knowing.

``pushactors bench layerwise [--device cuda] [--tokens N] [--reps N] [--quick]``

Per push mode, a P and a D node process (KV on ``--device``, per-layer pages). P computes each
request layer by layer with a real kernel per layer (a matmul as large as one Llama-3-8B layer
at that many tokens: (tokens x 4096) @ (4096 x 53248)), D's registration already waiting at P
when the forward starts (push mode's steady state). Per request:

* ``after_ms``: D's transport knew every byte landed, minus when P's last layer had run (one
  host, one monotonic clock): what a push adds to the time to first token;
* ``forward_ms``: P's forward, first layer queued to last layer run;
* ``steps_ms_p50`` (``--timeline``): when each step of the push happened, ms after the last
  layer had run, from stamps the writers keep in memory (core/timeline.py), not from logs.

Baselines of the same run, same bytes: one NIXL WRITE of the request as one descriptor between
two bare processes, and a device copy; and one bare WRITE of a single layer (two descriptors),
the floor of what a layer-wise push still does after the last layer. Goals (issue 30): at 4k
tokens, layer-wise ``after`` at most 0.2 of whole-request ``after``; at 256 tokens, no worse
than whole-request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from suites import (
    SHAPES,
    EnginePhases,
    Shape,
    engine_idle_s,
    engine_node_options,
    engine_rows,
    engine_spec,
    engine_text,
    gbps,
    log,
    machine,
    parse_config,
    sim_spec,
    table,
)

from pushactors.apps import progress
from pushactors.core.timeline import STEPS

HIDDEN, WIDTH = 4096, 53248  # one Llama-3-8B layer: q,k,v,o (4096 x 6144 + 4096 x 4096) + MLP (3 x 14336)
QUICK = {"hidden": 256, "width": 1024}
LATE_CHECK_S = 0.0005  # the late-check baseline: its first check this long after the post


class Events:
    """The nodes' sent / received events, by request id."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sent: dict[str, tuple[Any, ...]] = {}
        self.received: dict[str, tuple[Any, ...]] = {}

    def __call__(self, event: tuple[Any, ...]) -> None:
        with self.cond:
            if event[0] == "sent":
                self.sent[event[1]] = event
            elif event[0] == "received":
                self.received[event[1]] = event
            self.cond.notify_all()

    def wait(self, table_: dict[str, tuple[Any, ...]], rid: str, timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while rid not in table_:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{rid} not reported within {timeout}s")
                self.cond.wait(min(left, 0.5))
            return table_[rid]


VERIFY_COUNTERS = (
    "write.digested",
    "recv.verified",
    "recv.verify_failed",
    "recv.verify_unavailable",
    "recv.verify_uncovered",
)


def verify_counts(p: Any, d: Any) -> dict[str, int]:
    """The verified-push counters of a node pair (``--config verify=...``): P's and D's."""
    metrics = {**p.stats().get("metrics", {}), **d.stats().get("metrics", {})}
    return {k: int(metrics.get(k, 0)) for k in VERIFY_COUNTERS}


def median_ms(values: list[float]) -> float | None:
    """Median in ms, rounded to the µs; None for no values (rather than a 0 that reads as free)."""
    return round(statistics.median(values) * 1e3, 3) if values else None


def run_mode(
    mode: str,
    shape: Shape,
    tokens_list: list[int],
    reps: int,
    device: str,
    work: dict[str, int],
    timeout: float,
    logs: str | None = None,
    settings: dict[str, Any] | None = None,
    sides: dict[str, dict[str, Any]] | None = None,
    engine: Any = None,
    idle_s: float = 0.0,
) -> dict[int, dict[str, Any]]:
    """One node pair in push mode ``mode``; per token count a warm-up request, then ``reps``
    timed ones. ``engine``: the nodes run the engine model, with an idle phase after each warm-up
    and the pushes' phase over the timed requests (``engine`` in each token count's result)."""
    from pushactors.testing.node import Node, NodeSpec

    events = Events()
    blocks = max(-(-t // shape.block_size) for t in tokens_list)
    sim = sim_spec(shape, "hnd", blocks + 4, device)
    config = {**(settings or {}), "push_mode": mode}
    sides = sides or {}

    def log_json(role: str) -> str | None:
        if logs is None:
            return None
        Path(logs).mkdir(parents=True, exist_ok=True)
        return str(Path(logs) / f"{mode}-{role}.jsonl")

    nodes = [
        Node(
            NodeSpec(
                role=role,
                engine_id=f"{role}-{mode}",
                sim=sim,
                config={**config, **sides.get(role, {})},
                log_json=log_json(role),
                **engine_node_options(engine),
            ),
            on_event=events,
        )
        for role in ("prefill", "decode")
    ]
    p, d = nodes
    phases = EnginePhases(engine, {"prefill": p, "decode": d}, idle_s) if engine is not None else None
    out: dict[int, dict[str, Any]] = {}
    timed: dict[int, list[tuple[str, str, float]]] = {}  # tokens -> (P id, D id, forward's end)
    try:
        for node in nodes:
            node.wait_ready(timeout=max(180.0, timeout))
        for tokens in tokens_list:
            after: list[float] = []
            forward: list[float] = []
            kernel = {"tokens": tokens, **work}
            checked = 0
            verified_before = verify_counts(p, d) if config.get("verify", "off") != "off" else {}
            for i in range(reps + 1):  # the first one warms both sides up, untimed
                if i == 1 and phases is not None:
                    phases.idle()
                base = f"{mode}-{tokens}-{i}"
                p_id, d_id = f"{base}-{0xA0000000 + i:08x}", f"{base}-{0xD0000000 + i:08x}"
                d.expect(d_id, tokens, p.decode_params(p_id), base, wait=True)
                p.wait_registrations_held(1, timeout)
                began = time.monotonic()
                ended = p.forward(p_id, tokens, base, layerwise=mode == "layerwise", work=kernel, timeout=timeout)
                got = events.wait(events.received, d_id, timeout)
                sent = events.wait(events.sent, p_id, timeout)
                if got[2] is not None or sent[2] is not None:
                    raise RuntimeError(f"{mode} push failed: P {sent[2]!r}, D {got[2]!r}")
                # D's bytes (checked only with stamped KV, the engine model's; else 0 of 0)
                if got[4] or (phases is not None and not got[3]):
                    raise RuntimeError(f"{mode} push {d_id}: {got[4]} of {got[3]} bytes checked wrong")
                checked += got[3]
                if i:
                    after.append(got[7] - ended)
                    forward.append(ended - began)
                    timed.setdefault(tokens, []).append((p_id, d_id, ended))
            out[tokens] = {
                "after_ms_p50": median_ms(after),
                "after_ms": [round(a * 1e3, 3) for a in after],
                "forward_ms_p50": median_ms(forward),
                "reps": reps,
            }
            if phases is not None:
                out[tokens]["engine"] = {**phases.pushes(), "bytes_checked": checked}
            if config.get("verify", "off") != "off":
                # What was checked (warm-up included): an unverified push must not pass for one.
                now = verify_counts(p, d)
                out[tokens]["verify"] = {k: now[k] - verified_before[k] for k in now} | {"pushes": reps + 1}
            log(f"{mode} {tokens} tokens: after p50 {out[tokens]['after_ms_p50']} ms")
    finally:
        finals = [node.stop() for node in nodes]
    if config.get("timeline"):
        p_steps, d_steps = ((f or {}).get("timeline", {}) for f in finals)
        for tokens, rows in timed.items():
            out[tokens]["steps_ms_p50"] = step_medians(rows, p_steps, d_steps)
    return out


def step_medians(
    rows: list[tuple[str, str, float]], p_steps: dict[str, dict[str, float]], d_steps: dict[str, dict[str, float]]
) -> dict[str, float | None]:
    """Each step's median time after the forward's end, ms, over the requests that stamped it
    (P's steps by P's request id, D's by D's)."""
    out: dict[str, float] = {}
    for step in STEPS:
        on_p = step.startswith("p.")
        side = p_steps if on_p else d_steps
        times = []
        for p_id, d_id, ended in rows:
            at = side.get(p_id if on_p else d_id, {}).get(step)
            if at is not None:
                times.append(at - ended)
        if times:
            out[step] = median_ms(times)
    return out


def baselines(
    shape: Shape, tokens_list: list[int], reps: int, device: str, timeout: float
) -> dict[int, dict[str, Any]]:
    from bare_nixl import BarePair

    out: dict[int, dict[str, Any]] = {}
    sizes = {t: -(-t // shape.block_size) * shape.layers * shape.layer_block_bytes for t in tokens_list}
    with BarePair(max(sizes.values()), device, timeout=timeout) as bare:
        for tokens, nbytes in sizes.items():
            key = f"one-{tokens}"
            bare.prep(key, np.zeros(1), np.zeros(1), np.array([nbytes]))
            t = bare.write(key, reps, poll_s=0.0)
            copy = statistics.median(bare.copy(nbytes, reps))
            done = statistics.median(t.seen)  # post → the target saw the notification
            # The floor of a layer-wise push's last WRITE: one layer of the request, as two
            # descriptors (its K and V runs when blocks are in order, as the push posts them).
            layer = nbytes // shape.layers
            half = layer // 2
            lkey = f"layer-{tokens}"
            offs = np.array([0, half], dtype=np.uint64)
            bare.prep(lkey, offs, offs.copy(), np.array([half, layer - half], dtype=np.uint64))
            lt = bare.write(lkey, reps, poll_s=0.0)
            # ... and its first check when made 0.5 ms after the post, when the copy has ended:
            # what NIXL's own completion of a finished WRITE costs (P's DONE check in a push).
            late = bare.write(lkey, reps, poll_s=0.0, check_after=LATE_CHECK_S)
            out[tokens] = {
                "bytes": nbytes,
                "one_descriptor_ms_p50": round(done * 1e3, 3),
                "one_descriptor_GBps": gbps(nbytes, done),
                "device_copy_ms_p50": round(copy * 1e3, 3),
                "one_layer_bytes": layer,
                "one_layer_ms_p50": median_ms(lt.seen),
                "one_layer_post_ms_p50": median_ms(lt.post),
                # Over the repetitions whose post did not return DONE itself (None if none).
                "one_layer_first_check_ms_p50": median_ms(lt.first_check),
                "one_layer_late_check_ms_p50": median_ms(late.first_check),
                "one_layer_late_done_at_post": late.done_at_post,
            }
    return out


def cli(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("pushactors bench: --device cuda but torch sees no GPU", file=sys.stderr)
            return 2
    shape = SHAPES[args.shape]
    if args.layers:
        shape = Shape(
            shape.name, args.layers, shape.kv_heads, shape.head_dim, shape.elem_size, shape.block_size, shape.tokens
        )
    work = {"hidden": HIDDEN, "width": WIDTH}
    if args.quick:  # a small kernel and 256 tokens; 4 layers unless --layers says otherwise
        layers = args.layers or min(shape.layers, 4)
        shape = Shape(shape.name, layers, shape.kv_heads, shape.head_dim, shape.elem_size, shape.block_size, 256)
        work = dict(QUICK)
    tokens_list = [args.tokens] if args.tokens else ([shape.tokens, 256] if shape.tokens != 256 else [256])
    reps = args.reps or (2 if args.quick else 5)
    result: dict[str, Any] = {"suite": "layerwise", "machine": machine(args.device), "shape": shape.name}
    result["layers"] = shape.layers
    result["settings"] = parse_config(args.config)  # --config KEY=VALUE, for both nodes in both modes
    if getattr(args, "timeline", False):
        result["settings"]["timeline"] = True
    sides = {
        "prefill": parse_config(getattr(args, "p_config", None)),  # --p-config: P's node only
        "decode": parse_config(getattr(args, "d_config", None)),
    }
    if sides["prefill"] or sides["decode"]:
        result["settings_by_role"] = sides
    result["kernel"] = work
    engine = engine_spec(args)
    if engine is not None:
        result["engine_model"] = {"share": engine.share, "step_s": engine.step, "idle_s": engine_idle_s(args)}
    with progress.Progress("bench layerwise", enabled=getattr(args, "progress", True)):
        progress.stage("baselines")
        result["baselines"] = base = baselines(shape, tokens_list, reps, args.device, args.timeout)
        modes = {}
        for mode in ("whole", "layerwise"):
            progress.stage(mode)
            modes[mode] = run_mode(
                mode,
                shape,
                tokens_list,
                reps,
                args.device,
                work,
                args.timeout,
                args.logs,
                result["settings"],
                sides,
                engine,
                engine_idle_s(args),
            )
    result["modes"] = modes
    rows = []
    for tokens in tokens_list:
        whole, layered, b = modes["whole"][tokens], modes["layerwise"][tokens], base[tokens]
        ratio = layered["after_ms_p50"] / whole["after_ms_p50"] if whole["after_ms_p50"] else float("nan")
        result.setdefault("ratios", {})[tokens] = {
            "layerwise_over_whole": round(ratio, 3),
            "whole_over_one_descriptor": round(whole["after_ms_p50"] / b["one_descriptor_ms_p50"], 3),
            "layerwise_over_one_descriptor": round(layered["after_ms_p50"] / b["one_descriptor_ms_p50"], 3),
        }
        rows.append(
            [
                tokens,
                f"{b['bytes'] / 2**20:.1f}",
                whole["forward_ms_p50"],
                whole["after_ms_p50"],
                layered["after_ms_p50"],
                f"{ratio:.3f}",
                b["one_descriptor_ms_p50"],
                b["device_copy_ms_p50"],
                b["one_layer_ms_p50"],
            ]
        )
    text = table(
        [
            "tokens",
            "MiB",
            "forward ms",
            "whole after ms",
            "layerwise after ms",
            "layerwise/whole",
            "1-desc ms",
            "copy ms",
            "1-layer ms",
        ],
        rows,
    )
    path = Path(args.json) if args.json else Path("runs/bench/layerwise.json")
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    for mode, by_tokens in modes.items():
        for tokens, row in by_tokens.items():
            if "verify" in row:
                v = row["verify"]
                print(
                    f"verify ({result['settings']['verify']}) {mode} {tokens} tokens: {v['recv.verified']} of "
                    f"{v['pushes']} pushes verified, {v['recv.verify_failed']} failed, "
                    f"{v['recv.verify_unavailable'] + v['recv.verify_uncovered']} unverifiable"
                )
    steps = [
        [mode, tokens, *(modes[mode][tokens].get("steps_ms_p50", {}).get(s, "") for s in STEPS)]
        for mode in ("whole", "layerwise")
        for tokens in tokens_list
        if modes[mode][tokens].get("steps_ms_p50")
    ]
    if steps:
        print("\nsteps, ms after the last layer had run (p50):")
        print(table(["mode", "tokens", *STEPS], steps))
    if engine is not None:
        rows = [
            row
            for mode in ("whole", "layerwise")
            for tokens in tokens_list
            for row in engine_rows(f"{mode} {tokens}", modes[mode][tokens]["engine"])
        ]
        print(engine_text(rows, engine.step, engine_idle_s(args)).lstrip("\n"))
    print(f"\nJSON: {path}")
    return 0
