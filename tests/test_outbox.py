"""The outbox's record of when this rank knew a D request's outcome (``ended_at``)."""

from __future__ import annotations

import time

from pushactors.core.outbox import Outbox


def test_ended_at_is_when_the_outcome_was_known_once_per_report() -> None:
    """Landed and failed receives carry the moment the transport knew (not when the engine
    asked); a second report of the same id keeps the first moment; a drain hands them over
    once, and P's sends carry none."""
    box = Outbox()
    before = time.monotonic()
    box.received("d-ok")
    box.recv_failed("d-bad", "lost")
    box.sent("p-1")
    middle = time.monotonic()
    box.received("d-ok")  # reported again: the first moment stands
    report = box.drain()
    assert set(report.ended_at) == {"d-ok", "d-bad"}
    assert all(before <= t <= middle for t in report.ended_at.values())
    assert report.finished_recving == frozenset({"d-ok"}) and report.failed_recving == {"d-bad": "lost"}
    assert box.drain().ended_at == {}
