"""The suites of ``pushactors bench`` (docs/performance.md): big, small, control, dram, xpyd.

    pushactors bench big [--device cuda] [--shape 70b] [--config staging_bytes=1073741824]
    .venv/bin/python bench/suites.py dram --quick          # the same, without the entry point

Every suite prints a Markdown table and writes JSON (``--json``, default
``runs/bench/<suite>.json``, ``big-70b.json`` for ``--shape 70b``). The pushactors cases run P
and D as two node processes (:mod:`pushactors.testing.node`, real NIXL); their bare-NIXL
baselines run in the same command, in two helper processes (:mod:`bare_nixl`) with buffers of
the same size on the same device, before the pushactors cases (never at the same time).
``control`` and ``xpyd`` run in one process over the fake fabric (``xpyd``: N P and M D engines,
:mod:`pushactors.testing.xpyd`).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bare_nixl import BarePair, WriteTimes

from pushactors.apps import progress

SUITES = ("big", "small", "control", "dram", "xpyd")
PATTERNS = ("contiguous", "fragmented", "scattered")
BENCH_LAYOUTS = ("hnd", "blhnc")


# ------------------------------------------------------------------------------------------------
# Shapes, layouts, block orders
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    elem_size: int
    block_size: int  # tokens per block
    tokens: int  # of one request

    @property
    def blocks(self) -> int:
        return math.ceil(self.tokens / self.block_size)

    @property
    def layer_block_bytes(self) -> int:
        """One block of one layer, K and V, every head (TP1)."""
        return self.kv_heads * self.block_size * 2 * self.head_dim * self.elem_size

    @property
    def request_bytes(self) -> int:
        return self.blocks * self.layers * self.layer_block_bytes


SHAPES = {
    # Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, bf16; a 4k-token request is 512 MiB.
    "8b": Shape("llama3-8b", 32, 8, 128, 2, 16, 4096),
    # Llama-3-70B: 80 layers, 8 KV heads, head_dim 128, bf16; a 32k-token request is 10 GiB.
    "70b": Shape("llama3-70b", 80, 8, 128, 2, 16, 32768),
}


def unit(shape: Shape, layout: str) -> tuple[int, int]:
    """(regions, bytes per descriptor) of one block: per-layer pages ("hnd") give one
    descriptor per layer and block; block-outermost ("blhnc") one per block, all layers."""
    if layout == "hnd":
        return shape.layers, shape.layer_block_bytes
    if layout == "blhnc":
        return 1, shape.layers * shape.layer_block_bytes
    raise ValueError(f"bench layouts are {BENCH_LAYOUTS}, not {layout!r}")


def descriptor_rows(
    shape: Shape, layout: str, p_blocks: Sequence[int], d_blocks: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The WRITE's descriptors as pushactors lists them: region by region (one region per
    layer tensor for "hnd", one for "blhnc"), blocks in request order. Returns (region,
    offset in P's region, offset in D's region, length) per descriptor."""
    regions, length = unit(shape, layout)
    p = np.asarray(p_blocks, dtype=np.uint64) * np.uint64(length)
    d = np.asarray(d_blocks, dtype=np.uint64) * np.uint64(length)
    region = np.repeat(np.arange(regions, dtype=np.int64), len(p))
    return region, np.tile(p, regions), np.tile(d, regions), np.full(len(region), length, dtype=np.uint64)


def region_sizes(shape: Shape, layout: str, pool: int) -> list[int]:
    regions, length = unit(shape, layout)
    return [pool * length] * regions


def _run_starts(region: np.ndarray, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Where each run of descriptors contiguous on both sides begins (never across regions,
    which are separate allocations)."""
    r, s, d, n = (a.astype(np.int64) for a in (region, src, dst, lengths))
    joins = (r[1:] == r[:-1]) & (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    return np.flatnonzero(np.concatenate(([True], ~joins))) if len(s) else np.zeros(0, dtype=np.int64)


def merged_count(region: np.ndarray, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> int:
    """Descriptors left after joining runs contiguous on both sides."""
    return len(_run_starts(region, src, dst, lengths))


def merge_runs(
    region: np.ndarray, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The descriptors with :func:`merged_count`'s joins made: one row per run (region, P
    offset, D offset, length), what pushactors posts when it posts runs."""
    starts = _run_starts(region, src, dst, lengths)
    n = lengths.astype(np.int64)
    run_lengths = np.add.reduceat(n, starts) if len(starts) else n[:0]
    return region[starts], src[starts], dst[starts], run_lengths


def block_order(pattern: str, n: int, rng: random.Random) -> list[int]:
    """D's block ids for one request of ``n`` blocks: in order, in runs of 2 (about half the
    descriptors merge), or shuffled."""
    if pattern == "contiguous":
        return list(range(n))
    if pattern == "fragmented":
        runs = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]
        rng.shuffle(runs)
        return [b for run in runs for b in run]
    if pattern == "scattered":
        order = list(range(n))
        rng.shuffle(order)
        return order
    raise ValueError(f"patterns are {PATTERNS}, not {pattern!r}")


# ------------------------------------------------------------------------------------------------
# Small helpers
# ------------------------------------------------------------------------------------------------
def parse_config(items: Sequence[str] | None) -> dict[str, Any]:
    """``key=value`` PushConfig overrides (values as JSON when they parse, else strings),
    checked by PushConfig itself so a wrong key fails before anything starts."""
    from pushactors.core.config import ConfigError, PushConfig

    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--config {item!r}: expected KEY=VALUE")
        if key in ("engine_id", "role"):
            raise ConfigError(f"--config {key}: set by the benchmark for each node")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    for role in ("producer", "consumer"):
        PushConfig.from_dict({"engine_id": "bench", "role": role, **out})
    return out


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1), linear between order statistics."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "device": device,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if device == "cuda" and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
            try:
                info["nixl"] = f"{dist} {version(dist)}"
                break
            except PackageNotFoundError:
                continue
    except ImportError:
        pass
    return info


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def log(msg: str) -> None:
    # Through the progress display: above its bar on a terminal, a plain stderr line elsewhere.
    progress.note(f"[bench {time.strftime('%H:%M:%S')}] {msg}")


# ------------------------------------------------------------------------------------------------
# Nodes (pushactors P and D in their own processes)
# ------------------------------------------------------------------------------------------------
def _node_main(spec: Any, conn: Any, free_order: tuple[int, ...] = ()) -> None:
    """A node process whose block pool hands out ``free_order`` (D's fragmentation)."""
    from pushactors.testing import node

    build = node._build

    def ordered(s: Any) -> tuple[Any, Any]:
        engine, server = build(s)
        if free_order:
            engine.release(engine.take(list(free_order)))  # the free list, in this order
        return engine, server

    node._build = ordered  # type: ignore[assignment]
    node.node_main(spec, conn)


def start_node(spec: Any, on_event: Callable[..., None], free_order: Sequence[int] = ()) -> Any:
    import pushactors.testing.node as node_mod

    if not free_order:
        return node_mod.Node(spec, on_event=on_event)
    saved = node_mod.node_main
    node_mod.node_main = functools.partial(_node_main, free_order=tuple(free_order))  # type: ignore[assignment]
    try:
        return node_mod.Node(spec, on_event=on_event)
    finally:
        node_mod.node_main = saved


