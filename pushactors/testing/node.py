"""Engines in their own OS processes, driven by a parent (the demo, two-process tests).

Each node process runs a :class:`~pushactors.testing.engine.SimEngine` with real NIXL agents and
a ZMQ side channel, and steps it like an engine loop. The parent talks to it over a pipe:
commands go down (``prefill``, ``expect``, ``stats``, ``quiesce``, ``stop``), events come up
(``ready``, ``ack``, ``sent``, ``received``). D verifies every received block in its own process
and reports the byte counts.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import random
import secrets
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ..logs import flush_sinks
from . import kvstamp
from .engine import SimSpec
from .engine_model import EngineModel, EngineModelSpec

Event = tuple[Any, ...]


@dataclass(frozen=True)
class NodeSpec:
    role: str  # "prefill" or "decode"
    engine_id: str
    tp_size: int = 1
    pp_size: int = 1  # prefill only: each stage holds its share of the layers
    sim: SimSpec = field(default_factory=SimSpec)
    config: dict[str, Any] = field(default_factory=dict)  # PushConfig overrides
    host: str = "127.0.0.1"
    log_json: str | None = None
    seed: int = 0
    fabric: str = "nixl"
    # Injected faults at this node's agents (real NIXL underneath). Random, for soak tests:
    # {"seed": int, "rate": float, "kinds": [FaultPlan method names], "delay": seconds}; and/or
    # targeted: "rules": [{"kind": FaultPlan method, "match": MATCH, "times": n or None,
    # "seconds"/"runs_on"/"copies": ...}], "record": MATCH (inbound notifications kept for the
    # "replay" command), where MATCH is {"completion_of": D id} or {"prefix": str} or {} (all).
    faults: dict[str, Any] | None = None
    # Seconds this process's wall clock runs ahead of the host's (negative: behind), as on
    # another host with a badly set clock: log timestamps and the clock samples it serves shift.
    wall_clock_skew: float = 0.0
    # Share of each 10 ms that a thread of this process runs Python, as an engine's own
    # scheduling and bookkeeping do between the steps (0: none, 1: always). Every other thread
    # of the rank (its actors) then waits for the GIL while that thread holds it.
    python_busy: float = 0.0
    # The node's loop as a real engine thread runs (engine_model.py): every ``step`` seconds
    # its input and the connector hooks, Python for ``share`` of the step, a GIL-free wait.
    # None: the loop steps about every millisecond and does nothing else.
    engine_model: EngineModelSpec | None = None
    # P stamps each request's blocks and D checks every byte it received (kvstamp.py): a byte
    # check for benches, whose engines neither fill nor check the KV.
    stamp_kv: bool = False


class PythonLoad:
    """A thread that runs Python for ``share`` of every ``period`` and sleeps the rest. It
    counts the time it spent in its Python loop (wall time, including the hand-overs the
    interpreter forced on it), so a test can see the load is there."""

    def __init__(self, share: float, period: float = 0.01) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"python_busy must be within [0, 1], not {share!r}")
        self.share = share
        self.period = period
        self.busy_s = 0.0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="python-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            until = start + self.share * self.period
            x = 0
            while time.monotonic() < until:
                x += 1  # pure bytecode: holds the GIL but for the interpreter's forced hand-overs
            now = time.monotonic()
            self.busy_s += now - start
            rest = self.period - (now - start)
            if rest > 0:
                self._stop.wait(rest)

    def measured_share(self) -> float:
        return self.busy_s / max(1e-9, time.monotonic() - self.started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def _skew_wall_clock(seconds: float) -> None:
    real = time.time

    def skewed() -> float:
        return real() + seconds

    time.time = skewed


def exit_status(code: int | None) -> str:
    """A node process's exit code in words: ``killed by SIGSEGV`` for a signal."""
    if code is None:
        return "its pipe closed, but it is still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def node_main(spec: NodeSpec, conn: Connection) -> None:
    """Entry point of a node process."""
    # NIXL's own Python logger prints INFO lines to stderr; a node keeps them to warnings.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # A node that dies in native code (NIXL, UCX) says where on stderr, which pytest shows.
    faulthandler.enable()
    if spec.wall_clock_skew:
        _skew_wall_clock(spec.wall_clock_skew)
    engine = None
    load = None
    model = None
    try:
        engine, server = _build(spec)
        if spec.python_busy:
            load = PythonLoad(spec.python_busy)
        if spec.engine_model is not None:
            model = EngineModel(spec.engine_model)
            for worker in engine.workers:
                model.time_hooks(worker)
        conn.send(
            (
                "ready",
                {
                    "engine_id": spec.engine_id,
                    "host": server.host,
                    "port": server.port,
                    "tp_size": spec.tp_size,
                    "pp_size": spec.pp_size,
                    "pid": os.getpid(),
                    "device": spec.sim.device,
                },
            )
        )
        _loop(spec, engine, conn, load, model)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if load is not None:
            load.stop()
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown(timeout=5.0)


