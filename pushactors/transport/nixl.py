"""The real NIXL agent behind :class:`~pushactors.transport.agent.NixlAgentLike`.

Imports ``nixl._api`` (the ``nixl`` meta package), falling back to the wheel-specific
``nixl_cu12._api`` / ``nixl_cu13._api``. Only the writer actor calls an agent.

NIXL's progress thread is off by default: the writer polls the agent anyway, and with the
thread on every idle process busy-polls a core (measured on the 2-core CI machine: ~0.45 s of
CPU per idle second, and lower throughput), which starves the engine.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np

from .agent import LOCAL_AGENT, AgentFactory, DescArray, DlistHandle, IndexList, XferHandle, XferState

_CANDIDATES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


class NixlUnavailable(ImportError):
    """No NIXL Python API is installed."""


def import_nixl_api() -> ModuleType:
    errors = []
    for name in _CANDIDATES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable(
        "NIXL is not installed (pip install 'pushactors[nixl]', i.e. nixl-cu12 or nixl-cu13); tried "
        + "; ".join(errors)
    )


def nixl_available() -> bool:
    try:
        import_nixl_api()
    except NixlUnavailable:
        return False
    return True


class NixlAgent:
    """A ``nixl_agent`` with the narrow, typed surface the writer uses."""

    def __init__(
        self,
        name: str,
        *,
        backends: tuple[str, ...] = ("UCX",),
        progress_thread: bool = False,
        num_threads: int = 0,
    ) -> None:
        api = import_nixl_api()
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread, backends=list(backends), num_threads=num_threads
        )
        self._api = api
        self._agent: Any = api.nixl_agent(name, config)
        self._name = name
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise RuntimeError(f"NIXL backends {missing} are not available (have {list(self._agent.backends)})")

    @property
    def name(self) -> str:
        return self._name

    def register_memory(self, descs: DescArray, mem_type: str) -> object:
        reg = self._agent.get_reg_descs(np.ascontiguousarray(descs, dtype=np.uint64), mem_type)
        if reg is None:
            raise ValueError("NIXL could not build a registration list")
        self._agent.register_memory(reg)
        return reg

    def deregister_memory(self, registration: object) -> None:
        self._agent.deregister_memory(registration)

    def get_agent_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def add_remote_agent(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)

    def remove_remote_agent(self, agent_name: str) -> None:
        self._agent.remove_remote_agent(agent_name)

    def prep_xfer_dlist(self, agent_name: str, descs: DescArray, mem_type: str) -> DlistHandle:
        target = "NIXL_INIT_AGENT" if agent_name == LOCAL_AGENT else agent_name
        arr = np.ascontiguousarray(descs, dtype=np.uint64).reshape(-1, 3)
        return self._agent.prep_xfer_dlist(target, arr, mem_type)  # type: ignore[no-any-return]

    def release_dlist_handle(self, handle: DlistHandle) -> None:
        self._agent.release_dlist_handle(handle)

    def make_prepped_xfer(
        self,
        operation: str,
        local: DlistHandle,
        local_indices: IndexList,
        remote: DlistHandle,
        remote_indices: IndexList,
        notif_msg: bytes,
    ) -> XferHandle:
        return self._agent.make_prepped_xfer(  # type: ignore[no-any-return]
            operation,
            local,
            np.ascontiguousarray(local_indices, dtype=np.int32),
            remote,
            np.ascontiguousarray(remote_indices, dtype=np.int32),
            notif_msg,
        )

    def transfer(self, handle: XferHandle) -> XferState:
        return self._agent.transfer(handle)  # type: ignore[no-any-return]

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        return self._agent.check_xfer_state(handle)  # type: ignore[no-any-return]

    def release_xfer_handle(self, handle: XferHandle) -> None:
        self._agent.release_xfer_handle(handle)

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        self._agent.send_notif(agent_name, notif_msg)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        raw = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in raw.items()}


def nixl_agent_factory(
    *, backends: tuple[str, ...] = ("UCX",), progress_thread: bool = False, num_threads: int = 0
) -> AgentFactory:
    """An :data:`~pushactors.transport.agent.AgentFactory` creating real NIXL agents."""

    def make(name: str) -> NixlAgent:
        return NixlAgent(name, backends=backends, progress_thread=progress_thread, num_threads=num_threads)

    return make
