"""An engine thread as a real worker runs one, for the benches: hooks, Python, device wait.

A vLLM worker runs the connector's hooks on the thread that then prepares the next step in
Python, waits for the device (the GIL free) and polls for its next input. :class:`EngineModel`
gives a loop that shape: every step (``EngineModelSpec.step`` seconds) the caller runs its
input and the hooks between :meth:`EngineModel.begin_step` and :meth:`EngineModel.end_step`,
which then runs Python for ``share`` of the step and blocks for the rest. It times the hooks
around the real calls (:meth:`EngineModel.time_hooks` wraps a worker's hook methods) and
counts the Python work in units, so what the transport costs the engine reads as hook time per
step and as work units per second, one phase (idle, pushes) against another.

The node processes of the benches run their loop with it (:mod:`pushactors.testing.node`);
:class:`EngineLoop` runs one in this process, for tests over the fake fabric.
"""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .engine import SimEngine, StepReport

R = TypeVar("R")

# The worker hooks an engine calls on its own thread (vLLM: start_load_kv before the forward,
# save_kv_layer per layer and wait_for_save after it, get_finished after the step).
HOOKS = ("start_load_kv", "save_kv_layer", "wait_for_save", "get_finished")


@dataclass(frozen=True)
class EngineModelSpec:
    step: float = 0.010  # seconds from one step's start to the next's, when the step fits
    share: float = 0.5  # of each step, the engine's own Python work after the hooks

    def __post_init__(self) -> None:
        if not (math.isfinite(self.step) and 0 < self.step <= 1.0):
            raise ValueError(f"engine step must be above 0 and at most 1 second, not {self.step!r}")
        if not (math.isfinite(self.share) and 0.0 <= self.share <= 1.0):
            raise ValueError(f"engine share must be within [0, 1], not {self.share!r}")


def work_unit() -> int:
    """One unit of the engine's Python work: a few dozen small operations on lists and dicts,
    as preparing a step's inputs does (pure bytecode: it holds the GIL but for the forced
    hand-overs)."""
    rows = [(i, i * 3 + 1) for i in range(16)]
    index = {i: j for i, j in rows}
    return sum(index.values()) & 0xFF


@dataclass
class EnginePhase:
    """What the engine thread did over one phase (from one :meth:`EngineModel.take_phase` to
    the next)."""

    seconds: float  # wall time of the phase, less the harness's off-clock work
    steps: int
    hook_s: list[float]  # per step: time inside the hooks
    hook_calls: dict[str, int]
    work_units: int
    work_s: float  # wall time in the work loop (the share it was given, forced hand-overs included)
    late_steps: int  # steps whose input, hooks and work ran past the step's length (no wait)

    def as_dict(self) -> dict[str, Any]:
        hooks = sorted(self.hook_s)
        return {
            "seconds": round(self.seconds, 4),
            "steps": self.steps,
            "hook_us_p50": round(quantile(hooks, 0.5) * 1e6, 1),
            "hook_us_p99": round(quantile(hooks, 0.99) * 1e6, 1),
            "hook_us_mean": round(sum(hooks) / len(hooks) * 1e6, 1) if hooks else 0.0,
            "hook_calls": dict(self.hook_calls),
            "work_units": self.work_units,
            "work_units_per_s": round(self.work_units / self.seconds, 1) if self.seconds > 0 else 0.0,
            "work_s": round(self.work_s, 4),
            # The work's own pace: what the thread got done while it ran Python, whatever the
            # steps' length (a long step, as with a forward in it, lowers only work_units_per_s).
            "work_units_per_work_s": round(self.work_units / self.work_s, 1) if self.work_s > 0 else 0.0,
            "late_steps": self.late_steps,
        }


def quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linear between order statistics (0 for none)."""
    if not ordered:
        return 0.0
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class _Tally:
    started: float
    off_clock: float = 0.0
    steps: int = 0
    hook_s: list[float] = field(default_factory=list)
    hook_calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HOOKS, 0))
    work_units: int = 0
    work_s: float = 0.0
    late_steps: int = 0


class EngineModel:
    """One engine thread's steps. Every method but :meth:`time_hooks` is called on that thread."""

    def __init__(self, spec: EngineModelSpec, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.spec = spec
        self._clock = clock
        self._tally = _Tally(clock())
        self._step_start = 0.0
        self._step_hooks = 0.0
        self._step_off = 0.0  # harness work this step, off the model's clock

    def time_hooks(self, worker: Any) -> None:
        """Time every call of ``worker``'s hooks (:data:`HOOKS`) from now on."""
        for name in HOOKS:
            setattr(worker, name, self._timed(name, getattr(worker, name)))

    def _timed(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self._clock()
            try:
                return hook(*args, **kwargs)
            finally:
                self._step_hooks += self._clock() - start
                self._tally.hook_calls[name] += 1

        return timed

    def begin_step(self) -> None:
        """The step starts: its input and hooks come next."""
        self._step_start = self._clock()
        self._step_hooks = 0.0
        self._step_off = 0.0

    def end_step(self) -> None:
        """The hooks are done: Python work for ``share`` of the step, then a wait with the GIL
        free (as for the device) until the step's end. A step already past its end waits for
        nothing; its work still runs in full."""
        tally = self._tally
        tally.steps += 1
        tally.hook_s.append(self._step_hooks)
        start = self._clock()
        until = start + self.spec.share * self.spec.step
        units = 0
        if self.spec.share > 0:
            now = start
            while now < until:
                work_unit()
                units += 1
                now = self._clock()
            tally.work_s += now - start
        tally.work_units += units
        rest = self._step_start + self._step_off + self.spec.step - self._clock()
        if rest > 0:
            time.sleep(rest)  # the device sync: no Python runs, the GIL is free
        else:
            tally.late_steps += 1

    @contextlib.contextmanager
    def off_clock(self) -> Iterator[None]:
        """Harness work on the engine thread (filling or checking KV for the bench): it moves
        the step's end and is left out of the phase's seconds, so it costs the model nothing."""
        start = self._clock()
        try:
            yield
        finally:
            spent = self._clock() - start
            self._step_off += spent
            self._tally.off_clock += spent

    def take_phase(self) -> EnginePhase:
        """What the thread did since the last call (or since it started); a new phase begins."""
        now = self._clock()
        t = self._tally
        self._tally = _Tally(now)
        return EnginePhase(
            seconds=now - t.started - t.off_clock,
            steps=t.steps,
            hook_s=t.hook_s,
            hook_calls=t.hook_calls,
            work_units=t.work_units,
            work_s=t.work_s,
            late_steps=t.late_steps,
        )


def compare(idle: dict[str, Any], pushes: dict[str, Any]) -> dict[str, Any]:
    """One engine thread's two phases (:meth:`EnginePhase.as_dict`) side by side, with the share
    of its Python work per second the pushes cost it (``work_lost_pct``) and of its pace while
    it ran Python (``work_pace_lost_pct``); None where it did no work idle."""

    def lost(key: str) -> float | None:
        base = idle[key]
        return round((1 - pushes[key] / base) * 100, 1) if base else None

    return {
        "idle": idle,
        "pushes": pushes,
        "work_lost_pct": lost("work_units_per_s"),
        "work_pace_lost_pct": lost("work_units_per_work_s"),
    }


def report(spec: EngineModelSpec, sides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bench's ``engine`` field: the model's settings and each side's :func:`compare`."""
    return {"share": spec.share, "step_s": spec.step, **sides}


class EngineLoop:
    """A :class:`SimEngine` stepped under an :class:`EngineModel` on a thread of its own, in this
    process: each step runs what :meth:`call` handed it (the step's input), the engine's step
    (the hooks) and the model's work and wait. Its step reports go to ``on_report``."""

    def __init__(
        self,
        engine: SimEngine,
        spec: EngineModelSpec,
        *,
        on_report: Callable[[StepReport], None] | None = None,
        name: str = "engine",
    ) -> None:
        self.engine = engine
        self.model = EngineModel(spec)
        for worker in engine.workers:
            self.model.time_hooks(worker)
        self._on_report = on_report
        self._inbox: queue.SimpleQueue[tuple[Callable[[SimEngine], Any], Future[Any]]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.model.begin_step()
                while True:
                    try:
                        fn, done = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    try:
                        done.set_result(fn(self.engine))
                    except BaseException as exc:  # handed back to the caller
                        done.set_exception(exc)
                report = self.engine.step()
                if self._on_report is not None:
                    self._on_report(report)
                self.model.end_step()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self._refuse_waiting()

    def _refuse_waiting(self) -> None:
        # The loop is over: whatever is still handed to it will never run.
        while True:
            try:
                _, done = self._inbox.get_nowait()
            except queue.Empty:
                return
            done.set_exception(RuntimeError(f"the engine loop has ended: {self.error!r}"))

    def call(self, fn: Callable[[SimEngine], R], timeout: float = 30.0) -> R:
        """Run ``fn(engine)`` on the engine thread at its next step's input; its result."""
        done: Future[R] = Future()
        self._inbox.put((fn, done))
        if not self._thread.is_alive():
            self._refuse_waiting()
        return done.result(timeout=timeout)

    def take_phase(self, timeout: float = 30.0) -> EnginePhase:
        """The model's phase so far, ended at a step's input (so each phase has whole steps)."""
        return self.call(lambda _e: self.model.take_phase(), timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