def _build(spec: NodeSpec) -> tuple[Any, Any]:
    from ..core.config import PushConfig
    from ..logs import configure_logging
    from ..transport.auth import Keyring
    from ..transport.nixl import agent_factory_from_config
    from ..transport.sidechannel import SideChannelClient, SideChannelServer
    from .engine import SimEngine

    if spec.log_json:
        configure_logging(json_path=spec.log_json)
    config = PushConfig(
        engine_id=spec.engine_id, role="producer" if spec.role == "prefill" else "consumer", **spec.config
    )
    server = SideChannelServer(spec.host, 0, engine_id=spec.engine_id, keyring=Keyring.from_config(config))
    factory = agent_factory_from_config(config)
    faulty = _faulty(factory, spec.faults) if spec.faults else None
    engine = SimEngine(
        config,
        agent_factory=faulty if faulty is not None else factory,
        source=SideChannelClient(keyring=Keyring.from_config(config)),
        publisher_for_rank=lambda _r: server,
        tp_size=spec.tp_size,
        pp_size=spec.pp_size,
        spec=spec.sim,
        seed=spec.seed,
    )
    engine._side_channel = server  # type: ignore[attr-defined]
    engine._faulty = faulty  # type: ignore[attr-defined]
    engine._recorder = faulty.recorder if faulty is not None else None  # type: ignore[attr-defined]
    return engine, server


def _faulty(factory: Any, faults: dict[str, Any]) -> Any:
    import random

    from .faults import FaultPlan, NotifRecorder, faulty_factory, random_match

    rng = random.Random(faults.get("seed", 0))
    plan = FaultPlan()
    for rule in faults.get("rules", ()):
        _add_rule(plan, rule)
    record = faults.get("record")
    recorder = NotifRecorder(_match_of(record)) if record is not None else None
    kinds = list(faults.get("kinds", ()))
    rate = float(faults.get("rate", 0.0)) / max(1, len(kinds))
    for kind in kinds:
        match = random_match(rate, rng)
        if kind == "delay_notif":
            plan.delay_notif(float(faults.get("delay", 0.05)), match, times=None)
        else:
            getattr(plan, kind)(match, times=None)
    return faulty_factory(factory, plan, recorder)


def _match_of(spec: dict[str, Any]) -> Any:
    from .faults import completion_of

    if "completion_of" in spec:
        return completion_of(str(spec["completion_of"]))
    if "prefix" in spec:
        prefix = str(spec["prefix"]).encode()
        return lambda ctx: ctx.notif.startswith(prefix)
    if spec:
        raise ValueError(f"unknown fault match {spec!r}")
    return lambda ctx: True


def _add_rule(plan: Any, rule: dict[str, Any]) -> None:
    kind = rule["kind"]
    match = _match_of(rule.get("match", {}))
    times = rule.get("times", 1)
    if kind in ("delay_notif", "slow_transfer"):
        getattr(plan, kind)(float(rule["seconds"]), match, times=times)
    elif kind == "duplicate_notif":
        plan.duplicate_notif(match, times=times, copies=int(rule.get("copies", 1)))
    elif kind == "release_continues":
        plan.release_continues(match, times=times, runs_on=rule.get("runs_on"))
    else:
        getattr(plan, kind)(match, times=times)


