"""Where actors leave results for the engine thread, and the rank's counters.

The engine thread must never wait on an actor, so results do not come back as replies: actors
record them here and :meth:`Outbox.drain` hands them over on the next ``get_finished``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FinishedReport:
    """What finished since the last report.

    ``finished_sending``: P requests whose blocks may be freed (pushed, expired or failed;
    the failed ones are also in ``failed_sending`` with a reason). ``finished_recving``: D
    requests whose KV landed. ``failed_recving``: D requests that will get no (complete) KV,
    with a reason; their blocks hold garbage. ``ended_at``: for each D request in either, the
    ``time.monotonic()`` at which this rank knew its outcome (the transport's own latency,
    apart from how often the engine asks).
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: dict[str, str] = field(default_factory=dict)
    failed_sending: dict[str, str] = field(default_factory=dict)
    ended_at: dict[str, float] = field(default_factory=dict)

    def __iter__(self):  # type: ignore[no-untyped-def]
        # Unpacks like vLLM's get_finished(): (sending, recving, failed recving).
        yield self.finished_sending
        yield self.finished_recving
        yield frozenset(self.failed_recving)

    @property
    def empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


class Outbox:
    """Thread-safe hand-over of finished ids from actors to the engine thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._send_failed: dict[str, str] = {}
        self._recved: set[str] = set()
        self._recv_failed: dict[str, str] = {}
        self._ended_at: dict[str, float] = {}

    def sent(self, request_id: str, *, ok: bool = True, reason: str = "") -> None:
        with self._lock:
            self._sent.add(request_id)
            if not ok:
                self._send_failed[request_id] = reason or "failed"

    def received(self, request_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._recved.add(request_id)
            self._ended_at.setdefault(request_id, now)

    def recv_failed(self, request_id: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._recv_failed[request_id] = reason
            self._ended_at.setdefault(request_id, now)

    def drain(self) -> FinishedReport:
        with self._lock:
            if not (self._sent or self._recved or self._recv_failed):
                return FinishedReport()
            report = FinishedReport(
                frozenset(self._sent),
                frozenset(self._recved - set(self._recv_failed)),
                dict(self._recv_failed),
                dict(self._send_failed),
                dict(self._ended_at),
            )
            self._ended_at.clear()
            self._sent.clear()
            self._send_failed.clear()
            self._recved.clear()
            self._recv_failed.clear()
            return report


class Metrics:
    """Named counters, safe to bump from any actor thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
