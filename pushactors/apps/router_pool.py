"""The router's engines: a pool of P and a pool of D, their health checks, P identity discovery
and per-engine latency. The choosing itself is :mod:`pushactors.routing` (shared with the xPyD
simulation); this module adds the I/O around it.

* **Health**: every ``health_interval`` seconds a ``GET <url>/health`` per engine (HTTP 200 within
  ``health_timeout`` is healthy). An engine is up once a check passed: the first round runs
  before the router serves, and an engine it did not see healthy stays out until one does.
  ``failure_threshold`` failures in a row, health checks and requests that failed for transport
  reasons alike, take an engine out; one passed check brings it back. With health checks off,
  every engine starts up and request failures take nothing out (nothing would bring it back).
* **Routable**: up, not draining, and (P, with concurrent legs) of known identity —
  :meth:`Fleet.routable`. Requests go to routable engines (when a role has none, concurrent legs
  still probe the ones not draining: panic mode, :mod:`pushactors.routing`), and the router's
  own ``/health`` is 200 only while both roles have one (:meth:`Fleet.missing`).
* **Identity** (concurrent mode): D's leg names the P computing its prompt. Given on the command
  line, or discovered: a warm-up completion (one token, ``do_remote_decode``) whose response
  carries P's ``kv_transfer_params``, as pushactors' connector (and vLLM's own) returns them. A P
  with no known identity takes no concurrent legs; discovery retries with backoff, and runs again
  when P comes back up (a restarted P may have a new side-channel port) or when a P response
  names another identity than the one the router holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout

from ..routing import Engine, EnginePool, Policy, PrefillIdentity

WARMUP_PROMPT = "pushactors router warm-up"
_LATENCY_WINDOW = 1024  # legs per engine kept for the percentiles: recent, and cheap to sort
_GIVEN, _DISCOVERED = "given", "discovered"
_SEEN_UP = "seen_up"  # Engine.extra: a health check (or a request) has seen it up since the start


@dataclass(frozen=True)
class EngineSpec:
    """One engine as configured: its URL, its name (defaults to the URL), P's identity if given."""

    url: str
    name: str = ""
    identity: PrefillIdentity | None = None

    def label(self) -> str:
        return self.name or self.url


def parse_endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    return host, int(port)


def parse_engine(text: str) -> EngineSpec:
    """``[NAME=]URL[@ENGINE_ID@HOST:PORT[@TP[@PP]]]`` (the ``--prefill``/``--decode`` syntax)."""
    name = ""
    head, sep, rest = text.partition("=")
    if sep and "://" in rest and "/" not in head and ":" not in head:
        name, text = head, rest
    url, *ident = text.split("@")
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"expected [NAME=]http(s)://HOST:PORT[@ENGINE_ID@HOST:PORT[@TP[@PP]]], got {text!r}"
        )
    identity = None
    if ident:
        if not 2 <= len(ident) <= 4 or not ident[0]:
            raise argparse.ArgumentTypeError(f"expected URL@ENGINE_ID@HOST:PORT[@TP[@PP]], got {text!r}")
        host, port = parse_endpoint(ident[1])
        sizes = ident[2:]
        if not all(s.isdigit() and int(s) >= 1 for s in sizes):
            raise argparse.ArgumentTypeError(f"TP and PP sizes must be positive integers, got {text!r}")
        tp, pp = (int(s) for s in [*sizes, "1", "1"][:2])
        identity = PrefillIdentity(ident[0], host, port, tp, pp)
    return EngineSpec(url, name or url, identity)


def identity_from_params(params: Any) -> PrefillIdentity | None:
    """P's identity from the ``kv_transfer_params`` of its response (None if they name none).

    pushactors' connector returns ``remote_engine_id``, ``remote_host``, ``remote_port`` (its side
    channel), ``remote_tp_size``/``remote_pp_size`` and, as vLLM's own connectors name them,
    ``tp_size``/``pp_size``."""
    if not isinstance(params, dict):
        return None
    eid, host, port = params.get("remote_engine_id"), params.get("remote_host"), params.get("remote_port")
    tp = params.get("remote_tp_size", params.get("tp_size", 1))
    pp = params.get("remote_pp_size", params.get("pp_size", 1))
    if not (isinstance(eid, str) and eid and isinstance(host, str) and host):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (port, tp, pp)):
        return None
    assert isinstance(port, int) and isinstance(tp, int) and isinstance(pp, int)
    if port > 65535:
        return None
    return PrefillIdentity(eid, host, port, tp, pp)


class DiscoveryError(Exception):
    pass


