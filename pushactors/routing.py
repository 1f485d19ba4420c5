"""Choosing engines for requests: a pool of P or D engines with health, draining and load.

Pure bookkeeping (no I/O, no event loop), shared by ``pushactors router`` and the xPyD
simulation so that what the simulation measures is what the router does.

* **least outstanding** (default): the eligible engine with the fewest requests in flight; ties
  go round-robin, so equal engines share evenly even at low load;
* **prefix affinity**: a request key (e.g. the prompt's first tokens) picks its engine by
  rendezvous hashing, so requests sharing a prefix land where its KV may be cached; the choice
  falls back to least outstanding when that engine carries ``affinity_slack`` more requests
  than the least loaded one (affinity must not build hot spots).

An engine is eligible while it is up and not draining. Health: ``failure_threshold`` failures in a
row (a failed health check or a request that failed for transport reasons) take it out; one
success brings it back. Draining (rolling restarts) stops new requests; those in flight finish.
When every engine that is not draining is down, requests still go to them (panic mode, as in
Envoy): a health check that is wrong must not refuse every request.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

Policy = Literal["least_outstanding", "prefix_affinity"]


@dataclass(frozen=True)
class PrefillIdentity:
    """What D needs to reach a P engine: its engine id, side channel and parallel sizes."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1


@dataclass(eq=False)
class Engine:
    """One engine behind the router, and what the pool knows about it."""

    name: str
    url: str
    role: Literal["prefill", "decode"]
    identity: PrefillIdentity | None = None  # P: discovered or given
    outstanding: int = 0
    up: bool = True
    draining: bool = False
    chosen: int = 0
    succeeded: int = 0
    failed: int = 0
    consecutive_failures: int = 0
    last_error: str = ""
    cancelled: int = 0  # abandoned (client left, or the other leg made it moot): no verdict
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def eligible(self) -> bool:
        return self.up and not self.draining

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "url": self.url,
            "role": self.role,
            "up": self.up,
            "draining": self.draining,
            "outstanding": self.outstanding,
            "chosen": self.chosen,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
        }
        if self.identity is not None:
            out["identity"] = {
                "engine_id": self.identity.engine_id,
                "side_channel": f"{self.identity.host}:{self.identity.port}",
                "tp_size": self.identity.tp_size,
                "pp_size": self.identity.pp_size,
            }
        return out


class EnginePool:
    """Engines of one role; thread-safe (the router's event loop and health checks share it)."""

    def __init__(
        self,
        engines: Iterable[Engine],
        *,
        policy: Policy = "least_outstanding",
        failure_threshold: int = 3,
        affinity_slack: int = 4,
    ) -> None:
        self.engines = list(engines)
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique: {names}")
        if policy not in ("least_outstanding", "prefix_affinity"):
            raise ValueError(f"unknown selection policy {policy!r}")
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        self.policy = policy
        self.failure_threshold = failure_threshold
        self.affinity_slack = affinity_slack
        self._lock = threading.Lock()
        self._turn = 0
        self.panics = 0  # picks made with every engine down (see :meth:`pick`)

    def __len__(self) -> int:
        return len(self.engines)

    def get(self, name: str) -> Engine | None:
        return next((e for e in self.engines if e.name == name), None)

    def eligible(self) -> list[Engine]:
        with self._lock:
            return [e for e in self.engines if e.eligible]

    # --- choosing ------------------------------------------------------------------------------
    def pick(self, key: str | None = None, *, exclude: Iterable[Engine] = ()) -> Engine | None:
        """The engine for the next request (None when no engine is eligible). The caller must
        :meth:`release` what it picked (or use :meth:`lease`)."""
        skip = set(map(id, exclude))
        with self._lock:
            eligible = [e for e in self.engines if e.eligible and id(e) not in skip]
            if not eligible:
                # Panic mode: every engine not drained on purpose is marked down. Health checks
                # can be wrong (a loaded engine answering slowly), so requests go on probing
                # them rather than all being refused; one that succeeds brings its engine back,
                # and a truly dead engine fails them fast (connection refused).
                eligible = [e for e in self.engines if not e.draining and id(e) not in skip]
                if not eligible:
                    return None
                self.panics += 1
            least = min(e.outstanding for e in eligible)
            chosen: Engine | None = None
            if self.policy == "prefix_affinity" and key is not None:
                preferred = max(eligible, key=lambda e: _score(key, e.name))
                if preferred.outstanding <= least + self.affinity_slack:
                    chosen = preferred
            if chosen is None:
                lightest = [e for e in eligible if e.outstanding == least]
                chosen = lightest[self._turn % len(lightest)]
                self._turn += 1
            chosen.outstanding += 1
            chosen.chosen += 1
            return chosen

    def release(
        self, engine: Engine, *, ok: bool, error: str = "", transport: bool = False, cancelled: bool = False
    ) -> None:
        """A request on ``engine`` ended. ``transport``: it failed because the engine could not
        be reached or answered garbage (counts towards taking it out), not because of the
        request itself (a 4xx for a bad prompt says nothing about the engine's health).
        ``cancelled``: the request was abandoned before it ended (the client left, or the other
        leg failed): it says nothing about the engine, so only ``outstanding`` changes."""
        with self._lock:
            engine.outstanding = max(0, engine.outstanding - 1)
            if cancelled:
                engine.cancelled += 1
                return
            if ok:
                engine.succeeded += 1
            else:
                engine.failed += 1
                engine.last_error = error[:300]
            if transport:
                self._failure(engine, error)
            elif ok:
                self._success(engine)

    @contextmanager
    def lease(self, key: str | None = None) -> Iterator[Engine | None]:
        """``with pool.lease() as engine:`` — picked and released (as failed if it raised)."""
        engine = self.pick(key)
        ok = False
        try:
            yield engine
            ok = True
        finally:
            if engine is not None:
                self.release(engine, ok=ok)

    # --- health and draining -------------------------------------------------------------------
    def health(self, engine: Engine, ok: bool, error: str = "") -> bool:
        """The result of a health check; returns whether the engine changed state."""
        with self._lock:
            was = engine.up
            if ok:
                self._success(engine)
            else:
                self._failure(engine, error)
            return engine.up != was

    def _success(self, engine: Engine) -> None:
        engine.consecutive_failures = 0
        engine.up = True

    def _failure(self, engine: Engine, error: str) -> None:
        engine.consecutive_failures += 1
        engine.last_error = error[:300] or engine.last_error
        if engine.consecutive_failures >= self.failure_threshold:
            engine.up = False

    def set_draining(self, name: str, draining: bool) -> Engine:
        engine = self.get(name)
        if engine is None:
            raise KeyError(name)
        with self._lock:
            engine.draining = draining
        return engine

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return [e.snapshot() for e in self.engines]


def _score(key: str, name: str) -> int:
    """Rendezvous (highest random weight) hashing: adding or removing an engine moves only the
    keys that engine wins, so affinity survives pool changes."""
    return int.from_bytes(hashlib.blake2b(f"{name}\x00{key}".encode(), digest_size=8).digest(), "big")
