"""Child processes a test starts: their environment (this checkout's package first) and the JSON
logs they are still writing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def repo_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with this checkout first on ``PYTHONPATH`` and ``extra`` set. The parent's
    own ``PYTHONPATH`` stays after it: dependencies installed by path (``pip --target``) must
    reach the child too, or it fails to import them on a host set up that way."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def written_events(path: Path) -> list[dict[str, Any]]:
    """The events of a JSON-lines log another process may still be writing: every complete
    line (a last one without its newline yet is left for the next read)."""
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
