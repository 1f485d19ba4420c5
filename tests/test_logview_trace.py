"""Request traces, run summaries and their pictures (pushactors.logview.trace/summary/plot).

Synthetic P and D logs are written as JSON lines with known timestamps, so every stage duration
below is known exactly; one test runs the in-process demo and traces its real logs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from pushactors.logview.model import Event, RequestIndex, parse_line
from pushactors.logview.plot import plot_summary, plot_trace
from pushactors.logview.stages import STAGES
from pushactors.logview.summary import END_TO_END, normalise_reason, percentile, render_summary, stage_times, summarize
from pushactors.logview.trace import build_trace, render_trace
from pushactors.testing.browser import rendered_dom

P = {"pid": 100, "rank": "prefill-0/pp0/tp0"}
D = {"pid": 200, "rank": "decode-0/pp0/tp0"}
MS = 1e-3
HOSTILE = "</script><script>document.body.dataset.error='injected'</script><!--"


class Log:
    """Events of both engines, written to one file per engine and read back through parse_line."""

    def __init__(self) -> None:
        self.lines: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}

    def add(
        self,
        side: dict[str, Any],
        actor: str,
        event: str,
        ts: float,
        *,
        msg: str | None = None,
        wait_ms: float | None = None,
        handle_ms: float | None = None,
        level: str = "debug",
        **fields: Any,
    ) -> None:
        record: dict[str, Any] = {"actor": actor, "rank": side["rank"], **fields}
        if msg is not None:
            record.update(msg=msg, wait_ms=wait_ms, handle_ms=handle_ms)
        record.update(event=event, level=level, ts=ts, pid=side["pid"])
        self.lines["prefill" if side is P else "decode"].append(record)

    def events(self, tmp_path: Path) -> list[Event]:
        out: list[Event] = []
        for name, records in self.lines.items():
            path = tmp_path / f"mailbox-{name}.jsonl"
            text = "".join(json.dumps(r) + "\n" for r in sorted(records, key=lambda r: r["ts"]))
            # Another program's output and a torn last line: both skipped.
            path.write_text("not json at all\n" + text + '{"event": "torn", "ts": 12')
            for i, line in enumerate(path.read_bytes().splitlines(), 1):
                ev = parse_line(line, str(path), i)
                if ev is not None:
                    out.append(ev)
        return sorted(out, key=lambda e: (e.ts, e.source, e.line))


def landed(log: Log, t: float, d_id: str, p_id: str, ms: dict[str, float], *, taken: bool = False) -> None:
    """A request that lands, matched on the registration's arrival, with these stage durations (ms).
    ``taken``: D's writer reported it as it routed the completion (core/claims.py); the reaper
    counts it 0.3 ms later, off the request's path."""
    reg, match, post, settle, notify = (ms[name] for name in STAGES)
    log.add(P, "reaper", "lease.armed", t, msg="arm_lease", wait_ms=0.1, handle_ms=0.05, request_id=p_id)
    log.add(
        P,
        "matcher",
        "blocks.stored",
        t + 0.2 * MS,
        msg="blocks_finished",
        wait_ms=0.05,
        handle_ms=0.05,
        request_id=p_id,
        blocks=4,
    )
    staged = t + 0.5 * MS
    log.add(D, "reaper", "recv.watching", staged, msg="watch_recv", wait_ms=0.1, handle_ms=0.1, request_id=d_id)
    log.add(
        D,
        "writer",
        "reg.sent",
        t + 0.7 * MS,
        msg="send_registration",
        wait_ms=0.05,
        handle_ms=0.05,
        request_id=d_id,
        sent=1,
    )
    r = staged + reg * MS  # P's writer routes the registration
    log.add(P, "writer", "notif.routed", r, kind="Registration", request_id=d_id, sender="decode-0-pp0-tp0")
    m = r + match * MS  # matched
    log.add(
        P,
        "matcher",
        "reg.matched",
        m,
        msg="registration_arrived",
        wait_ms=0.1,
        handle_ms=0.1,
        request_id=d_id,
        p_request_id=p_id,
        order="registration_last",
        d_rank=0,
    )
    # The PostPush arrives as the match ends; the WRITE is handed to NIXL ``post`` ms later.
    log.add(
        P,
        "writer",
        "write.posted",
        m + (post + 0.5) * MS,
        msg="post_push",
        wait_ms=0.2,
        handle_ms=post + 0.3,
        post_ms=post - 0.2,
        request_id=p_id,
        d_request_id=d_id,
        bytes=65536,
    )
    s = m + (post + settle) * MS
    log.add(P, "writer", "write.settled", s, request_id=p_id, d_request_id=d_id, ok=True, bytes=65536, note=HOSTILE)
    log.add(P, "writer", "push.finished", s + 0.01 * MS, request_id=p_id, outcome="pushed")
    if taken:
        log.add(D, "writer", "notif.routed", s + notify * MS, kind="Completion", request_id=d_id, taken=True)
        log.add(D, "reaper", "recv.finished", s + (notify + 0.3) * MS, request_id=d_id, by="writer")
        log.add(D, "reaper", "recv.notified", s + (notify + 0.32) * MS, msg="recv_notified", wait_ms=0.3,
                handle_ms=0.02, request_id=d_id, ok=True, taken=True)  # fmt: skip
        return
    log.add(D, "writer", "notif.routed", s + 0.1 * MS, kind="Completion", request_id=d_id)
    log.add(D, "reaper", "recv.finished", s + notify * MS, request_id=d_id)
    log.add(
        D,
        "reaper",
        "recv.notified",
        s + (notify + 0.02) * MS,
        msg="recv_notified",
        wait_ms=0.05,
        handle_ms=notify - 0.18,
        request_id=d_id,
        ok=True,
        answered=1,
        expected=1,
    )


