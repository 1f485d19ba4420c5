"""The shipped example runs as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_embed_worker_example_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_worker.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "every byte matches" in out.stdout
    assert "D's blocks were never written" in out.stdout  # the abort part
    log = tmp_path / "runs" / "example" / "mailbox.jsonl"
    assert log.exists() and log.stat().st_size > 0


def test_the_integration_test_example_passes(tmp_path: Path) -> None:
    """docs/testing.md's example: a user's actor-level tests with the kit, run as a user would."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(ROOT / "examples" / "test_my_integration.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "5 passed" in out.stdout


@pytest.mark.real_nixl
def test_embed_nixl_example_pushes_and_aborts_over_real_nixl(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_nixl.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "every byte matches" in out.stdout
    assert "aborted req-2 on D: reported failed" in out.stdout
    assert "were never written" in out.stdout
