"""Actor-level tests of the lease-reaper (docs/protocol.md, 'Generations and deadlines'): P leases,
D ledger, watchdog, heartbeats."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pushactors.actors.base import RankContext, Tick
from pushactors.actors.reaper import Reaper
from pushactors.core.config import PushConfig
from pushactors.protocol import (
    AbortRecv,
    ArmLease,
    ClearLease,
    ExpireLease,
    ExtendLeases,
    PeerKey,
    RecvNotified,
    RecvUndelivered,
    Registration,
    SendAbort,
    SendHeartbeats,
    SendRegistration,
    WatchRecv,
)
from pushactors.protocol.mailbox import Batch
from pushactors.testing import ActorRig, Probe, registration, wait_until

pytestmark = pytest.mark.timeout(60)

LEASE = 0.2
QUARANTINE = 0.3
HB_EVERY = 0.05


class StampedProbe(Probe):
    """A probe that also records when each message arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps: list[tuple[float, Any]] = []
        self._stamp_lock = threading.Lock()

    def on_receive(self, message: Any) -> None:
        with self._stamp_lock:
            now = time.monotonic()
            self.stamps.extend((now, m) for m in (message.messages if isinstance(message, Batch) else (message,)))
        super().on_receive(message)

    def stamped(self, kind: type, where: Any = None) -> list[tuple[float, Any]]:
        with self._stamp_lock:
            return [(t, m) for t, m in self.stamps if isinstance(m, kind) and (where is None or where(m))]


