"""The ZMQ side channel, and handshakes over it: every failure is typed, nothing hangs."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import zmq

from pushactors.actors.handshake import Handshake
from pushactors.core.config import PushConfig
from pushactors.protocol import (
    AgentInfo,
    ClockSample,
    CompatSpec,
    FetchPeer,
    HandshakeCompleted,
    HandshakeFailed,
    HandshakeRequest,
    PeerKey,
    RegionInfo,
    compatibility_hash,
)
from pushactors.testing import ProbeSet
from pushactors.testing.ports import free_port
from pushactors.transport.directory import SideChannelError
from pushactors.transport.sidechannel import SideChannelClient, SideChannelServer

HASH = compatibility_hash(CompatSpec(model="m", dtype="bf16"))


def info(engine: str = "prefill", tp_rank: int = 0) -> AgentInfo:
    return AgentInfo(
        engine_id=engine,
        agent_name=f"{engine}-tp{tp_rank}",
        agent_metadata=b"\x01md",
        mem_type="DRAM",
        tp_size=2,
        tp_rank=tp_rank,
        block_size=16,
        regions=(RegionInfo(base_addr=4096, block_len=64, stride=64, num_blocks=8, members=("l0",)),),
        clock=ClockSample(monotonic=0.0, wall=0.0),
    )


def request(tp_rank: int = 0) -> HandshakeRequest:
    return HandshakeRequest(pp_rank=0, tp_rank=tp_rank, requester_engine_id="decode", requester_agent="decode-tp0")


@pytest.fixture
def server():
    srv = SideChannelServer("127.0.0.1", 0, engine_id="prefill")
    srv.publish(info(tp_rank=0), HASH)
    srv.publish(info(tp_rank=1), HASH)
    yield srv
    srv.close()


def test_fetch_serves_each_rank_with_a_fresh_clock(server: SideChannelServer) -> None:
    client = SideChannelClient()
    peer = PeerKey("prefill", server.host, server.port, 0, 1)
    before = time.monotonic()
    raw = client.fetch(peer, request(1), timeout=5)
    from pushactors.protocol import decode_handshake

    got = decode_handshake(raw, expected_hash=HASH, expected_engine="prefill")
    assert got.tp_rank == 1 and got.agent_name == "prefill-tp1"
    assert got.clock.monotonic >= before  # sampled when served, not when published
    assert [i.engine_id for i in server.introductions] == ["decode"]


def test_peer_down_is_refused_at_once() -> None:
    client = SideChannelClient()
    peer = PeerKey("prefill", "127.0.0.1", free_port(), 0, 0)
    t0 = time.monotonic()
    with pytest.raises(SideChannelError) as err:
        client.fetch(peer, request(), timeout=5)
    assert err.value.kind == "refused"
    assert time.monotonic() - t0 < 4  # well before the timeout


def test_silent_peer_times_out() -> None:
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(SideChannelError) as err:
            SideChannelClient().fetch(PeerKey("p", "127.0.0.1", port, 0, 0), request(), timeout=0.3)
        assert err.value.kind == "timeout"
    finally:
        mute.close(linger=0)


def test_a_connection_dropped_before_the_reply_is_told_at_once() -> None:
    # Something still listens, but the connection the request went out on is closed with no
    # reply (a process going down, a proxy restarting). A REQ socket never resends, so no reply
    # can come: the fetch says "disconnected" now instead of waiting out its 30 s.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def drop_everything() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(1.0)
            try:
                conn.recv(64)  # the TCP probe sends nothing; ZMQ sends its greeting
            except OSError:
                pass
            conn.close()

    t = threading.Thread(target=drop_everything)
    t.start()
    try:
        with pytest.raises(SideChannelError) as err:
            SideChannelClient().fetch(PeerKey("p", "127.0.0.1", port, 0, 0), request(), timeout=30)
        assert err.value.kind == "disconnected", err.value
    finally:
        stop.set()
        t.join()
        listener.close()


def test_a_peer_whose_port_closes_mid_request_is_refused() -> None:
    # The whole process is gone by the time the client looks again: "refused", which is what
    # lets D release requests that waited on it.
    ctx = zmq.Context.instance()
    dying = ctx.socket(zmq.ROUTER)
    port = dying.bind_to_random_port("tcp://127.0.0.1")

    def die() -> None:
        if dying.poll(5000):
            dying.recv_multipart()
        dying.close(linger=0)

    t = threading.Thread(target=die)
    t.start()
    try:
        with pytest.raises(SideChannelError) as err:
            SideChannelClient().fetch(PeerKey("p", "127.0.0.1", port, 0, 0), request(), timeout=30)
        assert err.value.kind == "refused", err.value
    finally:
        t.join()


def test_garbage_reply_is_typed() -> None:
    ctx = zmq.Context.instance()
    liar = ctx.socket(zmq.ROUTER)
    port = liar.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if liar.poll(5000):
            ident, empty, _ = liar.recv_multipart()
            liar.send_multipart([ident, empty, b"\xff\x00garbage", b"x", b"y", b"z"])

    t = threading.Thread(target=answer)
    t.start()
    try:
        with pytest.raises(SideChannelError) as err:
            SideChannelClient().fetch(PeerKey("p", "127.0.0.1", port, 0, 0), request(), timeout=5)
        assert err.value.kind == "garbage"
    finally:
        t.join()
        liar.close(linger=0)


def test_unregistered_rank_is_not_ready(server: SideChannelServer) -> None:
    with pytest.raises(SideChannelError) as err:
        SideChannelClient().fetch(PeerKey("prefill", server.host, server.port, 0, 5), request(5), timeout=5)
    assert err.value.kind == "not_ready"


def test_listener_survives_garbage_requests(server: SideChannelServer) -> None:
    ctx = zmq.Context.instance()
    # Not a handshake request, several frames, an empty frame, raw TCP noise.
    for frames in ([b"\xc1\xc1garbage"], [b"a", b"b", b"c"], [b""], [msgspec.msgpack.encode({"pp_rank": -1})]):
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{server.port}")
        dealer.send_multipart(frames)
        dealer.poll(500)
        dealer.close(linger=0)
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(f"tcp://127.0.0.1:{server.port}")
    req.send(b"\x93not-a-request")
    assert req.poll(5000)
    status, kind, _ = req.recv_multipart()
    assert (status, kind) == (b"err", b"bad_request")
    req.close(linger=0)
    # Still serving real requests.
    raw_payload = SideChannelClient().fetch(PeerKey("prefill", server.host, server.port, 0, 0), request(), timeout=5)
    assert raw_payload
    assert server.bad_requests >= 3


@pytest.fixture
def handshake_with(server: SideChannelServer):
    started = []

    def make(compat_hash: str = HASH, **cfg):
        ps = ProbeSet(PushConfig(engine_id="decode", handshake_timeout=1.0, **cfg))
        ref = Handshake.start(ps.ctx, SideChannelClient(), compat_hash)
        started.append((ps, ref))
        return ps, ref

    yield make
    for ps, ref in started:
        ref.stop()
        ps.stop()


def test_handshake_actor_over_zmq(server, handshake_with) -> None:
    ps, ref = handshake_with()
    ref.tell(FetchPeer(peer=PeerKey("prefill", server.host, server.port, 0, 1), full=True))
    done = ps.probe("writer").wait_for(HandshakeCompleted)[0]
    assert done.info.agent_name == "prefill-tp1"
    assert abs(done.clock_offset) < 1.0  # one host: the monotonic clocks agree


@pytest.mark.parametrize(
    ("case", "kind"),
    [("down", "refused"), ("hash", "incompatible"), ("engine", "wrong_engine"), ("rank", "not_ready")],
)
def test_handshake_failures_become_messages(server, handshake_with, case: str, kind: str) -> None:
    compat = compatibility_hash(CompatSpec(model="other")) if case == "hash" else HASH
    ps, ref = handshake_with(compat)
    port = free_port() if case == "down" else server.port
    engine = "someone-else" if case == "engine" else "prefill"
    tp = 7 if case == "rank" else 0
    ref.tell(FetchPeer(peer=PeerKey(engine, "127.0.0.1", port, 0, tp), full=True))
    failed = ps.probe("writer").wait_for(HandshakeFailed, timeout=10)[0]
    assert failed.kind == kind
    assert not ps.probe("writer").of(HandshakeCompleted)
