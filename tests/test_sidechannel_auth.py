"""Authenticated side channel over real ZMQ on loopback: only keyed peers get (or give) metadata."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from test_sidechannel import HASH, info, request

from pushactors.actors.handshake import Handshake
from pushactors.core.config import PushConfig
from pushactors.protocol import (
    FetchPeer,
    HandshakeCompleted,
    HandshakeFailed,
    PeerKey,
    decode_handshake,
    encode_handshake_request,
)
from pushactors.testing import ProbeSet
from pushactors.transport.auth import Keyring, is_sealed
from pushactors.transport.directory import SideChannelError, fresh_payload
from pushactors.transport.sidechannel import SideChannelClient, SideChannelServer

SECRET = b"side-channel-secret-0001"
KEYS = {"k1": SECRET}


def keyring(keys: dict[str, bytes] | None = None, signer: str = "k1") -> Keyring:
    return Keyring(keys or KEYS, signer)


@pytest.fixture
def make_server() -> Iterator[Callable[[Keyring | None], SideChannelServer]]:
    servers: list[SideChannelServer] = []

    def make(ring: Keyring | None) -> SideChannelServer:
        srv = SideChannelServer("127.0.0.1", 0, engine_id="prefill", keyring=ring)
        srv.publish(info(), HASH)
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


def fetch(client: SideChannelClient, srv: SideChannelServer, tp_rank: int = 0) -> bytes:
    return client.fetch(PeerKey("prefill", srv.host, srv.port, 0, tp_rank), request(tp_rank), timeout=5)


def refused(client: SideChannelClient, srv: SideChannelServer) -> SideChannelError:
    with pytest.raises(SideChannelError) as err:
        fetch(client, srv)
    return err.value


def test_signed_client_and_server(make_server) -> None:
    srv = make_server(keyring())
    raw = fetch(SideChannelClient(keyring=keyring()), srv)
    assert not is_sealed(raw)  # the client hands on the opened payload
    got = decode_handshake(raw, expected_hash=HASH, expected_engine="prefill")
    assert got.agent_name == "prefill-tp0"
    assert srv.unauthorized == 0 and [i.engine_id for i in srv.introductions] == ["decode"]


def test_rotation_across_the_wire(make_server) -> None:
    both = {"k1": SECRET, "k2": b"the-next-secret-000002"}
    srv = make_server(keyring(both, "k1"))
    assert fetch(SideChannelClient(keyring=keyring(both, "k2")), srv)  # signed with the new key
    assert fetch(SideChannelClient(keyring=keyring({"k1": SECRET})), srv)  # old key still listed
    assert srv.unauthorized == 0


def test_unsigned_client_to_signed_server(make_server) -> None:
    srv = make_server(keyring())
    err = refused(SideChannelClient(), srv)
    assert err.kind == "unauthorized" and "missing" in err.detail
    assert srv.unauthorized == 1 and srv.introductions == []
    # The listener keeps serving: the next good request is answered.
    assert fetch(SideChannelClient(keyring=keyring()), srv)
    assert refused(SideChannelClient(), srv).kind == "unauthorized"
    assert srv.unauthorized == 2 and len(srv.introductions) == 1


@pytest.mark.parametrize(
    "client_keys", [{"k1": b"another-secret-of-k1!"}, {"k9": SECRET}], ids=["same-id-other-secret", "unknown-id"]
)
def test_signed_client_with_another_key(make_server, client_keys) -> None:
    srv = make_server(keyring())
    signer = next(iter(client_keys))
    err = refused(SideChannelClient(keyring=keyring(client_keys, signer)), srv)
    assert err.kind == "unauthorized"
    assert srv.unauthorized == 1 and srv.introductions == []
    assert fetch(SideChannelClient(keyring=keyring()), srv)


def test_keyed_client_to_unsigned_server(make_server) -> None:
    srv = make_server(None)
    err = refused(SideChannelClient(keyring=keyring()), srv)
    assert err.kind == "unauthorized"
    assert srv.introductions == []  # the unsigned server could not even read the request


def test_unsigned_pair_is_unchanged(make_server) -> None:
    srv = make_server(None)
    raw = fetch(SideChannelClient(), srv)
    assert decode_handshake(raw, expected_hash=HASH, expected_engine="prefill").tp_rank == 0
    assert srv.unauthorized == 0


def test_authentic_errors_keep_their_kind(make_server) -> None:
    srv = make_server(keyring())
    with pytest.raises(SideChannelError) as err:
        fetch(SideChannelClient(keyring=keyring()), srv, tp_rank=3)
    assert err.value.kind == "not_ready" and "not registered" in err.value.detail


def raw_exchange(srv: SideChannelServer, body: bytes) -> list[bytes]:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{srv.port}")
        sock.send(body)
        assert sock.poll(5000)
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)


def test_server_refuses_stale_and_misplaced_requests(make_server) -> None:
    ring = keyring()
    srv = make_server(ring)
    body = encode_handshake_request(request())
    stale = ring.seal(b"hs-req", body, now=time.time() - 3600)
    wrong_context = ring.seal(b"hs-reply", body)
    tampered = ring.seal(b"hs-req", body)[:-1] + b"\x00"
    for forged, why in [(stale, b"stale"), (wrong_context, b"bad_mac"), (tampered, b"bad_mac")]:
        status, kind, detail = raw_exchange(srv, forged)
        assert (status, kind) == (b"err", b"unauthorized") and why in detail
    assert srv.unauthorized == 3 and srv.introductions == []
    ok, payload = raw_exchange(srv, ring.seal(b"hs-req", body))
    assert ok == b"ok" and is_sealed(payload)
    assert decode_handshake(ring.open(b"hs-reply", payload), expected_hash=HASH, expected_engine="prefill")


def fake_server(reply: Callable[[bytes], list[bytes]]) -> tuple[int, Callable[[], None]]:
    """A ROUTER that answers one request with ``reply(request)``."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if sock.poll(5000):
            ident, empty, body = sock.recv_multipart()
            sock.send_multipart([ident, empty, *reply(body)])

    t = threading.Thread(target=answer)
    t.start()

    def done() -> None:
        t.join()
        sock.close(linger=0)

    return port, done


