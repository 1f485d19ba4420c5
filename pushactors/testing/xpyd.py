"""A simulated xPyD deployment: N prefill and M decode engines over one fake fabric, in one process.

Every engine is a :class:`~pushactors.testing.engine.SimEngine` (its own PushScheduler, one
PushWorker and actor system per TP rank); all of them share one :class:`FakeFabric` (with
``copy=True`` WRITEs move real bytes) and one :class:`InProcessDirectory` (the side channels).
Engine ids are ``prefill-i`` and ``decode-j``; TP may differ per engine.

:class:`XpydSim` plays the router: per request it picks a P and a D from two
:class:`~pushactors.routing.EnginePool` s (the router's own bookkeeping, least outstanding by
default), sends both legs at once (``D.expect`` with P's decode params, ``P.prefill``), steps
every engine, collects what finished or failed, checks every landed request's bytes on D
(:meth:`SimEngine.verify`), frees D's blocks and releases the pool leases when a leg ends. It
keeps ``in_flight`` requests going at once until ``requests`` were served. :meth:`XpydSim.warm_up`
first pushes one request per (P, D) pair outside the pools, so a measured run starts with every
handshake done.

Legs and leases: a request's P leg ends when P reports its push (finished sending, or failed);
its D leg when D reports the KV landed or failed. Each leg holds its pool's lease until then, so
"outstanding" is what each engine still works on.

:meth:`XpydSim.kill_prefill` kills a P engine the way a process dies: from then on its side
channel refuses, NIXL notifications to its agents fail with "remote disconnected", nothing its
agents send arrives and no WRITE of theirs lands; it is no longer stepped and its actors are
stopped in the background. The router sees every P leg it had open there break (released as
transport failures, which takes the engine out of its pool) and connections to it refused. D
learns of the death through its heartbeats (and registrations) to that P and fails the requests
waiting on it; every other request must still land byte-exact.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.config import PushConfig
from ..routing import Engine as PoolEngine
from ..routing import EnginePool, Policy, PrefillIdentity
from ..transport.directory import DirectoryEndpoint, InProcessDirectory
from .engine import SimEngine, SimSpec
from .fabric import FakeFabric
from .faults import FaultContext

# Short timings so that a dead P is noticed within about a second, and safe by the library's own
# rule (abort_quarantine >= 2/3 lease + write_timeout + 2 ticks). Leases and the registration
# watchdog are long enough for thousands of requests queued on two cores. Writers poll the fake
# fabric every 1 ms when busy (not 0.2 ms): with 16+ ranks' writers in one process the tight
# default mostly contends for the GIL, and makes engines' throughput (so least-outstanding's
# per-engine counts) depend on thread scheduling (2,000 requests on a loaded 2-core machine:
# P spread 10-19% with the default, 3-11% with this).
SIM_CONFIG: dict[str, Any] = {
    "poll_interval_busy": 0.001,
    "poll_busy_linger": 0.01,
    "reaper_tick": 0.02,
    "lease_duration": 10.0,
    "heartbeat_interval": 0.25,
    "registration_timeout": 60.0,
    "write_timeout": 5.0,
    "abort_quarantine": 12.0,
    "handshake_timeout": 5.0,
    "stats_interval": 0.0,
}

TpSpec = int | Sequence[int]


def sim_spec(in_flight: int, engines: int, *, tokens: int = 40, block_size: int = 16, **spec: Any) -> SimSpec:
    """A small-KV :class:`SimSpec` whose pool holds an engine's fair share of ``in_flight``
    requests of ``tokens`` tokens four times over (leases end a little after the request)."""
    per_request = max(1, -(-tokens // block_size))
    share = -(-in_flight // max(1, engines))
    defaults: dict[str, Any] = {"num_layers": 2, "block_bytes": 256, "block_size": block_size}
    defaults.update(spec)
    return SimSpec(num_blocks=max(64, 4 * share * per_request + 64), **defaults)


@dataclass
class SimRequest:
    """One router request and the fate of its two legs."""

    n: int
    p: PoolEngine
    d: PoolEngine | None
    p_id: str
    d_id: str
    tokens: int
    started: float
    p_open: bool = True  # the P lease is held
    d_open: bool = False  # the D lease is held
    landed: bool = False
    failure: str | None = None
    ended: float | None = None
    checked: int = 0
    wrong: int = 0

    @property
    def done(self) -> bool:
        return not (self.p_open or self.d_open)


@dataclass
class XpydResult:
    """What one :meth:`XpydSim.run` did."""

    requests: int
    landed: int
    failed: dict[str, str]  # request key -> reason
    failed_on: dict[str, str]  # request key -> the P engine it was sent to
    bytes_checked: int
    bytes_wrong: int
    wrong_requests: list[str]
    per_prefill: dict[str, int]  # requests sent to each P engine (this run)
    per_decode: dict[str, int]
    wall_s: float
    max_in_flight: int
    latencies: list[float] = field(default_factory=list)  # per landed request, seconds

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else 0.0

    @staticmethod
    def spread(counts: Mapping[str, int]) -> float:
        """The largest relative distance of any engine's count from the mean (0.05: within 5%)."""
        values = list(counts.values())
        if not values:
            return 0.0
        mean = sum(values) / len(values)
        return max(abs(v - mean) for v in values) / mean if mean else 0.0

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def q(x: float) -> float:
            return lat[min(len(lat) - 1, int(x * len(lat)))] if lat else 0.0

        return {
            "requests": self.requests,
            "landed": self.landed,
            "failed": len(self.failed),
            "bytes_checked": self.bytes_checked,
            "bytes_wrong": self.bytes_wrong,
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(self.requests_per_s, 1),
            "max_in_flight": self.max_in_flight,
            "prefill_spread": round(self.spread(self.per_prefill), 4),
            "decode_spread": round(self.spread(self.per_decode), 4),
            "latency_p50_ms": round(q(0.5) * 1e3, 2),
            "latency_p99_ms": round(q(0.99) * 1e3, 2),
            "per_prefill": dict(self.per_prefill),
            "per_decode": dict(self.per_decode),
        }


