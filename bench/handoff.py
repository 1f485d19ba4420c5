"""The floor of one hand-off between Python threads: what a push's hot path cannot go below.

    pushactors bench handoff [--rounds 2000] [--chain 3] [--busy off|on|both] [--switch-interval S]
    python bench/handoff.py  [same options]

A push crosses several actors (worker → matcher → writer → …), each a thread woken by a
message. This measures one such wake-up with nothing else to do, as one-way latency
percentiles (p50, p90, p99, mean and max, µs) over ``--rounds`` round trips after a warm-up of
``min(200, rounds)``, every time taken with ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux:
one clock for every thread, so a stamp taken on one thread and read on another is comparable):

* ``simplequeue``: ping-pong between two threads over two ``queue.SimpleQueue`` (a C lock on
  each side); one-way = round trip / 2;
* ``event``: ping-pong over two ``threading.Event`` (set / wait / clear: a Condition, Python
  on both sides); one-way = round trip / 2;
* ``pykka_tell``: ``ref.tell(msg)`` to a plain ``pykka.ThreadingActor``, from the sender's stamp
  to the first line of ``on_receive`` on the actor's thread (the actor answers the main thread
  through a SimpleQueue, which only paces the next round);
* ``pushactor_tell``: the same through the project's own base, :class:`PushActor` with its
  :class:`TimedInbox` and ``@handles`` dispatch, up to the first line of the handler;
* ``chain_pykka`` / ``chain_pushactor``: ``--chain`` K actors, each handler ``tell``-ing the same
  message to the next, the last answering the main thread: from the stamp before the first
  ``tell`` to the first line of the last handler is K hand-offs (``chain_us``);
  ``per_hop_us`` = chain / K, which is also the case's ``one_way_us``.

``--busy on`` runs every case again beside a thread spinning pure-Python arithmetic (as an
engine's own thread runs Python between its steps): a woken thread then needs the GIL from it,
which CPython hands over when the spinner's switch interval runs out (``sys.getswitchinterval()``,
reported per case; ``--switch-interval`` sets it for the run). ``--busy both`` runs idle, then
busy. Beside a busy thread most hand-offs still take microseconds and a few wait out a whole
switch interval, often too few for p99 to show: ``max``, ``mean`` and ``share_over_1ms`` (the
share of rounds that took 1 ms or more) do. Prints a table and writes JSON (``--json``, default
``runs/bench/handoff.json``). Self-contained: the standard library, Pykka and pushactors.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pykka

from pushactors.actors.base import Note, PushActor, RankContext, handles
from pushactors.apps.argtypes import positive_int
from pushactors.core.config import PushConfig

ROUNDS = 2000
WARMUP = 200
CHAIN = 3
# A round this slow (round trip; tell → last handler) waited for the GIL (a switch interval),
# not for a wake-up: ``share_over_1ms`` is the share of such rounds.
SLOW_NS = 1_000_000
BUSY_MODES = ("off", "on", "both")
CASES = ("simplequeue", "event", "pykka_tell", "pushactor_tell", "chain_pykka", "chain_pushactor")
_clock = time.perf_counter_ns


class Ping(msgspec.Struct, tag="bench.ping"):
    """The message every actor case sends: the sender's ``perf_counter_ns`` stamp."""

    sent: int


# ------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------
def percentiles(samples_ns: Sequence[float], divide: float = 1.0) -> dict[str, float]:
    """p50 / p90 / p99 (nearest rank), mean and max of ``samples_ns / divide``, in µs."""
    if not samples_ns:
        raise ValueError("no samples")
    s = sorted(samples_ns)
    n = len(s)

    def rank(q: float) -> float:
        return s[min(n - 1, max(0, math.ceil(q * n - 1e-9) - 1))]

    scale = 1e3 * divide
    return {
        "p50": round(rank(0.50) / scale, 2),
        "p90": round(rank(0.90) / scale, 2),
        "p99": round(rank(0.99) / scale, 2),
        "mean": round(sum(s) / n / scale, 2),
        "max": round(s[-1] / scale, 2),
    }


