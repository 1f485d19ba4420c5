"""Progress of long runs: on stderr only, a transient bar on a terminal, sparse plain lines
elsewhere; stdout keeps exactly the run's result."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from env_kit import repo_env

from pushactors.apps import progress
from pushactors.apps.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(progress, "time", fake)
    return fake


def test_off_a_terminal_at_most_one_line_per_period(clock: FakeClock) -> None:
    out = io.StringIO()
    with Progress("demo", total=100, stream=out, every=5.0) as p:
        assert not p.on_terminal
        for i in range(1, 101):
            clock.now += 0.125  # 12.5 s in all
            p.update(i, f"{i % 7} in flight")
    lines = out.getvalue().splitlines()
    assert lines == ["  … demo: 40/100 done, 5 in flight", "  … demo: 80/100 done, 3 in flight"]


def test_short_runs_and_disabled_progress_print_nothing(clock: FakeClock) -> None:
    out = io.StringIO()
    with Progress("demo", total=3, stream=out) as p:
        for i in range(3):
            clock.now += 0.5
            p.update(i + 1)
    with Progress("demo", total=3, stream=out, enabled=False, every=0.0) as p:
        p.update(1)
        p.note("kept back")
    assert out.getvalue() == ""


def test_stages_and_notes_without_a_terminal(clock: FakeClock, capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    with Progress("bench dram", stream=out, every=1.0) as p:
        progress.stage("pushactors hnd", total=4)
        progress.note("[bench] pushactors hnd: P and D nodes")
        clock.now += 2
        progress.update(2, "round 1")
        assert (p.description, p.total, p.completed) == ("pushactors hnd", 4, 2)
    assert out.getvalue().splitlines() == [
        "[bench] pushactors hnd: P and D nodes",
        "  … pushactors hnd: 2/4 done, round 1",
    ]
    progress.note("no progress active: straight to stderr")
    progress.update(5)  # nothing to update: ignored
    assert capsys.readouterr().err == "no progress active: straight to stderr\n"


def test_on_a_terminal_a_transient_bar() -> None:
    term = Terminal()
    with Progress("demo", total=10, stream=term) as p:
        assert p.on_terminal
        p.update(4, "2 in flight")
        p.note("P pid 1, D pid 2")
        p.stage("next case")  # no total: counts without a bar length
        p.update(3)
    text = term.getvalue()
    plain = ANSI.sub("", text)
    assert "P pid 1, D pid 2" in plain and "demo" in plain
    assert text.rstrip("\r\n").endswith("\x1b[2K")  # erased at the end


def run_demo(tmp_path: Path) -> list[str]:
    demo = [sys.executable, "-m", "pushactors", "demo", "--fabric", "fake", "--requests", "30"]
    return [*demo, "--max-tokens", "512", "--log-dir", str(tmp_path / "logs")]


def expected_summary(stdout: str) -> None:
    lines = stdout.splitlines()
    assert lines[0] == "pushactors demo (in-process, fake NIXL fabric)", stdout
    assert lines[1].startswith("  requests      30   finished 30   failed 0"), stdout
    assert lines[-2].startswith("  mailbox log   "), stdout
    assert lines[-1] == "  RESULT        OK: every byte verified", stdout
    assert len(lines) == 7, stdout
    assert "\x1b" not in stdout and "…" not in stdout


def test_piped_demo_keeps_stdout_to_the_summary(tmp_path: Path) -> None:
    env = repo_env()
    done = subprocess.run(
        run_demo(tmp_path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    expected_summary(done.stdout)
    assert "\x1b" not in done.stderr
    assert len(done.stderr.splitlines()) <= 3, done.stderr  # a few seconds' run: a line or two at most


def test_demo_on_a_terminal_shows_a_bar_then_an_intact_summary(tmp_path: Path) -> None:
    env = repo_env(TERM="xterm-256color", COLUMNS="120", LINES="40")
    master, slave = pty.openpty()
    proc = subprocess.Popen(run_demo(tmp_path), cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    raw = b""
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer of the pty is gone
                    break
                if not chunk:
                    break
                raw += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=30) == 0, raw.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = raw.decode(errors="replace")
    frames: Any = ANSI.sub("", text).replace("\r\n", "\n").split("\n")
    bars = [f for line in frames for f in line.split("\r") if "demo ━" in f]
    assert bars and re.search(r"\d+/30", bars[-1]), text[-2000:]  # the bar, counting up to 30
    # Everything after the bar's last erase is the summary, whole and without escapes.
    tail = text[text.rindex("\x1b[2K") + len("\x1b[2K") :]
    expected_summary(tail.replace("\r\n", "\n"))
