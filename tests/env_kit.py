"""The environment of a child Python process that a test starts with this checkout's package."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def repo_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout first on ``PYTHONPATH`` and ``extra`` set. The parent's
    own ``PYTHONPATH`` stays after it: dependencies installed by path (``pip --target``) must
    reach the child too, or it fails to import them on a host set up that way."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
