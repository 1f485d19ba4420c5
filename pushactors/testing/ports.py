"""Local TCP ports for test servers started in other processes.

A port from ``bind(0)`` lies in the OS's ephemeral range, which the kernel also hands to every
process's outgoing connections and ``bind(0)`` calls. Between choosing it and the server
binding it, a vLLM start-up (ZMQ sockets, torch's process group) can take it, and the server
then dies with "Address already in use". Ports here come from below that range instead, and
one process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_RANGE = (32768, 60999)
_LOWEST = 20000  # above the ports services commonly listen on


class Chooser(Protocol):
    def choice(self, seq: Sequence[int], /) -> int: ...


def bindable(port: int) -> bool:
    """Whether nothing listens on ``port`` on any local address now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))  # clashes with a listener on any local address
        except OSError:
            return False
    return True


class PortPicker:
    """Hands out ports, each once. The module's ``free_port`` uses one shared picker; tests build
    their own with a scripted ``rng``, a ``range_file`` or a ``bindable`` check."""

    def __init__(
        self,
        *,
        rng: Chooser | None = None,
        range_file: Path = RANGE_FILE,
        bindable: Callable[[int], bool] = bindable,
    ) -> None:
        # Unaffected by random.seed(): a test runner that reseeds every test would replay the ports.
        self._rng: Chooser = rng if rng is not None else random.SystemRandom()
        self._range_file = range_file
        self._bindable = bindable
        self._given: set[int] = set()

    @property
    def given(self) -> frozenset[int]:
        """The ports handed out so far."""
        return frozenset(self._given)

    def ephemeral_range(self) -> tuple[int, int]:
        """The OS's ephemeral port range (Linux's default where it cannot be read)."""
        try:
            low, high = (int(v) for v in self._range_file.read_text().split()[:2])
        except (OSError, ValueError):
            return LINUX_DEFAULT_RANGE
        return low, high

    def pool(self) -> range:
        """The ports this picker chooses from: below the ephemeral range where there is room."""
        low, high = self.ephemeral_range()
        if low - _LOWEST >= 1000:
            return range(_LOWEST, low)
        if 65535 - high >= 1000:
            return range(high + 1, 65536)
        return range(1024, 65536)  # an unusual range: any port that binds

    def free_port(self, attempts: int = 500) -> int:
        """A TCP port nothing is bound to now, outside the ephemeral range, not given out before
        by this picker."""
        pool = self.pool()
        for _ in range(attempts):
            port = self._rng.choice(pool)
            if port not in self._given and self._bindable(port):
                self._given.add(port)
                return port
        raise RuntimeError(f"no free TCP port found in {pool.start}-{pool.stop - 1} after {attempts} tries")


_picker = PortPicker()


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's default where it cannot be read)."""
    return _picker.ephemeral_range()


def free_port(attempts: int = 500) -> int:
    """A TCP port nothing is bound to now, outside the ephemeral range, not given out before
    by this process."""
    return _picker.free_port(attempts)
