"""A router for disaggregated serving (xPyD): OpenAI-compatible ``/v1/completions`` and
``/v1/chat/completions`` over many P and many D engines.

``concurrent`` (default) sends the prefill leg to P and the decode leg to D at the same time: in
push mode D needs only P's identity (engine id, side-channel address, TP/PP size), which the
router knows up front, and a ``transfer_id`` ties the two legs together. ``sequential`` waits
for P's response and hands its ``kv_transfer_params`` to D, as pull connectors need.

    pushactors router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --prefill-engine-id prefill-0 --prefill-side-channel 127.0.0.1:5600 --port 8000

    pushactors router --prefill p0=http://10.0.0.1:8100@prefill-0@10.0.0.1:5600@2 \\
        --prefill p1=http://10.0.0.2:8100 --decode d0=http://10.0.1.1:8200 \\
        --decode d1=http://10.0.1.2:8200 --policy prefix_affinity

``--prefill`` and ``--decode`` repeat, one per engine: ``[NAME=]URL`` (NAME defaults to the URL;
``/admin/*`` and the logs use it). A P's identity is given inline (``URL@ENGINE_ID@HOST:PORT[@TP[@PP]]``,
HOST:PORT being its side channel), with ``--prefill-engine-id``/``--prefill-side-channel`` for a
single P, or discovered: a one-token warm-up completion whose ``kv_transfer_params`` name P. Per
request P and D are chosen independently: least outstanding requests (default) or
``prefix_affinity`` (the prompt's first ``--affinity-prefix`` characters or tokens pick the
engine). ``GET <url>/health`` every ``--health-interval`` seconds takes failing engines out and
brings them back (an engine is routable once a check saw it up); a P leg refused before any
response (connection error) is retried once on another P, with a fresh transfer id and a fresh
D leg; so is one whose D leg failed first (D cannot reach a dead P either) with an error the
client has not seen, once P's leg tells (``RouterConfig.prefill_grace``).

The router's own ``GET /health`` is 200 only while it can route: at least one routable P (in
``concurrent`` mode, of known identity) and one routable D; else 503 with a JSON body whose
``missing`` names each role without one and why, in the words a request's 503 would use. Wait
for its 200 before sending traffic.

Admin: ``GET /admin/engines`` (per-engine state, load, latency and the router's counters);
``POST /admin/drain`` and ``POST /admin/undrain`` with ``{"engine": NAME}`` stop and resume new
requests to an engine (in-flight ones finish), for rolling restarts. With ``--admin-token`` they
need ``Authorization: Bearer TOKEN``.

Every client request gets a transfer id minted here (never derived from client input: a retry
that reuses its ``X-Request-Id`` must not share a transfer with the first attempt). Failures are
always answered: an error status before a response started, an OpenAI-style error event on a
started stream.

Needs ``aiohttp`` (``pip install 'pushactors[router]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import secrets
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import (
    ClientConnectionError,
    ClientConnectorError,
    ClientError,
    ClientOSError,
    ClientResponse,
    ClientSession,
    ClientTimeout,
    ServerDisconnectedError,
    web,
)

from ..logs import configure_logging, get_logger
from ..routing import Engine, PrefillIdentity
from .router_pool import EngineSpec, Fleet, FleetConfig, parse_endpoint, parse_engine

__all__ = [
    "EngineSpec",
    "FleetConfig",
    "PrefillIdentity",
    "Router",
    "RouterConfig",
    "add_arguments",
    "config_from_args",
    "decode_params_for",
    "main",
    "new_transfer_id",
    "parse_endpoint",
    "prefill_body",
    "run",
]

_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
_SSE = "text/event-stream"
_DONE_EVENT = b"data: [DONE]\n\n"
# aiohttp cancels a handler on client disconnect only when asked; the router relies on it to
# close both upstream legs (so vLLM aborts them) as soon as the client goes away.
HANDLER_CANCELLATION = True
ADMIN_TOKEN_ENV = "PUSHACTORS_ROUTER_ADMIN_TOKEN"


@dataclass(frozen=True)
class RouterConfig:
    """``prefill_url``/``decode_url`` (and ``prefill``, that P's identity) are the one-engine
    form; ``prefills``/``decodes`` add engines. A P without identity is discovered."""

    prefill_url: str = ""
    decode_url: str = ""
    mode: str = "concurrent"  # or "sequential"
    prefill: PrefillIdentity | None = None  # prefill_url's identity
    timeout: float = 600.0
    prefills: tuple[EngineSpec, ...] = ()
    decodes: tuple[EngineSpec, ...] = ()
    fleet: FleetConfig = field(default_factory=FleetConfig)
    admin_token: str | None = None  # required as a bearer token by /admin/* when set
    # Seconds a concurrent request waits for P's leg after D's leg failed first (an error not
    # sent yet): long enough for a refused or reset P connection to tell on a loaded machine,
    # short for an error response (only a P still computing makes the client wait it out).
    prefill_grace: float = 1.0

    def prefill_specs(self) -> list[EngineSpec]:
        if self.prefill is not None and not self.prefill_url:
            raise ValueError("a prefill identity was given without prefill_url")
        url = self.prefill_url.rstrip("/")
        return ([EngineSpec(url, url, self.prefill)] if url else []) + list(self.prefills)

    def decode_specs(self) -> list[EngineSpec]:
        url = self.decode_url.rstrip("/")
        return ([EngineSpec(url, url)] if url else []) + list(self.decodes)


def new_transfer_id() -> str:
    """Unguessable and unique: P and D key a transfer by it, so it must name one request."""
    return f"tx-{secrets.token_hex(16)}"


def prefill_body(body: dict[str, Any], transfer_id: str | None, *, per_prompt: bool = False) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, asks P to keep its KV for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _DROP_FOR_PREFILL}
    params: dict[str, Any] = {"do_remote_decode": True}
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
        if per_prompt:
            params["transfer_per_prompt"] = True
    out.update(kv_transfer_params=params, max_tokens=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_params_for(prefill: PrefillIdentity, transfer_id: str | None, *, per_prompt: bool = False) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.host,
        "remote_port": prefill.port,
        "remote_tp_size": prefill.tp_size,
        "tp_size": prefill.tp_size,
        "remote_pp_size": prefill.pp_size,
        "pp_size": prefill.pp_size,
    }
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
        if per_prompt:
            params["transfer_per_prompt"] = True
    return params


COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


async def _json_body(request: web.Request) -> Any:
    """The request's JSON, or None for anything that is not (bad charset, bad UTF-8, nesting
    deeper than the parser goes): a 400 for the client, never a 500."""
    try:
        return json.loads(await request.read())
    except (ValueError, RecursionError, LookupError):
        return None


def _keyed_per_request(body: dict[str, Any], path: str) -> bool:
    """Whether one router request becomes several engine requests on each side: several
    prompts (``<id>-<i>``), or ``n`` > 1 (vLLM runs n children ``<k>_<id>`` with the same
    kv_transfer_params). Then each is keyed by the transfer id and its own base id."""
    n = body.get("n")
    children = isinstance(n, int) and not isinstance(n, bool) and n > 1
    return children or not _is_single_prompt(body, path)


def _is_single_prompt(body: dict[str, Any], path: str = COMPLETIONS) -> bool:
    if path == CHAT_COMPLETIONS:
        return True  # a chat request is one conversation (a stray "messages" elsewhere is not)
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int))


@dataclass
class _Call:
    """One client request: its ids, its client stream once started, and how it ended."""

    request_id: str
    transfer_id: str | None
    path: str = COMPLETIONS
    # Several prompts: each is its own engine request, and P and D key each prompt's legs by
    # the transfer id and the prompt's base id (the same X-Request-Id goes to both legs).
    per_prompt: bool = False  # the OpenAI endpoint the client called; both legs go to the same one
    out: web.StreamResponse | None = None
    # served | failed | failed_prefill | failed_decode | unavailable | client_disconnect
    outcome: str = "failed"
    status: int = 0
    reason: str = ""
    prefill_engine: str | None = None  # names, for the log: the last attempt's engines
    decode_engine: str | None = None
    retried: bool = False
    decode_transport: bool = False  # the D leg failed for transport reasons (counts against D)
    # When (time.monotonic()) the request arrived, P's leg answered, D's leg answered (its
    # headers) and D's first event went to the client: a request's time split by leg.
    started: float = 0.0
    prefill_done: float | None = None
    decode_headers: float | None = None
    first_event: float | None = None

    def since_start_ms(self, t: float | None) -> float | None:
        return None if t is None else round((t - self.started) * 1e3, 2)

    def error(self, message: str, kind: str, code: int, **extra: Any) -> dict[str, Any]:
        return {
            "error": {
                "message": message,
                "type": kind,
                "param": None,
                "code": code,
                "request_id": self.request_id,
                "transfer_id": self.transfer_id,
                **extra,
            }
        }


def _unsent_error(resp: web.StreamResponse) -> bool:
    """An error response nothing of which has reached the client yet."""
    return resp.status >= 500 and not resp.prepared


def _unsent_error_leg(leg: asyncio.Task[web.StreamResponse]) -> bool:
    """A decode leg that ended with an error response the client has not seen yet."""
    return leg.done() and not leg.cancelled() and leg.exception() is None and _unsent_error(leg.result())


@dataclass(frozen=True)
class _LegResult:
    status: int | None  # None: no HTTP response (connection error, timeout, unreadable body)
    payload: Any
    reason: str = ""
    transport: bool = False  # P unreachable, dead (5xx) or garbled: counts against P's health
    retryable: bool = False  # a connection error before any response byte: another P may take it
    # The connection broke before any response byte (reset, closed): a pooled keep-alive
    # connection the server dropped, not an answer of P's. The same P may take it once, afresh.
    stale: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 200

    def describe(self) -> str:
        return self.reason if self.status is None else f"HTTP {self.status}: {_upstream_message(self.payload)}"


def _dropped_connection(exc: BaseException) -> bool:
    """An established connection reset or closed by the server before any response byte (a
    pooled connection it had dropped), as opposed to one that could not be opened."""
    if isinstance(exc, ServerDisconnectedError):
        return True
    return (
        isinstance(exc, ClientOSError)
        and not isinstance(exc, ClientConnectorError)
        and exc.errno in (errno.ECONNRESET, errno.EPIPE)
    )


def _upstream_error(payload: Any) -> dict[str, Any] | None:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return dict(payload["error"])
    return None


def _upstream_message(payload: Any) -> str:
    err = _upstream_error(payload)
    if err is not None and "message" in err:
        return str(err["message"])
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return text[:500]


def _next_event(buf: bytearray) -> bytes | None:
    """Pop one complete SSE event (through its blank line) from ``buf``; None if none yet."""
    ends = [(i, n) for i, n in ((buf.find(b"\n\n"), 2), (buf.find(b"\r\n\r\n"), 4)) if i >= 0]
    if not ends:
        return None
    i, n = min(ends)
    event = bytes(buf[: i + n])
    del buf[: i + n]
    return event


def _event_data(event: bytes) -> bytes:
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines)


class Router:
    def __init__(self, config: RouterConfig) -> None:
        if config.mode not in ("concurrent", "sequential"):
            raise ValueError(f"unknown router mode {config.mode!r}")
        prefills, decodes = config.prefill_specs(), config.decode_specs()
        if any(s.identity is not None for s in decodes):
            raise ValueError("a decode engine takes no prefill identity")
        if config.mode == "concurrent" and not config.fleet.discover and any(s.identity is None for s in prefills):
            raise ValueError(
                "concurrent legs need each prefill engine's identity (--prefill-engine-id, --prefill-side-channel, "
                "URL@ENGINE_ID@HOST:PORT) when discovery is off"
            )
        self.config = config
        self.log = get_logger(actor="router", mode=config.mode)
        self.fleet = Fleet(prefills, decodes, config.fleet, self.log, need_identity=config.mode == "concurrent")
        self._session: ClientSession | None = None
        self.counters = {
            "served": 0,
            "failed": 0,
            "failed_prefill": 0,
            "failed_decode": 0,
            "unavailable": 0,
            "client_disconnects": 0,
            "prefill_retries": 0,
        }

    @property
    def served(self) -> int:
        return self.counters["served"]

    @property
    def failed(self) -> int:
        return self.counters["failed"]

    async def start(self, app: web.Application) -> None:
        self._session = ClientSession(timeout=ClientTimeout(total=self.config.timeout))
        # Sequential legs relay P's own params to D: the router never needs P's identity then.
        await self.fleet.start(self._session, discover=self.config.mode == "concurrent")

    async def stop(self, app: web.Application) -> None:
        await self.fleet.stop()
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        """The aiohttp app. Serve it with ``handler_cancellation=True`` (see HANDLER_CANCELLATION)."""
        app = web.Application()
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_post(CHAT_COMPLETIONS, self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/admin/engines", self.admin_engines)
        app.router.add_post("/admin/drain", self.admin_drain)
        app.router.add_post("/admin/undrain", self.admin_undrain)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    def runner(self) -> web.AppRunner:
        return web.AppRunner(self.app(), handler_cancellation=HANDLER_CANCELLATION)

    async def health(self, request: web.Request) -> web.Response:
        """200 only while a request would find a routable P and a routable D (the predicate
        routing uses: :meth:`Fleet.routable`); else 503, with ``missing``: per role, the reason
        a request gets in its own 503."""
        fleet = self.fleet
        missing = fleet.missing()
        body: dict[str, Any] = {
            "status": "unavailable" if missing else "ok",
            "mode": self.config.mode,
            **self.counters,
            "prefill_eligible": len(fleet.prefill.eligible()),  # up and not draining
            "decode_eligible": len(fleet.decode.eligible()),
            "prefill_routable": len(fleet.routable(fleet.prefill)),  # ... and of known identity if needed
            "decode_routable": len(fleet.routable(fleet.decode)),
        }
        if missing:
            body["missing"] = missing
        return web.json_response(body, status=503 if missing else 200)

    # --- admin ---------------------------------------------------------------------------------
    def _admin_denied(self, request: web.Request) -> web.Response | None:
        token = self.config.admin_token
        if not token:
            return None
        given = request.headers.get("Authorization", "")
        if secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return None
        return web.json_response({"error": {"message": "admin endpoints need the router's admin token"}}, status=401)

    async def admin_engines(self, request: web.Request) -> web.Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        return web.json_response(
            {
                "mode": self.config.mode,
                "policy": self.config.fleet.policy,
                "counters": dict(self.counters),
                "panic_picks": {"prefill": self.fleet.prefill.panics, "decode": self.fleet.decode.panics},
                **self.fleet.snapshot(),
            }
        )

    async def admin_drain(self, request: web.Request) -> web.Response:
        return await self._set_draining(request, True)

    async def admin_undrain(self, request: web.Request) -> web.Response:
        return await self._set_draining(request, False)

    async def _set_draining(self, request: web.Request, draining: bool) -> web.Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        body = await _json_body(request)
        name = body.get("engine") if isinstance(body, dict) else None
        if not isinstance(name, str):
            return web.json_response({"error": {"message": 'expected a JSON body {"engine": NAME}'}}, status=400)
        engine = self.fleet.get(name)
        if engine is None:
            known = [e.name for e in self.fleet.engines]
            return web.json_response({"error": {"message": f"no engine named {name!r}", "engines": known}}, status=404)
        self.fleet.pool(engine).set_draining(name, draining)
        self.log.info(
            "router.engine_draining" if draining else "router.engine_undrained",
            engine=name,
            role=engine.role,
            outstanding=engine.outstanding,
        )
        return web.json_response({"engine": engine.snapshot()})

    # ------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT_COMPLETIONS)

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        body = await _json_body(request)
        if not isinstance(body, dict):
            self.counters["failed"] += 1
            call = _Call(rid, None)
            return web.json_response(
                call.error("request body must be a JSON object", "BadRequestError", 400), status=400
            )
        # Every request gets a transfer id of its own, never the client's X-Request-Id as the key
        # (a retry reusing it would pair with the first attempt's KV); several prompts share it,
        # told apart by their index in the engines' ids.
        call = _Call(rid, new_transfer_id(), path, per_prompt=_keyed_per_request(body, path))
        started = call.started = time.monotonic()
        try:
            if self.config.mode == "concurrent":
                return await self._concurrent(request, body, call)
            return await self._sequential(request, body, call)
        except asyncio.CancelledError:
            call.outcome, call.reason = "client_disconnect", "client went away; both legs cancelled"
            raise
        except ConnectionError:
            # Writing to a client that has gone (without handler cancellation).
            call.outcome, call.reason = "client_disconnect", "client went away; both legs cancelled"
            return call.out if call.out is not None else web.Response(status=499)
        finally:
            self._count(call)
            log = self.log.info if call.outcome == "served" else self.log.warning
            log(
                "router.request",
                request_id=rid,
                transfer_id=call.transfer_id,
                outcome=call.outcome,
                status=call.status,
                reason=call.reason or None,
                prefill_engine=call.prefill_engine,
                decode_engine=call.decode_engine,
                prefill_retried=call.retried or None,
                ms=round((time.monotonic() - started) * 1e3, 2),
                prefill_ms=call.since_start_ms(call.prefill_done),
                decode_headers_ms=call.since_start_ms(call.decode_headers),
                first_event_ms=call.since_start_ms(call.first_event),
            )

    def _count(self, call: _Call) -> None:
        if call.outcome == "served":
            self.counters["served"] += 1
        elif call.outcome == "client_disconnect":
            self.counters["client_disconnects"] += 1
        else:
            self.counters["failed"] += 1
            if call.outcome in ("failed_prefill", "failed_decode", "unavailable"):
                self.counters[call.outcome] += 1

    async def _concurrent(self, request: web.Request, body: dict[str, Any], call: _Call) -> web.StreamResponse:
        key = self.fleet.key(body)
        tried: list[Engine] = []
        failure: _LegResult | None = None
        while True:
            p = self.fleet.pick_prefill(key, need_identity=True, exclude=tried)
            if p is None:
                if failure is not None:  # the retry found no other P: the first failure stands
                    return await self._prefill_failed(request, call, failure)
                why = self.fleet.unavailable(self.fleet.prefill, need_identity=True)
                return await self._unavailable(request, call, why)
            d = self.fleet.decode.pick(key)
            if d is None:
                self.fleet.release(p, cancelled=True)
                return await self._unavailable(request, call, self.fleet.unavailable(self.fleet.decode))
            call.prefill_engine, call.decode_engine = p.name, d.name
            assert p.identity is not None  # pick_prefill(need_identity=True) takes only known ones
            d_body = dict(body)
            d_body["kv_transfer_params"] = decode_params_for(p.identity, call.transfer_id, per_prompt=call.per_prompt)
            prefill = asyncio.create_task(self._prefill(p, body, call))
            decode = asyncio.create_task(self._decode(request, d, d_body, call))
            try:
                done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
                if prefill in done and not decode.done() and not prefill.result().ok:
                    # D would wait for a push that never comes (until its watchdog): abort D's leg,
                    # which closes its connection so vLLM aborts the request, and say why.
                    decode.cancel()
                    await asyncio.wait({decode})
                    if decode.cancelled() or decode.exception() is not None:
                        failure = prefill.result()
                        if decode.cancelled() and self._retry(call, failure, tried, p):
                            continue  # D's leg named this P: the retry gets a fresh D leg too
                        return await self._prefill_failed(request, call, failure)
                elif _unsent_error_leg(decode):
                    # D failed first (or in the same turn as P), and the client has seen nothing:
                    # a dead P is one D cannot reach either, and D may fail at once, before P's
                    # refusal or reset reaches the router. P's leg tells within a moment then (a
                    # P still computing is cancelled below); if it failed before any answer,
                    # retry as above.
                    if not prefill.done():
                        await asyncio.wait({prefill}, timeout=self.config.prefill_grace)
                    if prefill.done() and self._retry(call, prefill.result(), tried, p):
                        continue
                return await decode
            finally:
                # D finished first (or the client left): P's answer no longer matters.
                for task in (prefill, decode):
                    task.cancel()
                await asyncio.gather(prefill, decode, return_exceptions=True)

    async def _sequential(self, request: web.Request, body: dict[str, Any], call: _Call) -> web.StreamResponse:
        key = self.fleet.key(body)
        tried: list[Engine] = []
        failure: _LegResult | None = None
        while True:
            if not self.fleet.routable(self.fleet.decode):
                # Checked first: a prefill no D can take would only hold P's blocks until its lease.
                return await self._unavailable(request, call, self.fleet.unavailable(self.fleet.decode))
            p = self.fleet.pick_prefill(key, need_identity=False, exclude=tried)
            if p is None:
                if failure is not None:
                    return await self._prefill_failed(request, call, failure)
                return await self._unavailable(request, call, self.fleet.unavailable(self.fleet.prefill))
            call.prefill_engine = p.name
            result = await self._prefill(p, body, call)
            if result.ok:
                break
            failure = result
            if not self._retry(call, result, tried, p):
                return await self._prefill_failed(request, call, result)
        params = result.payload.get("kv_transfer_params") if isinstance(result.payload, dict) else None
        if not isinstance(params, dict) or not params:
            # Never the client's own kv_transfer_params instead: a client must not aim D at a
            # transfer. Without P's, D has nothing to receive.
            missing = _LegResult(None, result.payload, "P's response named no kv_transfer_params")
            return await self._prefill_failed(request, call, missing)
        d = self.fleet.decode.pick(key)
        if d is None:
            return await self._unavailable(request, call, self.fleet.unavailable(self.fleet.decode))
        call.decode_engine = d.name
        d_body = dict(body)
        d_body["kv_transfer_params"] = params
        return await self._decode(request, d, d_body, call)

    def _retry(self, call: _Call, result: _LegResult, tried: list[Engine], engine: Engine) -> bool:
        """Whether to send the prompt to P again: only once, only when P never answered (a
        connection error before any response byte), and only while the client has seen nothing.
        Another P if one is eligible; else the same P, only when the server dropped an open
        connection (``stale``), since one that refused a connection would refuse again."""
        if not result.retryable or call.retried or call.out is not None:
            return False
        tried.append(engine)
        need_identity = self.config.mode == "concurrent"
        if not any(
            e not in tried and not e.draining and (e.identity is not None or not need_identity)
            for e in self.fleet.prefill.engines
        ):
            if not result.stale or engine.draining:
                return False  # no other P to try: the failure stands under the transfer id its legs used
            tried.remove(engine)  # the same P again, on a new connection
        old = call.transfer_id
        if old is not None:
            # The failed attempt's transfer id may still be known to P or D: never reuse it.
            call.transfer_id = new_transfer_id()
        call.retried = True
        self.counters["prefill_retries"] += 1
        self.log.warning(
            "router.prefill_retry",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            failed_transfer_id=old,
            prefill_engine=engine.name,
            same_engine=engine not in tried,
            reason=result.describe(),
        )
        return True

    async def _unavailable(self, request: web.Request, call: _Call, why: str) -> web.StreamResponse:
        call.outcome, call.reason = "unavailable", why
        return await self._answer_error(request, call, call.error(why, "service_unavailable", 503), 503)

    # ------------------------------------------------------------------------------------------
    async def _prefill(self, engine: Engine, body: dict[str, Any], call: _Call) -> _LegResult:
        """P's leg; releases ``engine`` (a cancelled leg says nothing about P's health)."""
        started = time.monotonic()
        result: _LegResult | None = None
        try:
            result = await self._post_prefill(engine, body, call)
            call.prefill_done = time.monotonic()
            return result
        finally:
            if result is None:
                self.fleet.release(engine, cancelled=True)
            else:
                if result.ok:
                    self.fleet.observe_identity(engine, result.payload.get("kv_transfer_params"))
                self.fleet.release(
                    engine,
                    ok=result.ok,
                    error="" if result.ok else result.describe(),
                    transport=result.transport,
                    ms=(time.monotonic() - started) * 1e3,
                )

    async def _post_prefill(self, engine: Engine, body: dict[str, Any], call: _Call) -> _LegResult:
        assert self._session is not None
        responded = False
        try:
            async with self._session.post(
                f"{engine.url}{call.path}",
                json=prefill_body(body, call.transfer_id, per_prompt=call.per_prompt),
                headers={"X-Request-Id": call.request_id},
            ) as resp:
                responded = True
                text = await resp.text()
                try:
                    payload: Any = json.loads(text)
                except ValueError:
                    payload = text
                if resp.status == 200 and not isinstance(payload, dict):
                    return _LegResult(None, payload, f"unreadable prefill response: {text[:200]!r}", transport=True)
                return _LegResult(resp.status, payload, transport=resp.status >= 500)
        except (ClientError, asyncio.TimeoutError, ValueError) as exc:
            # A timeout may have reached P (and may still be computing): only a connection that
            # failed before any response is safe to send elsewhere.
            retryable = (
                not responded and isinstance(exc, ClientConnectionError) and not isinstance(exc, asyncio.TimeoutError)
            )
            stale = retryable and _dropped_connection(exc)
            reason = f"{type(exc).__name__}: {exc}"
            # A dropped connection says nothing of P's health; a retry that cannot connect does.
            return _LegResult(None, None, reason, transport=not stale, retryable=retryable, stale=stale)

    async def _prefill_failed(self, request: web.Request, call: _Call, result: _LegResult) -> web.StreamResponse:
        call.outcome = "failed_prefill"
        if result.status is not None and 400 <= result.status < 500:
            # The client's request was refused by P (validation): the client's error, not ours.
            status = result.status
            err = _upstream_error(result.payload) or {"message": _upstream_message(result.payload)}
            err.setdefault("type", "BadRequestError")
            err.setdefault("code", status)
            payload: dict[str, Any] = {
                "error": {**err, "request_id": call.request_id, "transfer_id": call.transfer_id, "leg": "prefill"}
            }
            call.reason = f"prefill refused the request ({status}): {err.get('message')}"
        else:
            status = 502
            why = (
                f"HTTP {result.status}: {_upstream_message(result.payload)}"
                if result.status is not None
                else result.reason
            )
            call.reason = f"prefill failed ({why}); decode leg cancelled"
            payload = call.error(call.reason, "prefill_error", 502, leg="prefill")
        self.log.warning(
            "router.prefill_failed",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            prefill_engine=call.prefill_engine,
            status=result.status,
            reason=call.reason,
        )
        return await self._answer_error(request, call, payload, status)

    async def _answer_error(
        self, request: web.Request, call: _Call, payload: dict[str, Any], status: int
    ) -> web.StreamResponse:
        """An error status, or an error event and ``[DONE]`` on a stream that already started."""
        call.status = status
        if call.out is not None and call.out.prepared:
            try:
                await call.out.write(b"data: " + json.dumps(payload).encode() + b"\n\n" + _DONE_EVENT)
                await call.out.write_eof()
            except ConnectionError:
                pass
            return call.out
        return web.json_response(payload, status=status, headers={"X-Request-Id": call.request_id})

    # ------------------------------------------------------------------------------------------
    async def _decode(
        self, request: web.Request, engine: Engine, body: dict[str, Any], call: _Call
    ) -> web.StreamResponse:
        """D's leg; releases ``engine`` (cancelled, by P's failure or the client, says nothing)."""
        started = time.monotonic()
        # A retry's leg starts afresh: a failed first leg's outcome must not outlive it (a relayed
        # stream keeps a "failed_decode" it finds, as its own error event would have set it).
        call.outcome, call.status, call.reason = "failed", 0, ""
        call.decode_transport = False
        try:
            out = await self._decode_leg(request, engine, body, call)
        except BaseException:
            self.fleet.release(engine, cancelled=True)
            raise
        ok = call.outcome == "served"
        self.fleet.release(
            engine,
            ok=ok,
            error="" if ok else call.reason,
            transport=call.decode_transport,
            ms=(time.monotonic() - started) * 1e3,
        )
        return out

    async def _decode_leg(
        self, request: web.Request, engine: Engine, body: dict[str, Any], call: _Call
    ) -> web.StreamResponse:
        assert self._session is not None
        resp: ClientResponse | None = None
        complete = False
        try:
            # Only upstream errors here: writing to a client that left raises a ClientError too.
            try:
                resp = await self._session.post(
                    f"{engine.url}{call.path}", json=body, headers={"X-Request-Id": call.request_id}
                )
                call.decode_headers = time.monotonic()
                ctype = resp.headers.get("Content-Type", "application/json")
                stream = resp.status == 200 and ctype.startswith(_SSE)
                data = b"" if stream else await resp.read()
            except (ClientError, asyncio.TimeoutError) as exc:
                return await self._decode_failed(request, call, f"{type(exc).__name__}: {exc}")
            if stream:
                out = await self._relay_stream(request, resp, call)
                complete = call.outcome == "served"
                return out
            complete = True
        finally:
            if resp is not None:
                # close, not release, unless finished: an unfinished upstream must see the
                # disconnect (vLLM aborts the request then).
                if complete:
                    resp.release()
                else:
                    resp.close()
        if resp.status == 200:
            call.outcome, call.status = "served", 200
            return web.Response(status=200, body=data, headers={"Content-Type": ctype, "X-Request-Id": call.request_id})
        return self._decode_error_response(call, resp.status, data)

    def _decode_error_response(self, call: _Call, status: int, data: bytes) -> web.Response:
        try:
            payload: Any = json.loads(data)
        except ValueError:
            payload = data.decode(errors="replace")
        call.outcome, call.status = "failed_decode", status
        call.decode_transport = status >= 500
        message = _upstream_message(payload)
        err = _upstream_error(payload) or {"message": message, "type": "decode_error", "code": status}
        if status >= 500:
            # vLLM says only "Internal server error" when the KV load failed; name the transfer
            # so its reason can be found in the engines' logs.
            err["message"] = f"decode failed on D ({message}); the KV transfer {call.transfer_id} may have failed"
            err["upstream_message"] = message
        call.reason = str(err["message"])
        err.update(request_id=call.request_id, transfer_id=call.transfer_id, leg="decode")
        self.log.warning(
            "router.decode_failed",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            decode_engine=call.decode_engine,
            status=status,
            reason=call.reason,
        )
        return web.json_response({"error": err}, status=status, headers={"X-Request-Id": call.request_id})

    async def _decode_failed(self, request: web.Request, call: _Call, why: str) -> web.StreamResponse:
        call.outcome = "failed_decode"
        call.reason = f"decode failed ({why})"
        call.decode_transport = True  # D unreachable, or its response broke off
        self.log.warning(
            "router.decode_failed",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            decode_engine=call.decode_engine,
            status=None,
            reason=call.reason,
        )
        return await self._answer_error(request, call, call.error(call.reason, "decode_error", 502, leg="decode"), 502)

    async def _relay_stream(self, request: web.Request, resp: ClientResponse, call: _Call) -> web.StreamResponse:
        """Forward D's SSE stream event by event (an injected error event never splits one)."""
        buf = bytearray()
        done = False
        while not done:
            try:
                chunk = await resp.content.readany()
            except (ClientError, asyncio.TimeoutError) as exc:
                return await self._decode_failed(request, call, f"D's stream broke: {type(exc).__name__}: {exc}")
            if not chunk:
                break
            buf += chunk
            while (event := _next_event(buf)) is not None:
                data = _event_data(event)
                if data == b"[DONE]":
                    done = True
                elif data.startswith(b"{") and b'"error"' in data and (err := self._decode_error_event(call, data)):
                    if call.out is None:
                        # Nothing sent yet: a real error status says it better than a stream.
                        return web.json_response(err, status=call.status, headers={"X-Request-Id": call.request_id})
                    event = b"data: " + json.dumps(err).encode() + b"\n\n"
                if call.out is None:
                    # Opened at D's first event, not its headers: a failure before that still
                    # gets a real error status.
                    call.out = web.StreamResponse(
                        status=200,
                        headers={
                            "Content-Type": resp.headers.get("Content-Type", _SSE),
                            "Cache-Control": "no-cache",
                            "X-Request-Id": call.request_id,
                        },
                    )
                    await call.out.prepare(request)
                await call.out.write(event)
                if call.first_event is None:
                    call.first_event = time.monotonic()
                if done:
                    break
        if not done:
            return await self._decode_failed(request, call, "D's stream ended before [DONE]")
        if call.outcome != "failed_decode":
            call.outcome, call.status = "served", 200
        assert call.out is not None
        await call.out.write_eof()
        return call.out

    def _decode_error_event(self, call: _Call, data: bytes) -> dict[str, Any] | None:
        """D's own error event (vLLM: "Internal server error" when the KV load failed), with
        the transfer named so its reason can be found in the engines' logs."""
        try:
            payload = json.loads(data)
        except ValueError:
            return None
        err = _upstream_error(payload)
        if err is None:
            return None
        message = str(err.get("message", ""))
        err["message"] = f"decode failed on D ({message}); the KV transfer {call.transfer_id} may have failed"
        err.update(upstream_message=message, request_id=call.request_id, transfer_id=call.transfer_id, leg="decode")
        code = err.get("code")
        call.outcome, call.reason = "failed_decode", err["message"]
        call.status = code if isinstance(code, int) and 400 <= code < 600 else 500
        call.decode_transport = call.status >= 500
        self.log.warning(
            "router.decode_failed",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            decode_engine=call.decode_engine,
            status=call.status,
            reason=call.reason,
        )
        return {"error": err}