def refused_on_post(log: Log, t: float, d_id: str, p_id: str) -> None:
    """Matched, then P's writer refuses the WRITE. P's refusal names only P's id: the trace
    finds it through the match's ``p_request_id``."""
    log.add(P, "reaper", "lease.armed", t, msg="arm_lease", wait_ms=0.1, handle_ms=0.05, request_id=p_id)
    log.add(D, "reaper", "recv.watching", t + 0.5 * MS, msg="watch_recv", wait_ms=0.1, handle_ms=0.1, request_id=d_id)
    r = t + 2.0 * MS
    log.add(P, "writer", "notif.routed", r, kind="Registration", request_id=d_id)
    log.add(
        P,
        "matcher",
        "reg.matched",
        r + 0.4 * MS,
        msg="registration_arrived",
        wait_ms=0.1,
        handle_ms=0.1,
        request_id=d_id,
        p_request_id=p_id,
        order="registration_last",
    )
    why = "D agent changed since it registered"
    log.add(
        P,
        "writer",
        "write.refused",
        r + 1.0 * MS,
        msg="post_push",
        wait_ms=0.3,
        handle_ms=0.1,
        level="warning",
        request_id=p_id,
        reason=why,
    )
    log.add(P, "writer", "push.finished", r + 1.1 * MS, level="info", request_id=p_id, outcome="failed", reason=why)
    log.add(D, "reaper", "recv.failed", r + 1.95 * MS, level="info", request_id=d_id, reason=f"P failed it: {why}")
    log.add(
        D,
        "reaper",
        "recv.notified",
        r + 2.0 * MS,
        msg="recv_notified",
        wait_ms=0.1,
        handle_ms=0.1,
        request_id=d_id,
        ok=False,
    )


def refused_registration(log: Log, t: float, d_id: str, reason: str) -> None:
    log.add(D, "reaper", "recv.watching", t, msg="watch_recv", wait_ms=0.1, handle_ms=0.1, request_id=d_id)
    log.add(P, "writer", "notif.routed", t + 1.0 * MS, kind="Registration", request_id=d_id)
    log.add(
        P,
        "matcher",
        "reg.refused",
        t + 1.3 * MS,
        msg="registration_arrived",
        wait_ms=0.1,
        handle_ms=0.1,
        level="warning",
        request_id=d_id,
        reason=reason,
    )
    log.add(D, "reaper", "recv.failed", t + 2.0 * MS, level="info", request_id=d_id, reason=reason)


