"""``log_json`` rotation by size: the sink never splits or loses a line, keeps ``backups`` files,
and ``pushactors logs`` / ``pushactors top`` read a rotated set as one log, oldest first, also
while it rotates under a follower."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import msgspec
import pytest

from pushactors.apps.cli import main
from pushactors.core.config import PushConfig
from pushactors.logs import JsonLinesSink, configure_logging, get_logger, remove_sink, rotated_path
from pushactors.logview.source import LogSet, expand

RANK = "prefill-0/pp0/tp0"


def event(i: int, pad: int = 0) -> dict[str, object]:
    return {
        "event": "push.finished",
        "ts": 1000.0 + i,
        "pid": 7,
        "rank": RANK,
        "actor": "writer",
        "i": i,
        "pad": "x" * pad,
    }


def lines_of(path: Path) -> list[dict[str, object]]:
    raw = path.read_bytes()
    assert raw.endswith(b"\n"), f"{path.name} ends inside a line"
    return [json.loads(line) for line in raw.splitlines()]


def the_set(base: Path, backups: int) -> list[Path]:
    """The rotated set oldest first, as the sink names it."""
    rotated = [rotated_path(base, i) for i in range(backups, 0, -1)]
    return [p for p in rotated if p.exists()] + [base]


def test_sink_rotates_between_whole_lines_and_keeps_every_event(tmp_path: Path) -> None:
    base = tmp_path / "push.jsonl"
    sink = JsonLinesSink(base, max_bytes=1000, backups=50)
    for i in range(200):
        sink(event(i, pad=i % 37))  # lines of varied length: rotation points fall anywhere
    sink.close()
    files = the_set(base, 50)
    assert sink.rotations == len(files) - 1 >= 10
    got = []
    for path in files:
        assert path.stat().st_size <= 1000, f"{path.name} grew past max_bytes"
        got.extend(e["i"] for e in lines_of(path))
    assert got == list(range(200))  # nothing lost, nothing twice, oldest file first


def test_only_backups_files_are_kept_the_newest_events(tmp_path: Path) -> None:
    base = tmp_path / "push.jsonl"
    sink = JsonLinesSink(base, max_bytes=400, backups=2)
    for i in range(100):
        sink(event(i))
    sink.close()
    assert not rotated_path(base, 3).exists()
    files = the_set(base, 2)
    assert files == [rotated_path(base, 2), rotated_path(base, 1), base]
    kept = [e["i"] for path in files for e in lines_of(path)]
    assert kept == list(range(100 - len(kept), 100))  # a contiguous run of the newest


def test_a_line_longer_than_max_bytes_gets_a_file_of_its_own(tmp_path: Path) -> None:
    base = tmp_path / "push.jsonl"
    sink = JsonLinesSink(base, max_bytes=200, backups=3)
    sink(event(0))
    sink(event(1, pad=500))
    sink(event(2))
    sink.close()
    assert [[e["i"] for e in lines_of(p)] for p in the_set(base, 3)] == [[0], [1], [2]]


def test_rotation_under_concurrent_writers_splits_no_line(tmp_path: Path) -> None:
    base = tmp_path / "push.jsonl"
    sink = JsonLinesSink(base, max_bytes=2000, backups=1000, flush_interval=0.001)

    def write(thread: int) -> None:
        for i in range(300):
            sink(event(thread * 1000 + i, pad=i % 11))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sink.close()
    got = sorted(e["i"] for p in the_set(base, 1000) for e in lines_of(p))
    assert got == sorted(t * 1000 + i for t in range(4) for i in range(300))


def test_an_existing_file_counts_toward_the_limit(tmp_path: Path) -> None:
    base = tmp_path / "push.jsonl"
    base.write_bytes(b"x" * 950 + b"\n")  # an earlier run's log
    sink = JsonLinesSink(base, max_bytes=1000, backups=2)
    sink(event(0))
    sink.close()
    assert rotated_path(base, 1).read_bytes() == b"x" * 950 + b"\n"
    assert [e["i"] for e in lines_of(base)] == [0]


def test_bad_rotation_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backups >= 1"):
        JsonLinesSink(tmp_path / "a.jsonl", max_bytes=100, backups=0)
    with pytest.raises(ValueError, match="max_bytes >= 0"):
        JsonLinesSink(tmp_path / "b.jsonl", max_bytes=-1)
    with pytest.raises(msgspec.ValidationError, match="log_backups"):
        msgspec.convert({"engine_id": "e", "log_backups": 0}, PushConfig)
    assert PushConfig(engine_id="e").log_max_bytes > 0  # rotation is on unless turned off


def test_configure_logging_rotates_what_the_actors_log(tmp_path: Path) -> None:
    base = tmp_path / "run.jsonl"
    sink = configure_logging(json_path=base, max_bytes=600, backups=20)
    assert sink is not None
    try:
        log = get_logger(actor="writer", rank=RANK)
        for i in range(40):
            log.info("push.finished", i=i)
    finally:
        remove_sink(sink)
        sink.close()
    assert sink.rotations >= 3
    mine = [e["i"] for p in the_set(base, 20) for e in lines_of(p) if e.get("rank") == RANK]
    assert mine == list(range(40))


# --------------------------------------------------------------------------------------------
# Readers
# --------------------------------------------------------------------------------------------
def write_rotated(base: Path, count: int, *, max_bytes: int = 500, backups: int = 20) -> JsonLinesSink:
    sink = JsonLinesSink(base, max_bytes=max_bytes, backups=backups)
    for i in range(count):
        sink(event(i))
    sink.flush()
    return sink


def test_a_base_path_reads_the_rotated_set_oldest_first(tmp_path: Path) -> None:
    base = tmp_path / "push.jsonl"
    write_rotated(base, 60).close()
    assert rotated_path(base, 3).exists()
    events = LogSet([str(base)]).read_all()
    assert [e.record["i"] for e in events] == list(range(60))


@pytest.mark.parametrize("how", ["rotated file", "glob of all", "directory"])
def test_any_name_of_a_set_reads_it_once(tmp_path: Path, how: str) -> None:
    base = tmp_path / "push.jsonl"
    write_rotated(base, 60).close()
    arg = {
        "rotated file": str(rotated_path(base, 2)),
        "glob of all": str(tmp_path / "push.*"),
        "directory": str(tmp_path),
    }[how]
    assert expand([arg]) == [base]
    assert [e.record["i"] for e in LogSet([arg]).read_all()] == list(range(60))


def test_only_rotated_files_left_are_still_read(tmp_path: Path) -> None:
    base = tmp_path / "push.jsonl"
    write_rotated(base, 30).close()
    base.unlink()  # the process is gone and so is its current file
    kept = [e.record["i"] for e in LogSet([str(base)]).read_all()]
    assert kept and kept == list(range(kept[0], kept[-1] + 1))
    assert [e.record["i"] for e in LogSet([str(tmp_path)]).read_all()] == kept


def test_a_follower_reads_the_rest_of_a_file_rotated_under_it(tmp_path: Path) -> None:
    base = tmp_path / "push.jsonl"
    sink = JsonLinesSink(base, max_bytes=1200, backups=10)
    follower = LogSet([str(base)], follow=True)
    seen: list[object] = []
    i = 0
    for burst in (3, 5, 1, 17, 2, 30, 4):  # rotations land between polls, one or several at once
        for _ in range(burst):
            sink(event(i))
            i += 1
        sink.flush()
        seen.extend(e.record["i"] for e in follower.poll())
    sink.close()
    seen.extend(e.record["i"] for e in follower.poll())
    assert sink.rotations >= 3
    assert seen == list(range(i))


def test_logs_cli_reads_the_rotated_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "push.jsonl"
    write_rotated(base, 40).close()
    assert main(["logs", str(base), "--json"]) == 0
    shown = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert [e["i"] for e in shown] == list(range(40))


def test_top_counts_events_of_the_whole_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "push.jsonl"
    now = time.time()
    sink = JsonLinesSink(base, max_bytes=500, backups=20)
    for i in range(12):
        sink({**event(i), "ts": now - 1 + i * 0.05, "outcome": "pushed"})
    sink.close()
    assert rotated_path(base, 2).exists()
    assert main(["top", str(base), "--once", "--json"]) == 0
    (doc,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert doc["files"] == 1 and doc["pushed"] == 12