def _tps(tp: TpSpec, n: int, what: str) -> list[int]:
    if isinstance(tp, int):
        return [tp] * n
    sizes = list(tp)
    if len(sizes) != n:
        raise ValueError(f"{what}: {len(sizes)} TP sizes for {n} engines")
    return sizes


class XpydSim:
    """N P and M D :class:`SimEngine` s on one fake fabric, and a router over them."""

    def __init__(
        self,
        n_p: int = 8,
        n_d: int = 8,
        *,
        p_tp: TpSpec = 1,
        d_tp: TpSpec = 1,
        spec: SimSpec | None = None,
        p_spec: SimSpec | None = None,
        d_spec: SimSpec | None = None,
        config: Mapping[str, Any] | None = None,
        policy: Policy = "least_outstanding",
        failure_threshold: int = 3,
        fabric: FakeFabric | None = None,
        seed: int = 0,
    ) -> None:
        if n_p < 1 or n_d < 1:
            raise ValueError("an xPyD deployment needs at least one P and one D engine")
        self.fabric = fabric or FakeFabric(copy=True)
        self.directory = InProcessDirectory()
        self.settings = {**SIM_CONFIG, **(config or {})}
        base = spec or SimSpec(num_layers=2, block_bytes=256, num_blocks=1024)
        p_spec, d_spec = p_spec or base, d_spec or base
        self.prefills: dict[str, SimEngine] = {}
        self.decodes: dict[str, SimEngine] = {}
        self.endpoints: dict[str, DirectoryEndpoint] = {}
        self.dead: set[str] = set()
        self.rng = random.Random(seed)
        self._killers: list[threading.Thread] = []
        self._down_at: dict[str, int] = {}  # P name -> its pool's `chosen` when it went down
        self.killed_at: dict[str, float] = {}
        try:
            for i, tp in enumerate(_tps(p_tp, n_p, "p_tp")):
                self.prefills[f"prefill-{i}"] = self._engine(f"prefill-{i}", "producer", tp, p_spec, seed + i)
            for j, tp in enumerate(_tps(d_tp, n_d, "d_tp")):
                self.decodes[f"decode-{j}"] = self._engine(f"decode-{j}", "consumer", tp, d_spec, seed + 1000 + j)
        except BaseException:
            self.close()
            raise
        p_engines = []
        for name, e in self.prefills.items():
            ep = self.endpoints[name]
            identity = PrefillIdentity(name, ep.host, ep.port, e.tp_size, e.pp_size)
            p_engines.append(PoolEngine(name, f"sim://{name}", "prefill", identity=identity))
        d_engines = [PoolEngine(name, f"sim://{name}", "decode") for name in self.decodes]
        self.p_pool = EnginePool(p_engines, policy=policy, failure_threshold=failure_threshold)
        self.d_pool = EnginePool(d_engines, policy=policy, failure_threshold=failure_threshold)
        self.requests: dict[str, SimRequest] = {}  # key -> request, every run
        self._by_p: dict[tuple[str, str], SimRequest] = {}  # (P engine, P id) -> open P leg
        self._by_d: dict[tuple[str, str], SimRequest] = {}  # (D engine, D id) -> open D leg
        self._next = 0

    def _engine(self, name: str, role: Literal["producer", "consumer"], tp: int, spec: SimSpec, seed: int) -> SimEngine:
        endpoint = self.directory.endpoint(f"{name}-host")
        self.endpoints[name] = endpoint
        return SimEngine(
            PushConfig(engine_id=name, role=role, **self.settings),
            agent_factory=self.fabric,
            source=self.directory,
            publisher_for_rank=lambda _r: endpoint,
            tp_size=tp,
            spec=spec,
            seed=seed,
        )

    # --- engines -----------------------------------------------------------------------------
    @property
    def engines(self) -> dict[str, SimEngine]:
        return {**self.prefills, **self.decodes}

    @property
    def live(self) -> list[SimEngine]:
        return [e for name, e in self.engines.items() if name not in self.dead]

    def agents_of(self, name: str) -> set[str]:
        e = self.engines[name]
        return {f"{name}-pp{pp}-tp{tp}" for pp, tp in e.ranks}

    def kill_prefill(self, i: int | str) -> str:
        """Kill P engine ``i`` (index or name) as if its process died; returns its name."""
        name = i if isinstance(i, str) else f"prefill-{i}"
        engine = self.prefills[name]
        if name in self.dead:
            return name
        agents = self.agents_of(name)
        ep = self.endpoints[name]

        def to_it(ctx: FaultContext) -> bool:
            return ctx.dst in agents

        def from_it(ctx: FaultContext) -> bool:
            return ctx.src in agents

        faults = self.fabric.faults
        faults.disconnect_notif(match=to_it, times=None)  # D's heartbeats, registrations, aborts
        faults.err_transfer(match=from_it, times=None)  # no WRITE of the dead process lands
        faults.drop_notif(match=from_it, times=None)  # nor any notification of it
        self.directory.refused.add((ep.host, ep.port))
        self.dead.add(name)
        self.killed_at[name] = time.monotonic()
        # The router's connections to it break: every open P leg there fails as a transport error.
        pool_engine = self.p_pool.get(name)
        assert pool_engine is not None
        for (p_name, _), req in list(self._by_p.items()):
            if p_name == name:
                self._end_p(req, "connection to P lost: engine killed", transport=True)
        self._note_down(pool_engine)
        # Its actors go away on their own (nothing they do reaches anyone any more).
        t = threading.Thread(target=engine.shutdown, args=(5.0,), name=f"xpyd-kill-{name}", daemon=True)
        t.start()
        self._killers.append(t)
        return name

    def chosen_after_down(self, name: str) -> int | None:
        """Requests the P pool sent to ``name`` after it went down (None: it never did)."""
        at = self._down_at.get(name)
        e = self.p_pool.get(name)
        return None if at is None or e is None else e.chosen - at

    def _note_down(self, engine: PoolEngine) -> None:
        if not engine.up and engine.name not in self._down_at:
            self._down_at[engine.name] = engine.chosen

    # --- warming up -----------------------------------------------------------------------------
    def warm_up(self, *, tokens: int = 16, timeout: float = 60.0) -> int:
        """One request per (P, D) pair, outside the pools, so that every handshake is done
        before a measured run: otherwise the pairs that handshake last start late, and a short
        run's per-engine counts show that start-up rather than the selection policy. Returns the
        bytes checked; AssertionError if any pair failed or wrote a wrong byte."""
        legs: list[tuple[SimEngine, str, SimEngine, str]] = []
        for p_name, prefill in self.prefills.items():
            if p_name in self.dead:
                continue
            for d_name, decode in self.decodes.items():
                key = f"warm-{p_name}-{d_name}"
                p_id, d_id = f"{key}-aaaaaaaa", f"{key}-bbbbbbbb"
                decode.expect(d_id, tokens, prefill.scheduler.decode_params(p_id), key=key)
                prefill.prefill(p_id, tokens, key=key)
                legs.append((prefill, p_id, decode, d_id))
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while not all(p_id in p.sent and d_id in d.received for p, p_id, d, d_id in legs):
            if time.monotonic() > deadline:
                raise AssertionError(f"warm-up did not finish within {timeout}s")
            self.step()
            pause.wait(0.0005)
        checked = 0
        for p, p_id, d, d_id in legs:
            if p.sent[p_id] is not None or d.received[d_id] is not None:
                raise AssertionError(f"warm-up {d_id} failed: P {p.sent[p_id]!r}, D {d.received[d_id]!r}")
            got, wrong = d.verify(d_id)
            if wrong:
                raise AssertionError(f"warm-up {d_id}: {wrong} wrong bytes")
            checked += got
            d.finish_recv(d_id)
        return checked

    # --- the router ----------------------------------------------------------------------------
    def _dispatch(self, tokens: int) -> SimRequest | None:
        """Start one request: pick P (and D), send both legs. None when no engine is eligible."""
        n = self._next
        key = f"req{n}"
        p = self.p_pool.pick(key)
        if p is None:
            return None
        self._next += 1
        now = time.monotonic()
        req = SimRequest(n, p, None, f"{key}-aaaaaaaa", f"{key}-bbbbbbbb", tokens, now)
        self.requests[key] = req
        self._by_p[(p.name, req.p_id)] = req
        if p.name in self.dead:  # connection refused: fails at once, counts against P's health
            self._end_p(req, "connection to P refused", transport=True)
            self._note_down(p)
            return req
        d = self.d_pool.pick(key)
        if d is None:
            self._end_p(req, "no decode engine available", transport=False)
            return req
        req.d, req.d_open = d, True
        self._by_d[(d.name, req.d_id)] = req
        prefill, decode = self.prefills[p.name], self.decodes[d.name]
        need = prefill.blocks_for(tokens), decode.blocks_for(tokens)
        if prefill.free_blocks < need[0] or decode.free_blocks < need[1]:
            # The pools are too small for this load (see sim_spec): both legs are refused.
            why = f"out of blocks: {p.name} has {prefill.free_blocks}, {d.name} {decode.free_blocks}, need {need}"
            req.d_open = False
            self._by_d.pop((d.name, req.d_id), None)
            self.d_pool.release(d, ok=False, error=why)
            self._fail(req, why)
            self._end_p(req, why, transport=False)
            return req
        decode.expect(req.d_id, tokens, prefill.scheduler.decode_params(req.p_id), key=key)
        prefill.prefill(req.p_id, tokens, key=key)
        return req

    def _fail(self, req: SimRequest, reason: str) -> None:
        if req.failure is None and not req.landed:
            req.failure = reason

    def _end_p(self, req: SimRequest, failure: str | None, *, transport: bool = False) -> None:
        if not req.p_open:
            return
        req.p_open = False
        self._by_p.pop((req.p.name, req.p_id), None)
        self.p_pool.release(req.p, ok=failure is None, error=failure or "", transport=transport)
        if failure is not None and req.d is None:
            self._fail(req, failure)
        self._maybe_ended(req)

    def _end_d(self, req: SimRequest, failure: str | None, *, ok: bool) -> None:
        if not req.d_open or req.d is None:
            return
        req.d_open = False
        self._by_d.pop((req.d.name, req.d_id), None)
        decode = self.decodes[req.d.name]
        if failure is None:
            req.checked, req.wrong = decode.verify(req.d_id)
            req.landed = True
        else:
            self._fail(req, failure)
        if req.d_id in decode.recvs:
            decode.finish_recv(req.d_id)
        self.d_pool.release(req.d, ok=ok, error=failure or "")
        self._maybe_ended(req)

    def _maybe_ended(self, req: SimRequest) -> None:
        if req.done and req.ended is None:
            req.ended = time.monotonic()

    def step(self) -> int:
        """Step every live engine once and account for what it reported; returns the number of
        leg reports handled."""
        handled = 0
        for name, engine in list(self.prefills.items()):
            if name in self.dead:
                continue
            rep = engine.step()
            for rid in rep.finished_sending:
                req = self._by_p.get((name, rid))
                if req is not None:
                    handled += 1
                    self._end_p(req, rep.failed_sending.get(rid))
        for name, engine in self.decodes.items():
            rep = engine.step()
            for rid in rep.finished_recving:
                req = self._by_d.get((name, rid))
                if req is not None:
                    handled += 1
                    self._end_d(req, None, ok=True)
            for rid, why in rep.failed_recving.items():
                req = self._by_d.get((name, rid))
                if req is not None:
                    handled += 1
                    self._end_d(req, why, ok=False)
        return handled

    def run(
        self,
        requests: int,
        *,
        in_flight: int = 2000,
        tokens: int | tuple[int, int] = 40,
        timeout: float = 300.0,
        at: Mapping[int, Callable[[], object]] | None = None,
        on_progress: Callable[[int, int], object] | None = None,
        progress_every: float = 0.5,
    ) -> XpydResult:
        """Serve ``requests`` requests, ``in_flight`` at once at most, and wait until every leg
        ended. ``tokens``: every prompt's length, or a (low, high) range drawn per request.
        ``at``: actions run once when that many requests of this run were dispatched (e.g.
        ``{5000: lambda: sim.kill_prefill(3)}``). ``on_progress(ended, dispatched)`` is called
        every ``progress_every`` seconds. Raises AssertionError past ``timeout``."""
        actions = sorted((at or {}).items())
        chosen_p = {e.name: e.chosen for e in self.p_pool.engines}
        chosen_d = {e.name: e.chosen for e in self.d_pool.engines}
        mine: list[SimRequest] = []
        open_now: list[SimRequest] = []
        start = time.monotonic()
        deadline = start + timeout
        pause = threading.Event()
        peak = 0
        next_report = start + progress_every
        while True:
            while actions and len(mine) >= actions[0][0]:
                actions.pop(0)[1]()
            open_now = [r for r in open_now if not r.done]
            admitted = 0
            while len(mine) < requests and len(open_now) < in_flight:
                if actions and len(mine) >= actions[0][0]:
                    break
                n = tokens if isinstance(tokens, int) else self.rng.randint(*tokens)
                req = self._dispatch(n)
                if req is None:
                    break
                mine.append(req)
                admitted += 1
                if not req.done:
                    open_now.append(req)
            peak = max(peak, len(open_now))
            handled = self.step()
            if len(mine) >= requests and not actions and all(r.done for r in open_now):
                break
            now = time.monotonic()
            if on_progress is not None and now >= next_report:
                next_report = now + progress_every
                on_progress(len(mine) - sum(not r.done for r in open_now), len(mine))
            if now > deadline:
                stuck = [r for r in open_now if not r.done]
                raise AssertionError(
                    f"xPyD run timed out after {timeout}s: {len(mine)}/{requests} dispatched, "
                    f"{len(stuck)} open, e.g. {[(r.p_id, r.p.name, r.d.name if r.d else None) for r in stuck[:5]]}"
                )
            if not handled and not admitted:
                pause.wait(0.0005)  # let the actors run
        wall = time.monotonic() - start
        failed = {f"req{r.n}": r.failure or "?" for r in mine if not r.landed}
        return XpydResult(
            requests=len(mine),
            landed=sum(r.landed for r in mine),
            failed=failed,
            failed_on={f"req{r.n}": r.p.name for r in mine if not r.landed},
            bytes_checked=sum(r.checked for r in mine),
            bytes_wrong=sum(r.wrong for r in mine),
            wrong_requests=[f"req{r.n}" for r in mine if r.wrong],
            per_prefill={e.name: e.chosen - chosen_p[e.name] for e in self.p_pool.engines},
            per_decode={e.name: e.chosen - chosen_d[e.name] for e in self.d_pool.engines},
            wall_s=wall,
            max_in_flight=peak,
            latencies=[r.ended - r.started for r in mine if r.landed and r.ended is not None],
        )

    # --- the end -----------------------------------------------------------------------------
    def settled(self) -> bool:
        """No lease, watchdog or staged work left on any live engine."""
        return not any(e.has_pending_push_work() for e in self.live)

    def settle(self, timeout: float = 30.0) -> None:
        """Step the live engines until :meth:`settled` (AssertionError past ``timeout``)."""
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while True:
            self.step()
            if self.settled():
                return
            if time.monotonic() > deadline:
                busy = {e.config.engine_id: e.scheduler.pending() for e in self.live if e.has_pending_push_work()}
                raise AssertionError(f"engines did not settle within {timeout}s: {busy}")
            pause.wait(0.001)

    def leaks(self) -> list[str]:
        """Everything still held after a settled run: blocks, leases, open legs, pool load."""
        out: list[str] = []
        for name, e in self.engines.items():
            if name in self.dead:
                continue
            if e.held:
                out.append(f"{name} holds P leases {sorted(e.held)[:5]}")
            if e.recvs:
                out.append(f"{name} holds D requests {sorted(e.recvs)[:5]}")
            if e.free_blocks != e.spec.num_blocks:
                out.append(f"{name}: {e.spec.num_blocks - e.free_blocks} blocks not freed")
            for w in e.workers:
                if w.pending() != (0, 0):
                    out.append(f"{name} rank {w.ctx.tp_rank} pending {w.pending()}")
            if e.duplicate_reports:
                out.append(f"{name}: {e.duplicate_reports} duplicate reports")
        if self._by_p or self._by_d:
            out.append(f"open legs: {len(self._by_p)} P, {len(self._by_d)} D")
        for pool in (self.p_pool, self.d_pool):
            for pe in pool.engines:
                if pe.outstanding:
                    out.append(f"pool engine {pe.name} still has {pe.outstanding} outstanding")
        return out

    def close(self, timeout: float = 10.0) -> None:
        threads = [
            threading.Thread(target=e.shutdown, args=(timeout,), name=f"xpyd-close-{n}", daemon=True)
            for n, e in self.engines.items()
            if n not in self.dead
        ]
        for t in threads:
            t.start()
        for t in [*threads, *self._killers]:
            t.join(timeout + 5.0)

    def __enter__(self) -> XpydSim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["SIM_CONFIG", "SimRequest", "XpydResult", "XpydSim", "sim_spec"]
