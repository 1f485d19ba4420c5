"""Actor-level tests of the handshake actor over an InProcessDirectory (SPEC §2 handshake)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from pushactors.actors.handshake import Handshake
from pushactors.config import PushConfig
from pushactors.directory import DirectoryEndpoint, InProcessDirectory
from pushactors.protocol import (
    PROTOCOL_VERSION,
    AgentInfo,
    ClockSample,
    CompatSpec,
    FetchPeer,
    HandshakeCompleted,
    HandshakeEnvelope,
    HandshakeFailed,
    PeerKey,
    RegionInfo,
    compatibility_hash,
    encode_handshake,
)
from pushactors.testing import ProbeSet, wait_until

pytestmark = pytest.mark.timeout(60)

HASH = compatibility_hash(CompatSpec(model="tiny", dtype="uint8", kv_shape=(64,), num_layers=2))
OTHER_HASH = compatibility_hash(CompatSpec(model="other", dtype="uint8", kv_shape=(64,), num_layers=2))


def make_info(engine: str = "decode", *, tp_rank: int = 0, tp_size: int = 1, agent: str | None = None) -> AgentInfo:
    return AgentInfo(
        engine_id=engine,
        agent_name=agent or f"{engine}-pp0-tp{tp_rank}",
        agent_metadata=b"fake-agent-metadata",
        mem_type="DRAM",
        tp_size=tp_size,
        tp_rank=tp_rank,
        block_size=16,
        regions=(RegionInfo(base_addr=1 << 20, block_len=64, stride=64, num_blocks=8, members=("layer.0",)),),
        clock=ClockSample(monotonic=0.0, wall=0.0),
    )


def peer_of(endpoint: DirectoryEndpoint, engine: str = "decode", *, tp_rank: int = 0) -> PeerKey:
    return PeerKey(engine, endpoint.host, endpoint.port, 0, tp_rank)


class Rig:
    def __init__(self, **config: Any) -> None:
        self.directory = InProcessDirectory()
        settings = {"handshake_timeout": 0.2, **config}
        self.ps = ProbeSet(config=PushConfig(engine_id="prefill", **settings))
        self.ref = Handshake.start(self.ps.ctx, self.directory, HASH)
        self.ps.replace("handshake", self.ref)
        self.writer = self.ps.probe("writer")
        self.metrics = self.ps.ctx.metrics

    def fetch(self, peer: PeerKey, *, full: bool = True) -> None:
        self.ref.tell(FetchPeer(peer=peer, full=full))

    def failure(self, peer: PeerKey, *, full: bool = True) -> HandshakeFailed:
        self.fetch(peer, full=full)
        (failed,) = self.writer.wait_for(HandshakeFailed)
        assert failed.peer == peer
        assert self.writer.of(HandshakeCompleted) == []
        return failed

    def settle(self) -> None:
        self.ref.proxy().handled.get(timeout=5)
        self.ps.refs["writer"].ask("barrier", timeout=5)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.ps.stop()


def test_fetch_completes_with_the_published_info(rig: Rig) -> None:
    endpoint = rig.directory.endpoint("decode-host")
    info = make_info()
    endpoint.publish(info, HASH)
    peer = peer_of(endpoint)
    before = time.monotonic()
    rig.fetch(peer, full=True)
    (done,) = rig.writer.wait_for(HandshakeCompleted)
    assert done.peer == peer
    assert done.full is True
    # Served with a fresh clock sample (for deadline rebasing); everything else as published.
    assert done.info.clock.monotonic >= before
    assert done.info == msgspec.structs.replace(info, clock=done.info.clock)
    (fetched_peer, request) = rig.directory.fetches[0]
    assert fetched_peer == peer
    assert (request.pp_rank, request.tp_rank) == (0, 0)
    assert request.requester_engine_id == "prefill"
    assert rig.metrics.get("handshake.completed") == 1


def test_notif_only_fetch_reports_full_false(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(), HASH)
    rig.fetch(peer_of(endpoint), full=False)
    (done,) = rig.writer.wait_for(HandshakeCompleted)
    assert done.full is False


def test_refused(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(), HASH)
    rig.directory.refused.add((endpoint.host, endpoint.port))
    assert rig.failure(peer_of(endpoint)).kind == "refused"


def test_nothing_listening_is_refused(rig: Rig) -> None:
    assert rig.failure(PeerKey("decode", "nowhere", 1, 0, 0)).kind == "refused"


def test_timeout(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(), HASH)
    rig.directory.delays[(endpoint.host, endpoint.port)] = 0.5  # > handshake_timeout 0.2
    failed = rig.failure(peer_of(endpoint))
    assert failed.kind == "timeout"
    assert rig.metrics.get("handshake.failed.timeout") == 1


def test_incompatible_hash(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(), OTHER_HASH)
    assert rig.failure(peer_of(endpoint)).kind == "incompatible"


def test_wrong_engine(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info("decode"), HASH)
    assert rig.failure(peer_of(endpoint, engine="decode-2")).kind == "wrong_engine"


@pytest.mark.parametrize(
    "tamper",
    [
        lambda _raw: b"\x00\x01 not msgpack at all",
        lambda _raw: msgspec.msgpack.encode({"a": 1}),
        lambda _raw: msgspec.msgpack.encode(HandshakeEnvelope(PROTOCOL_VERSION, HASH, b"\xc1junk body")),
        lambda raw: raw[: len(raw) // 2],
    ],
    ids=["garbage", "not-an-envelope", "garbage-body", "truncated"],
)
def test_garbage(rig: Rig, tamper: Any) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(), HASH)
    rig.directory.tamper[(endpoint.host, endpoint.port)] = tamper
    assert rig.failure(peer_of(endpoint)).kind == "garbage"


def test_other_protocol_version(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(), HASH)
    rig.directory.tamper[(endpoint.host, endpoint.port)] = lambda raw: msgspec.msgpack.encode(
        HandshakeEnvelope(PROTOCOL_VERSION + 1, HASH, b"")
    )
    assert rig.failure(peer_of(endpoint)).kind == "version"


def test_not_ready(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(tp_size=2, tp_rank=0), HASH)
    assert rig.failure(peer_of(endpoint, tp_rank=1)).kind == "not_ready"


def test_wrong_rank_in_payload(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(tp_size=2, tp_rank=1), HASH)
    rank0 = encode_handshake(make_info(tp_size=2, tp_rank=0), HASH)
    rig.directory.tamper[(endpoint.host, endpoint.port)] = lambda _raw: rank0
    assert rig.failure(peer_of(endpoint, tp_rank=1)).kind == "wrong_rank"


def test_concurrent_fetches_of_one_peer_share_one_fetch() -> None:
    rig = Rig(handshake_timeout=5.0)
    try:
        endpoint = rig.directory.endpoint()
        endpoint.publish(make_info(), HASH)
        rig.directory.delays[(endpoint.host, endpoint.port)] = 0.3
        peer = peer_of(endpoint)
        for i in range(20):
            rig.fetch(peer, full=i % 2 == 1)  # a later full request upgrades the joined fetch
        (done,) = rig.writer.wait_for(HandshakeCompleted, timeout=5)
        assert done.full is True
        rig.settle()
        assert len(rig.writer.of(HandshakeCompleted)) == 1
        assert len(rig.directory.fetches) == 1
        assert rig.metrics.get("handshake.started") == 1
        # Once settled, a new request fetches again (the writer asks only when it needs to).
        rig.directory.delays.clear()
        rig.fetch(peer)
        rig.writer.wait_for(HandshakeCompleted, count=2)
        assert len(rig.directory.fetches) == 2
    finally:
        rig.ps.stop()


def test_slow_peer_does_not_delay_a_fast_one() -> None:
    rig = Rig(handshake_timeout=5.0)
    try:
        slow_end = rig.directory.endpoint("slow-host")
        fast_end = rig.directory.endpoint("fast-host")
        slow_end.publish(make_info("slow"), HASH)
        fast_end.publish(make_info("fast"), HASH)
        rig.directory.delays[(slow_end.host, slow_end.port)] = 1.0
        slow, fast = peer_of(slow_end, "slow"), peer_of(fast_end, "fast")
        rig.fetch(slow)
        wait_until(lambda: len(rig.directory.fetches) == 1, timeout=5, what="the slow fetch to start")
        rig.fetch(fast)
        done = rig.writer.wait_for(HandshakeCompleted, count=2, timeout=5)
        assert [d.peer for d in done] == [fast, slow]
    finally:
        rig.ps.stop()


def test_failure_then_retry_succeeds(rig: Rig) -> None:
    endpoint = rig.directory.endpoint()
    endpoint.publish(make_info(), HASH)
    addr = (endpoint.host, endpoint.port)
    rig.directory.refused.add(addr)
    rig.failure(peer_of(endpoint))
    rig.directory.refused.discard(addr)
    rig.fetch(peer_of(endpoint))
    (done,) = rig.writer.wait_for(HandshakeCompleted)
    assert done.info.engine_id == "decode"


def test_stopping_with_a_fetch_in_flight_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    # A fetch that returns after the actor stopped is dropped, not a traceback in the logs.
    rig = Rig(handshake_timeout=5.0)
    try:
        endpoint = rig.directory.endpoint()
        endpoint.publish(make_info(), HASH)
        rig.directory.delays[(endpoint.host, endpoint.port)] = 0.2
        rig.fetch(peer_of(endpoint))
        wait_until(lambda: len(rig.directory.fetches) == 1, timeout=5, what="the fetch to start")
        prefix = f"pushactors-hs-{rig.ps.ctx.label}"
        with caplog.at_level(logging.ERROR):
            rig.ps.stop()
            wait_until(
                lambda: not any(t.name.startswith(prefix) for t in threading.enumerate()),
                timeout=5,
                what="the handshake pool to wind down",
            )
    finally:
        rig.ps.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
