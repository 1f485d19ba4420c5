"""Following a running engine's JSON logs: new lines of known files, and files that appear later.

Small and self-contained on purpose (``pushactors top`` needs nothing else): each :meth:`Follower.poll`
re-expands the paths (globs, directories of ``*.jsonl``), reads what each file gained since the last
poll, and keeps a torn last line until its newline arrives.
"""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .model import Event, parse_line

_GLOB_CHARS = frozenset("*?[")
# Read at most this much of one file per poll, so a large backlog cannot stall a refresh.
_MAX_READ = 16 << 20


def expand(paths: Sequence[str]) -> list[Path]:
    """The files the paths name now: a file as given (even if it does not exist yet), a glob's
    matches, every ``*.jsonl`` below a directory."""
    found: dict[Path, None] = {}
    for spec in paths:
        if any(c in spec for c in _GLOB_CHARS):
            for name in sorted(glob.glob(spec, recursive=True)):
                p = Path(name)
                if p.is_dir():
                    found.update(dict.fromkeys(sorted(p.rglob("*.jsonl"))))
                elif p.is_file():
                    found[p] = None
        elif Path(spec).is_dir():
            found.update(dict.fromkeys(sorted(Path(spec).rglob("*.jsonl"))))
        else:
            found[Path(spec)] = None
    return list(found)


@dataclass
class _Tail:
    """Where reading one file stopped."""

    path: Path
    offset: int = 0
    inode: int = -1
    partial: bytes = b""
    lines: int = 0


class Follower:
    """Incremental reader of the files some paths name, kept current as files appear."""

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        self._tails: dict[Path, _Tail] = {}
        self._named: list[Path] = []  # what the paths named at the last poll
        self.bad_lines = 0
        self.events = 0

    @property
    def files(self) -> list[Path]:
        """The files named at the last poll that have been read (existed then)."""
        return [p for p in self._named if self._tails[p].inode != -1]

    def poll(self) -> list[Event]:
        """Events of the complete lines written since the last poll, file by file."""
        self._named = expand(self.paths)
        for path in self._named:
            self._tails.setdefault(path, _Tail(path))
        out: list[Event] = []
        for path in self._named:
            out.extend(self._read(self._tails[path]))
        self.events += len(out)
        return out

    def _read(self, tail: _Tail) -> list[Event]:
        try:
            st = os.stat(tail.path)
        except OSError:  # not there (yet), or gone
            tail.inode = -1
            return []
        if not stat.S_ISREG(st.st_mode):  # a directory named before it existed, a fifo...
            tail.inode = -1
            return []
        if st.st_ino != tail.inode or st.st_size < tail.offset:
            # A new file under that name, or truncated: start over from its beginning.
            tail.inode, tail.offset, tail.partial, tail.lines = st.st_ino, 0, b"", 0
        if st.st_size == tail.offset:
            return []
        try:
            with open(tail.path, "rb") as fh:
                fh.seek(tail.offset)
                chunk = fh.read(min(st.st_size - tail.offset, _MAX_READ))
        except OSError:
            return []
        tail.offset += len(chunk)
        data = tail.partial + chunk
        cut = data.rfind(b"\n") + 1
        tail.partial = data[cut:]
        events: list[Event] = []
        source = str(tail.path)
        for raw in data[:cut].split(b"\n")[:-1]:
            tail.lines += 1
            ev = parse_line(raw, source, tail.lines)
            if ev is not None:
                events.append(ev)
            elif raw.strip():
                self.bad_lines += 1
        return events
