"""``pushactors top``: a live view of a running engine's ranks, from the JSON logs it writes.

    pushactors top runs/demo                     # every *.jsonl below the directory, followed
    pushactors top 'logs/*.jsonl' --interval 1   # a glob, re-expanded on every refresh
    pushactors top runs/demo --once              # one table of everything written so far
    pushactors top runs/demo --json --for 10     # one JSON object per refresh, for 10 seconds

One row per rank (grouped by process): pushes in flight, leases, registrations and receives
waiting (from the latest ``rank.stats``, whose age is shown), pushes done, handshakes and failures
(counted from events), bytes moved; and per actor its mailbox depth, messages per second and
handler/mailbox-wait percentiles over the last few seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..logview.board import WINDOW_S, Board, RankStats, Snapshot
from ..logview.source import LogSet
from .argtypes import interval, positive_seconds
from .interrupt import interruptible


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files, globs or directories of *.jsonl")
    p.add_argument("--interval", type=interval, default=0.5, help="seconds between refreshes (default 0.5)")
    p.add_argument(
        "--window",
        type=positive_seconds,
        default=WINDOW_S,
        help="seconds of rates and percentiles (default 5)",
    )
    p.add_argument("--once", action="store_true", help="print one snapshot of what is written so far and exit")
    p.add_argument("--json", action="store_true", help="one JSON object per refresh instead of tables")
    p.add_argument(
        "--for",
        dest="duration",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="exit after this long",
    )


def run(args: argparse.Namespace) -> int:
    try:
        import rich  # noqa: F401
    except ImportError:
        print("pushactors top needs rich: pip install rich", file=sys.stderr)
        return 2
    if args.interval <= 0 or args.window <= 0:
        print("pushactors top: --interval and --window must be positive", file=sys.stderr)
        return 2
    follower = LogSet(args.paths, follow=True)
    if not args.once:
        interruptible()
    board = Board(window_s=args.window)
    try:
        if args.once:
            return _once(follower, board, as_json=args.json)
        return _follow(follower, board, args)
    except KeyboardInterrupt:
        return 0


def snapshot(follower: LogSet, board: Board) -> Snapshot:
    return board.snapshot(time.time(), files=len(follower.files), bad_lines=follower.bad_lines)


def _once(follower: LogSet, board: Board, *, as_json: bool) -> int:
    while True:  # a poll reads a bounded chunk per file: drain the backlog
        events = follower.poll()
        if not events:
            break
        board.add_all(events)
    if not follower.files:
        print(f"pushactors top: no log files at {' '.join(follower.paths)}", file=sys.stderr)
        return 2
    snap = snapshot(follower, board)
    if as_json:
        print(json.dumps(snap.to_json()), flush=True)
        return 0
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(render(snap))
    return 0


def _follow(follower: LogSet, board: Board, args: argparse.Namespace) -> int:
    start = time.monotonic()
    end = start + args.duration if args.duration is not None else None

    def tick() -> Snapshot:
        board.add_all(follower.poll())
        return snapshot(follower, board)

    def wait_next(tick_no: int) -> bool:
        """Sleep until the next refresh; False once --for has run out."""
        wake = start + tick_no * args.interval
        if end is not None and wake >= end:
            time.sleep(max(0.0, end - time.monotonic()))
            return False
        time.sleep(max(0.0, wake - time.monotonic()))
        return True

    tick_no = 0
    if args.json:
        while True:
            print(json.dumps(tick().to_json()), flush=True)
            tick_no += 1
            if not wait_next(tick_no):
                return 0
    from rich.live import Live

    # Refreshed by hand after each read, so the screen never shows a half-read state.
    with Live(render(tick()), auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as live:
        while True:
            tick_no += 1
            if not wait_next(tick_no):
                return 0
            live.update(render(tick()), refresh=True)


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------
def render(snap: Snapshot) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    header = Text.assemble(
        ("pushactors top", "bold"),
        f"  {snap.files} files · {snap.events:,} events",
        (f" · {snap.bad_lines} bad lines" if snap.bad_lines else ""),
        f" · window {snap.window_s:g} s · landed on D {snap.landed} · pushed by P {snap.pushed} · ",
        time.strftime("%H:%M:%S", time.localtime(snap.at)),
    )
    if not snap.ranks:
        return Group(header, Text("no rank events yet", style="dim"))

    ranks = Table(title="ranks", title_justify="left", expand=False)
    for name in (
        *("pid", "rank", "stats", "msg/s", "inflight", "leases", "regs", "recvs", "handshakes", "done", "failed"),
        *("last failure", "received", "sent"),
    ):
        text = name in ("rank", "last failure")
        ranks.add_column(name, justify="left" if text else "right", no_wrap=name != "last failure", max_width=40)
    actors = Table(title="actors", title_justify="left", expand=False)
    for name in ("pid", "rank", "actor", "mailbox", "msg/s", "p50 ms", "p99 ms", "wait p99", "handled"):
        actors.add_column(name, justify="left" if name in ("rank", "actor") else "right", no_wrap=True)

    for i, r in enumerate(snap.ranks):
        last_of_pid = i + 1 == len(snap.ranks) or snap.ranks[i + 1].pid != r.pid
        ranks.add_row(
            str(r.pid),
            r.rank,
            _age(r),
            f"{r.per_s:,.0f}",
            _opt(r.in_flight),
            _opt(r.leases),
            _opt(r.pending_registrations),
            _opt(r.recvs_waiting),
            f"{r.handshakes_started}/{r.handshakes_completed}/{r.handshakes_failed}",
            str(r.pushes_done),
            Text(str(r.failures), style="bold red" if r.failures else ""),
            Text(r.last_failure, style="red"),
            _bytes(r.bytes_received),
            _bytes(r.bytes_sent),
            end_section=last_of_pid,
        )
        for j, a in enumerate(r.actors):
            depth = _opt(a.mailbox) + ("" if a.answered else " ?")
            actors.add_row(
                str(r.pid),
                r.rank,
                a.actor,
                Text(depth, style="bold yellow" if (a.mailbox or 0) > 0 or not a.answered else ""),
                f"{a.per_s:,.0f}",
                _ms(a.handle_p50_ms),
                _ms(a.handle_p99_ms),
                _ms(a.wait_p99_ms),
                str(a.handled),
                end_section=j + 1 == len(r.actors),
            )
    legend = Text(
        "stats: age of the latest rank.stats · inflight: WRITEs posted, not settled · leases: P blocks held · "
        "regs: P registrations waiting for blocks · recvs: D receives waiting for KV · handshakes: started/"
        "completed/failed · done: pushes finished (P) or landed (D) · mailbox ?: actor did not answer",
        style="dim",
    )
    return Group(header, ranks, actors, legend)


def _age(r: RankStats) -> Any:
    from rich.text import Text

    if r.stats_age_s is None:
        return Text("—", style="red" if r.stale else "dim")
    text = f"{r.stats_age_s:.1f}s"
    return Text(f"stale {text}", style="bold red") if r.stale else Text(text)


def _opt(value: int | None) -> str:
    return "—" if value is None else str(value)


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
