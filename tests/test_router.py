"""The router against in-process fake P and D servers (aiohttp): ids, failures, disconnects.

Every fake upstream runs with handler cancellation, so a handler that is still running when the
router closes its connection sees ``CancelledError``: that is how a test observes that the router
really dropped a leg (vLLM aborts a request the same way).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

# aiohttp is a test dependency (setup.cfg): missing, this module fails to import, never skips.
import aiohttp
import pytest
from aiohttp import web

from pushactors.apps.router import EngineSpec, FleetConfig, PrefillIdentity, Router, RouterConfig
from pushactors.logs import capture_events

DEADLINE = 5.0  # seconds: every failure must reach the client well within this
Handler = Callable[["Upstream", web.Request], Awaitable[web.StreamResponse]]


class Upstream:
    """A fake vLLM server; ``handler`` decides what it answers."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[Any, dict[str, Any]]] = []
        self.cancelled = 0
        self.cancelled_event = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.healthy = True  # what its /health answers: 200, else 503

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.headers.copy(), await request.json()))
        try:
            return await self.handler(self, request)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancelled_event.set()
            raise

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.healthy else 503)

    async def start(self) -> Upstream:
        app = web.Application()
        app.router.add_post("/v1/completions", self._serve)
        app.router.add_get("/health", self._health)  # the router's health checks
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def wait_cancelled(self) -> None:
        await asyncio.wait_for(self.cancelled_event.wait(), DEADLINE)


async def forever(up: Upstream, request: web.Request) -> web.StreamResponse:
    await asyncio.Event().wait()  # until the router drops the leg
    raise AssertionError("unreachable")


def completion(text: str = "ok", **extra: Any) -> dict[str, Any]:
    return {"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": text}], **extra}


async def prefill_ok(up: Upstream, request: web.Request) -> web.StreamResponse:
    _, body = up.requests[-1]
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_request_id": "cmpl-p-0-abcdef12"}
    tid = body["kv_transfer_params"].get("transfer_id")
    if tid:
        params["transfer_id"] = tid
    return web.json_response(completion("x", kv_transfer_params=params))


async def decode_ok(up: Upstream, request: web.Request) -> web.StreamResponse:
    _, body = up.requests[-1]
    return web.json_response(completion(f"decoded:{body['prompt']}"))


def sse(payload: Any) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