def still_waiting(log: Log, t: float, d_id: str) -> float:
    """Registration stored on P, no blocks yet. Returns when P received it."""
    log.add(D, "reaper", "recv.watching", t, msg="watch_recv", wait_ms=0.1, handle_ms=0.1, request_id=d_id)
    log.add(
        D, "writer", "reg.sent", t + 0.2 * MS, msg="send_registration", wait_ms=0.05, handle_ms=0.05, request_id=d_id
    )
    r = t + 1.0 * MS
    log.add(P, "writer", "notif.routed", r, kind="Registration", request_id=d_id)
    log.add(
        P,
        "matcher",
        "reg.stored",
        r + 0.3 * MS,
        msg="registration_arrived",
        wait_ms=0.1,
        handle_ms=0.1,
        request_id=d_id,
        d_rank=0,
    )
    return r


LANDED = ("req-l-0-d0000001", "req-l-0-a0000001")
FAILED = ("req-f-0-d0000002", "req-f-0-a0000002")
WAITING = "req-w-0-d0000003"
SLOW = ("req-s-0-d0000004", "req-s-0-a0000004")
CAPACITY = ("req-c1-0-d0000005", "req-c2-0-d0000006")
LANDED_MS = {"registration": 1.5, "match": 0.4, "post": 2.5, "settle": 0.3, "notify": 0.6}


def normal_ms(i: int) -> dict[str, float]:
    return {
        "registration": 1.0 + 0.02 * i,
        "match": 0.3 + 0.004 * i,
        "post": 2.0 + 0.02 * i,
        "settle": 1.0 + 0.01 * i,
        "notify": 0.5 + 0.004 * i,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Event], RequestIndex]:
    log = Log()
    landed(log, 1000.0, *LANDED, LANDED_MS)
    refused_on_post(log, 1001.0, *FAILED)
    refused_registration(log, 1002.0, CAPACITY[0], "block id 812 is beyond D's capacity of 512 blocks (group 0)")
    refused_registration(log, 1003.0, CAPACITY[1], "block id 1900 is beyond D's capacity of 1024 blocks (group 1)")
    still_waiting(log, 1050.0, WAITING)
    for i in range(50):
        landed(log, 1100.0 + i * 0.1, f"req-{i}-0-d{i:07x}", f"req-{i}-0-a{i:07x}", normal_ms(i))
    landed(log, 1200.0, *SLOW, {**normal_ms(25), "post": 40.0})
    events = log.events(tmp_path_factory.mktemp("logs"))
    return events, RequestIndex.build(events)


# --- stages and outcomes ---------------------------------------------------------------------------
def test_landed_request_stages_are_exact(run: tuple[list[Event], RequestIndex]) -> None:
    events, index = run
    trace = build_trace(events, index, LANDED[0])
    assert trace.found and trace.outcome == "landed" and trace.reason is None and trace.waiting_on is None
    assert trace.ids == sorted(LANDED)
    assert [s.name for s in trace.stages] == list(STAGES)
    for span in trace.stages:
        assert span.duration_ms == pytest.approx(LANDED_MS[span.name], abs=1e-6), span.name
    assert trace.stage("registration").where == "decode-0/pp0/tp0 [200] -> prefill-0/pp0/tp0 [100]"
    assert trace.stage("post").where == "prefill-0/pp0/tp0 [100]"
    assert trace.stalls == []
    # One hop per event; the settle, logged inside the posting handler, comes after the post.
    names = [h.event for h in trace.hops]
    assert len(names) == 12 and names.index("write.posted") < names.index("write.settled")
    posted = trace.hops[names.index("write.posted")]
    assert posted.end - posted.start == pytest.approx(2.8 * MS)
    assert posted.start - posted.arrival == pytest.approx(0.2 * MS)
    assert posted.fields["post_ms"] == pytest.approx(2.3) and "request_id" not in posted.fields
    assert trace.hops[0].gap_ms is None and all(h.gap_ms is not None for h in trace.hops[1:])
    # From lease.armed's arrival to recv.notified's end (it ends after recv.finished, logged inside it).
    assert trace.total_ms == pytest.approx(0.15 + 0.5 + sum(LANDED_MS.values()) + 0.02, abs=1e-6)
    # Found the same by P's id, by the base id, and as JSON.
    assert build_trace(events, index, LANDED[1]).ids == sorted(LANDED)
    assert build_trace(events, index, "req-l-0").ids == sorted(LANDED)
    json.dumps(trace.to_json())


