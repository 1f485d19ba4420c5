"""One request's path through the actors of P and D: hops, stages, outcome, stalls.

``build_trace`` finds every id the request goes by (:meth:`RequestIndex.resolve`), lays its events
out as hops in the order their handlers started (an event is written when its handler ends, and
some are written inside another handler), cuts the time line into the five stages, says how it
ended or what it still waits for, and flags stages far slower than the run's usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .model import Event, RequestIndex
from .stages import STAGES, StageSpan, arrival, extract_stages, request_outcome, start, with_connector_failures
from .summary import Dist, stage_dists, stage_samples, stage_times

# Fields every hop shows in its own columns (or the header shows), left out of ``Hop.fields``.
_SHOWN = frozenset(
    {"event", "level", "ts", "pid", "actor", "rank", "msg", "wait_ms", "handle_ms", "request_id", "d_request_id"}
    | {"p_request_id"}
)

STALL_FACTOR = 3.0  # a stage stalls above max(3 × p50, p90, 1 ms) of the run
STALL_FLOOR_MS = 1.0

LEVEL_STYLE = {"debug": "dim", "info": "", "warning": "yellow", "error": "red", "critical": "bold red"}
OUTCOME_STYLE = {"landed": "bold green", "failed": "bold red", "in flight": "bold yellow", "unknown": "bold"}


@dataclass
class Hop:
    """One event of the request: its message's arrival, handler start and end (epoch seconds)."""

    arrival: float
    start: float
    end: float
    process: str
    actor: str
    event: str
    level: str
    msg: str | None
    wait_ms: float | None
    handle_ms: float | None
    gap_ms: float | None  # from the previous hop's end to this handler's start
    request_id: str | None
    fields: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    line: int = 0

    @classmethod
    def of(cls, ev: Event, gap_ms: float | None) -> Hop:
        return cls(
            arrival=arrival(ev),
            start=start(ev),
            end=ev.ts,
            process=ev.process,
            actor=ev.actor,
            event=ev.event,
            level=ev.level,
            msg=ev.msg,
            wait_ms=ev.wait_ms,
            handle_ms=ev.handle_ms,
            gap_ms=gap_ms,
            request_id=ev.request_id,
            fields={k: v for k, v in ev.record.items() if k not in _SHOWN},
            source=ev.source,
            line=ev.line,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "arrival": self.arrival,
            "start": self.start,
            "end": self.end,
            "process": self.process,
            "actor": self.actor,
            "event": self.event,
            "level": self.level,
            "msg": self.msg,
            "wait_ms": self.wait_ms,
            "handle_ms": self.handle_ms,
            "gap_ms": self.gap_ms,
            "request_id": self.request_id,
            "fields": self.fields,
            "source": self.source,
            "line": self.line,
        }


@dataclass
class Stall:
    """A stage that took far longer than the run's usual for it."""

    stage: str
    duration_ms: float
    p50_ms: float
    p90_ms: float
    threshold_ms: float
    in_progress: bool = False  # still waiting in it: duration so far

    @property
    def factor(self) -> float | None:
        """How many times the run's median it took."""
        return self.duration_ms / self.p50_ms if self.p50_ms > 0 else None

    def describe(self) -> str:
        took = "has waited" if self.in_progress else "took"
        times = f"{self.factor:.1f}× " if self.factor is not None else ""
        return (
            f"{self.stage} {took} {self.duration_ms:.3f} ms, {times}the run's p50 of {self.p50_ms:.3f} ms "
            f"(p90 {self.p90_ms:.3f} ms, threshold {self.threshold_ms:.3f} ms)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "duration_ms": self.duration_ms,
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "threshold_ms": self.threshold_ms,
            "factor": self.factor,
            "in_progress": self.in_progress,
            "text": self.describe(),
        }