_ENGINE_HELP = (
    "[NAME=]URL[@ENGINE_ID@HOST:PORT[@TP[@PP]]] of a prefill engine; repeat for several. NAME (default: the URL) "
    "names it in /admin/* and the logs; ENGINE_ID@HOST:PORT (its side channel) and its TP/PP sizes are what D "
    "needs in concurrent mode. Without them P's identity is discovered from a one-token warm-up completion."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--prefill", action="append", required=True, type=parse_engine, metavar="PREFILL", help=_ENGINE_HELP)
    p.add_argument(
        "--decode",
        action="append",
        required=True,
        type=parse_engine,
        metavar="DECODE",
        help="[NAME=]URL of a decode engine; repeat for several",
    )
    p.add_argument("--mode", choices=["concurrent", "sequential"], default="concurrent")
    p.add_argument("--prefill-engine-id", help="the (single) P's engine id, concurrent legs")
    p.add_argument("--prefill-side-channel", type=parse_endpoint, help="the (single) P's side channel host:port")
    p.add_argument("--prefill-tp", type=int, default=1, help="the (single) P's TP size (with --prefill-engine-id)")
    p.add_argument("--prefill-pp", type=int, default=1, help="the (single) P's PP size (with --prefill-engine-id)")
    p.add_argument(
        "--policy",
        choices=["least_outstanding", "prefix_affinity"],
        default="least_outstanding",
        help="how P and D are chosen (each independently) for a request",
    )
    p.add_argument(
        "--affinity-prefix",
        type=int,
        default=256,
        help="prefix_affinity: the key is the prompt's first N characters (token ids for a token prompt)",
    )
    p.add_argument(
        "--affinity-slack",
        type=int,
        default=4,
        help="prefix_affinity: fall back to least outstanding when the preferred engine has N more in flight",
    )
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between GET <url>/health; 0: off")
    p.add_argument("--health-timeout", type=float, default=5.0, help="seconds a health check may take (default 5)")
    p.add_argument(
        "--failure-threshold",
        type=int,
        default=3,
        help="failures in a row (health checks, transport errors of requests) that take an engine out",
    )
    p.add_argument("--no-discovery", action="store_true", help="never warm-up P to learn its identity")
    p.add_argument(
        "--admin-token",
        default=os.environ.get(ADMIN_TOKEN_ENV),
        help=f"bearer token /admin/* require (default: ${ADMIN_TOKEN_ENV}; unset: no check)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--prefill-grace",
        type=float,
        default=1.0,
        help="concurrent mode: seconds to wait for P's leg when D's fails first (a dead P), to retry it",
    )
    p.add_argument("--log-json", help="write router events as JSON lines here")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's configuration from its command line; ValueError for contradictory options."""
    prefills: list[EngineSpec] = list(args.prefill)
    decodes: list[EngineSpec] = list(args.decode)
    if args.prefill_engine_id or args.prefill_side_channel:
        if not (args.prefill_engine_id and args.prefill_side_channel):
            raise ValueError("--prefill-engine-id and --prefill-side-channel go together")
        if len(prefills) != 1:
            raise ValueError(
                "--prefill-engine-id/--prefill-side-channel name one P; with several, give each inline: "
                "--prefill URL@ENGINE_ID@HOST:PORT[@TP[@PP]]"
            )
        if prefills[0].identity is not None:
            raise ValueError("P's identity is given twice (inline and --prefill-engine-id)")
        host, port = args.prefill_side_channel
        identity = PrefillIdentity(args.prefill_engine_id, host, port, args.prefill_tp, args.prefill_pp)
        prefills[0] = replace(prefills[0], identity=identity)
    if any(d.identity is not None for d in decodes):
        raise ValueError("--decode takes [NAME=]URL only")
    if args.affinity_prefix < 1 or args.failure_threshold < 1:
        raise ValueError("--affinity-prefix and --failure-threshold must be at least 1")
    return RouterConfig(
        mode=args.mode,
        timeout=args.timeout,
        prefill_grace=args.prefill_grace,
        prefills=tuple(prefills),
        decodes=tuple(decodes),
        fleet=FleetConfig(
            policy=args.policy,
            affinity_prefix=args.affinity_prefix,
            affinity_slack=args.affinity_slack,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            failure_threshold=args.failure_threshold,
            discover=not args.no_discovery,
        ),
        admin_token=args.admin_token or None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pushactors router")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    if args.log_json:
        configure_logging(json_path=args.log_json)
    try:
        router = Router(config_from_args(args))
    except ValueError as exc:
        print(f"pushactors router: {exc}", file=sys.stderr)
        return 2
    web.run_app(router.app(), host=args.host, port=args.port, print=None, handler_cancellation=HANDLER_CANCELLATION)
    return 0
