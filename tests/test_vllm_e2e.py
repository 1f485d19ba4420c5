"""Real vLLM engines (CPU) with the pushactors connector, behind the concurrent-legs router.

A P and a D vLLM OpenAI server load ``pushactors.integrations.vllm.PushActorsConnector``; a
tiny random Llama makes greedy output depend on every cached key and value. Checks: D's tokens
with remote prefill equal D's tokens with local prefill (``cache_salt`` keeps D's own cache out of
the reference), D really loaded the prompt externally (its metrics) and the bytes pushed are
blocks × layers × block bytes (P's mailbox log), and corrupted pushed KV changes the output.

Needs a vLLM environment: ``PUSHACTORS_VLLM_PYTHON`` (``.ci/test`` builds ``.venv-vllm``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from pushactors.testing.vllm_servers import (
    PUSHACTORS_CONNECTOR,
    RouterProcess,
    ServerSpec,
    VllmServer,
    build_tiny_model,
    free_port,
    metric_value,
    wait_healthy,
)

VLLM_PY = os.environ.get("PUSHACTORS_VLLM_PYTHON")
if not VLLM_PY:
    if os.environ.get("PUSHACTORS_REQUIRE_VLLM"):
        raise RuntimeError("PUSHACTORS_REQUIRE_VLLM is set but PUSHACTORS_VLLM_PYTHON is not")
    pytest.skip(
        "set PUSHACTORS_VLLM_PYTHON to a vLLM environment's python (.ci/bootstrap-vllm)", allow_module_level=True
    )

aiohttp = pytest.importorskip("aiohttp")

BLOCK = 128  # vLLM's CPU block size
LAYERS = 2
BLOCK_BYTES = 32768  # one layer's block: 1 KV head × 128 tokens × (64 K + 64 V) × bf16


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = str(build_tiny_model(VLLM_PY or "", root / "model"))
        self.p_side, self.d_side = free_port(), free_port()
        self.p_port, self.d_port, self.router_port = free_port(), free_port(), free_port()
        self.p_log = root / "logs" / "prefill.jsonl"

        def kv(role: str, engine: str, side: int, log: Path) -> dict[str, Any]:
            return {
                **PUSHACTORS_CONNECTOR,
                "kv_role": role,
                "kv_buffer_device": "cpu",
                "engine_id": engine,
                "kv_connector_extra_config": {
                    "side_channel_port": side,
                    "log_json": str(log),
                    "debug_allow_noise": role == "kv_producer",
                    "handshake_timeout": 20.0,
                    "registration_timeout": 120.0,
                },
            }

        env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        self.p = VllmServer(
            VLLM_PY or "",
            self.model,
            ServerSpec("prefill", self.p_port, kv("kv_producer", "prefill-0", self.p_side, self.p_log), "0", env),
            root / "logs",
        )
        self.d = VllmServer(
            VLLM_PY or "",
            self.model,
            ServerSpec(
                "decode",
                self.d_port,
                kv("kv_consumer", "decode-0", self.d_side, root / "logs" / "decode.jsonl"),
                "1",
                env,
            ),
            root / "logs",
        )
        self.router = RouterProcess(
            [
                "--prefill",
                self.p.url,
                "--decode",
                self.d.url,
                "--prefill-engine-id",
                "prefill-0",
                "--prefill-side-channel",
                f"127.0.0.1:{self.p_side}",
            ],
            self.router_port,
            root / "logs",
        )

    def start(self) -> None:
        wait_healthy([self.p, self.d, self.router], timeout=400)

    def stop(self) -> None:
        for proc in (self.router, self.p, self.d):
            proc.stop()

    def pushed_bytes(self, rid: str) -> int:
        """Bytes P's writer posted for router request ``rid`` (from P's JSON mailbox log)."""
        total = 0
        for path in self.p_log.parent.glob(f"{self.p_log.stem}.worker.*.jsonl"):
            for line in path.read_text().splitlines():
                event = json.loads(line)
                if event.get("event") == "write.posted" and str(event.get("request_id", "")).startswith(f"cmpl-{rid}-"):
                    total += int(event["bytes"])
        return total


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("vllm"))
    try:
        c.start()
        yield c
    except BaseException:
        for proc in (c.p, c.d, c.router):
            print(f"--- {proc.name} ---\n{proc.tail(60)}")
        raise
    finally:
        c.stop()


def prompt_of(tokens_hint: int, seed: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "cache", "block", "push", "decode", "prefill", "rank"]
    # A byte-level BPE of vocab 512 turns each " word" into about two tokens.
    return " ".join(
        words[(seed * 7 + i * 3) % len(words)] + str((seed + i) % 10) for i in range(max(1, tokens_hint // 3))
    )


async def complete(session: Any, url: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
    async with session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as resp:
        text = await resp.text()
        return {"status": resp.status, "body": json.loads(text) if text.startswith("{") else text}


def body(cluster: Cluster, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": cluster.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}


async def run_all(cluster: Cluster, jobs: list[tuple[str, dict[str, Any], str]]) -> list[dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(complete(session, url, b, rid) for url, b, rid in jobs))


def test_remote_prefill_matches_local_prefill(cluster: Cluster) -> None:
    hints = [3, 40, 120, 127, 128, 129, 200, 380, 700]
    prompts = [prompt_of(h, i) for i, h in enumerate(hints)]
    rids = [f"e2e-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(prompts))]
    before = cluster.d.metrics()
    # All in flight at once, through the router (both legs of each sent concurrently).
    jobs = [(cluster.router.url, body(cluster, p), r) for p, r in zip(prompts, rids, strict=True)]
    remote = asyncio.run(run_all(cluster, jobs))
    after = cluster.d.metrics()
    local = asyncio.run(
        run_all(
            cluster,
            [
                (cluster.d.url, body(cluster, p, cache_salt=f"ref-{r}"), f"ref-{r}")
                for p, r in zip(prompts, rids, strict=True)
            ],
        )
    )
    total_prompt = 0
    total_bytes = 0
    for rid, got, want in zip(rids, remote, local, strict=True):
        assert got["status"] == 200, got
        assert want["status"] == 200, want
        assert got["body"]["choices"][0]["text"] == want["body"]["choices"][0]["text"], rid
        n = got["body"]["usage"]["prompt_tokens"]
        total_prompt += n
        expected = math.ceil(n / BLOCK) * LAYERS * BLOCK_BYTES
        assert cluster.pushed_bytes(rid) == expected, (rid, n)
        total_bytes += expected
    assert any(r["body"]["usage"]["prompt_tokens"] < BLOCK for r in remote)  # shorter than a block
    # D served every prompt token from the push, none computed locally.
    hits = metric_value(after, "vllm:external_prefix_cache_hits_total") - metric_value(
        before, "vllm:external_prefix_cache_hits_total"
    )
    assert hits == total_prompt
    received = metric_value(after, "vllm:pushactors_bytes_received_total") - metric_value(
        before, "vllm:pushactors_bytes_received_total"
    )
    assert received == total_bytes


def test_prefix_hit_on_decode_pushes_only_the_suffix(cluster: Cluster) -> None:
    prompt = prompt_of(420, 99)
    first, second = f"pfx-a-{uuid.uuid4().hex[:6]}", f"pfx-b-{uuid.uuid4().hex[:6]}"
    (r1,) = asyncio.run(run_all(cluster, [(cluster.router.url, body(cluster, prompt), first)]))
    (r2,) = asyncio.run(run_all(cluster, [(cluster.router.url, body(cluster, prompt), second)]))
    (ref,) = asyncio.run(run_all(cluster, [(cluster.d.url, body(cluster, prompt, cache_salt="pfx-ref"), "pfx-ref")]))
    n = r1["body"]["usage"]["prompt_tokens"]
    assert r1["body"]["choices"][0]["text"] == ref["body"]["choices"][0]["text"]
    assert r2["body"]["choices"][0]["text"] == ref["body"]["choices"][0]["text"]
    assert cluster.pushed_bytes(first) == math.ceil(n / BLOCK) * LAYERS * BLOCK_BYTES
    # D kept the full blocks of the first push cached; only what it lacks is pushed, taken
    # from the END of P's blocks.
    cached_blocks = (n - 1) // BLOCK
    assert cluster.pushed_bytes(second) == (math.ceil(n / BLOCK) - cached_blocks) * LAYERS * BLOCK_BYTES


def test_corrupted_push_changes_the_output(cluster: Cluster) -> None:
    """Negative control: the match above is not vacuous."""
    prompts = [prompt_of(h, 50 + i) for i, h in enumerate([150, 300, 500])]
    changed = 0
    for i, prompt in enumerate(prompts):
        rid = f"noise-{i}-{uuid.uuid4().hex[:6]}"
        p_body = {
            **body(cluster, prompt),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "pushactors_debug_noise": True},
        }
        (p_resp,) = asyncio.run(run_all(cluster, [(cluster.p.url, p_body, rid)]))
        assert p_resp["status"] == 200, p_resp
        params = p_resp["body"]["kv_transfer_params"]
        (d_resp,) = asyncio.run(
            run_all(cluster, [(cluster.d.url, {**body(cluster, prompt), "kv_transfer_params": params}, rid)])
        )
        (ref,) = asyncio.run(
            run_all(cluster, [(cluster.d.url, body(cluster, prompt, cache_salt=f"n-{rid}"), f"n-{rid}")])
        )
        assert d_resp["status"] == 200, d_resp
        assert cluster.pushed_bytes(rid) > 0
        changed += d_resp["body"]["choices"][0]["text"] != ref["body"]["choices"][0]["text"]
    assert changed == len(prompts)


def test_bad_kv_transfer_params_fail_only_that_request(cluster: Cluster) -> None:
    prompt = prompt_of(60, 7)
    bad = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_port": cluster.p_side}  # no host, no tp
    (resp,) = asyncio.run(
        run_all(cluster, [(cluster.d.url, {**body(cluster, prompt), "kv_transfer_params": bad}, "bad-1")])
    )
    assert resp["status"] != 200  # failed visibly (vLLM's default load-failure policy: fail)
    ok = asyncio.run(
        run_all(cluster, [(cluster.router.url, body(cluster, prompt), f"after-bad-{uuid.uuid4().hex[:6]}")])
    )
    assert ok[0]["status"] == 200  # the engine keeps serving


def test_unreachable_prefill_fails_fast_not_at_the_watchdog(cluster: Cluster) -> None:
    prompt = prompt_of(60, 8)
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "ghost",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "tp_size": 1,
    }
    import time

    t0 = time.monotonic()
    (resp,) = asyncio.run(
        run_all(cluster, [(cluster.d.url, {**body(cluster, prompt), "kv_transfer_params": params}, "ghost-1")])
    )
    assert resp["status"] != 200
    assert time.monotonic() - t0 < 60  # the registration timeout is 120 s: this failed on the handshake