def share_over(samples_ns: Sequence[float], limit_ns: float) -> float:
    """The share of samples at or above ``limit_ns``."""
    return round(sum(1 for x in samples_ns if x >= limit_ns) / len(samples_ns), 5)


# ------------------------------------------------------------------------------------------------
# The cases: each returns (round trips, forward times) in ns, one per timed round
# ------------------------------------------------------------------------------------------------
Samples = tuple[list[int], list[int]]


def _simplequeue(rounds: int, warmup: int) -> Samples:
    ping: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    pong: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while ping.get() is not None:
            pong.put(_clock())

    thread = threading.Thread(target=echo, name="handoff-echo", daemon=True)
    thread.start()
    rt: list[int] = []
    fwd: list[int] = []
    try:
        for i in range(warmup + rounds):
            t0 = _clock()
            ping.put(t0)
            arrived = pong.get()
            t1 = _clock()
            if i >= warmup:
                rt.append(t1 - t0)
                fwd.append(arrived - t0)
    finally:
        ping.put(None)
        thread.join(10)
    return rt, fwd


def _event(rounds: int, warmup: int) -> Samples:
    go, back = threading.Event(), threading.Event()
    arrived = [0]
    stop = [False]

    def echo() -> None:
        while True:
            go.wait()
            arrived[0] = _clock()
            go.clear()
            if stop[0]:
                return
            back.set()

    thread = threading.Thread(target=echo, name="handoff-echo", daemon=True)
    thread.start()
    rt: list[int] = []
    fwd: list[int] = []
    try:
        for i in range(warmup + rounds):
            t0 = _clock()
            go.set()
            back.wait()
            t1 = _clock()
            back.clear()
            if i >= warmup:
                rt.append(t1 - t0)
                fwd.append(arrived[0] - t0)
    finally:
        stop[0] = True
        go.set()
        thread.join(10)
    return rt, fwd


class _PykkaHop(pykka.ThreadingActor):
    """One actor of a chain: forwards the message to ``next_ref``, or, last, answers ``reply``
    with the time its handler began."""

    def __init__(self, reply: queue.SimpleQueue[int], next_ref: pykka.ActorRef[Any] | None) -> None:
        super().__init__()
        self.reply = reply
        self.next_ref = next_ref

    def on_receive(self, message: Any) -> None:
        now = _clock()
        if self.next_ref is None:
            self.reply.put(now)
        else:
            self.next_ref.tell(message)


class _PushHop(PushActor):
    """The same hop through the project's base: TimedInbox, ``@handles`` dispatch, one Note."""

    actor_name = "bench"

    def __init__(self, ctx: RankContext, reply: queue.SimpleQueue[int], next_ref: pykka.ActorRef[Any] | None) -> None:
        super().__init__(ctx)
        self.reply = reply
        self.next_ref = next_ref

    @handles(Ping)
    def on_ping(self, msg: Ping, note: Note) -> None:
        now = _clock()
        if self.next_ref is None:
            self.reply.put(now)
        else:
            self.next_ref.tell(msg)


def _actor_chain(kind: str, hops: int, rounds: int, warmup: int) -> Samples:
    """``hops`` actors (1: a single tell); forward = the sender's stamp → the last handler."""
    reply: queue.SimpleQueue[int] = queue.SimpleQueue()
    ctx = RankContext(config=PushConfig(engine_id="bench"), engine_id="bench")
    refs: list[pykka.ActorRef[Any]] = []
    next_ref: pykka.ActorRef[Any] | None = None
    try:
        for _ in range(hops):  # built from the last, so each knows the one after it
            ref = _PushHop.start(ctx, reply, next_ref) if kind == "pushactor" else _PykkaHop.start(reply, next_ref)
            refs.append(ref)
            next_ref = ref
        first = refs[-1]
        rt: list[int] = []
        fwd: list[int] = []
        for i in range(warmup + rounds):
            t0 = _clock()
            first.tell(Ping(t0))
            arrived = reply.get(timeout=60)
            t1 = _clock()
            if i >= warmup:
                rt.append(t1 - t0)
                fwd.append(arrived - t0)
        return rt, fwd
    finally:
        for ref in reversed(refs):
            try:
                ref.stop(timeout=10)
            except pykka.ActorDeadError:
                pass


