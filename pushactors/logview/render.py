"""Showing events: one readable line each (rich), or the original records as JSON lines.

A line reads: time after the first event, wall time, process, actor, event (coloured by
level), request id, mailbox wait and handler time, then the other fields as ``key=value``,
which rich wraps to the console's width.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, TextIO

import msgspec
from rich.console import Console
from rich.text import Text

from .clocks import ClockModel
from .model import Event

LEVEL_STYLES = {
    "debug": "blue",
    "info": "green",
    "warning": "yellow",
    "warn": "yellow",
    "error": "bold red",
    "exception": "bold red",
    "critical": "bold white on red",
}
# One colour per process, in the order processes first appear: P and D stay apart at a glance.
PROCESS_STYLES = ("cyan", "magenta", "green", "yellow", "bright_blue", "bright_cyan", "bright_magenta", "bright_green")
# Shown in their own columns, so not again among the key=value fields.
COLUMNS = frozenset({"event", "level", "ts", "pid", "actor", "rank", "request_id", "wait_ms", "handle_ms"})
# Columns grow to the widest value seen, up to these widths (longer values just push the line).
MAX_WIDTHS = {"process": 30, "actor": 14, "event": 24, "request": 24}
ID_LIMIT = 28  # longer request ids keep their head and their engine suffix

_encoder = msgspec.json.Encoder()


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, the cut marked with an ellipsis."""
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def short_id(request_id: str, limit: int = ID_LIMIT) -> str:
    """A long id's head and tail: vLLM ids differ between P and D only in the last 8 hex."""
    if len(request_id) <= limit:
        return request_id
    tail = 13  # "-0-" and the engine's 8 hex digits, with room to spare
    return request_id[: limit - tail - 1] + "…" + request_id[-tail:]


def format_value(key: str, value: Any, limit: int) -> str:
    """One field's value for a key=value pair: bare words plain, anything else as JSON."""
    if isinstance(value, str):
        if key.endswith(("request_id", "transfer_id")):
            return short_id(value)
        plain = value and not any(ch.isspace() or ch == '"' for ch in value)
        text = value if plain else _encoder.encode(value).decode()
    else:
        text = _encoder.encode(value).decode()
    return shorten(text, limit)


def wall_time(ts: float) -> str:
    """HH:MM:SS.mmm in local time ("?" for a time no calendar holds: a forged or broken ts)."""
    try:
        return datetime.fromtimestamp(ts).isoformat(timespec="milliseconds")[11:23]
    except (OverflowError, OSError, ValueError):
        return "?"


def relative_time(ts: float, origin: float) -> str:
    return f"{ts - origin:+.6f}s"


class EventRenderer:
    """Prints events as aligned, coloured lines on ``console``. Times are shown after
    ``origin`` (by default the first event shown)."""

    def __init__(self, console: Console, origin: float | None = None, max_value: int = 80) -> None:
        self.console = console
        self.origin = origin
        self.max_value = max_value
        self.widths = dict.fromkeys(MAX_WIDTHS, 0)
        self._process_styles: dict[int, str] = {}

    def fit(self, events: Iterable[Event]) -> None:
        """Widen the columns for these events (done by :meth:`show` for each batch)."""
        for ev in events:
            self._widen("process", len(ev.process))
            self._widen("actor", len(ev.actor))
            self._widen("event", len(ev.event))
            if ev.request_id is not None:
                self._widen("request", len(short_id(ev.request_id)))

    def _widen(self, column: str, width: int) -> None:
        self.widths[column] = max(self.widths[column], min(width, MAX_WIDTHS[column]))

    def process_style(self, pid: int) -> str:
        style = self._process_styles.get(pid)
        if style is None:
            style = PROCESS_STYLES[len(self._process_styles) % len(PROCESS_STYLES)]
            self._process_styles[pid] = style
        return style

    def line(self, ev: Event) -> Text:
        if self.origin is None:
            self.origin = ev.ts
        text = Text(overflow="fold")
        text.append(f"{relative_time(ev.ts, self.origin):>12}", "bold")
        text.append(f" {wall_time(ev.ts)} ", "dim")
        text.append(ev.process.ljust(self.widths["process"]), self.process_style(ev.pid))
        text.append(" ")
        text.append(ev.actor.ljust(self.widths["actor"]), "bold")
        text.append(" ")
        text.append(ev.event.ljust(self.widths["event"]), LEVEL_STYLES.get(ev.level, ""))
        text.append(" ")
        text.append(short_id(ev.request_id or "").ljust(self.widths["request"]), "bright_white")
        if ev.wait_ms is not None:
            text.append(f" wait={ev.wait_ms:.3f}ms", "cyan")
        if ev.handle_ms is not None:
            text.append(f" handle={ev.handle_ms:.3f}ms", "cyan")
        for key, value in ev.record.items():
            if key in COLUMNS:
                continue
            text.append(" ")
            text.append(f"{key}=", "dim")
            text.append(format_value(key, value, self.max_value))
        text.rstrip()
        return text

    def show(self, events: Iterable[Event]) -> None:
        batch = list(events)
        self.fit(batch)
        if self.console.color_system is None and self.console.soft_wrap:
            # Unstyled and unwrapped (a pipe, a file): the plain text is the output, ten times sooner.
            out = self.console.file
            for ev in batch:
                out.write(self.line(ev).plain + "\n")
            return
        for ev in batch:
            self.console.print(self.line(ev))


def json_record(ev: Event) -> dict[str, Any]:
    """The record as its process wrote it, plus ``ts_corrected`` when the clock correction
    moved it."""
    record = dict(ev.record)
    if ev.ts != ev.raw_ts:
        record["ts_corrected"] = ev.ts
    return record


def write_json(events: Iterable[Event], out: TextIO) -> None:
    for ev in events:
        out.write(_encoder.encode(json_record(ev)).decode())
        out.write("\n")


def describe_clocks(model: ClockModel, labels: Mapping[int, str]) -> str:
    """Each process's correction, e.g. ``pid 8774 (decode-0/pp0/tp0): -3.200 ms ±0.800 ms``:
    what was added to its timestamps, and the bound on that correction's error."""

    def name(pid: int) -> str:
        label = labels.get(pid)
        return f"pid {pid} ({label})" if label else f"pid {pid}"

    parts: list[str] = []
    if model.reference is not None:
        parts.append(f"{name(model.reference)}: reference")
    for pid in sorted(model.offsets):
        if pid != model.reference:
            correction_ms = -model.offsets[pid] * 1e3
            error_ms = model.error.get(pid, 0.0) * 1e3
            parts.append(f"{name(pid)}: {correction_ms:+.3f} ms ±{error_ms:.3f} ms")
    parts.extend(f"{name(pid)}: uncorrected" for pid in sorted(model.uncorrected))
    return "; ".join(parts)


def header(files: int, events: int, bad_lines: int, model: ClockModel, labels: Mapping[int, str]) -> str:
    """What was read, for the top of a listing."""
    read = f"{files} file{'s' * (files != 1)}, {events} event{'s' * (events != 1)}, {bad_lines} bad lines skipped"
    clocks = describe_clocks(model, labels)
    return f"{read}\nclocks: {clocks}" if clocks else read
