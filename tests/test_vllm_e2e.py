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
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from vllm_cluster import (
    Cluster,
    agree,
    assert_noise_changes_the_output,
    body,
    complete,
    greedy_of,
    prompt_of,
    router_health,
    run_all,
    text_of,
)

from pushactors.testing import wait_until
from pushactors.testing.greedy import Greedy
from pushactors.testing.ports import free_port
from pushactors.testing.vllm_servers import (
    TINY_BLOCK,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    metric_value,
    vllm_python_or_skip,
    wait_healthy,
)

VLLM_PY = vllm_python_or_skip()

aiohttp = pytest.importorskip("aiohttp")

BLOCK, LAYERS, BLOCK_BYTES = TINY_BLOCK, TINY_LAYERS, TINY_BLOCK_BYTES  # the tiny model on vLLM CPU


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
        assert agree(got, greedy_of(want)) is None, (rid, agree(got, greedy_of(want)))
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


def log_tool(*args: str) -> Any:
    """Run ``pushactors <args> --json`` as a user would and decode its answer."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "pushactors", *args, "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else None


def test_the_log_tools_follow_a_request_through_router_p_and_d(cluster: Cluster) -> None:
    # vLLM's ids are "cmpl-<client id>-0-<8 hex>", one per engine; the router logs the client's
    # X-Request-Id beside the transfer id it minted. `pushactors logs --trace <client id>` must
    # find both engines' ids and every stage; `pushactors top` must see both ranks.
    rid = f"logs-{uuid.uuid4().hex[:6]}"
    (got,) = asyncio.run(run_all(cluster, [(cluster.router.url, body(cluster, prompt_of(150, 7)), rid)]))
    assert got["status"] == 200, got
    logs = str(cluster.root / "logs")
    seen: dict[str, Any] = {}

    def landed() -> bool:
        seen["trace"] = log_tool("logs", logs, "--trace", rid)
        return bool(seen["trace"]) and seen["trace"]["outcome"] == "landed"

    wait_until(landed, timeout=30, interval=0.5, what="the trace to show the request landed")
    trace = seen["trace"]
    assert len([i for i in trace["ids"] if i.startswith(f"cmpl-{rid}-")]) == 2, trace["ids"]
    assert [s["name"] for s in trace["stages"]] == ["registration", "match", "post", "settle", "notify"]
    assert all(s["duration_ms"] is not None for s in trace["stages"]), trace["stages"]
    top = log_tool("top", logs, "--once")
    ranks = {r["rank"]: r for r in top["ranks"]}
    assert {"prefill-0/pp0/tp0", "decode-0/pp0/tp0"} <= set(ranks), list(ranks)
    assert ranks["decode-0/pp0/tp0"]["landed"] >= 1 and ranks["prefill-0/pp0/tp0"]["pushed"] >= 1


async def toy_sequential_proxy(session: Any, cluster: Cluster, payload: dict[str, Any], rid: str) -> dict[str, Any]:
    """What vLLM's disaggregated-serving example proxy does, with no knowledge of pushactors:
    the prefill leg asks P to keep its KV for a remote decode (pull-connector fields, all None),
    then P's returned ``kv_transfer_params`` go to D verbatim."""
    prefill = {
        **payload,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    headers = {"X-Request-Id": rid}
    async with session.post(f"{cluster.p.url}/v1/completions", json=prefill, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        params = (await resp.json())["kv_transfer_params"]
    decode = {**payload, "kv_transfer_params": params}
    async with session.post(f"{cluster.d.url}/v1/completions", json=decode, headers=headers) as resp:
        text = await resp.text()
        return {"status": resp.status, "body": json.loads(text) if text.startswith("{") else text, "params": params}


def test_a_sequential_proxy_built_for_vllms_pull_connectors_works_unchanged(cluster: Cluster) -> None:
    # A fresh first word: no block of these prompts is in D's own prefix cache from earlier tests
    # (a local hit would leave tokens that did not come by push).
    prompts = [f"toy{uuid.uuid4().hex[:8]} " + prompt_of(h, 700 + i) for i, h in enumerate([50, 200, 380])]
    before = cluster.d.metrics()

    async def run() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(
                *(toy_sequential_proxy(session, cluster, body(cluster, p), f"toy-{i}") for i, p in enumerate(prompts))
            )

    got = asyncio.run(run())
    assert_own_tokens(got, references(cluster, prompts))
    for r in got:  # P named itself in the fields a pull connector's proxy copies
        assert r["params"]["do_remote_prefill"] and r["params"]["remote_engine_id"] == "prefill-0", r["params"]
    hits = metric_value(cluster.d.metrics(), "vllm:external_prefix_cache_hits_total") - metric_value(
        before, "vllm:external_prefix_cache_hits_total"
    )
    assert hits == sum(r["body"]["usage"]["prompt_tokens"] for r in got)  # every prompt token came by push


def test_prefix_hit_on_decode_pushes_only_the_suffix(cluster: Cluster) -> None:
    prompt = prompt_of(420, 99)
    first, second = f"pfx-a-{uuid.uuid4().hex[:6]}", f"pfx-b-{uuid.uuid4().hex[:6]}"
    (r1,) = asyncio.run(run_all(cluster, [(cluster.router.url, body(cluster, prompt), first)]))
    (r2,) = asyncio.run(run_all(cluster, [(cluster.router.url, body(cluster, prompt), second)]))
    (ref,) = asyncio.run(run_all(cluster, [(cluster.d.url, body(cluster, prompt, cache_salt="pfx-ref"), "pfx-ref")]))
    n = r1["body"]["usage"]["prompt_tokens"]
    assert_own_tokens([r1, r2], [greedy_of(ref)] * 2)
    assert cluster.pushed_bytes(first) == math.ceil(n / BLOCK) * LAYERS * BLOCK_BYTES
    # D kept the full blocks of the first push cached; only what it lacks is pushed, taken
    # from the END of P's blocks.
    cached_blocks = (n - 1) // BLOCK
    assert cluster.pushed_bytes(second) == (math.ceil(n / BLOCK) - cached_blocks) * LAYERS * BLOCK_BYTES


def test_corrupted_push_changes_the_output(cluster: Cluster) -> None:
    """Negative control: the match above is not vacuous."""
    assert_noise_changes_the_output(cluster)


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
    t0 = time.monotonic()
    (resp,) = asyncio.run(
        run_all(cluster, [(cluster.d.url, {**body(cluster, prompt), "kv_transfer_params": params}, "ghost-1")])
    )
    assert resp["status"] != 200
    assert time.monotonic() - t0 < 60  # the registration timeout is 120 s: this failed on the handshake


# --- the router against clients that retry, leave, or outlive P ---------------------------------


async def stream_complete(session: Any, url: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
    """A streaming request, read to its end: its text, the error event if any, and [DONE]."""
    async with session.post(
        f"{url}/v1/completions", json={**body, "stream": True}, headers={"X-Request-Id": rid}
    ) as resp:
        raw = (await resp.read()).decode()
        if not resp.content_type.startswith("text/event-stream"):
            return {"status": resp.status, "body": json.loads(raw) if raw.startswith("{") else raw}
    events = [b[len("data: ") :] for b in raw.split("\n\n") if b.startswith("data: ")]
    done = bool(events) and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    errors = [c["error"] for c in chunks if "error" in c]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    text = "".join(c["text"] for c in choices)
    error = errors[0] if errors else None
    return {"status": resp.status, "text": text, "error": error, "done": done, "choices": choices}


def fresh_prompt(tokens_hint: int, seed: int) -> str:
    """A prompt no earlier request shares a block with (a unique first word)."""
    return f"{uuid.uuid4().hex[:8]} {prompt_of(tokens_hint, seed)}"


def assert_own_tokens(results: list[dict[str, Any]], want: list[Greedy | None]) -> None:
    """Each result has its own prompt's tokens: D's greedy tokens with local prefill."""
    pairs = enumerate(zip(results, want, strict=True))
    wrong = [(r.get("rid", i), why, greedy_of(r)) for i, (r, w) in pairs if (why := agree(r, w))]
    assert not wrong, wrong


def references(cluster: Cluster, prompts: list[str], **extra: Any) -> list[Greedy | None]:
    """D's tokens with local prefill (``cache_salt`` keeps D's own cache out of it)."""
    tag = uuid.uuid4().hex[:6]
    jobs = [
        (cluster.d.url, body(cluster, p, cache_salt=f"ref-{tag}-{i}", **extra), f"ref-{tag}-{i}")
        for i, p in enumerate(prompts)
    ]
    out = asyncio.run(run_all(cluster, jobs))
    assert all(r["status"] == 200 for r in out), out
    return [greedy_of(r) for r in out]


def test_concurrent_requests_sharing_one_request_id_get_their_own_tokens(cluster: Cluster) -> None:
    """A client that reuses its X-Request-Id: the router's transfer ids keep the requests apart."""
    rid = f"shared-{uuid.uuid4().hex[:6]}"
    hints = [40, 130, 260, 90, 300, 170, 60, 220]
    prompts = [fresh_prompt(h, 200 + i) for i, h in enumerate(hints)]
    remote = asyncio.run(run_all(cluster, [(cluster.router.url, body(cluster, p), rid) for p in prompts]))
    assert_own_tokens(remote, references(cluster, prompts))
    # Each prompt was pushed exactly once, whole.
    expected = sum(math.ceil(r["body"]["usage"]["prompt_tokens"] / BLOCK) * LAYERS * BLOCK_BYTES for r in remote)
    assert cluster.pushed_bytes(rid, pushes=len(prompts)) == expected


def test_a_retried_request_is_served_again_correctly(cluster: Cluster) -> None:
    """The same request (header and prompt) re-sent while the first copy runs, and after it ended."""
    rid = f"retry-{uuid.uuid4().hex[:6]}"
    prompt = fresh_prompt(250, 300)
    (want,) = references(cluster, [prompt])

    async def scenario() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            first = asyncio.create_task(complete(session, cluster.router.url, body(cluster, prompt), rid))
            again = asyncio.create_task(stream_complete(session, cluster.router.url, body(cluster, prompt), rid))
            both = await asyncio.gather(first, again)
            later = await complete(session, cluster.router.url, body(cluster, prompt), rid)
            return [*both, later]

    results = asyncio.run(scenario())
    assert_own_tokens(results, [want] * 3)


def test_client_disconnect_mid_stream_leaves_the_engines_serving(cluster: Cluster) -> None:
    """The router drops both legs (tests/test_router.py shows it); vLLM then aborts D's request.
    How many tokens D makes before the abort lands depends on CPU contention (a tiny model
    decodes 800 tokens in ~2 s), so only the aftermath is checked here."""
    rid = f"gone-{uuid.uuid4().hex[:6]}"
    before = router_health(cluster)

    async def leave_early() -> None:
        long = {**body(cluster, fresh_prompt(30, 400)), "max_tokens": 800, "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            resp = await session.post(f"{cluster.router.url}/v1/completions", json=long, headers={"X-Request-Id": rid})
            assert resp.status == 200
            assert (await resp.content.readany()).startswith(b"data: ")
            resp.close()  # the client goes away mid-stream

    asyncio.run(leave_early())
    wait_until(
        lambda: metric_value(cluster.d.metrics(), "vllm:num_requests_running") == 0,
        timeout=20,
        interval=0.2,
        what="D to stop the request its client left",
    )
    seen: dict[str, Any] = {}

    def router_finished() -> bool:
        seen.update(router_health(cluster))
        return seen["client_disconnects"] + seen["served"] != before["client_disconnects"] + before["served"]

    wait_until(router_finished, timeout=20, interval=0.1, what="the router to finish the request its client left")
    after = seen
    # Counted as a disconnect; as served only if D's whole stream reached the router in one
    # write before it saw the client go (a starved D API server merges its outputs).
    assert after["client_disconnects"] + after["served"] == before["client_disconnects"] + before["served"] + 1
    assert after["failed"] == before["failed"]
    assert cluster.p.healthy() and cluster.d.healthy()
    prompts = [fresh_prompt(h, 410 + i) for i, h in enumerate([80, 200])]
    remote = asyncio.run(
        run_all(cluster, [(cluster.router.url, body(cluster, p), f"{rid}-next-{i}") for i, p in enumerate(prompts)])
    )
    assert_own_tokens(remote, references(cluster, prompts))


def test_prefill_stalls_keep_every_request_its_own_tokens(cluster: Cluster) -> None:
    """P stops dead for up to 2.6 s at a time (SIGSTOP: a swapped-out or overloaded host) while
    eight clients keep sending. Pushes pile up behind each stall and land on D in bursts; every
    request still gets its own tokens. (This is the load under which CI saw a bf16 tie broken
    the other way: the comparison tells that apart from wrong KV.)"""
    results: list[dict[str, Any]] = []
    prompts: dict[str, str] = {}

    async def client(i: int, session: Any, stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            rid = f"stall-{i}-{n}-{uuid.uuid4().hex[:4]}"
            prompts[rid] = fresh_prompt(60 + 45 * i, 900 + 17 * i + n)
            call = stream_complete if i % 2 else complete
            results.append({**await call(session, cluster.router.url, body(cluster, prompts[rid]), rid), "rid": rid})
            n += 1

    async def scenario() -> None:
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            tasks = [asyncio.create_task(client(i, session, stop)) for i in range(8)]
            try:
                for cycle in range(8):
                    await asyncio.sleep(1.5)  # P runs: requests flow (a load pattern, not a wait)
                    os.killpg(cluster.p.proc.pid, signal.SIGSTOP)
                    await asyncio.sleep(0.5 + (cycle % 4) * 0.7)  # the stall itself
                    os.killpg(cluster.p.proc.pid, signal.SIGCONT)
            finally:
                os.killpg(cluster.p.proc.pid, signal.SIGCONT)
                stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)

    asyncio.run(scenario())
    assert len(results) >= 8 * 3, len(results)  # the clients kept going through the stalls
    assert all(text_of(r) is not None for r in results), [r for r in results if text_of(r) is None][:3]
    assert_own_tokens(results, references(cluster, [prompts[r["rid"]] for r in results]))
    assert cluster.p.healthy() and cluster.d.healthy()


@pytest.fixture
def p_restored(cluster: Cluster):
    """For a test that kills P: afterwards P runs again (same ports, same engine id)."""
    yield cluster
    if not cluster.p.alive() or not cluster.p.healthy():
        cluster.p.restart()
        wait_healthy([cluster.p], timeout=400)
        cluster.wait_routable()


KILL_BOUND = 10.0  # seconds from P's death until the router answers a client whose P leg broke
# A request whose P leg had already succeeded waits on D's core: D notices P gone when a
# notification to it fails (its next heartbeat, lease/6 = 5 s), finds its side channel refusing
# (the process is dead, nothing of it can still land) and fails the request at once. If D looks
# while the killed process is still going down (its port accepts, then drops the connection), it
# asks again within a second instead of sitting out the 45 s quarantine (CI saw that once).
CORE_BOUND = 5.0 + 10.0


def error_of(result: dict[str, Any]) -> dict[str, Any] | None:
    """The error a client got (status or event), None for a success."""
    if text_of(result) is not None:
        return None
    if "text" in result:
        return result["error"] or {"message": "stream ended without an error event"}
    err = result["body"].get("error") if isinstance(result["body"], dict) else None
    return err if isinstance(err, dict) else {"message": str(result["body"])}


def test_prefill_killed_with_requests_in_flight(p_restored: Cluster) -> None:
    cluster = p_restored
    workers = 8
    results: list[dict[str, Any]] = []
    prompts: dict[str, str] = {}
    killed_at: list[float] = []

    current: dict[int, float] = {}  # worker -> start of its request in flight

    async def worker(i: int, session: Any, stop: asyncio.Event, started: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            rid = f"kill-{i}-{n}-{uuid.uuid4().hex[:4]}"
            prompts[rid] = fresh_prompt(60 + 45 * i, 500 + 17 * i + n)
            call = stream_complete if i % 2 else complete
            t0 = current[i] = time.monotonic()
            r = await call(session, cluster.router.url, body(cluster, prompts[rid]), rid)
            results.append({**r, "rid": rid, "start": t0, "end": time.monotonic(), "stream": i % 2 == 1})
            started.set()
            n += 1

    async def scenario() -> None:
        stop = asyncio.Event()
        starts = [asyncio.Event() for _ in range(workers)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            tasks = [asyncio.create_task(worker(i, session, stop, starts[i])) for i in range(workers)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in starts)), 120)
            # Freeze P so that prefills pile up there, then kill it: it dies with P legs in
            # flight, next to requests whose push (or decode) was already under way.
            loop = asyncio.get_running_loop()
            frozen = time.monotonic()
            os.killpg(cluster.p.proc.pid, signal.SIGSTOP)
            # A request sent after the freeze has its P leg there for sure; the others may be
            # anywhere. (If every worker is already stuck on P, kill after a short while.)
            deadline = frozen + 3
            while not any(t > frozen for t in current.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # polling the workers under the deadline
            killed_at.append(time.monotonic())
            await loop.run_in_executor(None, cluster.p.kill)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)

    asyncio.run(scenario())
    t_kill = killed_at[0]
    in_flight = [r for r in results if r["start"] < t_kill < r["end"]]
    waited = {r["rid"]: round(r["end"] - t_kill, 2) for r in in_flight}
    errors = {r["rid"]: error_of(r) for r in in_flight}
    print("in flight at the kill:", {rid: (waited[rid], (errors[rid] or {}).get("message")) for rid in waited})
    for r in in_flight:  # answered: a status, or a stream that ends with an error event and [DONE]
        if r.get("stream") and r["status"] == 200:
            assert r["done"], r
    # With both legs sent at once, a request in flight fails by its P leg (the router sees P
    # go) or by its decode leg (D's push from the dead P fails first): either way visibly.
    failed = [rid for rid, err in errors.items() if err is not None]
    assert failed, "the kill hit no request in flight"
    by_router = [rid for rid in failed if errors[rid].get("leg") == "prefill"]
    assert all(waited[rid] < KILL_BOUND for rid in by_router), (waited, errors)
    assert all(w < CORE_BOUND for w in waited.values()), (waited, errors)
    # Every success, before or across the kill, has exactly its own tokens.
    ok = [r for r in results if text_of(r) is not None]
    assert_own_tokens(ok, references(cluster, [prompts[r["rid"]] for r in ok]))
    # D stays healthy; without P the router fails fast, with a reason.
    assert cluster.d.healthy()
    t0 = time.monotonic()
    (dead,) = asyncio.run(run_all(cluster, [(cluster.router.url, body(cluster, fresh_prompt(50, 600)), "p-dead")]))
    assert dead["status"] == 502 and "prefill failed" in dead["body"]["error"]["message"], dead
    assert time.monotonic() - t0 < 5
    # P again, same engine id and ports: the requests after its restart are correct.
    cluster.p.restart()
    wait_healthy([cluster.p], timeout=400)
    after = [fresh_prompt(h, 620 + i) for i, h in enumerate([70, 150, 260, 330])]
    want = references(cluster, after)
    (first,) = asyncio.run(run_all(cluster, [(cluster.router.url, body(cluster, after[0]), "after-restart-0")]))
    # D still held the dead P's NIXL agent: its PUSH_REG through it fails with "remote
    # disconnected", and D resends it to P's next incarnation after a fresh handshake.
    assert agree(first, want[0]) is None, (first, agree(first, want[0]))
    rest = asyncio.run(
        run_all(
            cluster, [(cluster.router.url, body(cluster, p), f"after-restart-{i + 1}") for i, p in enumerate(after[1:])]
        )
    )
    assert_own_tokens(rest, want[1:])
