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
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # above the ports services commonly listen on
_given: set[int] = set()
# Unaffected by random.seed(): a test runner that reseeds every test would replay the ports.
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in _RANGE_FILE.read_text().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _pool() -> range:
    low, high = ephemeral_range()
    if low - _LOWEST >= 1000:
        return range(_LOWEST, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return range(1024, 65536)  # an unusual range: any port that binds


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))  # clashes with a listener on any local address
        except OSError:
            return False
    return True


def free_port(attempts: int = 500) -> int:
    """A TCP port nothing is bound to now, outside the ephemeral range, not given out before
    by this process."""
    pool = _pool()
    for _ in range(attempts):
        port = _rng.choice(pool)
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    raise RuntimeError(f"no free TCP port found in {pool.start}-{pool.stop - 1} after {attempts} tries")
