"""D's side of the writer's books, as plain state (no NIXL, no threads).

What a D rank waits to hear from P ranks: which registrations went out and are still awaited
(the writer polls tightly while any is), which P rank owes an answer for which request (that
rank is busy, never evicted, and its agent name stays bound to it), and which dead-or-alive
checks of a P rank to ask again, and when.
"""

from __future__ import annotations

from ...protocol import PeerKey
from .remotes import CheckDeath


class Answers:
    """Registrations awaited, answers owed per P rank, and death checks to repeat."""

    def __init__(self, *, poll_await: float, horizon: float) -> None:
        self.poll_await = poll_await  # how long a sent registration keeps polling tight
        self.horizon = horizon  # past its watchdog and quarantine a D request has ended
        # request id -> when to stop polling tightly for its answer
        self.awaiting: dict[str, float] = {}
        # P rank -> {request id: when its registration went there}
        self.expecting: dict[PeerKey, dict[str, float]] = {}
        # P rank -> (when to ask again, the check)
        self.death_retries: dict[PeerKey, tuple[float, CheckDeath]] = {}

    def sent(self, peer: PeerKey, request_id: str, now: float) -> None:
        """A registration went out to ``peer``: await its answer and hold the rank bound."""
        if self.poll_await > 0:
            self.awaiting[request_id] = now + self.poll_await
        self.expecting.setdefault(peer, {})[request_id] = now

    def heard(self, request_id: str) -> None:
        """Something answered ``request_id`` (or D gave up on it): stop polling tightly."""
        self.awaiting.pop(request_id, None)

    def answered(self, peer: PeerKey, request_id: str) -> None:
        waiting = self.expecting.get(peer)
        if waiting is not None:
            waiting.pop(request_id, None)
            if not waiting:
                del self.expecting[peer]

    def owed_by(self, peer: PeerKey) -> tuple[str, ...]:
        """The requests ``peer`` owed an answer for; the peer owes nothing afterwards."""
        return tuple(self.expecting.pop(peer, {}))

    def prune(self, now: float) -> None:
        for rid in [r for r, until in self.awaiting.items() if until <= now]:
            del self.awaiting[rid]  # back to idle polling; the reaper's watchdog bounds the request
        cutoff = now - self.horizon
        for peer in list(self.expecting):
            waiting = self.expecting[peer]
            for rid in [r for r, at in waiting.items() if at < cutoff]:
                del waiting[rid]
            if not waiting:
                del self.expecting[peer]

    def retry_later(self, check: CheckDeath, due: float) -> None:
        self.death_retries[check.peer] = (due, check)

    def cancel_retry(self, peer: PeerKey) -> None:
        self.death_retries.pop(peer, None)

    def due_checks(self, now: float) -> list[CheckDeath]:
        due = [check for at, check in self.death_retries.values() if now >= at]
        for check in due:
            del self.death_retries[check.peer]
        return due

    def busy(self) -> set[PeerKey]:
        return set(self.expecting)

    def sizes(self) -> dict[str, int]:
        return {
            "answers_awaited": len(self.awaiting),
            # Bounded by age, not emptied by every end: a request whose answer was lost is
            # dropped here after registration_timeout + abort_quarantine.
            "answers_expected": sum(len(w) for w in self.expecting.values()),
        }
