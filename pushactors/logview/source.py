"""Log files named by paths, globs and directories, read incrementally and followed.

A writer appends whole lines, but a reader can catch the last one half written (the sink's
buffer is flushed in pieces), so a reader keeps an unterminated tail until its newline comes.
Files are followed the way ``tail -F`` does: a file that shrinks is read again from its start.
A log the sink rotates (``events.jsonl`` -> ``events.jsonl.1`` -> ``events.jsonl.2``) is read as
one: naming the file (or any of its rotated files, a glob or a directory holding it) reads the
rotated files oldest first, then the file; when the file is rotated while followed, the rest of
the file that was renamed is read before the new one.
"""

from __future__ import annotations

import glob
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO

from . import clocks
from .clocks import ClockModel
from .model import Event, parse_line

_GLOB_CHARS = frozenset("*?[")
_CHUNK = 4 << 20  # bytes read per system call: bounds memory on a huge file


_ROTATED = re.compile(r"^(?P<base>.+)\.(?P<index>[1-9][0-9]*)$")


def base_of(path: Path) -> Path:
    """The file a rotated file (``events.jsonl.3``) was rotated from; any other path itself."""
    m = _ROTATED.match(path.name)
    return path.with_name(m["base"]) if m else path


def rotated_of(path: Path) -> list[Path]:
    """The rotated files of ``path`` now, oldest first (``path.N`` .. ``path.1``)."""
    found: list[tuple[int, Path]] = []
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return []
    for sibling in siblings:
        m = _ROTATED.match(sibling.name)
        if m and m["base"] == path.name and sibling.is_file():
            found.append((int(m["index"]), sibling))
    return [p for _, p in sorted(found, reverse=True)]


def _logs_under(directory: Path) -> list[Path]:
    """Every ``*.jsonl`` below ``directory``, rotated sets as their base file."""
    found = {base_of(p) for p in directory.rglob("*.jsonl*") if p.is_file()}
    return sorted(p for p in found if p.suffix == ".jsonl")


def _files_of(pattern: str) -> list[Path]:
    """The files one path argument names now (none when it names nothing yet)."""
    text = os.path.expanduser(pattern)
    matches = sorted(Path(m) for m in glob.glob(text, recursive=True)) if _GLOB_CHARS & set(text) else [Path(text)]
    files: list[Path] = []
    for match in matches:
        if match.is_dir():
            files.extend(_logs_under(match))
        elif match.is_file():
            files.append(base_of(match))  # a rotated file is read with its whole set
        elif rotated_of(match):
            files.append(match)  # only rotated files left (the process is gone, say)
    return files


def expand(paths: Sequence[str], *, missing_ok: bool = False) -> list[Path]:
    """The log files ``paths`` name: files as given, globs expanded, directories replaced by
    every ``*.jsonl`` below them; each file once, in the order the paths name them.

    Raises ValueError naming every path that matches no file, unless ``missing_ok`` (when
    following, such a file may appear later)."""
    files: list[Path] = []
    seen: set[Path] = set()
    missing: list[str] = []
    for pattern in paths:
        found = _files_of(pattern)
        if not found:
            missing.append(pattern)
        for path in found:
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                files.append(path)
    if missing and not missing_ok:
        raise ValueError(f"no log files at {', '.join(missing)} (give files, globs, or directories holding *.jsonl)")
    return files


# No event of ours comes near this; a longer line is counted bad and skipped, not buffered.
MAX_LINE_BYTES = 4 << 20


Identity = tuple[int, int]  # (st_dev, st_ino): the same file under whatever name


def _fstat_identity(fh: IO[bytes]) -> Identity:
    stat = os.fstat(fh.fileno())
    return (stat.st_dev, stat.st_ino)


