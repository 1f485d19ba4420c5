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

The registry alone is not the whole truth, though: what the engine told the reaper and the
reaper has not applied yet (a re-stage with new blocks, an abort) waits in the reaper's
mailbox. A decision on the registry then would decide on a fact its owner has not applied,
and report a request landed whose current blocks never got its KV. So the engine *announces*
each such message here, synchronously and before it is sent, and the reaper counts it applied
in the same hold that applies it. While a request has announced messages not applied yet,
neither side decides it alone: the writer takes nothing for it (the completion goes the
ordinary way, behind them), and the registry reports nothing for it (``DRegistry.behind``);
the report waits until the engine's last word is applied.
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
        self._unapplied: dict[str, int] = {}  # D id -> engine messages the reaper has not applied

    @property
    def registry(self) -> DRegistry | None:
        """The registry attached (the reaper's), None before it exists."""
        return self._registry

    # --- the engine ------------------------------------------------------------------------------
    def announce(self, request_id: str, *, live: bool = False) -> bool:
        """The engine is about to tell the reaper something about ``request_id`` (a staging, a
        re-stage, an abort): until the reaper applies it, no completion of it is taken and it
        is not reported. ``live``: the engine believes the request is still waiting for its KV.
        False (nothing announced) when the registry has ended it already: its report is on its
        way to the engine, and the message must not be sent (a re-stage would register again
        a request that was reported)."""
        with self._lock:
            registry = self._registry
            ended = request_id in self._taken or (registry is not None and not registry.knows(request_id))
            if live and ended:
                return False
            self._unapplied[request_id] = self._unapplied.get(request_id, 0) + 1
            return True

    def attach(self, registry: DRegistry) -> None:
        """The registry the takes are judged against (the reaper's, set once it exists)."""
        with self._lock:
            self._registry = registry
            registry.behind = self._unapplied  # read (and changed) only under this lock

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
            if request_id in self._unapplied:
                return False  # the registry is behind the engine for this id: the reaper decides
            ledger = registry.ledgers.get(request_id)
            if ledger is None or not ledger.lands_with(rank_key(peer), generation):
                return False
            self._taken[request_id] = (peer, generation)
            return True
        finally:
            self._lock.release()

    # --- the registry's owner ----------------------------------------------------------------------
    @contextmanager
    def owned(self, now: float, *, applies: str | None = None) -> Iterator[list[tuple[str, DResult]]]:
        """Hold the registry (no take is judged meanwhile) and absorb the takes so far first:
        yields ``(request id, result)`` for each, the result's report of that request made
        already by the writer (only its other actions are left to carry out). The list stays
        the caller's even when the body raises: what was absorbed must still be carried out.
        ``applies``: the body applies one announced engine message about that id: it is counted
        applied first, in this hold (so the registry sees only what is still behind it, and a
        body that raises does not leave it announced for ever)."""
        with self._lock:
            if applies is not None:
                self._applied(applies)
            absorbed: list[tuple[str, DResult]] = []
            registry = self._registry
            while self._taken and registry is not None:
                rid = next(iter(self._taken))
                peer, generation = self._taken.pop(rid)  # absorbed once, even if this raises
                landed = registry.notified(
                    rid, ok=True, peer=peer, final=True, reason="", now=now, generation=generation, taken=True
                )
                absorbed.append((rid, landed))
            yield absorbed

    def _applied(self, request_id: str) -> None:
        left = self._unapplied.get(request_id, 0) - 1
        if left > 0:
            self._unapplied[request_id] = left
        else:
            self._unapplied.pop(request_id, None)

    def pending(self) -> int:
        """Takes not absorbed yet."""
        return len(self._taken)

    def unapplied(self) -> int:
        """Requests with engine messages announced and not applied by the reaper yet."""
        return len(self._unapplied)
