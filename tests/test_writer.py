"""Actor-level tests of the writer over the fake NIXL fabric: real bytes, probes for its peers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from pushactors.actors.writer.actor import Writer
from pushactors.core.blocks import KVLayout, PairedLayout
from pushactors.core.config import PushConfig
from pushactors.protocol import (
    Abort,
    AbortArrived,
    CancelPush,
    ClearLease,
    ExpireLease,
    FetchPeer,
    Forget,
    HandshakeCompleted,
    HandshakeFailed,
    HeartbeatArrived,
    MemoryRegistered,
    PeerKey,
    PostPush,
    PushFailure,
    RecvNotified,
    RecvUndelivered,
    RefuseRegistration,
    RegisterMemory,
    Registration,
    RegistrationArrived,
    SendAbort,
    SendRegistration,
    decode_notification,
    encode_abort,
    encode_completion,
    encode_heartbeat,
    encode_push_failure,
    encode_registration,
)
from pushactors.testing import ActorRig, FakeFabric, FakeNixlAgent, agent_info, registration, wait_until

pytestmark = pytest.mark.timeout(60)

BLOCK = 64  # bytes per block
NBLOCKS = 8
LAYERS = ("layer.0", "layer.1")
D_PEER = PeerKey("decode", "decode-host", 31000, 0, 0)
P_PEER = PeerKey("prefill", "prefill-host", 32000, 0, 0)


def kv_tensors(fill: bool) -> dict[str, torch.Tensor]:
    out = {}
    for li, name in enumerate(LAYERS):
        t = torch.zeros((NBLOCKS, BLOCK), dtype=torch.uint8)
        if fill:
            for b in range(NBLOCKS):
                t[b] = (li * 100 + b * 7 + 1) % 251
                t[b, :4] = torch.tensor([li, b, 0xAB, 0xCD], dtype=torch.uint8)
        out[name] = t
    return out


def register_request(layout: KVLayout) -> RegisterMemory:
    return RegisterMemory(
        regions=layout.region_infos,
        memory=layout.memory,
        mem_type=layout.mem_type,
        block_size=layout.block_size,
        physical_blocks_per_logical=layout.physical_blocks_per_logical,
    )


def make_reg(d_id: str, blocks: tuple[int, ...], *, rank: int = 0, tid: str | None = None) -> Registration:
    return registration(d_id, blocks, rank=rank, tid=tid)


def push(p_id: str, p_blocks: tuple[int, ...], d_id: str, d_blocks: tuple[int, ...]) -> PostPush:
    return PostPush(request_id=p_id, block_ids=(p_blocks,), registration=make_reg(d_id, d_blocks), expected_targets=1)


class Inbox:
    """Everything a directly driven fake agent received, accumulated across polls."""

    def __init__(self, agent: FakeNixlAgent) -> None:
        self.agent = agent
        self.raw: list[tuple[str, bytes]] = []

    def poll(self) -> list[tuple[str, bytes]]:
        for sender, msgs in self.agent.get_new_notifs().items():
            self.raw.extend((sender, m) for m in msgs)
        return self.raw

    def wait(self, count: int = 1, timeout: float = 5.0) -> list[tuple[str, bytes]]:
        wait_until(lambda: len(self.poll()) >= count, timeout=timeout, what=f"{count} notifications")
        return self.raw

    def decoded(self) -> list[Any]:
        return [decode_notification(raw) for _, raw in self.poll()]


class PRig(ActorRig):
    """A real P writer (engine "prefill") between probes, and a D agent driven by the test."""

    def __init__(self, fabric: FakeFabric, **config: Any) -> None:
        self.fabric = fabric
        super().__init__(
            "writer", lambda ctx: Writer.start(ctx, fabric), PushConfig(engine_id="prefill", reaper_tick=0.01, **config)
        )
        self.reaper = self.probe("reaper")
        self.matcher = self.probe("matcher")
        self.handshake = self.probe("handshake")
        self.sent: set[str] = set()
        self.send_failed: dict[str, str] = {}
        try:
            self._setup(fabric)
        except BaseException:
            self.stop()
            raise

    def _setup(self, fabric: FakeFabric) -> None:
        self.sizes()  # on_start (agent creation) has run
        self.agent = fabric.get(self.ctx.agent_name)
        self.p_kv = kv_tensors(fill=True)
        self.p_layout = KVLayout.from_tensors(self.p_kv, block_size=16)
        reply = self.ref.ask(register_request(self.p_layout), timeout=5)
        assert isinstance(reply, MemoryRegistered) and not reply.error, reply
        # D: a fake agent with its own registered tensors.
        self.d_kv = kv_tensors(fill=False)
        self.d_layout = KVLayout.from_tensors(self.d_kv, block_size=16)
        self.d_agent = fabric.agent("decode-pp0-tp0")
        self.d_agent.register_memory(
            np.array([(m.addr, m.length, m.device_id) for m in self.d_layout.memory], dtype=np.uint64), "DRAM"
        )
        self.d_info = agent_info("decode", self.d_agent, self.d_layout)
        self.d_inbox = Inbox(self.d_agent)

    def connect_d(self) -> None:
        self.tell(HandshakeCompleted(peer=D_PEER, info=self.d_info, full=True))
        self.sizes()  # handled: notifications polled from now on know D's agent

    def pull(self) -> None:
        report = self.ctx.outbox.drain()
        self.sent |= set(report.finished_sending)
        self.send_failed.update(report.failed_sending)

    def wait_sent(self, *rids: str, timeout: float = 5.0) -> None:
        def done() -> bool:
            self.pull()
            return set(rids) <= self.sent

        wait_until(done, timeout=timeout, what=f"{rids} finished sending")

    def p_block(self, layer: str, b: int) -> torch.Tensor:
        return self.p_kv[layer][b]

    def d_block(self, layer: str, b: int) -> torch.Tensor:
        return self.d_kv[layer][b]

    def assert_landed(self, mapping: dict[int, int]) -> None:
        """D block d holds P block p for every (d: p), in every layer; other D blocks untouched."""
        for layer in LAYERS:
            for d in range(NBLOCKS):
                if d in mapping:
                    assert torch.equal(self.d_block(layer, d), self.p_block(layer, mapping[d])), (layer, d)
                else:
                    assert int(self.d_block(layer, d).count_nonzero()) == 0, (layer, d)


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


@pytest.fixture
def rig(fabric: FakeFabric) -> Iterator[PRig]:
    r = PRig(fabric)
    try:
        yield r
    finally:
        r.stop()


# ------------------------------------------------------------------------------------------------
# P: pushes
# ------------------------------------------------------------------------------------------------
def test_register_memory_twice_is_refused(rig: PRig) -> None:
    reply = rig.ref.ask(register_request(rig.p_layout), timeout=5)
    assert reply.error


def test_push_writes_exactly_the_registered_blocks(rig: PRig) -> None:
    rig.connect_d()
    rig.tell(push("p-1", (0, 1, 2, 3), "d-1", (4, 5, 6, 7)))
    rig.wait_sent("p-1")
    assert rig.send_failed == {}
    rig.assert_landed({4: 0, 5: 1, 6: 2, 7: 3})
    assert rig.d_inbox.wait() == [(rig.agent.name, b"d-1:1")]
    (clear,) = rig.reaper.wait_for(ClearLease)
    assert clear.request_id == "p-1"
    (forget,) = rig.matcher.wait_for(Forget)
    assert forget == Forget(request_id="p-1", outcome="pushed")
    assert rig.fabric.stats.transfers_done == 1
    assert rig.fabric.stats.bytes_moved == 4 * BLOCK * len(LAYERS)


def test_push_keeps_p_last_blocks_when_d_registers_fewer(rig: PRig) -> None:
    rig.connect_d()
    # D had a prefix cached: it registers only its 2-block suffix; P must send its LAST 2 blocks.
    rig.tell(push("p-1", (0, 1, 2, 3, 4, 5), "d-1", (1, 2)))
    rig.wait_sent("p-1")
    assert rig.send_failed == {}
    rig.assert_landed({1: 4, 2: 5})
    assert rig.d_inbox.wait() == [(rig.agent.name, b"d-1:1")]


def test_pushes_wait_for_one_handshake_and_replay(rig: PRig) -> None:
    rig.tell(push("p-1", (0, 1), "d-1", (2, 3)), push("p-2", (4,), "d-2", (6,)))
    (fetch,) = rig.handshake.wait_for(FetchPeer)
    assert fetch == FetchPeer(peer=D_PEER, full=True)
    rig.settle()
    assert len(rig.handshake.of(FetchPeer)) == 1
    assert rig.sizes()["awaiting"] == 2
    assert rig.fabric.stats.transfers_posted == 0
    rig.connect_d()
    rig.wait_sent("p-1", "p-2")
    assert rig.send_failed == {}
    rig.assert_landed({2: 0, 3: 1, 6: 4})
    assert sorted(raw for _, raw in rig.d_inbox.wait(2)) == [b"d-1:1", b"d-2:1"]
    assert rig.sizes()["awaiting"] == 0


def test_failed_handshake_fails_the_pushes(rig: PRig) -> None:
    rig.tell(push("p-1", (0,), "d-1", (2,)), push("p-2", (1,), "d-2", (3,)))
    rig.handshake.wait_for(FetchPeer)
    rig.tell(HandshakeFailed(peer=D_PEER, kind="refused", reason="nothing listens"))
    rig.wait_sent("p-1", "p-2")
    for rid in ("p-1", "p-2"):
        assert "handshake" in rig.send_failed[rid]
    forgets = rig.matcher.wait_for(Forget, count=2)
    assert {f.outcome for f in forgets} == {"failed"}
    assert rig.fabric.stats.transfers_posted == 0
    rig.assert_landed({})


def test_transfer_that_raises_fails_the_push(rig: PRig) -> None:
    rig.connect_d()
    rig.fabric.faults.raise_on_transfer()
    rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
    rig.wait_sent("p-1")
    assert "p-1" in rig.send_failed
    ((_, raw),) = rig.d_inbox.wait()
    assert raw.startswith(b"PUSH_FAIL:")
    failure = decode_notification(raw)
    assert isinstance(failure, PushFailure) and failure.request_id == "d-1"
    (forget,) = rig.matcher.wait_for(Forget)
    assert forget.outcome == "failed"
    assert rig.agent.live_handles == 0
    assert rig.ctx.metrics.get("write.submit_failed") == 1
    rig.assert_landed({})


def test_transfer_that_ends_in_err_fails_the_push() -> None:
    fabric = FakeFabric(latency=0.02)  # the ERR is seen by polling, not at post
    rig = PRig(fabric)
    try:
        rig.connect_d()
        fabric.faults.err_transfer()
        rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
        rig.wait_sent("p-1")
        assert "ERR" in rig.send_failed["p-1"]
        ((_, raw),) = rig.d_inbox.wait()
        failure = decode_notification(raw)
        assert isinstance(failure, PushFailure) and failure.request_id == "d-1"
        assert rig.agent.live_handles == 0
        assert fabric.stats.transfers_err == 1
        rig.assert_landed({})
    finally:
        rig.stop()


def test_expired_lease_with_nothing_in_flight(rig: PRig) -> None:
    rig.tell(ExpireLease(request_id="p-x"))
    rig.wait_sent("p-x")
    assert rig.send_failed["p-x"] == "lease_expired"
    (forget,) = rig.matcher.wait_for(Forget)
    assert forget.outcome == "expired"
    rig.settle()
    # Every finish clears its lease: a no-op for the reaper's own expiry (it dropped the lease),
    # but an expiry from elsewhere (the matcher's failure) leaves it armed otherwise.
    assert rig.reaper.of(ClearLease) == [ClearLease(request_id="p-x", serial=0)]


def test_a_failure_from_the_matcher_with_a_push_live_clears_the_lease() -> None:
    """The matcher fails an entry (ExpireLease(failed=True) straight to the writer) while its
    push is live: the reaper never expired it, so the writer's finish must clear the lease or it
    outlives the request (a table the soak finds non-empty after settling)."""
    rig = PRig(FakeFabric())
    try:
        rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
        rig.handshake.wait_for(FetchPeer)
        rig.tell(ExpireLease(request_id="p-1", reason="ambiguous", failed=True))
        rig.wait_sent("p-1")
        rig.settle()
        assert [c.request_id for c in rig.reaper.of(ClearLease)] == ["p-1"]
    finally:
        rig.stop()


def test_expired_lease_while_waiting_for_handshake_never_writes(rig: PRig) -> None:
    rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
    rig.handshake.wait_for(FetchPeer)
    rig.tell(ExpireLease(request_id="p-1"))
    rig.wait_sent("p-1")
    assert "p-1" in rig.send_failed
    rig.connect_d()  # the deferred WRITE must not fire from freed blocks
    ((_, raw),) = rig.d_inbox.wait()
    failure = decode_notification(raw)
    assert isinstance(failure, PushFailure) and failure.request_id == "d-1"
    rig.settle()
    assert rig.fabric.stats.transfers_posted == 0
    rig.assert_landed({})


def test_expired_lease_with_write_in_flight_is_reported_after_it_settles(rig: PRig) -> None:
    rig.connect_d()
    gate = rig.fabric.faults.hold_transfer()
    rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
    wait_until(lambda: rig.fabric.in_flight() == 1, timeout=5, what="WRITE in flight")
    rig.tell(ExpireLease(request_id="p-1"))
    rig.settle()
    assert rig.sizes()["in_flight"] == 1
    rig.pull()
    assert "p-1" not in rig.sent  # the WRITE still reads P's blocks: they are not free
    assert rig.matcher.of(Forget) == []
    gate.open()
    rig.wait_sent("p-1")
    rig.assert_landed({2: 0, 3: 1})
    assert rig.d_inbox.wait() == [(rig.agent.name, b"d-1:1")]
    assert rig.agent.live_handles == 0


def test_cancel_before_the_handshake_never_writes(rig: PRig) -> None:
    rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
    rig.handshake.wait_for(FetchPeer)
    rig.tell(CancelPush(request_id="p-1", d_request_id="d-1", decode_tp_rank=0))
    rig.wait_sent("p-1")
    assert "abort" in rig.send_failed["p-1"]
    rig.connect_d()
    ((_, raw),) = rig.d_inbox.wait()
    assert isinstance(decode_notification(raw), PushFailure)
    rig.settle()
    assert rig.fabric.stats.transfers_posted == 0


def test_push_after_the_request_finished_is_tombstoned(rig: PRig) -> None:
    rig.connect_d()
    rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
    rig.wait_sent("p-1")
    rig.d_inbox.wait()
    rig.tell(push("p-1", (0, 1), "d-9", (5, 6)))
    ((_, raw),) = rig.d_inbox.wait(2)[1:]
    failure = decode_notification(raw)
    assert isinstance(failure, PushFailure)
    assert failure.request_id == "d-9"
    assert "pushed" in failure.reason
    rig.settle()
    assert rig.fabric.stats.transfers_posted == 1
    rig.assert_landed({2: 0, 3: 1})


def test_refused_registration_is_answered_with_push_failure(rig: PRig) -> None:
    rig.connect_d()
    rig.tell(RefuseRegistration(registration=make_reg("d-r", (1,)), reason="aborted by decode"))
    ((_, raw),) = rig.d_inbox.wait()
    failure = decode_notification(raw)
    assert failure == PushFailure(request_id="d-r", reason="aborted by decode", tp_rank=0, pp_rank=0)


def test_block_ids_beyond_d_capacity_fail_without_writing(rig: PRig) -> None:
    rig.connect_d()
    rig.tell(push("p-1", (0,), "d-1", (NBLOCKS + 3,)))
    rig.wait_sent("p-1")
    assert "p-1" in rig.send_failed
    ((_, raw),) = rig.d_inbox.wait()
    assert isinstance(decode_notification(raw), PushFailure)
    assert rig.fabric.stats.transfers_posted == 0


# ------------------------------------------------------------------------------------------------
# Inbound notifications
# ------------------------------------------------------------------------------------------------
def test_inbound_notifications_are_routed(rig: PRig) -> None:
    sender = "decode-pp0-tp0"
    rig.connect_d()  # P knows D's agent: registrations from it are admitted at once
    reg = make_reg("d-1", (1, 2), tid="T-1")
    abort = Abort(request_id="d-3", transfer_id="T-3", reason="client went away")
    for raw in (
        encode_registration(reg),
        encode_completion("d-2", 2),
        encode_push_failure(PushFailure(request_id="d-4", reason="lease expired")),
        encode_heartbeat(["p-5", "T-6"]),
        encode_abort(abort),
    ):
        rig.agent.inject_notif(sender, raw)
    (arrived,) = rig.matcher.wait_for(RegistrationArrived)
    assert (arrived.registration, arrived.sender) == (reg, sender)
    assert arrived.capacity == (8,)  # what D advertised, for the matcher's capacity check
    # The pairing the matcher plans on: a pure layout and its id, never the writer's NIXL lists.
    assert isinstance(arrived.pairing, PairedLayout) and arrived.pairing_id > 0
    notified = rig.reaper.wait_for(RecvNotified, count=2)
    # The sender is named by the rank a handshake verified it as: the reaper counts only ranks
    # a request expects.
    assert RecvNotified(request_id="d-2", ok=True, sender=sender, peer=D_PEER) in notified
    assert RecvNotified(request_id="d-4", ok=False, sender=sender, reason="lease expired", peer=D_PEER) in notified
    (hb,) = rig.matcher.wait_for(HeartbeatArrived)
    assert hb == HeartbeatArrived(ids=("p-5", "T-6"), sender=sender)
    (ab,) = rig.matcher.wait_for(AbortArrived)
    assert ab == AbortArrived(abort=abort, sender=sender)
    assert rig.ctx.metrics.get("notif.malformed") == 0


def test_heartbeats_read_in_one_poll_reach_the_matcher_as_one_message_per_sender(rig: PRig) -> None:
    """A storm of one-id heartbeats (each its own notification) read in one poll is one
    HeartbeatArrived per sender, ids deduplicated in arrival order: whatever the matcher holds
    behind it (and the reaper behind that) waits for one message, not for 500. Another agent's
    heartbeats are never merged into the first one's (the matcher checks the sender per id)."""
    rig.connect_d()
    sender, other = "decode-pp0-tp0", "decode-pp0-tp1"
    ids = [f"p-{i % 120}" for i in range(500)]
    reg = make_reg("d-1", (1, 2), tid="T-1")
    storm = [encode_heartbeat([rid]) for rid in ids]
    rig.agent.inject_notifs(sender, [*storm[:250], encode_registration(reg), *storm[250:]])
    rig.agent.inject_notifs(other, [encode_heartbeat(["p-7"]), encode_heartbeat(["p-7", "p-8"])])
    (arrived,) = rig.matcher.wait_for(RegistrationArrived)
    assert arrived.registration == reg
    rig.matcher.wait_for(HeartbeatArrived, count=2)
    rig.settle()  # the poll that read them all has ended
    beats = rig.matcher.of(HeartbeatArrived)
    assert sorted(beats, key=lambda b: b.sender) == [
        HeartbeatArrived(ids=tuple(dict.fromkeys(ids)), sender=sender),
        HeartbeatArrived(ids=("p-7", "p-8"), sender=other),
    ]
    assert rig.ctx.metrics.get("notif.kind.heartbeat") == 502
    assert rig.ctx.metrics.get("heartbeat.coalesced") == 500