async def open_sse(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await out.prepare(request)
    return out


async def decode_stream_ok(up: Upstream, request: web.Request) -> web.StreamResponse:
    out = await open_sse(request)
    for word in ("a", "b", "c"):
        await out.write(sse(completion(word)))
    await out.write(sse(b"[DONE]"))
    await out.write_eof()
    return out


class Rig:
    """Fake P and D behind a real router, all on 127.0.0.1 with ephemeral ports."""

    def __init__(
        self, prefill: Handler, decode: Handler, mode: str = "concurrent", fleet: FleetConfig | None = None
    ) -> None:
        self.p = Upstream(prefill)
        self.d = Upstream(decode)
        self.mode = mode
        self.fleet = fleet or FleetConfig()
        self.router: Router | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.session: aiohttp.ClientSession | None = None

    def config(self) -> RouterConfig:
        return RouterConfig(
            prefill_url=self.p.url,
            decode_url=self.d.url,
            mode=self.mode,
            prefill=PrefillIdentity("prefill-0", "127.0.0.1", 5600),
            timeout=30.0,
            fleet=self.fleet,
        )

    async def __aenter__(self) -> Rig:
        await self.p.start()
        await self.d.start()
        self.router = Router(self.config())
        self.runner = self.router.runner()
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None and self.runner is not None
        await self.session.close()
        await self.runner.cleanup()
        await self.p.stop()
        await self.d.stop()

    def post(self, body: dict[str, Any], rid: str | None = None) -> Any:
        assert self.session is not None
        headers = {"X-Request-Id": rid} if rid is not None else {}
        return self.session.post(f"{self.url}/v1/completions", json=body, headers=headers)

    async def call(self, body: dict[str, Any], rid: str | None = None) -> tuple[int, Any]:
        async with self.post(body, rid) as resp:
            text = await asyncio.wait_for(resp.text(), DEADLINE)
            return resp.status, json.loads(text) if resp.content_type == "application/json" else text

    async def health(self) -> dict[str, Any]:
        return (await self.health_status())[1]

    async def health_status(self) -> tuple[int, dict[str, Any]]:
        assert self.session is not None
        async with self.session.get(f"{self.url}/health") as resp:
            result: dict[str, Any] = await resp.json()
            return resp.status, result

    async def until_health(self, status: int, missing: list[str] | None = None) -> dict[str, Any]:
        """Poll the router's /health (its checks of the engines run on their own) until it
        answers ``status`` (naming exactly the roles ``missing``, if given), under DEADLINE."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE
        while True:
            got, body = await self.health_status()
            if got == status and (missing is None or sorted(body.get("missing", {})) == missing):
                return body
            assert loop.time() < deadline, f"/health still {got}, not {status}: {body}"
            await asyncio.sleep(0.01)  # polling, under the deadline above


def events_of(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def req(prompt: Any = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, **extra}


# ------------------------------------------------------------------------------------------------
def test_transfer_ids_are_minted_per_request_and_never_from_the_header() -> None:
    async def main() -> None:
        async with Rig(prefill_ok, decode_ok) as rig:
            with capture_events() as events:
                results = await asyncio.gather(
                    rig.call(req("one"), rid="retry-1"), rig.call(req("two"), rid="retry-1"), rig.call(req("three"))
                )
            assert [s for s, _ in results] == [200, 200, 200]
            assert sorted(b["choices"][0]["text"] for _, b in results) == [
                "decoded:one",
                "decoded:three",
                "decoded:two",
            ]
            p_tids = {b["prompt"]: b["kv_transfer_params"]["transfer_id"] for _, b in rig.p.requests}
            d_tids = {b["prompt"]: b["kv_transfer_params"]["transfer_id"] for _, b in rig.d.requests}
            assert p_tids == d_tids  # both legs of one request share one id ...
            assert len(set(p_tids.values())) == 3  # ... and no two requests do
            for tid in p_tids.values():
                assert tid.startswith("tx-") and len(tid) == 3 + 32 and "retry" not in tid
            # The client's id still reaches both engines (their logs), or a fresh one is made.
            p_rids = {b["prompt"]: h["X-Request-Id"] for h, b in rig.p.requests}
            d_rids = {b["prompt"]: h["X-Request-Id"] for h, b in rig.d.requests}
            assert p_rids == d_rids
            assert p_rids["one"] == p_rids["two"] == "retry-1"
            assert p_rids["three"] != "retry-1" and len(p_rids["three"]) == 32
            logged = {e["transfer_id"]: e["request_id"] for e in events.named("router.request")}
            assert logged == {p_tids[k]: p_rids[k] for k in p_tids}
            assert {e["outcome"] for e in events.named("router.request")} == {"served"}
            # P is asked for one token without streaming; D gets P's identity.
            _, p_body = rig.p.requests[0]
            assert p_body["max_tokens"] == 1 and p_body["stream"] is False
            assert p_body["kv_transfer_params"]["do_remote_decode"] is True
            _, d_body = rig.d.requests[0]
            assert d_body["kv_transfer_params"]["remote_engine_id"] == "prefill-0"
            assert d_body["kv_transfer_params"]["remote_port"] == 5600
            assert (await rig.health())["served"] == 3

    asyncio.run(main())


def test_multi_prompt_requests_carry_one_minted_transfer_id_keyed_per_prompt() -> None:
    """Several prompts share one minted transfer id, marked per prompt (each side keys a
    prompt's leg by it and the prompt's base id): the client's X-Request-Id is never the only
    key, so a retry reusing it cannot pair with the first attempt's KV."""

    async def main() -> None:
        async with Rig(prefill_ok, decode_ok) as rig:
            status, _ = await rig.call(req(["a", "b"]), rid="reused")
            assert status == 200
            status, _ = await rig.call(req(["a", "b"]), rid="reused")
            assert status == 200
            p_params = [r[1]["kv_transfer_params"] for r in rig.p.requests]
            d_params = [r[1]["kv_transfer_params"] for r in rig.d.requests]
            for pp, dp in zip(p_params, d_params, strict=True):
                assert pp["transfer_id"].startswith("tx-") and pp["transfer_id"] == dp["transfer_id"]
                assert pp["transfer_per_prompt"] is True and dp["transfer_per_prompt"] is True
            assert p_params[0]["transfer_id"] != p_params[1]["transfer_id"]
            status, _ = await rig.call(req("one prompt"))
            assert "transfer_per_prompt" not in rig.p.requests[-1][1]["kv_transfer_params"]

    asyncio.run(main())


def test_prefill_4xx_passes_through_and_cancels_decode() -> None:
    async def refuse(up: Upstream, request: web.Request) -> web.StreamResponse:
        err = {"message": "prompt too long", "type": "BadRequestError", "param": None, "code": 400}
        return web.json_response({"error": err}, status=400)

    async def main() -> None:
        async with Rig(refuse, forever) as rig:
            status, body = await rig.call(req(), rid="r-4xx")
            assert status == 400
            assert body["error"]["message"] == "prompt too long"
            assert body["error"]["type"] == "BadRequestError"
            assert body["error"]["transfer_id"].startswith("tx-")
            assert body["error"]["request_id"] == "r-4xx"
            await rig.d.wait_cancelled()
            health = await rig.health()
            assert health["failed"] == health["failed_prefill"] == 1

    asyncio.run(main())


@pytest.mark.parametrize("failure", ["500", "unreachable"])
def test_prefill_failure_before_the_stream_started_is_a_502(failure: str) -> None:
    async def broken(up: Upstream, request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "engine dead", "type": "InternalServerError"}}, status=500)

    async def waiting_stream(up: Upstream, request: web.Request) -> web.StreamResponse:
        await open_sse(request)  # headers only: D waits for the push
        return await forever(up, request)

    async def main() -> None:
        async with Rig(broken, waiting_stream) as rig:
            if failure == "unreachable":
                await rig.p.stop()  # connection refused
            status, body = await rig.call(req(stream=True))
            assert status == 502
            assert body["error"]["type"] == "prefill_error"
            assert body["error"]["transfer_id"].startswith("tx-")
            assert ("engine dead" if failure == "500" else "Connect") in body["error"]["message"]
            if failure == "500" or rig.d.requests:  # a refused P may beat D's leg to its server
                await rig.d.wait_cancelled()

    asyncio.run(main())


