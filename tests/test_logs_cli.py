"""``pushactors logs`` as a user runs it, over logs of a real two-process run.

P and D run as separate processes over real NIXL (DRAM), each writing its own JSON log, and P's
wall clock runs 7.5 s ahead on purpose (as on a host with a badly set clock). The command runs
as a subprocess: merged time line, ``--follow`` on files that grow and appear, ``--trace`` of a
request that landed, one that failed and one still in flight, ``--summary`` and the plots.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from env_kit import repo_env

from pushactors.testing.browser import rendered_dom
from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec

pytestmark = pytest.mark.real_nixl

SKEW = 7.5  # seconds P's wall clock runs ahead
OK_REQUESTS = 6
ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = repo_env(COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "pushactors", "logs", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling under a deadline


def logged(path: Path, event: str, request_id: str) -> bool:
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        if f'"{event}"' in line and request_id in line:
            return True
    return False


class Run:
    """What the fixture did, for the tests to look up."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.p_log = root / "prefill" / "mailbox-prefill.jsonl"
        self.d_log = root / "decode" / "mailbox-decode.jsonl"
        self.ok: list[tuple[str, str, str]] = []  # (base, P id, D id)
        self.failed_d = ""
        self.stuck_d = ""
        self.received: dict[str, str | None] = {}


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    root = Path(tempfile.mkdtemp(prefix="pushactors-logs-"))
    result = Run(root)
    router = Dispatcher(seed=3)
    seen = threading.Condition()

    def on_event(event: Any) -> None:
        router.on_event(event)
        if event[0] == "received":
            with seen:
                result.received[event[1]] = event[2]
                seen.notify_all()

    spec = SimSpec(num_layers=2, num_blocks=256, block_bytes=4096)
    stats = {"stats_interval": 0.5}
    p = Node(
        NodeSpec(
            role="prefill",
            engine_id="prefill-0",
            sim=spec,
            config=stats,
            log_json=str(result.p_log),
            wall_clock_skew=SKEW,
        ),
        on_event=on_event,
    )
    d = Node(
        NodeSpec(role="decode", engine_id="decode-0", sim=spec, config=stats, log_json=str(result.d_log)),
        on_event=on_event,
    )
    try:
        p.wait_ready(timeout=180)
        d.wait_ready(timeout=180)
        for i in range(OK_REQUESTS):
            o = router.dispatch(p, d, i, 40 + 16 * i, transfer_id=f"tx-ok-{i}")
            result.ok.append((f"req-{i}-0", o.p_id, o.d_id))
        assert router.wait_all(timeout=120), "the requests did not finish"
        assert all(o.ok for o in router.outcomes), [(o.d_id, o.received) for o in router.outcomes]
        # Failed: two of P's requests claim one transfer id, so P cannot tell which KV D wants
        # and refuses D's registration.
        p.prefill("dup-a-0000000a", 32, "k-dup-a", "tx-dup", wait=True)
        p.prefill("dup-b-0000000b", 32, "k-dup-b", "tx-dup", wait=True)
        result.failed_d = "dup-0-0000000d"
        d.expect(result.failed_d, 32, p.decode_params("dup-0", "tx-dup"), "k-dup")
        with seen:
            assert seen.wait_for(lambda: result.failed_d in result.received, timeout=60), "the dup request"
        assert result.received[result.failed_d], "the ambiguous request should have failed"
        # In flight: D registered, P never runs the prefill.
        result.stuck_d = "stuck-0-0000000e"
        d.expect(result.stuck_d, 32, p.decode_params("stuck-0", "tx-stuck"), "k-stuck")
        wait_for(lambda: logged(result.p_log, "reg.stored", result.stuck_d), 60, "P to store the registration")
        # One more rank.stats on each side, and the sinks flushed.
        wait_for(lambda: logged(result.d_log, "rank.stats", ""), 30, "D's stats")
        yield result
    finally:
        for node in (p, d):
            node.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_merge_puts_both_processes_on_one_time_line(run: Run) -> None:
    out = cli(str(run.root), "--json")
    assert out.returncode == 0, out.stderr
    records = json_lines(out.stdout)
    assert {r["pid"] for r in records} and len({r["pid"] for r in records}) >= 2
    corrected = [r.get("ts_corrected", r["ts"]) for r in records]
    assert corrected == sorted(corrected), "not merged in time order"
    for _, p_id, d_id in run.ok:
        mine = [r for r in records if r.get("request_id") in (p_id, d_id)]

        def at(event: str, field: str = "ts_corrected", mine: list[dict[str, Any]] = mine) -> float:
            # The request's first event of that name, whichever id it is logged under (the
            # matcher names the request by D's id when the registration came last).
            r = next(r for r in mine if r["event"] == event)
            return float(r.get(field, r["ts"]))

        # P's raw stamps are SKEW ahead: uncorrected, P settles its WRITE seconds after D saw it land.
        assert at("write.settled", "ts") - at("recv.notified", "ts") > SKEW - 1.0
        # Corrected, cause precedes effect (within the handshake's error bound, ~1 ms here).
        assert at("reg.sent") <= at("reg.matched") + 0.05
        assert at("write.posted") - 0.05 <= at("recv.notified")
        assert abs(at("write.settled") - at("recv.notified")) < 1.0
    # D's events moved by the skew (P has the most events, so its clock is the reference).
    shifts = {round(r["ts_corrected"] - r["ts"], 1) for r in records if "ts_corrected" in r}
    assert shifts in ({SKEW}, {-SKEW}), shifts
    text = cli(str(run.root), "--no-color")
    assert "reference" in text.stderr and "+7500" in text.stderr.replace("+7499", "+7500"), text.stderr