def test_heartbeats_in_one_poll_keep_the_earliest_promise(rig: PRig) -> None:
    """Merged heartbeats carry the earliest of their promises (D keeps every block it named
    until then at least); one without a promise leaves the merged one without any."""
    # D's clock runs 5 s ahead of ours, known to within 0.5 s: its promises are rebased.
    rig.tell(HandshakeCompleted(peer=D_PEER, info=rig.d_info, full=True, clock_offset=5.0, clock_error=0.5))
    rig.sizes()
    sender = "decode-pp0-tp0"
    rig.agent.inject_notifs(sender, [encode_heartbeat(["a"], 50.0), encode_heartbeat(["b", "a"], 40.0)])
    (first,) = rig.matcher.wait_for(HeartbeatArrived)
    rig.agent.inject_notifs(sender, [encode_heartbeat(["c"], 50.0), encode_heartbeat(["d"])])
    second = rig.matcher.wait_for(HeartbeatArrived, count=2)[1]
    rig.settle()
    assert first.ids == ("a", "b") and first.deadline == 40.0 - 5.0 - 0.5
    assert second.ids == ("c", "d") and second.deadline is None


def test_registration_from_unknown_d_waits_for_p_to_handshake_d(rig: PRig) -> None:
    reg = make_reg("d-v", (1,))
    rig.agent.inject_notif("decode-pp0-tp0", encode_registration(reg))
    (fetch,) = rig.handshake.wait_for(FetchPeer)
    assert fetch.peer == D_PEER and fetch.full  # verified against D's own side channel
    rig.settle()
    assert rig.matcher.of(RegistrationArrived) == []
    rig.connect_d()
    (arrived,) = rig.matcher.wait_for(RegistrationArrived)
    assert arrived.registration == reg