class Results:
    """Accumulates what the reaper hands the engine thread through the outbox."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.finished: set[str] = set()
        self.failed: dict[str, str] = {}

    def pull(self) -> Results:
        report = self.ctx.outbox.drain()
        self.finished |= set(report.finished_recving)
        self.failed.update(report.failed_recving)
        return self


class Rig(ActorRig):
    def __init__(self, clock: Any = None, **config: Any) -> None:
        settings: dict[str, Any] = {
            "lease_duration": LEASE,
            "reaper_tick": 0.01,
            "heartbeat_interval": HB_EVERY,
            "abort_quarantine": QUARANTINE,
            # These tests time the quarantine itself, far below the production bound.
            "allow_unsafe_quarantine": True,
            **config,
        }
        extra = {"clock": clock} if clock is not None else {}
        super().__init__(
            "reaper",
            Reaper.start,
            PushConfig(engine_id="decode", **settings),
            probes={"writer": StampedProbe.start()},
            **extra,
        )
        self.writer: StampedProbe = self.probe("writer")  # type: ignore[assignment]
        self.matcher = self.probe("matcher")
        self.results = Results(self.ctx)

    def expiries(self) -> list[tuple[float, str]]:
        return [(t, m.request_id) for t, m in self.writer.stamped(ExpireLease)]


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.ps.stop()


def now() -> float:
    return time.monotonic()


# ------------------------------------------------------------------------------------------------
# P leases
# ------------------------------------------------------------------------------------------------
def test_arm_lease_holds_a_lease_and_forwards_nothing(rig: Rig) -> None:
    """The worker hands the blocks to the matcher itself (after the lease): the reaper only
    keeps time, so the matcher hears nothing from it."""
    rig.tell(ArmLease(request_id="p-1", deadline=now() + 30))
    rig.settle()
    assert rig.ref.proxy().sizes().get(timeout=5)["leases"] == 1
    assert rig.matcher.messages == ["barrier"]  # only the settle barrier itself


def test_lease_expires_at_its_deadline_never_before(rig: Rig) -> None:
    deadline = now() + 0.15
    rig.tell(ArmLease(request_id="p-1", deadline=deadline))
    (expire,) = rig.writer.wait_for(ExpireLease, timeout=5)
    assert expire.request_id == "p-1"
    assert expire.reason == "lease_expired"
    ((at, _),) = rig.expiries()
    assert at >= deadline
    assert rig.ctx.metrics.get("lease.expired") == 1
    assert rig.ref.proxy().sizes().get(timeout=5)["leases"] == 0


def test_cleared_lease_never_expires(rig: Rig) -> None:
    t0 = now()
    rig.tell(
        ArmLease(request_id="cleared", deadline=t0 + 0.05),
        ClearLease(request_id="cleared"),
        # A later lease is the barrier: the reaper reaps in deadline order.
        ArmLease(request_id="control", deadline=t0 + 0.1),
    )
    rig.writer.wait_for(ExpireLease, where=lambda m: m.request_id == "control")
    rig.settle()
    assert [rid for _, rid in rig.expiries()] == ["control"]


def test_extend_moves_deadline_to_two_thirds_lease_and_never_shortens(rig: Rig) -> None:
    t0 = now()
    rig.tell(
        ArmLease(request_id="short", deadline=t0 + 0.08),
        ArmLease(request_id="control", deadline=t0 + 0.08),
        ArmLease(request_id="long", deadline=t0 + 0.4),
    )
    extended_at = now()
    rig.tell(ExtendLeases(request_ids=("short", "long", "unknown")))
    rig.writer.wait_for(ExpireLease, count=3, timeout=5)
    got = dict((rid, at) for at, rid in rig.expiries())
    assert [rid for _, rid in sorted((at, rid) for rid, at in got.items())] == ["control", "short", "long"]
    assert got["short"] >= extended_at + LEASE * 2 / 3 - 1e-3
    assert got["long"] >= t0 + 0.4  # not shortened to now + 2/3 lease
    assert len(rig.expiries()) == 3  # the stale heap entries were skipped


def test_heap_orders_by_deadline_not_arrival(rig: Rig) -> None:
    t0 = now()
    rig.tell(
        ArmLease(request_id="A", deadline=t0 + 0.2),
        ArmLease(request_id="B", deadline=t0 + 0.05),
    )
    rig.writer.wait_for(ExpireLease, count=2, timeout=5)
    order = [rid for _, rid in rig.expiries()]
    assert order == ["B", "A"]
    stamps = dict((rid, at) for at, rid in rig.expiries())
    assert stamps["B"] >= t0 + 0.05
    assert stamps["A"] >= t0 + 0.2


def test_heartbeated_head_does_not_strand_expired_entries(rig: Rig) -> None:
    t0 = now()
    rig.tell(
        ArmLease(request_id="head", deadline=t0 + 0.05),
        ArmLease(request_id="behind", deadline=t0 + 0.09),
        ExtendLeases(request_ids=("head",)),  # head now expires at ~t0 + 0.133
    )
    rig.writer.wait_for(ExpireLease, count=2, timeout=5)
    stamps = dict((rid, at) for at, rid in rig.expiries())
    assert [rid for _, rid in rig.expiries()] == ["behind", "head"]
    assert stamps["behind"] >= t0 + 0.09
    assert stamps["head"] >= t0 + LEASE * 2 / 3


def test_a_settled_burst_leaves_no_stale_item_in_the_lease_heap() -> None:
    """P settles a burst of 2,000 requests, 100 in flight at a time: each lease armed, then
    cleared as its push lands. Right after the last clear the lease heap is empty, not holding
    stale items until the reaper's next tick (a heartbeat period away)."""
    rig = Rig(heartbeat_interval=50.0, lease_duration=90.0)  # no tick runs during the test
    try:
        t0 = now()
        for i in range(2000):
            rig.tell(ArmLease(request_id=f"p-{i}", deadline=t0 + 30 + i * 1e-3, serial=i + 1))
            if i >= 100:
                rig.tell(ClearLease(request_id=f"p-{i - 100}", serial=i - 99))
        rig.tell(*(ClearLease(request_id=f"p-{i}", serial=i + 1) for i in range(1900, 2000)))
        assert rig.sizes()["leases"] == 0
        assert rig.sizes()["lease_heap"] == 0
        assert rig.expiries() == []
    finally:
        rig.ps.stop()


class Sink:
    def __init__(self) -> None:
        self.told: list[Any] = []

    def tell(self, message: Any) -> None:
        self.told.append(message)


