"""The router over many P and many D engines (xPyD), against in-process fake engines (aiohttp).

The fakes model what matters to the router: a P "pushes" the KV of a transfer id when it computes
its prompt (answering with ``kv_transfer_params`` that name it, as pushactors' connector does), and
a D answers only once the P named in its leg pushed that transfer id (else, like a real watchdog,
with a 500 long after every test deadline). So a D leg that names the wrong P, or that the router
forgot to abort, makes a test fail rather than pass quietly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pushactors.apps.router import Router, RouterConfig, add_arguments, config_from_args
from pushactors.apps.router_pool import WARMUP_PROMPT, EngineSpec, FleetConfig, identity_from_params, parse_engine
from pushactors.logs import capture_events
from pushactors.routing import PrefillIdentity

DEADLINE = 5.0  # seconds: every wait in these tests ends within this
WATCHDOG = 30.0  # a D leg nobody pushes to answers only after this: far beyond DEADLINE


async def until(cond: Callable[[], bool], what: str) -> None:
    """Poll ``cond`` under DEADLINE (the router's state changes on its own event loop tasks)."""
    deadline = asyncio.get_running_loop().time() + DEADLINE
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)  # polling, under the deadline above


def completion(text: str, **extra: Any) -> dict[str, Any]:
    return {"id": "cmpl-x", "object": "text_completion", "choices": [{"index": 0, "text": text}], **extra}


class Cluster:
    """What the fake engines share: which P pushed each transfer id."""

    def __init__(self) -> None:
        self.pushes: dict[str, asyncio.Future[str]] = {}
        self.arrivals: dict[str, asyncio.Event] = {}  # transfer id -> a D got its leg

    def _future(self, tid: str) -> asyncio.Future[str]:
        return self.pushes.setdefault(tid, asyncio.get_running_loop().create_future())

    def push(self, tid: str, engine_id: str) -> None:
        fut = self._future(tid)
        if not fut.done():
            fut.set_result(engine_id)

    async def pushed_by(self, tid: str) -> str | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self._future(tid)), WATCHDOG)
        except asyncio.TimeoutError:
            return None


class FakeEngine:
    """A fake vLLM server, P or D, that can be stopped and restarted on the same port."""

    def __init__(self, cluster: Cluster, name: str, role: str, engine_id: str = "", side_port: int = 0) -> None:
        self.cluster = cluster
        self.name, self.role = name, role
        self.engine_id, self.side_port = engine_id, side_port
        self.requests: list[tuple[Any, dict[str, Any]]] = []
        self.cancelled = 0
        self.healthy = True
        self.names_itself = True  # False: warm-ups answer without kv_transfer_params
        self.fail_status: int | None = None  # answer client requests with this status
        self.wait_for_d = False  # P: answer only once D got the request's leg
        self.drop_next = 0  # reset this many client requests' connections without an answer
        self.gates: dict[str, asyncio.Event] = {}  # prompt -> wait for it before answering
        self.port = 0
        self.paths: list[str] = []  # the endpoint of each request, in order
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def params(self, tid: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.side_port,
            "remote_tp_size": 1,
            "remote_pp_size": 1,
            "remote_request_id": "cmpl-p-0",
            "tp_size": 1,
            "pp_size": 1,
            "remote_block_ids": [[1, 2]],
            "transfer_mode": "push",
        }
        if tid:
            out["transfer_id"] = tid
        return out

    def identity(self) -> PrefillIdentity:
        return PrefillIdentity(self.engine_id, "127.0.0.1", self.side_port)

    def client_bodies(self) -> list[dict[str, Any]]:
        return [b for _, b in self.requests if b.get("prompt") != WARMUP_PROMPT]

    def warmups(self) -> list[dict[str, Any]]:
        return [b for _, b in self.requests if b.get("prompt") == WARMUP_PROMPT]

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.headers.copy(), body))
        self.paths.append(request.path)
        if "messages" in body:  # a chat: answered like a completion of its conversation
            body = {**body, "prompt": json.dumps(body["messages"])}
        try:
            if body.get("prompt") == WARMUP_PROMPT:
                named = {"kv_transfer_params": self.params(None)} if self.names_itself else {}
                return web.json_response(completion("w", **named))
            params = body["kv_transfer_params"]
            tid = params.get("transfer_id")
            if self.drop_next > 0:
                # The server drops the connection (RST) as one dropping a pooled keep-alive
                # connection does: the router sees it broken before any response byte.
                self.drop_next -= 1
                sock = request.transport.get_extra_info("socket") if request.transport else None
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                assert request.transport is not None
                request.transport.abort()
                raise asyncio.CancelledError
            arrived = self.cluster.arrivals.setdefault(tid, asyncio.Event())
            if self.role == "decode":
                arrived.set()
            elif self.wait_for_d:
                await asyncio.wait_for(arrived.wait(), DEADLINE)
            gate = self.gates.get(str(body.get("prompt")))
            if gate is not None:
                await gate.wait()
            if self.fail_status is not None:
                err = {"message": f"{self.name} fails", "type": "Error", "code": self.fail_status}
                return web.json_response({"error": err}, status=self.fail_status)
            if self.role == "prefill":
                if params.get("transfer_id"):
                    self.cluster.push(params["transfer_id"], self.engine_id)
                return web.json_response(completion("x", kv_transfer_params=self.params(params.get("transfer_id"))))
            pusher = await self.cluster.pushed_by(params["transfer_id"])
            if pusher is None or pusher != params["remote_engine_id"]:
                return web.json_response({"error": {"message": "KV transfer failed", "code": 500}}, status=500)
            return web.json_response(completion(f"{self.name}<-{pusher}:{body['prompt']}"))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "tiny-model", "object": "model"}]})

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


