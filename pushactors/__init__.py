"""pushactors: a prefill→decode KV-cache push transport built as Pykka actors over NIXL.

Importing pushactors configures no logging and needs neither NIXL nor vLLM. The engine-side
names (which pull in torch) load on first use, so the log tools (``pushactors logs``/``top``)
start without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .core.config import ConfigError, PushConfig
from .logs import capture_events, configure_logging
from .protocol import CompatSpec, KVTransferParams, PushConnectorMeta, Registration
from .transport.directory import (
    HeldMetadata,
    InProcessDirectory,
    MetadataPublisher,
    MetadataSource,
    SideChannelError,
)

if TYPE_CHECKING:
    from .core.outbox import FinishedReport
    from .engine.scheduler import PushScheduler
    from .engine.stack import PushEngine, open_engine, open_worker
    from .engine.worker import PushWorker

__version__ = "0.1.0"

_LAZY = {
    "FinishedReport": ".core.outbox",
    "PushScheduler": ".engine.scheduler",
    "PushWorker": ".engine.worker",
    "PushEngine": ".engine.stack",
    "open_engine": ".engine.stack",
    "open_worker": ".engine.stack",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pushactors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "CompatSpec",
    "ConfigError",
    "FinishedReport",
    "HeldMetadata",
    "InProcessDirectory",
    "KVTransferParams",
    "MetadataPublisher",
    "MetadataSource",
    "PushConfig",
    "PushConnectorMeta",
    "PushEngine",
    "PushScheduler",
    "PushWorker",
    "Registration",
    "SideChannelError",
    "__version__",
    "capture_events",
    "configure_logging",
    "open_engine",
    "open_worker",
]