def test_a_request_the_writer_reported_lands_when_its_completion_was_routed(tmp_path: Path) -> None:
    """D's writer took the completion (core/claims.py): D knew when it routed it, not when the
    reaper counted it afterwards, so the notify stage ends at the routing."""
    log = Log()
    landed(log, 1000.0, *LANDED, LANDED_MS, taken=True)
    events = log.events(tmp_path)
    trace = build_trace(events, RequestIndex.build(events), LANDED[0])
    assert trace.outcome == "landed"
    for span in trace.stages:
        assert span.duration_ms == pytest.approx(LANDED_MS[span.name], abs=1e-6), span.name


def test_failed_request_reason_and_link_through_p_request_id(run: tuple[list[Event], RequestIndex]) -> None:
    events, index = run
    trace = build_trace(events, index, FAILED[0])  # D's id: P's refusal names only P's id
    assert trace.ids == sorted(FAILED)
    assert trace.outcome == "failed"
    assert trace.reason == "D agent changed since it registered"
    assert trace.failed_at == "write.refused on prefill-0/pp0/tp0 [100]"
    assert trace.stage("registration").duration_ms == pytest.approx(1.5, abs=1e-6)
    assert trace.stage("match").duration_ms == pytest.approx(0.4, abs=1e-6)
    assert trace.stage("post").start is not None and trace.stage("post").end is None
    assert trace.waiting_on is None
    console = Console(record=True, width=200)
    render_trace(trace, console)
    text = console.export_text()
    assert "FAILED" in text and "D agent changed since it registered" in text and "write.refused" in text


def test_in_flight_request_waits_for_prefill(run: tuple[list[Event], RequestIndex]) -> None:
    events, index = run
    trace = build_trace(events, index, WAITING)
    assert trace.outcome == "in flight"
    assert trace.waiting_on == "match: P has the registration, waiting for its prefill to finish"
    received = 1050.0 + 1.0 * MS
    assert trace.waiting_since == pytest.approx(received)
    last = max(ev.ts for ev in events)
    assert trace.waiting_ms == pytest.approx((last - received) * 1e3)
    assert trace.stage("registration").duration_ms == pytest.approx(1.0, abs=1e-6)
    assert trace.stage("match").start == pytest.approx(received) and trace.stage("match").end is None
    stall = trace.stall_of("match")
    assert stall is not None and stall.in_progress  # waiting far longer than any match took
    console = Console(record=True, width=200)
    render_trace(trace, console)
    text = console.export_text()
    assert "IN FLIGHT" in text and "waiting on match: P has the registration" in text


def test_slow_stage_is_flagged_against_the_run(run: tuple[list[Event], RequestIndex]) -> None:
    events, index = run
    posts = [LANDED_MS["post"], 40.0] + [normal_ms(i)["post"] for i in range(50)]
    p50, p90 = statistics.median(posts), percentile(posts, 90)
    trace = build_trace(events, index, SLOW[1])
    assert trace.outcome == "landed"
    assert [s.stage for s in trace.stalls] == ["post"]
    stall = trace.stalls[0]
    assert stall.duration_ms == pytest.approx(40.0, abs=1e-6)
    assert stall.p50_ms == pytest.approx(p50) and stall.p90_ms == pytest.approx(p90)
    assert stall.threshold_ms == pytest.approx(max(3 * p50, p90, 1.0))
    assert stall.factor == pytest.approx(40.0 / p50)
    for i in (0, 25, 49):  # the usual requests are not flagged
        assert build_trace(events, index, f"req-{i}-0-d{i:07x}").stalls == []
    console = Console(record=True, width=200)
    render_trace(trace, console)
    text = console.export_text()
    assert "STALL" in text and f"{40.0 / p50:.1f}×" in text