def _loop(
    spec: NodeSpec, engine: Any, conn: Connection, load: PythonLoad | None = None, model: EngineModel | None = None
) -> None:
    started: dict[str, float] = {}
    kept: set[str] = set()  # received requests whose blocks stay held until "finish"
    pending_acks: list[int] = []
    quiesce: list[tuple[int, float]] = []

    def harness() -> contextlib.AbstractContextManager[None]:
        # The bench's own work on this thread (its byte checks): off the engine model's clock.
        return model.off_clock() if model is not None else contextlib.nullcontext()

    def received_bytes(rid: str) -> tuple[int, int]:
        if not spec.stamp_kv:
            return engine.verify(rid)  # type: ignore[no-any-return]
        rec = engine.recvs[rid]
        with harness():
            return kvstamp.check(engine, rec.blocks, rec.key, first_position=rec.first_position)

    while True:
        if model is not None:
            model.begin_step()  # its input (the commands), then the hooks (engine.step)
        while conn.poll(0):
            cmd = conn.recv()
            op = cmd[0]
            if op == "stop":
                final = {**_stats(engine, load), "timeline": _timelines(engine)}
                engine.shutdown(timeout=cmd[1] if len(cmd) > 1 else 5.0)
                engine._side_channel.close()
                flush_sinks()  # the parent may kill this process soon after "stopped"
                conn.send(("stopped", final))
                return
            if op == "prefill":
                _, seq, rid, tokens, key, tid = cmd
                try:
                    engine.prefill(rid, tokens, key=key, transfer_id=tid)
                    if spec.stamp_kv:  # before the push starts (the next step's hooks) and its clock
                        with harness():
                            kvstamp.stamp(engine, engine.held[rid], key)
                    started[rid] = time.monotonic()
                except MemoryError as exc:
                    conn.send(("sent", rid, f"no free blocks: {exc}", 0.0))
                pending_acks.append(seq)
            elif op == "expect":
                _, seq, rid, tokens, params, key, cached, blocks, hold = cmd
                try:
                    rec = engine.expect(rid, tokens, params, key=key, cached_blocks=cached, blocks=blocks)
                    if spec.stamp_kv:
                        with harness():
                            kvstamp.clear(engine, rec.blocks)
                    started[rid] = time.monotonic()
                    if hold:
                        kept.add(rid)
                except (MemoryError, ValueError) as exc:
                    conn.send(("received", rid, f"not staged: {exc}", 0, 0, 0.0, 0.0))
                pending_acks.append(seq)
            elif op == "forward":
                _, seq, rid, tokens, key, work, layerwise = cmd
                layer_work = _layer_work(engine, work)
                if spec.stamp_kv:
                    layer_work = _stamping(engine, rid, key, layer_work)
                ended, _ = engine.forward(rid, tokens, key=key, layerwise=layerwise, layer_work=layer_work)
                started[rid] = ended  # P's KV was ready when the forward's last layer had run
                conn.send(("forwarded", seq, ended))
            elif op == "abort":
                _, seq, rid = cmd
                conn.send(("aborted", seq, bool(engine.scheduler.abort_recv(rid))))
            elif op == "verify":
                _, seq, rid = cmd
                conn.send(("verified", seq, *received_bytes(rid)))
            elif op == "finish":
                _, seq, rid = cmd
                kept.discard(rid)
                engine.finish_recv(rid)
                pending_acks.append(seq)
            elif op == "replay":
                recorder = getattr(engine, "_recorder", None)
                conn.send(("replayed", cmd[1], recorder.replay() if recorder is not None else 0))
            elif op == "stats":
                conn.send(("stats", cmd[1], _stats(engine, load)))
            elif op == "engine_phase":
                conn.send(("engine_phase", cmd[1], model.take_phase().as_dict() if model is not None else None))
            elif op == "quiesce":
                quiesce.append((cmd[1], time.monotonic() + cmd[2]))
        report = engine.step()
        for seq in pending_acks:
            conn.send(("ack", seq))
        pending_acks.clear()
        now = time.monotonic()
        for rid in report.finished_sending:
            begun = started.pop(rid, now)
            conn.send(("sent", rid, report.failed_sending.get(rid), now - begun, begun))
        for rid in report.finished_recving:
            checked, wrong = received_bytes(rid)
            if rid not in kept:
                engine.finish_recv(rid)
            begun = started.pop(rid, now)
            ended = engine.ended_at.pop(rid, now)
            conn.send(("received", rid, None, checked, wrong, now - begun, ended - begun, ended, now))
        for rid, why in report.failed_recving.items():
            kept.discard(rid)
            engine.finish_recv(rid)
            begun = started.pop(rid, now)
            ended = engine.ended_at.pop(rid, now)
            conn.send(("received", rid, why, 0, 0, now - begun, ended - begun, ended))
        for item in list(quiesce):
            seq, deadline = item
            if not engine.has_pending_push_work() or now >= deadline:
                quiesce.remove(item)
                conn.send(("quiet", seq, not engine.has_pending_push_work(), _stats(engine, load)))
        if model is not None:
            model.end_step()  # the engine's own Python work, then its wait for the device
        else:
            # An engine loop steps about every millisecond; wait for commands meanwhile.
            conn.poll(0.001)