class XRig:
    """2 fake P and 2 fake D (by default) behind a real router, all on 127.0.0.1."""

    def __init__(
        self,
        n_p: int = 2,
        n_d: int = 2,
        *,
        mode: str = "concurrent",
        give_identity: bool = True,
        admin_token: str | None = None,
        **fleet: Any,
    ) -> None:
        self.cluster = Cluster()
        self.ps = [FakeEngine(self.cluster, f"p{i}", "prefill", f"prefill-{i}", 5600 + i) for i in range(n_p)]
        self.ds = [FakeEngine(self.cluster, f"d{i}", "decode") for i in range(n_d)]
        self.mode = mode
        self.give_identity = give_identity
        self.admin_token = admin_token
        self.fleet = FleetConfig(
            **{
                "health_interval": 0.05,
                # A stopped engine refuses at once and a sick one answers 503, so the timeout
                # only has to outlast a loaded CI machine: 0.5 s marked live engines down there.
                "health_timeout": 3.0,
                "failure_threshold": 1,
                "discovery_backoff": (0.02, 0.1),
                **fleet,
            }
        )
        self.router: Router | None = None
        self.runner: web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None
        self.url = ""

    async def __aenter__(self) -> XRig:
        for e in self.ps + self.ds:
            await e.start()
        prefills = tuple(EngineSpec(p.url, p.name, p.identity() if self.give_identity else None) for p in self.ps)
        self.router = Router(
            RouterConfig(
                mode=self.mode,
                timeout=30.0,
                prefills=prefills,
                decodes=tuple(EngineSpec(d.url, d.name) for d in self.ds),
                fleet=self.fleet,
                admin_token=self.admin_token,
            )
        )
        self.runner = self.router.runner()
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.session is not None and self.runner is not None
        await self.session.close()
        await self.runner.cleanup()
        for e in self.ps + self.ds:
            await e.stop()

    async def call(self, prompt: str, rid: str | None = None) -> tuple[int, Any]:
        assert self.session is not None
        headers = {"X-Request-Id": rid} if rid else {}
        body = {"model": "m", "prompt": prompt, "max_tokens": 4}
        async with self.session.post(f"{self.url}/v1/completions", json=body, headers=headers) as resp:
            text = await asyncio.wait_for(resp.text(), DEADLINE)
            return resp.status, json.loads(text)

    async def health(self) -> tuple[int, dict[str, Any]]:
        assert self.session is not None
        async with self.session.get(f"{self.url}/health") as resp:
            return resp.status, await resp.json()

    async def engines(self) -> dict[str, Any]:
        status, body = await self.admin("GET", "/admin/engines")
        assert status == 200, body
        return body

    def engine(self, snapshot: dict[str, Any], name: str) -> dict[str, Any]:
        return next(e for e in snapshot["prefill"] + snapshot["decode"] if e["name"] == name)

    async def admin(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        assert self.session is not None
        token = token if token is not None else self.admin_token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.request(method, f"{self.url}{path}", json=body, headers=headers) as resp:
            return resp.status, await resp.json()

    def state(self, name: str) -> Any:
        assert self.router is not None
        engine = self.router.fleet.get(name)
        assert engine is not None
        return engine


def tid_of(body: dict[str, Any]) -> str:
    tid = body["kv_transfer_params"]["transfer_id"]
    assert isinstance(tid, str)
    return tid


def check_legs_pair_up(rig: XRig) -> dict[str, tuple[str, str]]:
    """Every D leg named the P that got the same transfer id: transfer id -> (P name, D name)."""
    p_of = {tid_of(b): p for p in rig.ps for b in p.client_bodies()}
    out: dict[str, tuple[str, str]] = {}
    for d in rig.ds:
        for b in d.client_bodies():
            tid = tid_of(b)
            p = p_of[tid]
            params = b["kv_transfer_params"]
            assert (params["remote_engine_id"], params["remote_port"]) == (p.engine_id, p.side_port), (tid, p.name)
            out[tid] = (p.name, d.name)
    return out


# ------------------------------------------------------------------------------------------------
def test_least_outstanding_spreads_concurrent_requests_evenly_and_admin_agrees() -> None:
    async def main() -> None:
        # The policy alone: no health check may take an engine out mid-test.
        async with XRig(health_interval=60.0) as rig:
            gate = asyncio.Event()
            prompts = [f"slow-{i}" for i in range(8)]
            for e in rig.ps + rig.ds:
                e.gates = dict.fromkeys(prompts, gate)
            with capture_events() as events:
                calls = [asyncio.create_task(rig.call(p)) for p in prompts]
                await until(lambda: sum(len(d.client_bodies()) for d in rig.ds) == 8, "8 D legs in flight")
                await until(lambda: sum(len(p.client_bodies()) for p in rig.ps) == 8, "8 P legs in flight")
                snap = await rig.engines()
                assert [e["outstanding"] for e in snap["prefill"]] == [4, 4]
                assert [e["outstanding"] for e in snap["decode"]] == [4, 4]
                gate.set()
                results = await asyncio.gather(*calls)
            assert [s for s, _ in results] == [200] * 8
            for e in rig.ps + rig.ds:
                assert len(e.client_bodies()) == 4, e.name  # even within a margin of 0
            pairs = check_legs_pair_up(rig)
            for _, body in results:
                d_name, rest = body["choices"][0]["text"].split("<-")
                assert d_name in ("d0", "d1") and rest.startswith("prefill-")
            snap = await rig.engines()
            for row in snap["prefill"] + snap["decode"]:
                assert (row["chosen"], row["succeeded"], row["failed"], row["outstanding"]) == (4, 4, 0, 0), row
                assert row["up"] and not row["draining"]
                lat = row["latency_ms"]
                assert lat["n"] == 4 and 0 < lat["p50"] <= lat["p99"]
            assert snap["counters"]["served"] == 8 and snap["counters"]["failed"] == 0
            assert snap["policy"] == "least_outstanding" and snap["mode"] == "concurrent"
            # The log line names both engines of each request, by name.
            logged = {
                e["transfer_id"]: (e["prefill_engine"], e["decode_engine"]) for e in events.named("router.request")
            }
            assert logged == pairs
            assert {e["outcome"] for e in events.named("router.request")} == {"served"}

    asyncio.run(main())


def test_p_identity_is_discovered_from_the_warm_up_and_named_in_d_legs() -> None:
    async def main() -> None:
        rig = XRig(give_identity=False)
        rig.ps[1].names_itself = False  # p1's connector does not (yet) answer with its identity
        async with rig:
            await until(lambda: rig.state("p0").identity is not None, "p0 discovered")
            warm = rig.ps[0].warmups()[0]
            assert warm["max_tokens"] == 1 and warm["stream"] is False
            assert warm["kv_transfer_params"] == {"do_remote_decode": True}
            assert warm["model"] == "tiny-model"  # from P's /v1/models
            assert rig.state("p0").identity == rig.ps[0].identity()
            # p1 keeps being asked (with backoff) but takes no request until it names itself.
            await until(lambda: len(rig.ps[1].warmups()) >= 2, "p1 warm-up retried")
            snap = await rig.engines()
            p1 = rig.engine(snap, "p1")
            assert "identity" not in p1 and p1["discovering"] and "names no engine" in p1["discovery_error"]
            for i in range(4):
                status, _ = await rig.call(f"early-{i}")
                assert status == 200
            assert not rig.ps[1].client_bodies() and len(rig.ps[0].client_bodies()) == 4
            rig.ps[1].names_itself = True
            await until(lambda: rig.state("p1").identity is not None, "p1 discovered")
            assert rig.state("p1").identity == rig.ps[1].identity()
            for i in range(4):
                status, _ = await rig.call(f"later-{i}")
                assert status == 200
            assert len(rig.ps[1].client_bodies()) == 2  # now shared evenly
            check_legs_pair_up(rig)
            snap = await rig.engines()
            p1 = rig.engine(snap, "p1")
            assert p1["identity"] == {
                "engine_id": "prefill-1",
                "side_channel": "127.0.0.1:5601",
                "tp_size": 1,
                "pp_size": 1,
            }
            assert p1["identity_source"] == "discovered" and not p1["discovering"]

    asyncio.run(main())


def test_no_p_with_a_known_identity_is_a_503() -> None:
    async def main() -> None:
        rig = XRig(give_identity=False)
        for p in rig.ps:
            p.names_itself = False
        async with rig:
            await until(lambda: all(p.warmups() for p in rig.ps), "warm-ups sent")
            status, body = await rig.call("x")
            assert status == 503 and body["error"]["type"] == "service_unavailable"
            assert "no known identity" in body["error"]["message"]
            assert not any(e.client_bodies() for e in rig.ps + rig.ds)
            assert (await rig.engines())["counters"]["unavailable"] == 1

    asyncio.run(main())


def test_health_waits_for_a_p_whose_identity_is_known_in_concurrent_mode() -> None:
    """Concurrent legs need P's identity: up but unnamed, no P is routable, and /health says so
    (503, naming the prefill role, in the words a request's 503 uses) until discovery names one."""

    async def main() -> None:
        rig = XRig(give_identity=False)
        for p in rig.ps:
            p.names_itself = False
        async with rig:
            await until(lambda: all(p.warmups() for p in rig.ps), "warm-ups sent")
            status, health = await rig.health()
            assert status == 503 and list(health["missing"]) == ["prefill"], health
            assert "2 with no known identity yet" in health["missing"]["prefill"]
            assert health["prefill_eligible"] == 2 and health["prefill_routable"] == 0
            code, body = await rig.call("x")
            assert code == 503 and body["error"]["message"] == health["missing"]["prefill"]
            rig.ps[1].names_itself = True
            await until(lambda: rig.state("p1").identity is not None, "p1 discovered")
            status, health = await rig.health()
            assert status == 200 and health["prefill_routable"] == 1 and health["decode_routable"] == 2
            code, _ = await rig.call("y")
            assert code == 200

    asyncio.run(main())


def test_a_p_answering_with_a_new_identity_replaces_a_discovered_one() -> None:
    async def main() -> None:
        async with XRig(n_p=1, n_d=1, give_identity=False) as rig:
            await until(lambda: rig.state("p0").identity is not None, "p0 discovered")
            rig.ps[0].side_port = 6600  # P restarted between two health checks: new side channel
            with capture_events() as events:
                await rig.call("a")  # its D leg still names the old port; P's answer names the new one
            assert rig.state("p0").identity.port == 6600
            assert events.named("router.identity_changed")
            status, _ = await rig.call("b")
            assert status == 200
            assert rig.ds[0].client_bodies()[-1]["kv_transfer_params"]["remote_port"] == 6600

    asyncio.run(main())


def test_prefix_affinity_keeps_a_prefix_on_one_engine() -> None:
    async def main() -> None:
        async with XRig(policy="prefix_affinity", affinity_prefix=16) as rig:
            shared = "system: you are a"  # 17 characters: the key is its first 16
            for i in range(8):
                status, _ = await rig.call(f"{shared} helpful assistant #{i}")
                assert status == 200
            assert sorted(len(p.client_bodies()) for p in rig.ps) == [0, 8]
            assert sorted(len(d.client_bodies()) for d in rig.ds) == [0, 8]
            for i in range(24):
                status, _ = await rig.call(f"{i:02d} another prompt entirely")
                assert status == 200
            assert all(p.client_bodies() for p in rig.ps)  # distinct prefixes spread over both
            check_legs_pair_up(rig)
            assert (await rig.engines())["policy"] == "prefix_affinity"

    asyncio.run(main())


def test_health_checks_take_a_stopped_engine_out_and_bring_it_back_rediscovered() -> None:
    async def main() -> None:
        async with XRig(give_identity=False) as rig:
            await until(lambda: all(rig.state(p.name).identity for p in rig.ps), "both P discovered")
            p1, d1 = rig.ps[1], rig.ds[1]
            with capture_events() as events:
                await p1.stop()
                d1.healthy = False  # reachable, but says it is not well
                await until(lambda: not rig.state("p1").up and not rig.state("d1").up, "p1 and d1 out")
                for i in range(6):
                    status, _ = await rig.call(f"while-down-{i}")
                    assert status == 200
                assert not p1.client_bodies() and not d1.client_bodies()
                snap = await rig.engines()
                assert not rig.engine(snap, "p1")["up"] and "health check" in rig.engine(snap, "p1")["last_error"]
                # p1 comes back with another side channel: its identity is discovered again.
                p1.side_port = 7601
                await p1.start()
                d1.healthy = True
                await until(lambda: rig.state("p1").up and rig.state("d1").up, "p1 and d1 back")
                await until(lambda: rig.state("p1").identity is not None, "p1 rediscovered")
                assert rig.state("p1").identity.port == 7601
                for i in range(4):
                    status, _ = await rig.call(f"after-{i}")
                    assert status == 200
            assert len(p1.client_bodies()) == 2 and len(d1.client_bodies()) == 2
            assert all(
                b["kv_transfer_params"]["remote_port"] in (5600, 7601) for d in rig.ds for b in d.client_bodies()
            )
            check_legs_pair_up(rig)
            assert {e["engine"] for e in events.named("router.engine_down")} == {"p1", "d1"}
            assert {e["engine"] for e in events.named("router.engine_up")} == {"p1", "d1"}

    asyncio.run(main())


def test_a_refused_p_leg_is_retried_once_on_another_p_with_a_fresh_transfer() -> None:
    async def main() -> None:
        # Health checked once at start only: the router learns of the dead P from a request.
        async with XRig(health_interval=60.0) as rig:
            await until(lambda: all(rig.state(e.name).extra.get("health_checks") for e in rig.ps + rig.ds), "checks")
            await rig.ps[1].stop()  # connection refused
            with capture_events() as events:
                for i in range(4):
                    status, body = await rig.call(f"r-{i}", rid=f"rid-{i}")
                    assert status == 200, body
            retries = events.named("router.prefill_retry")
            assert len(retries) == 1  # the refusal took p1 out: later requests never tried it
            retry = retries[0]
            assert retry["prefill_engine"] == "p1" and "Connect" in retry["reason"]
            assert retry["failed_transfer_id"] != retry["transfer_id"]
            line = next(e for e in events.named("router.request") if e["request_id"] == retry["request_id"])
            assert line["prefill_retried"] is True and line["prefill_engine"] == "p0"
            assert line["transfer_id"] == retry["transfer_id"] and line["outcome"] == "served"
            # The retry's D leg names p0 under the fresh id; no D leg under the failed id survived.
            legs = [b for d in rig.ds for b in d.client_bodies()]
            assert [tid_of(b) for b in legs].count(retry["transfer_id"]) == 1
            stale = [b for b in legs if tid_of(b) == retry["failed_transfer_id"]]
            assert sum(d.cancelled for d in rig.ds) == len(stale)
            assert all(b["kv_transfer_params"]["remote_engine_id"] == "prefill-0" for b in legs if b not in stale)
            snap = await rig.engines()
            assert snap["counters"]["prefill_retries"] == 1 and snap["counters"]["served"] == 4
            p1 = rig.engine(snap, "p1")
            assert not p1["up"] and p1["failed"] == 1 and p1["chosen"] == 1

    asyncio.run(main())


def test_prefill_failures_abort_the_d_leg_with_many_engines() -> None:
    async def main() -> None:
        async with XRig(health_interval=60.0, failure_threshold=100) as rig:
            for p in rig.ps:
                p.fail_status = 500
                p.wait_for_d = True  # so that every request's D leg is surely waiting at a D
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            results = await asyncio.gather(*(rig.call(f"doomed-{i}") for i in range(6)))
            assert loop.time() - t0 < DEADLINE
            assert [s for s, _ in results] == [502] * 6
            assert all(b["error"]["type"] == "prefill_error" for _, b in results)
            # Every D leg that reached a D was aborted (no D waits for a push that never comes).
            assert sum(len(d.client_bodies()) for d in rig.ds) == 6
            await until(lambda: sum(d.cancelled for d in rig.ds) == 6, "every D leg aborted")
            assert all(d.client_bodies() for d in rig.ds)  # both D were involved
            snap = await rig.engines()
            assert snap["counters"]["failed_prefill"] == 6 and snap["counters"]["prefill_retries"] == 0
            assert sum(e["failed"] for e in snap["prefill"]) == 6 and all(e["failed"] for e in snap["prefill"])
            assert all(e["outstanding"] == 0 and e["failed"] == 0 for e in snap["decode"])
            assert sum(e["cancelled"] for e in snap["decode"]) == 6

    asyncio.run(main())


def test_p_5xx_counts_against_its_health_and_4xx_does_not() -> None:
    async def main() -> None:
        async with XRig(health_interval=60.0, failure_threshold=2) as rig:
            for p in rig.ps:
                p.fail_status = 400
            for i in range(4):
                status, _ = await rig.call(f"bad-{i}")
                assert status == 400
            assert all(rig.state(p.name).up for p in rig.ps)
            for p in rig.ps:
                p.fail_status = 500
            for i in range(4):
                status, _ = await rig.call(f"dead-{i}")
                assert status == 502
            assert not any(rig.state(p.name).up for p in rig.ps)
            # Every P is down: requests still probe them (panic mode) rather than all being
            # refused, and one that succeeds brings its engine back.
            status, _ = await rig.call("still-failing")
            assert status == 502
            for p in rig.ps:
                p.fail_status = None
            status, _ = await rig.call("after")
            assert status == 200
            assert sum(rig.state(p.name).up for p in rig.ps) == 1

    asyncio.run(main())


def test_drain_stops_new_requests_while_the_in_flight_one_completes() -> None:
    async def main() -> None:
        async with XRig(admin_token="s3cret") as rig:
            gate = asyncio.Event()
            for d in rig.ds:
                d.gates = {"slow": gate}
            slow = asyncio.create_task(rig.call("slow"))
            await until(lambda: any(d.client_bodies() for d in rig.ds), "the slow request on a D")
            busy = next(d for d in rig.ds if d.client_bodies())
            other = next(d for d in rig.ds if d is not busy)
            assert (await rig.admin("POST", "/admin/drain", {"engine": busy.name}, token="wrong"))[0] == 401
            assert (await rig.admin("GET", "/admin/engines", token="wrong"))[0] == 401
            status, body = await rig.admin("POST", "/admin/drain", {"engine": busy.name})
            assert status == 200 and body["engine"]["draining"] and body["engine"]["outstanding"] == 1
            assert (await rig.admin("POST", "/admin/drain", {"engine": "nope"}))[0] == 404
            assert (await rig.admin("POST", "/admin/drain", {"name": busy.name}))[0] == 400
            for i in range(4):
                status, _ = await rig.call(f"fast-{i}")
                assert status == 200
            assert len(busy.client_bodies()) == 1 and len(other.client_bodies()) == 4
            gate.set()
            status, _ = await slow
            assert status == 200  # the drained engine finished what it had
            row = rig.engine(await rig.engines(), busy.name)
            assert row["draining"] and row["outstanding"] == 0 and row["succeeded"] == 1
            status, body = await rig.admin("POST", "/admin/undrain", {"engine": busy.name})
            assert status == 200 and not body["engine"]["draining"]
            for i in range(2):
                status, _ = await rig.call(f"again-{i}")
                assert status == 200
            assert len(busy.client_bodies()) == 2
            # Draining every D leaves nothing to send to: a 503, and no P leg either.
            for d in rig.ds:
                assert (await rig.admin("POST", "/admin/drain", {"engine": d.name}))[0] == 200
            p_legs = sum(len(p.client_bodies()) for p in rig.ps)
            status, body = await rig.call("nowhere")
            assert status == 503 and "2 draining" in body["error"]["message"]
            assert sum(len(p.client_bodies()) for p in rig.ps) == p_legs

    asyncio.run(main())


def test_sequential_legs_over_many_engines_hand_each_p_its_own_params() -> None:
    async def main() -> None:
        async with XRig(mode="sequential", give_identity=False) as rig:
            for i in range(6):
                status, _ = await rig.call(f"s-{i}")
                assert status == 200
            check_legs_pair_up(rig)  # D got the params of the P that computed its prompt
            assert not any(p.warmups() for p in rig.ps)  # no discovery: P's params are relayed
            assert all(len(e.client_bodies()) == 3 for e in rig.ps + rig.ds)

    asyncio.run(main())


# --- configuration -------------------------------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_single_engine_command_line_still_works() -> None:
    config = config_from_args(
        parse(
            "--prefill", "http://127.0.0.1:8100/", "--decode", "http://127.0.0.1:8200",
            "--prefill-engine-id", "prefill-0", "--prefill-side-channel", "127.0.0.1:5600", "--prefill-tp", "2",
        )
    )  # fmt: skip
    assert config.prefill_specs() == [
        EngineSpec("http://127.0.0.1:8100", "http://127.0.0.1:8100", PrefillIdentity("prefill-0", "127.0.0.1", 5600, 2))
    ]
    assert config.decode_specs() == [EngineSpec("http://127.0.0.1:8200", "http://127.0.0.1:8200")]
    assert config.mode == "concurrent" and config.fleet.health_interval == 2.0 and config.fleet.health_timeout == 5.0
    assert config.fleet.policy == "least_outstanding"


def test_many_engines_on_the_command_line() -> None:
    config = config_from_args(
        parse(
            "--prefill", "p0=http://10.0.0.1:8100@prefill-0@10.0.0.1:5600@2@2",
            "--prefill", "http://10.0.0.2:8100",
            "--decode", "d0=http://10.0.1.1:8200", "--decode", "http://10.0.1.2:8200",
            "--policy", "prefix_affinity", "--affinity-prefix", "64", "--health-interval", "0.5",
        )
    )  # fmt: skip
    p0, p1 = config.prefill_specs()
    assert p0 == EngineSpec("http://10.0.0.1:8100", "p0", PrefillIdentity("prefill-0", "10.0.0.1", 5600, 2, 2))
    assert p1 == EngineSpec("http://10.0.0.2:8100", "http://10.0.0.2:8100", None)
    assert [d.name for d in config.decode_specs()] == ["d0", "http://10.0.1.2:8200"]
    assert config.fleet.policy == "prefix_affinity" and config.fleet.affinity_prefix == 64
    assert config.fleet.health_interval == 0.5
    help_text = argparse.ArgumentParser()
    add_arguments(help_text)
    assert "ENGINE_ID@HOST:PORT" in help_text.format_help() and "/admin/drain" in help_text.format_help()


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--prefill-engine-id", "x", "--prefill-side-channel", "h:1"], "name one P"),
        (["--prefill-engine-id", "x"], "go together"),
    ],
)
def test_contradictory_command_lines_are_refused(argv: list[str], error: str) -> None:
    base = ["--prefill", "http://a:1", "--prefill", "http://b:1", "--decode", "http://c:1"]
    with pytest.raises(ValueError, match=error):
        config_from_args(parse(*base, *argv))
    with pytest.raises(ValueError, match="given twice"):
        config_from_args(
            parse("--prefill", "http://a:1@e@h:1", "--decode", "http://c:1", "--prefill-engine-id", "e",
                  "--prefill-side-channel", "h:1")
        )  # fmt: skip
    with pytest.raises(ValueError, match="unique"):
        Router(RouterConfig(prefills=(EngineSpec("http://a:1", "x"),), decodes=(EngineSpec("http://b:1", "x"),)))


