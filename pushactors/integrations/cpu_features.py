"""CPU features an engine's process must ask the OS for before its kernels may use them."""

from __future__ import annotations

import torch


def request_amx_tile_state() -> bool | None:
    """Ask Linux for the AMX tile-data state on this process (x86-64 CPUs with AMX).

    vLLM's CPU attention picks its AMX kernel on such CPUs but leaves asking the kernel for
    tile-data permission to oneDNN, which asks on its first AMX matrix multiply. A decode
    engine fed by push runs a pushed request's decode first, so the AMX attention can run
    before anything asked, and the worker dies of SIGILL (seen here, intermittently, on a
    Xeon with AMX whose process held only the tile-config state). Asking once at start-up is
    what oneDNN would do anyway. Returns whether the state is granted, or None where it does
    not apply (not Linux x86-64, or no AMX)."""
    import ctypes
    import platform
    import sys

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        amx = bool(torch.cpu._is_amx_tile_supported())  # type: ignore[attr-defined]
    except Exception:
        return None
    if not amx:
        return None
    sys_arch_prctl, req_perm, get_perm, xtiledata = 158, 0x1023, 0x1022, 18
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(sys_arch_prctl, req_perm, xtiledata)
        mask = ctypes.c_uint64(0)
        if libc.syscall(sys_arch_prctl, get_perm, ctypes.byref(mask)) != 0:
            return False
        return bool(mask.value & (1 << xtiledata))
    except (OSError, AttributeError):
        return False
