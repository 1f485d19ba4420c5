"""Thread-free tests of the plain classes the writer actor is a shell over: ``Poster`` (the NIXL
calls), ``Pusher`` (P's pushes), ``Links`` (remote ranks), ``Inbound`` (routing) and
``Answers`` (what D awaits). No actor runs: every class is driven directly on this thread
against the fake fabric, and the messages it would send to sibling actors are recorded."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pushactors.actors.base import Note, Peers, RankContext
from pushactors.actors.writer.answers import Answers
from pushactors.actors.writer.inbound import Inbound
from pushactors.actors.writer.links import Links
from pushactors.actors.writer.outbound import Outbound
from pushactors.actors.writer.poster import Poster
from pushactors.actors.writer.push.book import PushBook
from pushactors.actors.writer.push.pusher import Pusher
from pushactors.actors.writer.remotes import CheckDeath, DeliverPush, Notify
from pushactors.core.blocks import KVLayout, PairedLayout
from pushactors.core.config import PushConfig
from pushactors.protocol import (
    ClearLease,
    FetchPeer,
    Forget,
    HandshakeCompleted,
    PeerGone,
    PeerKey,
    PostPush,
    PushFailure,
    RecvNotified,
    RegisterMemory,
    decode_notification,
    encode_completion,
    encode_registration,
)
from pushactors.testing import FakeFabric, agent_info, registration

BLOCK, NBLOCKS, LAYERS = 64, 8, ("layer.0", "layer.1")
D_PEER = PeerKey("decode", "decode-host", 31000, 0, 0)
P_PEER = PeerKey("prefill", "prefill-host", 32000, 0, 0)


class Recorder:
    """Stands for a sibling actor's reference: keeps what it was told."""

    def __init__(self) -> None:
        self.told: list[Any] = []

    def tell(self, message: Any) -> None:
        self.told.append(message)

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.told if isinstance(m, kind)]


def kv(fill: bool) -> dict[str, torch.Tensor]:
    out = {}
    for li, name in enumerate(LAYERS):
        t = torch.zeros((NBLOCKS, BLOCK), dtype=torch.uint8)
        if fill:
            for b in range(NBLOCKS):
                t[b] = (li * 50 + b * 7 + 1) % 251
        out[name] = t
    return out


class Desk:
    """One P rank's writer parts, wired as the writer wires them, with a D agent beside."""

    def __init__(self, **config: Any) -> None:
        self.fabric = FakeFabric()
        self.ctx = RankContext(config=PushConfig(engine_id="prefill", **config), engine_id="prefill")
        self.peers = {name: Recorder() for name in ("writer", "matcher", "reaper", "handshake", "stager")}
        self.ctx.peers = Peers(**self.peers)  # type: ignore[arg-type]
        self.log = _Log()
        self.poster = Poster(self.ctx, self.fabric, self.log)
        self.poster.start()
        self.book = PushBook(tombstone_ttl=60.0)
        self.answers = Answers(poll_await=30.0, horizon=100.0)
        self.out = Outbound(None, tp_rank=0, pp_rank=0, tp_size=1)
        self.links = Links(self.ctx, self.log, self.poster, self.out, self.book.busy_peers, self.answers)
        self.replayed: list[Any] = []
        self.failed: list[tuple[Any, str]] = []
        self.links.replay = self.replayed.append
        self.links.fail_work = lambda work, reason, kind: self.failed.append((work, reason))
        self.wakes: list[float] = []
        self.pusher = Pusher(self.ctx, self.log, self.poster, self.links, self.book, self.out, self.wakes.append)
        self.p_kv, self.d_kv = kv(True), kv(False)
        p_layout = KVLayout.from_tensors(self.p_kv, block_size=16)
        reply, capacity = self.poster.register(
            RegisterMemory(regions=p_layout.region_infos, memory=p_layout.memory, mem_type="DRAM", block_size=16)
        )
        assert not reply.error and capacity == NBLOCKS
        d_layout = KVLayout.from_tensors(self.d_kv, block_size=16)
        self.d_agent = self.fabric.agent("decode-pp0-tp0")
        self.d_agent.register_memory(
            np.array([(m.addr, m.length, m.device_id) for m in d_layout.memory], dtype=np.uint64), "DRAM"
        )
        self.d_info = agent_info("decode", self.d_agent, d_layout)

    def connect_d(self) -> None:
        assert self.links.apply(HandshakeCompleted(peer=D_PEER, info=self.d_info, full=True), Note()) is None

    def d_notifs(self) -> list[Any]:
        return [decode_notification(raw) for msgs in self.d_agent.get_new_notifs().values() for raw in msgs]

    def open(self, p_id: str, p_blocks: tuple[int, ...], d_id: str, d_blocks: tuple[int, ...]) -> Any:
        msg = PostPush(
            request_id=p_id,
            block_ids=(p_blocks,),
            registration=registration(d_id, d_blocks),
            expected_targets=1,
            serial=1,
        )
        state, target, why = self.book.open(msg, 0.0)
        assert state is not None and target is not None, why
        return state, target


class _Log:
    """A logger that keeps every event (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.events.append((level, event, fields))


@pytest.fixture
def desk() -> Desk:
    return Desk()


def test_a_push_lands_its_bytes_then_finishes_once_with_its_clean_up_first(desk: Desk) -> None:
    desk.connect_d()
    _, target = desk.open("p-1", (1, 2), "d-1", (5, 6))
    remote = desk.links.get(D_PEER)
    assert remote is not None
    desk.pusher.post(target, remote, Note())
    desk.fabric.progress()
    while desk.book.in_flight:
        desk.pusher.check_in_flight()
        desk.fabric.progress()
    for layer in LAYERS:
        assert torch.equal(desk.d_kv[layer][5], desk.p_kv[layer][1])
        assert torch.equal(desk.d_kv[layer][6], desk.p_kv[layer][2])
        assert int(desk.d_kv[layer][0].count_nonzero()) == 0
    report = desk.ctx.outbox.drain()
    assert report.finished_sending == {"p-1"} and not report.failed_sending
    # The lease and the matcher's entry were told to go before the engine could see the end.
    assert [m.request_id for m in desk.peers["reaper"].of(ClearLease)] == ["p-1"]
    assert [m.request_id for m in desk.peers["matcher"].of(Forget)] == ["p-1"]
    assert desk.book.ended("p-1", 1) == "pushed" and not desk.book.pushes
    completions = desk.d_notifs()
    assert [c.request_id for c in completions] == ["d-1"]
    assert remote.in_flight == 0 and desk.fabric.in_flight() == 0


def test_descriptor_lists_are_prepared_once_per_remote_rank(desk: Desk, monkeypatch: pytest.MonkeyPatch) -> None:
    desk.connect_d()
    remote = desk.links.get(D_PEER)
    assert remote is not None
    agent = desk.fabric.get(desk.ctx.agent_name)
    preps: list[str] = []
    real = agent.prep_xfer_dlist
    monkeypatch.setattr(agent, "prep_xfer_dlist", lambda name, *a: (preps.append(name), real(name, *a))[1])
    first = desk.poster.prepared(remote, 0, 1)
    assert len(preps) == 2  # ours and D's, once
    again = desk.poster.prepared(remote, 0, 1)
    assert again == first and again.paired is first.paired and len(preps) == 2
    assert again.local is first.local and again.remote is first.remote and again.pairing_id == first.pairing_id


def test_a_write_ending_in_err_fails_the_request_and_tells_d(desk: Desk) -> None:
    desk.connect_d()
    desk.fabric.faults.err_transfer()
    _, target = desk.open("p-1", (1,), "d-1", (5,))
    remote = desk.links.get(D_PEER)
    assert remote is not None
    desk.pusher.post(target, remote, Note())
    for _ in range(100):
        if not desk.book.in_flight:
            break
        desk.fabric.progress()
        desk.pusher.check_in_flight()
    report = desk.ctx.outbox.drain()
    assert report.failed_sending == {"p-1": "WRITE ended in ERR at post"}
    (failure,) = desk.d_notifs()
    assert isinstance(failure, PushFailure) and failure.request_id == "d-1" and failure.final
    assert all(int(t.count_nonzero()) == 0 for t in desk.d_kv.values())


def test_a_write_to_a_d_not_loaded_is_parked_and_replayed_after_the_handshake(desk: Desk) -> None:
    work = DeliverPush("p-1", 0, 1, D_PEER)
    desk.links.park(D_PEER, full=True, work=work)
    assert [m.peer for m in desk.peers["handshake"].of(FetchPeer)] == [D_PEER]
    desk.links.park(D_PEER, full=True, work=DeliverPush("p-2", 0, 1, D_PEER))
    assert len(desk.peers["handshake"].of(FetchPeer)) == 1  # one fetch however many wait
    desk.connect_d()
    assert [w.request_id for w in desk.replayed] == ["p-1", "p-2"]


def test_a_forgotten_peer_names_what_it_owed_and_is_unloaded(desk: Desk) -> None:
    desk.connect_d()
    remote = desk.links.get(D_PEER)
    assert remote is not None
    desk.answers.sent(D_PEER, "d-1", 0.0)
    desk.links.forget(remote)
    (gone,) = desk.peers["reaper"].of(PeerGone)
    assert gone.delivered == ("d-1",) and gone.agent == "decode-pp0-tp0"
    assert desk.links.get(D_PEER) is None
    assert "decode-pp0-tp0" not in desk.fabric.get(desk.ctx.agent_name).remote_agents
    # A D rank would also ask whether that peer is dead; a P rank does not.
    assert not any(isinstance(w, CheckDeath) for w, _ in desk.failed)


def test_tell_d_parks_a_push_failure_until_d_is_loaded(desk: Desk) -> None:
    desk.pusher.tell_d(registration("d-1", (5,)), "no room")
    parked = desk.links.table.take_parked(D_PEER)
    assert len(parked) == 1 and isinstance(parked[0], Notify) and parked[0].request_id == "d-1"


def test_inbound_counts_answers_only_with_the_sender_it_verified(desk: Desk) -> None:
    desk.connect_d()
    inbound = Inbound(desk.ctx, desk.log, desk.out, desk.links, desk.answers, desk.poster)
    desk.answers.sent(D_PEER, "d-1", 0.0)
    inbound.route("stranger", encode_completion("d-1", 1))
    inbound.route("decode-pp0-tp0", encode_completion("d-1", 1))
    first, second = desk.peers["reaper"].of(RecvNotified)
    assert first.peer is None and second.peer == D_PEER
    # Only the verified answer ends the wait; the stranger's did not.
    assert "d-1" not in desk.answers.awaiting and D_PEER not in desk.answers.expecting
    inbound.route("decode-pp0-tp0", b"\xff\x00 not a notification")
    inbound.route("decode-pp0-tp0", 12345)
    assert desk.ctx.metrics.get("notif.malformed") == 2


def test_inbound_parks_a_registration_until_its_sender_is_verified(desk: Desk) -> None:
    inbound = Inbound(desk.ctx, desk.log, desk.out, desk.links, desk.answers, desk.poster)
    inbound.route("decode-pp0-tp0", encode_registration(registration("d-1", (5,))))
    assert [m.peer for m in desk.peers["handshake"].of(FetchPeer)] == [D_PEER]
    assert not desk.peers["matcher"].told  # nothing reaches the matcher unverified


def test_answers_prune_by_age_and_hand_out_due_death_checks() -> None:
    answers = Answers(poll_await=1.0, horizon=10.0)
    answers.sent(P_PEER, "d-1", 0.0)
    answers.sent(P_PEER, "d-2", 5.0)
    assert answers.busy() == {P_PEER}
    answers.prune(2.0)
    assert set(answers.awaiting) == {"d-2"}
    answers.prune(7.0)
    assert not answers.awaiting and answers.sizes()["answers_expected"] == 2
    answers.prune(12.0)
    assert answers.sizes()["answers_expected"] == 1
    answers.answered(P_PEER, "d-2")
    assert answers.busy() == set()
    check = CheckDeath(P_PEER, "prefill-pp0-tp0", b"", first_at=0.0)
    answers.retry_later(check, 3.0)
    assert answers.due_checks(2.0) == [] and answers.due_checks(3.0) == [check]
    assert answers.due_checks(4.0) == []


def test_the_nixl_adapter_types_nixls_disconnect_error_only() -> None:
    """NixlAgent raises PeerDisconnected for NIXL's disconnect error (its binding's type, or
    its status in the message) and lets every other error through as it came."""
    from pushactors.transport.nixl import disconnected

    assert disconnected(type("nixlRemoteDisconnectError", (Exception,), {})("peer went away"))
    assert disconnected(RuntimeError("NIXL_ERR_REMOTE_DISCONNECT"))
    assert not disconnected(RuntimeError("NIXL_ERR_BACKEND"))
    assert not disconnected(type("nixlBackendError", (Exception,), {})("busy"))


def test_a_notification_to_a_peer_nixl_says_disconnected_forgets_that_peer(desk: Desk) -> None:
    """Only NIXL's typed disconnect makes the writer forget a peer (and tell the reaper what
    it owed); another send failure leaves it loaded."""
    desk.connect_d()
    remote = desk.links.get(D_PEER)
    assert remote is not None
    desk.fabric.faults.fail_send_notif()
    assert desk.links.send(remote, b"HB:x") is not None
    assert desk.links.get(D_PEER) is remote and not desk.peers["reaper"].of(PeerGone)
    desk.fabric.faults.disconnect_notif()
    assert desk.links.send(remote, b"HB:x") is not None
    (gone,) = desk.peers["reaper"].of(PeerGone)
    assert gone.agent == "decode-pp0-tp0" and desk.links.get(D_PEER) is None
    assert "decode-pp0-tp0" not in desk.fabric.get(desk.ctx.agent_name).remote_agents


@pytest.mark.parametrize("disconnected", [True, False], ids=["peer-disconnected", "backend-error"])
def test_a_write_nixl_refuses_fails_its_push_and_forgets_only_a_disconnected_peer(
    desk: Desk, monkeypatch: pytest.MonkeyPatch, disconnected: bool
) -> None:
    from pushactors.testing.errors import FakeNixlError, FakePeerDisconnected

    desk.connect_d()
    _, target = desk.open("p-1", (1,), "d-1", (5,))
    remote = desk.links.get(D_PEER)
    assert remote is not None
    agent = desk.fabric.get(desk.ctx.agent_name)
    error = FakePeerDisconnected("injected") if disconnected else FakeNixlError("NIXL_ERR_BACKEND", "injected")

    def refuse(handle: Any, notif_msg: bytes = b"") -> Any:
        raise error

    monkeypatch.setattr(agent, "transfer", refuse)
    desk.pusher.post(target, remote, Note())
    assert "WRITE submission failed" in desk.ctx.outbox.drain().failed_sending["p-1"]
    assert desk.ctx.metrics.get("write.submit_failed") == 1 and not desk.book.in_flight
    assert agent.live_handles == 0  # the WRITE it made went with the refusal
    assert (desk.links.get(D_PEER) is None) is disconnected
    assert len(desk.peers["reaper"].of(PeerGone)) == (1 if disconnected else 0)


def _planned(paired: PairedLayout, pairing_id: int) -> PostPush:
    reg = registration("d-1", (5, 6))
    plan = paired.plan(((1, 2),), reg.block_groups, reg.skip_blocks, merge=True)
    return PostPush(
        request_id="p-1",
        block_ids=((1, 2),),
        registration=reg,
        expected_targets=1,
        serial=1,
        plan=plan,
        pairing_id=pairing_id,
    )


@pytest.mark.parametrize("current", [True, False], ids=["pairing-current", "pairing-replaced"])
def test_the_writer_posts_the_matchers_plan_only_on_the_pairing_it_holds(desk: Desk, current: bool) -> None:
    desk.connect_d()
    remote = desk.links.get(D_PEER)
    assert remote is not None
    prepared = desk.poster.prepared(remote, 0, 1)
    assert prepared.pairing_id > 0 and desk.poster.prepared(remote, 0, 1) is prepared  # built once
    # Not current: the remote was reloaded since the matcher planned (same shape, another id).
    msg = _planned(prepared.paired, prepared.pairing_id if current else prepared.pairing_id + 1)
    state, target, _ = desk.book.open(msg, 0.0)
    assert state is not None and target is not None
    desk.pusher.post(target, remote, Note(), msg)
    assert desk.ctx.metrics.get("write.preplanned") == (1 if current else 0)
    while desk.book.in_flight:
        desk.fabric.progress()
        desk.pusher.check_in_flight()
    for layer in LAYERS:
        assert torch.equal(desk.d_kv[layer][5], desk.p_kv[layer][1])
        assert torch.equal(desk.d_kv[layer][6], desk.p_kv[layer][2])
    assert desk.ctx.outbox.drain().finished_sending == {"p-1"}


def test_the_matcher_plans_a_matched_write_on_the_pairing_the_writer_sent() -> None:
    from pushactors.actors.matcher import Matcher
    from pushactors.protocol import BlocksFinished, RegistrationArrived
    from pushactors.testing import ActorRig

    desk = Desk()
    desk.connect_d()
    remote = desk.links.get(D_PEER)
    assert remote is not None
    prepared = desk.poster.prepared(remote, 0, 1)
    rig = ActorRig("matcher", Matcher.start, PushConfig(engine_id="prefill"))
    try:
        writer = rig.probe("writer")
        reg = registration("req-1", (5, 6))
        arrived = RegistrationArrived(
            registration=reg, sender="decode-pp0-tp0", pairing=prepared.paired, pairing_id=prepared.pairing_id
        )
        rig.tell(arrived)
        rig.tell(BlocksFinished(request_id="req-1", block_ids=((1, 2),)))
        (post,) = writer.wait_for(PostPush)
        assert post.pairing_id == prepared.pairing_id and post.plan is not None
        assert post.plan.nbytes == 2 * len(LAYERS) * BLOCK and post.plan.num_blocks == 2
        # A registration whose sender the matcher holds no pairing for is planned by the writer.
        rig.tell(RegistrationArrived(registration=registration("req-2", (3,)), sender="other-pp0-tp0"))
        rig.tell(BlocksFinished(request_id="req-2", block_ids=((4,),)))
        posts = writer.wait_for(PostPush, count=2)
        assert posts[1].plan is None and posts[1].pairing_id == 0
    finally:
        rig.stop()


def test_the_writer_polls_without_pause_only_shortly_after_posting_a_write_still_running() -> None:
    from pushactors.actors.writer.actor import Writer

    config = PushConfig(engine_id="prefill", poll_spin_in_flight=0.002)
    writer = Writer(RankContext(config=config, engine_id="prefill"), FakeFabric())
    now = 1000.0
    assert writer.next_poll_delay(now) > 0  # nothing in flight: backing off
    writer.book.track("target")  # type: ignore[arg-type]
    writer.pusher.last_posted_at = now - 0.001
    assert writer.next_poll_delay(now) == 0.0  # just posted and running: no pause
    writer.pusher.last_posted_at = now - 0.003
    assert writer.next_poll_delay(now) == config.poll_interval_busy  # past the spin: busy interval
    writer.book.take_in_flight()
    assert writer.next_poll_delay(now) > 0


def test_a_write_just_posted_is_polled_without_pause_even_while_an_answer_is_awaited() -> None:
    """The await interval is a floor for waiting on others; a WRITE of ours just posted (a
    layer-wise push's last, with the engine waiting in wait_for_save) needs P's own progress
    to finish and send its completion, so it is polled flat out first."""
    from pushactors.actors.writer.actor import Writer

    config = PushConfig(engine_id="prefill", poll_spin_in_flight=0.002, poll_interval_await=0.0001)
    writer = Writer(RankContext(config=config, engine_id="prefill"), FakeFabric())
    now = 1000.0
    writer.answers.awaiting["req-d"] = now + 10
    assert writer.next_poll_delay(now) == config.poll_interval_await
    writer.book.track("target")  # type: ignore[arg-type]
    writer.pusher.last_posted_at = now - 0.001
    assert writer.next_poll_delay(now) == 0.0
    writer.pusher.last_posted_at = now - 0.003
    assert writer.next_poll_delay(now) == config.poll_interval_await  # past the spin: awaiting


@pytest.mark.parametrize("renewed", [True, False], ids=["renewed-by-heartbeat", "past-deadline"])
def test_a_write_is_posted_only_before_ds_newest_deadline(desk: Desk, renewed: bool) -> None:
    """D's first deadline passed while the push waited; a heartbeat since renewed D's promise
    (the matcher keeps the newest in ``ctx.promises``): posted. Without a renewal: refused, and
    D is told; nothing lands."""
    import msgspec

    desk.connect_d()
    remote = desk.links.get(D_PEER)
    assert remote is not None
    gen = (5 << 32) | 1
    reg = msgspec.structs.replace(registration("d-1", (5,)), generation=gen)
    msg = PostPush(request_id="p-1", block_ids=((1,),), registration=reg, expected_targets=1, serial=1, deadline=1.0)
    state, target, _ = desk.book.open(msg, 0.0)
    assert state is not None and target is not None and target.deadline == 1.0
    if renewed:
        import time

        desk.ctx.promises.renew(("p-1", 0, gen), time.monotonic() + 30.0)
    desk.pusher.post(target, remote, Note())
    while desk.book.in_flight:
        desk.fabric.progress()
        desk.pusher.check_in_flight()
    report = desk.ctx.outbox.drain()
    if renewed:
        assert report.finished_sending == {"p-1"} and not report.failed_sending
        assert torch.equal(desk.d_kv["layer.0"][5], desk.p_kv["layer.0"][1])
    else:
        assert "deadline" in report.failed_sending["p-1"]
        assert desk.ctx.metrics.get("write.past_deadline") == 1
        assert all(int(t.count_nonzero()) == 0 for t in desk.d_kv.values())
        (failure,) = desk.d_notifs()
        assert isinstance(failure, PushFailure) and failure.generation == gen


def test_a_targets_progress_checks_count_from_its_latest_post() -> None:
    """write.settled says how often P asked NIXL about a WRITE since its (last) post and the
    longest it went unasked: UCX moves a WRITE only while P progresses it. The stuck timer
    (``posted_at``) runs from the push's first WRITE and never restarts."""
    from pushactors.actors.writer.push.book import PushState, Target

    target = Target(registration=registration("d-1", [1]), push=PushState("p-1", ((1,),), 1, 0.0), d_rank=0)
    target.reposted(10.0, first=True)
    target.checked(10.001)
    target.checked(10.004)  # 3 ms unasked
    target.checked(10.0045)
    assert target.checks == 3 and target.check_gap == pytest.approx(0.003)
    target.reposted(11.0)  # a layer-wise push's next layer: checks counted afresh, not its age
    assert (target.checks, target.check_gap, target.posted_at) == (0, 0.0, 10.0)
    target.checked(11.002)
    assert target.checks == 1 and target.check_gap == pytest.approx(0.002)