@pytest.mark.parametrize(
    "bad", ["a:1", "http://a:1@e", "http://a:1@e@h", "http://a:1@e@h:1@0", "http://a:1@e@h:1@1@1@1"]
)
def test_bad_engine_syntax(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_engine(bad)


def test_identity_from_params_reads_what_ps_connector_returns() -> None:
    ours = FakeEngine(Cluster(), "p", "prefill", "prefill-7", 5607).params("tx-1")
    assert identity_from_params(ours) == PrefillIdentity("prefill-7", "127.0.0.1", 5607)
    # vLLM's own connectors name P's sizes tp_size/pp_size only.
    vllm = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "tp_size": 4, "pp_size": 2}
    assert identity_from_params(vllm) == PrefillIdentity("e", "h", 1, 4, 2)
    for broken in (None, {}, {**vllm, "remote_port": "1"}, {**vllm, "remote_engine_id": ""}, {**vllm, "tp_size": 0}):
        assert identity_from_params(broken) is None


def test_a_chat_request_takes_both_legs_to_the_chat_endpoint() -> None:
    # /v1/chat/completions: the same two legs (P: one token, asked to keep its KV; D: naming the
    # P that computed it, one transfer id for both) on the engines' chat endpoint.
    async def main() -> None:
        async with XRig() as rig:
            assert rig.session is not None
            chat = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
            async with rig.session.post(f"{rig.url}/v1/chat/completions", json=chat) as resp:
                status, body = resp.status, await resp.json()
            assert status == 200, body
            legs = [
                (e, b)
                for e in rig.ps + rig.ds
                for (_, b), path in zip(e.requests, e.paths, strict=True)
                if path == "/v1/chat/completions"
            ]
            assert sorted(e.role for e, _ in legs) == ["decode", "prefill"]
            ((p_engine, p_body),) = [(e, b) for e, b in legs if e.role == "prefill"]
            ((_, d_body),) = [(e, b) for e, b in legs if e.role == "decode"]
            assert p_body["max_tokens"] == 1 and p_body["kv_transfer_params"]["do_remote_decode"]
            tid = p_body["kv_transfer_params"]["transfer_id"]
            assert d_body["kv_transfer_params"]["transfer_id"] == tid
            assert d_body["kv_transfer_params"]["remote_engine_id"] == p_engine.engine_id
            assert d_body["messages"] == chat["messages"] and d_body["max_tokens"] == 4
            assert body["choices"][0]["text"].endswith(f"<-{p_engine.engine_id}:" + json.dumps(chat["messages"]))

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["concurrent", "sequential"])
def test_a_dropped_connection_to_the_only_p_is_retried_once_on_it_with_a_fresh_transfer(mode: str) -> None:
    """P's server drops the connection before answering (a pooled keep-alive connection it had
    closed): that is no answer of P's and says nothing of its health, so the same P takes the
    prompt once more under a fresh transfer id (and a fresh D leg). A second drop stands."""
    from pushactors.logs import capture_events

    async def main() -> None:
        async with XRig(1, 1, health_interval=60.0, mode=mode) as rig:
            p = rig.ps[0]
            p.drop_next = 1
            with capture_events() as events:
                status, body = await rig.call("hello", rid="rid-drop")
            assert status == 200, body
            (retry,) = events.named("router.prefill_retry")
            assert retry["same_engine"] is True and retry["prefill_engine"] == "p0"
            assert retry["failed_transfer_id"] != retry["transfer_id"]
            (line,) = events.named("router.request")
            assert line["prefill_retried"] is True and line["transfer_id"] == retry["transfer_id"]
            # D was asked only under the fresh id, or its leg under the failed one was cancelled.
            legs = rig.ds[0].client_bodies()
            assert [tid_of(b) for b in legs].count(retry["transfer_id"]) == 1
            stale = [b for b in legs if tid_of(b) == retry["failed_transfer_id"]]
            assert rig.ds[0].cancelled == len(stale)
            snap = await rig.engines()
            p0 = rig.engine(snap, "p0")
            # A dropped connection is a failed attempt, not P failing: with failure_threshold 1
            # a transport failure would have taken P out.
            assert p0["up"] and p0["failed"] == 1 and p0["chosen"] == 2
            assert snap["counters"]["prefill_retries"] == 1 and snap["counters"]["served"] == 1
            # Dropped twice in a row: one retry only, and the failure stands.
            p.drop_next = 2
            status, body = await rig.call("again", rid="rid-drop-2")
            assert status == 502 and body["error"]["type"] == "prefill_error"
            assert rig.router is not None and rig.router.counters["prefill_retries"] == 2

    asyncio.run(main())


def test_a_refused_only_p_is_no_retry_and_the_error_names_the_transfer_its_legs_used() -> None:
    """P refuses connections and there is no other P: nothing is retried (no retry counted, no
    fresh transfer id minted), and the 502 names the transfer id D's leg was sent."""
    from pushactors.logs import capture_events

    async def main() -> None:
        async with XRig(1, 1, health_interval=0) as rig:
            await rig.ps[0].stop()
            with capture_events() as events:
                status, body = await rig.call("hello")
            assert status == 502
            assert rig.router is not None and rig.router.counters["prefill_retries"] == 0
            (done,) = events.named("router.request")
            assert not done["prefill_retried"] and events.named("router.prefill_retry") == []
            sent = [b["kv_transfer_params"]["transfer_id"] for _, b in rig.ds[0].requests]
            assert sent in ([], [body["error"]["transfer_id"]])

    asyncio.run(main())
