"""``pushactors bench <suite>``: the performance suites of docs/performance.md.

    pushactors bench big   [--device cuda] [--shape 70b] [--config KEY=VALUE ...]
    pushactors bench small [--device cuda] [--engine model --engine-step 0.010 --engine-share 0.5]
    pushactors bench control
    pushactors bench dram
    pushactors bench xpyd  [--prefills 8 --decodes 8 --p-tp 1,2 --requests 20000 --in-flight 4000]
    pushactors bench handoff [--rounds 2000] [--chain 3] [--busy off|on|both]
    pushactors bench fence [--device cuda] [--process-model auto|two-process|in-process] [--sizes B,...] [--reps 5]

Each suite prints a table and writes JSON (``--json``, default ``runs/bench/<suite>.json``),
every pushactors case beside its bare-NIXL baseline measured in the same run. The suites live
in the source tree's ``bench/`` directory (``bench/suites.py``, ``bench/bare_nixl.py``), found
next to this package or under the working directory (or at ``$PUSHACTORS_BENCH_DIR``); they are
not part of an installed wheel. ``handoff`` (``bench/handoff.py``) has no NIXL in it: it
measures one hand-off between Python threads (a queue, an event, a Pykka or pushactors tell, a
chain of actors), the floor under every hop of a push. ``fence`` (``bench/fence.py``) asks NIXL/UCX
whether D deregistering (and re-registering) a region stops a WRITE that P posts late with what
it loaded before, and what re-registration and reloading D's metadata cost.

``--engine model`` (small, big, dram, layerwise) runs each node's loop as a real engine thread:
every ``--engine-step`` seconds its input and the connector hooks, Python work for
``--engine-share`` of the step, then a wait with the GIL free (pushactors/testing/engine_model.py);
each case then reports the hooks' time per step and the engine's Python work per second, idle
(``--engine-idle`` seconds) and while the pushes ran, and every push's bytes are checked.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

from .argtypes import nonnegative_seconds, positive_int, positive_int_list, positive_seconds, unit_share

SUITES = ("big", "small", "control", "dram", "xpyd", "handoff", "fence", "layerwise")
ENGINE_SUITES = ("big", "small", "dram", "layerwise")  # the ones --engine model applies to
ENGINES = ("loop", "model")
MODULE_SUITES = ("handoff", "fence", "layerwise")  # bench/<name>.py
PROCESS_MODELS = ("auto", "two-process", "in-process")
BUSY_MODES = ("off", "on", "both")
SHAPES = ("8b", "70b")
LAYOUTS = ("hnd", "blhnc")
PATTERNS = ("contiguous", "fragmented", "scattered")


def bench_dir() -> Path:
    """The directory holding ``suites.py`` and ``bare_nixl.py``."""
    env = os.environ.get("PUSHACTORS_BENCH_DIR")
    candidates = [Path(env)] if env else []
    candidates += [Path(__file__).resolve().parents[2] / "bench", Path.cwd() / "bench"]
    for c in candidates:
        if (c / "suites.py").is_file() and (c / "bare_nixl.py").is_file():
            return c
    raise FileNotFoundError(
        "the benchmark suites (bench/suites.py) are not here: run from a source checkout "
        "or set PUSHACTORS_BENCH_DIR to its bench/ directory"
    )


def load_suites() -> ModuleType:
    """Import ``bench/suites.py`` as the top-level module ``suites``. Its directory goes on
    ``sys.path``, which spawned benchmark processes inherit, so they import it too."""
    return load_bench_module("suites")


def load_bench_module(name: str) -> ModuleType:
    """Import ``bench/<name>.py`` as the top-level module ``name`` (its directory on ``sys.path``)."""
    path = str(bench_dir())
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def engine_step(text: str) -> float:
    """An engine step: above 0, at most 1 second."""
    value = positive_seconds(text)
    if value > 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be at most 1 second")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "suite",
        choices=SUITES,
        help="big | small | control | dram | xpyd | handoff | fence | layerwise (docs/performance.md)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where KV lives (default cpu: DRAM)")
    p.add_argument(
        "--json",
        default=None,
        help="where to write the results (default runs/bench/<suite>.json; big-70b.json for --shape 70b)",
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    p.add_argument(
        "--config",
        action="append",
        metavar="KEY=VALUE",
        help="PushConfig setting for both nodes (repeatable; VALUE as JSON when it parses)",
    )
    for role, who in (("p", "P (prefill)"), ("d", "D (decode)")):
        p.add_argument(
            f"--{role}-config",
            action="append",
            metavar="KEY=VALUE",
            help=f"layerwise: PushConfig setting for the {who} node only, over --config (repeatable)",
        )
    p.add_argument("--shape", default="8b", choices=SHAPES, help="big: model shape (default 8b)")
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=None,
        help="big/dram/xpyd: tokens per request (xpyd default: 17-48 at random)",
    )
    p.add_argument("--layers", type=positive_int, default=None, help="big/dram: override the shape's layer count")
    p.add_argument("--layouts", default=None, help=f"big/dram: comma list of {','.join(LAYOUTS)}")
    p.add_argument("--patterns", default=None, help=f"big/dram: D block orders, of {','.join(PATTERNS)}")
    p.add_argument(
        "--reps", type=positive_int, default=None, help="big/dram: timed requests per case; fence: timed repetitions"
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="small: push sizes in bytes (default 65536,262144,1048576,4194304); "
        "fence: regions re-registered, bytes (default 1 MiB, 64 MiB, 512 MiB)",
    )
    p.add_argument("--count", type=positive_int, default=None, help="small: pushes per size (default 200)")
    p.add_argument("--pushes", type=positive_int, default=None, help="control: pushes timed (default 3000)")
    p.add_argument(
        "--engine-busy",
        type=unit_share,
        default=0.0,
        help="small, --engine loop: share of time a thread beside each node's loop runs Python (0 to 1; default 0)",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="loop",
        help="small/big/dram/layerwise: how each node's engine thread runs. loop (default): it steps about "
        "every ms and does nothing else; model: as a real engine's, every --engine-step its input and "
        "the connector hooks, then Python for --engine-share of the step, then a GIL-free wait; each case "
        "reports the hooks' time per step and the Python work done per second, idle and with pushes, and "
        "checks every push's bytes",
    )
    p.add_argument(
        "--engine-step",
        type=engine_step,
        default=0.010,
        help="--engine model: seconds per engine step (default 0.010)",
    )
    p.add_argument(
        "--engine-share",
        type=unit_share,
        default=0.5,
        help="--engine model: share S of each step the engine runs Python after the hooks (0 to 1; default 0.5)",
    )
    p.add_argument(
        "--engine-idle",
        type=positive_seconds,
        default=None,
        help="--engine model: seconds of the idle baseline phase of each node pair (default 2; 1 with --quick)",
    )
    p.add_argument(
        "--switch-interval",
        type=positive_seconds,
        default=None,
        help="small: the nodes' interpreter switch interval; handoff: this process's; seconds "
        "(default: CPython's 0.005)",
    )
    p.add_argument(
        "--in-flight", type=positive_int, default=None, help="control/xpyd: requests in flight (default 64; xpyd 2000)"
    )
    p.add_argument(
        "--step-interval",
        type=nonnegative_seconds,
        default=0.001,
        help="control: engine step period in seconds",
    )
    p.add_argument(
        "--registrations",
        type=positive_int_list,
        default=None,
        help="control: outstanding registrations (default 100,100000)",
    )
    p.add_argument("--matches", type=positive_int, default=None, help="control: push cycles timed per registry size")
    p.add_argument("--prefills", type=positive_int, default=8, help="xpyd: P engines (default 8)")
    p.add_argument("--decodes", type=positive_int, default=8, help="xpyd: D engines (default 8)")
    p.add_argument("--p-tp", default="1", help="xpyd: TP of each P engine, cycled over them (e.g. 1,2; default 1)")
    p.add_argument("--d-tp", default="1", help="xpyd: TP of each D engine, cycled over them (default 1)")
    p.add_argument("--requests", type=positive_int, default=None, help="xpyd: requests served (default 20000)")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=None,
        help="handoff: timed round trips per case, after 200 untimed (default 2000; 500 with --quick)",
    )
    p.add_argument("--chain", type=positive_int, default=3, help="handoff: actors in the chain cases (default 3)")
    p.add_argument(
        "--busy",
        choices=BUSY_MODES,
        default="off",
        help="handoff: a thread spinning Python beside the cases: off, on, or both one after the other (default off)",
    )
    p.add_argument(
        "--process-model",
        choices=PROCESS_MODELS,
        default="auto",
        help="fence: P and D in two processes, or in one (auto: two, one if two fails on DRAM)",
    )
    p.add_argument("--seed", type=int, default=0, help="big/dram: seed of the fragmented/scattered block orders")
    p.add_argument(
        "--bare-poll",
        type=nonnegative_seconds,
        default=None,
        help="bare NIXL target's pause between notification checks, seconds (default: 0.001 for big/dram "
        "as an engine loop steps, 0 for small)",
    )
    p.add_argument(
        "--forward-us",
        type=float,
        default=2000.0,
        help="small: P's forward on the engine's default (armed) path, µs of waiting on the device "
        "(the interpreter free); the push is armed meanwhile (default 2000)",
    )
    p.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds one request may take")
    p.add_argument(
        "--logs",
        default=None,
        metavar="DIR",
        help="layerwise: each node's events as JSON lines under DIR (every level: slower, for a breakdown)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="layerwise: the writers stamp each push's steps in memory (PushConfig.timeline) and the "
        "report gives each step's median time after the last layer (no logs, so no log cost)",
    )
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress on stderr (by default: a bar on a terminal, log lines elsewhere)",
    )


def engine_refusal(args: argparse.Namespace) -> str | None:
    """Why ``--engine`` and its options cannot run as given (None when they can)."""
    if getattr(args, "engine", "loop") != "model":
        return None
    if args.suite not in ENGINE_SUITES:
        return f"--engine model is for {', '.join(ENGINE_SUITES)}, not {args.suite}"
    if args.engine_busy:
        return (
            "--engine-busy is a thread beside the plain loop; with --engine model the engine's own "
            "Python work is --engine-share"
        )
    return None


def run(args: argparse.Namespace) -> int:
    from ..core.config import ConfigError

    if args.suite == "handoff" and args.rounds is None and args.quick:
        args.rounds = 500
    refused = engine_refusal(args)
    if refused:
        print(f"pushactors bench: {refused}", file=sys.stderr)
        return 2
    if args.suite in MODULE_SUITES:
        # Suites in a module of their own under bench/, each with a cli(args).
        try:
            module = load_bench_module(args.suite)
        except FileNotFoundError as exc:
            print(f"pushactors bench: {exc}", file=sys.stderr)
            return 2
        return int(module.cli(args))
    try:
        suites = load_suites()
    except FileNotFoundError as exc:
        print(f"pushactors bench: {exc}", file=sys.stderr)
        return 2
    try:
        return int(suites.run(args))
    except ConfigError as exc:
        print(f"pushactors bench: {exc}", file=sys.stderr)
        return 2
