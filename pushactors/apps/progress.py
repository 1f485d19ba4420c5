"""Progress of long runs (demo, bench) that never garbles their output.

Progress goes to stderr only; stdout keeps just the run's result, so it can be piped or parsed.
On a terminal it is a transient rich bar, gone when the run ends so the summary printed after it
stays clean; elsewhere (pipes, CI logs) it is a plain line at most every few seconds. Notes (lines
worth keeping, like which bench case is running) print above the bar, or as plain lines.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO

PLAIN_EVERY_S = 5.0

_active: list[Progress] = []


class Progress:
    """``with Progress("demo", total=n) as progress: progress.update(done, "3 in flight")``."""

    def __init__(
        self,
        description: str,
        total: int | None = None,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        every: float = PLAIN_EVERY_S,
    ) -> None:
        self.description = description
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.completed = 0
        self.detail = ""
        self._bar: Any = None  # rich.progress.Progress on a terminal
        self._task: Any = None
        self._last_line = -float("inf")
        self._shown: tuple[int, str] | None = None

    @property
    def on_terminal(self) -> bool:
        return self._bar is not None

    def __enter__(self) -> Progress:
        if self.enabled and _isatty(self.stream):
            self._bar = _rich_bar(self.stream)
        if self._bar is not None:
            self._task = self._bar.add_task(self.description, total=self.total, detail="", count="")
            self._bar.start()
        # The first plain line waits a full period: short runs print none.
        self._last_line = time.monotonic()
        _active.append(self)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self in _active:
            _active.remove(self)
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(self, completed: int, detail: str = "", *, total: int | None = None) -> None:
        """Record progress; shown now on a terminal, in a plain line when one is due."""
        self.completed, self.detail = completed, detail
        if total is not None:
            self.total = total
        if not self.enabled:
            return
        if self._bar is not None:
            if self._shown != (completed, detail):  # callers may update in a tight loop
                self._shown = (completed, detail)
                self._bar.update(self._task, completed=completed, total=self.total, detail=detail, count=self._count())
            return
        now = time.monotonic()
        if now - self._last_line >= self.every:
            self._last_line = now
            self._line(self.line())

    def stage(self, description: str, total: int | None = None) -> None:
        """Name what runs now (a bench case), counting from zero again, out of ``total``."""
        self.description, self.total, self.completed, self.detail = description, total, 0, ""
        self._shown = None
        if self._bar is not None:
            # A fresh task, not reset(): reset keeps the old total when the new one is unknown.
            self._bar.remove_task(self._task)
            self._task = self._bar.add_task(description, total=total, detail="", count="")

    def note(self, text: str) -> None:
        """A line that stays: above the bar on a terminal, as is elsewhere."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            self._line(text)

    def line(self) -> str:
        return f"  … {self.description}: {self._count()} done" + (f", {self.detail}" if self.detail else "")

    def _count(self) -> str:
        return f"{self.completed}/{self.total}" if self.total is not None else str(self.completed)

    def _line(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed pipe must not end the run
            pass


def note(text: str) -> None:
    """A note through the innermost active :class:`Progress`, else a plain stderr line."""
    if _active:
        _active[-1].note(text)
    else:
        print(text, file=sys.stderr, flush=True)


def stage(description: str, total: int | None = None) -> None:
    """Name what runs now on the innermost active :class:`Progress` (no-op without one)."""
    if _active:
        _active[-1].stage(description, total)


def update(completed: int, detail: str = "") -> None:
    """Progress of the innermost active :class:`Progress` (no-op without one)."""
    if _active:
        _active[-1].update(completed, detail)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _rich_bar(stream: TextIO) -> Any:
    try:
        from rich.console import Console
        from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress
    except ImportError:  # no rich: plain lines
        return None
    return RichProgress(
        SpinnerColumn(),
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),  # "n/total", or just n when the total is unknown
        TimeElapsedColumn(),
        TextColumn("{task.fields[detail]}"),
        console=Console(file=stream),
        transient=True,  # gone at the end: the summary after it stays clean
        redirect_stdout=False,  # stdout is the run's result: never routed through the bar
        redirect_stderr=True,
    )
