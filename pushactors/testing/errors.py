"""The errors a NIXL stand-in raises, shared by the fake fabric and the fault wrapper."""

from __future__ import annotations

from ..transport.agent import PeerDisconnected


class FakeNixlError(RuntimeError):
    """Raised where real NIXL raises (its errors are plain exceptions named by status)."""

    def __init__(self, status: str, detail: str = "") -> None:
        super().__init__(f"{status}: {detail}" if detail else status)
        self.status = status


class FakePeerDisconnected(FakeNixlError, PeerDisconnected):
    """NIXL's disconnect error, typed as the real agent raises it."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("NIXL_ERR_REMOTE_DISCONNECT", detail)
