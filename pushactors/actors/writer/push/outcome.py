"""What posting a push's first WRITE came to, as a closed union the pusher applies.

A push mode (:mod:`.direct`, :mod:`.staged`, :mod:`.layered`) plans and posts; it never records
what follows. It returns one of these, and :meth:`~.pusher.Pusher.apply` alone carries it out:

* :class:`Posted`: a WRITE is on its way (or already ended at its post);
* :class:`Complete`: nothing to copy into this D rank, the completion alone settles it;
* :class:`Refused`: the WRITE could not be planned (layouts that do not pair, a bad plan);
* :class:`SubmitFailed`: NIXL refused the post;
* :class:`Pending`: nothing posted yet, and nothing to record (a staged layer-wise push waits
  for every layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias

from ....protocol import Gather
from ..remotes import RemotePeer
from ..verify import PendingDigest
from ..writes import Write


@dataclass(frozen=True, eq=False)
class Posted:
    """A WRITE is on its way: the target holds ``handle`` until it settles."""

    handle: Write
    remote: RemotePeer
    nbytes: int
    kind: str  # the counter it adds besides ``write.posted`` ("": none)
    fields: dict[str, Any] | None  # write.posted's fields (None: nobody reads them, none built)
    at: float  # when its post began: the push's stuck timer runs from here
    status: str = "PROC"  # NIXL's at the post: a WRITE DONE or ERR then settles at once
    resources: Any = None  # its own lists (and P's slot), released when it settles
    # Check it in a tight loop at once (UCX moves a small WRITE only while P progresses). Not a
    # push whose parts come later (chunks still gathering, layers still computing).
    spin: bool = True
    gathers: tuple[Gather, ...] = ()  # the stager's work, sent once it is recorded
    # A verified push's digest, computed once the WRITE is on its way and sent after it.
    digest: PendingDigest | None = None


@dataclass(frozen=True, eq=False)
class Complete:
    """Nothing to copy (D had every block cached, or a lower P rank writes these heads):
    ``completion`` alone settles the target."""

    remote: RemotePeer
    completion: bytes


@dataclass(frozen=True, eq=False)
class Refused:
    """The WRITE could not be planned: the push fails, D is told why."""

    exc: Exception


@dataclass(frozen=True, eq=False)
class SubmitFailed:
    """NIXL refused the post (having released what it made): the push fails."""

    remote: RemotePeer
    exc: Exception


@dataclass(frozen=True)
class Pending:
    """Nothing posted yet, nothing to record: the push's first WRITE goes later."""


Outcome: TypeAlias = Posted | Complete | Refused | SubmitFailed | Pending
