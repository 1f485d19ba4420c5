"""The AMX tile-state request the vLLM connector makes at worker start-up on CPU engines."""

from __future__ import annotations

import ctypes
import platform
import sys

import torch

from pushactors.integrations.cpu_features import request_amx_tile_state


def _amx_cpu() -> bool:
    return sys.platform == "linux" and platform.machine() == "x86_64" and bool(torch.cpu._is_amx_tile_supported())


def test_amx_tile_state_is_granted_where_the_cpu_has_amx() -> None:
    """On an AMX CPU the process holds the tile-data state afterwards (Linux's permission mask
    has XTILEDATA, bit 18): vLLM's AMX attention no longer dies of SIGILL on a decode-first
    engine. Elsewhere the request does not apply and says so (None), asking nothing."""
    granted = request_amx_tile_state()
    if not _amx_cpu():
        assert granted is None
        return
    assert granted is True
    mask = ctypes.c_uint64(0)
    assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask)) == 0  # ARCH_GET_XCOMP_PERM
    assert mask.value & (1 << 18)
    assert request_amx_tile_state() is True  # asking again is harmless
