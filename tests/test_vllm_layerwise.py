"""Layer-wise pushes with real vLLM engines (CPU): P runs ``push_mode = "layerwise"``, so each
attention layer's KV is written into D's blocks as vLLM's forward saves it (save_kv_layer), one
completion when every layer landed. D's tokens must equal D's tokens with local prefill; P's log
must show one WRITE per layer per request; the trace tool shows the layers, marked one by one
as the forward saved them. A chunked prefill (P's step budget below the prompt) is announced in the step
of its last chunk. Needs ``PUSHACTORS_VLLM_PYTHON`` (``.ci/test`` builds ``.venv-vllm``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from env_kit import written_events

from pushactors.testing import wait_until
from pushactors.testing.greedy import LOGPROB_FIELDS, disagreement, from_choice
from pushactors.testing.ports import free_port
from pushactors.testing.vllm_servers import (
    PUSHACTORS_CONNECTOR,
    TINY_BLOCK,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    RouterProcess,
    ServerSpec,
    VllmServer,
    build_tiny_model,
    metric_value,
    vllm_python_or_skip,
    wait_healthy,
)

VLLM_PY = vllm_python_or_skip()

aiohttp = pytest.importorskip("aiohttp")

ROOT = Path(__file__).resolve().parent.parent
BLOCK, LAYERS, BLOCK_BYTES = TINY_BLOCK, TINY_LAYERS, TINY_BLOCK_BYTES  # the tiny model on vLLM CPU
STEP_TOKENS = 512  # P's step budget: a longer prompt is prefilled in chunks


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = str(build_tiny_model(VLLM_PY or "", root / "model"))
        p_side, d_side = free_port(), free_port()
        self.logs = root / "logs"

        def kv(role: str, engine: str, side: int, extra: dict[str, Any]) -> dict[str, Any]:
            return {
                **PUSHACTORS_CONNECTOR,
                "kv_role": role,
                "kv_buffer_device": "cpu",
                "engine_id": engine,
                "kv_connector_extra_config": {
                    "side_channel_port": side,
                    "log_json": str(self.logs / f"{role}.jsonl"),
                    "handshake_timeout": 20.0,
                    "registration_timeout": 120.0,
                    **extra,
                },
            }

        env = {"PYTHONPATH": str(ROOT)}
        p_kv = kv("kv_producer", "prefill-lw", p_side, {"push_mode": "layerwise"})
        chunked = ["--max-num-batched-tokens", str(STEP_TOKENS), "--enable-chunked-prefill"]
        self.p = VllmServer(
            VLLM_PY or "", self.model, ServerSpec("prefill", free_port(), p_kv, "0", env, chunked), self.logs
        )
        d_kv = kv("kv_consumer", "decode-lw", d_side, {})
        self.d = VllmServer(VLLM_PY or "", self.model, ServerSpec("decode", free_port(), d_kv, "1", env), self.logs)
        self.router = RouterProcess(
            [
                "--prefill",
                self.p.url,
                "--decode",
                self.d.url,
                "--prefill-engine-id",
                "prefill-lw",
                "--prefill-side-channel",
                f"127.0.0.1:{p_side}",
                "--log-json",
                str(self.logs / "router.jsonl"),
            ],
            free_port(),
            self.logs,
        )

    def p_events(self, rid: str) -> list[dict[str, Any]]:
        out = []
        for path in self.logs.glob("kv_producer.worker.*.jsonl"):
            for event in written_events(path):
                if str(event.get("request_id", "")).startswith(f"cmpl-{rid}-"):
                    out.append(event)
        return sorted(out, key=lambda e: e["ts"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("vllm-layerwise"))
    try:
        wait_healthy([c.p, c.d, c.router], timeout=400)
        yield c
    except BaseException:
        for proc in (c.p, c.d, c.router):
            print(f"--- {proc.name} ---\n{proc.tail(60)}")
        raise
    finally:
        for proc in (c.router, c.p, c.d):
            proc.stop()


def prompt_of(tokens_hint: int, seed: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "cache", "block", "push", "decode", "prefill", "rank"]
    head = uuid.uuid4().hex[:8]  # no prefix shared with another request
    return head + " " + " ".join(words[(seed * 7 + i * 3) % 10] + str((seed + i) % 10) for i in range(tokens_hint // 3))


def body(cluster: Cluster, prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": cluster.model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        **LOGPROB_FIELDS,
        **extra,
    }


async def _all(jobs: list[tuple[str, dict[str, Any], str]]) -> list[dict[str, Any]]:
    async def one(session: Any, url: str, payload: dict[str, Any], rid: str) -> dict[str, Any]:
        async with session.post(f"{url}/v1/completions", json=payload, headers={"X-Request-Id": rid}) as resp:
            text = await resp.text()
            return {"status": resp.status, "body": json.loads(text) if text.startswith("{") else text}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(one(session, u, b, r) for u, b, r in jobs))


def test_layer_wise_pushes_are_token_exact_one_write_per_layer(cluster: Cluster) -> None:
    hints = [3, 130, 300, 450, 650]  # the last one is prefilled in chunks of STEP_TOKENS
    prompts = [prompt_of(h, i) for i, h in enumerate(hints)]
    rids = [f"lw-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(prompts))]
    before = cluster.d.metrics()
    remote = asyncio.run(_all([(cluster.router.url, body(cluster, p), r) for p, r in zip(prompts, rids, strict=True)]))
    after = cluster.d.metrics()
    local = asyncio.run(
        _all(
            [
                (cluster.d.url, body(cluster, p, cache_salt=f"ref-{r}"), f"ref-{r}")
                for p, r in zip(prompts, rids, strict=True)
            ]
        )
    )
    total_prompt = 0
    for rid, got, want in zip(rids, remote, local, strict=True):
        assert got["status"] == 200 and want["status"] == 200, (got, want)
        why = disagreement(from_choice(got["body"]["choices"][0]), from_choice(want["body"]["choices"][0]))
        assert why is None, (rid, why)
        n = got["body"]["usage"]["prompt_tokens"]
        total_prompt += n
        seen: dict[str, Any] = {}

        def logged(rid: str = rid, seen: dict[str, Any] = seen) -> bool:
            seen["events"] = names = cluster.p_events(rid)
            # Both: a push that ends inside the handler that posted it logs push.finished
            # before that handler's own write.posted event.
            return {"push.finished", "write.posted"} <= {e["event"] for e in names}

        wait_until(logged, timeout=10, interval=0.1, what=f"{rid}'s push in P's log")
        layers = [e for e in seen["events"] if e["event"] == "write.layer_posted"]
        assert [e["layer_group"] for e in layers] == list(range(LAYERS)), (rid, layers)
        assert sum(e["bytes"] for e in layers) == math.ceil(n / BLOCK) * LAYERS * BLOCK_BYTES
        (posted,) = [e for e in seen["events"] if e["event"] == "write.posted"]
        assert posted.get("layerwise") is True
    assert max(r["body"]["usage"]["prompt_tokens"] for r in remote) > STEP_TOKENS  # one prefill in chunks
    hits = metric_value(after, "vllm:external_prefix_cache_hits_total") - metric_value(
        before, "vllm:external_prefix_cache_hits_total"
    )
    assert hits == total_prompt  # every prompt token of D came by push


def test_the_trace_shows_each_layer_written(cluster: Cluster) -> None:
    rid = f"lwtrace-{uuid.uuid4().hex[:6]}"
    (got,) = asyncio.run(_all([(cluster.router.url, body(cluster, prompt_of(200, 3)), rid)]))
    assert got["status"] == 200, got
    seen: dict[str, Any] = {}

    def landed() -> bool:
        out = subprocess.run(
            [sys.executable, "-m", "pushactors", "logs", str(cluster.logs), "--trace", rid, "--json"],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        seen["trace"] = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else None
        return bool(seen["trace"]) and seen["trace"]["outcome"] == "landed" and len(seen["trace"]["layers"]) == LAYERS

    wait_until(landed, timeout=30, interval=0.5, what="the trace to show both layers")
    layers = seen["trace"]["layers"]
    assert [layer["layer_group"] for layer in layers] == [0, 1] and layers[-1]["of"] == LAYERS
    # Marked by save_kv_layer as each layer was saved (0 is the announcement before the forward),
    # not only at the step's end; then wait_for_save hands the last layers over and waits.
    marks = [
        (h["fields"].get("ready"), h["fields"].get("handover"))
        for h in seen["trace"]["hops"]
        if h["event"] == "layers.ready"
    ]
    assert marks == [(0, None), (1, None), (2, None), (2, True)], marks
