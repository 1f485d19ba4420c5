"""pushactors: a prefill→decode KV-cache push transport built as Pykka actors over NIXL.

Importing pushactors configures no logging and needs neither NIXL nor vLLM.
"""

from .core.config import ConfigError, PushConfig
from .engine.outbox import FinishedReport
from .engine.scheduler import PushScheduler
from .engine.worker import PushWorker
from .logs import capture_events, configure_logging
from .protocol import CompatSpec, KVTransferParams, PushConnectorMeta, Registration
from .transport.directory import InProcessDirectory, MetadataPublisher, MetadataSource, SideChannelError

__version__ = "0.1.0"

__all__ = [
    "CompatSpec",
    "ConfigError",
    "FinishedReport",
    "InProcessDirectory",
    "KVTransferParams",
    "MetadataPublisher",
    "MetadataSource",
    "PushConfig",
    "PushConnectorMeta",
    "PushScheduler",
    "PushWorker",
    "Registration",
    "SideChannelError",
    "__version__",
    "capture_events",
    "configure_logging",
]
