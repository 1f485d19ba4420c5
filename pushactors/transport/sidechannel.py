"""The ZMQ side channel: how ranks learn each other's NIXL metadata (docs/protocol.md,
'Side channel').

One :class:`SideChannelServer` per engine (a ROUTER socket on its own thread) serves the
handshake payload of each of the engine's ranks, addressed by ``(pp_rank, tp_rank)``. The
handshake actor fetches through :class:`SideChannelClient`, one short-lived REQ socket per fetch
so a timed-out exchange never wedges the next one.

Reply frames: ``[b"ok", payload]`` or ``[b"err", kind, detail]``. Every failure on the client
side is a :class:`~pushactors.transport.directory.SideChannelError` with a kind: ``refused`` (nothing
listens: the host answered that no process holds the port), ``unreachable`` (no route to the
host, or the address does not resolve: a broken link, which says nothing of the process behind it),
``timeout``, ``disconnected`` (the connection broke before the reply: the peer may
be dying, so asking again soon tells more), ``garbage`` (a reply that is not this protocol), ``not_ready`` (the rank
has not registered yet), ``bad_request``, ``unauthorized`` (see below), ``error``. The server
answers garbage requests with an error and keeps serving.

Authentication (opt-in, :mod:`pushactors.transport.auth`): with a keyring the client seals its request
(context ``b"hs-req"``) and the server opens it before decoding anything; a request that does not
open is answered ``[b"err", b"unauthorized", detail]``, counted in ``unauthorized`` and never
introduced. The server seals an OK payload (``b"hs-reply"``) and, for an authentic request, an
error's detail (``b"hs-err:" + kind``). A keyed client believes nothing unauthenticated: an OK or
error reply that does not open (an unsigned server, another key) is ``unauthorized``. Without a
keyring nothing is sealed and frames are exactly as above.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..logs import get_logger
from ..protocol import (
    AgentInfo,
    HandshakeRequest,
    MalformedMessage,
    PeerKey,
    decode_handshake_request,
    encode_handshake_request,
)
from .auth import AuthError, Keyring
from .directory import SideChannelError, fresh_payload

OK = b"ok"
ERR = b"err"
UNAUTHORIZED = b"unauthorized"
CTX_REQUEST = b"hs-req"
CTX_REPLY = b"hs-reply"
CTX_ERROR = b"hs-err:"  # + the error kind, so a sealed detail cannot be moved to another kind
_CLIENT_ERROR_KINDS = ("not_ready", "bad_request", "unauthorized")
# Monitor events after which a REQ socket's request can no longer be answered.
_CONNECTION_LOST = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED
MAX_REQUEST_BYTES = 64 * 1024


@dataclass(frozen=True)
class Introduction:
    """Who asked for our metadata: a handshake the server served."""

    engine_id: str
    agent: str
    pp_rank: int
    tp_rank: int
    at: float


class SideChannelServer:
    """Serves this engine's handshake payloads; a :class:`MetadataPublisher`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        engine_id: str = "",
        on_introduction: Callable[[Introduction], None] | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        self._keyring = keyring
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if port:
            self._sock.bind(f"tcp://{_bracket(host)}:{port}")
            self._port = port
        else:
            self._port = self._sock.bind_to_random_port(f"tcp://{_bracket(host)}")
        self._host = host
        self.engine_id = engine_id
        self._served: dict[tuple[int, int], tuple[AgentInfo, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._on_introduction = on_introduction
        self.requests = 0
        self.bad_requests = 0
        self.unauthorized = 0
        self.introductions: list[Introduction] = []
        self.log = get_logger(actor="side_channel", engine=engine_id, port=self._port)
        self._thread = threading.Thread(target=self._serve, name=f"pushactors-sidechannel-{self._port}", daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    def publish(self, info: AgentInfo, compat_hash: str) -> None:
        with self._lock:
            self._served[(info.pp_rank, info.tp_rank)] = (info, compat_hash)
        self.log.info("side_channel.published", pp_rank=info.pp_rank, tp_rank=info.tp_rank)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(100))
            except zmq.ZMQError:
                break
            if self._sock not in events:
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                self.log.warning("side_channel.recv_failed", error=repr(exc))
                continue
            try:
                self._answer(frames)
            except Exception as exc:  # one bad exchange must never stop the listener
                self.bad_requests += 1
                self.log.error("side_channel.answer_failed", error=repr(exc))
        self._sock.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        self.requests += 1
        # REQ peers send [identity, b"", request]; anything else is answered when possible.
        if len(frames) < 2:
            self.bad_requests += 1
            return
        identity = frames[0]
        body = frames[2:] if len(frames) >= 3 and frames[1] == b"" else frames[1:]
        envelope = [identity, b""] if len(frames) >= 3 and frames[1] == b"" else [identity]
        if len(body) != 1:
            self._reply(envelope, [ERR, b"bad_request", b"expected one request frame"])
            self.bad_requests += 1
            return
        raw = body[0]
        if self._keyring is not None:
            try:
                raw = self._keyring.open(CTX_REQUEST, raw)
            except AuthError as exc:
                # Answered unsealed: the peer may hold no key, and ours must not vouch for the reply.
                self.unauthorized += 1
                self.log.warning("side_channel.unauthorized", auth_kind=exc.kind, reason=str(exc)[:200])
                self._reply(envelope, [ERR, UNAUTHORIZED, str(exc)[:500].encode()])
                return
        try:
            request = decode_handshake_request(raw)
        except MalformedMessage as exc:
            self.bad_requests += 1
            self.log.warning("side_channel.bad_request", reason=exc.reason[:200])
            self._error(envelope, b"bad_request", exc.reason[:500].encode())
            return
        with self._lock:
            entry = self._served.get((request.pp_rank, request.tp_rank))
        if entry is None:
            self._error(envelope, b"not_ready", f"rank pp{request.pp_rank}/tp{request.tp_rank} not registered".encode())
            return
        intro = Introduction(
            request.requester_engine_id, request.requester_agent, request.pp_rank, request.tp_rank, time.monotonic()
        )
        self.introductions.append(intro)
        if len(self.introductions) > 1024:
            del self.introductions[:512]
        if self._on_introduction is not None:
            self._on_introduction(intro)
        payload = fresh_payload(*entry)
        if self._keyring is not None:
            payload = self._keyring.seal(CTX_REPLY, payload)
        self._reply(envelope, [OK, payload])
        self.log.debug(
            "side_channel.served",
            requester=request.requester_engine_id,
            pp_rank=request.pp_rank,
            tp_rank=request.tp_rank,
        )

    def _error(self, envelope: list[bytes], kind: bytes, detail: bytes) -> None:
        """An error reply to an authentic (or, without a keyring, any) request."""
        if self._keyring is not None:
            detail = self._keyring.seal(CTX_ERROR + kind, detail)
        self._reply(envelope, [ERR, kind, detail])

    def _reply(self, envelope: list[bytes], frames: list[bytes]) -> None:
        try:
            self._sock.send_multipart(envelope + frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.log.warning("side_channel.reply_failed", error=repr(exc))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


class SideChannelClient:
    """Fetches peers' handshake payloads over ZMQ; a :class:`MetadataSource`."""

    def __init__(self, *, probe_tcp: bool = True, keyring: Keyring | None = None) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._probe = probe_tcp
        self._keyring = keyring
        self._local = threading.local()

    def last_sent(self) -> float | None:
        """When this thread's last request left (monotonic): the start of the round trip that
        brackets the peer's clock sample, after the probe and connect that precede it."""
        sent: float | None = getattr(self._local, "sent", None)
        return sent

    def fetch(self, peer: PeerKey, request: HandshakeRequest, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        if self._probe:
            self._tcp_probe(peer, deadline)
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024 * 1024)
        # A REQ socket never resends a request over a new connection, so once the connection it
        # went out on breaks no reply can come: say so at once (the peer may be dying, and the
        # caller may want to ask again) instead of waiting out the whole timeout.
        monitor = sock.get_monitor_socket(_CONNECTION_LOST)
        try:
            sock.connect(f"tcp://{_bracket(peer.host)}:{peer.port}")
            raw_request = encode_handshake_request(request)
            if self._keyring is not None:
                raw_request = self._keyring.seal(CTX_REQUEST, raw_request)
            self._local.sent = time.monotonic()
            sock.send(raw_request)
            frames = self._await_reply(sock, monitor, peer, deadline, timeout)
        except zmq.ZMQError as exc:
            raise SideChannelError("error", f"ZMQ error talking to {peer.host}:{peer.port}: {exc}") from None
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        where = f"{peer.host}:{peer.port}"
        if len(frames) == 2 and frames[0] == OK:
            if self._keyring is None:
                return bytes(frames[1])
            try:
                return self._keyring.open(CTX_REPLY, bytes(frames[1]))
            except AuthError as exc:
                raise SideChannelError("unauthorized", f"reply from {where} does not authenticate: {exc}") from None
        if len(frames) == 3 and frames[0] == ERR:
            kind = frames[1].decode("ascii", "replace")[:32]
            detail = bytes(frames[2])
            if self._keyring is not None and kind != "unauthorized":
                try:
                    detail = self._keyring.open(CTX_ERROR + bytes(frames[1]), detail)
                except AuthError as exc:
                    # An unsigned server cannot read a sealed request and says so unsealed.
                    text = detail.decode("utf-8", "replace")[:200]
                    raise SideChannelError(
                        "unauthorized", f"error reply from {where} does not authenticate ({exc}): {kind}: {text}"
                    ) from None
            text = detail.decode("utf-8", "replace")[:500]
            raise SideChannelError(kind if kind in _CLIENT_ERROR_KINDS else "error", text)
        raise SideChannelError("garbage", f"reply of {len(frames)} frames is not the side-channel protocol")

    def _tcp_probe(self, peer: PeerKey, deadline: float) -> None:
        """ZMQ retries a refused connect silently; a plain TCP connect tells "nobody listens"
        apart from "slow" at once. Short attempts until the deadline: a process being killed
        drops SYNs for a moment before its port refuses, and that moment must not cost the
        whole timeout."""
        while True:
            remaining = deadline - time.monotonic()
            try:
                with socket.create_connection((peer.host, peer.port), timeout=max(0.05, min(remaining, 1.0))):
                    return
            except ConnectionRefusedError:
                raise SideChannelError("refused", f"nothing listens at {peer.host}:{peer.port}") from None
            except TimeoutError as exc:
                if time.monotonic() >= deadline:
                    raise SideChannelError("timeout", f"connecting to {peer.host}:{peer.port}: {exc}") from None
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise SideChannelError("timeout", f"connecting to {peer.host}:{peer.port}: {exc}") from None
                # No route, or no such host: fail as fast as a refusal, but it is no proof that
                # the process is gone (a live peer behind a broken link looks the same), so a
                # death check does not take it for one.
                raise SideChannelError("unreachable", f"cannot reach {peer.host}:{peer.port}: {exc}") from None

    def _await_reply(
        self, sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], peer: PeerKey, deadline: float, timeout: float
    ) -> list[bytes]:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SideChannelError("timeout", f"no reply from {peer.host}:{peer.port} within {timeout}s")
            ready = dict(poller.poll(int(remaining * 1000) + 1))
            if sock in ready:
                return sock.recv_multipart()
            if monitor in ready:
                event = recv_monitor_message(monitor)
                if event["event"] & _CONNECTION_LOST:
                    if self._probe:
                        self._tcp_probe(peer, min(deadline, time.monotonic() + 1.0))  # "refused" if it died
                    raise SideChannelError(
                        "disconnected", f"{peer.host}:{peer.port} dropped the connection before it answered"
                    )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
