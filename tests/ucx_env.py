"""The UCX transport list the tests pin for "TCP only" (as between hosts without RDMA), on hosts
with and without GPUs.

NIXL 1.5.1's UCX backend does not start on a host whose CUDA driver sees a GPU when
``UCX_TLS=tcp`` leaves out every CUDA transport. There the tests add ``cuda_copy``: a transport
within one process (host and device copies), so a WRITE between two processes' DRAM still has
tcp alone to travel by. Where NIXL refuses even that (checked by starting an agent), the test
is skipped with NIXL's error: only on a GPU host, never where ``tcp`` alone must work.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

# Asks the CUDA driver, in a process of its own (this one never initialises CUDA).
_PROBE = """
import ctypes
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0)
else:
    n = ctypes.c_int(0)
    print(n.value if cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0)
"""


@functools.cache
def cuda_devices() -> int:
    """GPUs the CUDA driver sees (0 without a driver): what UCX finds when NIXL starts it."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False)
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


# Starts a NIXL agent (its UCX backend) under the UCX_TLS of its environment.
_AGENT = """
from pushactors.transport.nixl import NixlAgent
NixlAgent("ucx-tls-probe")
"""


@functools.cache
def nixl_refuses(tls: str) -> str | None:
    """Why NIXL's UCX backend does not start under ``UCX_TLS=tls`` here (None: it starts)."""
    env = {**os.environ, "UCX_TLS": tls}
    cmd = [sys.executable, "-c", _AGENT]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    if out.returncode == 0:
        return None
    return " ".join(out.stderr.strip().splitlines()[-3:])[-500:] or f"exit status {out.returncode}"


def tcp_only() -> str:
    """``UCX_TLS`` for DRAM pushes over TCP alone: ``tcp``, plus ``cuda_copy`` on a GPU host.

    On a GPU host where NIXL still refuses that list, the test is skipped with NIXL's error;
    never on a host without GPUs (CI), where ``tcp`` must work."""
    devices = cuda_devices()
    if not devices:
        return "tcp"
    tls = "tcp,cuda_copy"
    why = nixl_refuses(tls)
    if why is not None:
        pytest.skip(
            f"NIXL's UCX backend does not start with UCX_TLS={tls} on this host with {devices} GPU(s) "
            f"({why}); DRAM pushes over TCP alone are tested on hosts without GPUs"
        )
    return tls
