"""Choosing events: by request, actor, event name, level, rank and time window.

Criteria of one kind are alternatives (``--actor writer --actor reaper``: either); criteria of
different kinds must all hold.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, time
from fnmatch import fnmatchcase

from .model import Event, RequestIndex

LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "exception": 40, "critical": 50}

_GLOB_CHARS = frozenset("*?[")
_RELATIVE = re.compile(r"\+?(?P<n>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>us|ms|s|m|min|h)?")
_FRACTION = re.compile(r"(\d\d:\d\d:\d\d)\.(\d+)")
_UNIT_SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, None: 1.0}


def level_number(level: str) -> int:
    """The level's rank in the stdlib's order; an unknown level counts as info."""
    return LEVELS.get(level.lower(), 20)


@dataclass(frozen=True)
class TimeBound:
    """One end of a time window, as the user wrote it; :meth:`at` places it on the time line.
    Exactly one of ``epoch``, ``offset`` (seconds after the first event) and ``clock`` (a time
    of day on the first event's date) is set."""

    text: str
    epoch: float | None = None
    offset: float | None = None
    clock: time | None = None

    def at(self, origin: float | None) -> float | None:
        """Epoch seconds, or None while a relative bound has no first event to count from."""
        if self.epoch is not None:
            return self.epoch
        if origin is None:
            return None
        if self.offset is not None:
            return origin + self.offset
        assert self.clock is not None
        day = datetime.fromtimestamp(origin, self.clock.tzinfo).date()
        return datetime.combine(day, self.clock).timestamp()


def parse_time(text: str) -> TimeBound:
    """``1796103036.75`` (epoch seconds), ``+2.5s`` / ``+150ms`` / ``2.5s`` (after the first
    event), ``12:34:56.789`` (time of day, on the first event's date) or an ISO 8601 date and
    time (``2026-12-01T12:34:56``, local time unless it names a zone)."""
    value = text.strip()
    relative = _RELATIVE.fullmatch(value)
    if relative is not None and (value.startswith("+") or relative["unit"]):
        return TimeBound(text, offset=float(relative["n"]) * _UNIT_SECONDS[relative["unit"]])
    if value.startswith("+"):
        raise ValueError(f"bad relative time {text!r}: use e.g. +2.5s or +150ms")
    try:
        return TimeBound(text, epoch=float(value))
    except ValueError:
        pass
    iso = _iso_for_python310(value)
    try:
        return TimeBound(text, clock=time.fromisoformat(iso))
    except ValueError:
        pass
    try:
        return TimeBound(text, epoch=datetime.fromisoformat(iso).timestamp())
    except ValueError:
        raise ValueError(
            f"bad time {text!r}: use epoch seconds, +2.5s / +150ms after the first event, "
            "12:34:56.789, or an ISO 8601 date and time"
        ) from None


def _iso_for_python310(value: str) -> str:
    """What Python 3.10's ``fromisoformat`` accepts: "Z" spelled +00:00, and 6 fraction digits."""
    if value.endswith(("Z", "z")):
        value = value[:-1] + "+00:00"
    return _FRACTION.sub(lambda m: m[1] + "." + m[2][:6].ljust(6, "0"), value)


def _glob_or_exact(pattern: str, value: str) -> bool:
    return fnmatchcase(value, pattern) if _GLOB_CHARS & set(pattern) else value == pattern


@dataclass
class EventFilter:
    """Which events to show. Call :meth:`bind` before :meth:`matches` (and again when the
    index grows, when following) so a request query and relative times resolve."""

    request: str | None = None
    actors: Sequence[str] = ()  # exact names or globs
    events: Sequence[str] = ()  # exact names or globs like "write.*"
    level: str | None = None  # the lowest level shown
    ranks: Sequence[str] = ()  # substrings or globs of the rank label, or a pid
    since: TimeBound | None = None
    until: TimeBound | None = None
    # What bind() resolved: the request's ids and transfer ids, the window in epoch seconds.
    request_ids: set[str] = field(default_factory=set, init=False)
    transfer_ids: set[str] = field(default_factory=set, init=False)
    since_ts: float | None = field(default=None, init=False)
    until_ts: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.level is not None and self.level.lower() not in LEVELS:
            raise ValueError(f"unknown level {self.level!r}: one of {', '.join(LEVELS)}")

    def bind(self, index: RequestIndex | None = None, origin: float | None = None) -> None:
        """Resolve the request query through ``index`` and relative times from ``origin``
        (the first event's time)."""
        if self.request is not None and index is not None:
            self.request_ids = index.resolve(self.request)
            self.transfer_ids = index.transfers_of(self.request_ids)
        self.since_ts = self.since.at(origin) if self.since else None
        self.until_ts = self.until.at(origin) if self.until else None

    def matches(self, ev: Event) -> bool:
        if self.request is not None and not self._of_request(ev):
            return False
        if self.actors and not any(_glob_or_exact(a, ev.actor) for a in self.actors):
            return False
        if self.events and not any(_glob_or_exact(e, ev.event) for e in self.events):
            return False
        if self.level is not None and level_number(ev.level) < level_number(self.level):
            return False
        if self.ranks and not any(self._of_rank(r, ev) for r in self.ranks):
            return False
        if self.since_ts is not None and ev.ts < self.since_ts:
            return False
        return not (self.until_ts is not None and ev.ts > self.until_ts)

    def _of_request(self, ev: Event) -> bool:
        ids = self.request_ids
        return (
            (ev.request_id is not None and ev.request_id in ids)
            or (ev.d_request_id is not None and ev.d_request_id in ids)
            or (ev.transfer_id is not None and ev.transfer_id in self.transfer_ids)
        )

    @staticmethod
    def _of_rank(pattern: str, ev: Event) -> bool:
        if pattern == str(ev.pid):
            return True
        if _GLOB_CHARS & set(pattern):
            return fnmatchcase(ev.rank, pattern)
        return pattern in ev.rank