def test_extend_leases_works_one_bounded_slice_per_message_towards_the_first_target() -> None:
    """Plain, no threads: 3,000 leases named by one ExtendLeases are extended at most
    ``extend_slice`` per handler call; the rest is told back to the mailbox, behind an ArmLease
    already waiting (handled after one slice), and extended to the target of the first slice
    even though the rank clock moved on."""
    t = [100.0]
    ctx = RankContext(
        config=PushConfig(engine_id="prefill", lease_duration=30.0), engine_id="prefill", clock=lambda: t[0]
    )
    for name in ("writer", "matcher", "handshake", "stager"):
        setattr(ctx.peers, name, Sink())
    r = Reaper(ctx)
    ids = tuple(f"p-{i}" for i in range(3000))
    for rid in ids:
        r.on_receive(ArmLease(request_id=rid, deadline=101.0, serial=1))
    r.actor_ref.tell(ExtendLeases(request_ids=ids))
    r.actor_ref.tell(ArmLease(request_id="new", deadline=130.0))
    slice_ = Reaper.extend_slice
    assert slice_ == 1024
    handled = []
    first_target = 100.0 + 30.0 * 2 / 3
    while not r.actor_inbox.empty():
        message = r.actor_inbox.get().message
        if isinstance(message, Tick):
            continue
        r.on_receive(message)
        handled.append(message)
        extended = sum(1 for rid in ids if r.lease_deadline(rid) == first_target)
        assert extended == min(len(ids), slice_ * sum(isinstance(h, ExtendLeases) for h in handled))
        t[0] += 5.0  # time passes between messages: the rest still extends to the first target
    assert [type(h).__name__ for h in handled] == ["ExtendLeases", "ArmLease", "ExtendLeases", "ExtendLeases"]
    assert [h.offset for h in handled if isinstance(h, ExtendLeases)] == [0, slice_, 2 * slice_]
    assert all(h.request_ids is ids for h in handled if isinstance(h, ExtendLeases))
    assert all(r.lease_deadline(rid) == first_target for rid in ids)
    assert ctx.metrics.get("reaper.extend_requeued") == 2


# ------------------------------------------------------------------------------------------------
# D ledger
# ------------------------------------------------------------------------------------------------
def make_reg(d_id: str, *, engine: str = "prefill", tid: str | None = None, port: int = 32000) -> Registration:
    return registration(d_id, (4, 5), prefill=(engine, "prefill-host", port), p_tp=2, tid=tid)


def watch(
    d_id: str,
    *,
    expected: int = 1,
    deadline: float | None = None,
    engine: str = "prefill",
    heartbeat_id: str | None = None,
    tid: str | None = None,
    port: int = 32000,
) -> WatchRecv:
    reg = make_reg(d_id, engine=engine, tid=tid, port=port)
    return WatchRecv(
        request_id=d_id,
        expected=expected,
        deadline=deadline if deadline is not None else now() + 30,
        registration=reg,
        peers=tuple(PeerKey(engine, "prefill-host", port, 0, tp) for tp in range(expected)),
        heartbeat_id=heartbeat_id or d_id,
    )


def peer_of(sender: str, engine: str = "prefill", port: int = 32000) -> PeerKey:
    """The P rank the writer verified ``sender`` as (agent names end in -pp<p>-tp<t>)."""
    tp = int(sender.rsplit("-tp", 1)[1]) if "-tp" in sender else 0
    return PeerKey(engine, "prefill-host", port, 0, tp)


def ok(d_id: str, sender: str = "prefill-pp0-tp0") -> RecvNotified:
    return RecvNotified(request_id=d_id, ok=True, sender=sender, peer=peer_of(sender))


def failed(d_id: str, reason: str, sender: str = "prefill-pp0-tp0", *, final: bool = True) -> RecvNotified:
    return RecvNotified(request_id=d_id, ok=False, sender=sender, reason=reason, peer=peer_of(sender), final=final)


def test_watch_sends_the_registration(rig: Rig) -> None:
    w = watch("d-1")
    rig.tell(w)
    (send,) = rig.writer.wait_for(SendRegistration)
    assert send.registration == w.registration


def test_finished_only_after_every_expected_completion(rig: Rig) -> None:
    rig.tell(watch("d-1", expected=2), ok("d-1", "prefill-pp0-tp0"))
    rig.settle()
    assert rig.results.pull().finished == set()
    assert rig.results.failed == {}
    rig.tell(ok("d-1", "prefill-pp0-tp1"))
    rig.settle()
    assert rig.results.pull().finished == {"d-1"}
    assert rig.results.failed == {}
    assert rig.ref.proxy().sizes().get(timeout=5)["recvs"] == 0


def test_duplicate_completion_from_one_p_rank_counts_once(rig: Rig) -> None:
    # P TP 2 → D TP 1: each P rank writes its head slice. A duplicated completion from rank 0
    # must not stand in for rank 1's, or D reads half-written KV.
    rig.tell(watch("d-1", expected=2), ok("d-1", "prefill-pp0-tp0"), ok("d-1", "prefill-pp0-tp0"))
    rig.settle()
    rig.results.pull()
    assert rig.results.finished == set()
    assert rig.results.failed == {}
    rig.tell(ok("d-1", "prefill-pp0-tp1"))
    rig.settle()
    assert rig.results.pull().finished == {"d-1"}


