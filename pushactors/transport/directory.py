"""Where handshake payloads come from.

A rank *publishes* its payload with a :class:`MetadataPublisher`; the handshake actor *fetches*
a peer's payload through a :class:`MetadataSource`. :class:`InProcessDirectory` is both, for
engines that share one process (tests, the in-process demo); the ZMQ side channel in
:mod:`pushactors.transport.sidechannel` is the cross-process implementation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from ..protocol import (
    AgentInfo,
    ClockSample,
    HandshakeRequest,
    PeerKey,
    encode_handshake,
)


class SideChannelError(Exception):
    """A fetch that failed; ``kind``: refused (no process holds the port: proof the peer is
    gone), unreachable (no route or another connect error: not proof), timeout, disconnected,
    garbage, not_ready, bad_request, unauthorized, error."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class MetadataSource(Protocol):
    def fetch(self, peer: PeerKey, request: HandshakeRequest, timeout: float) -> bytes:
        """Return the raw handshake payload of ``peer`` or raise :class:`SideChannelError`."""
        ...


class MetadataPublisher(Protocol):
    """Where a worker rank publishes its handshake payload (its NIXL agent and regions)."""

    @property
    def host(self) -> str:
        """The host of the engine's side channel, which D's registrations are sent to."""
        ...

    @property
    def port(self) -> int:
        """The port of the engine's side channel."""
        ...

    def publish(self, info: AgentInfo, compat_hash: str) -> None:
        """Serve ``info`` for its (pp_rank, tp_rank) from now on."""
        ...


class _Held(msgspec.Struct, frozen=True, tag="held_metadata"):
    info: AgentInfo
    compat_hash: str


class HeldMetadata:
    """A :class:`MetadataPublisher` for a worker rank that runs in another process than its
    engine's side channel: it keeps what the rank publishes; the engine carries
    :meth:`payload` to the scheduler process by its own means (vLLM's handshake metadata, a
    queue, a pipe), which serves it (``PushEngine.publish_held``, or :func:`decode_held` and
    ``SideChannelServer.publish``). ``host``/``port``: the engine's side channel, which the
    rank advertises."""

    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self.info: AgentInfo | None = None
        self.compat_hash = ""

    @property
    def host(self) -> str:
        """The engine's side-channel host this rank advertises."""
        return self._host

    @property
    def port(self) -> int:
        """The engine's side-channel port this rank advertises."""
        return self._port

    def publish(self, info: AgentInfo, compat_hash: str) -> None:
        """Keep ``info`` for :meth:`payload` (the rank calls this when it registers its KV)."""
        self.info, self.compat_hash = info, compat_hash

    def payload(self) -> bytes:
        """What the scheduler process needs to serve this rank; LookupError before the rank
        registered its KV caches (that publishes it)."""
        if self.info is None:
            raise LookupError("nothing published yet: register the rank's KV caches first")
        return msgspec.msgpack.encode(_Held(info=self.info, compat_hash=self.compat_hash))


def decode_held(payload: bytes) -> tuple[AgentInfo, str]:
    """(info, compat_hash) from :meth:`HeldMetadata.payload`; msgspec.ValidationError or
    DecodeError for anything else."""
    held = msgspec.msgpack.decode(payload, type=_Held)
    return held.info, held.compat_hash


def fresh_payload(info: AgentInfo, compat_hash: str) -> bytes:
    """Encode ``info`` with a clock sample taken now (for deadline rebasing)."""
    sample = ClockSample(monotonic=time.monotonic(), wall=time.time())
    return encode_handshake(msgspec.structs.replace(info, clock=sample), compat_hash)


class InProcessDirectory:
    """Published payloads of engines in this process, addressed like side channels.

    Each engine gets a pseudo address ``(host, port)`` from :meth:`endpoint`. Faults for tests:
    ``refused`` makes an address refuse, ``delays`` makes fetches from it slow, ``disconnects``
    drops the connection of its next N fetches before they are answered (a process being
    killed), and ``tamper`` rewrites the payload bytes served.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: dict[tuple[str, int], dict[tuple[int, int], tuple[AgentInfo, str]]] = {}
        self._next_port = 20000
        self.refused: set[tuple[str, int]] = set()
        self.delays: dict[tuple[str, int], float] = {}
        self.disconnects: dict[tuple[str, int], int] = {}
        self.tamper: dict[tuple[str, int], Callable[[bytes], bytes]] = {}
        self.fetches: list[tuple[PeerKey, HandshakeRequest]] = []

    def endpoint(self, host: str = "inproc") -> DirectoryEndpoint:
        """A new engine's address in this directory: its publisher (for its worker ranks)
        and its host/port (for the scheduler to advertise)."""
        with self._lock:
            port = self._next_port
            self._next_port += 1
            self._served[(host, port)] = {}
        return DirectoryEndpoint(self, host, port)

    def _publish(self, host: str, port: int, info: AgentInfo, compat_hash: str) -> None:
        with self._lock:
            self._served.setdefault((host, port), {})[(info.pp_rank, info.tp_rank)] = (info, compat_hash)

    def published(self, addr: tuple[str, int], pp_rank: int, tp_rank: int) -> tuple[AgentInfo, str] | None:
        """What the engine at ``addr`` published for that rank (its info and compat hash), if any."""
        with self._lock:
            return self._served.get(addr, {}).get((pp_rank, tp_rank))

    def fetch(self, peer: PeerKey, request: HandshakeRequest, timeout: float) -> bytes:
        """``peer``'s payload as published, or :class:`SideChannelError` (refused: no engine
        at that address; not_ready: the rank has not published yet)."""
        addr = (peer.host, peer.port)
        with self._lock:
            self.fetches.append((peer, request))
            delay = self.delays.get(addr, 0.0)
        if delay:
            # Simulated network latency for tests of slow handshakes.
            time.sleep(min(delay, timeout))
            if delay >= timeout:
                raise SideChannelError("timeout", f"no reply from {addr} within {timeout}s")
        with self._lock:
            if self.disconnects.get(addr, 0) > 0:
                self.disconnects[addr] -= 1
                raise SideChannelError("disconnected", f"{addr} dropped the connection before it answered")
            if addr in self.refused or addr not in self._served:
                raise SideChannelError("refused", f"nothing listens at {addr}")
            entry = self._served[addr].get((request.pp_rank, request.tp_rank))
            tamper = self.tamper.get(addr)
        if entry is None:
            raise SideChannelError("not_ready", f"rank pp{request.pp_rank}/tp{request.tp_rank} not published at {addr}")
        payload = fresh_payload(*entry)
        return tamper(payload) if tamper else payload


class DirectoryEndpoint:
    """One engine's address in an :class:`InProcessDirectory`: its publisher."""

    def __init__(self, directory: InProcessDirectory, host: str, port: int) -> None:
        self.directory = directory
        self._host = host
        self._port = port

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    def publish(self, info: AgentInfo, compat_hash: str) -> None:
        self.directory._publish(self._host, self._port, info, compat_hash)

    def fetch(self, peer: PeerKey, request: HandshakeRequest, timeout: float) -> bytes:
        return self.directory.fetch(peer, request, timeout)