def test_prefill_death_after_the_stream_started_ends_it_with_an_error_event() -> None:
    async def main() -> None:
        sent = asyncio.Event()

        async def dies_later(up: Upstream, request: web.Request) -> web.StreamResponse:
            await sent.wait()
            assert request.transport is not None
            request.transport.close()  # like kill -9: no response at all
            return await forever(up, request)

        async def one_token_then_wait(up: Upstream, request: web.Request) -> web.StreamResponse:
            out = await open_sse(request)
            await out.write(sse(completion("a")))
            sent.set()
            return await forever(up, request)

        async with Rig(dies_later, one_token_then_wait) as rig:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with rig.post(req(stream=True)) as resp:
                assert resp.status == 200
                text = (await asyncio.wait_for(resp.read(), DEADLINE)).decode()
            assert loop.time() - t0 < DEADLINE
            events = events_of(text)
            assert events[0]["choices"][0]["text"] == "a"
            assert events[-1] == "[DONE]"
            err = events[-2]["error"]
            assert err["type"] == "prefill_error" and "prefill failed" in err["message"]
            assert err["transfer_id"] == rig.d.requests[0][1]["kv_transfer_params"]["transfer_id"]
            await rig.d.wait_cancelled()
            assert (await rig.health())["failed_prefill"] == 1

    asyncio.run(main())