def test_unknown_request(run: tuple[list[Event], RequestIndex]) -> None:
    events, index = run
    trace = build_trace(events, index, "no-such-request")
    assert not trace.found and trace.outcome == "unknown" and trace.hops == []
    console = Console(record=True, width=120)
    render_trace(trace, console)
    assert "no events for request no-such-request" in console.export_text()


# --- summary -----------------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([float(v) for v in range(1, 11)], 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_stage_times_group_p_and_d_ids_under_d(run: tuple[list[Event], RequestIndex]) -> None:
    events, _ = run
    times = stage_times(events)
    assert set(times) == {LANDED[0], FAILED[0], WAITING, SLOW[0], *CAPACITY} | {
        f"req-{i}-0-d{i:07x}" for i in range(50)
    }
    assert times[LANDED[0]]["settle"].duration_ms == pytest.approx(0.3, abs=1e-6)
    assert times["req-7-0-d0000007"]["notify"].duration_ms == pytest.approx(normal_ms(7)["notify"], abs=1e-6)


def test_summary_stages_outcomes_failures_actors(run: tuple[list[Event], RequestIndex]) -> None:
    events, _ = run
    summary = summarize(events)
    assert summary.events == len(events) and summary.requests == 56
    assert summary.first_ts == min(e.ts for e in events) and summary.span_s == pytest.approx(
        max(e.ts for e in events) - min(e.ts for e in events)
    )
    assert summary.outcomes == {"landed": 52, "failed": 3, "in flight": 1}
    posts = [LANDED_MS["post"], 40.0] + [normal_ms(i)["post"] for i in range(50)]
    post = summary.stages["post"]
    assert post.count == 52 and post.max == pytest.approx(40.0)
    assert post.p50 == pytest.approx(statistics.median(posts))
    assert post.p90 == pytest.approx(percentile(posts, 90)) and post.p99 == pytest.approx(percentile(posts, 99))
    regs = [LANDED_MS["registration"], 1.5, 1.0, 1.0, 1.0, normal_ms(25)["registration"]]
    regs += [normal_ms(i)["registration"] for i in range(50)]
    assert summary.stages["registration"].count == len(regs)
    assert summary.stages["registration"].p50 == pytest.approx(statistics.median(regs))
    e2e = [sum(LANDED_MS.values()), sum({**normal_ms(25), "post": 40.0}.values())]
    e2e += [sum(normal_ms(i).values()) for i in range(50)]
    assert summary.stages[END_TO_END].count == 52
    assert summary.stages[END_TO_END].p50 == pytest.approx(statistics.median(e2e))

    by_pattern = {g.pattern: g for g in summary.failures}
    capacity = by_pattern["block id <n> is beyond D's capacity of <n> blocks (group <n>)"]
    assert capacity.count == 2 and sorted(capacity.requests) == sorted(CAPACITY)
    assert capacity.example.startswith("block id ")
    assert by_pattern["D agent changed since it registered"].requests == [FAILED[0]]
    assert summary.failures[0] is capacity  # most frequent first

    matcher = next(a for a in summary.actors if a.actor == "matcher" and a.process.startswith("prefill"))
    # blocks_finished ×52 (landed), registration_arrived ×(52 + failed + 2 refused + waiting)
    assert matcher.handled == 52 + 56
    assert matcher.rate == pytest.approx(matcher.handled / summary.span_s)
    assert matcher.busiest[0][:2] == ("registration_arrived", 56)
    assert matcher.wait_p50 is not None and matcher.handle_p99 is not None
    json.dumps(summary.to_json())
    console = Console(record=True, width=200)
    render_summary(summary, console)
    text = console.export_text()
    assert "failures by reason" in text and "landed 52" in text and "end to end" in text


def test_normalise_reason() -> None:
    assert normalise_reason("registration names engine 'p-1', this is 'p-0'") == (
        "registration names engine <s>, this is <s>"
    )
    assert normalise_reason("request req-3-0-f728b4fa already pushed") == "request <id> already pushed"
    assert (
        normalise_reason("WRITE submission failed: NixlError(0x7f00aabb)")
        == "WRITE submission failed: NixlError(<hex>)"
    )


