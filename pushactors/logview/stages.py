"""One request's five push stages and its outcome, read from its events.

Stages (the protocol's names, docs/protocol.md): ``registration`` (D staged it -> P received it), ``match`` (P has both
the registration and its finished blocks -> matched), ``post`` (matched -> WRITE handed to
NIXL), ``settle`` (posted -> WRITE complete), ``notify`` (complete -> D knows the KV landed).

Every event is written when its handler ENDS, and a handler that hands work to another actor
does so before it ends, so the next actor may finish first. A boundary between a cause and its
effect is therefore the earlier of "the cause's handler ended" and "the effect's message
arrived": that is when the work crossed over, and it keeps durations from going negative.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .model import Event, RequestIndex

STAGES: tuple[str, ...] = ("registration", "match", "post", "settle", "notify")

OUTCOMES: tuple[str, ...] = ("landed", "failed", "in flight", "unknown")

# Events that end a request badly (more are recognised by their fields in is_failure).
FAILURE_EVENTS = frozenset(
    {
        "recv.failed",
        "recv.failed_by_error",
        "recv.timed_out",
        "recv.aborted",
        "recv.ambiguous",
        "connector.recv_failed",
        "push.rejected",
        "push.expired",
        "write.refused",
        "write.failed",
        "lease.expired",
        "reg.refused",
        "reg.ambiguous",
        "reg.unsendable",
        "reg.dropped",
        "blocks.ambiguous",
        "stage.scatter_failed",
    }
)
LANDED_EVENTS = frozenset({"recv.finished", "stage.scattered"})

# Which engine's id an event's request_id is (reg.matched can be either: see its ``order``).
_D_ID_PREFIXES = ("recv.", "reg.", "notif.", "stage.", "connector.")
_P_ID_PREFIXES = ("lease.", "blocks.", "write.", "push.", "request.")


def arrival(ev: Event) -> float:
    """When the message this event answers entered the mailbox (its ts when not a message)."""
    return ev.ts - ((ev.wait_ms or 0.0) + (ev.handle_ms or 0.0)) / 1e3


def start(ev: Event) -> float:
    """When its handler started (its ts when not a message)."""
    return ev.ts - (ev.handle_ms or 0.0) / 1e3


@dataclass
class StageSpan:
    """One stage of one request; ``start``/``end`` are None where the logs do not say."""

    name: str
    start: float | None = None
    end: float | None = None
    start_process: str | None = None
    end_process: str | None = None

    @property
    def complete(self) -> bool:
        return self.start is not None and self.end is not None

    @property
    def duration_ms(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return (self.end - self.start) * 1e3

    @property
    def where(self) -> str:
        """The process it ran on, or ``A -> B`` when it crossed from one to another."""
        a, b = self.start_process, self.end_process
        if a and b and a != b:
            return f"{a} -> {b}"
        return a or b or ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "start": self.start,
            "end": self.end,
            "duration_ms": self.duration_ms,
            "start_process": self.start_process,
            "end_process": self.end_process,
        }


Mark = tuple[float, str]  # (time, process)


def _earliest(marks: Iterable[Mark]) -> Mark | None:
    return min(marks, default=None)


def _latest(marks: Iterable[Mark]) -> Mark | None:
    return max(marks, default=None)


def _all_ranks(marks: Iterable[Mark]) -> Mark | None:
    """The first mark of each process, then the last of those: a stage is over for the request
    once every rank that takes part (TP > 1) is past it."""
    first: dict[str, float] = {}
    for t, proc in marks:
        first[proc] = min(t, first.get(proc, t))
    return _latest((t, proc) for proc, t in first.items())


def _post_point(ev: Event) -> float:
    """When the WRITE went to NIXL: the handler may go on to settle it before the event is
    written, so use its own ``post_ms`` from the handler's start where it has one."""
    post_ms = ev.get("post_ms")
    if ev.handle_ms is None or not isinstance(post_ms, (int, float)):
        return ev.ts
    return min(ev.ts, start(ev) + float(post_ms) / 1e3)