class NodePair:
    """P and D node processes with a :class:`Dispatcher`; requests one at a time."""

    def __init__(
        self,
        p_sim: Any,
        d_sim: Any,
        *,
        config: dict[str, Any],
        d_free_order: Sequence[int] = (),
        p_log: Path | None = None,
        d_log: Path | None = None,
        timeout: float,
        node_options: dict[str, Any] | None = None,
    ) -> None:
        from pushactors.testing.node import Dispatcher, NodeSpec

        self.timeout = timeout
        # With stamped KV (the engine model) every push must have had its bytes checked.
        self.check_bytes = bool((node_options or {}).get("stamp_kv"))
        self.bytes_checked = 0
        self.router = Dispatcher(seed=7)
        for path in (p_log, d_log):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.unlink(missing_ok=True)
        self.p_log = p_log
        self.d_log = d_log
        self.nodes: list[Any] = []

        def spec(role: str, sim: Any, log: Path | None) -> Any:
            return NodeSpec(
                role=role,
                engine_id=f"{role}-bench",
                sim=sim,
                config=config,
                log_json=str(log) if log else None,
                **(node_options or {}),  # NodeSpec's process options (python_busy, engine_model, stamp_kv)
            )

        try:
            self.p = start_node(spec("prefill", p_sim, p_log), self.router.on_event)
            self.nodes.append(self.p)
            self.d = start_node(spec("decode", d_sim, d_log), self.router.on_event, d_free_order)
            self.nodes.append(self.d)
            for node in self.nodes:
                node.wait_ready(timeout=max(180.0, timeout))
        except BaseException:
            self.close()
            raise
        self._index = 0

    def push(self, tokens: int, order: str = "prefill_first", forward: dict[str, int] | None = None) -> Any:
        """One request. ``prefill_first``: P's prefill finished before D stages its
        registration, so D's latency (registration staged → KV landed) is the transport's.
        ``registration_first``: D's registration waits at P before the prefill ends (push
        mode's steady state), and ``Outcome.critical_path`` is the push alone."""
        o = self.router.dispatch(self.p, self.d, self._index, tokens, order=order, forward=forward)
        self._index += 1
        if not self.router.wait(lambda: o.done, self.timeout):
            raise TimeoutError(f"push {o.p_id} did not finish in {self.timeout}s")
        if not o.ok or (self.check_bytes and not o.checked):
            raise RuntimeError(
                f"push {o.p_id} → {o.d_id} failed: P: {o.sent!r}, D: {o.received!r}, "
                f"{o.wrong} of {o.checked} bytes checked wrong"
            )
        self.bytes_checked += o.checked
        return o

    def engine_phase(self) -> dict[str, Any]:
        """Each node's engine-model phase so far (P's, then D's), a new one begun."""
        return {"prefill": self.p.engine_phase(), "decode": self.d.engine_phase()}

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        self.nodes = []

    def events(self, side: str, names: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
        """``side``'s ("p" or "d") events named ``names``, by request id, then event (the first
        of each); read once the nodes have stopped and flushed their logs."""
        path = self.p_log if side == "p" else self.d_log
        out: dict[str, dict[str, dict[str, Any]]] = {}
        if path is None or not path.exists():
            return out
        wanted = set(names)
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") in wanted and e.get("request_id"):
                out.setdefault(e["request_id"], {}).setdefault(e["event"], e)
        return out

    def p_events(self) -> dict[str, dict[str, dict[str, Any]]]:
        """P's write.posted / write.settled events by P request id."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        if self.p_log is None or not self.p_log.exists():
            return out
        for line in self.p_log.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") in ("write.posted", "write.settled") and e.get("request_id"):
                out.setdefault(e["request_id"], {})[e["event"]] = e
        return out


# ------------------------------------------------------------------------------------------------
# The engine model (--engine model): each node's loop as a real engine thread runs it
# ------------------------------------------------------------------------------------------------
def engine_spec(args: argparse.Namespace) -> Any:
    """The nodes' EngineModelSpec for ``--engine model``, else None (the plain node loop)."""
    if getattr(args, "engine", "loop") != "model":
        return None
    from pushactors.testing.engine_model import EngineModelSpec

    return EngineModelSpec(step=args.engine_step, share=args.engine_share)


def engine_node_options(model: Any) -> dict[str, Any]:
    """NodeSpec options for the engine model; its nodes stamp and check every push's bytes."""
    return {"engine_model": model, "stamp_kv": True} if model is not None else {}


class EnginePhases:
    """The engine model's idle baseline and push phase of a P and a D node."""

    def __init__(self, model: Any, nodes: dict[str, Any], idle_s: float) -> None:
        self.model = model
        self.nodes = nodes
        self.idle_s = idle_s
        self._idle: dict[str, Any] = {}

    def idle(self) -> None:
        """``idle_s`` of both nodes stepping with nothing to push (after the warm-up, so the
        handshakes are done and only idle polling is left); a push phase begins after."""
        for node in self.nodes.values():
            node.engine_phase()
        threading.Event().wait(self.idle_s)  # the baseline's length: nothing to wait for
        self._idle = {side: node.engine_phase() for side, node in self.nodes.items()}

    def pushes(self) -> dict[str, Any]:
        """The phase since :meth:`idle`, beside it: the case's ``engine`` field."""
        from pushactors.testing.engine_model import compare, report

        phase = {side: node.engine_phase() for side, node in self.nodes.items()}
        sides = {side: compare(self._idle[side], phase[side]) for side in self.nodes}
        return {**report(self.model, sides), "idle_s": self.idle_s}


def engine_idle_s(args: argparse.Namespace) -> float:
    """``--engine-idle``, else 2 s (1 s with ``--quick``)."""
    if getattr(args, "engine_idle", None) is not None:
        return float(args.engine_idle)
    return 1.0 if args.quick else 2.0


ENGINE_COLS = [
    "case",
    "node",
    "S",
    "step ms",
    "hooks µs p50 / p99, idle",
    "hooks µs p50 / p99, pushes",
    "work units/s: idle → pushes (lost)",
    "units/s of its Python time: idle → pushes (lost)",
    "late steps idle / pushes",
]


def engine_rows(case: str, engine: dict[str, Any]) -> list[list[Any]]:
    """Table rows of one case's ``engine`` field, one per node."""
    rows = []

    def change(e: dict[str, Any], key: str, lost: str) -> str:
        pct_ = "—" if e[lost] is None else f"{e[lost]}%"
        return f"{e['idle'][key]:,.0f} → {e['pushes'][key]:,.0f} ({pct_})"

    for side in ("prefill", "decode"):
        e = engine[side]
        idle, busy = e["idle"], e["pushes"]
        rows.append(
            [
                case,
                "P" if side == "prefill" else "D",
                engine["share"],
                round(engine["step_s"] * 1e3, 3),
                f"{idle['hook_us_p50']} / {idle['hook_us_p99']}",
                f"{busy['hook_us_p50']} / {busy['hook_us_p99']}",
                change(e, "work_units_per_s", "work_lost_pct"),
                change(e, "work_units_per_work_s", "work_pace_lost_pct"),
                f"{idle['late_steps']} / {busy['late_steps']}",
            ]
        )
    return rows


ENGINE_NOTE = (
    "\n\nThe engine model: one thread per node steps every {step} ms: its input, the connector hooks, "
    "Python work for S of the step, then a GIL-free wait. hooks = the hooks' own time per step "
    "(start_load_kv, get_finished, save_kv_layer, wait_for_save); work units/s = the engine's Python "
    "work done per second, idle ({idle} s, nothing to push) and while the pushes ran; units/s of its "
    "Python time = the same per second the thread spent in its work, whatever the steps' length; late "
    "steps = steps that ran past their length. KV stamped on P and every byte checked on D (off the "
    "engine's clock)\n\n"
)


def engine_text(rows: list[list[Any]], step_s: float, idle_s: float) -> str:
    return ENGINE_NOTE.format(step=round(step_s * 1e3, 3), idle=idle_s) + table(ENGINE_COLS, rows)


def sim_spec(shape: Shape, layout: str, num_blocks: int, device: str) -> Any:
    from pushactors.testing.engine import SimSpec

    return SimSpec(
        num_layers=shape.layers,
        num_blocks=num_blocks,
        block_size=shape.block_size,
        device=device,
        layout=layout,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        elem_size=shape.elem_size,
        shuffle_blocks=False,
        fill_and_verify=False,
    )


# ------------------------------------------------------------------------------------------------
# Transfer cases (big, dram)
# ------------------------------------------------------------------------------------------------
def bare_summary(runs: Sequence[WriteTimes], nbytes: int) -> dict[str, Any]:
    """Medians over every run's samples (the phases before and after the pushactors cases)."""
    done = statistics.median(x for t in runs for x in t.done)
    return {
        "ms_p50": round(done * 1e3, 3),
        "GBps": gbps(nbytes, done),
        "GBps_per_phase": [gbps(nbytes, statistics.median(t.done)) for t in runs],
        "post_ms_p50": round(statistics.median(x for t in runs for x in t.post) * 1e3, 3),
        "notif_ms_p50": round(statistics.median(x for t in runs for x in t.seen) * 1e3, 3),
        "notifications_seen": sum(t.notifs for t in runs),
        "reps": sum(len(t.done) for t in runs),
    }


@dataclass
class BareRuns:
    """Raw samples of the bare-NIXL baselines, gathered over one or more phases."""

    writes: dict[str, list[WriteTimes]]
    copies: list[list[float]]
    descs: dict[str, tuple[int, int]]  # key -> (descriptors, merged)


def run_bare_transfers(
    runs: BareRuns,
    shape: Shape,
    layouts: Sequence[str],
    orders: dict[str, list[int]],
    device: str,
    reps: int,
    timeout: float,
    poll_s: float,
    phase: str,
) -> None:
    """One phase of baselines. Per layout, two fresh processes hold that layout's KV regions
    (one allocation per layer tensor, as the nodes do) plus one region of the request's size:
    each case's exact descriptor list, one descriptor of the request's bytes, a device copy."""
    total = shape.request_bytes
    n = shape.blocks
    for layout in layouts:
        sizes = [*region_sizes(shape, layout, n), total]
        one = len(sizes) - 1
        progress.stage(f"bare NIXL ({phase}, {layout})")
        log(f"bare NIXL ({phase}, {layout}): two processes, {sum(sizes) / 2**20:.0f} MiB each on {device}")
        with BarePair(sizes, device, timeout=timeout) as bare:
            bare.prep("one", np.zeros(1), np.zeros(1), np.array([total]), src_region=one, dst_region=one)
            runs.writes.setdefault("one", []).append(bare.write("one", reps, poll_s=poll_s))
            runs.descs["one"] = (1, 1)
            runs.copies.append(bare.copy(total, reps, region=one))
            for pattern, d_order in orders.items():
                region, src, dst, lengths = descriptor_rows(shape, layout, range(n), d_order)
                key = f"{layout}/{pattern}"
                bare.prep(key, src, dst, lengths, src_region=region, dst_region=region)
                t = bare.write(key, reps, poll_s=poll_s)
                runs.writes.setdefault(key, []).append(t)
                merged = merged_count(region, src, dst, lengths)
                runs.descs[key] = (len(src), merged)
                log(f"bare NIXL {key}: {len(src)} descs, {gbps(total, statistics.median(t.done))} GB/s")
                if merged * 2 <= len(src):
                    # What pushactors posts when it posts runs: bare NIXL with those descriptors,
                    # so P's own host work shows beside NIXL's for the same list.
                    mr, ms, md, ml = merge_runs(region, src, dst, lengths)
                    bare.prep(f"{key}/merged", ms, md, ml, src_region=mr, dst_region=mr)
                    runs.writes.setdefault(f"{key}/merged", []).append(bare.write(f"{key}/merged", reps, poll_s=poll_s))
                    runs.descs[f"{key}/merged"] = (merged, merged)


def bare_results(runs: BareRuns, total: int, poll_s: float) -> dict[str, Any]:
    copy = statistics.median(x for c in runs.copies for x in c)
    out: dict[str, Any] = {
        "target_poll_s": poll_s,
        "phases": len(runs.copies),
        "device_copy": {
            "ms_p50": round(copy * 1e3, 3),
            "GBps": gbps(total, copy),
            "GBps_per_phase": [gbps(total, statistics.median(c)) for c in runs.copies],
            "reps": sum(len(c) for c in runs.copies),
        },
        "cases": {},
    }
    for key, times in runs.writes.items():
        descs, merged = runs.descs[key]
        summary = {"descs": descs, "merged_descs": merged, **bare_summary(times, total)}
        if key == "one":
            out["one_descriptor"] = summary
        else:
            out["cases"][key] = summary
    return out


def run_pushactors_transfers(
    shape: Shape,
    layout: str,
    orders: dict[str, list[int]],
    *,
    device: str,
    reps: int,
    config: dict[str, Any],
    logdir: Path,
    timeout: float,
    engine: Any = None,
    idle_s: float = 0.0,
) -> dict[str, Any]:
    """One node pair; D's pool holds one section per pattern, so requests cycle through them.
    ``engine``: the nodes run the engine model (an idle phase after the warm-up round)."""
    n = shape.blocks
    names = list(orders)
    d_free = [b + k * n for k, name in enumerate(names) for b in orders[name]]
    p_sim = sim_spec(shape, layout, n, device)
    d_sim = sim_spec(shape, layout, n * len(names), device)
    progress.stage(f"pushactors {layout}", total=(1 + reps) * len(names))
    log(f"pushactors {layout}: P and D nodes, {shape.request_bytes / 2**20:.0f} MiB per request")
    pair = NodePair(
        p_sim,
        d_sim,
        config=config,
        d_free_order=d_free,
        p_log=logdir / f"{layout}-prefill.jsonl",
        d_log=logdir / f"{layout}-decode.jsonl",
        timeout=timeout,
        node_options=engine_node_options(engine),
    )
    phases = EnginePhases(engine, {"prefill": pair.p, "decode": pair.d}, idle_s) if engine is not None else None
    outcomes: dict[str, list[Any]] = {name: [] for name in names}
    alone: dict[str, list[Any]] = {name: [] for name in names}
    try:
        for rnd in range(1 + reps):  # round 0 warms up every pattern (handshake, lists)
            if rnd == 1 and phases is not None:
                progress.update(len(names), f"engine idle, {idle_s} s")
                phases.idle()
            for i, name in enumerate(names):
                progress.update(rnd * len(names) + i, f"round {rnd}, {name}")
                o = pair.push(shape.tokens)
                if rnd:
                    outcomes[name].append(o)
        # The push alone: D's registration already waits at P when P's prefill ends.
        for _ in range(reps):
            for name in names:
                alone[name].append(pair.push(shape.tokens, order="registration_first"))
        engine_out = phases.pushes() if phases is not None else None
        metrics = {"prefill": pair.p.stats().get("metrics", {}), "decode": pair.d.stats().get("metrics", {})}
    finally:
        pair.close()
    events = pair.p_events()
    total = shape.request_bytes
    out: dict[str, Any] = {"metrics": metrics}
    if engine_out is not None:
        out["engine"] = {**engine_out, "bytes_checked": pair.bytes_checked}
    for name in names:
        lat = [o.transport_latency for o in outcomes[name]]
        seen = [o.push_latency for o in outcomes[name]]
        posted = [events.get(o.p_id, {}).get("write.posted", {}) for o in outcomes[name]]
        settled = [events.get(o.p_id, {}).get("write.settled", {}) for o in outcomes[name]]
        write_ms = [float(e["ms"]) for e in settled if e.get("ms")]
        post_ms = [float(e["post_ms"]) for e in posted if "post_ms" in e]
        plan_ms = [float(e["plan_ms"]) for e in posted if "plan_ms" in e]
        nixl_ms = {
            part: round(statistics.median(vals), 3)
            for part in ("prep_ms", "make_ms", "transfer_ms")
            if (vals := [float(e[part]) for e in posted if part in e])
        }
        descs = [int(e["descs"]) for e in posted if "descs" in e]
        merged = [int(e["merged_descs"]) for e in posted if "merged_descs" in e]
        d_lat = statistics.median(lat)
        p_ms = statistics.median(write_ms) if write_ms else 0.0
        push_s = statistics.median(o.critical_path for o in alone[name])
        out[name] = {
            "requests": len(lat),
            "push_ms_p50": round(push_s * 1e3, 3),
            "push_GBps": gbps(total, push_s),
            "d_latency_ms_p50": round(d_lat * 1e3, 3),
            "d_step_ms_p50": round(statistics.median(seen) * 1e3, 3),
            "d_GBps": gbps(total, d_lat),
            "p_write_ms_p50": round(p_ms, 3),
            "p_GBps": gbps(total, p_ms / 1e3) if p_ms else 0.0,
            "p_post_ms_p50": round(statistics.median(post_ms), 3) if post_ms else 0.0,
            "p_plan_ms_p50": round(statistics.median(plan_ms), 3) if plan_ms else 0.0,  # of p_post_ms
            "p_nixl_ms_p50": nixl_ms,  # the rest of p_post_ms: runs' lists, make_prepped_xfer, transfer
            "posted_as_runs": sum(1 for e in posted if e.get("runs")),  # WRITEs posted as runs
            "posted_descs": int(statistics.median(int(e["posted_descs"]) for e in posted if "posted_descs" in e))
            if any("posted_descs" in e for e in posted)
            else 0,
            "descs": int(statistics.median(descs)) if descs else 0,
            "merged_descs": int(statistics.median(merged)) if merged else 0,
        }
        log(f"pushactors {layout}/{name}: D {out[name]['d_GBps']} GB/s, P WRITE {out[name]['p_GBps']} GB/s")
    return out


def transfer_suite(
    args: argparse.Namespace,
    *,
    suite: str,
    shape: Shape,
    layouts: Sequence[str],
    patterns: Sequence[str],
    device: str,
    reps: int,
    notes: list[str],
) -> dict[str, Any]:
    config = parse_config(args.config)
    rng = random.Random(args.seed)
    orders = {p: block_order(p, shape.blocks, rng) for p in patterns}
    timeout = float(args.timeout)
    out = json_path(args)
    logdir = out.parent / f"{out.stem}-logs"  # P's and D's event logs per layout
    started = time.monotonic()
    poll_s = args.bare_poll if args.bare_poll is not None else 0.001
    engine = engine_spec(args)
    runs = BareRuns({}, [], {})
    # Baselines before and after the pushactors cases (never beside them): their samples are
    # pooled, and GBps_per_phase shows how much the machine drifted meanwhile.
    run_bare_transfers(runs, shape, layouts, orders, device, reps, timeout, poll_s, "before")
    pushed = {
        layout: run_pushactors_transfers(
            shape,
            layout,
            orders,
            device=device,
            reps=reps,
            config=config,
            logdir=logdir,
            timeout=timeout,
            engine=engine,
            idle_s=engine_idle_s(args),
        )
        for layout in layouts
    }
    run_bare_transfers(runs, shape, layouts, orders, device, reps, timeout, poll_s, "after")
    bare = bare_results(runs, shape.request_bytes, poll_s)
    metrics = {layout: pushed[layout].pop("metrics") for layout in layouts}
    # The engine model's phases are the node pair's, so each layout's cases share them.
    engines = {layout: pushed[layout].pop("engine", None) for layout in layouts}
    one = bare["one_descriptor"]["GBps"]
    cases = []
    for layout in layouts:
        for pattern in patterns:
            pa = pushed[layout][pattern]
            same = bare["cases"][f"{layout}/{pattern}"]
            merged = bare["cases"].get(f"{layout}/{pattern}/merged")
            extra = (
                {
                    "bare_merged_descs": merged,
                    "ratio_bare_merged_to_one_desc": ratio(merged["GBps"], one),
                    "ratio_p_to_bare_merged": ratio(pa["p_GBps"], merged["GBps"]),
                }
                if merged
                else {}
            )
            cases.append(
                {
                    "layout": layout,
                    "pattern": pattern,
                    "bytes": shape.request_bytes,
                    "pushactors": pa,
                    "bare_same_descs": same,
                    "ratio_push_to_one_desc": ratio(pa["push_GBps"], one),
                    "ratio_d_to_one_desc": ratio(pa["d_GBps"], one),
                    "ratio_p_to_one_desc": ratio(pa["p_GBps"], one),
                    "ratio_bare_same_to_one_desc": ratio(same["GBps"], one),
                    "ratio_d_to_bare_same": ratio(pa["d_GBps"], same["GBps"]),
                    "ratio_p_to_bare_same": ratio(pa["p_GBps"], same["GBps"]),
                    "descs_match_bare": pa["descs"] == same["descs"],
                    **extra,
                    **({"engine": engines[layout]} if engines[layout] is not None else {}),
                }
            )
    return {
        "suite": suite,
        "device": device,
        "memory": "VRAM" if device == "cuda" else "DRAM",
        "shape": {**asdict(shape), "blocks": shape.blocks, "request_bytes": shape.request_bytes},
        "layouts": list(layouts),
        "patterns": list(patterns),
        "reps": reps,
        "config": config,
        "machine": machine(device),
        "notes": notes,
        "baselines": {
            "one_descriptor": bare["one_descriptor"],
            "device_copy": bare["device_copy"],
            "target_poll_s": poll_s,
            "phases": bare["phases"],
        },
        "cases": cases,
        "node_metrics": metrics,  # each layout's P and D counters at the end of its run
        "seconds": round(time.monotonic() - started, 1),
    }


def transfer_table(result: dict[str, Any]) -> str:
    base = result["baselines"]
    shape = result["shape"]
    head = (
        f"{result['suite']}: {shape['name']} {shape['tokens']} tokens = {shape['blocks']} blocks = "
        f"{shape['request_bytes'] / 2**20:.0f} MiB per request, {result['memory']}; pushactors: median of "
        f"{result['reps']}, bare: median of {result['reps']} before + {result['reps']} after; "
        f"config {result['config'] or 'default'}\n"
        f"baselines: bare NIXL one descriptor {base['one_descriptor']['GBps']} GB/s "
        f"({base['one_descriptor']['ms_p50']} ms; per bare run: {base['one_descriptor']['GBps_per_phase']}); "
        f"device copy {base['device_copy']['GBps']} GB/s ({base['device_copy']['ms_p50']} ms)\n"
    )
    cols = [
        "layout",
        "D blocks",
        "descs → merged",
        "push GB/s (P's KV ready → D knows)",
        "D GB/s (registration → landed)",
        "P GB/s (WRITE)",
        "P posting ms",
        "bare same descs GB/s",
        "push / 1-desc",
        "D / 1-desc",
        "P / 1-desc",
        "bare same / 1-desc",
        "bare merged / 1-desc (posting ms)",
        "D / bare same",
    ]
    rows = []
    for c in result["cases"]:
        pa, same = c["pushactors"], c["bare_same_descs"]
        descs = f"{pa['descs']} → {pa['merged_descs']}"
        if not c["descs_match_bare"]:
            descs += f" (bare {same['descs']} → {same['merged_descs']})"
        rows.append(
            [
                c["layout"],
                c["pattern"],
                descs,
                pa["push_GBps"],
                pa["d_GBps"],
                pa["p_GBps"],
                pa["p_post_ms_p50"],
                same["GBps"],
                c["ratio_push_to_one_desc"],
                c["ratio_d_to_one_desc"],
                c["ratio_p_to_one_desc"],
                c["ratio_bare_same_to_one_desc"],
                f"{c['ratio_bare_merged_to_one_desc']} ({c['bare_merged_descs']['post_ms_p50']})"
                if "bare_merged_descs" in c
                else "—",
                c["ratio_d_to_bare_same"],
            ]
        )
    notes = "".join(f"\nnote: {n}" for n in result["notes"])
    return head + "\n" + table(cols, rows) + notes + transfer_engine_text(result)


def transfer_engine_text(result: dict[str, Any]) -> str:
    """The engine model's table of a big/dram run (one row pair per layout: its node pair's
    phases, shared by that layout's cases); empty without the model."""
    engines = {c["layout"]: c["engine"] for c in result["cases"] if "engine" in c}
    if not engines:
        return ""
    rows = [row for layout, e in engines.items() for row in engine_rows(layout, e)]
    first = next(iter(engines.values()))
    return engine_text(rows, first["step_s"], first["idle_s"])


def suite_big(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    device = args.device
    shape = SHAPES[args.shape]
    notes: list[str] = []
    tokens = args.tokens
    if tokens is None and args.quick:
        tokens = 1024
    if tokens is None and device == "cpu" and args.shape == "70b":
        tokens = 4096
        notes.append(
            "70b on CPU: scaled down to 4096 tokens (1.25 GiB per request); "
            "the full 32k-token request (10 GiB) runs with --device cuda"
        )
    if tokens is not None:
        shape = Shape(
            shape.name, shape.layers, shape.kv_heads, shape.head_dim, shape.elem_size, shape.block_size, tokens
        )
    if args.layers is not None:
        shape = Shape(
            shape.name, args.layers, shape.kv_heads, shape.head_dim, shape.elem_size, shape.block_size, shape.tokens
        )
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    layouts = _csv(args.layouts) if args.layouts else list(BENCH_LAYOUTS)
    patterns = _csv(args.patterns) if args.patterns else list(PATTERNS)
    result = transfer_suite(
        args, suite="big", shape=shape, layouts=layouts, patterns=patterns, device=device, reps=reps, notes=notes
    )
    return result, transfer_table(result)


def suite_dram(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    notes = []
    if args.device != "cpu":
        notes.append(f"dram always runs on DRAM (--device {args.device} ignored)")
    base = SHAPES["8b"]
    tokens = args.tokens if args.tokens is not None else (256 if args.quick else 512)  # 512 tokens = 64 MiB
    shape = Shape(
        "llama3-8b", args.layers or base.layers, base.kv_heads, base.head_dim, base.elem_size, base.block_size, tokens
    )
    reps = args.reps if args.reps is not None else (3 if args.quick else 10)
    layouts = _csv(args.layouts) if args.layouts else ["hnd"]
    patterns = _csv(args.patterns) if args.patterns else ["contiguous", "scattered"]
    result = transfer_suite(
        args, suite="dram", shape=shape, layouts=layouts, patterns=patterns, device="cpu", reps=reps, notes=notes
    )
    for c in result["cases"]:
        pa, same = c["pushactors"], c["bare_same_descs"]
        c["pushactors_ms"] = pa["d_latency_ms_p50"]
        c["push_ms"] = pa["push_ms_p50"]
        c["ratio_push_to_bare"] = ratio(pa["push_ms_p50"], same["ms_p50"])
        c["pushactors_write_ms"] = pa["p_write_ms_p50"]
        c["bare_ms"] = same["ms_p50"]
        c["ratio_pushactors_to_bare"] = ratio(pa["d_latency_ms_p50"], same["ms_p50"])
        c["ratio_write_to_bare"] = ratio(pa["p_write_ms_p50"], same["ms_p50"])
    shape_d = result["shape"]
    head = (
        f"dram: {shape_d['request_bytes'] / 2**20:.0f} MiB per request ({shape_d['layers']} layers × "
        f"{shape_d['blocks']} blocks), DRAM, two processes; pushactors: median of {result['reps']}, bare: "
        f"median of {result['reps']} before + {result['reps']} after; config {result['config'] or 'default'}; "
        f"bare NIXL one descriptor {result['baselines']['one_descriptor']['ms_p50']} ms\n\n"
    )
    cols = [
        "layout",
        "D blocks",
        "descs",
        "push ms (P's KV ready → D knows)",
        "D ms (registration → landed)",
        "P WRITE ms",
        "bare NIXL ms",
        "push / bare",
        "D / bare",
        "P WRITE / bare",
    ]
    rows = [
        [
            c["layout"],
            c["pattern"],
            c["pushactors"]["descs"],
            c["push_ms"],
            c["pushactors_ms"],
            c["pushactors_write_ms"],
            c["bare_ms"],
            c["ratio_push_to_bare"],
            c["ratio_pushactors_to_bare"],
            c["ratio_write_to_bare"],
        ]
        for c in result["cases"]
    ]
    notes_text = "".join(f"\nnote: {n}" for n in notes)
    return result, head + table(cols, rows) + notes_text + transfer_engine_text(result)


# ------------------------------------------------------------------------------------------------
# small: latency of one small push
# ------------------------------------------------------------------------------------------------
# Where one push's time goes, from the nodes' event logs (every mailbox message logs the time it
# waited and the time its handler took; ``ts`` is the wall clock, one clock for both processes
# on a host). Stages in the order a push crosses them; each is the p50 over the pushes.
SMALL_STAGES = (
    ("matcher_wait", "P: finished blocks wait in the matcher's mailbox"),
    ("matcher", "P: the matcher matches them with the held registration"),
    ("writer_wait", "P: the push waits in the writer's mailbox"),
    ("plan", "P: the writer plans the WRITE"),
    ("nixl_post", "P: NIXL prepares and posts it"),
    ("in_flight", "P: posted → P sees it settle"),
    ("d_pickup", "P sees it settle → D's writer has picked the completion up (and reported the request)"),
    ("d_reaper", "D: the reaper's mailbox and handler, when the writer could not report it (else 0)"),
)


def _stages_p50(
    pair: NodePair,
    pushes: Sequence[tuple[str, str]],
    p_events: tuple[str, ...],
    stages: Sequence[tuple[str, str]],
    values: Callable[[dict[str, Any], dict[str, Any]], dict[str, float] | None],
) -> dict[str, float]:
    """p50 µs of each of ``stages`` over ``pushes`` (P id, D id): ``values`` reads one push's
    stage times from P's events (``p_events``) and D's ``recv.notified`` (None: incomplete)."""
    p = pair.events("p", p_events)
    d = pair.events("d", ("recv.notified",))
    rows: dict[str, list[float]] = {k: [] for k, _ in stages}
    for p_id, d_id in pushes:
        got = values(p.get(p_id, {}), d.get(d_id, {}))
        for k, v in (got or {}).items():
            rows[k].append(v)
    return {k: round(pct(v, 0.5), 1) for k, v in rows.items() if v}


def _settled_at(settled: dict[str, Any]) -> float:
    # P saw it end when the check that found it DONE began (that check sent the completion).
    return float(settled["ts"]) - settled.get("seen_ms", 0.0) / 1e3


def _d_pickup_us(notified: dict[str, Any], settled_at: float) -> float:
    # notif.routed is logged after the hand-over; the reaper's wait starts at it. Two
    # processes' clocks: below 0 when D read a completion that left before P's check
    # (a WRITE done at its post) or P's thread was preempted inside that check.
    return (float(notified["ts"]) - (notified["handle_ms"] + notified["wait_ms"]) / 1e3 - settled_at) * 1e6


def _small_values(pe: dict[str, Any], de: dict[str, Any]) -> dict[str, float] | None:
    matched, posted, settled = pe.get("reg.matched"), pe.get("write.posted"), pe.get("write.settled")
    notified = de.get("recv.notified")
    if not (matched and posted and settled and notified):
        return None
    # taken: the writer reported the request itself (core/claims.py); the reaper's turn
    # came after, off the request's path.
    taken = bool(notified.get("taken"))
    # write.posted is logged when the PostPush handler returns (after a short spin that
    # may settle the WRITE): the posting itself is post_ms from the handler's start.
    post_start = posted["ts"] - posted["handle_ms"] / 1e3
    posted_at = post_start + posted["post_ms"] / 1e3
    settled_at = _settled_at(settled)
    return {
        "matcher_wait": matched["wait_ms"] * 1e3,
        "matcher": matched["handle_ms"] * 1e3,
        "writer_wait": posted["wait_ms"] * 1e3,
        "plan": posted["plan_ms"] * 1e3,
        "nixl_post": (posted["post_ms"] - posted["plan_ms"]) * 1e3,
        "in_flight": (settled_at - posted_at) * 1e6,
        "d_pickup": _d_pickup_us(notified, settled_at),
        "d_reaper": 0.0 if taken else (notified["wait_ms"] + notified["handle_ms"]) * 1e3,
    }


def small_stages(pair: NodePair, pushes: Sequence[tuple[str, str]]) -> dict[str, float]:
    """µs per stage (SMALL_STAGES), p50 over ``pushes`` (P id, D id), from the event logs."""
    return _stages_p50(pair, pushes, ("reg.matched", "write.posted", "write.settled"), SMALL_STAGES, _small_values)


# The same for the engine's default path (whole_push_start = "forward_end"): the push was armed
# when the request was announced (matched, planned, its WRITE made), and the forward's end
# (wait_for_save) hands it to the writer, which posts the WRITE made ahead.
ARMED_STAGES = (
    ("writer_wait", "P: the forward's end waits in the writer's mailbox"),
    ("make", "P: NIXL make_prepped_xfer (made ahead: 0)"),
    ("transfer", "P: NIXL transfer (posts the WRITE)"),
    ("in_flight", "P: posted → P sees it settle"),
    ("d_pickup", "P sees it settle → D's writer has picked the completion up (and reported the request)"),
)


def _armed_values(pe: dict[str, Any], de: dict[str, Any]) -> dict[str, float] | None:
    ready, posted, settled = pe.get("layers.ready"), pe.get("write.layer_posted"), pe.get("write.settled")
    notified = de.get("recv.notified")
    if not (ready and posted and settled and notified):
        return None
    settled_at = _settled_at(settled)
    return {
        "writer_wait": ready["wait_ms"] * 1e3,
        "make": posted.get("make_ms", 0.0) * 1e3,
        "transfer": posted.get("transfer_ms", 0.0) * 1e3,
        "in_flight": (settled_at - posted["ts"]) * 1e6,  # logged right after its post returned
        "d_pickup": _d_pickup_us(notified, settled_at),
    }


def armed_stages(pair: NodePair, pushes: Sequence[tuple[str, str]]) -> dict[str, float]:
    """µs per stage (ARMED_STAGES), p50 over ``pushes`` (P id, D id), from the event logs."""
    events = ("layers.ready", "write.layer_posted", "write.settled")
    return _stages_p50(pair, pushes, events, ARMED_STAGES, _armed_values)


def posted_calls(pair: NodePair, pushes: Sequence[tuple[str, str]], event: str) -> dict[str, float]:
    """The writer's own make_prepped_xfer / transfer times (µs p50) for ``pushes``, from its
    ``event`` (write.posted or write.layer_posted)."""
    p = pair.events("p", (event,))
    make = [p[i][event].get("make_ms", 0.0) * 1e3 for i, _ in pushes if event in p.get(i, {})]
    xfer = [p[i][event].get("transfer_ms", 0.0) * 1e3 for i, _ in pushes if event in p.get(i, {})]
    return {"make_us_p50": round(pct(make, 0.5), 1), "transfer_us_p50": round(pct(xfer, 0.5), 1)} if make else {}


def idle_cost(seconds: float, config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """CPU of a P and a D rank (one process, real NIXL) doing nothing after one push: what
    their polling costs when idle. Measured after ``poll_busy_linger`` has passed, so the
    writers have backed off to ``poll_interval_idle``. Always on DRAM: what idle polling
    costs does not depend on where the KV lives, and VRAM between two agents of one process is
    not a path we support (UCX's CUDA IPC wants two processes; on the H200 with
    ``nixl_num_threads=4`` and ``nixl_sgl`` this one push failed as a remote disconnect)."""
    from pushactors.core.config import PushConfig
    from pushactors.testing import PushPair, SimSpec
    from pushactors.transport.nixl import agent_factory_from_config

    cfg = PushConfig(engine_id="bench", role="producer", **config)
    spec = SimSpec(num_layers=2, num_blocks=8, device="cpu")
    with PushPair(agent_factory=agent_factory_from_config(cfg), p_spec=spec, **config) as pair:
        pair.prefill.prefill("idle-1-0-aaaaaaaa", 16, key="idle")
        params = pair.prefill.scheduler.decode_params("idle-1-0", None)
        pair.decode.expect("idle-1-0-bbbbbbbb", 16, params, key="idle")
        pair.pump(
            lambda: "idle-1-0-bbbbbbbb" in pair.received and "idle-1-0-aaaaaaaa" in pair.sent,
            timeout=timeout,
            what="the idle suite's one push",
        )
        if pair.received["idle-1-0-bbbbbbbb"] is not None:
            raise RuntimeError(f"idle suite's push failed: {pair.received['idle-1-0-bbbbbbbb']}")
        # Past the linger, every back-off step and the writers' deep-sleep threshold (what a
        # rank idle for longer than a second costs) before the clock starts.
        from pushactors.actors.writer.cadence import DEEP_AFTER_S, DEEP_FACTOR

        time.sleep(
            cfg.poll_busy_linger + 30 * cfg.poll_interval_idle + DEEP_AFTER_S + DEEP_FACTOR * cfg.poll_interval_idle
        )
        t0, c0 = time.monotonic(), time.process_time()
        time.sleep(seconds)
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
    return {
        "seconds": round(wall, 3),
        "ranks": 2,
        "cpu_s": round(cpu, 4),
        "core_share": round(cpu / wall, 4),  # of one core, both ranks together
        "poll_interval_idle_s": cfg.poll_interval_idle,
        "memory": "DRAM",
    }


def suite_small(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    sizes = [int(s) for s in _csv(args.sizes)] if args.sizes else [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    count = args.count if args.count is not None else (50 if args.quick else 200)
    warmup = 5
    device = args.device
    config = parse_config(args.config)
    timeout = float(args.timeout)
    started = time.monotonic()
    base = SHAPES["8b"]
    per_token = base.kv_heads * 2 * base.head_dim * base.elem_size  # one layer: 4 KiB a token
    for size in sizes:
        if size % per_token:
            raise ValueError(f"--sizes: {size} is not a multiple of {per_token} bytes (one token of one layer)")
    poll_s = args.bare_poll if args.bare_poll is not None else 0.0
    # Beside the transport's threads, a node thread that runs Python a share of the time, as an
    # engine's does (--engine-busy), or the node's loop itself run as an engine thread (--engine
    # model); the nodes' switch interval is the workers' own setting (bare NIXL runs without any).
    engine = engine_spec(args)
    idle_s = engine_idle_s(args)
    node_options = {"python_busy": args.engine_busy, **engine_node_options(engine)}
    node_config = {**config, "switch_interval": args.switch_interval} if args.switch_interval else config
    from pushactors.core.config import PushConfig

    defaults = PushConfig(engine_id="bench", role="consumer", **node_config)  # refused here if bad
    paced_s = min(defaults.poll_interval_busy, defaults.poll_interval_await)
    bare_res: dict[int, dict[str, Any]] = {}
    progress.stage("bare NIXL")
    log(f"bare NIXL: {count} WRITEs per size, one at a time")
    with BarePair(max(sizes), device, timeout=timeout) as bare:
        for size in sizes:
            bare.prep(f"s{size}", np.zeros(1), np.zeros(1), np.array([size]))
            t = bare.write(f"s{size}", count, warmup=warmup, poll_s=poll_s)
            # The same WRITEs with the target polling as D's writer does while it awaits a
            # push: UCX moves a small WRITE and its notification only while both ends progress.
            paced = bare.write(f"s{size}", count, warmup=warmup, poll_s=paced_s)
            ahead = bare.write(f"s{size}", count, warmup=warmup, poll_s=poll_s, made_ahead=True)
            bare_res[size] = {
                "notif_us_p50": round(pct(t.seen, 0.5) * 1e6, 1),
                "notif_us_p99": round(pct(t.seen, 0.99) * 1e6, 1),
                "done_us_p50": round(pct(t.done, 0.5) * 1e6, 1),
                # the post's two NIXL calls, to set beside the writer's own (stages table)
                "make_us_p50": round(pct(t.make, 0.5) * 1e6, 1),
                "transfer_us_p50": round(pct(t.transfer, 0.5) * 1e6, 1),
                # made ahead, its notification given at transfer (as an armed push posts)
                "ahead_transfer_us_p50": round(pct(ahead.transfer, 0.5) * 1e6, 1),
                "ahead_notif_us_p50": round(pct(ahead.seen, 0.5) * 1e6, 1),
                "notifications_seen": t.notifs,
                "paced_poll_s": paced_s,
                "paced_notif_us_p50": round(pct(paced.seen, 0.5) * 1e6, 1),
                "paced_notif_us_p99": round(pct(paced.seen, 0.99) * 1e6, 1),
            }
    # P's forward, armed path: a wait on the device (the interpreter free), as long as a short
    # prefill's forward at least, during which the request is matched and its WRITE made.
    forward = {"device_us": int(args.forward_us)}
    cases = []
    for size in sizes:
        shape = Shape(
            "one-layer", 1, base.kv_heads, base.head_dim, base.elem_size, size // per_token, size // per_token
        )
        sim = sim_spec(shape, "hnd", 4, device)
        progress.stage(f"pushactors {_size(size)}", total=warmup + count)
        log(f"pushactors: {size // 1024} KiB pushes, {count} of them")
        logdir = json_path(args).parent / f"{json_path(args).stem}-logs"
        pair = NodePair(
            sim,
            sim,
            config=node_config,
            p_log=logdir / f"{_size(size).replace(' ', '')}-prefill.jsonl",
            d_log=logdir / f"{_size(size).replace(' ', '')}-decode.jsonl",
            timeout=timeout,
            node_options=node_options,
        )
        phases = EnginePhases(engine, {"prefill": pair.p, "decode": pair.d}, idle_s) if engine is not None else None
        engine_out = None
        try:
            # Push mode's steady state first (D's registration already at P: the push alone),
            # then P's prefill first (the registration's trip to P is on the path too).
            crit, lat, seen, armed, armed_engine = [], [], [], [], []
            ids: list[tuple[str, str]] = []
            armed_ids: list[tuple[str, str]] = []
            for i in range(warmup + count):
                progress.update(i)
                if i == warmup and phases is not None:
                    progress.update(i, f"engine idle, {idle_s} s")
                    phases.idle()  # after the warm-up: handshakes done, nothing in flight
                # The engine's default path (armed, posted at the forward's end), then the
                # same request handed over a step later (its next step's start_load_kv).
                o = pair.push(shape.tokens, order="armed", forward=forward)
                if i >= warmup:
                    armed.append(o.critical_path)
                    armed_engine.append(o.engine_path)
                    armed_ids.append((o.p_id, o.d_id))
                o = pair.push(shape.tokens, order="registration_first")
                if i >= warmup:
                    crit.append(o.critical_path)
                    ids.append((o.p_id, o.d_id))
            for i in range(warmup + count):
                o = pair.push(shape.tokens)
                if i >= warmup:
                    lat.append(o.transport_latency)
                    seen.append(o.push_latency)
            if phases is not None:
                engine_out = {**phases.pushes(), "bytes_checked": pair.bytes_checked}
            loads = {side: node.stats() for side, node in (("prefill", pair.p), ("decode", pair.d))}
        finally:
            pair.close()
        load = {
            side: {"python_busy_share": round(st["python_busy_share"], 3), "switch_interval_s": st["switch_interval_s"]}
            for side, st in loads.items()
        }
        stages = small_stages(pair, ids)
        stages_armed = armed_stages(pair, armed_ids)
        b = bare_res[size]
        a50, a99 = pct(armed, 0.5) * 1e6, pct(armed, 0.99) * 1e6
        c50, c99 = pct(crit, 0.5) * 1e6, pct(crit, 0.99) * 1e6
        p50, p99 = pct(lat, 0.5) * 1e6, pct(lat, 0.99) * 1e6
        cases.append(
            {
                "bytes": size,
                "pushes": len(lat),
                "armed_us_p50": round(a50, 1),
                "armed_us_p99": round(a99, 1),
                "armed_added_us_p50": round(a50 - b["notif_us_p50"], 1),
                "armed_added_us_p99": round(a99 - b["notif_us_p99"], 1),
                # ... until D's engine had it from its hook (it asks once a step)
                "armed_engine_us_p50": round(pct(armed_engine, 0.5) * 1e6, 1),
                "armed_engine_us_p99": round(pct(armed_engine, 0.99) * 1e6, 1),
                "stages_armed_us_p50": stages_armed,
                # the writer's own NIXL calls beside the bare pair's (same run)
                "nixl_calls_us_p50": {
                    "armed": posted_calls(pair, armed_ids, "write.layer_posted"),
                    "next_step": posted_calls(pair, ids, "write.posted"),
                    "bare": {"make_us_p50": b["make_us_p50"], "transfer_us_p50": b["transfer_us_p50"]},
                    "bare_made_ahead": {"make_us_p50": 0.0, "transfer_us_p50": b["ahead_transfer_us_p50"]},
                },
                "critical_us_p50": round(c50, 1),
                "critical_us_p99": round(c99, 1),
                "critical_added_us_p50": round(c50 - b["notif_us_p50"], 1),
                "critical_added_us_p99": round(c99 - b["notif_us_p99"], 1),
                "pushactors_us_p50": round(p50, 1),
                "pushactors_us_p99": round(p99, 1),
                "engine_step_us_p50": round(pct(seen, 0.5) * 1e6, 1),
                "stages_us_p50": stages,
                "bare": b,
                "added_us_p50": round(p50 - b["notif_us_p50"], 1),
                "added_us_p99": round(p99 - b["notif_us_p99"], 1),
                "node_load": load,  # measured in each node: its engine thread's Python share
                **({"engine": engine_out} if engine_out is not None else {}),
            }
        )
    progress.stage("idle")
    log("idle: a P and a D rank doing nothing, real NIXL")
    idle = idle_cost(1.0 if args.quick else 3.0, config, timeout)
    result = {
        "suite": "small",
        "idle": idle,
        "device": device,
        "memory": "VRAM" if device == "cuda" else "DRAM",
        "count": count,
        "warmup": warmup,
        "bare_target_poll_s": poll_s,
        "config": config,
        "forward_us": args.forward_us,
        "engine_busy": args.engine_busy,
        "engine_model": {"share": engine.share, "step_s": engine.step, "idle_s": idle_s} if engine else None,
        "switch_interval_s": args.switch_interval,
        "machine": machine(device),
        "cases": cases,
        "seconds": round(time.monotonic() - started, 1),
    }
    cols = [
        "size",
        "bare NIXL p50 / p99 µs",
        "bare, paced p50 µs",
        "push p50 / p99 µs",
        "push added p50 / p99 µs",
        "D's engine has it p50 / p99 µs",
        "push a step later p50 / p99 µs",
        "reg. + push p50 / p99 µs",
        "reg. + push added p50 µs",
    ]
    rows = [
        [
            _size(c["bytes"]),
            f"{c['bare']['notif_us_p50']} / {c['bare']['notif_us_p99']}",
            c["bare"]["paced_notif_us_p50"],
            f"{c['armed_us_p50']} / {c['armed_us_p99']}",
            f"{c['armed_added_us_p50']} / {c['armed_added_us_p99']}",
            f"{c['armed_engine_us_p50']} / {c['armed_engine_us_p99']}",
            f"{c['critical_us_p50']} / {c['critical_us_p99']}",
            f"{c['pushactors_us_p50']} / {c['pushactors_us_p99']}",
            c["added_us_p50"],
        ]
        for c in cases
    ]
    head = (
        f"small: one block per push, TP1, {result['memory']}, {count} pushes per size and order, one "
        "at a time. push = the engine's default path: D's registration already held by P, the push "
        "armed when P's forward was announced and posted at its end; P's forward has computed the "
        f"KV (a forward of {args.forward_us:g} µs on the device) → D's transport knows it landed "
        "(one clock, time.monotonic, for both processes). D's engine has it = the same until D's "
        "engine loop had it from its hook (once a step). a step later = handed over at the next "
        "step's start (whole_push_start = next_step): P's prefill hands its KV to the transport → D "
        "knows. reg. + push = P's prefill finished first: D stages its registration → D's "
        "transport knows (the registration's trip to P included). bare = WRITE posted → "
        "notification seen by the target, polling without pause; paced = the target polling as "
        "D's writer does while it awaits a push\n\n"
    )
    stage_cols = ["stage (p50 µs)"] + [_size(c["bytes"]) for c in cases]
    stage_rows = [[what] + [c["stages_armed_us_p50"].get(key, "—") for c in cases] for key, what in ARMED_STAGES]
    stage_rows.append(["push (end to end, p50)"] + [c["armed_us_p50"] for c in cases])
    stage_rows.append(["**a step later:**"] + ["" for _ in cases])
    stage_rows += [[what] + [c["stages_us_p50"].get(key, "—") for c in cases] for key, what in SMALL_STAGES]
    stage_rows.append(["push a step later (end to end, p50)"] + [c["critical_us_p50"] for c in cases])
    calls_cols = ["NIXL call (p50 µs)", "size", "bare", "bare, made ahead", "push", "push a step later"]
    calls_rows = [
        [
            call,
            _size(c["bytes"]),
            c["nixl_calls_us_p50"]["bare"].get(f"{call}_us_p50", "—"),
            c["nixl_calls_us_p50"]["bare_made_ahead"].get(f"{call}_us_p50", "—"),
            c["nixl_calls_us_p50"]["armed"].get(f"{call}_us_p50", "—"),
            c["nixl_calls_us_p50"]["next_step"].get(f"{call}_us_p50", "—"),
        ]
        for c in cases
        for call in ("make", "transfer")
    ]
    idle_text = (
        f"\n\nIdle: a P and a D rank (one process, real NIXL, DRAM) after one push, {idle['seconds']} s: "
        f"{idle['cpu_s'] * 1e3:.1f} ms of CPU, {idle['core_share'] * 100:.2f}% of one core for both "
        f"(writers polling every {idle['poll_interval_idle_s'] * 1e3:g} ms)"
    )
    engine_part = (
        engine_text([row for c in cases for row in engine_rows(_size(c["bytes"]), c["engine"])], engine.step, idle_s)
        if engine is not None
        else ""
    )
    return result, (
        head
        + table(cols, rows)
        + engine_part
        + idle_text
        + "\n\nWhere a push's time goes (from the nodes' event logs; stages overlap little, so they "
        "sum to about the push)\n\n"
        + table(stage_cols, stage_rows)
        + "\n\nThe post's NIXL calls: the bare pair's, and the writer's own (its events), same run "
        "(a push armed ahead made its WRITE then: make 0)\n\n" + table(calls_cols, calls_rows)
    )


# ------------------------------------------------------------------------------------------------
# control: the control plane alone (fake fabric, no bytes moved)
# ------------------------------------------------------------------------------------------------
def control_pushes(
    pushes: int, in_flight: int, step_interval: float, timeout: float, config: dict[str, Any] | None = None
) -> dict[str, Any]:
    from pushactors.testing import PushPair, SimSpec
    from pushactors.testing.fabric import FakeFabric

    spec = SimSpec(num_blocks=max(256, 2 * in_flight), shuffle_blocks=False, fill_and_verify=False)
    rng = random.Random(1)
    with PushPair(fabric=FakeFabric(copy=False), p_spec=spec, **(config or {})) as pair:
        tokens = spec.block_size  # one block

        def run(count: int, offset: int) -> tuple[float, float]:
            started = completed = 0
            live: set[str] = set()
            t0, c0 = time.monotonic(), time.process_time()
            deadline = t0 + timeout
            while completed < count:
                while started < count and len(live) < in_flight:
                    i = offset + started
                    base = f"cmpl-{i}-0"
                    p_id, d_id = f"{base}-{rng.getrandbits(32):08x}", f"{base}-{rng.getrandbits(32):08x}"
                    pair.prefill.prefill(p_id, tokens, key=base)
                    params = pair.prefill.scheduler.decode_params(base, None)
                    pair.decode.expect(d_id, tokens, params, key=base)
                    live.add(d_id)
                    started += 1
                _, d_rep = pair.step()
                if d_rep.failed_recving:
                    raise RuntimeError(f"control pushes failed: {dict(list(d_rep.failed_recving.items())[:3])}")
                for rid in d_rep.finished_recving:
                    pair.decode.finish_recv(rid)
                    live.discard(rid)
                    completed += 1
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{completed}/{count} control pushes in {timeout}s")
                if step_interval:
                    time.sleep(step_interval)
            # P's last reports come a step later: let them settle so the next run starts clean.
            pair.pump(lambda: len(pair.prefill.held) == 0, timeout=timeout, what="P to release its blocks")
            return time.monotonic() - t0, time.process_time() - c0

        run(min(pushes, 4 * in_flight), 10**7)  # warm-up: handshakes, descriptor lists
        wall, cpu = run(pushes, 0)
        failed = [k for k, v in pair.sent.items() if v is not None]
        stats = pair.fabric.stats
    return {
        "pushes": pushes,
        "in_flight": in_flight,
        "step_interval_s": step_interval,
        "seconds": round(wall, 3),
        "pushes_per_s": round(pushes / wall, 1),
        "cpu_s": round(cpu, 3),
        "cpu_us_per_push": round(cpu / pushes * 1e6, 1),
        "cpu_cores_busy": round(cpu / wall, 2),
        "p_failures": len(failed),
        "fabric_transfers": stats.transfers_done,
        "fabric_bytes_moved": stats.bytes_moved,
    }


def registry_cost(outstanding: int, matches: int, rounds: int = 5) -> dict[str, Any]:
    """µs per add with ``outstanding`` registrations waiting, and µs per push cycle
    (registration → P's blocks match it → forget) against that background.

    The cycles run in ``rounds`` rounds of ``matches`` each; ``match_cycle_us`` is the best
    round (as ``timeit`` reports), ``match_cycle_us_median`` the median. One round is tens of
    milliseconds, so on a loaded 2-core machine a single preemption can double one round;
    the best round is the registry's own cost."""
    from pushactors.core.registry import Post, PRegistry
    from pushactors.testing import registration

    reg = PRegistry(lease_duration=30.0, tombstone_ttl=600.0, orphan_ttl=480.0)
    sender = "decode-bench-tp0"
    background = [registration(f"bg-{i}-0-0000beef", (i % 1024,)) for i in range(outstanding)]
    now = 1.0
    gc.collect()
    t0 = time.perf_counter()
    for r in background:
        reg.add_registration(r, sender, now)
    fill = time.perf_counter() - t0
    per_round: list[float] = []
    for k in range(max(1, rounds)):
        regs = [registration(f"m{k}-{j}-0-0000d00d", (j % 1024,)) for j in range(matches)]
        gc.collect()
        t0 = time.perf_counter()
        posted = 0
        for j, r in enumerate(regs):
            p_id = f"m{k}-{j}-0-0000a11a"
            reg.add_registration(r, sender, now)
            res = reg.add_finished(p_id, ((j % 1024,),), None, now)
            posted += sum(isinstance(a, Post) for a in res.actions)
            reg.forget(p_id, "pushed", transfer_id=None, serial=0, now=now)
        per_round.append((time.perf_counter() - t0) / matches * 1e6)
        if posted != matches:
            raise RuntimeError(f"registry matched {posted} of {matches}")
        if len(reg.pending) != outstanding:
            raise RuntimeError(f"{len(reg.pending)} registrations pending, expected {outstanding}")
    return {
        "outstanding": outstanding,
        "matches": matches,
        "rounds": len(per_round),
        "add_us": round(fill / outstanding * 1e6, 2),
        "match_cycle_us": round(min(per_round), 2),
        "match_cycle_us_median": round(statistics.median(per_round), 2),
    }


def suite_control(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    pushes = args.pushes if args.pushes is not None else (500 if args.quick else 3000)
    in_flight = args.in_flight if args.in_flight is not None else 64
    regs = list(args.registrations) if args.registrations else [100, 100_000]
    matches = args.matches if args.matches is not None else 2000
    config = parse_config(args.config)
    started = time.monotonic()
    progress.stage("control: pushes")
    log(f"control: {pushes} one-block pushes, {in_flight} in flight, fake fabric without copies")
    push = control_pushes(pushes, in_flight, args.step_interval, float(args.timeout), config)
    progress.stage("control: registry")
    log(f"control: registry with {regs} outstanding registrations")
    cost = [registry_cost(n, matches) for n in regs]
    lo, hi = cost[0], cost[-1]
    result = {
        "suite": "control",
        "device": "fake",
        "machine": machine("cpu"),
        "pushes": push,
        "registry": cost,
        "registry_ratio": {
            "outstanding": [lo["outstanding"], hi["outstanding"]],
            "match_cycle": ratio(hi["match_cycle_us"], lo["match_cycle_us"]),
            "add": ratio(hi["add_us"], lo["add_us"]),
        },
        "seconds": round(time.monotonic() - started, 1),
    }
    text = (
        "control: one process, P and D over the fake fabric (no bytes copied), 1-block requests\n\n"
        + table(
            ["pushes", "in flight", "pushes/s", "CPU µs per push", "CPU cores busy"],
            [
                [
                    push["pushes"],
                    push["in_flight"],
                    push["pushes_per_s"],
                    push["cpu_us_per_push"],
                    push["cpu_cores_busy"],
                ]
            ],
        )
        + "\n\nP's registry (PRegistry), µs per operation with N registrations outstanding\n\n"
        + table(
            ["outstanding", "add µs", "match cycle µs (register + match + forget): best / median round"],
            [[c["outstanding"], c["add_us"], f"{c['match_cycle_us']} / {c['match_cycle_us_median']}"] for c in cost],
        )
        + f"\n\nratio {hi['outstanding']} / {lo['outstanding']} outstanding: match cycle "
        f"{result['registry_ratio']['match_cycle']}, add {result['registry_ratio']['add']}"
    )
    return result, text


# ------------------------------------------------------------------------------------------------
# xpyd: N P and M D engines in one process over the fake fabric, routed by EnginePool
# ------------------------------------------------------------------------------------------------
def suite_xpyd(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from pushactors.testing.xpyd import XpydSim, sim_spec

    requests = args.requests if args.requests is not None else (2000 if args.quick else 20_000)
    in_flight = args.in_flight if args.in_flight is not None else (500 if args.quick else 2000)
    tokens: int | tuple[int, int] = args.tokens if args.tokens is not None else (17, 48)
    longest = tokens if isinstance(tokens, int) else tokens[1]
    p_tp = [int(x) for x in _csv(args.p_tp)]
    d_tp = [int(x) for x in _csv(args.d_tp)]
    p_sizes = [p_tp[i % len(p_tp)] for i in range(args.prefills)]
    d_sizes = [d_tp[i % len(d_tp)] for i in range(args.decodes)]
    config = parse_config(args.config)
    engines = min(args.prefills, args.decodes)
    spec = sim_spec(in_flight, engines, tokens=longest, block_bytes=256 * math.lcm(*p_sizes, *d_sizes))
    started = time.monotonic()
    progress.stage(f"xpyd: {args.prefills}P{args.decodes}D", total=requests)
    log(
        f"xpyd: {args.prefills} P (TP {p_sizes}) and {args.decodes} D (TP {d_sizes}), {requests} requests, "
        f"{in_flight} in flight, fake fabric with copies, every byte checked"
    )
    with XpydSim(
        args.prefills, args.decodes, p_tp=p_sizes, d_tp=d_sizes, spec=spec, config=config, seed=args.seed
    ) as sim:
        sim.warm_up()  # every P-D handshake, before the clock starts
        c0 = time.process_time()
        res = sim.run(
            requests,
            in_flight=in_flight,
            tokens=tokens,
            timeout=float(args.timeout),
            on_progress=lambda ended, sent: progress.update(ended, f"{sent - ended} in flight"),
        )
        cpu = time.process_time() - c0
        sim.settle(timeout=60)
        leaks = sim.leaks()
        fabric = sim.fabric.stats
    summary = res.summary()
    result = {
        "suite": "xpyd",
        "device": "fake",
        "machine": machine("cpu"),
        "prefills": p_sizes,
        "decodes": d_sizes,
        "tokens": list(tokens) if isinstance(tokens, tuple) else tokens,
        "spec": {"num_layers": spec.num_layers, "block_bytes": spec.block_bytes, "num_blocks": spec.num_blocks},
        **summary,
        "cpu_s": round(cpu, 3),
        "cpu_us_per_request": round(cpu / max(1, res.requests) * 1e6, 1),
        "fabric_transfers": fabric.transfers_done,
        "fabric_bytes_moved": fabric.bytes_moved,
        "leaks": leaks,
        "seconds": round(time.monotonic() - started, 1),
    }
    if res.failed or res.bytes_wrong or leaks:
        raise RuntimeError(
            f"xpyd: {len(res.failed)} requests failed (e.g. {list(res.failed.items())[:3]}), "
            f"{res.bytes_wrong} wrong bytes, leaks {leaks[:5]}"
        )
    text = (
        f"xpyd: one process, {args.prefills} P and {args.decodes} D over the fake fabric (bytes copied "
        "and checked), least-outstanding pools\n\n"
        + table(
            [
                "requests",
                "in flight",
                "requests/s",
                "p50 ms",
                "p99 ms",
                "failed",
                "wrong bytes",
                "P spread",
                "D spread",
            ],
            [
                [
                    summary["requests"],
                    summary["max_in_flight"],
                    summary["requests_per_s"],
                    summary["latency_p50_ms"],
                    summary["latency_p99_ms"],
                    summary["failed"],
                    summary["bytes_wrong"],
                    f"{summary['prefill_spread']:.1%}",
                    f"{summary['decode_spread']:.1%}",
                ]
            ],
        )
        + "\n\nrequests per engine\n\n"
        + table(
            ["engine", "TP", "requests"],
            [[n, sim.prefills[n].tp_size, c] for n, c in res.per_prefill.items()]
            + [[n, sim.decodes[n].tp_size, c] for n, c in res.per_decode.items()],
        )
    )
    return result, text


# ------------------------------------------------------------------------------------------------
# Entry
# ------------------------------------------------------------------------------------------------
def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def json_path(args: argparse.Namespace) -> Path:
    """``--json``, else ``runs/bench/<suite>.json`` (``big-70b.json`` for the 70b shape)."""
    if args.json:
        return Path(args.json)
    name = "big-70b" if args.suite == "big" and args.shape == "70b" else args.suite
    return Path("runs/bench") / f"{name}.json"


def run(args: argparse.Namespace) -> int:
    from pushactors.apps.bench import engine_refusal

    refused = engine_refusal(args)
    if refused:
        print(f"pushactors bench: {refused}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("pushactors bench: --device cuda but torch sees no GPU", file=sys.stderr)
            return 2
    runners = {"big": suite_big, "small": suite_small, "control": suite_control, "dram": suite_dram, "xpyd": suite_xpyd}
    runner = runners[args.suite]
    # The bar (stderr) is gone before the table is printed (stdout).
    with progress.Progress(f"bench {args.suite}", enabled=getattr(args, "progress", True)):
        result, text = runner(args)
    result["args"] = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    path = json_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    print(f"\nJSON: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench/suites.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from pushactors.apps.bench import add_arguments

    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