def test_registration_from_another_engines_agent_is_refused(rig: PRig) -> None:
    rig.connect_d()
    # Names D's engine and rank, but comes from an agent D's side channel does not advertise.
    rig.agent.inject_notif("intruder-pp0-tp0", encode_registration(make_reg("d-x", (1,))))
    rig.agent.inject_notif("decode-pp0-tp0", encode_registration(make_reg("d-y", (2,))))
    (arrived,) = rig.matcher.wait_for(RegistrationArrived)
    assert arrived.registration.request_id == "d-y"
    rig.settle()
    assert [a.registration.request_id for a in rig.matcher.of(RegistrationArrived)] == ["d-y"]
    assert rig.ctx.metrics.get("reg.rejected_sender") == 1


def test_malformed_notifications_are_dropped_and_counted(rig: PRig) -> None:
    sender = "decode-pp0-tp0"
    bad = [
        b"\xff\xfe\x00garbage",
        b"PUSH_REG:" + msgspec.msgpack.encode([1, 2, 3]),
        b"PUSH_REG:" + msgspec.msgpack.encode("a string"),
        b"PUSH_REG:\xc1",
        b"PUSH_REG:" + msgspec.msgpack.encode({"request_id": 5}),
        b"d-1:notanumber",
        b"no-separator",
        b":1",
        b"HB:",
        b"PUSH_FAIL:" + msgspec.msgpack.encode({"reason": "x"}),
        b"PUSH_ABORT:[]",
    ]
    for raw in bad:
        rig.agent.inject_notif(sender, raw)
    rig.agent.inject_notif(sender, encode_completion("d-ok", 1))
    (ok,) = rig.reaper.wait_for(RecvNotified)
    assert ok.request_id == "d-ok"
    assert rig.ctx.metrics.get("notif.malformed") == len(bad)
    rig.settle()
    assert [m for m in rig.matcher.messages if m != "barrier"] == []
    assert len(rig.reaper.of(RecvNotified)) == 1
    assert rig.ref.is_alive()
    # Still working: a real push goes through afterwards.
    rig.connect_d()
    rig.tell(push("p-1", (0,), "d-1", (1,)))
    rig.wait_sent("p-1")
    assert rig.send_failed == {}


