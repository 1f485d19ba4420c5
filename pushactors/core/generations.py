"""Registration generations: which registration a message answers (SPEC §3).

A D rank mints one for every registration it sends, re-stages included: its incarnation (32
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