def _layer_work(engine: Any, work: dict[str, int] | None) -> Any:
    """A kernel per layer sized like a transformer layer's: (tokens x hidden) @ (hidden x
    width), the weights made once per node (``work``: tokens, hidden, width); or, with
    ``device_us``, a forward that waits on its device that long in all (the interpreter free),
    its layers' share each."""
    if not work:
        return None
    if "device_us" in work:
        per_layer = work["device_us"] / 1e6 / max(1, len(engine.layer_names()))

        def wait(_: str) -> None:
            time.sleep(per_layer)

        return wait
    import torch

    shape = (work["tokens"], work["hidden"], work["width"])
    cache = engine.__dict__.setdefault("_layer_work", {})
    if shape not in cache:
        dtype = torch.bfloat16 if engine.spec.device.startswith("cuda") else torch.float32
        x = torch.randn(shape[0], shape[1], dtype=dtype, device=engine.spec.device)
        w = torch.randn(shape[1], shape[2], dtype=dtype, device=engine.spec.device)
        cache[shape] = (x, w)
    x, w = cache[shape]

    def run(_: str) -> None:
        torch.matmul(x, w)

    return run


def _stamping(engine: Any, rid: str, key: str, kernel: Any) -> Any:
    """``kernel`` (or nothing), then the layer's KV stamped, as a forward writes each layer's
    KV before it is saved; part of the forward, so on the engine's clock."""

    def run(name: str) -> None:
        if kernel is not None:
            kernel(name)
        kvstamp.stamp(engine, engine.held[rid], key, layers={name})

    return run


def _stats(engine: Any, load: PythonLoad | None = None) -> dict[str, Any]:
    merged: dict[str, int] = {}
    for w in engine.workers:
        for k, v in w.stats().items():
            merged[k] = merged.get(k, 0) + v
    return {
        "metrics": merged,
        "free_blocks": engine.free_blocks,
        "held": len(engine.held),
        "pending_push_work": engine.has_pending_push_work(),
        "healthy": all(w.healthy for w in engine.workers),
        # Registrations P's matchers hold unmatched (read through each matcher's mailbox, so
        # every registration it was handed before is counted).
        "pending_registrations": sum(_matcher_pending(w) for w in engine.workers),
        "python_busy_share": load.measured_share() if load is not None else 0.0,
        "switch_interval_s": sys.getswitchinterval(),
        "injected": engine._faulty.injected() if getattr(engine, "_faulty", None) is not None else {},
    }


def _timelines(engine: Any) -> dict[str, dict[str, float]]:
    """Each request's steps stamped by the node's ranks (PushConfig.timeline; empty when off).
    A step stamped by several ranks keeps the latest: the request is there when all are."""
    merged: dict[str, dict[str, float]] = {}
    for w in engine.workers:
        timeline = w.ctx.timeline
        if timeline is None:
            continue
        for rid, steps in timeline.take().items():
            into = merged.setdefault(rid, {})
            for step, at in steps.items():
                into[step] = max(at, into.get(step, at))
    return merged


def _matcher_pending(worker: Any) -> int:
    try:
        sizes = worker.runtime.refs["matcher"].proxy().sizes().get(timeout=5.0)
    except Exception:
        return 0
    return int(sizes.get("pending_registrations", 0))