def extract_stages(events: Iterable[Event]) -> dict[str, StageSpan]:
    """The five stages of one request, from its events (P's and D's, any order)."""
    named: dict[str, list[Event]] = defaultdict(list)
    reg_arrivals: list[Mark] = []  # the registration reaches P (router, or the matcher's mailbox)
    blocks_arrivals: list[Mark] = []  # P's finished blocks reach the matcher
    for ev in events:
        named[ev.event].append(ev)
        if ev.actor == "matcher" and ev.msg == "registration_arrived":
            reg_arrivals.append((arrival(ev), ev.process))
        elif ev.actor == "matcher" and ev.msg == "blocks_finished":
            blocks_arrivals.append((arrival(ev), ev.process))
        elif ev.event == "notif.routed" and ev.get("kind") == "Registration":
            reg_arrivals.append((ev.ts, ev.process))
    # Processes whose matcher never logged the blocks: the lease is armed as they are handed over.
    have_blocks = {proc for _, proc in blocks_arrivals}
    blocks_arrivals += [(start(ev), ev.process) for ev in named["lease.armed"] if ev.process not in have_blocks]

    staged = _earliest(
        [(ev.ts, ev.process) for ev in named["recv.watching"]]
        + [(arrival(ev), ev.process) for name in ("reg.sent", "reg.parked") for ev in named[name] if ev.msg]
    )
    received = _all_ranks(reg_arrivals)
    blocks = _all_ranks(blocks_arrivals)

    posted_in: dict[str, list[Event]] = defaultdict(list)
    for ev in named["write.posted"]:
        posted_in[ev.process].append(ev)
    matched_marks: list[Mark] = []
    for ev in named["reg.matched"]:
        # The writer got the PostPush before the matcher's event was written, maybe.
        handed = [arrival(p) for p in posted_in.get(ev.process, []) if p.msg]
        matched_marks.append((min([ev.ts, *handed]), ev.process))
    matched = _all_ranks(matched_marks)
    posted = _latest((_post_point(ev), ev.process) for ev in named["write.posted"])

    settled_p = _latest((ev.ts, ev.process) for ev in named["write.settled"]) or _latest(
        (ev.ts, ev.process) for ev in named["push.finished"] if ev.get("outcome") == "pushed"
    )
    # D may hear of the completion before P's poll sees it: the WRITE was complete by then.
    settled_d = _earliest(
        [(ev.ts, ev.process) for ev in named["notif.routed"] if ev.get("kind") == "Completion"]
        + [(arrival(ev), ev.process) for ev in named["recv.notified"] if ev.get("ok") is not False]
    )
    settled = settled_p
    if settled_d is not None and (settled is None or settled_d[0] < settled[0]):
        settled = settled_d
    if posted is not None and settled is not None and settled[0] < posted[0]:
        # The WRITE completed inside the call that posted it (DRAM, small transfers): the post
        # ends where completion was seen and settling took no time of its own.
        posted = (settled[0], posted[1])
    # A completion the writer took was reported when it was routed (core/claims.py); the
    # reaper's recv.finished for it (by=writer) only comes after, off the request's path.
    landed = (
        _latest(
            [(ev.ts, ev.process) for ev in named["notif.routed"] if ev.get("taken")]
            + [(ev.ts, ev.process) for ev in named["recv.finished"] if ev.get("by") != "writer"]
        )
        or _latest((ev.ts, ev.process) for ev in named["stage.scattered"])
        or _latest((ev.ts, ev.process) for ev in named["recv.notified"] if ev.get("ok") is not False)
    )

    match_start = _latest(m for m in (received, blocks) if m is not None)
    if match_start is not None and matched is not None and match_start[0] > matched[0]:
        match_start = (matched[0], match_start[1])
    spans = {
        "registration": _span("registration", staged, received),
        "match": _span("match", match_start, matched),
        "post": _span("post", matched, posted),
        "settle": _span("settle", posted, settled),
        "notify": _span("notify", settled, landed),
    }
    return spans


def _span(name: str, begin: Mark | None, end: Mark | None) -> StageSpan:
    span = StageSpan(name)
    if begin is not None:
        span.start, span.start_process = begin
    if end is not None:
        span.end, span.end_process = end
    return span


# --- outcome ---------------------------------------------------------------------------------------
def is_failure(ev: Event) -> bool:
    if ev.event in FAILURE_EVENTS:
        return True
    if ev.event == "push.finished":
        return ev.get("outcome") not in (None, "pushed")
    if ev.event == "recv.notified":
        return ev.get("ok") is False
    if ev.event == "write.chunk_posted":
        return bool(ev.get("failed"))
    return False


def failure_reason(ev: Event, ids: Iterable[str] = ()) -> str:
    """What the failure event says went wrong (its event name when it does not say)."""
    reason = ev.get("reason")
    if ev.event == "connector.recv_failed":
        reasons = ev.get("reasons")
        if isinstance(reasons, dict):
            for rid in ids:
                if rid in reasons:
                    reason = reasons[rid]
                    break
    if ev.event == "push.finished" and not reason:
        reason = f"push {ev.get('outcome')}"
    if not reason and ev.get("failed"):
        reason = ev.get("failed")
    return str(reason) if reason else ev.event


@dataclass
class Outcome:
    state: str  # one of OUTCOMES
    reason: str | None = None
    event: Event | None = None  # the event that decided it