def test_push_failure_fails_the_request_after_all_answered(rig: Rig) -> None:
    rig.tell(
        watch("d-1", expected=2),
        failed("d-1", "P lost its lease"),
    )
    rig.settle()
    assert rig.results.pull().failed == {}
    rig.tell(ok("d-1", "prefill-pp0-tp1"))
    rig.settle()
    rig.results.pull()
    assert rig.results.failed == {"d-1": "P lost its lease"}
    assert rig.results.finished == set()


def test_undelivered_registrations_count_as_answers(rig: Rig) -> None:
    rig.tell(watch("d-1", expected=3), ok("d-1"))
    rig.tell(RecvUndelivered(request_id="d-1", count=1, reason="no P agent"))
    rig.settle()
    assert rig.results.pull().failed == {}
    rig.tell(RecvUndelivered(request_id="d-1", count=1, reason="send failed"))
    rig.settle()
    rig.results.pull()
    assert rig.results.failed == {"d-1": "no P agent"}
    assert rig.results.finished == set()


def test_abort_quarantines_until_every_answer_arrived(rig: Rig) -> None:
    w = watch("d-1", expected=2, tid="T-1")
    rig.tell(w, ok("d-1"), AbortRecv(request_id="d-1"))
    (abort,) = rig.writer.wait_for(SendAbort)
    assert abort.abort.request_id == "d-1"
    assert abort.abort.transfer_id == "T-1"
    assert abort.abort.decode_tp_rank == 0
    assert abort.peers == w.peers
    rig.settle()
    assert rig.results.pull().failed == {}  # P may still write into those blocks
    assert rig.results.finished == set()
    # Repeated aborts do not send another.
    rig.tell(AbortRecv(request_id="d-1"))
    rig.settle()
    assert len(rig.writer.of(SendAbort)) == 1
    assert rig.results.pull().failed == {}
    rig.tell(ok("d-1", "prefill-pp0-tp1"))
    rig.settle()
    rig.results.pull()
    assert "d-1" in rig.results.failed
    assert "abort" in rig.results.failed["d-1"]
    assert rig.results.finished == set()


def test_watchdog_fails_a_request_that_never_saw_its_push(rig: Rig) -> None:
    t0 = now()
    rig.tell(watch("d-late", expected=1, deadline=t0 + 0.05), watch("d-past", expected=1, deadline=t0 - 1))
    # The watchdog first tells P to stand down; the blocks stay quarantined meanwhile.
    aborts = rig.writer.wait_for(SendAbort, count=2)
    assert {a.abort.request_id for a in aborts} == {"d-late", "d-past"}
    assert all(a.abort.reason for a in aborts)
    wait_until(lambda: len(rig.results.pull().failed) == 2, timeout=5, what="watchdog + quarantine")
    reported = now()
    sent = max(t for t, _ in rig.writer.stamped(SendAbort))
    assert reported - sent >= QUARANTINE * 0.9  # never released before the quarantine bound
    for rid in ("d-late", "d-past"):
        reason = rig.results.failed[rid].lower()
        assert "timeout" in reason or "timed out" in reason
    assert rig.ctx.metrics.get("recv.timed_out") == 2
    assert rig.results.finished == set()
    # A completion after the watchdog fired is unknown, and ignored.
    rig.tell(ok("d-late"))
    rig.settle()
    assert rig.results.pull().finished == set()
    assert rig.ctx.metrics.get("reaper.notif_unknown_request") == 1


def test_answer_after_watchdog_ends_the_quarantine_at_once(rig: Rig) -> None:
    rig.tell(watch("d-q", expected=1, deadline=now() + 0.03))
    rig.writer.wait_for(SendAbort)
    rig.tell(failed("d-q", "aborted by decode"))
    rig.settle()
    rig.results.pull()
    assert "d-q" in rig.results.failed  # P confirmed: no need to wait out the quarantine


def test_unknown_notification_is_ignored(rig: Rig) -> None:
    rig.tell(ok("never-watched"), RecvNotified(request_id="never-watched-2", ok=False, sender="x", reason="r"))
    rig.settle()
    assert rig.ctx.metrics.get("reaper.notif_unknown_request") == 2
    rig.results.pull()
    assert rig.results.finished == set()
    assert rig.results.failed == {}
    assert rig.ref.is_alive()


