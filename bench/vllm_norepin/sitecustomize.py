"""Put on PYTHONPATH of a vLLM server (bench/vllm_compare.py's ``+norepin`` modes): vLLM's NIXL
connector worker (``nixl/base_worker.py``) re-pins its process's main thread to the host's last
core on CPU, so on a 2-core host P's and D's workers share one core while pushactors' engines keep
one each. This turns exactly that call into a no-op (every other ``sched_setaffinity`` stands) and
says so once on stderr, so a log shows the run was labelled right.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_REPIN_SITE = os.path.join("kv_connector", "v1", "nixl", "base_worker.py")
_original = getattr(os, "sched_setaffinity", None)


def _sched_setaffinity(pid: int, mask: Any) -> None:
    caller = sys._getframe(1).f_code.co_filename
    if caller.endswith(_REPIN_SITE):
        print(f"[vllm_norepin] skipped vLLM NIXL re-pin of pid {pid or os.getpid()} to {sorted(mask)}", file=sys.stderr)
        return
    assert _original is not None
    _original(pid, mask)


if _original is not None:
    os.sched_setaffinity = _sched_setaffinity
