"""Loading a local HTML page in headless Chromium, for tests of the pages pushactors draws.

``rendered_dom(path)`` returns the DOM after the page's scripts ran (``--dump-dom``), so a test
can read what a script wrote into it (the plots set ``data-rendered`` and, on an error,
``data-error``). Without Chromium the calling test is skipped, or fails when
``PUSHACTORS_REQUIRE_BROWSER=1`` (CI installs it: ``.ci/bootstrap-browser``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

# What a sandboxed, offline machine needs: no background connections (refused here, many at a
# time), no sandbox as root, a fresh profile.
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium() -> str:
    """Chromium's path; skips (or, when required, fails) the calling test without it."""
    import pytest

    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("PUSHACTORS_REQUIRE_BROWSER") == "1":
            pytest.fail("PUSHACTORS_REQUIRE_BROWSER=1 but chromium is not installed")
        pytest.skip("chromium is not installed: the pages' scripts are not run (.ci/bootstrap-browser)")
    return path


def rendered_dom(page: Path, *, timeout: float = 120.0) -> str:
    """The DOM of ``page`` after its scripts ran in headless Chromium."""
    browser = chromium()
    profile = tempfile.mkdtemp(prefix="pushactors-chromium-")
    try:
        done = subprocess.run(
            [browser, *_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.resolve().as_uri()],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if done.returncode != 0:
        raise AssertionError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout
