"""The four actors of one rank, one module each, and their shared base."""

from .base import ActorKilled, Note, Peers, PushActor, RankContext, TimedInbox
from .handshake import Handshake
from .matcher import Matcher
from .reaper import Reaper
from .writer import Writer

__all__ = [
    "ActorKilled",
    "Handshake",
    "Matcher",
    "Note",
    "Peers",
    "PushActor",
    "RankContext",
    "Reaper",
    "TimedInbox",
    "Writer",
]
