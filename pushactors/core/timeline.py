"""The steps of each push on one rank's critical path, stamped in memory, not logged.

A debug log line costs the writer 0.05-0.1 ms on a GPU host: a breakdown of a sub-millisecond
push read from the logs mostly measures the logging. With ``PushConfig.timeline`` on, the writer
stamps a few named steps per request here instead (one uncontended lock each) and nothing is
written until someone takes them, off the critical path: ``pushactors bench layerwise
--timeline`` does, after its runs.

Steps, by the request id of the rank that stamps them (P's own id on P, D's on D):

* ``p.post_start`` / ``p.post_end``: P's writer posts the request's WRITE (layer-wise: the last
  layer group's, the one the completion rides on);
* ``p.digested``: a verified push's digest computed (while its WRITE flies) and sent;
* ``p.done``: the first check that saw that WRITE DONE (its completion leaves in that check);
* ``d.poll``, ``d.read``: D's writer began the poll that read the completion, and NIXL returned it
  (only for a completion the writer takes itself, core/claims.py: from the bound P rank, for the
  live generation; a forged, stale or duplicate one stamps nothing);
* ``d.verify_start``, ``d.verified``: D began and ended its check of a verified push (once every
  completion and digest is in);
* ``d.received``: D reported the request received.

The first stamp of a step wins. Only the latest ``capacity`` requests are kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

STEPS = (
    "p.post_start",
    "p.post_end",
    "p.digested",
    "p.done",
    "d.poll",
    "d.read",
    "d.verify_start",
    "d.verified",
    "d.received",
)


class Timeline:
    """Monotonic stamps of named steps per request (see the module docstring)."""

    def __init__(self, capacity: int = 4096) -> None:
        self._lock = threading.Lock()
        self._steps: OrderedDict[str, dict[str, float]] = OrderedDict()
        self.capacity = capacity
        self.dropped = 0  # requests pushed out by newer ones

    def mark(self, request_id: str, step: str, at: float) -> None:
        with self._lock:
            steps = self._steps.get(request_id)
            if steps is None:
                if len(self._steps) >= self.capacity:
                    self._steps.popitem(last=False)
                    self.dropped += 1
                steps = self._steps[request_id] = {}
            steps.setdefault(step, at)

    def take(self) -> dict[str, dict[str, float]]:
        """Every request's steps so far; the timeline starts empty again."""
        with self._lock:
            out = dict(self._steps)
            self._steps = OrderedDict()
            return out

    def __len__(self) -> int:
        return len(self._steps)