# ------------------------------------------------------------------------------------------------
# D side: registrations to P
# ------------------------------------------------------------------------------------------------
class DRig(ActorRig):
    """A real D writer (engine "decode") between probes, and a P agent driven by the test."""

    def __init__(self, fabric: FakeFabric) -> None:
        self.fabric = fabric
        super().__init__(
            "writer", lambda ctx: Writer.start(ctx, fabric), PushConfig(engine_id="decode", reaper_tick=0.01)
        )
        self.reaper = self.probe("reaper")
        self.handshake = self.probe("handshake")
        try:
            self.ref.proxy().sizes().get(timeout=5)
            self.agent = fabric.get(self.ps.ctx.agent_name)
            self.p_agent = fabric.agent("prefill-pp0-tp0")
            layout = KVLayout.from_tensors(kv_tensors(fill=False), block_size=16)
            self.p_info = agent_info("prefill", self.p_agent, layout)
            self.p_inbox = Inbox(self.p_agent)
        except BaseException:
            self.ps.stop()
            raise

    def connect_p(self) -> None:
        self.ref.tell(HandshakeCompleted(peer=P_PEER, info=self.p_info, full=False))


@pytest.fixture
def drig(fabric: FakeFabric) -> Iterator[DRig]:
    r = DRig(fabric)
    try:
        yield r
    finally:
        r.ps.stop()


def test_registration_is_sent_to_a_loaded_p(drig: DRig) -> None:
    drig.connect_p()
    reg = make_reg("d-1", (4, 5), tid="T-1")
    drig.ref.tell(SendRegistration(registration=reg))
    ((sender, raw),) = drig.p_inbox.wait()
    assert sender == drig.agent.name
    assert raw.startswith(b"PUSH_REG:")
    assert decode_notification(raw) == reg
    assert drig.handshake.of(FetchPeer) == []


def test_registration_waits_for_a_notif_only_handshake(drig: DRig) -> None:
    regs = [make_reg("d-1", (4,)), make_reg("d-2", (5,))]
    for reg in regs:
        drig.ref.tell(SendRegistration(registration=reg))
    (fetch,) = drig.handshake.wait_for(FetchPeer)
    assert fetch == FetchPeer(peer=P_PEER, full=False)
    drig.ref.proxy().sizes().get(timeout=5)
    drig.ps.refs["handshake"].ask("barrier", timeout=5)
    assert len(drig.handshake.of(FetchPeer)) == 1
    assert drig.p_inbox.poll() == []
    drig.connect_p()
    drig.p_inbox.wait(2)
    assert sorted(r.request_id for r in drig.p_inbox.decoded()) == ["d-1", "d-2"]


def test_registration_that_cannot_be_sent_is_undelivered(drig: DRig) -> None:
    drig.connect_p()
    drig.fabric.faults.fail_send_notif()
    drig.ref.tell(SendRegistration(registration=make_reg("d-1", (4,))))
    (undelivered,) = drig.reaper.wait_for(RecvUndelivered)
    assert undelivered.request_id == "d-1"
    assert undelivered.count == 1
    assert undelivered.reason


def test_registration_after_failed_handshake_is_undelivered(drig: DRig) -> None:
    drig.ref.tell(SendRegistration(registration=make_reg("d-1", (4,))))
    drig.handshake.wait_for(FetchPeer)
    drig.ref.tell(HandshakeFailed(peer=P_PEER, kind="timeout", reason="slow"))
    (undelivered,) = drig.reaper.wait_for(RecvUndelivered)
    assert undelivered.request_id == "d-1"
    assert undelivered.count == 1
    assert "timeout" in undelivered.reason


# ------------------------------------------------------------------------------------------------
# Thread ownership and release
# ------------------------------------------------------------------------------------------------
def test_only_the_writer_thread_calls_the_agent(rig: PRig) -> None:
    rig.connect_d()
    rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
    rig.wait_sent("p-1")
    rig.agent.inject_notif("decode-pp0-tp0", encode_heartbeat(["p-1"]))
    rig.matcher.wait_for(HeartbeatArrived)
    rig.sizes()
    writer_threads = {t.name for t in threading.enumerate() if t.name.startswith("Writer-")}
    assert len(rig.agent.calling_threads) == 1
    assert rig.agent.calling_threads <= writer_threads
    assert threading.current_thread().name not in rig.agent.calling_threads
    for method in ("register_memory", "add_remote_agent", "transfer", "get_new_notifs"):
        assert rig.agent.calls[method] >= 1