def test_filters_select_one_request_across_processes(run: Run) -> None:
    base, p_id, d_id = run.ok[2]
    for query in (base, p_id, d_id, "tx-ok-2"):
        out = cli(str(run.p_log), str(run.d_log), "--json", "--request", query)
        assert out.returncode == 0, out.stderr
        ids = {r.get("request_id") for r in json_lines(out.stdout)}
        assert ids == {p_id, d_id}, (query, ids)
    out = cli(str(run.root), "--json", "--actor", "matcher", "--event", "reg.*")
    events = {r["event"] for r in json_lines(out.stdout)}
    assert events and all(e.startswith("reg.") for e in events)
    assert {r["actor"] for r in json_lines(out.stdout)} == {"matcher"}
    out = cli(str(run.root), "--json", "--level", "warning")
    assert all(r["level"] in ("warning", "error", "critical") for r in json_lines(out.stdout))
    plain = cli(str(run.root), "--request", base, "--no-color")
    assert plain.returncode == 0 and "write.posted" in plain.stdout and "\x1b[" not in plain.stdout


def test_follow_sees_lines_appended_and_files_that_appear(run: Run, tmp_path: Path) -> None:
    d_lines = run.d_log.read_text().splitlines(keepends=True)
    p_lines = run.p_log.read_text().splitlines(keepends=True)
    live = tmp_path / "live"
    live.mkdir()
    growing = live / "decode.jsonl"
    half = len(d_lines) // 2
    growing.write_text("".join(d_lines[:half]))
    env = repo_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pushactors", "logs", str(live), "--follow", "--json", "--for", "90"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    got: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: got.extend(json.loads(x) for x in proc.stdout if x.strip()))  # type: ignore[union-attr]
    reader.start()
    try:
        wait_for(lambda: len(got) >= half, 60, "the existing lines")
        with growing.open("a") as f:  # the file grows, the last line torn at first
            f.write("".join(d_lines[half:-1]))
            f.write(d_lines[-1][:10])
            f.flush()
            wait_for(lambda: len(got) >= len(d_lines) - 1, 60, "the appended lines")
            f.write(d_lines[-1][10:])
        (live / "later").mkdir()
        (live / "later" / "prefill.jsonl").write_text("".join(p_lines))  # a new process's file
        wait_for(lambda: len(got) >= len(d_lines) + len(p_lines), 60, "the file that appeared")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=30)
    assert len(got) == len(d_lines) + len(p_lines)
    assert {r["pid"] for r in got} == {json.loads(d_lines[0])["pid"], json.loads(p_lines[0])["pid"]}


def trace(run: Run, query: str, *extra: str) -> dict[str, Any]:
    out = cli(str(run.root), "--trace", query, "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_trace_of_a_request_that_landed(run: Run) -> None:
    base, p_id, d_id = run.ok[1]
    for query in (base, "tx-ok-1", p_id):
        t = trace(run, query)
        assert t["outcome"] == "landed", t
        assert {p_id, d_id} <= set(t["ids"])
        stages = {s["name"]: s for s in t["stages"]}
        assert set(stages) == {"registration", "match", "post", "settle", "notify"}
        assert all(s["duration_ms"] is not None and s["duration_ms"] >= -2.0 for s in stages.values()), stages
    text = cli(str(run.root), "--trace", base, "--no-color")
    assert text.returncode == 0 and "landed" in text.stdout.lower()
    for stage in ("registration", "match", "post", "settle", "notify"):
        assert stage in text.stdout


def test_trace_of_a_request_that_failed(run: Run) -> None:
    t = trace(run, run.failed_d)
    assert t["outcome"] == "failed", t
    assert "transfer id" in (t["reason"] or ""), t


def test_trace_of_a_request_still_in_flight(run: Run) -> None:
    t = trace(run, "stuck-0")
    assert t["outcome"] == "in flight", t
    assert run.stuck_d in t["ids"]
    assert "match" in t["waiting_on"], t


def test_trace_of_an_unknown_request_says_so(run: Run) -> None:
    out = cli(str(run.root), "--trace", "never-seen")
    assert out.returncode == 1 and "never-seen" in (out.stdout + out.stderr)


def test_summary_groups_stages_actors_and_failures(run: Run) -> None:
    out = cli(str(run.root), "--summary", "--json")
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    stages = s["stages"]
    assert stages["settle"]["count"] == OK_REQUESTS
    assert all(st["p50"] <= st["p99"] <= st["max"] for st in stages.values() if st["count"])
    assert {"writer", "matcher", "reaper"} <= {a["actor"] for a in s["actors"]}
    assert s["outcomes"]["landed"] == OK_REQUESTS and s["outcomes"]["failed"] >= 1
    assert s["outcomes"]["in flight"] >= 1
    assert any("transfer id" in f["example"] and run.failed_d in f["requests"] for f in s["failures"]), s["failures"]
    text = cli(str(run.root), "--summary", "--no-color")
    assert text.returncode == 0 and "settle" in text.stdout


def test_plots_of_a_trace_and_the_summary(run: Run, tmp_path: Path) -> None:
    base, _, _ = run.ok[0]
    html, png = tmp_path / "trace.html", tmp_path / "trace.png"
    for path in (html, png):
        out = cli(str(run.root), "--trace", base, "--plot", str(path))
        assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = rendered_dom(html)
    assert "data-error" not in dom, dom[-2000:]
    rendered = dom.split('data-rendered="', 1)[1].split('"', 1)[0]
    assert int(rendered) >= 10, rendered  # every hop of the request drawn
    summary_html = tmp_path / "summary.html"
    out = cli(str(run.root), "--summary", "--plot", str(summary_html))
    assert out.returncode == 0, out.stderr
    dom = rendered_dom(summary_html)
    assert "data-error" not in dom and int(dom.split('data-rendered="', 1)[1].split('"', 1)[0]) > 0
