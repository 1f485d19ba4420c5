"""The NIXL agent surface the writer uses, as a typed protocol.

The real ``nixl_agent`` (through :mod:`pushactors.transport.nixl`) and the fake in
:mod:`pushactors.testing` both implement it, so the writer's code is the same for both. Only the
writer actor may call an agent: NIXL agents are not thread-safe by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

XferState = Literal["DONE", "PROC", "ERR"]
DescArray = npt.NDArray[np.uint64]  # Nx3: address, length, device id
IndexList = npt.NDArray[np.int64]

LOCAL_AGENT = "NIXL_INIT_AGENT"


class PeerDisconnected(RuntimeError):
    """NIXL says the remote agent disconnected (its process died or restarted): what an agent
    raises for NIXL's ``NIXL_ERR_REMOTE_DISCONNECT``, so the writer forgets that peer."""


class DlistHandle(Protocol):
    """A prepared descriptor list (opaque)."""


class XferHandle(Protocol):
    """A prepared transfer (opaque)."""


class NixlAgentLike(Protocol):
    @property
    def name(self) -> str: ...

    def register_memory(self, descs: DescArray, mem_type: str) -> object: ...

    def deregister_memory(self, registration: object) -> None: ...

    def get_agent_metadata(self) -> bytes: ...

    def add_remote_agent(self, metadata: bytes) -> str: ...

    def remove_remote_agent(self, agent_name: str) -> None: ...

    def prep_xfer_dlist(self, agent_name: str, descs: DescArray, mem_type: str) -> DlistHandle: ...

    def release_dlist_handle(self, handle: DlistHandle) -> None: ...

    def make_prepped_xfer(
        self,
        operation: str,
        local: DlistHandle,
        local_indices: IndexList,
        remote: DlistHandle,
        remote_indices: IndexList,
        notif_msg: bytes,
    ) -> XferHandle: ...

    def transfer(self, handle: XferHandle, notif_msg: bytes = b"") -> XferState:
        """Post ``handle``; a non-empty ``notif_msg`` is the notification this post carries,
        in place of the one the handle was made with (NIXL's ``transfer``)."""
        ...

    def check_xfer_state(self, handle: XferHandle) -> XferState: ...

    def release_xfer_handle(self, handle: XferHandle) -> None: ...

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None: ...

    def get_new_notifs(self) -> dict[str, list[bytes]]: ...


AgentFactory = Callable[[str], NixlAgentLike]
"""Builds the agent for one rank from its unique agent name; called on the writer's thread."""
