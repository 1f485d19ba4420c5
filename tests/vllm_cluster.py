"""A P and a D vLLM OpenAI server (CPU) with the pushactors connector behind the router, and
the requests and comparisons the end-to-end tests share (a helper module, not a test module).

Needs a vLLM environment: ``PUSHACTORS_VLLM_PYTHON`` (``.ci/test`` builds ``.venv-vllm``); a
module importing this one is skipped without it (or fails under ``PUSHACTORS_REQUIRE_VLLM``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from env_kit import written_events

from pushactors.testing import wait_until
from pushactors.testing.greedy import LOGPROB_FIELDS, Greedy, disagreement, from_choice, from_chunks
from pushactors.testing.ports import free_port
from pushactors.testing.vllm_servers import (
    PUSHACTORS_CONNECTOR,
    RouterProcess,
    ServerSpec,
    VllmServer,
    build_tiny_model,
    vllm_python_or_skip,
    wait_healthy,
)

VLLM_PY = vllm_python_or_skip()

aiohttp = pytest.importorskip("aiohttp")


class Cluster:
    def __init__(self, root: Path, args: tuple[str, ...] = ()) -> None:
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
            ServerSpec(
                "prefill", self.p_port, kv("kv_producer", "prefill-0", self.p_side, self.p_log), "0", env, list(args)
            ),
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
                list(args),
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
                "--log-json",
                str(root / "logs" / "router.jsonl"),
            ],
            self.router_port,
            root / "logs",
        )

    def start(self) -> None:
        wait_healthy([self.p, self.d, self.router], timeout=400)
        self.wait_routable()

    def wait_routable(self) -> None:
        """The router's own health checks see both engines up (they run every 2 s)."""

        def routable() -> bool:
            health = router_health(self)
            return bool(health["prefill_eligible"] >= 1 and health["decode_eligible"] >= 1)

        wait_until(
            routable,
            timeout=60,
            interval=0.2,
            what="the router to see P and D up",
        )

    def stop(self) -> None:
        for proc in (self.router, self.p, self.d):
            proc.stop()

    def pushed_bytes(self, rid: str, timeout: float = 5.0, *, pushes: int = 1) -> int:
        """Bytes P's writer posted for router request ``rid`` (from P's JSON mailbox log). The
        log reaches its file within its flush interval: wait (with a deadline) for the whole
        story of ``pushes`` pushes (requests sharing one id), up to their push.finished events."""
        seen = {"bytes": 0}

        def finished() -> bool:
            total = posted = done = 0
            for path in self.p_log.parent.glob(f"{self.p_log.stem}.worker.*.jsonl"):
                for event in written_events(path):
                    if not str(event.get("request_id", "")).startswith(f"cmpl-{rid}-"):
                        continue
                    if event.get("event") == "write.posted":
                        total += int(event["bytes"])
                        posted += 1
                    done += event.get("event") == "push.finished"
            seen["bytes"] = total
            # Both: a WRITE that settles inside the handler that posted it (its spin) logs
            # push.finished before that handler's own write.posted event.
            return done >= pushes and posted >= pushes

        try:
            wait_until(finished, timeout=timeout, interval=0.05, what=f"{rid}'s push in P's log")
        except AssertionError:
            pass  # no push logged: the caller's assertion on the bytes says what is wrong
        return seen["bytes"]


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
    # Log-probabilities let a comparison tell a bf16 tie broken the other way from wrong KV.
    return {
        "model": cluster.model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        **LOGPROB_FIELDS,
        **extra,
    }


async def run_all(cluster: Cluster, jobs: list[tuple[str, dict[str, Any], str]]) -> list[dict[str, Any]]:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(complete(session, url, b, rid) for url, b, rid in jobs))


def text_of(result: dict[str, Any]) -> str | None:
    """The completion's text if it succeeded, else None."""
    if result["status"] != 200:
        return None
    if "text" in result:
        return None if result["error"] is not None or not result["done"] else str(result["text"])
    return str(result["body"]["choices"][0]["text"])


def greedy_of(result: dict[str, Any]) -> Greedy | None:
    """The completion's tokens and log-probabilities if it succeeded, else None."""
    if text_of(result) is None:
        return None
    if "choices" in result:
        return from_chunks(result["choices"])
    return from_choice(result["body"]["choices"][0])


def agree(result: dict[str, Any], want: Greedy | None) -> str | None:
    """Why ``result`` does not carry ``want``'s tokens (a tie broken the other way excepted)."""
    got = greedy_of(result)
    if got is None or want is None:
        return f"no completion: {result if got is None else 'no reference'}"
    return disagreement(got, want)


def router_health(cluster: Cluster) -> dict[str, Any]:
    async def get() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(f"{cluster.router.url}/health") as resp:
            result: dict[str, Any] = await resp.json()
            return result

    return asyncio.run(get())


def assert_noise_changes_the_output(cluster: Cluster) -> None:
    """Negative control: P pushes noise for a debug id; the comparison every test uses catches
    it for each of a few prompts (so a match elsewhere is not vacuous)."""
    prompts = [prompt_of(h, 50 + i) for i, h in enumerate([150, 300, 500])]
    changed = 0
    for i, prompt in enumerate(prompts):
        rid = f"pushactors-debug-noise-{i}-{uuid.uuid4().hex[:6]}"  # P pushes noise for this id
        # The noise lands in both engines' prefix caches: a salt keeps it from later prompts
        # that share this prefix (prompt_of repeats every 10 seeds).
        salt = f"noise-{rid}"
        p_body = {
            **body(cluster, prompt, cache_salt=salt),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        (p_resp,) = asyncio.run(run_all(cluster, [(cluster.p.url, p_body, rid)]))
        assert p_resp["status"] == 200, p_resp
        params = p_resp["body"]["kv_transfer_params"]
        (d_resp,) = asyncio.run(
            run_all(
                cluster,
                [(cluster.d.url, {**body(cluster, prompt, cache_salt=salt), "kv_transfer_params": params}, rid)],
            )
        )
        (ref,) = asyncio.run(
            run_all(cluster, [(cluster.d.url, body(cluster, prompt, cache_salt=f"n-{rid}"), f"n-{rid}")])
        )
        assert d_resp["status"] == 200, d_resp
        assert cluster.pushed_bytes(rid) > 0
        # Noise is caught by the comparison every other test uses, tie tolerance and all.
        changed += agree(d_resp, greedy_of(ref)) is not None
    assert changed == len(prompts)