def payload_of(srv_ring: Keyring | None) -> bytes:
    raw = fresh_payload(info(), HASH)
    return raw if srv_ring is None else srv_ring.seal(b"hs-reply", raw)


@pytest.mark.parametrize(
    ("name", "reply"),
    [
        ("unsealed-ok", lambda _req: [b"ok", payload_of(None)]),
        ("other-key-ok", lambda _req: [b"ok", payload_of(keyring({"k1": b"not-the-right-secret"}))]),
        ("reply-as-request", lambda req: [b"ok", req]),  # a request echoed back cannot pass as a reply
        ("unsealed-error", lambda _req: [b"err", b"not_ready", b"try later"]),
        ("error-moved-kind", lambda _req: [b"err", b"bad_request", keyring().seal(b"hs-err:not_ready", b"x")]),
    ],
)
def test_keyed_client_believes_nothing_unauthenticated(name: str, reply) -> None:
    port, done = fake_server(reply)
    try:
        with pytest.raises(SideChannelError) as err:
            SideChannelClient(keyring=keyring()).fetch(PeerKey("prefill", "127.0.0.1", port, 0, 0), request(), 5)
        assert err.value.kind == "unauthorized", name
    finally:
        done()


@pytest.mark.parametrize(("client_ring", "outcome"), [(True, HandshakeCompleted), (False, HandshakeFailed)])
def test_handshake_actor_with_auth(make_server, client_ring: bool, outcome) -> None:
    srv = make_server(keyring())
    ps = ProbeSet(PushConfig(engine_id="decode", handshake_timeout=2.0))
    ref = Handshake.start(ps.ctx, SideChannelClient(keyring=keyring() if client_ring else None), HASH)
    try:
        ref.tell(FetchPeer(peer=PeerKey("prefill", srv.host, srv.port, 0, 0), full=True))
        msg = ps.probe("writer").wait_for(outcome, timeout=10)[0]
        if outcome is HandshakeFailed:
            assert msg.kind == "unauthorized"
        else:
            assert msg.info.agent_name == "prefill-tp0"
    finally:
        ref.stop()
        ps.stop()
