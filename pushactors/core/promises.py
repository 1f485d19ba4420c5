"""P: D's latest promise for each served registration, the one fact the matcher shares with
the writer without a mailbox.

D's heartbeats renew a registration's deadline; the matcher resolves them and is the only
writer here (renewals, and removal when P forgets the request). The writer reads a deadline
just before each WRITE of a push, so a WRITE that waited in its mailbox (or a layer-wise push
that posts for as long as the forward runs) is judged by D's newest word, not its first. A
message would arrive too late for that read: the WRITE would already be posted.

Thread-safe: every call holds the lock for a dict operation or two, never longer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

# (P's request id, D rank, registration generation)
PromiseKey = tuple[str, int, int]


class Promises:
    """D's deadlines per served registration, on this rank's clock (see the module docstring).
    Written only by the matcher; read by the writer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: dict[PromiseKey, float] = {}

    # --- the matcher's side (the only writer) ---------------------------------------------------
    def renew(self, key: PromiseKey, deadline: float) -> None:
        """D promised ``key``'s blocks until ``deadline``: kept when later than what is known
        (heartbeats may be resolved out of order; a promise is never taken back by one)."""
        with self._lock:
            if deadline > self._deadlines.get(key, 0.0):
                self._deadlines[key] = deadline

    def forget(self, keys: Iterable[PromiseKey]) -> None:
        """P is done with these registrations: nothing will be posted for them any more."""
        with self._lock:
            for key in keys:
                self._deadlines.pop(key, None)

    # --- the writer's side (read only) ----------------------------------------------------------
    def deadline(self, key: PromiseKey) -> float:
        """D's newest deadline for ``key`` (0.0: no renewal heard)."""
        with self._lock:
            return self._deadlines.get(key, 0.0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._deadlines)
