"""llm-d's routing sidecar in front of real vLLM engines (CPU) with the pushactors connector.

:class:`LlmdSidecar` sends what llm-d's P/D sidecar sends in its NIXL push mode
(llm-d/llm-d-router ``pkg/sidecar/proxy/connector_nixlv2.go`` and ``nixl_push_identity.go``,
``--kv-connector nixlv2``): while it knows no push identity for a P endpoint, a request goes
serially (P's leg, then D's leg with P's ``kv_transfer_params`` copied and the leg's
``transfer_id``), and the identity in P's answer is cached; later requests to that endpoint send
both legs at once, D's carrying the cached identity plus ``do_remote_prefill``,
``do_remote_decode: false``, ``remote_request_id`` and the ``transfer_id`` P's leg carries. D's
answer counts only once P answered with that same identity; otherwise D's leg is cancelled and
sent again with P's answer. Checks: D's tokens equal D's tokens with local prefill, every prompt
token came by push, P's answers carry the identity the sidecar caches.

Needs a vLLM environment: ``PUSHACTORS_VLLM_PYTHON`` (``.ci/test`` builds ``.venv-vllm``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pushactors.integrations.transfer_params import push_identity
from pushactors.testing import wait_until
from pushactors.testing.greedy import LOGPROB_FIELDS, Greedy, disagreement, from_choice, from_chunks
from pushactors.testing.ports import free_port
from pushactors.testing.vllm_servers import (
    PUSHACTORS_CONNECTOR,
    TINY_BLOCK,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    ServerSpec,
    VllmServer,
    build_tiny_model,
    metric_value,
    vllm_python_or_skip,
    wait_healthy,
)

VLLM_PY = vllm_python_or_skip()

aiohttp = pytest.importorskip("aiohttp")

BLOCK, LAYERS, BLOCK_BYTES = TINY_BLOCK, TINY_LAYERS, TINY_BLOCK_BYTES  # the tiny model on vLLM CPU
STREAM = {"stream": True, "stream_options": {"include_usage": True}}  # P's leg goes without both
PREFILL_TIMEOUT = 120.0  # the sidecar's NIXL push prefill timeout, generous for 2 cores


# --- the sidecar ------------------------------------------------------------------------------
@dataclass
class Dispatch:
    """What the sidecar sent for one client request, and when."""

    request_id: str
    mode: str  # "serial" or "parallel"
    prefill_leg: dict[str, Any]  # the kv_transfer_params sent to P
    decode_legs: list[Any] = field(default_factory=list)  # those sent to D (two when resent)
    prefill_answer: Any = None  # the kv_transfer_params of P's answer
    prefill_sent: float = 0.0
    prefill_answered: float = 0.0
    decode_sent: float = 0.0  # the first decode leg
    resent: bool = False


def llmd_identity(kv: Any) -> dict[str, Any] | None:
    """extractNIXLPushIdentity: the library's push_identity is that function, field for field."""
    return push_identity(kv)


