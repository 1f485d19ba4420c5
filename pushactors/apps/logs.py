"""``pushactors logs PATH...``: the mailbox logs of every process on one time line.

    pushactors logs runs/demo/                       every *.jsonl below, merged
    pushactors logs 'logs/*.jsonl' --follow          print, then keep printing as they grow
    pushactors logs logs/ --request req-3-0          one request, P's and D's ids together
    pushactors logs logs/ --event 'write.*' --level warning --since +2.5s --until +4s
    pushactors logs logs/ --json                     the records, with ts_corrected when moved
    pushactors logs logs/ --trace req-3-0 [--plot trace.html]
    pushactors logs logs/ --summary [--plot summary.png]

Each process stamps events with its own wall clock; the handshakes' clock samples put them on
the clock of one process (``--clock-reference PID``; by default the one with most events). What
was read and each process's correction go to stderr. Exit status: 0 when something was shown,
1 when nothing matched (or the traced request is unknown), 2 for bad arguments or paths.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from ..logview.filters import EventFilter, parse_time
from ..logview.model import Event, RequestIndex
from ..logview.render import EventRenderer, header, write_json
from ..logview.source import LogSet, Timeline, sort_events
from .argtypes import interval, positive_seconds
from .interrupt import interruptible

PLOT_SUFFIXES = (".html", ".png")
LEVEL_NAMES = ("debug", "info", "warning", "error", "critical")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="PATH", help="log files, globs (quoted) or directories of *.jsonl")
    p.add_argument("-f", "--follow", action="store_true", help="keep reading as the files grow and new ones appear")
    p.add_argument(
        "--for",
        dest="for_seconds",
        type=positive_seconds,
        metavar="SECONDS",
        help="with --follow: stop after this",
    )
    p.add_argument("--poll-interval", type=interval, default=0.2, metavar="SECONDS", help="with --follow (default 0.2)")
    p.add_argument("-r", "--request", help="one request: an engine's id, its base id, a transfer id or a client id")
    p.add_argument("-a", "--actor", action="append", default=[], help="actor name or glob (repeatable)")
    p.add_argument("-e", "--event", action="append", default=[], help="event name or glob like 'write.*' (repeatable)")
    p.add_argument("-l", "--level", choices=LEVEL_NAMES, help="lowest level shown")
    p.add_argument("--rank", action="append", default=[], help="rank label substring or glob, or a pid (repeatable)")
    p.add_argument("--since", help="epoch seconds, +2.5s / +150ms after the first event, 12:34:56.789 or ISO 8601")
    p.add_argument("--until", help="as --since")
    p.add_argument("--json", action="store_true", help="JSON lines (with --trace/--summary: their JSON)")
    p.add_argument("--no-color", action="store_true", help="no colours (also off when stdout is not a terminal)")
    p.add_argument("--clock-reference", type=int, metavar="PID", help="put every process on this one's clock")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--trace", metavar="REQUEST", help="one request's timeline through the push stages")
    mode.add_argument("--summary", action="store_true", help="stage and actor percentiles of the run")
    p.add_argument("--plot", metavar="OUT.html|OUT.png", help="draw the trace (with --trace) or the summary")


def run(args: argparse.Namespace) -> int:
    try:
        selection = _event_filter(args)
        _check_modes(args)
        logs = LogSet(args.paths, follow=args.follow)
    except ValueError as exc:
        _complain(str(exc))
        return 2
    # Markup stays on: the trace and summary views style their tables with it; event lines are Text.
    console = _console(Console(no_color=args.no_color, highlight=False, emoji=False))
    timeline = Timeline(logs, args.clock_reference)
    view = _Trace(args, console) if args.trace is not None else _Listing(args, selection, console)
    try:
        first = timeline.read()
        if not args.json:
            _report_reading(args, logs, timeline, len(first))
        if args.summary or (args.plot and args.trace is None):
            return _summarize(args, selection, first, console)
        code = view.add(first, timeline)
        if not args.follow:
            return code
        view.waiting()
        interruptible()
        return _follow(args, timeline, view)
    except KeyboardInterrupt:  # Ctrl-C ends a follow; no traceback for it
        return 0 if args.follow else 130
    except BrokenPipeError:  # `pushactors logs ... | head`
        _silence_stdout()
        return 0


def _event_filter(args: argparse.Namespace) -> EventFilter:
    return EventFilter(
        request=args.request,
        actors=args.actor,
        events=args.event,
        level=args.level,
        ranks=args.rank,
        since=parse_time(args.since) if args.since else None,
        until=parse_time(args.until) if args.until else None,
    )


def _check_modes(args: argparse.Namespace) -> None:
    if args.plot and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"--plot {args.plot}: the file name must end in .html or .png")
    if args.follow and (args.summary or (args.plot and args.trace is None)):
        raise ValueError("--follow does not combine with --summary or a summary plot (`pushactors top` is live)")
    if args.poll_interval <= 0:
        raise ValueError("--poll-interval must be positive")


def _console(console: Console) -> Console:
    # Into a pipe or a file, one event stays one line (grep-able); on a terminal rich wraps it.
    console.soft_wrap = not console.is_terminal
    return console


def _complain(message: str) -> None:
    print(f"pushactors logs: {message}", file=sys.stderr)


def _report_reading(args: argparse.Namespace, logs: LogSet, timeline: Timeline, events: int) -> None:
    err = _console(Console(stderr=True, no_color=args.no_color, highlight=False, emoji=False, markup=False))
    text = header(len(logs.files), events, logs.bad_lines, timeline.clocks, timeline.labels)
    if args.clock_reference is not None and args.clock_reference not in timeline.counts and events:
        text += f"\nclock reference: pid {args.clock_reference} logged nothing here"
    err.print(Text(text, style="dim"))


def _follow(args: argparse.Namespace, timeline: Timeline, view: _Trace | _Listing) -> int:
    deadline = None if args.for_seconds is None else time.monotonic() + args.for_seconds
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return 0
        time.sleep(args.poll_interval if deadline is None else min(args.poll_interval, deadline - now))
        view.add(timeline.read(), timeline)


class _Listing:
    """Prints the chosen events, batch after batch."""

    def __init__(self, args: argparse.Namespace, selection: EventFilter, console: Console) -> None:
        self.args = args
        self.selection = selection
        self.console = console
        self.renderer = EventRenderer(console)
        self.index = RequestIndex() if selection.request is not None else None
        self.origin: float | None = None
        self.shown = 0

    def add(self, batch: list[Event], timeline: Timeline) -> int:
        """Show what matches in ``batch``; the exit status if this were the last batch."""
        if self.origin is None and batch:
            self.origin = batch[0].ts
            self.renderer.origin = self.origin
        if self.index is not None:
            for ev in batch:
                self.index.add(ev)
        self.selection.bind(self.index, self.origin)
        chosen = [ev for ev in batch if self.selection.matches(ev)]
        if self.args.json:
            write_json(chosen, sys.stdout)
            sys.stdout.flush()
        else:
            self.renderer.show(chosen)
            self.console.file.flush()
        self.shown += len(chosen)
        if self.shown or self.args.follow:
            return 0
        if self.selection.request is not None and not self.selection.request_ids:
            _complain(f"no events for request {self.selection.request}")
        elif batch:
            _complain(f"none of {len(batch)} events matched")
        else:
            _complain("no events in the logs")
        return 1

    def waiting(self) -> None:
        pass


class _Trace:
    """One request's timeline, drawn again whenever events of that request arrive."""

    def __init__(self, args: argparse.Namespace, console: Console) -> None:
        self.args = args
        self.query: str = args.trace
        self.console = console
        self.events: list[Event] = []
        self.index = RequestIndex()
        self.concerns = EventFilter(request=self.query)
        self.found = False

    def add(self, batch: list[Event], timeline: Timeline) -> int:
        self.events.extend(batch)
        for ev in batch:
            self.index.add(ev)
        self.concerns.bind(self.index)
        if not any(self.concerns.matches(ev) for ev in batch):
            return 0 if self.found else self._unknown()
        from ..logview.trace import build_trace, render_trace

        timeline.clocks.apply(self.events)  # newer clock samples may have moved older events
        sort_events(self.events)
        trace = build_trace(self.events, self.index, self.query)
        if not trace.found:
            return self._unknown()
        self.found = True
        if self.args.json:
            _print_json(trace.to_json())
        else:
            render_trace(trace, self.console)
        return _plot("trace", trace, self.args.plot) if self.args.plot else 0

    def _unknown(self) -> int:
        if not self.args.follow:
            _complain(f"no events for request {self.query}")
        return 1

    def waiting(self) -> None:
        if not self.found:
            _complain(f"waiting for events of request {self.query}")


