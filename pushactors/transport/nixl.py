"""The real NIXL agent behind :class:`~pushactors.transport.agent.NixlAgentLike`.

Imports ``nixl._api`` (the ``nixl`` meta package), falling back to the wheel-specific
``nixl_cu12._api`` / ``nixl_cu13._api``. Only the writer actor calls an agent.

NIXL's progress thread is on by default, built to sleep on UCX's events
(:func:`with_progress_delay`) rather than spin as NIXL's Python wrapper makes it: it moves a
WRITE and its notification while the writer waits for a busy engine's interpreter.

Backend tuning comes from :class:`~pushactors.core.config.PushConfig` through
:func:`agent_factory_from_config` (``nixl_num_threads``, ``nixl_sgl``, ``nixl_progress_thread``;
docs/nixl.md, "Tuning"). SGL is not an agent argument: NIXL's UCX backend reads the environment
variable ``NIXL_UCX_SGL_ENABLE`` when the backend is created, so the factory sets it (process
wide) just before creating an agent, and a value the user set always wins.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from ..core.config import PushConfig
from ..logs import get_logger
from .agent import LOCAL_AGENT, AgentFactory, DescArray, DlistHandle, IndexList, PeerDisconnected, XferHandle, XferState

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


def disconnected(exc: BaseException) -> bool:
    """NIXL's "remote agent disconnected" error (``nixlRemoteDisconnectError``, status
    ``NIXL_ERR_REMOTE_DISCONNECT``): the peer process died or restarted."""
    name = type(exc).__name__
    return name == "nixlRemoteDisconnectError" or "REMOTE_DISCONNECT" in f"{name} {exc}"


class NixlAgent:
    """A ``nixl_agent`` with the narrow, typed surface the writer uses. The calls that reach a
    peer raise :class:`~pushactors.transport.agent.PeerDisconnected` for NIXL's disconnect
    error, so no caller reads NIXL's messages."""

    def __init__(
        self,
        name: str,
        *,
        backends: tuple[str, ...] = ("UCX",),
        progress_thread: bool = False,
        num_threads: int = 0,
        progress_delay_us: int = 0,
    ) -> None:
        api = import_nixl_api()
        config = api.nixl_agent_config(
            enable_prog_thread=progress_thread, backends=list(backends), num_threads=num_threads
        )
        self._api = api
        if progress_thread and progress_delay_us > 0:
            self._agent: Any = with_progress_delay(api, progress_delay_us, lambda: api.nixl_agent(name, config))
        else:
            self._agent = api.nixl_agent(name, config)
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
        try:
            return self._agent.prep_xfer_dlist(target, arr, mem_type)  # type: ignore[no-any-return]
        except Exception as exc:
            if disconnected(exc):
                raise PeerDisconnected(str(exc)) from exc
            raise

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
        try:
            return self._agent.make_prepped_xfer(  # type: ignore[no-any-return]
                operation,
                local,
                np.ascontiguousarray(local_indices, dtype=np.int32),
                remote,
                np.ascontiguousarray(remote_indices, dtype=np.int32),
                notif_msg,
            )
        except Exception as exc:
            if disconnected(exc):
                raise PeerDisconnected(str(exc)) from exc
            raise

    def transfer(self, handle: XferHandle, notif_msg: bytes = b"") -> XferState:
        try:
            return self._agent.transfer(handle, notif_msg)  # type: ignore[no-any-return]
        except Exception as exc:
            if disconnected(exc):
                raise PeerDisconnected(str(exc)) from exc
            raise

    def check_xfer_state(self, handle: XferHandle) -> XferState:
        try:
            return self._agent.check_xfer_state(handle)  # type: ignore[no-any-return]
        except Exception as exc:
            if disconnected(exc):
                raise PeerDisconnected(str(exc)) from exc
            raise

    def release_xfer_handle(self, handle: XferHandle) -> None:
        self._agent.release_xfer_handle(handle)

    def send_notif(self, agent_name: str, notif_msg: bytes) -> None:
        try:
            self._agent.send_notif(agent_name, notif_msg)
        except Exception as exc:
            if disconnected(exc):
                raise PeerDisconnected(str(exc)) from exc
            raise

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        raw = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else str(k)): list(v) for k, v in raw.items()}


