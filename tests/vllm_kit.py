"""The vLLM connector module imported without vLLM: over stand-ins for just what it imports
from vLLM at module level (vLLM 0.32's shapes), removed again right after, so nothing else in
the process mistakes them for vLLM. With vLLM installed, the real module."""

from __future__ import annotations

import enum
import importlib
import sys
import types
from typing import Any


def _stand_ins() -> dict[str, types.ModuleType]:
    class KVConnectorBase_V1:
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config

    class KVConnectorRole(enum.IntEnum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorStats:
        def __init__(self, data: dict[str, Any] | None = None) -> None:
            self.data = data or {}

    class KVConnectorPromMetrics:
        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine: Any) -> None:
            raise RuntimeError("stand-in: Prometheus metrics need vLLM")

    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector"]
    names += ["vllm.distributed.kv_transfer.kv_connector.v1"]
    mods = {n: types.ModuleType(n) for n in names}
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorBase_V1 = KVConnectorBase_V1  # type: ignore[attr-defined]
    base.KVConnectorRole = KVConnectorRole  # type: ignore[attr-defined]
    for cls in ("KVConnectorHandshakeMetadata", "KVConnectorMetadata", "KVConnectorTransferResults", "SupportsHMA"):
        setattr(base, cls, type(cls, (), {}))
    metrics = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    metrics.KVConnectorStats = KVConnectorStats  # type: ignore[attr-defined]
    metrics.KVConnectorPromMetrics = KVConnectorPromMetrics  # type: ignore[attr-defined]
    mods[base.__name__] = base
    mods[metrics.__name__] = metrics
    return mods


def import_connector() -> types.ModuleType:
    try:
        importlib.import_module("vllm.v1.kv_cache_interface")
    except ImportError:
        pass
    else:
        return importlib.import_module("pushactors.integrations.vllm")
    stand_ins = _stand_ins()
    saved = {n: sys.modules.get(n) for n in stand_ins}
    sys.modules.update(stand_ins)
    try:
        sys.modules.pop("pushactors.integrations.vllm", None)
        return importlib.import_module("pushactors.integrations.vllm")
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod
        sys.modules.pop("pushactors.integrations.vllm", None)