def request_outcome(events: Sequence[Event], ids: Iterable[str] = ()) -> Outcome:
    """Landed (D has the KV), failed (the first failure that says why), in flight, or unknown."""
    if not events:
        return Outcome("unknown")
    for ev in events:
        if ev.event in LANDED_EVENTS:
            return Outcome("landed", event=ev)
    failures = [ev for ev in events if is_failure(ev)]
    if failures:
        wanted = list(ids)
        # The first failure that gives a reason is the cause; later ones usually relay it.
        explained = [ev for ev in failures if failure_reason(ev, wanted) != ev.event]
        first = min(explained or failures, key=lambda e: (e.ts, e.source, e.line))
        return Outcome("failed", failure_reason(first, wanted), first)
    # Only P's side logged: a pushed WRITE is as landed as these logs can tell.
    if not any(_is_d_event(ev) for ev in events) and any(
        ev.event == "push.finished" and ev.get("outcome") == "pushed" for ev in events
    ):
        last = max(events, key=lambda e: e.ts)
        return Outcome("landed", event=last)
    if any(_is_push_event(ev) for ev in events):
        return Outcome("in flight")
    return Outcome("unknown")


def _is_d_event(ev: Event) -> bool:
    return ev.event in ("recv.watching", "recv.notified", "recv.finished", "reg.sent", "reg.parked") or (
        ev.event == "notif.routed" and ev.get("kind") == "Completion"
    )


def _is_push_event(ev: Event) -> bool:
    return ev.event.startswith(_D_ID_PREFIXES + _P_ID_PREFIXES) or ev.event == "reg.matched"


# --- requests -------------------------------------------------------------------------------------
def id_sides(index: RequestIndex) -> tuple[set[str], set[str]]:
    """(D's ids, P's ids) among the indexed ids, by what their events are."""
    d_ids: set[str] = set(index.p_of_d)
    p_ids: set[str] = set(index.d_of_p)
    for rid, evs in index.by_id.items():
        for ev in evs:
            if ev.event == "reg.matched":
                (p_ids if ev.get("order") == "blocks_last" else d_ids).add(rid)
            elif ev.event.startswith(_D_ID_PREFIXES):
                d_ids.add(rid)
            elif ev.event.startswith(_P_ID_PREFIXES):
                p_ids.add(rid)
    return d_ids, p_ids - d_ids


def group_requests(events: Sequence[Event], index: RequestIndex | None = None) -> dict[str, list[Event]]:
    """Every push request in ``events``: key (D's id, else P's) -> its events in time order.

    P's and D's ids are joined by the links the index knows (``d_request_id``, ``p_request_id``,
    transfer ids) and, where a base id names exactly one D id and at most one P id, by that."""
    if index is None:
        index = RequestIndex.build(events)
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for rid in index.by_id:
        find(rid)
    for p_id, d_ids in index.d_of_p.items():
        for d_id in d_ids:
            union(p_id, d_id)
    for tids in index.by_transfer.values():
        first, *rest = sorted(tids)
        for other in rest:
            union(first, other)
    d_side, p_side = id_sides(index)
    for ids in index.by_base.values():
        ds, ps = ids & d_side, ids & p_side
        if len(ds) == 1 and len(ps) <= 1 and len(ids) > 1 and ids <= d_side | p_side:
            first, *rest = sorted(ids)
            for other in rest:
                union(first, other)

    members: dict[str, set[str]] = defaultdict(set)
    for rid in parent:
        members[find(rid)].add(rid)
    by_failed_id = _connector_failures(events)
    out: dict[str, list[Event]] = {}
    for ids in members.values():
        evs = index.events_of(ids)
        extra = {id(e): e for rid in ids for e in by_failed_id.get(rid, ())}
        if extra:
            merged = {id(e): e for e in evs} | extra
            evs = sorted(merged.values(), key=lambda e: (e.ts, e.source, e.line))
        if not any(_is_push_event(ev) for ev in evs):
            continue
        d_keys = sorted(ids & d_side)
        key = d_keys[0] if d_keys else sorted(ids & p_side or ids)[0]
        out[key] = evs
    return out


def _connector_failures(events: Iterable[Event]) -> dict[str, list[Event]]:
    """``connector.recv_failed`` names its requests in a list, not as ``request_id``."""
    out: dict[str, list[Event]] = defaultdict(list)
    for ev in events:
        if ev.event == "connector.recv_failed":
            requests = ev.get("requests")
            if isinstance(requests, list):
                for rid in requests:
                    if isinstance(rid, str):
                        out[rid].append(ev)
    return out


def with_connector_failures(events: Sequence[Event], request_events: list[Event], ids: Iterable[str]) -> list[Event]:
    """``request_events`` plus the connector failures among ``events`` that name one of ``ids``."""
    wanted = set(ids)
    seen = {id(e) for e in request_events}
    extra = [
        ev
        for ev in events
        if ev.event == "connector.recv_failed"
        and id(ev) not in seen
        and isinstance(ev.get("requests"), list)
        and wanted.intersection(r for r in ev.get("requests") if isinstance(r, str))
    ]
    if not extra:
        return request_events
    return sorted([*request_events, *extra], key=lambda e: (e.ts, e.source, e.line))


__all__ = [
    "FAILURE_EVENTS",
    "LANDED_EVENTS",
    "OUTCOMES",
    "STAGES",
    "Outcome",
    "StageSpan",
    "arrival",
    "extract_stages",
    "failure_reason",
    "group_requests",
    "id_sides",
    "is_failure",
    "request_outcome",
    "start",
]
