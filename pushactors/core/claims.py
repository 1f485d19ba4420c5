"""Completions the writer reports itself: D's short path past the reaper's mailbox.

The lease-reaper owns D's request registry (:class:`~pushactors.core.ledger.DRegistry`) and is
the only one that changes it. A completion, though, is read off NIXL by the writer, and handing
it to the reaper costs a thread wake-up or two on the path to the first decode token. So the
writer may *take* a completion that settles its request on its own: the request is registered,
waits for one answer, from exactly the P rank the sender was verified as, for the live
generation, is not aborted, and is unstaged (a staged one still needs its scatter). The writer
then reports it received at once and tells the reaper, which *absorbs* the take (counts the
answer, drops the ledger) before anything else it does with the registry.

One lock makes the two agree. The reaper holds it whenever it reads or changes the registry, and
absorbs every take first; the writer only tries it and never waits (while the reaper holds it,
the completion goes the ordinary way, as a message). So a take is never judged against a
registry the reaper is changing, and the reaper never decides a request without knowing that
its completion was taken: each request has exactly one outcome, reported once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..protocol import PeerKey
from .ledger import DRegistry, DResult, rank_key


class CompletionClaims:
    """The writer's takes of D completions and the lock shared with the registry's owner."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registry: DRegistry | None = None
        self._taken: dict[str, tuple[PeerKey, int]] = {}  # D id -> (verified P rank, generation)

    def attach(self, registry: DRegistry) -> None:
        """The registry the takes are judged against (the reaper's, set once it exists)."""
        with self._lock:
            self._registry = registry

    # --- the writer ------------------------------------------------------------------------------
    def try_take(self, request_id: str, *, peer: PeerKey | None, generation: int) -> bool:
        """Take the completion of ``request_id`` from ``peer`` (verified) for ``generation``: True
        when it alone lands the request and nobody else holds the registry. The caller must
        then report the request received. Never blocks."""
        registry = self._registry
        if peer is None or registry is None:
            return False
        if not self._lock.acquire(blocking=False):
            return False  # the reaper is at the registry: the ordinary way
        try:
            if request_id in self._taken:
                return False  # a duplicate: the first one already spoke for this rank
            ledger = registry.ledgers.get(request_id)
            if ledger is None or not ledger.lands_with(rank_key(peer), generation):
                return False
            self._taken[request_id] = (peer, generation)
            return True
        finally:
            self._lock.release()

    # --- the registry's owner ----------------------------------------------------------------------
    @contextmanager
    def owned(self, now: float) -> Iterator[list[tuple[str, DResult]]]:
        """Hold the registry (no take is judged meanwhile) and absorb the takes so far first:
        yields ``(request id, result)`` for each, the result's report of that request made
        already by the writer (only its other actions are left to carry out). The list stays
        the caller's even when the body raises: what was absorbed must still be carried out."""
        with self._lock:
            absorbed: list[tuple[str, DResult]] = []
            registry = self._registry
            while self._taken and registry is not None:
                rid = next(iter(self._taken))
                peer, generation = self._taken.pop(rid)  # absorbed once, even if this raises
                landed = registry.notified(
                    rid, ok=True, peer=peer, final=True, reason="", now=now, generation=generation
                )
                absorbed.append((rid, landed))
            yield absorbed

    def pending(self) -> int:
        """Takes not absorbed yet."""
        return len(self._taken)