class LatencyWindow:
    """The last few legs' durations; percentiles are computed when asked (admin calls are rare)."""

    def __init__(self, size: int = _LATENCY_WINDOW) -> None:
        self._ms: deque[float] = deque(maxlen=size)

    def add(self, ms: float) -> None:
        self._ms.append(ms)

    def summary(self) -> dict[str, Any]:
        values = sorted(self._ms)
        if not values:
            return {"n": 0, "p50": None, "p99": None}

        def pct(q: float) -> float:
            return round(values[min(len(values) - 1, int(q * len(values)))], 2)

        return {"n": len(values), "p50": pct(0.5), "p99": pct(0.99)}


@dataclass(frozen=True)
class FleetConfig:
    policy: Policy = "least_outstanding"
    affinity_prefix: int = 256  # characters of a text prompt, tokens of a token-id prompt
    affinity_slack: int = 4
    health_interval: float = 2.0  # seconds; 0 turns health checks off
    # vLLM answers /health from its API server, which a busy CPU engine can keep waiting.
    health_timeout: float = 5.0
    failure_threshold: int = 3
    discover: bool = True  # warm-up P engines whose identity was not given
    discovery_backoff: tuple[float, float] = (0.25, 10.0)  # first retry, longest wait
    warmup_timeout: float = 30.0