def test_stop_releases_every_handle_and_list(fabric: FakeFabric) -> None:
    rig = PRig(fabric)
    try:
        rig.connect_d()
        rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
        rig.wait_sent("p-1")
        assert rig.agent.live_dlists > 0
        rig.ref.stop(timeout=5)
        assert rig.agent.live_handles == 0
        assert rig.agent.live_dlists == 0
        assert rig.agent.remote_agents == ()
    finally:
        rig.stop()


def test_stop_with_a_write_in_flight_releases_its_handle(fabric: FakeFabric) -> None:
    rig = PRig(fabric)
    try:
        rig.connect_d()
        gate = fabric.faults.hold_transfer()
        rig.tell(push("p-1", (0, 1), "d-1", (2, 3)))
        wait_until(lambda: rig.agent.live_handles == 1, timeout=5, what="WRITE in flight")
        rig.ref.stop(timeout=5)
        assert rig.agent.live_handles == 0
        assert rig.agent.live_dlists == 0
        assert fabric.in_flight() == 0
        gate.open()
    finally:
        rig.stop()


def test_a_large_registration_is_verified_by_its_header_and_decoded_off_the_writer(
    rig: PRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pushactors.actors.writer.inbound as inbound_module

    # This rig's memory is tiny (so is its registration size limit): lower the size above which
    # registrations are decoded off the writer, instead of building a huge pool.
    monkeypatch.setattr(inbound_module, "INLINE_REGISTRATION_BYTES", 200)
    rig.connect_d()
    big = make_reg("d-big", tuple(range(8)))
    raw = encode_registration(big)
    assert len(raw) > 200
    rig.agent.inject_notif("intruder-pp0-tp0", raw)
    rig.agent.inject_notif("decode-pp0-tp0", raw)
    (arrived,) = rig.matcher.wait_for(RegistrationArrived)
    # Verified from the header alone; the block ids travel undecoded to the matcher.
    assert arrived.registration is None and arrived.header == big.header()
    assert arrived.payload == raw[len(b"PUSH_REG:") :]
    assert rig.ctx.metrics.get("reg.rejected_sender") == 1


def test_a_write_replayed_after_a_slow_handshake_rechecks_its_registration_is_fresh(rig: PRig) -> None:
    # D last showed it waited for this registration longer ago than 2/3 of a lease: it may have
    # aborted (its abort lost) and reused the blocks. The parked WRITE must not fire.
    stale_since = time.monotonic() - rig.ctx.config.lease_duration
    msg = PostPush(
        request_id="p-1",
        block_ids=((0, 1),),
        registration=make_reg("d-1", (2, 3)),
        expected_targets=1,
        fresh_at=stale_since,
    )
    rig.tell(msg)
    rig.handshake.wait_for(FetchPeer)
    rig.connect_d()
    rig.wait_sent("p-1")
    assert "stale" in rig.send_failed["p-1"]
    ((_, raw),) = rig.d_inbox.wait()
    failure = decode_notification(raw)
    assert isinstance(failure, PushFailure) and failure.request_id == "d-1"
    assert rig.fabric.stats.transfers_posted == 0
    assert rig.ctx.metrics.get("write.stale_replay") == 1
    rig.assert_landed({})


def test_d_polls_busy_only_while_an_answer_is_awaited(drig: DRig) -> None:
    """A sent registration is awaited (the writer polls at the busy interval, however long the
    prefill takes) until its completion arrives; then nothing is awaited and polling backs off.
    A registration parked behind a handshake is awaited only once it went out; an abort ends
    the wait too."""
    config = drig.ps.ctx.config
    far = time.monotonic() + 3600.0  # past any linger: only what is awaited keeps polling tight

    def delay() -> float:
        return float(drig.ref.proxy().next_poll_delay(far).get(timeout=5))

    assert config.poll_interval_await < config.poll_interval_busy < config.poll_interval_idle
    drig.ref.tell(SendRegistration(registration=make_reg("d-1", (4,))))  # P not loaded: parked
    drig.handshake.wait_for(FetchPeer)
    assert drig.sizes()["answers_awaited"] == 0
    assert delay() > config.poll_interval_busy  # nothing awaited, nothing in flight: backing off
    drig.connect_p()  # the parked registration goes out
    drig.ref.tell(SendRegistration(registration=make_reg("d-2", (5,))))
    drig.p_inbox.wait(count=2)
    assert drig.sizes()["answers_awaited"] == 2
    assert delay() == config.poll_interval_await
    stranger = drig.fabric.agent("stranger")  # no handshake ever bound it to a P rank
    stranger.add_remote_agent(drig.agent.get_agent_metadata())
    stranger.send_notif(drig.agent.name, b"d-1:1")
    drig.reaper.wait_for(RecvNotified)
    assert drig.sizes()["answers_awaited"] == 2  # a forged answer leaves the request awaited
    drig.p_agent.add_remote_agent(drig.agent.get_agent_metadata())
    drig.p_agent.send_notif(drig.agent.name, b"d-1:1")  # P's completion
    drig.reaper.wait_for(RecvNotified, count=2)
    assert drig.sizes()["answers_awaited"] == 1
    assert delay() == config.poll_interval_await
    drig.ref.tell(SendAbort(abort=Abort(request_id="d-2"), peers=(P_PEER,)))
    wait_until(lambda: drig.sizes()["answers_awaited"] == 0, timeout=5, what="the abort to end the wait")
    assert delay() > config.poll_interval_busy


@pytest.mark.parametrize("spin", [0.0, 0.01])
def test_a_just_posted_write_is_spun_on_before_the_next_tick(spin: float) -> None:
    """A WRITE that is not DONE at post (here: 2 ms of fabric latency) settles inside the post's
    own handler when the writer spins on it (``poll_spin``), before the handler's event; without
    the spin it waits for a tick, after the handler."""
    from pushactors.logs import capture_events

    rig = PRig(FakeFabric(latency=0.002), poll_spin=spin)
    try:
        rig.connect_d()
        with capture_events() as events:
            rig.tell(push("p-1", (0,), "d-1", (4,)))
            rig.wait_sent("p-1")
        order = [e["event"] for e in events if e.get("event") in ("write.posted", "write.settled")]
        assert order == (["write.settled", "write.posted"] if spin else ["write.posted", "write.settled"])
        (posted,) = [e for e in events if e.get("event") == "write.posted"]
        assert 0 <= posted["plan_ms"] <= posted["post_ms"]  # the plan's share of posting
        parts = [posted[k] for k in ("plan_ms", "prep_ms", "make_ms", "transfer_ms")]
        assert min(parts) >= 0 and sum(parts) <= posted["post_ms"] + 0.005  # rounding, 4 parts
        assert posted["prep_ms"] == 0 or posted["runs"]  # lists of its own only for runs
        rig.assert_landed({4: 0})
    finally:
        rig.stop()


@pytest.mark.parametrize("outcome", ["handshake completes", "handshake fails"])
def test_work_parked_for_an_ended_incarnation_never_touches_the_next(outcome: str) -> None:
    """Incarnation 1 of a P id parks its WRITE on D engine A's handshake, then ends (its lease
    expires). Incarnation 2 of the same id parks on D engine B. Whatever A's handshake comes to,
    incarnation 1's parked WRITE is spent: it never posts, fails or ends incarnation 2."""
    b = ("decode2", "decode2-host", 31001)
    rig = PRig(FakeFabric())
    try:
        rig.tell(
            PostPush(
                request_id="p-1",
                block_ids=((0, 1),),
                registration=registration("d-1", (2, 3)),
                expected_targets=1,
                serial=1,
            )
        )
        rig.handshake.wait_for(FetchPeer)
        rig.tell(ExpireLease(request_id="p-1", serial=1))
        rig.settle()
        first = rig.ctx.outbox.drain()
        assert "p-1" in first.failed_sending
        rig.tell(
            PostPush(
                request_id="p-1",
                block_ids=((0, 1),),
                registration=registration("d-2", (2, 3), decode=b),
                expected_targets=1,
                serial=2,
            )
        )
        rig.handshake.wait_for(FetchPeer, count=2)
        if outcome == "handshake completes":
            rig.tell(HandshakeCompleted(peer=D_PEER, info=rig.d_info, full=True))
        else:
            rig.tell(HandshakeFailed(peer=D_PEER, kind="refused", reason="nothing listens"))
        rig.settle()
        assert "p-1" not in rig.ctx.outbox.drain().finished_sending
        assert rig.sizes()["pushes"] == 1  # incarnation 2 still waits for B
    finally:
        rig.stop()