def _summarize(args: argparse.Namespace, selection: EventFilter, events: list[Event], console: Console) -> int:
    index = RequestIndex.build(events) if selection.request is not None else None
    selection.bind(index, events[0].ts if events else None)
    chosen = [ev for ev in events if selection.matches(ev)]
    if not chosen:
        _complain("no events to summarize")
        return 1
    from ..logview.summary import render_summary, summarize

    summary = summarize(chosen)
    if args.json:
        _print_json(summary.to_json())
    elif args.summary:
        render_summary(summary, console)
    return _plot("summary", summary, args.plot) if args.plot else 0


def _plot(drawer: str, subject: Any, path: str) -> int:
    """Draw with :mod:`pushactors.logview.plot` (matplotlib, an optional dependency)."""
    try:
        from ..logview.plot import plot_summary, plot_trace

        if drawer == "trace":
            plot_trace(subject, Path(path))
        else:
            plot_summary(subject, Path(path))
    except ImportError as exc:
        _complain(f"--plot needs matplotlib (pip install 'pushactors[plot]'): {exc}")
        return 2
    except OSError as exc:  # a missing directory, a directory named like the file, no rights
        _complain(f"--plot {path}: cannot write it: {exc.strerror or exc}")
        return 2
    _complain(f"drawn in {path}")
    return 0


def _print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")
    sys.stdout.flush()


def _silence_stdout() -> None:
    # The reader went away: point stdout at /dev/null so the interpreter's final flush is quiet.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
