"""Putting several processes' events on one time line.

Each process stamps events with its own wall clock. Every handshake samples the peer's clock
(the side channel serves a fresh sample) and logs the peer's wall clock minus its own at the
exchange's midpoint as ``wall_offset_ms`` on ``handshake.completed`` (error at most half the
round trip, also logged as ``rtt_ms``). Those samples are edges between processes; from the
reference process (the one with the most events) every process reachable through them gets a
correction, the sample with the smallest round trip winning on each edge. Processes that no
handshake reaches (a router, an engine's scheduler process) keep their own clock: on one host
that is the same clock.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .model import Event


@dataclass
class ClockModel:
    """Seconds to subtract from each pid's timestamps to put them on the reference clock."""

    reference: int | None = None
    offsets: dict[int, float] = field(default_factory=dict)
    # pid -> (error bound in seconds: half the round trip of the samples on its path)
    error: dict[int, float] = field(default_factory=dict)
    uncorrected: set[int] = field(default_factory=set)

    def correct(self, ev: Event) -> Event:
        ev.ts = ev.raw_ts - self.offsets.get(ev.pid, 0.0)
        return ev

    def apply(self, events: Iterable[Event]) -> None:
        for ev in events:
            self.correct(ev)


def _pids_by_rank(events: Sequence[Event]) -> dict[str, list[tuple[float, float, int]]]:
    spans: dict[tuple[str, int], list[float]] = {}
    for ev in events:
        if not ev.rank or not ev.pid:
            continue
        span = spans.setdefault((ev.rank, ev.pid), [ev.raw_ts, ev.raw_ts])
        span[0] = min(span[0], ev.raw_ts)
        span[1] = max(span[1], ev.raw_ts)
    out: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for (rank, pid), (lo, hi) in spans.items():
        out[rank].append((lo, hi, pid))
    return out


def _pid_of(candidates: list[tuple[float, float, int]], at: float, skew: float) -> int | None:
    """The process serving that rank label around ``at`` (a restarted rank has several)."""
    if not candidates:
        return None
    guess = at + skew
    best = min(candidates, key=lambda c: 0.0 if c[0] <= guess <= c[1] else min(abs(c[0] - guess), abs(c[1] - guess)))
    return best[2]


def estimate(events: Sequence[Event], reference: int | None = None) -> ClockModel:
    """A :class:`ClockModel` from the ``handshake.completed`` samples among ``events``."""
    pids = Counter(ev.pid for ev in events if ev.pid)
    model = ClockModel()
    if not pids:
        return model
    ref: int = reference if reference is not None and reference in pids else pids.most_common(1)[0][0]
    model.reference = ref
    ranks = _pids_by_rank(events)
    # Best sample per directed edge: (rtt, offset) with offset = clock(peer) - clock(observer).
    edges: dict[tuple[int, int], tuple[float, float]] = {}
    for ev in events:
        if ev.event != "handshake.completed" or not ev.pid:
            continue
        off = ev.get("wall_offset_ms")
        peer = ev.get("peer")
        if not isinstance(off, (int, float)) or not isinstance(peer, str):
            continue
        rtt = ev.get("rtt_ms")
        rtt_s = float(rtt) / 1e3 if isinstance(rtt, (int, float)) else 1.0
        other = _pid_of(ranks.get(peer, []), ev.raw_ts, float(off) / 1e3)
        if other is None or other == ev.pid:
            continue
        for a, b, o in ((ev.pid, other, float(off) / 1e3), (other, ev.pid, -float(off) / 1e3)):
            old = edges.get((a, b))
            if old is None or rtt_s < old[0]:
                edges[(a, b)] = (rtt_s, o)
    graph: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    for (a, b), (rtt_s, o) in edges.items():
        graph[a].append((b, o, rtt_s / 2))
    model.offsets[ref] = 0.0
    model.error[ref] = 0.0
    todo = deque([ref])
    while todo:
        a = todo.popleft()
        for b, o, err in graph.get(a, ()):
            if b in model.offsets:
                continue
            # clock(b) - clock(ref) = (clock(a) - clock(ref)) + (clock(b) - clock(a))
            model.offsets[b] = model.offsets[a] + o
            model.error[b] = model.error[a] + err
            todo.append(b)
    model.uncorrected = {pid for pid in pids if pid not in model.offsets}
    return model
