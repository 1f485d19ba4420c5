"""Real vLLM engines (CPU) serving a hybrid model through the push, with vLLM's hybrid allocator on.

The tiny random Llama of the other end-to-end tests, its second layer a sliding window of
``WINDOW`` tokens (``layer_types``): vLLM keeps a full-attention and a sliding-window KV cache
group, and frees the window's blocks behind it. Checks: D's tokens with remote prefill equal
D's own with local prefill, token for token; the hybrid allocator is on in both engines (their
logs); and P pushes every block of the full-attention layer but only the blocks D's window
reads of the sliding-window layer (P's mailbox log), all of the prompt counted as loaded by D.

The tiny Qwen3-Next (a gated delta net layer, then full attention): vLLM keeps a state-space
group beside the attention group. P stops one token short and pushes the attention blocks and
the one state block; D computes the last prompt token from P's state, token-exact against D's
own prefill, in mamba cache modes ``align`` (prefix caching on) and ``none``.

Needs a vLLM environment: ``PUSHACTORS_VLLM_PYTHON`` (``.ci/test`` builds ``.venv-vllm``).
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from env_kit import written_events
from vllm_cluster import Cluster, agree, assert_noise_changes_the_output, body, greedy_of, prompt_of, run_all

from pushactors.testing.vllm_servers import (
    TINY_BLOCK,
    metric_value,
    vllm_python_or_skip,
)

VLLM_PY = vllm_python_or_skip()

WINDOW = 100  # tokens; not a whole number of blocks
BLOCK_BYTES = 32768  # one layer's block of the tiny model on vLLM CPU (1 KV head of 64, bf16)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("vllm-hybrid")
    subprocess.run(
        [VLLM_PY or "", "-m", "pushactors.testing.tiny_model", str(root / "model"), "--sliding-window", str(WINDOW)],
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    c = Cluster(root)  # finds the model there and leaves it as it is
    try:
        c.start()
        yield c
    except BaseException:
        for proc in (c.p, c.d, c.router):
            print(f"--- {proc.name} ---\n{proc.tail(60)}")
        raise
    finally:
        c.stop()


def scheduler_ready(log: Path) -> list[dict[str, object]]:
    events = []
    for path in log.parent.glob(f"{log.stem}.scheduler.*.jsonl"):
        for event in written_events(path):
            if event.get("event") == "connector.scheduler_ready":
                events.append(event)
    return events


def window_blocks(tokens: int) -> int:
    """Blocks of the sliding-window layer D reads after a prompt of ``tokens``."""
    return math.ceil(tokens / TINY_BLOCK) - max(0, tokens - WINDOW + 1) // TINY_BLOCK


def test_hybrid_model_remote_prefill_matches_local_prefill(hybrid: Cluster) -> None:
    logs = hybrid.root / "logs"
    for engine in ("prefill", "decode"):
        (ready,) = scheduler_ready(logs / f"{engine}.jsonl")
        assert ready["hybrid_allocator"] is True, ready
        assert ready["kv_groups"] == f"full@{TINY_BLOCK}+sliding_window:{WINDOW}@{TINY_BLOCK}", ready
    for proc in (hybrid.p, hybrid.d):
        assert "Turning off hybrid kv cache manager" not in proc.log_path.read_text(errors="replace")

    hints = [3, 40, 90, 120, 200, 380, 700]
    prompts = [prompt_of(h, i + 50) for i, h in enumerate(hints)]
    rids = [f"hyb-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(prompts))]
    before = hybrid.d.metrics()
    remote = asyncio.run(
        run_all(hybrid, [(hybrid.router.url, body(hybrid, p), r) for p, r in zip(prompts, rids, strict=True)])
    )
    after = hybrid.d.metrics()
    local = asyncio.run(
        run_all(
            hybrid,
            [
                (hybrid.d.url, body(hybrid, p, cache_salt=f"ref-{r}"), f"ref-{r}")
                for p, r in zip(prompts, rids, strict=True)
            ],
        )
    )
    total_prompt = 0
    behind_the_window = 0
    for rid, got, want in zip(rids, remote, local, strict=True):
        assert got["status"] == 200, got
        assert want["status"] == 200, want
        assert agree(got, greedy_of(want)) is None, (rid, agree(got, greedy_of(want)))
        n = got["body"]["usage"]["prompt_tokens"]
        total_prompt += n
        full = math.ceil(n / TINY_BLOCK)
        behind_the_window += full - window_blocks(n)
        # Full attention: every block; the window: only the blocks D reads.
        assert hybrid.pushed_bytes(rid) == (full + window_blocks(n)) * BLOCK_BYTES, (rid, n)
    assert behind_the_window > 0  # some prompt left whole blocks behind the window
    hits = metric_value(after, "vllm:external_prefix_cache_hits_total") - metric_value(
        before, "vllm:external_prefix_cache_hits_total"
    )
    assert hits == total_prompt


def test_prefix_hit_on_decode_registers_past_it_in_each_group(hybrid: Cluster) -> None:
    """The same prompt twice: D's second request hits its own cache (every group must hold the
    hit, the window only its tail) and registers per group past it; tokens stay exact."""
    prompt = prompt_of(600, 77)
    first, second = f"hpfx-a-{uuid.uuid4().hex[:6]}", f"hpfx-b-{uuid.uuid4().hex[:6]}"
    (r1,) = asyncio.run(run_all(hybrid, [(hybrid.router.url, body(hybrid, prompt), first)]))
    before = hybrid.d.metrics()
    (r2,) = asyncio.run(run_all(hybrid, [(hybrid.router.url, body(hybrid, prompt), second)]))
    after = hybrid.d.metrics()
    (ref,) = asyncio.run(run_all(hybrid, [(hybrid.d.url, body(hybrid, prompt, cache_salt="hpfx-ref"), "hpfx-ref")]))
    for got in (r1, r2):
        assert got["status"] == 200, got
        assert agree(got, greedy_of(ref)) is None, agree(got, greedy_of(ref))
    n = r2["body"]["usage"]["prompt_tokens"]
    hit = metric_value(after, "vllm:prefix_cache_hits_total") - metric_value(before, "vllm:prefix_cache_hits_total")
    assert hit > 0 and hit % TINY_BLOCK == 0, hit  # the second request really hit D's cache
    total, cached = math.ceil(n / TINY_BLOCK), int(hit) // TINY_BLOCK
    behind = max(0, n - WINDOW + 1) // TINY_BLOCK
    assert hybrid.pushed_bytes(second) == ((total - cached) + (total - max(cached, behind))) * BLOCK_BYTES


def test_corrupted_push_changes_the_hybrid_output(hybrid: Cluster) -> None:
    """Negative control: P pushes noise into both groups' blocks, and D's output changes."""
    assert_noise_changes_the_output(hybrid)


@pytest.fixture(scope="module", params=["align", "none"])
def linear(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Qwen3-Next (gated delta net + full attention), P and D with the hybrid allocator,
    in vLLM's default mamba cache mode with prefix caching on (align: the state group's blocks
    are the attention's, 256 tokens) and with prefix caching off (none: one state block of the
    model length)."""
    root = tmp_path_factory.mktemp(f"vllm-linear-{request.param}")
    subprocess.run(
        [VLLM_PY or "", "-m", "pushactors.testing.tiny_model", str(root / "model"), "--linear-attention"],
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    c = Cluster(root, () if request.param == "align" else ("--no-enable-prefix-caching",))
    try:
        c.start()
        yield c
    except BaseException:
        for proc in (c.p, c.d, c.router):
            print(f"--- {proc.name} ---\n{proc.tail(60)}")
        raise
    finally:
        c.stop()


LINEAR_BLOCK = 256  # vLLM raises the attention block size so its page matches the state page
STATE_BYTES = 3 * 256 * 2 + 2 * 64 * 64 * 4  # conv state (bf16) + SSM state (fp32) of the GDN layer
LINEAR_BLOCK_BYTES = LINEAR_BLOCK * 2 * 64 * 2  # the full-attention layer's block: K|V of 1 head, bf16


def ids_body(cluster: Cluster, ids: list[int], **extra: Any) -> dict[str, Any]:
    """A completion request whose prompt is these token ids."""
    return {**body(cluster, "", **extra), "prompt": ids}


def test_linear_attention_hybrid_remote_prefill_matches_local_prefill(linear: Cluster) -> None:
    """P computes all but the last prompt token and pushes the full-attention blocks and the one
    state block; D computes the last prompt token from P's state. D's tokens equal its own with
    local prefill, and D counts all but one prompt token as loaded."""
    logs = linear.root / "logs"
    for engine in ("prefill", "decode"):
        (ready,) = scheduler_ready(logs / f"{engine}.jsonl")
        assert ready["hybrid_allocator"] is True, ready
        mode = "none" if "linear-none" in linear.root.name else "align"
        state_block = LINEAR_BLOCK if mode == "align" else 1024  # mode none: the model length
        assert ready["kv_groups"] == f"state:{mode}@{state_block}+full@{LINEAR_BLOCK}", ready
    # Prompts as token ids, so P's pushed tokens (all but the last) fall inside the first block,
    # one short of, at and one past a block edge, and in a third block: the state slot moves on.
    lengths = [2, 100, 256, 257, 258, 600]
    prompts = [[4 + (i * 31 + j * 7) % 500 for j in range(n)] for i, n in enumerate(lengths)]
    rids = [f"lin-{i}-{uuid.uuid4().hex[:6]}" for i in range(len(prompts))]
    before = linear.d.metrics()
    remote = asyncio.run(
        run_all(linear, [(linear.router.url, ids_body(linear, p), r) for p, r in zip(prompts, rids, strict=True)])
    )
    after = linear.d.metrics()
    local = asyncio.run(
        run_all(
            linear,
            [
                (linear.d.url, ids_body(linear, p, cache_salt=f"ref-{r}"), f"ref-{r}")
                for p, r in zip(prompts, rids, strict=True)
            ],
        )
    )
    loaded = 0
    sizes: list[int] = []
    for rid, got, want in zip(rids, remote, local, strict=True):
        assert got["status"] == 200, got
        assert want["status"] == 200, want
        assert agree(got, greedy_of(want)) is None, (rid, agree(got, greedy_of(want)))
        n = got["body"]["usage"]["prompt_tokens"]
        sizes.append(n)
        loaded += n - 1
        # The attention blocks of all but the last prompt token, and one state block.
        want = math.ceil((n - 1) / LINEAR_BLOCK) * LINEAR_BLOCK_BYTES + STATE_BYTES
        assert linear.pushed_bytes(rid) == want, (rid, n)
    assert sizes == lengths, sizes
    hits = metric_value(after, "vllm:external_prefix_cache_hits_total") - metric_value(
        before, "vllm:external_prefix_cache_hits_total"
    )
    assert hits == loaded


def test_corrupted_state_push_changes_the_linear_attention_output(linear: Cluster) -> None:
    """Negative control: P pushes noise into the state and attention blocks, and D's output changes."""
    assert_noise_changes_the_output(linear)
