"""pushactors: a prefill→decode KV-cache push transport built as Pykka actors over NIXL.

Importing pushactors configures no logging and needs neither NIXL nor vLLM.
"""

from .config import ConfigError, PushConfig
from .directory import InProcessDirectory, MetadataPublisher, MetadataSource, SideChannelError
from .logs import capture_events, configure_logging
from .outbox import FinishedReport
from .protocol import CompatSpec, KVTransferParams, PushConnectorMeta, Registration
from .scheduler import PushScheduler
from .worker import PushWorker

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