def test_decode_dropping_mid_stream_ends_the_client_stream_with_an_error_event() -> None:
    async def drops(up: Upstream, request: web.Request) -> web.StreamResponse:
        out = await open_sse(request)
        await out.write(sse(completion("a")))
        await out.write(b'data: {"choices": [{"text": "half an ev')  # an event cut short
        assert request.transport is not None
        request.transport.close()
        return out

    async def main() -> None:
        async with Rig(prefill_ok, drops) as rig:
            async with rig.post(req(stream=True)) as resp:
                assert resp.status == 200
                text = (await asyncio.wait_for(resp.read(), DEADLINE)).decode()
            events = events_of(text)  # every event whole: the cut one never reaches the client
            assert len(events) == 3 and events[0]["choices"][0]["text"] == "a" and events[2] == "[DONE]"
            assert events[1]["error"]["type"] == "decode_error"
            assert "D's stream broke" in events[1]["error"]["message"]
            health = await rig.health()
            assert health["failed_decode"] == 1 and health["served"] == 0

    asyncio.run(main())


def test_decode_stream_without_done_is_an_error() -> None:
    async def ends_early(up: Upstream, request: web.Request) -> web.StreamResponse:
        out = await open_sse(request)
        await out.write(sse(completion("a")))
        await out.write_eof()
        return out

    async def main() -> None:
        async with Rig(prefill_ok, ends_early) as rig:
            async with rig.post(req(stream=True)) as resp:
                events = events_of((await asyncio.wait_for(resp.read(), DEADLINE)).decode())
            assert "before [DONE]" in events[1]["error"]["message"] and events[2] == "[DONE]"

    asyncio.run(main())


def test_streamed_decode_is_relayed_whole() -> None:
    async def main() -> None:
        async with Rig(prefill_ok, decode_stream_ok) as rig:
            async with rig.post(req(stream=True, stream_options={"include_usage": True})) as resp:
                assert resp.status == 200 and resp.content_type == "text/event-stream"
                events = events_of((await asyncio.wait_for(resp.read(), DEADLINE)).decode())
            assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b", "c"] and events[-1] == "[DONE]"
            assert "stream_options" not in rig.p.requests[0][1]
            assert (await rig.health())["served"] == 1

    asyncio.run(main())


def test_decode_5xx_names_the_transfer_and_keeps_ds_message() -> None:
    vllm_error = {
        "error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
    }

    async def fails(up: Upstream, request: web.Request) -> web.StreamResponse:
        return web.json_response(vllm_error, status=500)

    async def fails_in_stream(up: Upstream, request: web.Request) -> web.StreamResponse:
        # vLLM: a stream whose request failed is an error event and [DONE] (HTTP 200).
        out = await open_sse(request)
        tokens = 1 if up.requests[-1][1]["prompt"] == "late" else 0
        await out.write(sse(completion("a")) * tokens + sse(vllm_error) + sse(b"[DONE]"))
        await out.write_eof()
        return out

    async def main() -> None:
        async with Rig(prefill_ok, fails) as rig:
            status, body = await rig.call(req())
            assert status == 500
            err = body["error"]
            tid = rig.d.requests[0][1]["kv_transfer_params"]["transfer_id"]
            assert err["transfer_id"] == tid and tid in err["message"] and "may have failed" in err["message"]
            assert err["upstream_message"] == "Internal server error" and err["type"] == "InternalServerError"
        async with Rig(prefill_ok, fails_in_stream) as rig:
            # Failed before any token: nothing was sent, so the client gets D's status.
            status, body = await rig.call(req("early", stream=True))
            assert status == 500
            assert body["error"]["transfer_id"] in body["error"]["message"]
            # Failed after a token: the stream ends with the (annotated) error event.
            async with rig.post(req("late", stream=True)) as resp:
                assert resp.status == 200
                events = events_of((await asyncio.wait_for(resp.read(), DEADLINE)).decode())
            assert len(events) == 3 and events[0]["choices"][0]["text"] == "a" and events[-1] == "[DONE]"
            err = events[1]["error"]
            assert err["transfer_id"] in err["message"] and err["upstream_message"] == "Internal server error"
            assert (await rig.health())["failed_decode"] == 2

    asyncio.run(main())


