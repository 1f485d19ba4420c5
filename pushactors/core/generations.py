"""Registration generations: which registration a message answers (docs/protocol.md,
'Generations and deadlines').

A D rank mints one for every registration it sends, re-stages included: its incarnation (31
random bits, new each time the rank starts) above a counter. Two uses of one request id, two
stagings of one request, or the same id across a restart never share one, and within one
incarnation a later registration has a larger generation, so a receiver can tell a late copy
of an earlier registration from a newer one.
"""

from __future__ import annotations

import secrets
import threading

COUNTER_BITS = 32


class GenerationMint:
    """The generations of one D rank (thread-safe)."""

    def __init__(self, incarnation: int | None = None) -> None:
        self._lock = threading.Lock()
        self.incarnation = incarnation if incarnation else self._fresh()
        self._count = 0

    @staticmethod
    def _fresh() -> int:
        return secrets.randbits(COUNTER_BITS - 1) or 1  # generations stay below 2**63

    def next(self) -> int:
        with self._lock:
            self._count += 1
            if self._count >> COUNTER_BITS:
                # 2^32 registrations: a new incarnation, so no generation is ever minted twice.
                self.incarnation, self._count = self._fresh(), 1
            return (self.incarnation << COUNTER_BITS) | self._count


def incarnation_of(generation: int) -> int:
    return generation >> COUNTER_BITS


class ReplayWindow:
    """Which generations of one D incarnation a P rank has already taken (an anti-replay
    window, as IPsec keeps for sequence numbers): the newest one seen and a bitmask of the
    ``size`` below it. Constant memory, however many registrations went by: a late, duplicated
    or replayed copy of one P took before is recognised without a tombstone per request.

    Generations arrive in any order (D mints them for every P rank it registers with, so each
    P rank sees gaps): one not seen yet inside the window is new. One older than the window
    cannot be told from a copy and is refused (visibly: the answer names its generation, so D
    fails it if it was live, or drops the answer if it was a copy)."""

    def __init__(self, size: int = 1 << 16, floor: int = 0) -> None:
        self.size = size
        self.floor = floor  # generations at or below it are too old, whatever the mask says
        self.newest = 0
        self._mask = 0  # bit k: generation ``newest - k`` was seen

    def check(self, generation: int) -> str:
        """ "new", "seen" or "too_old" (nothing is recorded)."""
        if generation <= self.floor:
            return "too_old"
        if generation > self.newest:
            return "new"
        back = self.newest - generation
        if back >= self.size:
            return "too_old"
        return "seen" if (self._mask >> back) & 1 else "new"

    def mark(self, generation: int) -> None:
        if generation > self.newest:
            shift = generation - self.newest
            self._mask = ((self._mask << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            self.newest = generation
            return
        back = self.newest - generation
        if back < self.size:
            self._mask |= 1 << back


class ReplayWindows:
    """One :class:`ReplayWindow` per (registering agent, D incarnation), the least recently
    used dropped past ``max_peers``. Once one was dropped, a window made afresh treats every
    generation below its first as too old: a forgotten peer's late copies are refused, never
    taken for new."""

    def __init__(self, size: int = 1 << 16, max_peers: int = 4096) -> None:
        self.size = size
        self.max_peers = max_peers
        self._windows: dict[tuple[str, int], ReplayWindow] = {}
        self.dropped = 0

    def _window(self, sender: str, generation: int) -> ReplayWindow | None:
        key = (sender, incarnation_of(generation))
        window = self._windows.pop(key, None)
        if window is not None:
            self._windows[key] = window  # most recently used last
        return window

    def check(self, sender: str, generation: int) -> str:
        window = self._window(sender, generation)
        if window is None:
            return "new"
        return window.check(generation)

    def mark(self, sender: str, generation: int) -> None:
        key = (sender, incarnation_of(generation))
        window = self._window(sender, generation)
        if window is None:
            floor = generation - 1 if self.dropped else 0
            window = self._windows[key] = ReplayWindow(self.size, floor)
            while len(self._windows) > self.max_peers:
                del self._windows[next(iter(self._windows))]
                self.dropped += 1
        window.mark(generation)

    def __len__(self) -> int:
        return len(self._windows)