# --- pictures ------------------------------------------------------------------------------------------
def _body(dom: str) -> str:
    match = re.search(r"<body[^>]*>", dom)
    assert match is not None, dom[:500]
    return match.group(0)


def _self_contained(page: str) -> None:
    assert "<link" not in page and " src=" not in page and "href=" not in page and "@import" not in page
    assert HOSTILE not in page and "</script><script>document" not in page


def test_trace_html_draws_every_hop(run: tuple[list[Event], RequestIndex], tmp_path: Path) -> None:
    events, index = run
    pages = {}
    for name, query in (("landed", LANDED[0]), ("slow", SLOW[0]), ("waiting", WAITING), ("failed", FAILED[0])):
        trace = build_trace(events, index, query)
        path = tmp_path / f"{name}.html"
        plot_trace(trace, path)
        _self_contained(path.read_text())
        pages[name] = (path, len(trace.hops))
    assert "STALL" in pages["slow"][0].read_text()
    for path, hops in pages.values():
        body = _body(rendered_dom(path))
        assert f'data-rendered="{hops}"' in body, body
        assert "data-error" not in body, body


def test_summary_html_draws_every_sample(run: tuple[list[Event], RequestIndex], tmp_path: Path) -> None:
    events, _ = run
    summary = summarize(events)
    path = tmp_path / "summary.html"
    plot_summary(summary, path)
    _self_contained(path.read_text())
    points = sum(len(v) for v in summary.samples.values())
    assert points == 5 * 52 + 2 + 2 + 1 + 52  # complete stages (landed, failed, refused, waiting) + end to end
    body = _body(rendered_dom(path))
    assert f'data-rendered="{points}"' in body and "data-error" not in body, body


def test_png_plots(run: tuple[list[Event], RequestIndex], tmp_path: Path) -> None:
    events, index = run
    trace_png, summary_png = tmp_path / "trace.png", tmp_path / "summary.png"
    plot_trace(build_trace(events, index, SLOW[0]), trace_png)
    plot_summary(summarize(events), summary_png)
    for path in (trace_png, summary_png):
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_formats(run: tuple[list[Event], RequestIndex], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events, index = run
    trace = build_trace(events, index, LANDED[0])
    with pytest.raises(ValueError, match=r"\.html or \.png"):
        plot_trace(trace, tmp_path / "trace.svg")
    with pytest.raises(ValueError, match=r"\.html or \.png"):
        plot_summary(summarize(events), tmp_path / "summary")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'pushactors\[plot\]'"):
        plot_trace(trace, tmp_path / "trace.png")
    plot_trace(trace, tmp_path / "trace.html")  # HTML needs nothing beyond the standard library


# --- real logs ---------------------------------------------------------------------------------------
def test_demo_logs_trace_to_landed(tmp_path: Path) -> None:
    from pushactors.apps import demo

    args = argparse.Namespace(
        fabric="fake",
        device="cpu",
        tp=1,
        timeout=120,
        requests=40,
        concurrency=4,
        max_tokens=256,
        layers=2,
        blocks=256,
        block_bytes=4096,
        seed=0,
        log_dir=str(tmp_path),
        progress=False,
    )
    assert demo.run(args) == 0
    path = tmp_path / "mailbox-inprocess.jsonl"
    events = [ev for i, line in enumerate(path.read_bytes().splitlines(), 1) if (ev := parse_line(line, str(path), i))]
    events.sort(key=lambda e: (e.ts, e.source, e.line))
    index = RequestIndex.build(events)
    d_ids = sorted({ev.request_id for ev in events if ev.event == "recv.watching" and ev.request_id})
    assert len(d_ids) == 40
    for d_id in d_ids:
        trace = build_trace(events, index, d_id)
        assert trace.outcome == "landed", (d_id, trace.outcome, trace.reason)
        assert len(trace.ids) == 2, trace.ids  # P's id and D's
        for span in trace.stages:
            assert span.duration_ms is not None and span.duration_ms >= 0, (d_id, span)
    summary = summarize(events, index)
    assert summary.outcomes == {"landed": 40, "failed": 0, "in flight": 0}
    assert all(summary.stages[name].count == 40 for name in STAGES)