def test_client_disconnect_mid_stream_cancels_both_legs() -> None:
    async def one_token_then_wait(up: Upstream, request: web.Request) -> web.StreamResponse:
        out = await open_sse(request)
        await out.write(sse(completion("a")))
        return await forever(up, request)

    async def main() -> None:
        async with Rig(forever, one_token_then_wait) as rig:
            with capture_events() as events:
                resp = await rig.post(req(stream=True))
                assert resp.status == 200
                assert b'"a"' in await asyncio.wait_for(resp.content.readany(), DEADLINE)
                resp.close()  # the client goes away mid-stream
                await rig.p.wait_cancelled()
                await rig.d.wait_cancelled()
                deadline = asyncio.get_running_loop().time() + DEADLINE
                while not events.named("router.request"):
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.01)  # polling, under a deadline, for the router's log line
            assert events.named("router.request")[0]["outcome"] == "client_disconnect"
            health = await rig.health()
            assert health["client_disconnects"] == 1 and health["failed"] == 0

    asyncio.run(main())


def test_client_disconnect_before_any_response_cancels_both_legs() -> None:
    async def main() -> None:
        async with Rig(forever, forever) as rig:
            task = asyncio.create_task(rig.call(req()))
            await asyncio.wait_for(asyncio.gather(wait_for_requests(rig.p), wait_for_requests(rig.d)), DEADLINE)
            task.cancel()  # the client gives up: its connection closes
            await asyncio.gather(task, return_exceptions=True)
            await rig.p.wait_cancelled()
            await rig.d.wait_cancelled()

    asyncio.run(main())


async def wait_for_requests(up: Upstream) -> None:
    while not up.requests:
        await asyncio.sleep(0.01)  # polling (under the caller's deadline) for the fake to be called


def test_decode_finishing_first_cancels_a_pending_prefill() -> None:
    async def main() -> None:
        async with Rig(forever, decode_ok) as rig:
            status, _ = await rig.call(req())
            assert status == 200
            await rig.p.wait_cancelled()

    asyncio.run(main())


def test_sequential_legs_hand_ps_params_to_d() -> None:
    async def main() -> None:
        async with Rig(prefill_ok, decode_ok, mode="sequential") as rig:
            status, body = await rig.call(req("seq"), rid="s-1")
            assert status == 200 and body["choices"][0]["text"] == "decoded:seq"
            _, p_body = rig.p.requests[0]
            tid = p_body["kv_transfer_params"]["transfer_id"]
            assert tid.startswith("tx-")
            _, d_body = rig.d.requests[0]
            assert d_body["kv_transfer_params"] == {
                "do_remote_prefill": True,
                "remote_engine_id": "prefill-0",
                "remote_request_id": "cmpl-p-0-abcdef12",
                "transfer_id": tid,
            }
            assert rig.d.requests[0][0]["X-Request-Id"] == "s-1"

    asyncio.run(main())


def test_sequential_prefill_failures() -> None:
    async def refuse(up: Upstream, request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "bad", "type": "BadRequestError", "code": 400}}, status=400)

    async def main() -> None:
        async with Rig(refuse, decode_ok, mode="sequential") as rig:
            status, body = await rig.call(req())
            assert status == 400 and body["error"]["message"] == "bad"
            assert not rig.d.requests  # D never asked
        async with Rig(prefill_ok, decode_ok, mode="sequential") as rig:
            await rig.p.stop()
            status, body = await rig.call(req())
            assert status == 502 and "prefill failed" in body["error"]["message"]
            assert not rig.d.requests
            assert (await rig.health())["failed_prefill"] == 1

    asyncio.run(main())


def test_bad_request_body() -> None:
    async def main() -> None:
        async with Rig(forever, forever) as rig:
            assert rig.session is not None
            async with rig.session.post(f"{rig.url}/v1/completions", data=b"[1]") as resp:
                assert resp.status == 400
            assert not rig.p.requests and not rig.d.requests

    asyncio.run(main())


def test_a_completion_of_several_prompts_is_keyed_per_prompt_whatever_else_it_carries() -> None:
    """Only the chat endpoint is one conversation: a completion with a stray "messages" field
    and several prompts still shares one transfer id per prompt (never one key for all)."""

    async def main() -> None:
        async with Rig(prefill_ok, decode_ok) as rig:
            status, _ = await rig.call(req(["alpha", "beta"], messages=None))
            assert status == 200
            assert rig.p.requests[0][1]["kv_transfer_params"]["transfer_per_prompt"] is True
            assert rig.d.requests[0][1]["kv_transfer_params"]["transfer_per_prompt"] is True

    asyncio.run(main())


