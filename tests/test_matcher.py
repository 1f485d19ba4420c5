"""Actor-level tests of the matcher (docs/protocol.md, 'Matching'): probes stand in for its peers."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pushactors.actors.base import RankContext, Tick
from pushactors.actors.matcher import Matcher
from pushactors.core.config import PushConfig
from pushactors.protocol import (
    Abort,
    AbortArrived,
    BlocksFinished,
    CancelPush,
    ExpectTraffic,
    ExpireLease,
    ExtendLeases,
    Forget,
    HeartbeatArrived,
    PostPush,
    RefuseRegistration,
    Registration,
    RegistrationArrived,
)
from pushactors.testing import ActorRig, registration, wait_until

pytestmark = pytest.mark.timeout(60)

P_ENGINE = "prefill"
D_SENDER = "decode-pp0-tp0"


def make_reg(
    d_id: str,
    *,
    engine: str = P_ENGINE,
    blocks: tuple[int, ...] = (5, 6),
    **kw: Any,
) -> Registration:
    return registration(d_id, blocks, prefill=(engine, "prefill-host", 32000), **kw)


def arrived(reg: Registration) -> RegistrationArrived:
    return RegistrationArrived(registration=reg, sender=D_SENDER)


def finished(p_id: str, *, tid: str | None = None, blocks: tuple[int, ...] = (1, 2)) -> BlocksFinished:
    return BlocksFinished(request_id=p_id, block_ids=(blocks,), transfer_id=tid)


class Rig(ActorRig):
    """A real matcher between probes."""

    def __init__(self, config: PushConfig, **ctx: Any) -> None:
        super().__init__("matcher", Matcher.start, config, **ctx)
        self.writer = self.probe("writer")
        self.reaper = self.probe("reaper")

    def posts(self) -> list[PostPush]:
        return self.writer.of(PostPush)

    def refusals(self) -> list[RefuseRegistration]:
        return self.writer.of(RefuseRegistration)


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def factory(*, tp_rank: int = 0, tp_size: int = 1, **config: Any) -> Rig:
        rig = Rig(PushConfig(engine_id=P_ENGINE, **config), tp_rank=tp_rank, tp_size=tp_size)
        rigs.append(rig)
        return rig

    try:
        yield factory
    finally:
        for rig in rigs:
            rig.stop()


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    return make_rig()


# ------------------------------------------------------------------------------------------------
# Matching in both orders
# ------------------------------------------------------------------------------------------------
def test_registration_first_then_blocks(rig: Rig) -> None:
    reg = make_reg("cmpl-a-0-bbbbbbbb")
    rig.tell(arrived(reg))
    rig.settle()
    assert rig.posts() == []
    assert rig.sizes()["pending_registrations"] == 1
    rig.tell(finished("cmpl-a-0-aaaaaaaa", blocks=(1, 2)))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-a-0-aaaaaaaa"  # P's id: what P reports and frees
    assert post.registration == reg  # the WRITE is fired with D's registration
    assert post.block_ids == ((1, 2),)
    assert post.expected_targets == 1
    sizes = rig.sizes()
    assert sizes["pending_registrations"] == 0
    assert sizes["regs_by_id"] == sizes["regs_by_base"] == 0
    assert rig.metrics.get("matcher.matched") == 1


def test_writer_told_to_expect_traffic_only_for_blocks_left_waiting(rig: Rig) -> None:
    """Blocks that wait for their registration make the writer poll busy (the registration is
    on its way); blocks matched at once wake the writer only with their push."""
    rig.tell(arrived(make_reg("cmpl-a-0-bbbbbbbb")))
    rig.tell(finished("cmpl-a-0-aaaaaaaa"))
    rig.writer.wait_for(PostPush)
    rig.tell(finished("cmpl-b-0-aaaaaaaa"))
    rig.writer.wait_for(ExpectTraffic)
    rig.settle()
    assert len(rig.writer.of(ExpectTraffic)) == 1 and len(rig.posts()) == 1


def test_blocks_first_then_registration(rig: Rig) -> None:
    rig.tell(finished("cmpl-a-0-aaaaaaaa", blocks=(3, 4)))
    rig.settle()
    assert rig.posts() == []
    assert rig.sizes()["finished"] == 1
    reg = make_reg("cmpl-a-0-bbbbbbbb")
    rig.tell(arrived(reg))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-a-0-aaaaaaaa"
    assert post.registration == reg
    assert post.block_ids == ((3, 4),)
    assert rig.sizes()["pending_registrations"] == 0


@pytest.mark.parametrize("registration_first", [True, False])
def test_transfer_id_match(rig: Rig, registration_first: bool) -> None:
    reg = make_reg("d-unrelated", tid="T-1")
    msgs: list[Any] = [arrived(reg), finished("p-other", tid="T-1")]
    if not registration_first:
        msgs.reverse()
    rig.tell(*msgs)
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "p-other"
    assert post.registration.request_id == "d-unrelated"


@pytest.mark.parametrize("registration_first", [True, False])
@pytest.mark.parametrize(
    ("p_id", "d_id"),
    [("cmpl-x-0-aaaaaaaa", "cmpl-x-0-aaaaaaaa"), ("cmpl-x-0-aaaaaaaa", "cmpl-x-0-bbbbbbbb")],
    ids=["same-id", "same-base"],
)
def test_different_transfer_ids_never_match(rig: Rig, registration_first: bool, p_id: str, d_id: str) -> None:
    msgs: list[Any] = [arrived(make_reg(d_id, tid="T-d")), finished(p_id, tid="T-p")]
    if not registration_first:
        msgs.reverse()
    rig.tell(*msgs)
    rig.settle()
    assert rig.posts() == []
    assert rig.refusals() == []
    sizes = rig.sizes()
    assert sizes["pending_registrations"] == 1
    assert sizes["finished"] == 1


def test_transfer_id_on_one_side_only_falls_back_to_ids(rig: Rig) -> None:
    rig.tell(arrived(make_reg("cmpl-t-0-bbbbbbbb", tid="T-9")), finished("cmpl-t-0-aaaaaaaa"))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-t-0-aaaaaaaa"


def test_exact_id_match(rig: Rig) -> None:
    rig.tell(finished("req-exact-1"), arrived(make_reg("req-exact-1")))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "req-exact-1"
    assert post.registration.request_id == "req-exact-1"


@pytest.mark.parametrize("registration_first", [True, False])
def test_base_id_match(rig: Rig, registration_first: bool) -> None:
    msgs: list[Any] = [arrived(make_reg("cmpl-x-0-bbbbbbbb")), finished("cmpl-x-0-aaaaaaaa")]
    if not registration_first:
        msgs.reverse()
    rig.tell(*msgs)
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-x-0-aaaaaaaa"
    assert post.registration.request_id == "cmpl-x-0-bbbbbbbb"


def test_base_id_suffix_is_case_insensitive(rig: Rig) -> None:
    rig.tell(finished("cmpl-c-0-ABCDEF12"), arrived(make_reg("cmpl-c-0-0f0f0f0f")))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-c-0-ABCDEF12"


def test_remote_request_id_hint_matches(rig: Rig) -> None:
    rig.tell(arrived(make_reg("d-side-name", remote_request_id="p-side-name")), finished("p-side-name"))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "p-side-name"
    assert rig.sizes()["regs_by_id"] == 0


@pytest.mark.parametrize("registration_first", [True, False])
def test_sub_requests_never_cross_match(rig: Rig, registration_first: bool) -> None:
    msgs: list[Any] = [arrived(make_reg("cmpl-x-1-bbbbbbbb")), finished("cmpl-x-0-aaaaaaaa")]
    if not registration_first:
        msgs.reverse()
    rig.tell(*msgs)
    rig.settle()
    assert rig.posts() == []
    # Its own sibling does match, and only it.
    rig.tell(arrived(make_reg("cmpl-x-0-cccccccc")))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-x-0-aaaaaaaa"
    assert post.registration.request_id == "cmpl-x-0-cccccccc"
    rig.settle()
    assert len(rig.posts()) == 1
    assert rig.sizes()["pending_registrations"] == 1  # the index-1 registration still waits


def test_ids_without_suffix(rig: Rig) -> None:
    # No suffix: only exact ids match. A "-" + 8 non-hex chars or 7 hex digits is not a suffix.
    rig.tell(
        finished("plain"),
        arrived(make_reg("plainer")),
        finished("r-zzzzzzzz"),
        arrived(make_reg("r-yyyyyyyy")),
        finished("r-1234567"),
        arrived(make_reg("r-7654321")),
    )
    rig.settle()
    assert rig.posts() == []
    rig.tell(arrived(make_reg("plain")))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "plain"
    rig.settle()
    assert len(rig.posts()) == 1


# ------------------------------------------------------------------------------------------------
# Duplicates and competing registrations
# ------------------------------------------------------------------------------------------------
def test_duplicate_registration_after_match(rig: Rig) -> None:
    reg = make_reg("cmpl-d-0-bbbbbbbb")
    rig.tell(finished("cmpl-d-0-aaaaaaaa"), arrived(reg))
    rig.writer.wait_for(PostPush)
    rig.tell(arrived(reg))
    rig.settle()
    assert len(rig.posts()) == 1
    assert rig.refusals() == []
    assert rig.metrics.get("matcher.duplicate_registration") == 1


def test_duplicate_registration_while_pending(rig: Rig) -> None:
    reg = make_reg("cmpl-d-0-bbbbbbbb")
    rig.tell(arrived(reg), arrived(reg))
    rig.settle()
    assert rig.metrics.get("matcher.duplicate_registration") == 1
    assert rig.sizes()["pending_registrations"] == 1
    rig.tell(finished("cmpl-d-0-aaaaaaaa"))
    rig.writer.wait_for(PostPush)
    rig.settle()
    assert len(rig.posts()) == 1
    assert rig.refusals() == []


def test_second_d_request_for_same_rank_is_refused(rig: Rig) -> None:
    first = make_reg("cmpl-s-0-bbbbbbbb")
    second = make_reg("cmpl-s-0-cccccccc")
    rig.tell(finished("cmpl-s-0-aaaaaaaa"), arrived(first))
    rig.writer.wait_for(PostPush)
    rig.tell(arrived(second))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert refusal.registration == second
    rig.settle()
    assert len(rig.posts()) == 1


def test_two_pending_d_requests_for_same_rank_fail_everything_involved(rig: Rig) -> None:
    # Matching never guesses (docs/protocol.md, 'Matching'): two D requests wait for one P request on one D rank,
    # so which one its KV belongs to is unknown. Both are refused and P's request fails.
    first = make_reg("cmpl-s-0-bbbbbbbb")
    second = make_reg("cmpl-s-0-cccccccc")
    rig.tell(arrived(first), arrived(second), finished("cmpl-s-0-aaaaaaaa"))
    refusals = rig.writer.wait_for(RefuseRegistration, count=2)
    assert {r.registration.request_id for r in refusals} == {first.request_id, second.request_id}
    (expire,) = rig.writer.wait_for(ExpireLease)
    assert expire.request_id == "cmpl-s-0-aaaaaaaa" and expire.failed
    rig.settle()
    assert rig.posts() == []
    assert rig.sizes()["pending_registrations"] == 0
    assert rig.metrics.get("matcher.ambiguous") >= 1


# ------------------------------------------------------------------------------------------------
# After P is done with a request (Forget, tombstones)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("names", ["transfer_id", "remote_request_id", "exact_id"])
def test_late_registration_naming_the_ended_request_exactly_is_refused(rig: Rig, names: str) -> None:
    tid = "T-e" if names == "transfer_id" else None
    rig.tell(finished("cmpl-e-0-aaaaaaaa", tid=tid), Forget(request_id="cmpl-e-0-aaaaaaaa", outcome="expired"))
    late = {
        "transfer_id": make_reg("cmpl-e-0-bbbbbbbb", tid="T-e"),
        "remote_request_id": make_reg("cmpl-e-0-bbbbbbbb", remote_request_id="cmpl-e-0-aaaaaaaa"),
        "exact_id": make_reg("cmpl-e-0-aaaaaaaa"),
    }[names]
    rig.tell(arrived(late))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert "expired" in refusal.reason
    rig.settle()
    assert rig.posts() == []
    assert rig.sizes()["pending_registrations"] == 0


def test_ended_request_never_answers_a_registration_by_base_id(rig: Rig) -> None:
    # A tombstone names exactly one request: a client that reuses an id (same base id, new
    # engine suffix) must not inherit the old request's end. The new registration waits for
    # its own P request and is matched to it.
    rig.tell(finished("cmpl-e-0-aaaaaaaa"), Forget(request_id="cmpl-e-0-aaaaaaaa", outcome="pushed"))
    rig.tell(arrived(make_reg("cmpl-e-0-bbbbbbbb")))
    rig.settle()
    assert rig.refusals() == []
    assert rig.sizes()["pending_registrations"] == 1
    rig.tell(finished("cmpl-e-0-cccccccc"))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-e-0-cccccccc"


def test_replayed_registration_after_push_is_refused_never_written_twice(rig: Rig) -> None:
    reg = make_reg("cmpl-r-0-bbbbbbbb")
    rig.tell(finished("cmpl-r-0-aaaaaaaa"), arrived(reg))
    rig.writer.wait_for(PostPush)
    rig.tell(arrived(reg))  # while its push is live: a duplicate, dropped
    rig.settle()
    assert rig.refusals() == [] and rig.metrics.get("matcher.duplicate_registration") == 1
    rig.tell(Forget(request_id="cmpl-r-0-aaaaaaaa", outcome="pushed"))
    rig.tell(arrived(reg))  # after it: a late copy or a reused id, refused (D keeps its first answer)
    rig.settle()
    assert len(rig.refusals()) == 1
    assert len(rig.posts()) == 1
    assert rig.metrics.get("matcher.reused_slot") == 1


@pytest.mark.parametrize("with_tid", [False, True])
def test_forget_drops_state_under_every_key(rig: Rig, with_tid: bool) -> None:
    tid = "T-forget" if with_tid else None
    rig.tell(finished("cmpl-f-0-aaaaaaaa", tid=tid))
    rig.settle()
    sizes = rig.sizes()
    assert sizes["finished"] == 1
    # An entry with a transfer id pairs only by that id: it is not indexed by base.
    assert sizes["by_base"] == (0 if with_tid else 1)
    assert sizes["by_tid"] == (1 if with_tid else 0)
    rig.tell(Forget(request_id="cmpl-f-0-aaaaaaaa", outcome="expired"))
    sizes = rig.sizes()
    assert sizes["finished"] == 0
    assert sizes["by_tid"] == 0
    assert sizes["by_base"] == 0
    assert sizes["served"] == 0
    # Under no key does a registration meet the evicted entry any more; those that name it
    # exactly are answered at once, one by base id only waits for a request of its own.
    late = [make_reg("cmpl-f-0-aaaaaaaa"), make_reg("cmpl-f-0-bbbbbbbb", remote_request_id="cmpl-f-0-aaaaaaaa")]
    if with_tid:
        late = [make_reg("d-other-name", tid="T-forget", rank=0)]
    for i, reg in enumerate(late):
        rig.tell(arrived(reg))
        rig.writer.wait_for(RefuseRegistration, count=i + 1)
    rig.tell(arrived(make_reg("cmpl-f-0-cccccccc")))
    rig.settle()
    assert rig.posts() == []
    assert len(rig.refusals()) == len(late)
    assert rig.sizes()["pending_registrations"] == 1


def test_tombstone_of_one_transfer_does_not_refuse_another(rig: Rig) -> None:
    # Matching: transfer ids decide when both sides carry one. A tombstone left by transfer T-old
    # must not answer a registration of transfer T-new that shares the base id.
    rig.tell(finished("cmpl-g-0-aaaaaaaa", tid="T-old"), Forget(request_id="cmpl-g-0-aaaaaaaa", outcome="expired"))
    rig.tell(arrived(make_reg("cmpl-g-0-bbbbbbbb", tid="T-new")))
    rig.settle()
    assert rig.refusals() == []
    rig.tell(finished("cmpl-g-0-cccccccc", tid="T-new"))
    (post,) = rig.writer.wait_for(PostPush, timeout=2)
    assert post.request_id == "cmpl-g-0-cccccccc"


# ------------------------------------------------------------------------------------------------
# Misrouted registrations
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "reg",
    [
        make_reg("cmpl-m-0-bbbbbbbb", engine="someone-else"),
        make_reg("cmpl-m-0-bbbbbbbb", p_tp=2),
        make_reg("cmpl-m-0-bbbbbbbb", p_pp=2),
    ],
    ids=["other-engine", "other-tp-size", "other-pp-size"],
)
def test_misrouted_registration_is_refused(rig: Rig, reg: Registration) -> None:
    rig.tell(finished("cmpl-m-0-aaaaaaaa"), arrived(reg))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert refusal.registration == reg
    rig.settle()
    assert rig.posts() == []
    assert rig.sizes()["pending_registrations"] == 0


def test_registration_from_a_pipeline_parallel_d_is_refused(rig: Rig) -> None:
    """PP on D is not supported: a registration naming a D pipeline of 2 is refused, not served."""
    import msgspec

    reg = msgspec.structs.replace(make_reg("cmpl-pp-0-bbbbbbbb"), decode_pp_rank=1, decode_pp_size=2)
    rig.tell(finished("cmpl-pp-0-aaaaaaaa"), arrived(reg))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert "pipeline-parallel" in refusal.reason
    rig.settle()
    assert rig.posts() == []


def test_registration_for_a_d_rank_this_p_rank_does_not_write_is_refused(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(tp_rank=0, tp_size=2)
    wrong = make_reg("cmpl-w-0-bbbbbbbb", rank=1, d_tp=2, p_tp=2)  # P rank 1 writes D rank 1
    rig.tell(finished("cmpl-w-0-aaaaaaaa"), arrived(wrong))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert "rank" in refusal.reason
    # TP sizes that do not divide (P 2, D 3) cannot be served at all.
    odd = make_reg("cmpl-w-0-dddddddd", rank=0, d_tp=3, p_tp=2)
    rig.tell(arrived(odd))
    refusal = rig.writer.wait_for(RefuseRegistration, count=2)[1]
    assert refusal.registration == odd
    right = make_reg("cmpl-w-0-bbbbbbbb", rank=0, d_tp=2, p_tp=2)
    rig.tell(arrived(right))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.registration == right
    assert post.expected_targets == 1


def test_one_p_rank_writes_several_d_ranks(rig: Rig) -> None:
    # P TP 1 → D TP 2: this P rank writes both D ranks.
    regs = [make_reg("cmpl-h-0-bbbbbbbb", rank=r, d_tp=2) for r in (0, 1)]
    rig.tell(arrived(regs[0]), finished("cmpl-h-0-aaaaaaaa"), arrived(regs[1]))
    posts = rig.writer.wait_for(PostPush, count=2)
    assert sorted(p.registration.decode_tp_rank for p in posts) == [0, 1]
    assert {p.expected_targets for p in posts} == {2}
    assert rig.refusals() == []


def test_require_transfer_id(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(require_transfer_id=True)
    rig.tell(finished("cmpl-q-0-aaaaaaaa", tid="T-q"), arrived(make_reg("cmpl-q-0-bbbbbbbb")))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert "transfer_id" in refusal.reason
    rig.tell(arrived(make_reg("cmpl-q-0-bbbbbbbb", tid="T-q")))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-q-0-aaaaaaaa"


# ------------------------------------------------------------------------------------------------
# Heartbeats and aborts from D
# ------------------------------------------------------------------------------------------------
def test_heartbeat_resolves_p_ids(rig: Rig) -> None:
    rig.tell(finished("cmpl-1-0-aaaaaaaa"), finished("p-two", tid="T-2"), finished("cmpl-3-0-aaaaaaaa"))
    # Leases are kept alive only by the agents that registered for them.
    rig.tell(
        arrived(make_reg("cmpl-1-0-bbbbbbbb")),
        arrived(make_reg("d-two", tid="T-2")),
        arrived(make_reg("cmpl-3-0-bbbbbbbb")),
    )
    rig.writer.wait_for(PostPush, count=3)
    rig.tell(HeartbeatArrived(ids=("cmpl-1-0-aaaaaaaa", "T-2"), sender="someone-else"))
    rig.settle()
    assert rig.reaper.of(ExtendLeases) == []
    rig.tell(
        HeartbeatArrived(
            ids=("cmpl-1-0-aaaaaaaa", "T-2", "cmpl-3-0-bbbbbbbb", "nobody-knows-me", "cmpl-9-0-bbbbbbbb"),
            sender=D_SENDER,
        )
    )
    (extend,) = rig.reaper.wait_for(ExtendLeases)
    assert sorted(extend.request_ids) == ["cmpl-1-0-aaaaaaaa", "cmpl-3-0-aaaaaaaa", "p-two"]
    assert rig.metrics.get("matcher.heartbeat_unknown") == 2 + 2  # the stranger's two, then two unknown ids


def test_heartbeat_with_only_unknown_ids_extends_nothing(rig: Rig) -> None:
    rig.tell(HeartbeatArrived(ids=("x", "y"), sender=D_SENDER))
    rig.settle()
    assert rig.reaper.of(ExtendLeases) == []
    assert rig.metrics.get("matcher.heartbeat_unknown") == 2


class Sink:
    """A peer that records what it is told (for an actor driven on the test's thread)."""

    def __init__(self) -> None:
        self.told: list[Any] = []

    def tell(self, message: Any) -> None:
        self.told.append(message)


def drive(actor: Any) -> list[Any]:
    """Run an actor that was never started on this thread: take its mailbox in order, as its own
    thread would (ticks aside), until it is empty; return the messages handled."""
    handled = []
    while not actor.actor_inbox.empty():
        message = actor.actor_inbox.get().message
        if not isinstance(message, Tick):
            actor.on_receive(message)
            handled.append(message)
    return handled


def test_a_heartbeat_is_resolved_one_bounded_slice_per_message_with_other_messages_in_between() -> None:
    """Plain, no threads: a heartbeat naming 100k ids costs one handler call at most
    ``heartbeat_slice`` ids; the rest goes back to the mailbox behind a message that was already
    waiting, which therefore runs after one slice, not after 100k ids."""
    ctx = RankContext(config=PushConfig(engine_id=P_ENGINE), engine_id=P_ENGINE)
    sinks = {name: Sink() for name in ("writer", "reaper", "handshake", "stager")}
    for name, sink in sinks.items():
        setattr(ctx.peers, name, sink)
    m = Matcher(ctx)
    now = time.monotonic()
    m.registry.add_finished("cmpl-live-0-aaaaaaaa", ((1, 2),), None, now)
    m.registry.add_registration(make_reg("cmpl-live-0-bbbbbbbb"), D_SENDER, now)  # served: its lease extends
    waiting = make_reg("d-wait", remote_request_id="p-wait")
    m.registry.add_registration(waiting, D_SENDER, now - 5.0)  # pending, last refreshed 5 s ago
    seen: list[int] = []
    resolve = m.registry.heartbeat

    def counted(ids: tuple[str, ...], sender: str, at: float, deadline: float | None = None) -> Any:
        seen.append(len(ids))
        return resolve(ids, sender, at, deadline)

    m.registry.heartbeat = counted  # type: ignore[method-assign]
    ids = (*(f"ghost-{i}" for i in range(99_998)), "cmpl-live-0-aaaaaaaa", "p-wait")
    before = time.monotonic()
    m.actor_ref.tell(HeartbeatArrived(ids=ids, sender=D_SENDER))
    arrived_by = time.monotonic()
    m.actor_ref.tell(finished("cmpl-other-0-cccccccc"))
    handled = drive(m)
    slice_ = Matcher.heartbeat_slice
    assert slice_ == 1024
    assert max(seen) == slice_ and sum(seen) == len(ids) and len(seen) == math.ceil(len(ids) / slice_)
    assert isinstance(handled[1], BlocksFinished), "the waiting message ran after the first slice"
    rests = [h for h in handled[2:] if isinstance(h, HeartbeatArrived)]
    assert [h.offset for h in rests] == list(range(slice_, len(ids), slice_))
    assert all(h.ids is ids for h in rests)  # the rest is the same tuple from an offset: no copy
    assert all(h.at is not None and before <= h.at <= arrived_by for h in rests)
    assert ctx.metrics.get("matcher.heartbeat_unknown") == 99_998
    assert ctx.metrics.get("matcher.heartbeat_requeued") == len(rests)
    (extend,) = [t for t in sinks["reaper"].told if isinstance(t, ExtendLeases)]
    assert extend.request_ids == ("cmpl-live-0-aaaaaaaa",)
    # Resolved in the last slice, but as of when the heartbeat arrived: never fresher than D made it.
    pending = next(iter(m.registry.pending.values()))
    assert pending.registration == waiting and before <= pending.refreshed_at <= arrived_by


def test_a_slice_resolved_late_never_makes_a_registration_look_older() -> None:
    """The rest of a heartbeat that arrived before a registration is resolved after it: the
    registration keeps its own (later) arrival as its freshness."""
    ctx = RankContext(config=PushConfig(engine_id=P_ENGINE), engine_id=P_ENGINE)
    for name in ("writer", "reaper", "handshake", "stager"):
        setattr(ctx.peers, name, Sink())
    m = Matcher(ctx)
    ids = (*(f"ghost-{i}" for i in range(2 * Matcher.heartbeat_slice)), "p-late")
    m.actor_ref.tell(HeartbeatArrived(ids=ids, sender=D_SENDER))
    m.actor_ref.tell(arrived(make_reg("d-late", remote_request_id="p-late")))
    drive(m)
    (pending,) = m.registry.pending.values()
    assert pending.refreshed_at == pending.arrived_at
    assert ctx.metrics.get("matcher.heartbeat_unknown") == 2 * Matcher.heartbeat_slice


def test_abort_of_pending_registration(rig: Rig) -> None:
    reg = make_reg("cmpl-ab-0-bbbbbbbb", tid="T-ab")
    rig.tell(arrived(reg))
    rig.settle()
    assert rig.sizes()["pending_registrations"] == 1
    rig.tell(AbortArrived(abort=Abort(request_id=reg.request_id, transfer_id="T-ab"), sender=D_SENDER))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert refusal.registration == reg
    assert refusal.reason == "aborted by decode"
    sizes = rig.sizes()
    assert sizes["pending_registrations"] == 0
    assert sizes["regs_by_id"] == sizes["regs_by_base"] == sizes["regs_by_tid"] == 0
    # P's blocks arriving later meet no registration.
    rig.tell(finished("cmpl-ab-0-aaaaaaaa", tid="T-ab"))
    rig.settle()
    assert rig.posts() == []


def test_abort_after_match_cancels_push(rig: Rig) -> None:
    reg = make_reg("cmpl-ac-0-bbbbbbbb")
    rig.tell(finished("cmpl-ac-0-aaaaaaaa"), arrived(reg))
    rig.writer.wait_for(PostPush)
    rig.tell(AbortArrived(abort=Abort(request_id=reg.request_id), sender=D_SENDER))
    (cancel,) = rig.writer.wait_for(CancelPush)
    assert cancel == CancelPush(request_id="cmpl-ac-0-aaaaaaaa", d_request_id=reg.request_id, decode_tp_rank=0)


def test_abort_before_its_registration_ends_only_that_slot_from_that_sender(rig: Rig) -> None:
    # An abort that names nothing P has (yet) cannot be verified: it must not end anything
    # but the exact registration it names, from the agent that sent it.
    rig.tell(AbortArrived(abort=Abort(request_id="cmpl-ad-0-bbbbbbbb"), sender=D_SENDER))
    rig.tell(finished("cmpl-ad-0-aaaaaaaa"))
    rig.settle()
    assert rig.writer.of(ExpireLease) == []
    assert rig.sizes()["finished"] == 1
    # The reordered registration it named is refused ...
    rig.tell(arrived(make_reg("cmpl-ad-0-bbbbbbbb")))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert refusal.reason == "aborted by decode"
    # ... while the same slot from another agent, or another D request, is not touched.
    rig.tell(RegistrationArrived(registration=make_reg("cmpl-ad-0-cccccccc"), sender=D_SENDER))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-ad-0-aaaaaaaa"
    assert rig.metrics.get("matcher.abort_unknown") == 1


def test_abort_of_a_pending_registration_frees_p_blocks_it_named_on_arrival(rig: Rig) -> None:
    reg = make_reg("cmpl-ae-0-bbbbbbbb", tid="T-ae")
    rig.tell(arrived(reg))
    rig.settle()
    rig.tell(AbortArrived(abort=Abort(request_id=reg.request_id, transfer_id="T-ae"), sender=D_SENDER))
    rig.writer.wait_for(RefuseRegistration)
    rig.tell(finished("cmpl-ae-0-aaaaaaaa", tid="T-ae"))
    (expire,) = rig.writer.wait_for(ExpireLease)
    assert expire.request_id == "cmpl-ae-0-aaaaaaaa"
    assert expire.reason == "aborted by decode"
    rig.settle()
    assert rig.posts() == []


# ------------------------------------------------------------------------------------------------
# Time, scale and containment
# ------------------------------------------------------------------------------------------------
def test_orphan_registrations_are_dropped(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(orphan_registration_ttl=0.05, reaper_tick=0.01)
    rig.tell(arrived(make_reg("cmpl-o-0-bbbbbbbb", tid="T-o")))
    wait_until(lambda: rig.sizes()["pending_registrations"] == 0, timeout=5, what="orphan dropped")
    sizes = rig.sizes()
    assert sizes["regs_by_id"] == sizes["regs_by_base"] == sizes["regs_by_tid"] == 0
    assert rig.metrics.get("matcher.orphan_registration_dropped") == 1
    rig.tell(finished("cmpl-o-0-aaaaaaaa", tid="T-o"))
    rig.settle()
    assert rig.posts() == []


def test_indices_hold_one_entry_per_registration(rig: Rig) -> None:
    n = 5000
    for i in range(n):
        rig.tell(arrived(make_reg(f"cmpl-{i}-0-bbbbbbbb", tid=f"T-{i}")))
    sizes = rig.sizes()
    assert sizes["pending_registrations"] == n
    assert sizes["regs_by_id"] == n
    assert sizes["regs_by_base"] == n
    assert sizes["regs_by_tid"] == n
    # Keyed by base id (and name, and transfer id): a lookup is one dict access into a bucket of
    # one, no scan. Read on the matcher's own thread.
    shape = rig.ref.proxy().index_shape().get(timeout=5)
    assert shape == {"by_tid": (n, 1), "by_name": (n, 1), "by_base": (n, 1)}
    for i in range(n):
        rig.tell(finished(f"cmpl-{i}-0-aaaaaaaa"))
    sizes = rig.sizes()
    assert sizes["pending_registrations"] == 0
    assert sizes["regs_by_id"] == sizes["regs_by_base"] == sizes["regs_by_tid"] == 0
    assert rig.ref.proxy().index_shape().get(timeout=5) == {
        "by_tid": (0, 0),
        "by_name": (0, 0),
        "by_base": (0, 0),
    }
    assert sizes["finished"] == n
    for i in range(n):
        rig.tell(Forget(request_id=f"cmpl-{i}-0-aaaaaaaa", outcome="pushed"))
    sizes = rig.sizes()
    assert sizes["finished"] == sizes["by_base"] == sizes["by_tid"] == 0
    rig.writer.wait_for(PostPush, count=n)


def test_handler_exception_does_not_kill_the_actor(rig: Rig) -> None:
    rig.ctx.faults.fail_handler("matcher", RegistrationArrived, times=1)
    bad = make_reg("cmpl-boom-0-bbbbbbbb")
    rig.tell(arrived(bad))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert refusal.registration == bad
    assert "P matcher error" in refusal.reason and "injected failure" in refusal.reason
    assert rig.metrics.get("matcher.handler_error") == 1
    assert rig.ref.is_alive()
    rig.tell(finished("cmpl-ok-0-aaaaaaaa"), arrived(make_reg("cmpl-ok-0-bbbbbbbb")))
    (post,) = rig.writer.wait_for(PostPush)
    assert post.request_id == "cmpl-ok-0-aaaaaaaa"


def test_abort_of_one_transfer_does_not_expire_another(rig: Rig) -> None:
    # Same base id, different transfer ids: D's abort of T-a says nothing about P's T-b.
    rig.tell(AbortArrived(abort=Abort(request_id="cmpl-k-0-bbbbbbbb", transfer_id="T-a"), sender=D_SENDER))
    rig.tell(finished("cmpl-k-0-aaaaaaaa", tid="T-b"), arrived(make_reg("cmpl-k-0-cccccccc", tid="T-b")))
    (post,) = rig.writer.wait_for(PostPush, timeout=2)
    assert post.request_id == "cmpl-k-0-aaaaaaaa"
    rig.settle()
    assert rig.writer.of(ExpireLease) == []


def test_a_large_registration_is_decoded_here_and_checked_against_ds_capacity(rig: Rig) -> None:
    from pushactors.protocol import encode_registration

    big = make_reg("cmpl-big-0-bbbbbbbb", blocks=tuple(range(20000)))
    body = encode_registration(big)[len(b"PUSH_REG:") :]
    rig.tell(RegistrationArrived(sender=D_SENDER, header=big.header(), payload=body, capacity=(19999,)))
    (refusal,) = rig.writer.wait_for(RefuseRegistration)
    assert "capacity" in refusal.reason and refusal.registration == big
    rig.tell(RegistrationArrived(sender=D_SENDER, header=big.header(), payload=body, capacity=(20000,)))
    rig.tell(RegistrationArrived(sender=D_SENDER, header=big.header(), payload=body[:-7], capacity=(20000,)))
    rig.settle()
    assert rig.sizes()["pending_registrations"] == 1
    assert rig.metrics.get("notif.malformed.push_reg") == 1
    forged = make_reg("cmpl-other-0-bbbbbbbb", blocks=(1,))
    body2 = encode_registration(forged)[len(b"PUSH_REG:") :]
    rig.tell(RegistrationArrived(sender=D_SENDER, header=big.header(), payload=body2, capacity=(20000,)))
    rig.settle()
    assert rig.metrics.get("notif.malformed") == 2  # a body that is not what the header said


def test_ds_heartbeat_renews_its_promise_for_the_writer_and_forgetting_the_request_drops_it() -> None:
    """Plain, no threads: the matcher is the one writer of ``ctx.promises`` (core/promises.py).
    A heartbeat with D's deadline renews the served registration's promise, a late older one
    never takes it back, another D's heartbeat does not touch it, and P forgetting the request
    removes it."""
    ctx = RankContext(config=PushConfig(engine_id=P_ENGINE), engine_id=P_ENGINE)
    for name in ("writer", "reaper", "handshake", "stager"):
        setattr(ctx.peers, name, Sink())
    m = Matcher(ctx)
    gen = (3 << 32) | 1
    reg = make_reg("d-1", remote_request_id="p-1", generation=gen)
    m.actor_ref.tell(finished("p-1"))
    m.actor_ref.tell(arrived(reg))
    drive(m)
    assert [t for t in ctx.peers.writer.told if isinstance(t, PostPush)]  # type: ignore[attr-defined]
    key = ("p-1", reg.decode_tp_rank, gen)
    assert ctx.promises.deadline(key) == 0.0
    m.actor_ref.tell(HeartbeatArrived(ids=("p-1",), sender=D_SENDER, deadline=500.0))
    m.actor_ref.tell(HeartbeatArrived(ids=("p-1",), sender=D_SENDER, deadline=400.0))  # older, resolved late
    m.actor_ref.tell(HeartbeatArrived(ids=("p-1",), sender="other-pp0-tp0", deadline=900.0))  # not its sender
    drive(m)
    assert ctx.promises.deadline(key) == 500.0 and len(ctx.promises) == 1
    assert m.sizes()["promises"] == 1
    m.actor_ref.tell(Forget(request_id="p-1", outcome="pushed"))
    drive(m)
    assert ctx.promises.deadline(key) == 0.0 and len(ctx.promises) == 0
