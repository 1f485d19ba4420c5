"""The run at a glance: stage latencies, per-actor load, outcomes and failures grouped by reason."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .model import Event, RequestIndex
from .stages import OUTCOMES, STAGES, StageSpan, extract_stages, group_requests, request_outcome

END_TO_END = "end_to_end"  # registration staged on D -> KV landed on D


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's
    default), so small samples give the same numbers as the usual tools."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def stage_times(events: Sequence[Event], index: RequestIndex | None = None) -> dict[str, dict[str, StageSpan]]:
    """Per request (keyed by D's id, else P's) -> stage -> span."""
    return {key: extract_stages(evs) for key, evs in group_requests(events, index).items()}


def stage_samples(times: dict[str, dict[str, StageSpan]]) -> dict[str, list[tuple[str, float]]]:
    """(request key, duration in ms) of every complete stage, per stage and end to end."""
    out: dict[str, list[tuple[str, float]]] = {name: [] for name in (*STAGES, END_TO_END)}
    for key, spans in times.items():
        for name in STAGES:
            ms = spans[name].duration_ms
            if ms is not None:
                out[name].append((key, ms))
        first, last = spans[STAGES[0]].start, spans[STAGES[-1]].end
        if first is not None and last is not None:
            out[END_TO_END].append((key, (last - first) * 1e3))
    return out


def stage_dists(samples: dict[str, list[tuple[str, float]]]) -> dict[str, Dist]:
    return {name: Dist.of([ms for _, ms in values]) for name, values in samples.items()}


@dataclass
class Dist:
    """count, p50, p90, p99, max (ms) of one sample."""

    count: int = 0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not values:
            return cls()
        return cls(len(values), percentile(values, 50), percentile(values, 90), percentile(values, 99), max(values))

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "p50": self.p50, "p90": self.p90, "p99": self.p99, "max": self.max}


@dataclass
class ActorStats:
    process: str
    actor: str
    handled: int = 0
    rate: float = 0.0  # messages per second over the run's span
    wait_p50: float | None = None
    wait_p99: float | None = None
    handle_p50: float | None = None
    handle_p99: float | None = None
    busiest: list[tuple[str, int, float]] = field(default_factory=list)  # (message, count, handler ms total)

    def to_json(self) -> dict[str, Any]:
        return {
            "process": self.process,
            "actor": self.actor,
            "handled": self.handled,
            "rate": self.rate,
            "wait_ms": {"p50": self.wait_p50, "p99": self.wait_p99},
            "handle_ms": {"p50": self.handle_p50, "p99": self.handle_p99},
            "busiest": [{"msg": m, "count": n, "handle_ms": round(t, 3)} for m, n, t in self.busiest],
        }


@dataclass
class FailureGroup:
    pattern: str  # the reason with ids and numbers taken out
    example: str
    count: int = 0
    requests: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "example": self.example, "count": self.count, "requests": self.requests}


@dataclass
class Summary:
    events: int = 0
    first_ts: float | None = None
    last_ts: float | None = None
    requests: int = 0
    stages: dict[str, Dist] = field(default_factory=dict)  # STAGES and END_TO_END
    # (request key, ms) behind ``stages``: for plots; left out of to_json()
    samples: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    actors: list[ActorStats] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: list[FailureGroup] = field(default_factory=list)

    @property
    def span_s(self) -> float:
        if self.first_ts is None or self.last_ts is None:
            return 0.0
        return self.last_ts - self.first_ts

    def to_json(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "first_ts": self.first_ts,
            "last_ts": self.last_ts,
            "span_s": self.span_s,
            "requests": self.requests,
            "stages": {name: dist.to_json() for name, dist in self.stages.items()},
            "actors": [a.to_json() for a in self.actors],
            "outcomes": dict(self.outcomes),
            "failures": [f.to_json() for f in self.failures],
        }


# --- failure reasons -------------------------------------------------------------------------------
_NORMALISE = [
    (re.compile(r"(?<!\w)'[^']*'|\"[^\"]*\""), "<s>"),  # quoted names and ids (not "D's ... P's")
    (re.compile(r"\[[^\]]*\]"), "<list>"),
    (re.compile(r"\b[\w.-]*-[0-9a-fA-F]{8}\b"), "<id>"),  # engine request ids ("...-f728b4fa")
    (re.compile(r"\b0x[0-9a-fA-F]+\b|\b[0-9a-fA-F]{8,}\b"), "<hex>"),
    (re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"), "<n>"),
    (re.compile(r"\s+"), " "),
]


def normalise_reason(reason: str) -> str:
    """``reason`` with ids, quoted names and numbers replaced, so similar failures group."""
    out = reason
    for pattern, repl in _NORMALISE:
        out = pattern.sub(repl, out)
    return out.strip()


# --- building ----------------------------------------------------------------------------------
def _actor_stats(events: Iterable[Event], span_s: float) -> list[ActorStats]:
    waits: dict[tuple[str, str], list[float]] = defaultdict(list)
    handles: dict[tuple[str, str], list[float]] = defaultdict(list)
    per_msg: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    msg_time: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in events:
        msg = ev.msg
        if msg is None:
            continue
        key = (ev.process, ev.actor or "?")
        per_msg[key][msg] += 1
        if ev.wait_ms is not None:
            waits[key].append(ev.wait_ms)
        if ev.handle_ms is not None:
            handles[key].append(ev.handle_ms)
            msg_time[key][msg] += ev.handle_ms
    out = []
    for key, counts in per_msg.items():
        handled = sum(counts.values())
        w, h = waits[key], handles[key]
        out.append(
            ActorStats(
                process=key[0],
                actor=key[1],
                handled=handled,
                rate=handled / span_s if span_s > 0 else 0.0,
                wait_p50=percentile(w, 50) if w else None,
                wait_p99=percentile(w, 99) if w else None,
                handle_p50=percentile(h, 50) if h else None,
                handle_p99=percentile(h, 99) if h else None,
                busiest=[(m, n, msg_time[key].get(m, 0.0)) for m, n in counts.most_common(3)],
            )
        )
    out.sort(key=lambda a: (-a.handled, a.process, a.actor))
    return out


def summarize(events: Sequence[Event], index: RequestIndex | None = None) -> Summary:
    """Everything :class:`Summary` holds, over ``events`` (clock-corrected, any order)."""
    summary = Summary(events=len(events))
    if events:
        summary.first_ts = min(ev.ts for ev in events)
        summary.last_ts = max(ev.ts for ev in events)
    requests = group_requests(events, index)
    summary.requests = len(requests)
    times = {key: extract_stages(evs) for key, evs in requests.items()}
    summary.samples = stage_samples(times)
    summary.stages = stage_dists(summary.samples)
    summary.actors = _actor_stats(events, summary.span_s)
    outcomes: Counter[str] = Counter()
    groups: dict[str, FailureGroup] = {}
    for key, evs in requests.items():
        ids = {key} | {rid for ev in evs for rid in (ev.request_id, ev.d_request_id) if rid}
        outcome = request_outcome(evs, ids)
        outcomes[outcome.state] += 1
        if outcome.state == "failed":
            reason = outcome.reason or "unknown"
            pattern = normalise_reason(reason)
            group = groups.setdefault(pattern, FailureGroup(pattern, reason))
            group.count += 1
            group.requests.append(key)
    summary.outcomes = {state: outcomes[state] for state in OUTCOMES if outcomes[state] or state != "unknown"}
    summary.failures = sorted(groups.values(), key=lambda g: (-g.count, g.pattern))
    return summary


# --- rendering ---------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def render_summary(summary: Summary, console: Console) -> None:
    span = summary.span_s
    console.print(
        f"[bold]{summary.events}[/] events over [bold]{span:.3f}[/] s, [bold]{summary.requests}[/] requests: "
        + ", ".join(f"{state} [bold]{n}[/]" for state, n in summary.outcomes.items())
    )

    stages = Table(title="stages (ms)", title_justify="left")
    for col in ("stage", "count", "p50", "p90", "p99", "max"):
        stages.add_column(col, justify="left" if col == "stage" else "right")
    for name, dist in summary.stages.items():
        label = "end to end" if name == END_TO_END else name
        stages.add_row(label, str(dist.count), _ms(dist.p50), _ms(dist.p90), _ms(dist.p99), _ms(dist.max))
    console.print(stages)

    actors = Table(title="actors", title_justify="left")
    for col in ("process", "actor", "handled", "msg/s", "wait p50", "wait p99", "handle p50", "handle p99", "busiest"):
        actors.add_column(col, justify="left" if col in ("process", "actor", "busiest") else "right")
    for a in summary.actors:
        busiest = ", ".join(f"{m} ×{n}" for m, n, _ in a.busiest)
        actors.add_row(
            escape(a.process),
            escape(a.actor),
            str(a.handled),
            f"{a.rate:.1f}",
            _ms(a.wait_p50),
            _ms(a.wait_p99),
            _ms(a.handle_p50),
            _ms(a.handle_p99),
            escape(busiest),
        )
    console.print(actors)

    if summary.failures:
        failures = Table(title="failures by reason", title_justify="left")
        for col in ("count", "reason", "example", "requests"):
            failures.add_column(col, justify="right" if col == "count" else "left", overflow="fold")
        for g in summary.failures:
            shown = ", ".join(g.requests[:3]) + (f" (+{len(g.requests) - 3})" if len(g.requests) > 3 else "")
            failures.add_row(str(g.count), f"[red]{escape(g.pattern)}[/]", escape(g.example), escape(shown))
        console.print(failures)