class Node:
    """The parent's handle on a node process."""

    def __init__(self, spec: NodeSpec, *, on_event: Callable[[Event], None] | None = None) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=node_main, args=(spec, child), name=f"pushactors-{spec.role}", daemon=True)
        self.process.start()
        child.close()
        self.info: dict[str, Any] = {}
        self._events: queue.Queue[Event] = queue.Queue()
        self._on_event = on_event
        self._seq = 0
        self._send_lock = threading.Lock()
        self._waiters: dict[tuple[str, int], queue.Queue[Event]] = {}
        self._reader = threading.Thread(target=self._read, name=f"node-reader-{spec.role}", daemon=True)
        self._reader.start()
        self.error: str | None = None

    def _read(self) -> None:
        while True:
            try:
                event = self._conn.recv()
            except (EOFError, OSError):
                # Never reaped here: a join on this thread races the caller's own join/is_alive
                # (two waitpid calls: the loser sees no child and takes it for alive).
                self._events.put(("exited", None))
                return
            kind = event[0]
            if kind in ("ack", "stats", "quiet", "aborted", "verified", "replayed", "forwarded", "engine_phase"):
                waiter = self._waiters.pop((kind, event[1]), None)
                if waiter is not None:
                    waiter.put(event)
                continue
            if kind == "error":
                self.error = event[1]
            if self._on_event is not None and kind in ("sent", "received"):
                self._on_event(event)
                continue
            self._events.put(event)

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.spec.role} node not ready after {timeout}s") from None
            if event[0] == "ready":
                self.info = event[1]
                return self.info
            if event[0] == "error":
                raise RuntimeError(f"{self.spec.role} node failed to start: {event[1]}")
            if event[0] == "exited":
                self.process.join(5.0)  # the pipe closes before the process is reaped
                raise RuntimeError(f"{self.spec.role} node failed to start: {exit_status(self.process.exitcode)}")

    def _call(self, kind: str, *args: Any, wait: str | None = None, timeout: float = 30.0) -> Event | None:
        with self._send_lock:
            self._seq += 1
            seq = self._seq
            box: queue.Queue[Event] | None = None
            if wait is not None:
                box = queue.Queue()
                self._waiters[(wait, seq)] = box
            self._conn.send((kind, seq, *args))
        if box is None:
            return None
        try:
            return box.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.spec.role} node did not answer {kind} within {timeout}s") from None

    def prefill(self, rid: str, tokens: int, key: str, transfer_id: str | None = None, *, wait: bool = False) -> None:
        self._call("prefill", rid, tokens, key, transfer_id, wait="ack" if wait else None)

    def expect(
        self,
        rid: str,
        tokens: int,
        params: dict[str, Any],
        key: str,
        cached: int = 0,
        *,
        blocks: list[int] | None = None,
        hold: bool = False,
        wait: bool = False,
    ) -> None:
        """Stage D's side of a request. ``blocks``: exactly these block ids (they must be free);
        ``hold``: once received, its blocks stay held (and can be verified again) until
        :meth:`finish`."""
        self._call("expect", rid, tokens, params, key, cached, blocks, hold, wait="ack" if wait else None)

    def forward(
        self,
        rid: str,
        tokens: int,
        key: str,
        *,
        layerwise: bool,
        work: dict[str, int] | None = None,
        timeout: float = 120.0,
    ) -> float:
        """Run P's prefill layer by layer (``work``: a kernel per layer, see ``_layer_work``);
        layer-wise or whole. Returns the node's time.monotonic() when the last layer had run."""
        event = self._call("forward", rid, tokens, key, work, layerwise, wait="forwarded", timeout=timeout)
        assert event is not None
        return float(event[2])

    def abort(self, rid: str) -> bool:
        """D aborts a request it staged (as vLLM does when the client goes away)."""
        event = self._call("abort", rid, wait="aborted")
        assert event is not None
        return bool(event[2])

    def verify(self, rid: str) -> tuple[int, int]:
        """(bytes checked, bytes wrong) of a received request whose blocks are still held."""
        event = self._call("verify", rid, wait="verified")
        assert event is not None
        return int(event[2]), int(event[3])

    def finish(self, rid: str) -> None:
        """The decode of a held request ended: its blocks go back to the pool."""
        self._call("finish", rid, wait="ack")

    def replay(self) -> int:
        """Deliver every recorded notification again, from the peer that sent it."""
        event = self._call("replay", wait="replayed")
        assert event is not None
        return int(event[2])

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        event = self._call("stats", wait="stats", timeout=timeout)
        assert event is not None
        return event[2]  # type: ignore[no-any-return]

    def engine_phase(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """What the node's engine model did since the last call (``EnginePhase.as_dict``), a new
        phase begun at that step's input; None when the node runs without the model."""
        event = self._call("engine_phase", wait="engine_phase", timeout=timeout)
        assert event is not None
        return event[2]  # type: ignore[no-any-return]

    def quiesce(self, timeout: float = 60.0) -> tuple[bool, dict[str, Any]]:
        """Wait until the node's engine has no pending push work; (quiet, stats)."""
        event = self._call("quiesce", timeout, wait="quiet", timeout=timeout + 10)
        assert event is not None
        return bool(event[2]), event[3]

    def wait_registrations_held(self, at_least: int, timeout: float = 30.0) -> None:
        """Poll this (prefill) node until its matchers hold ``at_least`` registrations."""
        deadline = time.monotonic() + timeout
        pause = threading.Event()
        while self.stats()["pending_registrations"] < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"P held fewer than {at_least} registrations after {timeout}s")
            pause.wait(0.002)

    def decode_params(self, remote_request_id: str, transfer_id: str | None = None) -> dict[str, Any]:
        """kv_transfer_params naming this (prefill) node, as a router hands them to D."""
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": self.info["engine_id"],
            "remote_host": self.info["host"],
            "remote_port": self.info["port"],
            "remote_tp_size": self.info["tp_size"],
            "remote_pp_size": self.info.get("pp_size", 1),
            "remote_request_id": remote_request_id,
        }
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
        return params

    def kill(self) -> None:
        """SIGKILL the node (fault tests)."""
        self.process.kill()
        self.process.join(timeout=10)

    def stop(self, timeout: float = 20.0) -> dict[str, Any] | None:
        if not self.process.is_alive():
            return None
        try:
            self._conn.send(("stop", timeout / 2))
        except (OSError, BrokenPipeError):
            pass
        deadline = time.monotonic() + timeout
        final = None
        while time.monotonic() < deadline and final is None:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if event[0] == "stopped":
                final = event[1]
            elif event[0] == "exited":
                break
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        return final

    def events(self) -> queue.Queue[Event]:
        return self._events