class Fleet:
    """Both pools and what keeps them current; runs on the router's event loop."""

    def __init__(
        self,
        prefills: Iterable[EngineSpec],
        decodes: Iterable[EngineSpec],
        config: FleetConfig,
        log: Any,
        *,
        need_identity: bool = False,
    ):
        self.config = config
        self.log = log
        self.need_identity = need_identity  # concurrent legs: D's leg names its P
        p_engines = [Engine(name=s.label(), url=s.url, role="prefill", identity=s.identity) for s in prefills]
        d_engines = [Engine(name=s.label(), url=s.url, role="decode") for s in decodes]
        if not p_engines or not d_engines:
            raise ValueError("the router needs at least one prefill and one decode engine")
        names = [e.name for e in p_engines + d_engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique across P and D (name=URL to rename): {names}")
        for e in p_engines:
            e.extra["identity_source"] = _GIVEN if e.identity is not None else _DISCOVERED
        if config.health_interval > 0:
            for e in p_engines + d_engines:
                e.up = False  # until a health check sees it up: never routable on faith
                e.extra[_SEEN_UP] = False
        kw: dict[str, Any] = dict(
            policy=config.policy, failure_threshold=config.failure_threshold, affinity_slack=config.affinity_slack
        )
        self.prefill = EnginePool(p_engines, **kw)
        self.decode = EnginePool(d_engines, **kw)
        self.latency = {e.name: LatencyWindow() for e in p_engines + d_engines}
        self._session: ClientSession | None = None
        self._discovery_on = False
        self._health: asyncio.Task[None] | None = None
        self._discovery: dict[str, asyncio.Task[None]] = {}

    @property
    def engines(self) -> list[Engine]:
        return self.prefill.engines + self.decode.engines

    def get(self, name: str) -> Engine | None:
        return self.prefill.get(name) or self.decode.get(name)

    def pool(self, engine: Engine) -> EnginePool:
        return self.prefill if engine.role == "prefill" else self.decode

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self, session: ClientSession, *, discover: bool) -> None:
        """Check every engine once (before the router serves: the engines it finds healthy are
        routable at once), then keep checking and discover P identities in the background."""
        self._session = session
        if self.config.health_interval > 0:
            await self.check_all()
            self._health = asyncio.create_task(self._health_loop())
        self._discovery_on = discover and self.config.discover
        if self._discovery_on:
            for e in self.prefill.engines:
                if e.identity is None:
                    self.rediscover(e)

    async def stop(self) -> None:
        tasks = [t for t in [self._health, *self._discovery.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- choosing and releasing ----------------------------------------------------------------
    def key(self, body: dict[str, Any]) -> str | None:
        """The prefix-affinity key: the prompt's first ``affinity_prefix`` characters (or token ids)."""
        if self.config.policy != "prefix_affinity":
            return None
        prompt = body.get("prompt")
        messages = body.get("messages")
        if prompt is None and isinstance(messages, list):
            # A chat: the conversation so far, as text (its start is what a prefix cache shares).
            prompt = json.dumps(messages, sort_keys=True, separators=(",", ":"))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt
        n = self.config.affinity_prefix
        if isinstance(prompt, str):
            return prompt[:n]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:n]):
            return ",".join(map(str, prompt[:n]))
        return None

    def pick_prefill(self, key: str | None, *, need_identity: bool, exclude: Iterable[Engine] = ()) -> Engine | None:
        skip = list(exclude)
        if need_identity:
            skip += [e for e in self.prefill.engines if e.identity is None]
        return self.prefill.pick(key, exclude=skip)

    def routable(self, pool: EnginePool) -> list[Engine]:
        """The engines of ``pool`` a request is routed to: up, not draining, and for P with
        concurrent legs, of known identity. The router's ``/health`` and its routing both ask
        this (a role without one: ``/health`` is 503, and a request gets the same 503 unless its
        legs may probe the engines marked down, see :mod:`pushactors.routing`)."""
        need = self.need_identity and pool is self.prefill
        return [e for e in pool.eligible() if e.identity is not None or not need]

    def missing(self) -> dict[str, str]:
        """Role -> why it has no routable engine (the message a request's 503 carries); empty
        when the router can route."""
        out: dict[str, str] = {}
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            if not self.routable(pool):
                out[role] = self.unavailable(pool, need_identity=self.need_identity and pool is self.prefill)
        return out

    def release(
        self,
        engine: Engine,
        *,
        ok: bool = False,
        error: str = "",
        transport: bool = False,
        cancelled: bool = False,
        ms: float | None = None,
    ) -> None:
        if ok and ms is not None:
            self.latency[engine.name].add(ms)
        # Without health checks nothing would bring an engine back: request failures take none out.
        transport = transport and self.config.health_interval > 0
        was_up = engine.up
        self.pool(engine).release(engine, ok=ok, error=error, transport=transport, cancelled=cancelled)
        if engine.up:
            engine.extra[_SEEN_UP] = True  # a request it served brought it up (panic mode)
        if was_up and not engine.up:
            self.log.warning("router.engine_down", engine=engine.name, role=engine.role, reason=error[:300])

    def unavailable(self, pool: EnginePool, *, need_identity: bool = False) -> str:
        """Why ``pool`` has no engine to offer, for the client's error message."""
        es = pool.engines
        unseen = sum(not e.up and not e.extra.get(_SEEN_UP, True) for e in es)
        down = sum(not e.up for e in es) - unseen
        draining = sum(e.draining for e in es)
        unknown = sum(e.identity is None and e.eligible for e in es) if need_identity else 0
        parts = [f"{down} down", f"{draining} draining"]
        parts += [f"{unseen} not seen healthy yet"] if unseen else []
        parts += [f"{unknown} with no known identity yet"] if unknown else []
        role = es[0].role
        return f"no {role} engine available ({len(es)} configured: {', '.join(parts)})"

    # --- identity ------------------------------------------------------------------------------
    def observe_identity(self, engine: Engine, params: Any) -> None:
        """P's response names P: a discovered identity that no longer matches is replaced (P
        restarted between two health checks); a given one is only reported."""
        seen = identity_from_params(params)
        if seen is None or seen == engine.identity:
            return
        if engine.extra.get("identity_source") == _DISCOVERED:
            self.log.warning(
                "router.identity_changed", engine=engine.name, old=_describe(engine.identity), new=_describe(seen)
            )
            engine.identity = seen
        else:
            self.log.warning(
                "router.identity_mismatch",
                engine=engine.name,
                given=_describe(engine.identity),
                seen=_describe(seen),
                reason="P's response names another identity than the one given on the command line",
            )

    def rediscover(self, engine: Engine) -> None:
        """(Re)start discovery of ``engine`` at once; until it succeeds P takes no concurrent legs."""
        if not self._discovery_on or engine.extra.get("identity_source") != _DISCOVERED:
            return
        engine.identity = None
        old = self._discovery.pop(engine.name, None)
        if old is not None:
            old.cancel()
        self._discovery[engine.name] = asyncio.create_task(self._discover(engine))

    def discovering(self, engine: Engine) -> bool:
        task = self._discovery.get(engine.name)
        return task is not None and not task.done()

    async def _discover(self, engine: Engine) -> None:
        delay, longest = self.config.discovery_backoff
        attempt = 0
        while engine.identity is None:
            attempt += 1
            try:
                identity = await self.warm_up(engine)
            except DiscoveryError as exc:
                engine.extra["discovery_error"] = str(exc)[:300]
                self.log.warning(
                    "router.discovery_failed", engine=engine.name, attempt=attempt, retry_in=delay, reason=str(exc)
                )
                await asyncio.sleep(delay)  # backoff before the next warm-up
                delay = min(delay * 2, longest)
                continue
            engine.identity = identity
            engine.extra.pop("discovery_error", None)
            self.log.info("router.discovered", engine=engine.name, attempt=attempt, identity=_describe(identity))

    async def warm_up(self, engine: Engine) -> PrefillIdentity:
        """One-token completion asking for a remote decode: P's response names P."""
        assert self._session is not None
        body: dict[str, Any] = {
            "prompt": WARMUP_PROMPT,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        timeout = ClientTimeout(total=self.config.warmup_timeout)
        try:
            model = await self._model(engine, timeout)
            if model is not None:
                body["model"] = model
            async with self._session.post(
                f"{engine.url}/v1/completions",
                json=body,
                headers={"X-Request-Id": f"router-warmup-{secrets.token_hex(8)}"},
                timeout=timeout,
            ) as resp:
                text = await resp.text()
                status = resp.status
        except (ClientError, asyncio.TimeoutError) as exc:
            raise DiscoveryError(f"warm-up failed: {type(exc).__name__}: {exc}") from None
        if status != 200:
            raise DiscoveryError(f"warm-up answered HTTP {status}: {text[:200]}")
        try:
            payload = json.loads(text)
        except ValueError:
            raise DiscoveryError(f"warm-up answer is not JSON: {text[:200]!r}") from None
        params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        identity = identity_from_params(params)
        if identity is None:
            raise DiscoveryError(
                "P's warm-up response names no engine (kv_transfer_params without remote_engine_id, remote_host, "
                f"remote_port): is its kv connector pushactors with kv_role kv_producer? got {params!r}"[:300]
            )
        return identity

    async def _model(self, engine: Engine, timeout: ClientTimeout) -> str | None:
        """The served model's name (vLLM may require it); None where the engine does not say."""
        assert self._session is not None
        try:
            async with self._session.get(f"{engine.url}/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                payload = await resp.json(content_type=None)
        except (ClientError, asyncio.TimeoutError, ValueError):
            return None
        data = payload.get("data") if isinstance(payload, dict) else None
        if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
            return str(data[0]["id"])
        return None

    # --- health --------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)  # the check period, not a wait for a condition
            await self.check_all()

    async def check_all(self) -> None:
        """One health check of every engine, at once."""
        # return_exceptions: one check that raises something unexpected must not end the loop
        # (engines marked down would then never come back).
        results = await asyncio.gather(*(self.check(e) for e in self.engines), return_exceptions=True)
        for engine, result in zip(self.engines, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                self.log.warning("router.health_check_error", engine=engine.name, error=repr(result)[:300])

    async def check(self, engine: Engine) -> None:
        """One health check of ``engine``; a P back up is discovered again."""
        assert self._session is not None
        try:
            async with self._session.get(
                f"{engine.url}/health", timeout=ClientTimeout(total=self.config.health_timeout)
            ) as resp:
                ok, error = resp.status == 200, f"health check: HTTP {resp.status}"
        except (ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, error = False, f"health check: {type(exc).__name__}: {exc}"
        engine.extra["health_checks"] = engine.extra.get("health_checks", 0) + 1
        changed = self.pool(engine).health(engine, ok, "" if ok else error)
        if ok:
            engine.extra[_SEEN_UP] = True
        if not changed:
            return
        if engine.up:
            self.log.info("router.engine_up", engine=engine.name, role=engine.role)
            if engine.role == "prefill":
                self.rediscover(engine)  # a restarted P may have a new identity (side-channel port)
        else:
            self.log.warning("router.engine_down", engine=engine.name, role=engine.role, reason=error)

    # --- reporting -----------------------------------------------------------------------------
    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for role, pool in (("prefill", self.prefill), ("decode", self.decode)):
            rows = []
            for engine, row in zip(pool.engines, pool.snapshot(), strict=True):
                row["latency_ms"] = self.latency[engine.name].summary()
                row["health_checks"] = engine.extra.get("health_checks", 0)
                row["seen_healthy"] = engine.extra.get(_SEEN_UP, True)
                if role == "prefill":
                    row["identity_source"] = engine.extra.get("identity_source")
                    row["discovering"] = self.discovering(engine)
                    if "discovery_error" in engine.extra:
                        row["discovery_error"] = engine.extra["discovery_error"]
                rows.append(row)
            out[role] = rows
        return out


def _describe(identity: PrefillIdentity | None) -> str | None:
    if identity is None:
        return None
    return f"{identity.engine_id}@{identity.host}:{identity.port} tp={identity.tp_size} pp={identity.pp_size}"