class _Bindings(ModuleType):
    """NIXL's bindings module with another ``nixlAgentConfig``; every other name is the
    module's own."""

    def __init__(self, real: ModuleType, config: type) -> None:
        super().__init__(real.__name__)
        self._real = real
        self.nixlAgentConfig = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def with_progress_delay(api: ModuleType, delay_us: int, create: Callable[[], Any]) -> Any:
    """``create()`` an agent whose progress thread waits for UCX's events with a timeout of
    ``delay_us`` (NIXL rounds it up to whole milliseconds), not a busy loop.

    NIXL's UCX progress thread arms its workers and sleeps in ``poll()`` on their event fds,
    woken by traffic, with ``pthrDelay`` as the timeout; nixl 1.5's Python ``nixl_agent`` sets
    that timeout to 0, which makes the thread spin on a core. The agent is built with a
    config class that keeps our delay instead; only agent creation sees it (callers hold
    ``_env_lock``, and every other name of the bindings module is unchanged)."""
    bindings: ModuleType = getattr(api, "nixlBind")  # noqa: B009 (NIXL's private module name)
    base = bindings.nixlAgentConfig
    field = base.__dict__.get("pthrDelay")
    if field is None:
        raise RuntimeError("this NIXL has no pthrDelay setting: progress_delay cannot be applied")

    class DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(field.__get__(self, base))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            field.__set__(self, max(int(value), delay_us))

    setattr(api, "nixlBind", _Bindings(bindings, DelayedConfig))  # noqa: B010
    try:
        return create()
    finally:
        setattr(api, "nixlBind", bindings)  # noqa: B010


# --- backend tuning ------------------------------------------------------------------------------
# Read by NIXL's UCX backend (nixlUcxEngine's constructor, nixl 1.5.1) when the backend is created;
# y/yes/on/1/true/enable or n/no/off/0/false/disable, any case; anything else makes the backend
# creation fail.
SGL_ENV = "NIXL_UCX_SGL_ENABLE"
_SGL_TRUE = frozenset({"y", "yes", "on", "1", "true", "enable"})
# Agents are created on each rank's writer thread, several per process: the environment is
# adjusted and the agent created under one lock, so each agent gets the setting it asked for.
_env_lock = threading.Lock()
# Whether the value in the environment is the one this module set (then it may take it back);
# a value the user set is never changed.
_sgl_ours = False
_log = get_logger(actor="nixl")


def _apply_sgl(sgl: bool) -> None:
    """Make ``NIXL_UCX_SGL_ENABLE`` say ``sgl`` for the agent about to be created, unless the
    user set it: then the environment wins. Caller holds ``_env_lock``."""
    global _sgl_ours
    current = os.environ.get(SGL_ENV)
    if _sgl_ours and current != "1":
        _sgl_ours = False  # changed or removed by someone else since: not ours any more
    if sgl:
        if current is None:
            os.environ[SGL_ENV] = "1"
            _sgl_ours = True
        elif not _sgl_ours and current.strip().lower() not in _SGL_TRUE:
            _log.warning("nixl.sgl_overridden", env=SGL_ENV, value=current, note="the environment wins")
    elif _sgl_ours:
        # Set by us for an earlier agent of this process: this one asked for no SGL.
        del os.environ[SGL_ENV]
        _sgl_ours = False


def nixl_agent_factory(
    *,
    backends: tuple[str, ...] = ("UCX",),
    progress_thread: bool = True,
    num_threads: int = 0,
    sgl: bool = False,
    progress_delay: float = 0.01,
) -> AgentFactory:
    """An :data:`~pushactors.transport.agent.AgentFactory` creating real NIXL agents.

    ``num_threads`` > 0 makes NIXL's UCX backend a thread pool (that many extra UCX workers on
    their own threads, splitting large transfers); ``sgl`` sets ``NIXL_UCX_SGL_ENABLE=1``
    (batched copies) for the agents created, unless the environment already sets it.
    ``progress_delay`` (seconds, with ``progress_thread``): NIXL's progress thread sleeps on
    UCX's events with this timeout instead of spinning (0: NIXL's own busy loop)."""
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
        raise ValueError(f"num_threads must be an int >= 0, not {num_threads!r}")
    backends = tuple(backends)

    def make(name: str) -> NixlAgent:
        with _env_lock:
            _apply_sgl(sgl)
            return NixlAgent(
                name,
                backends=backends,
                progress_thread=progress_thread,
                num_threads=num_threads,
                progress_delay_us=round(progress_delay * 1e6),
            )

    return make


def agent_factory_from_config(config: PushConfig) -> AgentFactory:
    """The NIXL agent factory for these settings: ``backends``, ``nixl_num_threads``,
    ``nixl_sgl`` and ``nixl_progress_thread``."""
    return nixl_agent_factory(
        backends=config.backends,
        progress_thread=config.nixl_progress_thread,
        num_threads=config.nixl_num_threads,
        sgl=config.nixl_sgl,
        progress_delay=config.nixl_progress_delay,
    )