# ------------------------------------------------------------------------------------------------
# The busy engine thread
# ------------------------------------------------------------------------------------------------
class BusyThread:
    """A thread spinning pure-Python arithmetic while the ``with`` block runs; ``share`` is
    the CPU it got, as a share of the wall time it ran."""

    def __init__(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._spin, name="handoff-busy", daemon=True)
        self.loops = 0
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def _spin(self) -> None:
        cpu0, wall0 = time.thread_time(), time.monotonic()
        x, loops = 1, 0
        while not self._stop:
            for _ in range(1000):
                x = (x * 1103515245 + 12345) & 0x7FFFFFFF
            loops += 1000
        self.loops = loops
        self.cpu_s = time.thread_time() - cpu0
        self.wall_s = time.monotonic() - wall0

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join(10)

    @property
    def share(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


# ------------------------------------------------------------------------------------------------
# The suite
# ------------------------------------------------------------------------------------------------
_PING_PONG: dict[str, Callable[[int, int], Samples]] = {"simplequeue": _simplequeue, "event": _event}


def _note(args: argparse.Namespace, text: str) -> None:
    # A plain stderr line: no progress bar, whose refresh thread would take the GIL meanwhile.
    if getattr(args, "progress", True):
        print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _case(name: str, chain: int, rounds: int, warmup: int) -> dict[str, Any]:
    gc.collect()
    if name in _PING_PONG:
        rt, fwd = _PING_PONG[name](rounds, warmup)
        return {
            "hops": 1,
            "measured": "round trip / 2",
            "one_way_us": percentiles(rt, 2.0),
            "forward_us": percentiles(fwd),
            "round_trip_us": percentiles(rt),
            "share_over_1ms": share_over(rt, SLOW_NS),
        }
    kind = "pykka" if "pykka" in name else "pushactor"
    hops = chain if name.startswith("chain_") else 1
    rt, fwd = _actor_chain(kind, hops, rounds, warmup)
    out: dict[str, Any] = {
        "hops": hops,
        "measured": "tell → handler" if hops == 1 else f"chain of {hops} / {hops}",
        "one_way_us": percentiles(fwd, float(hops)),
        "forward_us": percentiles(fwd),
        "round_trip_us": percentiles(rt),
        "share_over_1ms": share_over(fwd, SLOW_NS),
    }
    if name.startswith("chain_"):
        out["chain_us"] = out["forward_us"]
        out["per_hop_us"] = out["one_way_us"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every case (idle, busy or both); the result as written to JSON."""
    rounds = getattr(args, "rounds", None) or ROUNDS
    warmup = min(getattr(args, "warmup", None) or WARMUP, rounds)
    chain = getattr(args, "chain", None) or CHAIN
    busy_mode = getattr(args, "busy", None) or "off"
    if busy_mode not in BUSY_MODES:
        raise ValueError(f"--busy must be one of {BUSY_MODES}, not {busy_mode!r}")
    busy_flags = {"off": [False], "on": [True], "both": [False, True]}[busy_mode]
    switch = getattr(args, "switch_interval", None)
    previous_switch = sys.getswitchinterval()
    load_before = os.getloadavg()
    started = time.monotonic()
    cases: list[dict[str, Any]] = []
    try:
        if switch is not None:
            sys.setswitchinterval(switch)
        for busy in busy_flags:
            for name in CASES:
                _note(args, f"{name}{' (busy thread beside)' if busy else ''}: {warmup} + {rounds} rounds")
                if busy:
                    with BusyThread() as spinner:
                        case = _case(name, chain, rounds, warmup)
                    busy_info: dict[str, Any] = {"cpu_share": round(spinner.share, 3), "loops": spinner.loops}
                else:
                    case = _case(name, chain, rounds, warmup)
                    busy_info = {}
                cases.append(
                    {
                        "case": name,
                        "busy": busy,
                        "switch_interval_s": sys.getswitchinterval(),
                        "rounds": rounds,
                        "warmup": warmup,
                        **case,
                        **({"busy_thread": busy_info} if busy else {}),
                    }
                )
    finally:
        sys.setswitchinterval(previous_switch)
    return {
        "suite": "handoff",
        "rounds": rounds,
        "warmup": warmup,
        "chain": chain,
        "busy": busy_mode,
        "switch_interval_s": switch if switch is not None else previous_switch,
        "host": {
            "cpus": os.cpu_count(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "pykka": importlib.metadata.version("pykka"),
            "machine": platform.machine(),
        },
        "seconds": round(time.monotonic() - started, 2),
        "cases": cases,
    }


def render(result: dict[str, Any]) -> str:
    """The Markdown table of one run."""
    host = result["host"]
    head = (
        f"one hand-off between Python threads, µs ({result['rounds']} rounds after {result['warmup']}; "
        f"switch interval {result['switch_interval_s'] * 1e3:g} ms; {host['cpus']} CPUs; "
        f"load avg {host['loadavg_before'][0]} → {host['loadavg_after'][0]}; "
        f"Python {host['python']}, Pykka {host['pykka']})"
    )
    columns = ["case", "busy thread", "measured", "p50", "p90", "p99", "mean", "max", "rounds ≥ 1 ms"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for c in result["cases"]:
        busy = f"spinning ({c['busy_thread']['cpu_share']:.0%} CPU)" if c["busy"] else "none"
        slow = f"{c['share_over_1ms']:.2%}"
        rows = [(c["case"], c["measured"], c["one_way_us"])]
        if "chain_us" in c:
            rows.append((f"{c['case']} (whole chain)", f"{c['hops']} hand-offs", c["chain_us"]))
        for name, measured, p in rows:
            cells = [name, busy, measured, p["p50"], p["p90"], p["p99"], p["mean"], p["max"], slow]
            lines.append("| " + " | ".join(f"{x:,.1f}" if isinstance(x, float) else str(x) for x in cells) + " |")
    return head + "\n\n" + "\n".join(lines)


def json_path(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "json", None) or "runs/bench/handoff.json")


def cli(args: argparse.Namespace) -> int:
    """Measure, print the table, write the JSON."""
    result = run(args)
    result["args"] = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    path = json_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(render(result))
    print(f"\nJSON: {path}")
    return 0


def _switch_interval(text: str) -> float:
    value = float(text)
    if not 0 < value <= 0.1:
        raise argparse.ArgumentTypeError(f"{value} must be above 0 and at most 0.1 seconds")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench/handoff.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=positive_int, default=ROUNDS, help=f"timed round trips per case ({ROUNDS})")
    ap.add_argument("--warmup", type=positive_int, default=WARMUP, help=f"untimed rounds first ({WARMUP})")
    ap.add_argument("--chain", type=positive_int, default=CHAIN, help=f"actors in the chain cases ({CHAIN})")
    ap.add_argument("--busy", choices=BUSY_MODES, default="off", help="a thread spinning Python beside (off)")
    ap.add_argument("--switch-interval", type=_switch_interval, default=None, help="sys.setswitchinterval (s)")
    ap.add_argument("--json", default=None, help="where to write the results (runs/bench/handoff.json)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no lines on stderr")
    return cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
