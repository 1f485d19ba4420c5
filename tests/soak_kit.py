"""What the fake soak watches from outside the library: WRITEs and notifications on the fake
fabric (passive fault rules that never fire), and D's re-stage events.

A rule of a :class:`FaultPlan` sees each event of its kind before anything is done to it, so a
rule that answers False observes without changing anything. Only the first rule of a kind is
sure to see every event (the plan stops at the first that fires), so a :class:`FabricWatch`
is made before the soak arms its faults.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pushactors.logs import add_sink, remove_sink
from pushactors.protocol import (
    ABORT_PREFIX,
    Abort,
    Completion,
    MalformedMessage,
    Registration,
    decode_notification,
)
from pushactors.testing.faults import FaultContext, FaultPlan, Match

SEALED = b"PAMAC1:"  # an authenticated notification: PAMAC1:<key id>:<ms>:<tag>:<payload>


def payload_of(notif: bytes) -> bytes:
    """The message inside a notification, sealed (auth) or not."""
    if notif.startswith(SEALED):
        parts = notif.split(b":", 4)
        return parts[4] if len(parts) == 5 else b""
    return notif


def abort_of(d_request_id: str) -> Match:
    """A match on D's aborts of ``d_request_id`` on their way to P."""

    def match(ctx: FaultContext) -> bool:
        body = payload_of(ctx.notif)
        if not body.startswith(ABORT_PREFIX):
            return False
        try:
            msg = decode_notification(body)
        except MalformedMessage:
            return False
        return isinstance(msg, Abort) and msg.request_id == d_request_id

    return match


def completion_for(d_request_id: str) -> Match:
    """A match on the WRITE (or notification) that carries P's completion for ``d_request_id``."""

    def match(ctx: FaultContext) -> bool:
        body = payload_of(ctx.notif)
        if not body or body.startswith((b"PUSH_", b"HB")):
            return False
        try:
            msg = decode_notification(body)
        except MalformedMessage:
            return False
        return isinstance(msg, Completion) and msg.request_id == d_request_id

    return match


class FabricWatch:
    """When, for each watched D request id, the first WRITE carrying its completion was posted
    (accepted by the fabric), the first such WRITE landed (its notification leaves only once
    its bytes are in D's blocks), and its first registration left for P. Times are
    ``time.time()``, the clock of the library's events. A layer-wise push's earlier WRITEs
    carry no completion: only its last one is seen."""

    def __init__(self, plan: FaultPlan) -> None:
        # Changed by the soak's thread, read by the fabric's callers: single set and dict
        # operations, atomic under the GIL (nothing iterates them).
        self._watched: set[str] = set()
        self.posted: dict[str, float] = {}
        self.landed: dict[str, float] = {}
        self.registered: dict[str, float] = {}
        plan.hold_transfer(self._on_post, times=None)  # asked last on a post: it was not refused
        plan.drop_notif(self._on_notif, times=None)

    def watch(self, d_request_id: str) -> None:
        for seen in (self.posted, self.landed, self.registered):
            seen.pop(d_request_id, None)  # an earlier use of the id
        self._watched.add(d_request_id)

    def unwatch(self, d_request_id: str) -> tuple[float | None, float | None]:
        """Stop watching; (posted, landed) as seen while watched."""
        self._watched.discard(d_request_id)
        self.registered.pop(d_request_id, None)
        return self.posted.pop(d_request_id, None), self.landed.pop(d_request_id, None)

    def _decoded(self, notif: bytes) -> Any:
        if not self._watched or not notif:
            return None
        body = payload_of(notif)
        if body.startswith((b"HB", b"PUSH_FAIL", ABORT_PREFIX)):
            return None
        try:
            msg = decode_notification(body)
        except MalformedMessage:
            return None
        return msg if msg.request_id in self._watched else None  # type: ignore[union-attr]

    def _on_post(self, ctx: FaultContext) -> bool:
        msg = self._decoded(ctx.notif)
        if isinstance(msg, Completion):
            self.posted.setdefault(msg.request_id, time.time())
        return False

    def _on_notif(self, ctx: FaultContext) -> bool:
        msg = self._decoded(ctx.notif)
        if isinstance(msg, Completion):
            self.landed.setdefault(msg.request_id, time.time())
        elif isinstance(msg, Registration):
            self.registered.setdefault(msg.request_id, time.time())
        return False


@dataclass(frozen=True)
class Restaged:
    """D's reaper applied a re-stage: when its handler began, how long it waited in the mailbox."""

    applied: float
    waited_ms: float


class RestageEvents:
    """D's re-stage events, by request id: ``recv.restaged`` (the reaper applied a re-stage of
    a live request) and ``recv.restaged_after_end`` (the worker found it ended already)."""

    def __init__(self) -> None:
        self.applied: dict[str, list[Restaged]] = {}
        self.after_end: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, event: dict[str, Any]) -> None:
        name = event.get("event")
        if name not in ("recv.restaged", "recv.restaged_after_end"):
            return
        rid = str(event.get("request_id"))
        with self._lock:
            if name == "recv.restaged_after_end":
                self.after_end.add(rid)
                return
            # The event is written once the handler ran: it began handle_ms earlier.
            began = float(event["ts"]) - float(event.get("handle_ms", 0.0)) / 1e3
            self.applied.setdefault(rid, []).append(Restaged(began, float(event.get("wait_ms", 0.0))))

    def first_after(self, rid: str, since: float) -> Restaged | None:
        with self._lock:
            return next((e for e in self.applied.get(rid, ()) if e.applied >= since), None)


@contextmanager
def restage_events() -> Iterator[RestageEvents]:
    events = RestageEvents()
    add_sink(events, "warning")  # both are warnings: no debug event is built for this
    try:
        yield events
    finally:
        remove_sink(events)