def test_sequential_never_hands_d_the_clients_own_kv_transfer_params() -> None:
    """P answered without kv_transfer_params: D is never sent the client's (which could aim it
    at another request's transfer); the client gets a 502 naming the prefill leg."""

    async def bare_prefill(up: Upstream, request: web.Request) -> web.StreamResponse:
        return web.json_response(completion("x"))

    async def main() -> None:
        async with Rig(bare_prefill, decode_ok, mode="sequential") as rig:
            forged = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "transfer_id": "tx-victim"}
            status, body = await rig.call(req("hi", kv_transfer_params=forged))
            assert status == 502 and body["error"]["leg"] == "prefill"
            assert rig.d.requests == []

    asyncio.run(main())


@pytest.mark.parametrize("raw", [b"[" * 100_000, b"\xff\xfe{", b'{"prompt": "x"'])
def test_a_body_that_is_no_json_object_is_a_400_never_a_500(raw: bytes) -> None:
    async def main() -> None:
        async with Rig(prefill_ok, decode_ok) as rig:
            assert rig.session is not None
            async with rig.session.post(f"{rig.url}/v1/completions", data=raw) as resp:
                assert resp.status == 400
            assert rig.p.requests == [] and rig.d.requests == []

    asyncio.run(main())


@pytest.mark.parametrize(("n", "per_prompt"), [(2, True), (1, False), (True, False), ("3", False)])
def test_n_children_are_keyed_each_by_their_own_id(n: Any, per_prompt: bool) -> None:
    """vLLM runs n > 1 as n child requests (``<k>_<id>``) that share the kv_transfer_params: one
    key for all would fail them as ambiguous on P, so each is keyed by the transfer id and its
    own base id (both legs run n children)."""

    async def main() -> None:
        async with Rig(prefill_ok, decode_ok) as rig:
            await rig.call(req("hi", n=n))
            for up in (rig.p, rig.d):
                assert up.requests[0][1]["kv_transfer_params"].get("transfer_per_prompt", False) is per_prompt
            assert rig.p.requests[0][1].get("n") == n  # P runs the same children as D

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------
# /health: 200 only while the router can route
# ------------------------------------------------------------------------------------------------
# Checked every 50 ms, one failure takes an engine out, and a slow CI machine is no failure.
CHECKED = FleetConfig(health_interval=0.05, health_timeout=3.0, failure_threshold=1)


def test_health_is_503_naming_what_is_missing_until_the_router_can_route() -> None:
    """D fails its health checks from the start: the router's /health is 503 from its first
    answer (never 200 on engines no check has seen up), naming D as missing in the very words a
    request gets in its 503. Once a check sees D up it is 200 and a request is served; D down
    again, 503 again."""

    async def main() -> None:
        rig = Rig(prefill_ok, decode_ok, mode="sequential", fleet=CHECKED)
        rig.d.healthy = False
        async with rig:
            status, health = await rig.health_status()
            assert status == 503 and health["status"] == "unavailable", health
            assert list(health["missing"]) == ["decode"]
            assert health["missing"]["decode"].startswith("no decode engine available (1 configured:")
            assert health["decode_routable"] == 0 and health["prefill_routable"] == 1
            code, body = await rig.call(req())
            assert code == 503 and body["error"]["message"] == health["missing"]["decode"]
            assert not rig.p.requests and not rig.d.requests  # no P leg for a request no D can take
            rig.d.healthy = True
            health = await rig.until_health(200)
            assert health["status"] == "ok" and "missing" not in health
            assert health["prefill_routable"] == health["decode_routable"] == 1
            code, body = await rig.call(req())
            assert code == 200, body
            rig.d.healthy = False
            health = await rig.until_health(503)
            assert list(health["missing"]) == ["decode"] and "1 down" in health["missing"]["decode"]
            code, _ = await rig.call(req())
            assert code == 503

    asyncio.run(main())