def spec_dict(spec: NodeSpec) -> dict[str, Any]:
    return asdict(spec)


@dataclass
class Outcome:
    """What happened to one router request across both nodes."""

    index: int
    p_id: str
    d_id: str
    tokens: int
    dispatched: float
    cached: int = 0  # D's prefix-cache hit, in blocks
    sent: str | None = None  # failure reason on P
    received: str | None = None  # failure reason on D
    sent_done: bool = False
    received_done: bool = False
    checked: int = 0
    wrong: int = 0
    push_latency: float = 0.0  # measured on D: registration staged → the engine's step saw it land
    transport_latency: float = 0.0  # registration staged → D's transport knew it landed
    end_to_end: float = 0.0  # measured by the router: dispatch → D reported
    # time.monotonic() (one clock for every process on a host): P's prefill handed its KV to
    # the transport, and D's transport knew the KV landed.
    p_started_at: float = 0.0
    d_ended_at: float = 0.0
    d_engine_at: float = 0.0  # D's engine loop had it (the hook that reported it returned)

    @property
    def critical_path(self) -> float:
        """P's KV ready → D's transport knew it landed: what a push adds to time to first token
        when D's registration was already at P (0 when either end is unknown)."""
        if not self.p_started_at or not self.d_ended_at:
            return 0.0
        return self.d_ended_at - self.p_started_at

    @property
    def engine_path(self) -> float:
        """P's KV ready → D's engine had the landed request from its hook (0 when unknown)."""
        if not self.p_started_at or not self.d_engine_at:
            return 0.0
        return self.d_engine_at - self.p_started_at

    @property
    def done(self) -> bool:
        return self.sent_done and self.received_done

    @property
    def ok(self) -> bool:
        return self.done and self.sent is None and self.received is None and self.wrong == 0