def test_heartbeats_list_awaited_requests_per_p_engine(rig: Rig) -> None:
    rig.tell(
        watch("d-1", engine="prefill-a", heartbeat_id="T-1", tid="T-1"),
        watch("d-2", engine="prefill-a", heartbeat_id="p-2"),
        watch("d-3", engine="prefill-b", port=32001),
        watch("d-4", engine="prefill-a", heartbeat_id="aborted-one"),
        watch("d-5", engine="prefill-a", heartbeat_id="settled-one"),
        AbortRecv(request_id="d-4"),
        RecvNotified(request_id="d-5", ok=True, sender="prefill-a-pp0-tp0", peer=peer_of("x", engine="prefill-a")),
    )
    rig.settle()
    seen = len(rig.writer.of(SendHeartbeats))
    rig.writer.wait_for(SendHeartbeats, count=seen + 4, timeout=5)
    fresh = rig.writer.of(SendHeartbeats)[seen:]
    by_engine: dict[str, set[tuple[str, ...]]] = {}
    for hb in fresh:
        by_engine.setdefault(hb.engine_id, set()).add(tuple(sorted(hb.ids)))
    assert by_engine["prefill-a"] == {("T-1", "p-2")}
    assert by_engine["prefill-b"] == {("d-3",)}
    for hb in fresh:
        if hb.engine_id == "prefill-a":
            assert (hb.host, hb.port) == ("prefill-host", 32000)
            assert hb.peers == (PeerKey("prefill-a", "prefill-host", 32000, 0, 0),)
        else:
            assert (hb.host, hb.port) == ("prefill-host", 32001)
    # Paced by heartbeat_interval: consecutive rounds for one engine are about that far apart.
    times = [t for t, m in rig.writer.stamped(SendHeartbeats, where=lambda m: m.engine_id == "prefill-b")]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps and min(gaps) >= HB_EVERY * 0.6


def test_no_heartbeats_once_nothing_is_awaited(rig: Rig) -> None:
    rig.tell(watch("d-1"))
    rig.writer.wait_for(SendHeartbeats, timeout=5)
    rig.tell(ok("d-1"))
    rig.settle()
    seen = len(rig.writer.of(SendHeartbeats))
    # A lease expiring well after several heartbeat intervals is the barrier.
    rig.tell(ArmLease(request_id="barrier", deadline=now() + 4 * HB_EVERY))
    rig.writer.wait_for(ExpireLease, timeout=5)
    rig.settle()
    assert len(rig.writer.of(SendHeartbeats)) == seen


def test_deadlines_follow_the_rank_clock() -> None:
    # Deadlines are on "this worker's clock" (ctx.clock); the reaper must reap on that clock too.
    offset = 1000.0

    def clock() -> float:
        return time.monotonic() + offset

    rig = Rig(clock=clock)
    try:
        rig.tell(ArmLease(request_id="p-1", deadline=clock() + 0.05))
        rig.tell(watch("d-1", deadline=clock() + 0.05))
        (expire,) = rig.writer.wait_for(ExpireLease, timeout=2)
        assert expire.request_id == "p-1"
        wait_until(lambda: "d-1" in rig.results.pull().failed, timeout=2, what="watchdog on the rank clock")
    finally:
        rig.ps.stop()


def test_a_take_absorbed_before_a_decision_that_raises_is_still_carried_out(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer took d-1's completion and reported it (core/claims.py). The reaper's next use
    of its registry absorbs that take and then raises: d-1 stays reported once, and d-2, which
    waited for d-1's transfer id, still ends (the id is spent) instead of being lost."""
    rig.tell(watch("d-1", tid="T"), watch("d-2", tid="T"))
    rig.writer.wait_for(SendRegistration)  # d-1's; d-2 waits, unregistered
    rig.settle()
    assert rig.ctx.claims.try_take("d-1", peer=peer_of("prefill-pp0-tp0"), generation=0)
    rig.ctx.outbox.received("d-1")  # as the writer does right after its take
    registry = rig.ctx.claims.registry
    assert registry is not None

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the registry failed")

    monkeypatch.setattr(registry, "abort", broken)
    rig.tell(AbortRecv(request_id="d-other"))
    rig.settle()
    assert rig.metrics.get("reaper.handler_error") == 1
    rig.results.pull()
    assert rig.results.finished == {"d-1"}
    assert set(rig.results.failed) == {"d-2"} and "transfer id 'T'" in rig.results.failed["d-2"]
    assert rig.sizes()["recvs"] == 0 and rig.sizes()["recv_waiting"] == 0
    assert len(rig.writer.of(SendRegistration)) == 1  # d-2 was never registered