def test_health_needs_a_routable_engine_of_each_role_and_names_each_one_missing() -> None:
    async def main() -> None:
        rig = Rig(prefill_ok, decode_ok, mode="sequential", fleet=CHECKED)
        rig.p.healthy = rig.d.healthy = False
        async with rig:
            status, health = await rig.health_status()
            assert status == 503 and sorted(health["missing"]) == ["decode", "prefill"]
            assert health["missing"]["prefill"].startswith("no prefill engine available")
            rig.d.healthy = True
            health = await rig.until_health(503, missing=["prefill"])
            assert health["decode_routable"] == 1 and health["prefill_routable"] == 0
            rig.p.healthy = True
            await rig.until_health(200)

    asyncio.run(main())


def test_the_request_log_splits_a_requests_time_by_leg() -> None:
    """``router.request`` says when P answered, when D's headers came and when D's first event
    went to the client (ms from arrival): a TTFT breakdown's router marks."""
    answered = asyncio.Event()

    async def slow_prefill(up: Upstream, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.05)  # P's simulated prefill time
        out = await prefill_ok(up, request)
        answered.set()
        return out

    async def decode_after_prefill(up: Upstream, request: web.Request) -> web.StreamResponse:
        out = await open_sse(request)  # D's headers at once, its first token only after P answered
        await asyncio.wait_for(answered.wait(), DEADLINE)
        for word in ("a", "b"):
            await out.write(sse(completion(word)))
        await out.write(sse(b"[DONE]"))
        await out.write_eof()
        return out

    async def main() -> None:
        async with Rig(slow_prefill, decode_after_prefill) as rig:
            with capture_events() as events:
                async with rig.post(req(stream=True)) as resp:
                    assert resp.status == 200
                    await asyncio.wait_for(resp.read(), DEADLINE)
            (logged,) = events.named("router.request")
            assert logged["outcome"] == "served"
            assert logged["prefill_ms"] >= 50
            assert logged["decode_headers_ms"] < logged["prefill_ms"] <= logged["first_event_ms"] <= logged["ms"]

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------
# A dead P whose failure races D's: the request is retried on another P either way
# ------------------------------------------------------------------------------------------------
IDENTITY_0 = PrefillIdentity("prefill-0", "127.0.0.1", 5600)
IDENTITY_1 = PrefillIdentity("prefill-1", "127.0.0.1", 5601)
VLLM_500 = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}


class FailoverRig(Rig):
    """P0 at ``p0_url`` (no health checks: the router believes it up, and its first pick is P0,
    the first engine) and P1 (``self.p``, answering) behind the router, one D."""

    def __init__(self, p0_url: str, decode: Handler) -> None:
        super().__init__(prefill_ok, decode, fleet=FleetConfig(health_interval=0))
        self.p0_url = p0_url

    def config(self) -> RouterConfig:
        return RouterConfig(
            prefills=(EngineSpec(self.p0_url, "p0", IDENTITY_0), EngineSpec(self.p.url, "p1", IDENTITY_1)),
            decodes=(EngineSpec(self.d.url, "d0"),),
            timeout=30.0,
            fleet=self.fleet,
        )


def d_fails_for_p0(answer: Callable[[], Awaitable[None]], stream: bool) -> Handler:
    """D: a leg naming P0 (which D cannot reach either) is a 500 once ``answer`` returns; a leg
    naming another P is served."""

    async def handler(up: Upstream, request: web.Request) -> web.StreamResponse:
        _, body = up.requests[-1]
        if body["kv_transfer_params"]["remote_engine_id"] == IDENTITY_0.engine_id:
            await answer()
            return web.json_response(VLLM_500, status=500)
        return await (decode_stream_ok if stream else decode_ok)(up, request)

    return handler


async def until_logged(events: Any, name: str) -> None:
    """The router logs ``router.request`` once its handler returns, which may be after the
    client read a stream's end: poll for it, under DEADLINE."""
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not events.named(name):
        assert asyncio.get_running_loop().time() < deadline, f"no {name} logged"
        await asyncio.sleep(0.01)  # polling, under the deadline above


