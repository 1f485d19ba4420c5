"""What ``pushactors top`` shows, computed from a stream of events: one :class:`RankStats` per rank.

Two kinds of numbers, from two kinds of events:

* totals (pushes done, handshakes, failures) are counted from the events themselves, so they are
  exact as soon as the lines are flushed; the ``counters`` of the latest ``rank.stats`` (emitted
  every ``stats_interval``, so up to that old) only raise them, never lower them;
* gauges (mailbox depths, pushes in flight, leases, waiting registrations and receives) exist only
  in ``rank.stats``: the latest one wins, and its age says how current they are;
* rates and handler-time percentiles come from the per-message events (``msg``, ``handle_ms``,
  ``wait_ms``) of the last ``window`` seconds.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .model import Event

WINDOW_S = 5.0
DEFAULT_STATS_INTERVAL_S = 2.0
STALE_FACTOR = 3.0  # stats older than this many of their own intervals are stale
ACTOR_ORDER = ("writer", "matcher", "reaper", "handshake", "stager")
_FAILURE_WORDS = ("failed", "expired", "rejected")
_FAILURE_EVENT_WORDS = (*_FAILURE_WORDS, "refused", "timed_out", "dead", "died", "unhealthy")


@dataclass
class ActorStats:
    actor: str
    mailbox: int | None  # depth in the latest rank.stats (None: not reported)
    answered: bool  # False when the actor did not answer the latest stats request in time
    handled: int  # per-message events seen in total
    per_s: float  # messages handled per second over the window
    handle_p50_ms: float | None
    handle_p99_ms: float | None
    wait_p99_ms: float | None  # time in the mailbox before the handler started


@dataclass
class RankStats:
    pid: int
    rank: str
    stats_age_s: float | None  # since the latest rank.stats (None: none yet)
    stale: bool
    in_flight: int | None  # writer.in_flight: WRITEs posted and not settled
    leases: int | None  # reaper.leases (P: blocks held for a push)
    pending_registrations: int | None  # matcher.pending_registrations (P: waiting for their blocks)
    recvs_waiting: int | None  # reaper.recvs (D: registrations waiting for KV)
    handshakes_started: int
    handshakes_completed: int
    handshakes_failed: int
    landed: int  # D: requests whose KV landed
    pushed: int  # P: pushes finished OK
    failures: int
    last_failure: str
    bytes_received: int
    bytes_sent: int
    per_s: float  # all actors' messages per second
    actors: list[ActorStats] = field(default_factory=list)

    @property
    def pushes_done(self) -> int:
        return self.landed + self.pushed


@dataclass
class Snapshot:
    at: float  # wall clock the window ends at
    window_s: float
    files: int
    events: int
    bad_lines: int
    ranks: list[RankStats]

    @property
    def landed(self) -> int:
        return sum(r.landed for r in self.ranks)

    @property
    def pushed(self) -> int:
        return sum(r.pushed for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        def clean(value: Any) -> Any:
            if isinstance(value, float):
                return round(value, 3)
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, list):
                return [clean(v) for v in value]
            return value

        ranks = []
        for r in self.ranks:
            d = asdict(r)
            d["pushes_done"] = r.pushes_done
            ranks.append(d)
        out: dict[str, Any] = clean(
            {
                "at": self.at,
                "window_s": self.window_s,
                "files": self.files,
                "events": self.events,
                "bad_lines": self.bad_lines,
                "landed": self.landed,
                "pushed": self.pushed,
                "ranks": ranks,
            }
        )
        return out


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def is_failure(ev: Event) -> bool:
    if ev.event == "push.finished":
        return bool(ev.get("outcome", "pushed") != "pushed")
    if ev.event == "handshake.failed" and ev.actor == "writer":
        return False  # the writer's echo of the handshake actor's event
    return ev.level in ("error", "critical") or any(w in ev.event for w in _FAILURE_EVENT_WORDS)


def failure_counters(counters: dict[str, Any]) -> int:
    """Sum of the counters that count failures. A counter with per-kind children
    (``handshake.failed`` beside ``handshake.failed.capacity``) is their total: skipped."""
    names = [k for k, v in counters.items() if isinstance(v, int) and any(w in k for w in _FAILURE_WORDS)]
    return sum(int(counters[k]) for k in names if not any(o.startswith(k + ".") for o in names))


class _Rank:
    """Everything seen of one rank of one process."""

    def __init__(self, pid: int, rank: str) -> None:
        self.pid, self.rank = pid, rank
        self.first_ts = math.inf
        self.stats: dict[str, Any] | None = None
        self.stats_ts = -math.inf
        self.windows: dict[str, deque[tuple[float, float, float | None]]] = {}
        self.handled: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.last_failure_ts = -math.inf
        self.last_failure = ""


class Board:
    """Aggregates events into per-rank numbers; :meth:`snapshot` reads them as of a moment."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._ranks: dict[tuple[int, str], _Rank] = {}
        self.events = 0

    def add_all(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.add(ev)

    def add(self, ev: Event) -> None:
        self.events += 1
        if not ev.rank:  # side channel, router, scheduler: not one rank's numbers
            return
        r = self._ranks.get((ev.pid, ev.rank))
        if r is None:
            r = self._ranks[(ev.pid, ev.rank)] = _Rank(ev.pid, ev.rank)
        ts = ev.raw_ts  # top compares against this host's clock, not a merged time line
        r.first_ts = min(r.first_ts, ts)
        name = ev.event
        if name == "rank.stats":
            if ts >= r.stats_ts:
                r.stats, r.stats_ts = ev.record, ts
            return
        handle = ev.handle_ms
        if ev.msg is not None and handle is not None and ev.actor:
            window = r.windows.get(ev.actor)
            if window is None:
                window = r.windows[ev.actor] = deque()
            window.append((ts, handle, ev.wait_ms))
            while window and window[0][0] < ts - self.window_s:
                window.popleft()
            r.handled[ev.actor] += 1
        if name in ("recv.finished", "stage.scattered"):  # the stager reports staged receives
            r.counts["landed"] += 1
        elif name == "push.finished" and ev.get("outcome") == "pushed":
            r.counts["pushed"] += 1
        elif name in ("handshake.started", "handshake.completed") or (
            name == "handshake.failed" and ev.actor != "writer"
        ):
            r.counts[name] += 1
        if is_failure(ev):
            r.counts["failures"] += 1
            if ts >= r.last_failure_ts:
                reason = ev.get("reason") or ev.get("outcome") or ev.get("cause") or ""
                r.last_failure_ts = ts
                r.last_failure = f"{name}: {reason}" if reason else name

    def snapshot(self, now: float, *, files: int = 0, bad_lines: int = 0) -> Snapshot:
        ranks = [self._rank_stats(r, now) for r in self._ranks.values()]
        ranks.sort(key=lambda r: (r.pid, r.rank))
        return Snapshot(
            at=now, window_s=self.window_s, files=files, events=self.events, bad_lines=bad_lines, ranks=ranks
        )

    def _rank_stats(self, r: _Rank, now: float) -> RankStats:
        stats = r.stats or {}
        counters = _dict(stats.get("counters"))
        tables = _dict(stats.get("tables"))
        mailbox = _dict(stats.get("mailbox"))
        unanswered = _names(stats.get("unanswered"))
        interval = stats.get("interval")
        interval = float(interval) if isinstance(interval, (int, float)) and interval > 0 else DEFAULT_STATS_INTERVAL_S
        if r.stats is None:
            age = None
            stale = now - r.first_ts > STALE_FACTOR * DEFAULT_STATS_INTERVAL_S
        else:
            age = max(0.0, now - r.stats_ts)
            stale = age > STALE_FACTOR * interval
        # Rates over the window, or over what the rank has lived of it (at least a second).
        span = max(1.0, min(self.window_s, now - r.first_ts))
        actors = []
        for actor in _ordered(set(mailbox) | set(r.windows)):
            recent = [e for e in r.windows.get(actor, ()) if now - self.window_s <= e[0] <= now + 1.0]
            handles = sorted(e[1] for e in recent)
            waits = sorted(e[2] for e in recent if e[2] is not None)
            depth = mailbox.get(actor)
            actors.append(
                ActorStats(
                    actor=actor,
                    mailbox=depth if isinstance(depth, int) and depth >= 0 else None,
                    answered=actor not in unanswered,
                    handled=r.handled[actor],
                    per_s=len(recent) / span,
                    handle_p50_ms=percentile(handles, 0.50),
                    handle_p99_ms=percentile(handles, 0.99),
                    wait_p99_ms=percentile(waits, 0.99),
                )
            )

        def table(actor: str, name: str) -> int | None:
            value = _dict(tables.get(actor)).get(name)
            return value if isinstance(value, int) else None

        def count(name: str, counted: int) -> int:
            value = counters.get(name)
            return max(counted, value if isinstance(value, int) else 0)

        failed_handshakes = sum(
            v for k, v in counters.items() if k.startswith("handshake.failed.") and isinstance(v, int)
        )
        return RankStats(
            pid=r.pid,
            rank=r.rank,
            stats_age_s=age,
            stale=stale,
            in_flight=table("writer", "in_flight"),
            leases=table("reaper", "leases"),
            pending_registrations=table("matcher", "pending_registrations"),
            recvs_waiting=table("reaper", "recvs"),
            handshakes_started=count("handshake.started", r.counts["handshake.started"]),
            handshakes_completed=count("handshake.completed", r.counts["handshake.completed"]),
            handshakes_failed=max(failed_handshakes, r.counts["handshake.failed"]),
            landed=count("recv.finished", r.counts["landed"]),
            pushed=count("push.pushed", r.counts["pushed"]),
            failures=max(failure_counters(counters), r.counts["failures"]),
            last_failure=r.last_failure,
            bytes_received=count("bytes.received", 0),
            bytes_sent=count("bytes.pushed", 0),
            per_s=sum(a.per_s for a in actors),
            actors=actors,
        )


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _names(value: Any) -> set[str]:
    """The strings of a list (anything else in a hand-edited or broken log line is ignored)."""
    return {v for v in value if isinstance(v, str)} if isinstance(value, list) else set()


def _ordered(actors: set[str]) -> list[str]:
    known = [a for a in ACTOR_ORDER if a in actors]
    return known + sorted(actors - set(known))