class LogReader:
    """Reads one file's new complete lines on each call, remembering where it stopped; its
    rotated files first (see the module's docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.source = str(path)
        self.offset = 0  # bytes of the followed file consumed, the unterminated tail included
        self.lines = 0  # complete lines consumed: the next event's line number is lines + 1
        self.bad_lines = 0
        self._tail = b""
        self._skipping = False
        self._identity: Identity | None = None  # the followed file, under whatever name now
        self._done: set[Identity] = set()  # rotated files read to their end

    @property
    def partial_bytes(self) -> int:
        """Bytes of an unterminated last line kept for the next read (at most ``MAX_LINE_BYTES``)."""
        return len(self._tail)

    def read_new(self, final: bool = False) -> list[Event]:
        """Events on the lines completed since the last call. With ``final``, an unterminated
        last line is taken as it is (an event if it parses, else a bad line), not kept back."""
        events: list[Event] = []
        try:
            fh: IO[bytes] | None = open(self.path, "rb")  # noqa: SIM115 - closed below
        except OSError:  # not there (yet, or between a rotation's rename and the new file)
            fh = None
        try:
            identity = _fstat_identity(fh) if fh is not None else None
            if identity is None or identity != self._identity:
                # The first read, a rotation, or the file gone: what was rotated comes first.
                events.extend(self._read_rotated())
            if fh is not None and identity is not None:
                if identity != self._identity or os.fstat(fh.fileno()).st_size < self.offset:
                    self._restart(identity)  # a new file, or this one truncated
                events.extend(self._read_from(fh))
        except OSError:  # not readable right now: try again on the next call
            pass
        finally:
            if fh is not None:
                fh.close()
        if final and self._tail:
            tail, self._tail = self._tail, b""
            events.extend(self._parse([tail]))
        return events

    def _read_rotated(self) -> list[Event]:
        """The rotated files not read to their end yet, oldest first: at the start all of them;
        after a rotation the rest of the followed file (now ``path.K``) and any file written
        and rotated since the last read."""
        events: list[Event] = []
        present: set[Identity] = set()
        for path in rotated_of(self.path):
            try:
                with open(path, "rb") as fh:
                    identity = _fstat_identity(fh)
                    present.add(identity)
                    if identity in self._done:
                        continue
                    if identity != self._identity:
                        self._restart(identity)  # new to this reader: from its start
                    events.extend(self._read_from(fh))
            except OSError:
                continue
            if self._tail:  # a rotated file is complete: its last line ends there
                tail, self._tail = self._tail, b""
                events.extend(self._parse([tail]))
            self._done.add(identity)
            self._identity = None  # read to its end; whatever comes next starts afresh
        self._done &= present  # forget files the sink deleted
        return events

    def _read_from(self, fh: IO[bytes]) -> list[Event]:
        fh.seek(self.offset)
        events: list[Event] = []
        while chunk := fh.read(_CHUNK):
            self.offset += len(chunk)
            events.extend(self._take_lines(chunk))
        return events

    def _restart(self, identity: Identity) -> None:
        """Read ``identity`` (another file, or this one truncated) from its start."""
        self.offset = 0
        self.lines = 0
        self._tail = b""
        self._skipping = False
        self._identity = identity

    def _take_lines(self, chunk: bytes) -> list[Event]:
        if self._skipping:  # inside a line too long to be one of our events: drop to its end
            end = chunk.find(b"\n")
            if end < 0:
                return []
            chunk, self._skipping = chunk[end + 1 :], False
            self.lines += 1
        pieces = (self._tail + chunk).split(b"\n")
        self._tail = pieces.pop()
        if len(self._tail) > MAX_LINE_BYTES:
            # A follower must not buffer a "line" without end (a binary file, a runaway writer).
            self._tail, self._skipping = b"", True
            self.bad_lines += 1
        return self._parse(pieces)

    def _parse(self, lines: Iterable[bytes]) -> list[Event]:
        events: list[Event] = []
        for raw in lines:
            self.lines += 1
            if not raw.strip():
                continue
            ev = parse_line(raw, self.source, self.lines)
            if ev is None:
                self.bad_lines += 1
            else:
                events.append(ev)
        return events


class LogSet:
    """The files some paths name. When following, the paths are expanded again on every
    :meth:`poll`, so files that appear later (a new process's log in a watched directory, a
    file matching a glob) join in, and unterminated last lines wait for their newline."""

    def __init__(self, paths: Sequence[str], follow: bool = False) -> None:
        self.paths = list(paths)
        self.follow = follow
        self._readers: dict[Path, LogReader] = {}
        self._discover()  # a bad path fails here, before anything is read

    def _discover(self) -> None:
        for path in expand(self.paths, missing_ok=self.follow):
            key = path.resolve()
            if key not in self._readers:
                self._readers[key] = LogReader(path)

    @property
    def files(self) -> list[Path]:
        return [reader.path for reader in self._readers.values()]

    @property
    def bad_lines(self) -> int:
        return sum(reader.bad_lines for reader in self._readers.values())

    def poll(self) -> list[Event]:
        """New events from every file, in file order, with their own processes' timestamps."""
        if self.follow:
            self._discover()
        events: list[Event] = []
        for reader in self._readers.values():
            events.extend(reader.read_new(final=not self.follow))
        return events

    def read_all(self) -> list[Event]:
        """Everything the files hold now that was not read yet (all of it, on the first call)."""
        return self.poll()