def check_retried_on_p1(rig: Rig, events: Any, status: int, got: Any, stream: bool) -> None:
    """The client got P1's answer, served under a fresh transfer id after D's failed first leg."""
    assert status == 200, got
    if stream:
        assert [e if e == "[DONE]" else e["choices"][0]["text"] for e in events_of(got)] == ["a", "b", "c", "[DONE]"]
    else:
        assert got["choices"][0]["text"] == "decoded:hello"
    # D saw both legs: the failed one naming P0, then the retry's naming P1 under a new transfer id.
    (_, first), (_, second) = rig.d.requests
    failed_tid, tid = first["kv_transfer_params"]["transfer_id"], second["kv_transfer_params"]["transfer_id"]
    assert first["kv_transfer_params"]["remote_engine_id"] == "prefill-0"
    assert second["kv_transfer_params"]["remote_engine_id"] == "prefill-1"
    assert failed_tid != tid and failed_tid.startswith("tx-") and tid.startswith("tx-")
    ((_, p1_body),) = rig.p.requests
    assert p1_body["kv_transfer_params"]["transfer_id"] == tid
    (retry,) = events.named("router.prefill_retry")
    assert retry["prefill_engine"] == "p0" and not retry["same_engine"]
    assert (retry["failed_transfer_id"], retry["transfer_id"]) == (failed_tid, tid)
    (line,) = events.named("router.request")
    assert line["outcome"] == "served" and line["status"] == 200, line
    assert line["prefill_engine"] == "p1" and line["prefill_retried"] is True and line["transfer_id"] == tid
    assert rig.router is not None
    counters = rig.router.counters
    assert counters["served"] == 1 and counters["prefill_retries"] == 1 and counters["failed"] == 0, counters


@pytest.mark.parametrize("stream", [False, True])
def test_a_p_leg_dropped_after_ds_500_came_in_is_retried_on_another_p(stream: bool) -> None:
    """D cannot reach a P that is dying either, and its 500 for P0's transfer is in before P0's
    leg failed (P0's socket took the connection, then resets it before any response byte, once
    the router has taken D's answer). The router waits a moment for P's leg
    (``prefill_grace``) rather than answer D's error at once, and retries on P1."""
    captured: list[Any] = []

    async def at_once() -> None:
        return None

    async def dying_p(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # the prefill leg's request is in
        # The router logs D's failure as its leg returns it: only then does P0 drop.
        await until_logged(captured[0], "router.decode_failed")
        writer.transport.abort()  # reset, no response byte: P died

    async def main() -> None:
        dying = await asyncio.start_server(dying_p, "127.0.0.1", 0)
        port = dying.sockets[0].getsockname()[1]
        try:
            async with FailoverRig(f"http://127.0.0.1:{port}", d_fails_for_p0(at_once, stream)) as rig:
                with capture_events() as events:
                    captured.append(events)
                    status, got = await rig.call(req(stream=stream))
                    await until_logged(events, "router.request")
                check_retried_on_p1(rig, events, status, got, stream)
                names = [e["event"] for e in events]
                # D's leg had ended (its error unsent) before P0's leg failed and was retried.
                assert names.index("router.decode_failed") < names.index("router.prefill_retry")
                (retry,) = events.named("router.prefill_retry")
                assert "Disconnect" in retry["reason"] or "reset" in retry["reason"].lower(), retry
                assert events.named("router.prefill_failed") == []
        finally:
            dying.close()
            await dying.wait_closed()

    asyncio.run(main())


def test_ds_500_while_p_still_computes_is_answered_after_the_grace_and_ps_leg_cancelled() -> None:
    """D fails first while P is alive and computing: the router gives P's leg its grace to fail
    (it does not), then answers D's error as before, cancels P's leg and retries nothing."""

    async def fails(up: Upstream, request: web.Request) -> web.StreamResponse:
        return web.json_response(VLLM_500, status=500)

    class GraceRig(Rig):
        def config(self) -> RouterConfig:
            return replace(super().config(), prefill_grace=0.05)

    async def main() -> None:
        async with GraceRig(forever, fails) as rig:
            with capture_events() as events:
                status, body = await rig.call(req())
                await until_logged(events, "router.request")
            assert status == 500 and body["error"]["upstream_message"] == "Internal server error", body
            await rig.p.wait_cancelled()
            (line,) = events.named("router.request")
            assert line["outcome"] == "failed_decode" and not line["prefill_retried"]
            assert line["ms"] >= 50  # it waited the grace out
            assert events.named("router.prefill_retry") == []

    asyncio.run(main())
