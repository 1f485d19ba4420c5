"""Actor-level tests of the handshake actor over an InProcessDirectory (docs/protocol.md, 'Side channel')."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from pushactors.actors.handshake import PER_ADDRESS_IN_FLIGHT, Handshake
from pushactors.core.config import PushConfig
from pushactors.protocol import (
    PROTOCOL_VERSION,
    AgentInfo,
    ClockSample,
    CompatSpec,
    FetchPeer,
    HandshakeCompleted,
    HandshakeEnvelope,
    HandshakeFailed,
    HandshakeRequest,
    PeerKey,
    RegionInfo,
    compatibility_hash,
    encode_handshake,
)
from pushactors.testing import ActorRig, wait_until
from pushactors.transport.directory import DirectoryEndpoint, InProcessDirectory, MetadataSource, SideChannelError

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


class Rig(ActorRig):
    def __init__(self, source: MetadataSource | None = None, **config: Any) -> None:
        self.directory = source.directory if isinstance(source, GatedSource) else InProcessDirectory()
        settings = {"handshake_timeout": 0.2, **config}
        directory = self.directory
        super().__init__(
            "handshake",
            lambda ctx: Handshake.start(ctx, source or directory, HASH),
            PushConfig(engine_id="prefill", **settings),
        )
        self.writer = self.probe("writer")

    def fetch(self, peer: PeerKey, *, full: bool = True) -> None:
        self.ref.tell(FetchPeer(peer=peer, full=full))

    def failure(self, peer: PeerKey, *, full: bool = True) -> HandshakeFailed:
        self.fetch(peer, full=full)
        (failed,) = self.writer.wait_for(HandshakeFailed)
        assert failed.peer == peer
        assert self.writer.of(HandshakeCompleted) == []
        return failed


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


# --- the fetch pool: an unreachable peer delays only its own requests -----------------------------


class GatedSource:
    """An :class:`InProcessDirectory` whose gated addresses hang like an unreachable host.

    A fetch from a gated address blocks until its gate opens (then it is served normally) or
    ``hold`` seconds pass (then it times out), whatever timeout the caller gave: the test, not
    the clock, decides when it ends. Records what started and how many ran at once per address.
    """

    def __init__(self, hold: float = 30.0) -> None:
        self.directory = InProcessDirectory()
        self.hold = hold
        self.gates: dict[tuple[str, int], threading.Event] = {}
        self._lock = threading.Lock()
        self.started: list[PeerKey] = []
        self._running: Counter[tuple[str, int]] = Counter()
        self.peak: Counter[tuple[str, int]] = Counter()

    def gate(self, endpoint: DirectoryEndpoint) -> threading.Event:
        return self.gates.setdefault((endpoint.host, endpoint.port), threading.Event())

    def open_all(self) -> None:
        for gate in list(self.gates.values()):
            gate.set()

    def started_at(self, endpoint: DirectoryEndpoint) -> list[PeerKey]:
        with self._lock:
            return [p for p in self.started if (p.host, p.port) == (endpoint.host, endpoint.port)]

    def fetch(self, peer: PeerKey, request: HandshakeRequest, timeout: float) -> bytes:
        addr = (peer.host, peer.port)
        with self._lock:
            self.started.append(peer)
            self._running[addr] += 1
            self.peak[addr] = max(self.peak[addr], self._running[addr])
        try:
            gate = self.gates.get(addr)
            if gate is not None and not gate.wait(self.hold):
                raise SideChannelError("timeout", f"no reply from {addr}")
            return self.directory.fetch(peer, request, timeout)
        finally:
            with self._lock:
                self._running[addr] -= 1


class PoolRig(Rig):
    def __init__(self, **config: Any) -> None:
        self.source = GatedSource()
        super().__init__(self.source, **config)

    def endpoint(self, host: str, engine: str, *, ranks: int = 1, gated: bool = False) -> DirectoryEndpoint:
        endpoint = self.directory.endpoint(host)
        for rank in range(ranks):
            endpoint.publish(make_info(engine, tp_rank=rank, tp_size=ranks), HASH)
        if gated:
            self.source.gate(endpoint)
        return endpoint

    def close(self) -> None:
        self.source.open_all()  # let hung fetches return so their threads end
        self.ps.stop()


def hs_threads(rig: Rig) -> list[threading.Thread]:
    prefix = f"pushactors-hs-{rig.ps.ctx.label}"
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_unreachable_peers_do_not_delay_a_healthy_one() -> None:
    # The regression: four workers and six hung peers used to queue every other handshake
    # behind the hung ones for a whole handshake_timeout.
    rig = PoolRig(handshake_workers=4, handshake_timeout=30.0)
    try:
        dead = [rig.endpoint(f"dead-{i}", f"dead-{i}", gated=True) for i in range(6)]
        healthy = rig.endpoint("healthy-host", "healthy")
        for i, endpoint in enumerate(dead):
            rig.fetch(peer_of(endpoint, f"dead-{i}"))
        wait_until(lambda: len(rig.source.started) == 6, timeout=5, what="all six hung fetches to be on the wire")
        assert all(t.daemon for t in hs_threads(rig))
        peer = peer_of(healthy, "healthy")
        started = time.monotonic()
        rig.fetch(peer)
        (done,) = rig.writer.wait_for(HandshakeCompleted, timeout=5)  # far below the 30 s timeout
        assert done.peer == peer
        assert time.monotonic() - started < 5
        assert rig.writer.of(HandshakeFailed) == []
        assert rig.metrics.get("handshake.queued") == 0
    finally:
        rig.close()


def test_ranks_of_a_hung_address_wait_behind_it_only() -> None:
    rig = PoolRig(handshake_timeout=30.0)
    try:
        hung = rig.endpoint("hung-host", "hung", ranks=8, gated=True)
        other = rig.endpoint("other-host", "other", ranks=2)
        hung_peers = [peer_of(hung, "hung", tp_rank=r) for r in range(8)]
        other_peers = [peer_of(other, "other", tp_rank=r) for r in range(2)]
        for peer in hung_peers:
            rig.fetch(peer)
        wait_until(lambda: len(rig.source.started) == 1, timeout=5, what="the first hung fetch")
        for peer in other_peers:
            rig.fetch(peer)
        done = rig.writer.wait_for(HandshakeCompleted, count=2, timeout=5)
        assert {d.peer for d in done} == set(other_peers)
        # The hung address holds one slot; its other ranks wait behind it, not on the wire.
        assert rig.source.started_at(hung) == hung_peers[:1]
        assert rig.metrics.get("handshake.queued") == 7 + 1  # other's rank 1 waited for rank 0
        rig.source.gate(hung).set()
        done = rig.writer.wait_for(HandshakeCompleted, count=10, timeout=5)
        assert {d.peer for d in done} == set(hung_peers) | set(other_peers)
        assert rig.source.started_at(hung) == hung_peers  # in order, each once
        assert rig.source.peak[(hung.host, hung.port)] == PER_ADDRESS_IN_FLIGHT
    finally:
        rig.close()


def test_queued_addresses_are_served_in_turn() -> None:
    # With one slot, an address with many ranks queued first must not go before every rank of
    # an address queued after it: addresses take turns.
    rig = PoolRig(max_handshakes_in_flight=1, handshake_timeout=30.0)
    try:
        blocker = rig.endpoint("blocker-host", "blocker", gated=True)
        many = rig.endpoint("many-host", "many", ranks=4)
        one = rig.endpoint("one-host", "one")
        rig.fetch(peer_of(blocker, "blocker"))
        wait_until(lambda: len(rig.source.started) == 1, timeout=5, what="the blocker to start")
        many_peers = [peer_of(many, "many", tp_rank=r) for r in range(4)]
        for peer in many_peers:
            rig.fetch(peer)
        rig.fetch(peer_of(one, "one"))
        rig.settle()
        assert len(rig.source.started) == 1
        rig.source.gate(blocker).set()
        rig.writer.wait_for(HandshakeCompleted, count=6, timeout=5)
        assert rig.source.started[1:] == [many_peers[0], peer_of(one, "one"), *many_peers[1:]]
        assert max(rig.source.peak.values()) == 1
    finally:
        rig.close()


def test_in_flight_bound_queues_then_starts() -> None:
    rig = PoolRig(max_handshakes_in_flight=2, handshake_timeout=30.0)
    try:
        ends = [rig.endpoint(f"host-{i}", f"engine-{i}", gated=True) for i in range(3)]
        peers = [peer_of(e, f"engine-{i}") for i, e in enumerate(ends)]
        for peer in peers:
            rig.fetch(peer)
        wait_until(lambda: len(rig.source.started) == 2, timeout=5, what="two fetches to start")
        rig.settle()
        assert rig.source.started == peers[:2]  # the third waits for a slot
        assert rig.metrics.get("handshake.queued") == 1
        rig.source.gate(ends[0]).set()
        rig.writer.wait_for(HandshakeCompleted, timeout=5)
        wait_until(lambda: len(rig.source.started) == 3, timeout=5, what="the queued fetch to start")
        assert rig.source.started[2] == peers[2]
        rig.source.open_all()
        done = rig.writer.wait_for(HandshakeCompleted, count=3, timeout=5)
        # The first finished first (its gate opened alone); the other two race each other.
        assert done[0].peer == peers[0] and {d.peer for d in done} == set(peers)
        assert rig.metrics.get("handshake.started") == 3
    finally:
        rig.close()


def test_a_fetch_queued_past_the_timeout_fails_without_running() -> None:
    rig = PoolRig(max_handshakes_in_flight=1, handshake_timeout=0.3)
    try:
        hung = rig.endpoint("hung-host", "hung", gated=True)  # hangs past the timeout
        healthy = rig.endpoint("healthy-host", "healthy")
        rig.fetch(peer_of(hung, "hung"))
        wait_until(lambda: len(rig.source.started) == 1, timeout=5, what="the hung fetch to start")
        peer = peer_of(healthy, "healthy")
        queued_at = time.monotonic()
        rig.fetch(peer)
        (failed,) = rig.writer.wait_for(HandshakeFailed, timeout=5)
        waited = time.monotonic() - queued_at
        assert failed.peer == peer
        assert failed.kind == "timeout"
        assert 0.3 <= waited < 3  # failed on its own deadline, while the hung fetch still runs
        assert rig.source.started_at(healthy) == []
        assert rig.metrics.get("handshake.queue_expired") == 1
        assert rig.metrics.get("handshake.failed.timeout") == 1
        # The slot is still usable: the hung fetch completes, and a new request runs.
        rig.source.gate(hung).set()
        rig.writer.wait_for(HandshakeCompleted, timeout=5)
        rig.fetch(peer)
        rig.writer.wait_for(HandshakeCompleted, count=2, timeout=5)
        assert rig.source.started_at(healthy) == [peer]
    finally:
        rig.close()


def test_a_queued_fetch_is_joined_and_upgraded() -> None:
    rig = PoolRig(handshake_timeout=30.0)
    try:
        hung = rig.endpoint("hung-host", "hung", ranks=2, gated=True)
        first, second = peer_of(hung, "hung", tp_rank=0), peer_of(hung, "hung", tp_rank=1)
        rig.fetch(first)
        rig.fetch(second, full=False)  # queued behind its address
        rig.fetch(second, full=True)  # joins the queued fetch and upgrades it
        rig.settle()
        assert rig.metrics.get("handshake.joined") == 1
        rig.source.gate(hung).set()
        done = rig.writer.wait_for(HandshakeCompleted, count=2, timeout=5)
        assert [(d.peer, d.full) for d in done] == [(first, True), (second, True)]
        assert rig.source.started == [first, second]
    finally:
        rig.close()


def test_stop_fails_pending_fetches_as_shutdown() -> None:
    rig = PoolRig(max_handshakes_in_flight=1, handshake_timeout=30.0)
    try:
        ends = [rig.endpoint(f"host-{i}", f"engine-{i}", gated=True) for i in range(3)]
        peers = [peer_of(e, f"engine-{i}") for i, e in enumerate(ends)]
        for peer in peers:
            rig.fetch(peer)
        wait_until(lambda: len(rig.source.started) == 1, timeout=5, what="the first fetch to start")
        assert all(t.daemon for t in hs_threads(rig))  # a hung peer never keeps the process alive
        rig.ref.stop(timeout=5)  # the writer (a probe) is still alive to hear about it
        failed = rig.writer.wait_for(HandshakeFailed, count=3, timeout=5)
        assert {f.peer for f in failed} == set(peers)  # the running one too: it can no longer answer
        assert {f.kind for f in failed} == {"shutdown"}
        assert rig.source.started == peers[:1]  # queued ones never ran
        assert rig.metrics.get("handshake.failed.shutdown") == 3
        rig.source.open_all()
        wait_until(lambda: not hs_threads(rig), timeout=5, what="the fetch threads to end")
        assert rig.writer.of(HandshakeCompleted) == []
    finally:
        rig.close()


def test_stop_with_the_writer_gone_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    rig = PoolRig(max_handshakes_in_flight=1, handshake_timeout=30.0)
    try:
        ends = [rig.endpoint(f"host-{i}", f"engine-{i}", gated=True) for i in range(2)]
        for i, endpoint in enumerate(ends):
            rig.fetch(peer_of(endpoint, f"engine-{i}"))
        wait_until(lambda: len(rig.source.started) == 1, timeout=5, what="the first fetch to start")
        with caplog.at_level(logging.ERROR):
            rig.ps.stop()  # stops the writer first, then the handshake actor
            rig.source.open_all()
            wait_until(lambda: not hs_threads(rig), timeout=5, what="the fetch threads to end")
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], [r.getMessage() for r in errors]
    finally:
        rig.close()
