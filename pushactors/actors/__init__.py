"""The actors of one rank (writer, handshake, matcher, lease-reaper, stager), one module each
(the writer a package, with the plain classes it is a shell over), and their shared base."""

from .base import ActorKilled, Note, Peers, PushActor, RankContext
from .handshake import Handshake
from .inbox import TimedInbox
from .matcher import Matcher
from .reaper import Reaper
from .stager import Stager
from .writer.actor import Writer

__all__ = [
    "ActorKilled",
    "Handshake",
    "Matcher",
    "Note",
    "Peers",
    "PushActor",
    "RankContext",
    "Reaper",
    "Stager",
    "TimedInbox",
    "Writer",
]