@dataclass
class Trace:
    query: str
    ids: list[str] = field(default_factory=list)
    transfer_ids: list[str] = field(default_factory=list)
    found: bool = False
    hops: list[Hop] = field(default_factory=list)
    stages: list[StageSpan] = field(default_factory=list)
    outcome: str = "unknown"  # landed | failed | in flight | unknown
    reason: str | None = None  # why it failed
    failed_at: str | None = None  # "event on process" of the failure
    waiting_on: str | None = None  # in flight: the stage it waits in, and for what
    waiting_since: float | None = None
    waiting_ms: float | None = None  # up to the last event of the whole log set
    stalls: list[Stall] = field(default_factory=list)
    typical: dict[str, Dist] = field(default_factory=dict)  # the run's per-stage distribution
    # A layer-wise push: each layer group's WRITE as P's writer posted it (write.layer_posted).
    layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def first(self) -> float | None:
        return min((h.arrival for h in self.hops), default=None)

    @property
    def last(self) -> float | None:
        return max((h.end for h in self.hops), default=None)

    @property
    def total_ms(self) -> float | None:
        first, last = self.first, self.last
        return None if first is None or last is None else (last - first) * 1e3

    def stage(self, name: str) -> StageSpan:
        for span in self.stages:
            if span.name == name:
                return span
        raise KeyError(name)

    def stall_of(self, name: str) -> Stall | None:
        return next((s for s in self.stalls if s.stage == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "ids": self.ids,
            "transfer_ids": self.transfer_ids,
            "found": self.found,
            "outcome": self.outcome,
            "reason": self.reason,
            "failed_at": self.failed_at,
            "waiting_on": self.waiting_on,
            "waiting_since": self.waiting_since,
            "waiting_ms": self.waiting_ms,
            "first": self.first,
            "last": self.last,
            "total_ms": self.total_ms,
            "hops": [h.to_json() for h in self.hops],
            "stages": [s.to_json() for s in self.stages],
            "stalls": [s.to_json() for s in self.stalls],
            "typical": {name: d.to_json() for name, d in self.typical.items() if name in STAGES},
            "layers": self.layers,
        }


def _hops(events: Sequence[Event]) -> list[Hop]:
    ordered = sorted(events, key=lambda e: (start(e), e.ts, e.source, e.line))
    hops: list[Hop] = []
    for ev in ordered:
        gap = (start(ev) - hops[-1].end) * 1e3 if hops else None
        hops.append(Hop.of(ev, gap))
    return hops


def _layers(hops: Sequence[Hop]) -> list[dict[str, Any]]:
    """The layer groups of a layer-wise push, in the order they were written."""
    out = []
    for h in hops:
        if h.event == "write.layer_posted":
            f = h.fields
            out.append(
                {
                    "layer_group": f.get("layer_group"),
                    "of": f.get("of"),
                    "at": h.end,
                    "bytes": f.get("bytes"),
                    "descs": f.get("descs"),
                    "completion": bool(f.get("notified")),
                    "process": h.process,
                }
            )
    return out


def _has_blocks(events: Sequence[Event]) -> bool:
    return any(
        ev.event in ("lease.armed", "blocks.stored") or (ev.actor == "matcher" and ev.msg == "blocks_finished")
        for ev in events
    )


def _waiting(spans: dict[str, StageSpan], events: Sequence[Event]) -> tuple[str, str, float | None]:
    """(stage, what it waits for, since when) for a request still in flight."""
    names = {ev.event for ev in events}
    reg, match, post, settle, notify = (spans[name] for name in STAGES)
    first = min((ev.ts for ev in events), default=None)
    if reg.end is None:
        if reg.start is not None:
            if "reg.parked" in names and "reg.sent" not in names:
                return "registration", "D parked the registration until its handshake with P completes", reg.start
            return "registration", "waiting for P to receive D's registration", reg.start
        if _has_blocks(events):
            return "registration", "P's blocks are ready, waiting for D's registration", first
        return "registration", "waiting for D to stage the request", first
    if match.end is None:
        if _has_blocks(events):
            return "match", "P has the registration and the blocks, waiting for the matcher", match.start or reg.end
        return "match", "P has the registration, waiting for its prefill to finish", reg.end
    if post.end is None:
        if "write.parked" in names:
            return "post", "matched; the WRITE is parked until P's handshake with D completes", match.end
        return "post", "matched, waiting for P's writer to post the WRITE", match.end
    if settle.end is None:
        return "settle", "WRITE posted, waiting for it to complete", post.end
    if notify.end is None:
        return "notify", "WRITE complete on P, waiting for D to be notified", settle.end
    last = max(events, key=lambda e: e.ts)
    return "notify", "D was notified, waiting for every P rank it expects to answer", last.ts


def _stall(name: str, duration_ms: float, dist: Dist, in_progress: bool = False) -> Stall | None:
    if dist.p50 is None or dist.p90 is None:
        return None
    threshold = max(STALL_FACTOR * dist.p50, dist.p90, STALL_FLOOR_MS)
    if duration_ms <= threshold:
        return None
    return Stall(name, duration_ms, dist.p50, dist.p90, threshold, in_progress)


def build_trace(events: Sequence[Event], index: RequestIndex, query: str) -> Trace:
    """The trace of the request ``query`` names (an id of P or D, a transfer id, a base id or a
    client's X-Request-Id), against the run in ``events`` (clock-corrected)."""
    trace = Trace(query=query)
    ids = index.resolve(query)
    trace.ids = sorted(ids)
    trace.transfer_ids = sorted(index.transfers_of(ids))
    mine = with_connector_failures(events, index.events_of(ids), ids) if ids else []
    trace.found = bool(mine)
    trace.typical = stage_dists(stage_samples(stage_times(events, index)))
    if not mine:
        return trace
    trace.hops = _hops(mine)
    trace.layers = _layers(trace.hops)
    spans = extract_stages(mine)
    trace.stages = [spans[name] for name in STAGES]
    outcome = request_outcome(mine, ids)
    trace.outcome, trace.reason = outcome.state, outcome.reason
    if outcome.state == "failed" and outcome.event is not None:
        trace.failed_at = f"{outcome.event.event} on {outcome.event.process}"
    for span in trace.stages:
        ms = span.duration_ms
        stall = _stall(span.name, ms, trace.typical[span.name]) if ms is not None else None
        if stall is not None:
            trace.stalls.append(stall)
    if outcome.state == "in flight":
        stage, what, since = _waiting(spans, mine)
        trace.waiting_on = f"{stage}: {what}"
        log_end = max(ev.ts for ev in events)
        if since is not None:
            trace.waiting_since = since
            trace.waiting_ms = max(0.0, (log_end - since) * 1e3)
            if trace.stall_of(stage) is None:
                stall = _stall(stage, trace.waiting_ms, trace.typical[stage], in_progress=True)
                if stall is not None:
                    trace.stalls.append(stall)
    return trace


# --- rendering ------------------------------------------------------------------------------------
def _ms(value: float | None, signed: bool = False) -> str:
    if value is None:
        return ""
    text = f"{value:+.3f}" if signed else f"{value:.3f}"
    return text


def _fields(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)


def render_trace(trace: Trace, console: Console) -> None:
    """The trace as a readable timeline: header, hops, stages (with STALL flags), what it waits on."""
    if not trace.found:
        console.print(f"[bold red]no events for request {escape(trace.query)!s}[/]")
        return
    style = OUTCOME_STYLE.get(trace.outcome, "bold")
    total = trace.total_ms
    console.print(f"[bold]trace[/] {escape(trace.query)}")
    console.print(f"  ids        {escape(', '.join(trace.ids))}")
    if trace.transfer_ids:
        console.print(f"  transfer   {escape(', '.join(trace.transfer_ids))}")
    outcome = f"[{style}]{trace.outcome.upper()}[/]"
    if trace.reason:
        outcome += f": {escape(trace.reason)}"
    if trace.failed_at:
        outcome += f" [dim]({escape(trace.failed_at)})[/]"
    console.print(f"  outcome    {outcome}")
    if total is not None:
        console.print(f"  total      {total:.3f} ms over {len(trace.hops)} events")
    if trace.layers:
        t_first = trace.first or 0.0
        first, last = trace.layers[0], trace.layers[-1]
        console.print(
            f"  layers     {len(trace.layers)} layer-wise WRITEs (of {last['of']} groups): group "
            f"{first['layer_group']} at +{(first['at'] - t_first) * 1e3:.3f} ms … group {last['layer_group']} at "
            f"+{(last['at'] - t_first) * 1e3:.3f} ms"
        )

    t0 = trace.first or 0.0
    hops = Table(title="hops", title_justify="left", expand=False)
    for col, justify in (
        ("t ms", "right"),
        ("+gap", "right"),
        ("process", "left"),
        ("actor", "left"),
        ("event", "left"),
        ("wait ms", "right"),
        ("handler ms", "right"),
        ("fields", "left"),
    ):
        hops.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for h in trace.hops:
        lvl = LEVEL_STYLE.get(h.level, "")
        event = f"[{lvl}]{escape(h.event)}[/]" if lvl else escape(h.event)
        hops.add_row(
            f"{(h.start - t0) * 1e3:.3f}",
            _ms(h.gap_ms, signed=True),
            escape(h.process),
            escape(h.actor),
            event,
            _ms(h.wait_ms),
            _ms(h.handle_ms),
            escape(_fields(h.fields)),
        )
    console.print(hops)

    stages = Table(title="stages", title_justify="left")
    for col in ("stage", "where", "start ms", "duration ms", "run p50 ms", "flag"):
        stages.add_column(col, justify="right" if "ms" in col else "left", overflow="fold")
    waiting_stage = trace.waiting_on.split(":", 1)[0] if trace.waiting_on else None
    for span in trace.stages:
        dist = trace.typical.get(span.name, Dist())
        stall = trace.stall_of(span.name)
        flag = ""
        if stall is not None:
            factor = f" {stall.factor:.1f}× p50" if stall.factor is not None else ""
            flag = f"[bold red]STALL{factor}[/]"
        if span.name == waiting_stage:
            flag = (flag + " " if flag else "") + "[yellow]waiting[/]"
        stages.add_row(
            span.name,
            escape(span.where),
            f"{(span.start - t0) * 1e3:.3f}" if span.start is not None else "",
            _ms(span.duration_ms),
            _ms(dist.p50),
            flag,
        )
    console.print(stages)
    for stall in trace.stalls:
        console.print(f"  [bold red]STALL[/] {escape(stall.describe())}")
    if trace.waiting_on:
        since = f" for {trace.waiting_ms:.3f} ms (to the last event logged)" if trace.waiting_ms is not None else ""
        console.print(f"  [yellow]waiting on[/] {escape(trace.waiting_on)}{since}")