def sort_events(events: list[Event]) -> None:
    events.sort(key=lambda ev: (ev.ts, ev.source, ev.line))


def load(paths: Sequence[str], reference: int | None = None) -> tuple[list[Event], ClockModel]:
    """Every event the paths hold, on one clock (see :mod:`.clocks`), in time order."""
    events = LogSet(paths).read_all()
    model = clocks.estimate(events, reference)
    model.apply(events)
    sort_events(events)
    return events, model


class Timeline:
    """A :class:`LogSet`'s events on one clock, batch by batch, for readers that follow.

    Clocks are estimated again whenever a batch brings a new clock sample (a
    ``handshake.completed``) or a new process; the estimate then sees only those samples and
    each process's first and last event per rank (all that :func:`.clocks.estimate` looks at
    besides event counts), so following for hours keeps no history. The reference process is
    chosen once (the one with most events in the first batch, unless given) so corrections stay
    comparable; events already returned keep the correction they had. Events without a pid are
    returned uncorrected.
    """

    def __init__(self, logs: LogSet, reference: int | None = None) -> None:
        self.logs = logs
        self.wanted = reference  # the caller's choice, used once that process has logged
        self.reference: int | None = None
        self.clocks = ClockModel()
        self.labels: dict[int, str] = {}  # pid -> its rank label (empty for a process without one)
        self.counts: Counter[int] = Counter()  # events per pid
        self._handshakes: list[Event] = []
        self._ends: dict[tuple[str, int], tuple[Event, Event]] = {}

    def read(self) -> list[Event]:
        """New events, corrected and in time order."""
        batch = self.logs.poll()
        if self._note(batch):
            if self.wanted in self.counts:
                self.reference = self.wanted
            elif self.reference is None:
                self.reference = self.counts.most_common(1)[0][0]
            self.clocks = clocks.estimate(self._samples(), self.reference)
        self.clocks.apply(batch)
        sort_events(batch)
        return batch

    def _note(self, batch: Iterable[Event]) -> bool:
        """Remember what the clock estimate needs; True when that changed."""
        changed = False
        for ev in batch:
            if not ev.pid:
                continue
            if ev.pid not in self.counts:
                changed = True
            self.counts[ev.pid] += 1
            if ev.rank and not self.labels.get(ev.pid):
                self.labels[ev.pid] = ev.rank
            self.labels.setdefault(ev.pid, "")
            if ev.event == "handshake.completed":
                self._handshakes.append(ev)
                changed = True
            key = (ev.rank, ev.pid)
            first, last = self._ends.get(key, (ev, ev))
            self._ends[key] = (ev if ev.raw_ts < first.raw_ts else first, ev if ev.raw_ts > last.raw_ts else last)
        return changed

    def _samples(self) -> list[Event]:
        samples = list(self._handshakes)
        for first, last in self._ends.values():
            samples.extend((first, last))
        return samples