class Dispatcher:
    """Sends each request's prefill leg to P and decode leg to D, by default at the same time
    (push needs only P's identity on D), and gathers what both nodes report."""

    def __init__(self, *, seed: int = 0, mint_transfer_ids: bool = False) -> None:
        self.rng = random.Random(seed)
        # Mint an unguessable transfer id for every request (as a production router does);
        # otherwise the mixed workload gives some requests the guessable ``tx-<index>``.
        self.mint_transfer_ids = mint_transfer_ids
        self._lock = threading.Lock()
        self._by_p: dict[str, Outcome] = {}
        self._by_d: dict[str, Outcome] = {}
        self.outcomes: list[Outcome] = []
        self._changed = threading.Condition(self._lock)

    def on_event(self, event: Event) -> None:
        with self._lock:
            if event[0] == "sent":
                o = self._by_p.get(event[1])
                if o is not None:
                    o.sent, o.sent_done = event[2], True
                    o.p_started_at = event[4] if len(event) > 4 else 0.0
            elif event[0] == "received":
                o = self._by_d.get(event[1])
                if o is not None:
                    o.received, o.received_done = event[2], True
                    o.checked, o.wrong, o.push_latency = event[3], event[4], event[5]
                    o.transport_latency = event[6] if len(event) > 6 else event[5]
                    o.d_ended_at = event[7] if len(event) > 7 else 0.0
                    o.d_engine_at = event[8] if len(event) > 8 else 0.0
                    o.end_to_end = time.monotonic() - o.dispatched
            self._changed.notify_all()

    def dispatch(
        self,
        p: Node,
        d: Node,
        index: int,
        tokens: int,
        *,
        order: str = "together",
        transfer_id: str | None = None,
        cached: int = 0,
        forward: dict[str, int] | None = None,
    ) -> Outcome:
        """Send one request's two legs in ``order``; ``forward``: the work of P's forward
        (``_layer_work``) for ``order="armed"``."""
        base = f"req-{index}-0"
        p_id = f"{base}-{self.rng.getrandbits(32):08x}"
        d_id = f"{base}-{self.rng.getrandbits(32):08x}"
        o = Outcome(index, p_id, d_id, tokens, time.monotonic(), cached)
        with self._lock:
            self._by_p[p_id] = o
            self._by_d[d_id] = o
            self.outcomes.append(o)
        params = p.decode_params(base, transfer_id)
        key = f"key-{index}"
        if order == "prefill_first":
            p.prefill(p_id, tokens, key, transfer_id, wait=True)
            d.expect(d_id, tokens, params, key, cached)
        elif order == "decode_first":
            d.expect(d_id, tokens, params, key, cached, wait=True)
            p.prefill(p_id, tokens, key, transfer_id)
        elif order == "armed":
            # The engine's default path (whole_push_start = "forward_end"): D's registration
            # waits at P, P's forward announces the request and the push goes at its end.
            held = p.stats()["pending_registrations"]
            d.expect(d_id, tokens, params, key, cached, wait=True)
            p.wait_registrations_held(held + 1)
            p.forward(p_id, tokens, key, layerwise=False, work=forward)
        elif order == "registration_first":
            # Push mode's steady state: D's registration waits in P's matcher before P's
            # prefill ends, so what follows the prefill is the push alone (Outcome.critical_path).
            held = p.stats()["pending_registrations"]
            d.expect(d_id, tokens, params, key, cached, wait=True)
            p.wait_registrations_held(held + 1)
            p.prefill(p_id, tokens, key, transfer_id)
        else:
            d.expect(d_id, tokens, params, key, cached)
            p.prefill(p_id, tokens, key, transfer_id)
        return o

    def dispatch_mixed(
        self, p: Node, d: Node, index: int, rng: random.Random, *, max_blocks: int, block_size: int
    ) -> Outcome:
        """A request of random length in a random arrival order, sometimes with a transfer id,
        sometimes after a prefix hit on D (the tests' and soaks' mixed workload)."""
        tokens = rng.randint(1, max_blocks * block_size)
        nblocks = -(-tokens // block_size)
        order = rng.choice(["together", "together", "prefill_first", "decode_first"])
        # Drawn whether or not it is used, so minting leaves the rest of the workload unchanged.
        tagged = rng.random() < 0.3
        if self.mint_transfer_ids:
            transfer_id: str | None = secrets.token_hex(8)
        else:
            transfer_id = f"tx-{index}" if tagged else None
        return self.dispatch(
            p,
            d,
            index,
            tokens,
            order=order,
            transfer_id=transfer_id,
            cached=rng.randrange(nblocks) if rng.random() < 0.2 else 0,
        )

    def _pending(self) -> int:
        return sum(1 for o in self.outcomes if not o.done)

    def in_flight(self) -> int:
        with self._lock:
            return self._pending()

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(min(remaining, 0.5))
        return True

    def wait_below(self, limit: int, timeout: float) -> bool:
        return self.wait(lambda: self._pending() < limit, timeout)

    def wait_all(self, timeout: float) -> bool:
        return self.wait(lambda: all(o.done for o in self.outcomes), timeout)
