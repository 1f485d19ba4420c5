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
    apart from how often the engine asks). ``sent_at``: the same for each P request in
    ``finished_sending``.
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: dict[str, str] = field(default_factory=dict)
    failed_sending: dict[str, str] = field(default_factory=dict)
    ended_at: dict[str, float] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)

    def __iter__(self):  # type: ignore[no-untyped-def]
        # Unpacks like vLLM's get_finished(): (sending, recving, failed recving).
        yield self.finished_sending
        yield self.finished_recving
        yield frozenset(self.failed_recving)

    @property
    def empty(self) -> bool:
        """Nothing finished or failed since the last report."""
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
        self._sent_at: dict[str, float] = {}

    def sent(self, request_id: str, *, ok: bool = True, reason: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            self._sent.add(request_id)
            self._sent_at.setdefault(request_id, now)
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
        if not (self._sent or self._recved or self._recv_failed):
            # Nothing to hand over (read without the lock: what is recorded during the read
            # goes with the next report).
            return FinishedReport()
        with self._lock:
            if not (self._sent or self._recved or self._recv_failed):
                return FinishedReport()
            report = FinishedReport(
                frozenset(self._sent),
                frozenset(self._recved - set(self._recv_failed)),
                dict(self._recv_failed),
                dict(self._send_failed),
                dict(self._ended_at),
                dict(self._sent_at),
            )
            self._ended_at.clear()
            self._sent_at.clear()
            self._sent.clear()
            self._send_failed.clear()
            self._recved.clear()
            self._recv_failed.clear()
            return report


class Metrics:
    """Named counters and latency samples, safe to record from any actor thread.

    Samples wait for one reader (:meth:`take_samples`, the vLLM stats hook); a process that
    never reads them keeps at most ``sample_cap`` per name and counts the rest as
    ``metrics.samples_dropped``, so memory stays bounded.
    """

    sample_cap = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._samples: dict[str, list[float]] = {}

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            samples = self._samples.setdefault(name, [])
            if len(samples) < self.sample_cap:
                samples.append(value)
            else:
                self._counts["metrics.samples_dropped"] += 1

    def take_samples(self) -> dict[str, list[float]]:
        """The samples recorded since the last call (and forget them)."""
        with self._lock:
            taken, self._samples = self._samples, {}
            return {k: v for k, v in taken.items() if v}


class HandOverClock:
    """When each request was handed to the rank's actors, so that its report yields the
    transport's latency: ``push.seconds`` (P: finished blocks handed over until the push
    settled and they may be freed) and ``recv.seconds`` (D: registration handed over until
    the KV landed). Successes only; failures are counted by reason elsewhere."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._lock = threading.Lock()
        self._handed: dict[str, float] = {}

    def handed(self, request_id: str, now: float) -> None:
        with self._lock:
            self._handed.setdefault(request_id, now)  # a re-stage keeps the first hand-over

    def settle(self, report: FinishedReport) -> None:
        """Record the latency of each request ``report`` ends (and forget them all)."""
        with self._lock:
            ended = (*report.finished_sending, *report.finished_recving, *report.failed_recving)
            started = {rid: self._handed.pop(rid, None) for rid in ended}
        for rid in report.finished_sending:
            start, at = started[rid], report.sent_at.get(rid)
            if start is not None and at is not None and rid not in report.failed_sending:
                self._metrics.observe("push.seconds", max(0.0, at - start))
        for rid in report.finished_recving:
            start, at = started[rid], report.ended_at.get(rid)
            if start is not None and at is not None:
                self._metrics.observe("recv.seconds", max(0.0, at - start))

    def clear(self) -> None:
        with self._lock:
            self._handed.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._handed)