class LlmdSidecar:
    """llm-d's P/D sidecar (NIXL push mode) for one P endpoint and the local D, as HTTP calls.

    Per client request: a request id (a UUID, sent to both legs as ``X-Request-Id``) and a
    transfer id ``xfer-<UUID>``. P's leg is the client's body with ``kv_transfer_params`` =
    ``{do_remote_decode: true, do_remote_prefill: false, remote_engine_id/remote_block_ids/
    remote_host/remote_port: null, transfer_id}``, ``max_tokens`` 1 (chat: and
    ``max_completion_tokens``), no ``min_tokens``, ``stream: false``, no ``stream_options``. D's
    leg is the client's body unchanged except its ``kv_transfer_params``."""

    def __init__(self, session: Any, prefill_url: str, decode_url: str) -> None:
        self.session = session
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.endpoint = prefill_url.split("://", 1)[1]  # the cache key: P's host:port
        self.identities: dict[str, dict[str, Any]] = {}
        self.dispatches: list[Dispatch] = []

    async def complete(self, body: dict[str, Any], path: str = "/v1/completions") -> dict[str, Any]:
        rid = str(uuid.uuid1())
        tid = f"xfer-{uuid.uuid4()}"
        identity = self.identities.get(self.endpoint)
        dispatch = Dispatch(rid, "parallel" if identity else "serial", prefill_leg={})
        self.dispatches.append(dispatch)
        prefill = self.prefill_body(body, tid, chat=path.endswith("/chat/completions"))
        dispatch.prefill_leg = prefill["kv_transfer_params"]
        if identity is None:
            return await self.serial(body, prefill, path, rid, tid, dispatch)
        return await self.parallel(body, prefill, path, rid, tid, identity, dispatch)

    @staticmethod
    def prefill_body(body: dict[str, Any], tid: str, *, chat: bool) -> dict[str, Any]:
        out = copy.deepcopy(body)
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            "transfer_id": tid,
        }
        out["max_tokens"] = 1  # CapSingleToken
        if chat:
            out["max_completion_tokens"] = 1
        out.pop("min_tokens", None)
        out["stream"] = False
        out.pop("stream_options", None)
        return out

    def store(self, kv: Any) -> dict[str, Any] | None:
        """storeNIXLPushIdentity: cache the identity of P's answer, or forget the endpoint's."""
        identity = llmd_identity(kv)
        if identity is None:
            self.identities.pop(self.endpoint, None)
        else:
            self.identities[self.endpoint] = dict(identity)
        return identity

    def drop_if_matches(self, identity: dict[str, Any]) -> None:
        if self.identities.get(self.endpoint) == identity:
            del self.identities[self.endpoint]

    async def prefill(self, body: dict[str, Any], path: str, rid: str, dispatch: Dispatch) -> dict[str, Any]:
        dispatch.prefill_sent = time.monotonic()
        answer = await post(self.session, self.prefill_url + path, body, rid)
        dispatch.prefill_answered = time.monotonic()
        return answer

    async def decode(self, body: dict[str, Any], kv: Any, path: str, rid: str, dispatch: Dispatch) -> dict[str, Any]:
        dispatch.decode_legs.append(kv)
        dispatch.decode_sent = dispatch.decode_sent or time.monotonic()
        return await post(self.session, self.decode_url + path, {**copy.deepcopy(body), "kv_transfer_params": kv}, rid)

    async def serial(
        self, body: dict[str, Any], prefill: dict[str, Any], path: str, rid: str, tid: str, dispatch: Dispatch
    ) -> dict[str, Any]:
        answer = await self.prefill(prefill, path, rid, dispatch)
        if answer["status"] >= 400:
            return answer  # P's error goes to the client as it is
        kv = answer["body"].get("kv_transfer_params")
        dispatch.prefill_answer = copy.deepcopy(kv)
        self.store(kv)
        if isinstance(kv, dict):
            kv = {**kv, "transfer_id": tid}  # P's answer carries no transfer_id it can rely on
        return await self.decode(body, kv, path, rid, dispatch)

    async def parallel(
        self,
        body: dict[str, Any],
        prefill: dict[str, Any],
        path: str,
        rid: str,
        tid: str,
        identity: dict[str, Any],
        dispatch: Dispatch,
    ) -> dict[str, Any]:
        # D sets remote_block_ids itself: neither it nor remote_num_tokens is sent.
        kv = {**identity, "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": rid}
        kv["transfer_id"] = tid
        p_task = asyncio.ensure_future(self.prefill(prefill, path, rid, dispatch))
        d_task = asyncio.ensure_future(self.decode(body, kv, path, rid, dispatch))
        done, _ = await asyncio.wait({p_task, d_task}, timeout=PREFILL_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        if p_task not in done and d_task in done and d_task.result()["status"] >= 400:
            # Decode failed before prefill answered: cancel prefill, D's error to the client.
            await cancel(p_task)
            self.drop_if_matches(identity)
            return d_task.result()
        try:
            answer = await asyncio.wait_for(asyncio.shield(p_task), PREFILL_TIMEOUT)
        except asyncio.TimeoutError:
            await cancel(p_task, d_task)
            self.drop_if_matches(identity)
            return {"status": 504, "body": {"error": "prefill did not respond within the NIXL push prefill timeout"}}
        if answer["status"] >= 400:
            await cancel(d_task)  # cancelling decode also frees its blocks on D
            self.drop_if_matches(identity)
            return answer
        kv_answer = answer["body"].get("kv_transfer_params")
        dispatch.prefill_answer = copy.deepcopy(kv_answer)
        if self.store(kv_answer) != identity:
            # D registered with an engine that did not run this prefill: send D again with
            # P's answer, as the serial path would.
            await cancel(d_task)
            dispatch.resent = True
            resent = {**kv_answer, "transfer_id": tid} if isinstance(kv_answer, dict) else kv_answer
            return await self.decode(body, resent, path, rid, dispatch)
        result = await d_task
        if result["status"] >= 400:
            self.drop_if_matches(identity)
        return result


async def cancel(*tasks: asyncio.Future[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def post(session: Any, url: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
    """One leg; a streamed answer is read to its end (its events, the text, [DONE])."""
    async with session.post(url, json=body, headers={"X-Request-Id": rid}) as resp:
        raw = (await resp.read()).decode()
        if not resp.content_type.startswith("text/event-stream"):
            return {"status": resp.status, "body": json.loads(raw) if raw.startswith("{") else raw}
    events = [b[len("data: ") :] for b in raw.split("\n\n") if b.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    return {
        "status": resp.status,
        "done": bool(events) and events[-1] == "[DONE]",
        "errors": [c["error"] for c in chunks if "error" in c],
        "choices": choices,
        "usage": usage,
    }


# --- the engines ------------------------------------------------------------------------------
class Engines:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = str(build_tiny_model(VLLM_PY or "", root / "model"))
        self.p_side, self.d_side = free_port(), free_port()
        self.logs = root / "logs"

        def kv(role: str, engine: str, side: int) -> dict[str, Any]:
            return {
                **PUSHACTORS_CONNECTOR,
                "kv_role": role,
                "kv_buffer_device": "cpu",
                "engine_id": engine,
                "kv_connector_extra_config": {
                    "side_channel_port": side,
                    "log_json": str(self.logs / f"{engine}.jsonl"),
                    "handshake_timeout": 20.0,
                    "registration_timeout": 120.0,
                },
            }

        env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        self.p = VllmServer(
            VLLM_PY or "",
            self.model,
            ServerSpec("prefill", free_port(), kv("kv_producer", "prefill-0", self.p_side), "0", env),
            self.logs,
        )
        self.d = VllmServer(
            VLLM_PY or "",
            self.model,
            ServerSpec("decode", free_port(), kv("kv_consumer", "decode-0", self.d_side), "1", env),
            self.logs,
        )

    def stop(self) -> None:
        for proc in (self.p, self.d):
            proc.stop()

    def events(self, engine: str, name: str) -> list[dict[str, Any]]:
        """``name`` events of ``engine``'s connector so far (its scheduler's and workers' logs)."""
        out: list[dict[str, Any]] = []
        for path in self.logs.glob(f"{engine}.*.jsonl"):
            for line in path.read_text().splitlines():
                if line.strip():
                    event = json.loads(line)
                    if event.get("event") == name:
                        out.append(event)
        return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    e = Engines(tmp_path_factory.mktemp("llmd"))
    try:
        wait_healthy([e.p, e.d], timeout=400)
        yield e
    except BaseException:
        for proc in (e.p, e.d):
            print(f"--- {proc.name} ---\n{proc.tail(60)}")
        raise
    finally:
        e.stop()


def prompt_of(tokens_hint: int, seed: int) -> str:
    """A prompt no earlier request shares a block with (a unique first word)."""
    words = ["alpha", "beta", "gamma", "delta", "cache", "block", "push", "decode", "prefill", "rank"]
    rest = " ".join(words[(seed * 7 + i * 3) % len(words)] + str((seed + i) % 10) for i in range(tokens_hint // 3))
    return f"{uuid.uuid4().hex[:8]} {rest}"


def body(engines: Engines, prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": engines.model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        **LOGPROB_FIELDS,
        **extra,
    }


def greedy_of(result: dict[str, Any]) -> Greedy | None:
    if result["status"] != 200:
        return None
    if "choices" in result:  # streamed
        return from_chunks(result["choices"]) if result["done"] and not result["errors"] else None
    return from_choice(result["body"]["choices"][0])


def prompt_tokens(result: dict[str, Any]) -> int:
    usage = result["usage"] if "choices" in result else result["body"]["usage"]
    return int(usage["prompt_tokens"])


async def with_session(run: Any) -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await run(session)


def references(engines: Engines, prompts: list[str]) -> list[Greedy | None]:
    """D's tokens with local prefill (``cache_salt`` keeps D's own cache out of it)."""
    tag = uuid.uuid4().hex[:6]

    async def run(session: Any) -> list[dict[str, Any]]:
        return await asyncio.gather(
            *(
                post(session, f"{engines.d.url}/v1/completions", body(engines, p, cache_salt=f"ref-{tag}-{i}"), f"r{i}")
                for i, p in enumerate(prompts)
            )
        )

    out = asyncio.run(with_session(run))
    assert all(r["status"] == 200 for r in out), out
    return [greedy_of(r) for r in out]


def assert_own_tokens(results: list[dict[str, Any]], want: list[Greedy | None]) -> None:
    wrong = []
    for i, (got, ref) in enumerate(zip(results, want, strict=True)):
        g = greedy_of(got)
        why = "no completion" if g is None or ref is None else disagreement(g, ref)
        if why:
            wrong.append((i, why, got if g is None else g.text))
    assert not wrong, wrong


def expected_identity(engines: Engines) -> dict[str, Any]:
    return {
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": engines.p_side,
        "tp_size": 1,
        "transfer_mode": "push",
        "pp_size": 1,
    }


def test_first_request_serial_then_both_legs_at_once(engines: Engines) -> None:
    """The sidecar's own sequence: one request alone (it learns P's identity from the answer),
    then concurrent requests, each sending P's and D's legs at the same time."""
    first = prompt_of(150, 1)
    later = [prompt_of(h, 10 + i) for i, h in enumerate([40, 130, 260, 90, 300, 200])]
    before = engines.d.metrics()

    async def run(session: Any) -> tuple[Any, list[Any], LlmdSidecar]:
        sidecar = LlmdSidecar(session, engines.p.url, engines.d.url)
        one = await sidecar.complete(body(engines, first))
        rest = await asyncio.gather(
            *(sidecar.complete(body(engines, p, **(STREAM if i % 2 else {}))) for i, p in enumerate(later))
        )
        return one, list(rest), sidecar

    one, rest, sidecar = asyncio.run(with_session(run))
    after = engines.d.metrics()
    results = [one, *rest]
    assert_own_tokens(results, references(engines, [first, *later]))

    serial, *parallel = sidecar.dispatches
    # First request: P's answer named P's push identity; D got that answer and the leg's transfer id.
    assert serial.mode == "serial"
    assert push_identity(serial.prefill_answer) == expected_identity(engines), serial.prefill_answer
    assert serial.prefill_answer["transfer_id"] == serial.prefill_leg["transfer_id"]
    assert serial.decode_legs == [serial.prefill_answer]
    assert serial.decode_sent >= serial.prefill_answered
    # The others: both legs at once, D's from the cached identity alone; P answered alike.
    assert [d.mode for d in parallel] == ["parallel"] * len(later)
    for d in parallel:
        assert not d.resent, d
        (leg,) = d.decode_legs
        assert leg == {
            **expected_identity(engines),
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": d.request_id,
            "transfer_id": d.prefill_leg["transfer_id"],
        }
        assert d.decode_sent < d.prefill_answered  # D's leg went before P had answered
        assert push_identity(d.prefill_answer) == expected_identity(engines)
    assert sidecar.identities == {sidecar.endpoint: expected_identity(engines)}

    # Every prompt token came by push (none computed on D), and each prompt's blocks exactly once.
    n = [prompt_tokens(r) for r in results]
    hits = metric_value(after, "vllm:external_prefix_cache_hits_total") - metric_value(
        before, "vllm:external_prefix_cache_hits_total"
    )
    assert hits == sum(n)
    received = metric_value(after, "vllm:pushactors_bytes_received_total") - metric_value(
        before, "vllm:pushactors_bytes_received_total"
    )
    assert received == sum(math.ceil(k / BLOCK) * LAYERS * BLOCK_BYTES for k in n)


def test_a_stale_identity_is_answered_by_sending_decode_again(engines: Engines) -> None:
    """The sidecar cached an identity P no longer has (P came back on another side-channel
    port): D's first leg registers with a side channel that never answers, P answers with its
    real identity, the sidecar cancels D's leg and sends it again with P's answer. D serves the
    second leg from the push and aborts the abandoned one."""
    import zmq

    # A side channel that takes the handshake and never answers: D waits out its handshake
    # timeout (20 s) rather than failing at once, so P's answer comes first, as in the field. (A
    # plain TCP socket is not that: D's ZeroMQ client can give up on it before P answers.)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        stale = {**expected_identity(engines), "remote_port": silent_port}
        prompts = [prompt_of(220, 40), prompt_of(90, 41)]

        async def run(session: Any) -> tuple[list[Any], LlmdSidecar]:
            sidecar = LlmdSidecar(session, engines.p.url, engines.d.url)
            sidecar.identities[sidecar.endpoint] = dict(stale)
            first = await sidecar.complete(body(engines, prompts[0]))
            second = await sidecar.complete(body(engines, prompts[1]))
            return [first, second], sidecar

        results, sidecar = asyncio.run(with_session(run))
        assert_own_tokens(results, references(engines, prompts))
        resent, relearned = sidecar.dispatches
        assert resent.mode == "parallel" and resent.resent
        assert resent.decode_legs[0]["remote_port"] == stale["remote_port"]
        assert resent.decode_legs[1] == {**resent.prefill_answer, "transfer_id": resent.prefill_leg["transfer_id"]}
        assert relearned.mode == "parallel" and not relearned.resent  # the answer refreshed the cache
    finally:
        silent.close(linger=0)
        ctx.term()

    # D aborted the abandoned leg (its KV can no longer come) and left nothing running or waiting.
    # vLLM may also abort it before its scheduler ever handed it to the transport (P answered
    # first): then only the second leg was watched (or waited for the first, recv.deferred).
    def legs_of(event: str) -> set[str]:
        return {
            str(e["request_id"])
            for e in engines.events("decode-0", event)
            if resent.request_id in str(e.get("request_id"))
        }

    def abandoned_leg_settled() -> bool:
        staged = legs_of("recv.watching") | legs_of("recv.deferred")
        pushed = legs_of("recv.finished")  # the leg sent again was served by the push
        return len(pushed) == 1 and (len(staged) == 1 or (len(staged) == 2 and bool(legs_of("recv.aborted") & staged)))

    wait_until(abandoned_leg_settled, timeout=10, interval=0.1, what="D's log to show the cancelled leg aborted")
    wait_until(
        lambda: (
            metric_value(engines.d.metrics(), "vllm:num_requests_running") == 0
            and metric_value(engines.d.metrics(), "vllm:num_requests_waiting") == 0
        ),
        timeout=30,
        interval=0.2,
        what="D to let the cancelled decode leg go",
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [({"transfer_mode": "pull"}, "transfer_mode 'pull'"), ({"dcp_size": 2}, "dcp_size 2")],
)
def test_a_decode_leg_d_cannot_serve_fails_visibly_with_its_reason(
    engines: Engines, change: dict[str, Any], reason: str
) -> None:
    """A decode leg in the sidecar's shape asking for what a pushactors D cannot do fails that
    request (vLLM's default load-failure policy) with the reason in D's log; D keeps serving."""
    prompt = prompt_of(60, 50)
    rid = f"bad-{uuid.uuid4().hex[:8]}"
    leg = {
        **expected_identity(engines),
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_request_id": rid,
        "transfer_id": f"xfer-{uuid.uuid4()}",
        **change,
    }

    async def run(session: Any) -> dict[str, Any]:
        return await post(
            session, f"{engines.d.url}/v1/completions", {**body(engines, prompt), "kv_transfer_params": leg}, rid
        )

    t0 = time.monotonic()
    got = asyncio.run(with_session(run))
    assert got["status"] != 200, got
    assert time.monotonic() - t0 < 60  # refused at once, not at the registration timeout
    rejected: list[dict[str, Any]] = []

    def logged() -> bool:
        rejected[:] = [e for e in engines.events("decode-0", "recv.rejected") if rid in str(e.get("request_id"))]
        return bool(rejected)

    wait_until(logged, timeout=10, interval=0.1, what="D's log to say why it refused the leg")
    assert reason in rejected[0]["reason"], rejected

    async def next_one(session: Any) -> dict[str, Any]:
        sidecar = LlmdSidecar(session, engines.p.url, engines.d.url)
        return await sidecar.complete(body(engines, prompt))

    assert_own_tokens([asyncio.run(with_session(next_one))], references(engines, [prompt]))
