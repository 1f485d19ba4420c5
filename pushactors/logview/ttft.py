"""A disaggregated request's time to first token, split by stage, from the client's own times
and the event logs of the router and of P's and D's connectors (``log_json``; debug events).

Each request is found by its client id (``X-Request-Id``): the router logs it as is, and vLLM
builds its engine ids from it. Marks, all epoch seconds on one host:

- ``sent``: the client sent the request; ``first_token``: its first streamed token came.
- ``router_in``: the router took it (its ``router.request`` event less its ``ms``).
- ``announced``: P's KV for it was announced to P's matcher (``blocks.stored``'s message arrived):
  whole pushes once P's scheduler saw the prefill finish, layer-wise ones at the start of the
  step that computes the prompt's last tokens (the push then runs beside that forward).
- ``landed``: D's rank knew the KV was in (``connector.recv_reported`` less ``waited_ms``).
- ``reported``: D's engine asked its worker what finished and was told (``connector.recv_reported``).
- ``scheduled``: D's scheduler put it into a step (``connector.recv_scheduled``).
- ``first_event``: the router relayed D's first event (``router.request``'s ``first_event_ms``).
- ``first_chunk``: the client got its first event (the first token's text may come later: a
  detokenizer holds back an incomplete UTF-8 sequence).

The stages between consecutive marks add up to the client's TTFT; a request missing a mark
gets no sample for the two stages around it (and is counted in ``incomplete``). Spans beside
them (``SIDE_SPANS``, not in the sum) use three more marks: ``p_answered`` (P's leg answered the
router), ``prefilled`` (P's scheduler saw the prefill finish, ``request.prefilled``) and
``last_post`` (P's last WRITE for it went to NIXL).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model import Event
from .source import load
from .stages import arrival

MARKS: tuple[str, ...] = (
    "sent",
    "router_in",
    "announced",
    "landed",
    "reported",
    "scheduled",
    "first_event",
    "first_chunk",
    "first_token",
)
# Stage name -> (from mark, to mark, who it belongs to).
STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("client -> router", "sent", "router_in", "router (ours)"),
    ("P until its last step (router -> KV announced)", "router_in", "announced", "P's vLLM + router's P leg"),
    ("P's last step + push (announced -> landed on D)", "announced", "landed", "P's vLLM forward + pushactors"),
    ("D learns it landed (landed -> engine told)", "landed", "reported", "D's engine step (vLLM) / connector"),
    ("D schedules it (told -> in a step)", "reported", "scheduled", "D's vLLM scheduler"),
    ("D's first step + stream out (-> router)", "scheduled", "first_event", "D's vLLM + router's D leg"),
    ("way back (router -> client's first event)", "first_event", "first_chunk", "router (ours)"),
    ("first event -> first text (held-back bytes)", "first_chunk", "first_token", "D's detokenizer"),
)
SIDE_SPANS: tuple[tuple[str, str, str, str], ...] = (
    ("P's leg answered (router -> P's response)", "router_in", "p_answered", "P's vLLM + router's P leg"),
    ("P's scheduler saw it finish (router -> prefilled)", "router_in", "prefilled", "P's vLLM"),
    ("push tail (last WRITE posted -> landed on D)", "last_post", "landed", "pushactors"),
)
_POSTS = frozenset({"write.posted", "write.layer_posted"})


@dataclass(frozen=True)
class ClientRecord:
    """One request as the client saw it: its ``X-Request-Id``, when it was sent (epoch), its
    TTFT and end-to-end seconds."""

    xid: str
    sent: float
    ttft: float
    e2e: float
    first_chunk: float | None = None  # its first event of any kind (vLLM may send one without text)


def _ids(ev: Event) -> list[str]:
    return [v for k in ("request_id", "d_request_id", "p_request_id") if isinstance(v := ev.get(k), str)]


def request_marks(events: Sequence[Event], record: ClientRecord) -> dict[str, float]:
    """The marks (see the module doc) found for one request, by its client id."""
    marks: dict[str, float] = {"sent": record.sent, "first_token": record.sent + record.ttft}
    if record.first_chunk is not None:
        marks["first_chunk"] = record.sent + record.first_chunk
    for ev in events:
        if not any(record.xid in rid for rid in _ids(ev)):
            continue
        if ev.event == "router.request" and ev.get("request_id") == record.xid:
            ms = ev.get("ms")
            if isinstance(ms, (int, float)):
                arrived = ev.ts - ms / 1e3
                marks["router_in"] = arrived
                for key, mark in (("first_event_ms", "first_event"), ("prefill_ms", "p_answered")):
                    value = ev.get(key)
                    if isinstance(value, (int, float)):
                        marks[mark] = arrived + value / 1e3
        elif ev.event == "request.prefilled":
            marks.setdefault("prefilled", ev.ts)
        elif ev.event == "blocks.stored":
            marks["announced"] = min(marks.get("announced", ev.ts), arrival(ev))
        elif ev.event in _POSTS:
            marks["last_post"] = max(marks.get("last_post", ev.ts), ev.ts)
        elif ev.event == "connector.recv_reported":
            marks.setdefault("reported", ev.ts)
            waited = ev.get("waited_ms")
            if isinstance(waited, (int, float)):
                marks.setdefault("landed", ev.ts - waited / 1e3)
        elif ev.event == "connector.recv_scheduled":
            marks.setdefault("scheduled", ev.ts)
    return marks


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))]


def summarize(samples: list[float]) -> dict[str, float] | None:
    if not samples:
        return None
    return {
        "n": len(samples),
        "p50": round(_pct(samples, 0.5), 2),
        "p90": round(_pct(samples, 0.9), 2),
        "p99": round(_pct(samples, 0.99), 2),
        "mean": round(statistics.fmean(samples), 2),
    }


def ttft_stages(paths: Sequence[Path | str], records: Sequence[ClientRecord]) -> dict[str, Any]:
    """Per stage (ms): n, p50, p90, p99, mean over the requests; and the client's TTFT."""
    events, _ = load([str(p) for p in paths]) if paths else ([], None)
    # Only the events that name a request (most do not: stats, handshakes).
    named = [ev for ev in events if _ids(ev)]
    per_request = [request_marks(named, r) for r in records]
    out: dict[str, Any] = {
        "requests": len(records),
        "incomplete": sum(1 for m in per_request if not all(k in m for k in MARKS)),
        "ttft": summarize([r.ttft * 1e3 for r in records]),
    }
    for key, spans in (("stages", STAGES), ("side", SIDE_SPANS)):
        out[key] = []
        for name, a, b, owner in spans:
            samples = [(m[b] - m[a]) * 1e3 for m in per_request if a in m and b in m]
            out[key].append({"stage": name, "from": a, "to": b, "owner": owner, **(summarize(samples) or {"n": 0})})
    return out


def _row(label: str, owner: str, s: dict[str, Any]) -> str:
    return f"| {label} | {owner} | {s['n']} | {s['p50']} | {s['p90']} | {s['p99']} | {s['mean']} |"


def stage_table(result: dict[str, Any]) -> list[str]:
    """Markdown rows of :func:`ttft_stages`' result: the stages, the client's TTFT (their
    sum), then the spans beside them."""
    rows = [
        "| stage | owner | n | p50 ms | p90 ms | p99 ms | mean ms |",
        "|---|---|---|---|---|---|---|",
        *(_row(s["stage"], s["owner"], s) for s in result["stages"] if s["n"]),
    ]
    if result.get("ttft"):
        rows.append(_row("TTFT (client)", "", result["ttft"]))
    rows += [_row(f"beside: {s['stage']}", s["owner"], s) for s in result.get("side", ()) if s["n"]]
    if result.get("incomplete"):
        rows.append(
            f"\n{result['incomplete']} of {result['requests']} requests lack a mark (see pushactors.logview.ttft)"
        )
    return rows
