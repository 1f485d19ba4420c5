"""``pushactors logs`` and the reading half of pushactors.logview: sources, clocks, filters, rendering.

The logs are synthetic: P (pid 100) and D (pid 200), D's wall clock 0.5 s ahead of P's, with
the handshake samples that measure it. Unless corrected, every D event sorts after P's.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from rich.console import Console
from rich.text import Text

from pushactors.apps import logs as logs_app
from pushactors.apps.cli import main
from pushactors.logview.filters import EventFilter, parse_time
from pushactors.logview.model import Event, RequestIndex, parse_line
from pushactors.logview.render import EventRenderer, describe_clocks, json_record, short_id
from pushactors.logview.source import LogReader, LogSet, Timeline, expand, load

P_PID, D_PID = 100, 200
P_RANK, D_RANK = "prefill-0/pp0/tp0", "decode-0/pp0/tp0"
SKEW = 0.5  # D's clock minus P's
T0 = 1_800_000_000.0
P_ID, D_ID = "req-7-0-aaaaaaaa", "req-7-0-bbbbbbbb"
OTHER_P, OTHER_D = "req-8-0-cccccccc", "req-8-0-dddddddd"
# One push in true (P clock) order.
CAUSAL = ["recv.watching", "notif.routed", "reg.matched", "write.posted", "write.settled", "recv.finished"]


def rec(event: str, t: float, pid: int, **fields: Any) -> dict[str, Any]:
    """A record as ``pid`` writes it at true time ``t`` (P's clock): D stamps it SKEW later."""
    rank, actor = (P_RANK, "writer") if pid == P_PID else (D_RANK, "reaper")
    level = fields.pop("level", "debug")
    record: dict[str, Any] = {"actor": actor, "rank": rank, **fields, "event": event, "level": level}
    record["ts"] = T0 + t + (SKEW if pid == D_PID else 0.0)
    record["pid"] = pid
    return record


def p_log() -> list[dict[str, Any]]:
    return [
        rec("rank.registered", 0.0, P_PID, actor="worker", level="info"),
        rec("handshake.completed", 0.5, P_PID, actor="handshake", peer=D_RANK, rtt_ms=1.0, wall_offset_ms=SKEW * 1e3),
        rec("notif.routed", 1.010, P_PID, kind="Registration", request_id=D_ID),
        rec(
            "reg.matched",
            1.020,
            P_PID,
            actor="matcher",
            request_id=D_ID,
            msg="registration_arrived",
            wait_ms=0.4,
            handle_ms=0.1,
        ),
        rec(
            "write.posted",
            1.030,
            P_PID,
            request_id=P_ID,
            d_request_id=D_ID,
            bytes=4096,
            msg="post_push",
            wait_ms=2.5,
            handle_ms=1.25,
        ),
        rec("write.settled", 1.040, P_PID, request_id=P_ID, d_request_id=D_ID, ok=True),
        rec(
            "write.refused", 1.045, P_PID, request_id=OTHER_P, d_request_id=OTHER_D, level="warning", reason="peer gone"
        ),
    ]


def d_log() -> list[dict[str, Any]]:
    return [
        rec("rank.registered", 0.1, D_PID, actor="worker", level="info"),
        rec(
            "handshake.completed",
            0.6,
            D_PID,
            actor="handshake",
            peer=P_RANK,
            rtt_ms=8.0,
            wall_offset_ms=-SKEW * 1e3 + 2.0,
        ),  # a worse sample (longer round trip): must lose
        rec("recv.watching", 1.000, D_PID, request_id=D_ID, msg="watch_recv", wait_ms=0.2, handle_ms=0.05),
        rec("recv.failed", 1.048, D_PID, request_id=OTHER_D, level="error", reason="write refused"),
        rec("recv.finished", 1.050, D_PID, request_id=D_ID),
    ]


def lines(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def write_logs(directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    p, d = directory / "mailbox-prefill.jsonl", directory / "mailbox-decode.jsonl"
    p.write_text(lines(p_log()))
    d.write_text(lines(d_log()))
    return p, d


def append(path: Path, text: str) -> None:
    with open(path, "a") as fh:
        fh.write(text)


def poll_until(
    poll: Callable[[], list[Event]], done: Callable[[list[Event]], bool], timeout: float = 5.0
) -> list[Event]:
    """Everything ``poll`` returns until ``done`` holds for it; fails at the deadline."""
    got: list[Event] = []
    deadline = time.monotonic() + timeout
    while not done(got):
        assert time.monotonic() < deadline, f"condition not met in {timeout}s; got {[e.event for e in got]}"
        got.extend(poll())
    return got


def of_push(events: list[Event]) -> list[str]:
    return [e.event for e in events if e.event in CAUSAL]


# --- sources -------------------------------------------------------------------------------------


def test_load_merges_two_processes_in_causal_order_after_clock_correction(tmp_path: Path) -> None:
    write_logs(tmp_path)
    raw = sorted(LogSet([str(tmp_path)]).read_all(), key=lambda e: e.raw_ts)
    assert of_push(raw) != CAUSAL  # D's fast clock puts its events last without the correction

    events, model = load([str(tmp_path)])
    assert of_push(events) == CAUSAL
    assert model.reference == P_PID  # most events
    assert model.offsets[D_PID] == pytest.approx(SKEW)  # P's sample (rtt 1 ms) beat D's (8 ms)
    assert model.error[D_PID] == pytest.approx(0.0005)
    watching = next(e for e in events if e.event == "recv.watching")
    assert watching.ts == pytest.approx(T0 + 1.0) and watching.raw_ts == pytest.approx(T0 + 1.5)
    assert [e.ts for e in events] == sorted(e.ts for e in events)


def test_load_with_the_other_process_as_clock_reference(tmp_path: Path) -> None:
    write_logs(tmp_path)
    events, model = load([str(tmp_path)], reference=D_PID)
    assert model.reference == D_PID and model.offsets[P_PID] == pytest.approx(-SKEW)
    assert of_push(events) == CAUSAL
    assert next(e for e in events if e.event == "recv.watching").ts == pytest.approx(T0 + 1.5)


def test_a_process_no_handshake_reaches_is_left_uncorrected(tmp_path: Path) -> None:
    write_logs(tmp_path)
    router = {"actor": "router", "event": "router.request", "level": "info", "ts": T0 + 2, "pid": 300}
    (tmp_path / "router.jsonl").write_text(json.dumps(router) + "\n")
    events, model = load([str(tmp_path)])
    assert model.uncorrected == {300}
    assert next(e for e in events if e.pid == 300).ts == T0 + 2
    text = describe_clocks(model, {P_PID: P_RANK, D_PID: D_RANK})
    assert text == (
        f"pid {P_PID} ({P_RANK}): reference; pid {D_PID} ({D_RANK}): -500.000 ms ±0.500 ms; pid 300: uncorrected"
    )


def test_torn_last_line_waits_for_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    whole = lines(p_log()[:3])
    last = json.dumps(p_log()[3]) + "\n"
    path.write_text(whole + last[:25])
    reader = LogReader(path)
    assert [e.event for e in reader.read_new()] == ["rank.registered", "handshake.completed", "notif.routed"]
    assert reader.read_new() == [] and reader.bad_lines == 0
    append(path, last[25:])
    (ev,) = reader.read_new()
    assert ev.event == "reg.matched" and ev.line == 4 and ev.source == str(path)
    assert reader.bad_lines == 0


def test_torn_last_line_counts_as_bad_when_read_once(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(lines(p_log()[:2]) + json.dumps(p_log()[2])[:30])
    logs = LogSet([str(path)])
    assert len(logs.read_all()) == 2 and logs.bad_lines == 1
    # A complete last record without its newline is still an event.
    path.write_text(lines(p_log()[:2]) + json.dumps(p_log()[2]))
    logs = LogSet([str(path)])
    assert len(logs.read_all()) == 3 and logs.bad_lines == 0


def test_garbage_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    good = p_log()[:2]
    path.write_text(
        json.dumps(good[0]) + "\nTraceback (most recent call last):\n\n[1, 2]\n"
        '{"event": "no.ts"}\n{"ts": 1.0}\n\x00\xff garbage\n' + json.dumps(good[1]) + "\n"
    )
    logs = LogSet([str(path)])
    events = logs.read_all()
    assert [e.line for e in events] == [1, 8]  # line numbers count every line, blank ones too
    assert logs.bad_lines == 5


def test_expand_files_globs_and_directories(tmp_path: Path) -> None:
    (tmp_path / "run" / "sub").mkdir(parents=True)
    b = tmp_path / "run" / "b.jsonl"
    a = tmp_path / "run" / "sub" / "a.jsonl"
    top = tmp_path / "top.jsonl"
    for path in (a, b, top):
        path.write_text("")
    (tmp_path / "run" / "notes.txt").write_text("not a log")
    run = str(tmp_path / "run")
    assert expand([run]) == [b, a]  # recursive, sorted by path
    assert expand([str(tmp_path / "*.jsonl")]) == [top]
    assert expand([str(tmp_path / "**" / "*.jsonl")]) == sorted([a, b, top])
    assert expand([str(top), str(tmp_path / "run" / "notes.txt")]) == [top, tmp_path / "run" / "notes.txt"]
    assert expand([run, str(b), str(tmp_path / "run" / "*.jsonl")]) == [b, a]  # each file once
    with pytest.raises(ValueError, match=r"no log files at .*missing\.jsonl, .*nothing-\*"):
        expand([str(top), str(tmp_path / "missing.jsonl"), str(tmp_path / "nothing-*")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        expand([str(tmp_path / "empty")])
    assert expand([str(tmp_path / "missing.jsonl")], missing_ok=True) == []


def test_follow_picks_up_appended_lines_and_files_created_later(tmp_path: Path) -> None:
    watched = tmp_path / "logs"
    watched.mkdir()
    p = watched / "mailbox-prefill.jsonl"
    p.write_text(lines(p_log()[:2]))
    late_glob = str(tmp_path / "late-*.jsonl")
    logs = LogSet([str(watched), late_glob], follow=True)  # the glob matches nothing yet: fine when following
    assert len(logs.poll()) == 2
    assert logs.poll() == []

    append(p, lines(p_log()[2:4]))
    got = poll_until(logs.poll, lambda got: len(got) >= 2)
    assert [e.event for e in got] == ["notif.routed", "reg.matched"]

    torn = json.dumps(p_log()[4]) + "\n"
    append(p, torn[:40])  # the writer is mid-line: nothing yet, and nothing counted bad
    assert logs.poll() == [] and logs.bad_lines == 0
    append(p, torn[40:])
    got = poll_until(logs.poll, lambda got: len(got) >= 1)
    assert [(e.event, e.line) for e in got] == [("write.posted", 5)]

    # A new worker's file in the watched directory, then one matching the glob.
    (watched / "mailbox-decode-201.jsonl").write_text(lines(d_log()[:1]))
    got = poll_until(logs.poll, lambda got: any(e.pid == D_PID for e in got))
    assert got[0].source == str(watched / "mailbox-decode-201.jsonl")
    (tmp_path / "late-1.jsonl").write_text(lines(d_log()[1:3]))
    got = poll_until(logs.poll, lambda got: len(got) >= 2)
    assert [e.event for e in got] == ["handshake.completed", "recv.watching"]
    assert len(logs.files) == 3 and logs.bad_lines == 0


def test_follow_rereads_a_truncated_or_replaced_file(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(lines(p_log()[:4]))
    reader = LogReader(path)
    assert len(reader.read_new()) == 4
    path.write_text(lines(p_log()[4:5]))  # truncated, then one new line: shorter than before
    (ev,) = reader.read_new()
    assert ev.event == "write.posted" and ev.line == 1
    rotated = tmp_path / "new.jsonl"
    rotated.write_text(lines(p_log()[:6]))
    rotated.replace(path)  # rotation: another file under the same name, longer than what was read
    assert [e.event for e in reader.read_new()][-1] == "write.settled"


def test_timeline_corrects_clocks_once_a_handshake_arrives(tmp_path: Path) -> None:
    p, d = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    p.write_text(lines([p_log()[0], p_log()[2]]))
    d.write_text(lines([d_log()[0]]))
    timeline = Timeline(LogSet([str(tmp_path)], follow=True))
    first = timeline.read()
    assert timeline.clocks.reference == P_PID and D_PID in timeline.clocks.uncorrected
    assert all(e.ts == e.raw_ts for e in first)
    assert timeline.labels == {P_PID: P_RANK, D_PID: D_RANK}

    append(p, lines([p_log()[1]]))  # the clock sample
    append(d, lines([d_log()[2]]))
    got = poll_until(timeline.read, lambda got: any(e.event == "recv.watching" for e in got))
    assert timeline.clocks.offsets[D_PID] == pytest.approx(SKEW)
    watching = next(e for e in got if e.event == "recv.watching")
    assert watching.ts == pytest.approx(T0 + 1.0)


# --- filters -------------------------------------------------------------------------------------


@pytest.fixture
def merged(tmp_path: Path) -> tuple[list[Event], RequestIndex]:
    write_logs(tmp_path)
    events, _ = load([str(tmp_path)])
    return events, RequestIndex.build(events)


def chosen(selection: EventFilter, merged: tuple[list[Event], RequestIndex]) -> list[Event]:
    events, index = merged
    selection.bind(index, events[0].ts)
    return [e for e in events if selection.matches(e)]


@pytest.mark.parametrize("query", [D_ID, P_ID, "req-7-0"])
def test_request_filter_finds_both_engines_ids(query: str, merged: tuple[list[Event], RequestIndex]) -> None:
    got = chosen(EventFilter(request=query), merged)
    assert of_push(got) == CAUSAL and len(got) == len(CAUSAL)
    assert chosen(EventFilter(request="req-9-0"), merged) == []


def test_actor_event_and_level_filters(merged: tuple[list[Event], RequestIndex]) -> None:
    assert {e.actor for e in chosen(EventFilter(actors=["matcher", "hand*"]), merged)} == {"matcher", "handshake"}
    assert [e.event for e in chosen(EventFilter(events=["write.*"]), merged)] == [
        "write.posted",
        "write.settled",
        "write.refused",
    ]
    assert [e.event for e in chosen(EventFilter(events=["recv.finished", "rank.registered"]), merged)] == [
        "rank.registered",
        "rank.registered",
        "recv.finished",
    ]
    assert [e.event for e in chosen(EventFilter(level="warning"), merged)] == ["write.refused", "recv.failed"]
    assert [e.event for e in chosen(EventFilter(level="ERROR"), merged)] == ["recv.failed"]
    assert len(chosen(EventFilter(level="info"), merged)) == 4
    with pytest.raises(ValueError, match="unknown level"):
        EventFilter(level="loud")


def test_rank_filter_by_substring_glob_or_pid(merged: tuple[list[Event], RequestIndex]) -> None:
    decode = chosen(EventFilter(ranks=["decode"]), merged)
    assert decode and {e.pid for e in decode} == {D_PID}
    assert {e.pid for e in chosen(EventFilter(ranks=["prefill-*/tp0"]), merged)} == {P_PID}
    assert chosen(EventFilter(ranks=["*/tp1"]), merged) == []
    assert {e.pid for e in chosen(EventFilter(ranks=[str(D_PID)]), merged)} == {D_PID}


def test_time_window(merged: tuple[list[Event], RequestIndex]) -> None:
    events, _ = merged
    assert events[0].ts == pytest.approx(T0)
    window = chosen(EventFilter(since=parse_time("+1.015s"), until=parse_time("+1046ms")), merged)
    assert [e.event for e in window] == ["reg.matched", "write.posted", "write.settled", "write.refused"]
    absolute = chosen(EventFilter(since=parse_time(str(T0 + 1.045))), merged)
    assert [e.event for e in absolute] == ["write.refused", "recv.failed", "recv.finished"]
    wall = datetime.fromtimestamp(T0 + 1.0495)  # local time, as the user reads it off the listing
    clock = chosen(EventFilter(since=parse_time(wall.strftime("%H:%M:%S.%f"))), merged)
    assert [e.event for e in clock] == ["recv.finished"]
    iso = chosen(EventFilter(until=parse_time(datetime.fromtimestamp(T0 + 0.05).isoformat())), merged)
    assert [e.event for e in iso] == ["rank.registered"]


def test_parse_time_forms_and_errors() -> None:
    assert parse_time("+2.5s").at(100.0) == 102.5
    assert parse_time("+150ms").at(100.0) == pytest.approx(100.15)
    assert parse_time("3s").at(100.0) == 103.0
    assert parse_time("+2").at(100.0) == 102.0
    assert parse_time("+2s").at(None) is None  # no first event yet: no bound
    assert parse_time("1800000000.25").at(None) == 1800000000.25
    assert parse_time("2027-01-15T08:00:00Z").at(None) == T0
    assert parse_time("2027-01-15T09:00:00+01:00").at(None) == T0
    assert parse_time("12:00:00.5Z").at(T0) == T0 + 4 * 3600 + 0.5  # that time of day, on the first event's date
    for bad in ("+soon", "yesterday", "12:61:00", ""):
        with pytest.raises(ValueError, match="time"):
            parse_time(bad)


# --- rendering -----------------------------------------------------------------------------------


def render(events: list[Event], **console: Any) -> str:
    out = Console(file=io.StringIO(), width=200, **console)
    EventRenderer(out).show(events)
    return out.file.getvalue()  # type: ignore[attr-defined, no-any-return]


def test_line_shows_times_process_actor_event_request_and_mailbox_times(
    merged: tuple[list[Event], RequestIndex],
) -> None:
    events, _ = merged
    text = render(events)
    posted = next(line for line in text.splitlines() if "write.posted" in line)
    wall = datetime.fromtimestamp(T0 + 1.030).strftime("%H:%M:%S.%f")[:12]
    assert posted.split()[:7] == ["+1.030000s", wall, P_RANK, f"[{P_PID}]", "writer", "write.posted", P_ID]
    assert "wait=2.500ms handle=1.250ms" in posted
    assert f"d_request_id={D_ID} bytes=4096 msg=post_push" in posted
    refused = next(line for line in text.splitlines() if "write.refused" in line)
    assert 'reason="peer gone"' in refused
    assert "\x1b[" not in text  # not a terminal: no escape codes


def test_colours_follow_the_level_unless_turned_off(merged: tuple[list[Event], RequestIndex]) -> None:
    events, _ = merged
    failed = [e for e in events if e.event == "recv.failed"]
    coloured = render(failed, force_terminal=True, color_system="standard")
    assert "\x1b[1;31mrecv.failed" in coloured  # error: bold red
    plain = render(failed, force_terminal=True, color_system="standard", no_color=True)
    assert "\x1b[31m" not in plain and "\x1b[1;31m" not in plain and "recv.failed" in plain


def test_long_values_and_ids_are_shortened() -> None:
    long_id = "cmpl-" + "0123456789abcdef" * 2 + "-0-1a2b3c4d"
    record = rec("recv.failed", 1.0, D_PID, request_id=long_id, reason="x" * 500)
    ev = parse_line(json.dumps(record))
    assert ev is not None
    text = render([ev])
    assert short_id(long_id) in text and long_id not in text and short_id(long_id).endswith("-0-1a2b3c4d")
    reason = next(part for part in text.split() if part.startswith("reason="))
    assert reason.endswith("…") and len(reason) <= len("reason=") + 80


def test_wrapped_to_the_console_width(merged: tuple[list[Event], RequestIndex]) -> None:
    events, _ = merged
    narrow = Console(file=io.StringIO(), width=60, force_terminal=True, no_color=True)
    EventRenderer(narrow).show([e for e in events if e.event == "write.posted"])
    printed = narrow.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert len(printed) > 1 and all(len(Text.from_ansi(line).plain) <= 60 for line in printed)


def test_json_record_adds_ts_corrected_only_when_moved(merged: tuple[list[Event], RequestIndex]) -> None:
    events, _ = merged
    p_ev = next(e for e in events if e.pid == P_PID)
    d_ev = next(e for e in events if e.pid == D_PID)
    assert json_record(p_ev) == p_ev.record and "ts_corrected" not in json_record(p_ev)
    moved = json_record(d_ev)
    assert moved["ts"] == d_ev.raw_ts and moved["ts_corrected"] == pytest.approx(d_ev.raw_ts - SKEW)


# --- the command ---------------------------------------------------------------------------------


def test_cli_lists_merged_events_with_a_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_logs(tmp_path)
    append(tmp_path / "mailbox-prefill.jsonl", "not json\n")
    assert main(["logs", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    printed = out.splitlines()
    assert len(printed) == len(p_log()) + len(d_log())
    assert [line.split()[5] for line in printed if line.split()[5] in CAUSAL] == CAUSAL
    assert printed[0].split()[0] == "+0.000000s"
    assert "2 files, 12 events, 1 bad lines skipped" in err
    assert f"pid {P_PID} ({P_RANK}): reference; pid {D_PID} ({D_RANK}): -500.000 ms ±0.500 ms" in err


def test_cli_json_passes_records_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_logs(tmp_path)
    assert main(["logs", str(tmp_path), "--json", "--request", "req-7-0"]) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["event"] for r in records] == CAUSAL
    originals = {(r["pid"], r["event"]): r for r in p_log() + d_log()}
    for r in records:
        corrected = r.pop("ts_corrected", None)
        assert r == originals[(r["pid"], r["event"])]
        assert (corrected is not None) == (r["pid"] == D_PID)
    assert err == ""  # no header in JSON mode


def test_cli_filters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_logs(tmp_path)
    code = main(["logs", str(tmp_path / "*.jsonl"), "--level", "warning", "--rank", "decode", "--no-color"])
    assert code == 0
    out, _ = capsys.readouterr()
    assert [line.split()[5] for line in out.splitlines()] == ["recv.failed"]
    assert main(["logs", str(tmp_path), "-e", "write.*", "-a", "writer", "--since", "+1.035s"]) == 0
    out, _ = capsys.readouterr()
    assert [line.split()[5] for line in out.splitlines()] == ["write.settled", "write.refused"]


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_logs(tmp_path)
    assert main(["logs", str(tmp_path / "nope.jsonl")]) == 2
    assert "no log files at" in capsys.readouterr().err
    assert main(["logs", str(tmp_path), "--since", "yesterday"]) == 2
    assert "bad time" in capsys.readouterr().err
    assert main(["logs", str(tmp_path), "--summary", "--plot", "out.pdf"]) == 2
    assert main(["logs", str(tmp_path), "--request", "req-9-0"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "no events for request req-9-0" in err
    assert main(["logs", str(tmp_path), "--event", "nothing.*"]) == 1
    assert "none of 12 events matched" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse's own usage errors
        main(["logs", str(tmp_path), "--level", "loud"])
    assert exc.value.code == 2


def _read_then(monkeypatch: pytest.MonkeyPatch, actions: dict[int, Callable[[], None]]) -> list[int]:
    """Run ``actions[n]`` just before the follow loop's n-th read (counting the first as 1)."""
    calls = [0]
    original = Timeline.read

    def read(self: Timeline) -> list[Event]:
        calls[0] += 1
        if calls[0] in actions:
            actions[calls[0]]()
        return original(self)

    monkeypatch.setattr(Timeline, "read", read)
    return calls


def test_cli_follow_prints_existing_then_new_events_until_for_elapses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    watched = tmp_path / "logs"
    watched.mkdir()
    p = watched / "mailbox-prefill.jsonl"
    p.write_text(lines(p_log()[:5]))
    decode = watched / "mailbox-decode.jsonl"
    calls = _read_then(
        monkeypatch,
        {
            2: lambda: decode.write_text(lines(d_log()[:3])),  # a process that starts later
            3: lambda: append(p, lines(p_log()[5:6]) + json.dumps(p_log()[6])[:20]),  # and a torn line
        },
    )
    started = time.monotonic()
    assert main(["logs", str(watched), "--follow", "--for", "0.6", "--poll-interval", "0.05"]) == 0
    assert 0.5 <= time.monotonic() - started < 5
    assert calls[0] >= 3
    out, err = capsys.readouterr()
    printed = [line.split()[5] for line in out.splitlines()]
    assert printed == [
        "rank.registered",
        "handshake.completed",
        "notif.routed",
        "reg.matched",
        "write.posted",
        "rank.registered",
        "handshake.completed",
        "recv.watching",  # D's batch, sorted within itself
        "write.settled",
    ]
    assert "1 file, 5 events" in err
    # D's events were corrected by P's sample once D's pid appeared: watching sits at +1.0 s.
    watching = next(line for line in out.splitlines() if "recv.watching" in line)
    assert watching.split()[0] == "+1.000000s"


def test_cli_follow_stops_cleanly_on_ctrl_c(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    write_logs(tmp_path)

    def interrupt() -> None:
        raise KeyboardInterrupt

    _read_then(monkeypatch, {2: interrupt})
    assert main(["logs", str(tmp_path), "--follow", "--json"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 12 and "Traceback" not in err


def test_cli_follow_waits_for_paths_that_do_not_exist_yet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    later = tmp_path / "later.jsonl"
    _read_then(monkeypatch, {2: lambda: later.write_text(lines(p_log()[:1]))})
    assert main(["logs", str(later), "--follow", "--for", "0.3", "--poll-interval", "0.05", "--json"]) == 0
    assert [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines()] == ["rank.registered"]


# --- --trace / --summary / --plot dispatch ---------------------------------------------------------


class FakeResult:
    def __init__(self, kind: str, found: bool, detail: Any) -> None:
        self.kind, self.found, self.detail = kind, found, detail

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "found": self.found, "detail": self.detail}


@pytest.fixture
def fake_views(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Stand-ins for pushactors.logview.trace / summary / plot that record how they are called."""
    calls = SimpleNamespace(trace=[], summary=[], plot=[])

    def build_trace(events: list[Event], index: RequestIndex, query: str) -> FakeResult:
        ids = index.resolve(query)
        mine = [e.event for e in events if e.request_id in ids or e.d_request_id in ids]
        calls.trace.append((query, mine))
        return FakeResult("trace", bool(mine), mine)

    def summarize(events: list[Event]) -> FakeResult:
        calls.summary.append([e.event for e in events])
        return FakeResult("summary", True, len(events))

    def render(result: FakeResult, console: Console) -> None:
        console.print(f"{result.kind} of {result.detail}")

    modules = {
        "trace": {"build_trace": build_trace, "render_trace": render},
        "summary": {"summarize": summarize, "render_summary": render},
        "plot": {
            "plot_trace": lambda result, path: calls.plot.append(("trace", result.kind, path)),
            "plot_summary": lambda result, path: calls.plot.append(("summary", result.kind, path)),
        },
    }
    for name, attrs in modules.items():
        module = ModuleType(f"pushactors.logview.{name}")
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return calls


def test_trace_dispatch(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_views: SimpleNamespace) -> None:
    write_logs(tmp_path)
    assert main(["logs", str(tmp_path), "--trace", "req-7-0", "--plot", str(tmp_path / "t.html")]) == 0
    out, _ = capsys.readouterr()
    assert fake_views.trace == [("req-7-0", CAUSAL)]  # merged, corrected, sorted
    assert f"trace of {CAUSAL}" in out.replace("\n", "")
    assert fake_views.plot == [("trace", "trace", tmp_path / "t.html")]
    assert main(["logs", str(tmp_path), "--trace", "req-8-0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"kind": "trace", "found": True, "detail": ["write.refused", "recv.failed"]}
    assert main(["logs", str(tmp_path), "--trace", "req-9-0"]) == 1
    assert "no events for request req-9-0" in capsys.readouterr().err


def test_summary_dispatch(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_views: SimpleNamespace) -> None:
    write_logs(tmp_path)
    assert main(["logs", str(tmp_path), "--summary", "--rank", "decode"]) == 0
    assert fake_views.summary == [[e["event"] for e in d_log()]]  # filters narrow what is summarised
    assert "summary of 5" in capsys.readouterr().out
    assert main(["logs", str(tmp_path), "--summary", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"kind": "summary", "found": True, "detail": 12}
    assert main(["logs", str(tmp_path), "--plot", str(tmp_path / "s.png")]) == 0  # --plot alone: the summary
    assert fake_views.plot == [("summary", "summary", tmp_path / "s.png")]
    assert capsys.readouterr().out == ""
    assert main(["logs", str(tmp_path), "--summary", "--follow"]) == 2


def test_follow_trace_redraws_when_the_request_moves_on(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    fake_views: SimpleNamespace,
) -> None:
    p, d = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    p.write_text(lines(p_log()[:4]))
    d.write_text(lines(d_log()[:3]))
    _read_then(
        monkeypatch,
        {
            2: lambda: append(p, lines(p_log()[6:7])),  # another request's event: no redraw
            3: lambda: append(d, lines(d_log()[4:5])),
        },
    )
    args = ["logs", str(tmp_path), "--trace", D_ID, "--follow", "--for", "0.5", "--poll-interval", "0.05"]
    assert main(args) == 0
    assert [mine for _, mine in fake_views.trace] == [CAUSAL[:3], [*CAUSAL[:3], "recv.finished"]]
    assert capsys.readouterr().out.count("trace of") == 2


def test_real_trace_and_summary_of_the_synthetic_push(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_logs(tmp_path)
    assert main(["logs", str(tmp_path), "--trace", "req-7-0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["found"] is True
    assert main(["logs", str(tmp_path), "--summary", "--json"]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)
    assert main(["logs", str(tmp_path), "--trace", "req-9-0"]) == 1


def test_module_help_lists_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["logs", "--help"])
    out = capsys.readouterr().out
    for flag in ("--follow", "--request", "--trace", "--summary", "--plot", "--clock-reference", "--for"):
        assert flag in out
    assert logs_app.__doc__ is not None and "pushactors logs" in logs_app.__doc__


def test_a_line_without_end_is_skipped_not_buffered(tmp_path: Path) -> None:
    # A follower fed a binary file or a runaway writer must not hold an ever-growing "line".
    from pushactors.logview.source import MAX_LINE_BYTES, LogReader

    path = tmp_path / "odd.jsonl"
    good = json.dumps({"event": "write.posted", "ts": 1.0, "pid": 7, "actor": "writer"}).encode()
    path.write_bytes(good + b"\n" + b"x" * (MAX_LINE_BYTES + 10))
    reader = LogReader(path)
    assert [e.event for e in reader.read_new()] == ["write.posted"]
    with path.open("ab") as fh:
        fh.write(b"y" * (3 * MAX_LINE_BYTES))
    assert reader.read_new() == [] and reader.partial_bytes <= MAX_LINE_BYTES
    with path.open("ab") as fh:
        fh.write(b"z\n" + good.replace(b"write.posted", b"write.settled") + b"\n")
    got = reader.read_new()
    assert [(e.event, e.line) for e in got] == [("write.settled", 3)]
    assert reader.bad_lines == 1
