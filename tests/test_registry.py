"""Thread-free unit tests of the plain request state (``pushactors.core.registry``)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushactors.core.registry import (
    AnswerAbort,
    CancelServed,
    DeadlineHeap,
    FailEntry,
    Post,
    PRegistry,
    Refuse,
    Tombstones,
)
from pushactors.protocol import Abort, Registration
from pushactors.testing import registration

SENDER = "decode-pp0-tp0"


def reg(d_id: str, *, rank: int = 0, d_tp: int = 1, tid: str | None = None, pid: str | None = None,
        blocks: tuple[int, ...] = (5, 6)) -> Registration:  # fmt: skip
    return registration(d_id, blocks, rank=rank, d_tp=d_tp, tid=tid, remote_request_id=pid)


def registry(**kw: Any) -> PRegistry:
    return PRegistry(
        lease_duration=kw.pop("lease", 30.0),
        tombstone_ttl=kw.pop("ttl", 600.0),
        orphan_ttl=kw.pop("orphan", 480.0),
        **kw,
    )


def kinds(result: Any) -> list[str]:
    return [type(a).__name__ for a in result.actions]


# ------------------------------------------------------------------------------------------------
# Tombstones and deadlines
# ------------------------------------------------------------------------------------------------
def test_tombstones_are_exact_and_pruned_by_age() -> None:
    t: Tombstones[str, int] = Tombstones(ttl=10.0, max_size=3)
    t.put("a", 1, now=0.0)
    t.put("b", 2, now=5.0)
    assert t.get("a") == 1 and "b" in t and t.get("c") is None
    assert t.prune(now=11.0) == 1  # "a" is older than 10 s
    assert "a" not in t and t.get("b") == 2
    t.put("b", 3, now=12.0)  # re-put refreshes its age
    assert t.prune(now=16.0) == 0
    for k in "cdef":
        t.put(k, 0, now=13.0)
    assert len(t) == 3 and "b" not in t  # bounded: the oldest go first


def test_deadline_heap_reaps_in_deadline_order_and_honours_moves() -> None:
    h: DeadlineHeap[str] = DeadlineHeap()
    h.set("x", 5.0)
    h.set("y", 3.0)
    h.set("x", 1.0)  # moved earlier
    h.set("y", 9.0)  # moved later (a heartbeat)
    h.set("z", 4.0)
    h.discard("z")
    assert h.next_deadline() == 1.0
    assert list(h.due(now=5.0)) == ["x"]
    assert list(h.due(now=8.0)) == []
    assert list(h.due(now=9.0)) == ["y"]
    assert len(h) == 0 and h.next_deadline() is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcde"), st.floats(0, 100)), max_size=40), st.floats(0, 100))
def test_deadline_heap_matches_a_dict(moves: list[tuple[str, float]], now: float) -> None:
    h: DeadlineHeap[str] = DeadlineHeap()
    want: dict[str, float] = {}
    for key, deadline in moves:
        h.set(key, deadline)
        want[key] = deadline
    assert sorted(h.due(now)) == sorted(k for k, d in want.items() if d <= now)
    assert len(h) == sum(1 for d in want.values() if d > now)


def _bounded(h: DeadlineHeap[str]) -> bool:
    return h.heap_size() <= 2 * len(h) + DeadlineHeap.COMPACT_SLACK


def test_deadline_heap_stays_bounded_by_live_keys_under_heartbeat_churn() -> None:
    """2,000 leases of 30 s, extended by heartbeats to now + 20 s every 5 s of a long prefill,
    some cleared and re-armed on the way, then all cleared: stale items never pile up with rate x
    timeout (the heap once grew by one item per extension until the item reached the top)."""
    h: DeadlineHeap[str] = DeadlineHeap()
    keys = [f"req-{i}" for i in range(2000)]
    now = 0.0
    for k in keys:
        h.set(k, now + 30.0)
    sets = len(keys)
    for beat in range(60):
        now += 5.0
        for i, k in enumerate(keys):
            if (i + beat) % 7 == 0:
                h.discard(k)  # the push landed: ClearLease
                h.set(k, now + 30.0)  # the id reused by a new request: ArmLease
                sets += 1
            elif k in h:
                h.set(k, max(h.get(k) or 0.0, now + 20.0))  # ExtendLeases
                sets += 1
            assert _bounded(h)
        assert list(h.due(now)) == []  # every lease was kept alive
        assert h.heap_size() <= 2 * len(keys) + DeadlineHeap.COMPACT_SLACK
    assert sets > 100_000  # without compaction the heap would hold one item per set
    for k in keys:
        h.discard(k)
        assert _bounded(h)
    assert len(h) == 0 and h.heap_size() <= len(h) + DeadlineHeap.COMPACT_SLACK
    assert h.next_deadline() is None and list(h.due(now + 1e6)) == []


def test_deadline_heap_set_then_discarded_leaves_no_more_than_the_slack() -> None:
    """D's watchdogs: 2,000 registrations armed, then (the pushes landed) discarded, round after
    round; and an unchanged deadline set again adds nothing."""
    h: DeadlineHeap[str] = DeadlineHeap()
    for round_ in range(20):
        for i in range(2000):
            h.set(f"r{round_}-{i}", 480.0 + round_)
            h.set(f"r{round_}-{i}", 480.0 + round_)  # the same deadline again: no new item
        assert h.heap_size() <= len(h) + DeadlineHeap.COMPACT_SLACK
        for i in range(2000):
            h.discard(f"r{round_}-{i}")
            assert _bounded(h)
        assert h.heap_size() <= len(h) + DeadlineHeap.COMPACT_SLACK
    assert len(h) == 0


@pytest.mark.parametrize("order", ["armed", "reversed", "shuffled"])
def test_deadline_heap_holds_no_stale_item_once_a_burst_is_cleared(order: str) -> None:
    """P's leases over a burst: 1,000 armed (some extended), then all cleared as their pushes
    land, in any order. Right after the last clear the heap is empty: no stale item waits there
    for a later reap or compaction to drop it."""
    h: DeadlineHeap[str] = DeadlineHeap()
    keys = [f"p-{i}" for i in range(1000)]
    for i, k in enumerate(keys):
        h.set(k, 30.0 + i * 1e-3)
        if i % 3 == 0:
            h.set(k, 50.0 + i * 1e-3)  # a heartbeat extended it: its first item is stale
    if order == "reversed":
        keys.reverse()
    elif order == "shuffled":
        random.Random(7).shuffle(keys)
    for k in keys:
        h.discard(k)
        assert h.heap_size() <= 2 * len(h) + DeadlineHeap.COMPACT_SLACK
    assert len(h) == 0 and h.heap_size() == 0
    assert h.next_deadline() is None


def test_deadline_heap_stale_items_never_outnumber_live_ones_past_the_slack() -> None:
    """Live leases armed before a burst sit above it in the heap, so the burst's stale items are
    not at the top to be popped: the heap is rebuilt once they outnumber the live items (plus
    the slack), so it never holds more than ``2 x live + COMPACT_SLACK``."""
    h: DeadlineHeap[str] = DeadlineHeap()
    live = [f"live-{i}" for i in range(200)]
    for k in live:
        h.set(k, 10.0)
    for i in range(3000):
        k = f"p-{i}"
        h.set(k, 40.0 + i * 1e-3)
        h.set(k, 45.0 + i * 1e-3)  # extended
        h.discard(k)
        assert h.heap_size() <= 2 * len(h) + DeadlineHeap.COMPACT_SLACK, i
    assert len(h) == len(live) and list(h.due(10.0)) == live
    assert h.heap_size() == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["set", "set", "discard", "due"]), st.sampled_from("abcdefgh"), st.floats(0, 100)),
        max_size=300,
    )
)
def test_deadline_heap_with_discards_matches_a_dict_and_stays_bounded(ops: list[tuple[str, str, float]]) -> None:
    h: DeadlineHeap[str] = DeadlineHeap()
    want: dict[str, float] = {}
    for op, key, value in ops:
        if op == "set":
            h.set(key, value)
            want[key] = value
        elif op == "discard":
            h.discard(key)
            want.pop(key, None)
        else:
            assert sorted(h.due(value)) == sorted(k for k, d in want.items() if d <= value)
            want = {k: d for k, d in want.items() if d > value}
        assert len(h) == len(want) and all(h.get(k) == d for k, d in want.items())
        assert h.next_deadline() == (min(want.values()) if want else None)
        assert _bounded(h)


# ------------------------------------------------------------------------------------------------
# Matching
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks_first", [True, False])
def test_pairs_by_transfer_id_in_either_order(blocks_first: bool) -> None:
    r = registry()
    if blocks_first:
        r.add_finished("p-1", ((1, 2),), "T", now=0.0, serial=7)
        res = r.add_registration(reg("d-x", tid="T"), SENDER, now=1.0)
    else:
        r.add_registration(reg("d-x", tid="T"), SENDER, now=0.0)
        res = r.add_finished("p-1", ((1, 2),), "T", now=1.0, serial=7)
    (post,) = res.actions
    assert isinstance(post, Post) and (post.p_request_id, post.serial, post.sender) == ("p-1", 7, SENDER)
    assert r.sizes()["pending_registrations"] == 0 and r.sizes()["served"] == 1


def test_an_entry_with_a_transfer_id_never_pairs_by_id_or_base() -> None:
    r = registry()
    r.add_finished("cmpl-a-0-aaaaaaaa", ((1,),), "T", now=0.0)
    for forged in (reg("cmpl-a-0-bbbbbbbb"), reg("cmpl-a-0-aaaaaaaa"), reg("x", pid="cmpl-a-0-aaaaaaaa")):
        assert r.add_registration(forged, SENDER, now=0.0).event == "reg.stored"
    assert r.sizes()["served"] == 0


def test_a_unique_base_id_pairs_and_an_ambiguous_one_fails_everything() -> None:
    r = registry()
    r.add_finished("cmpl-b-0-aaaaaaaa", ((1,),), None, now=0.0, serial=1)
    assert kinds(r.add_registration(reg("cmpl-b-0-bbbbbbbb"), SENDER, now=0.0)) == ["Post"]
    r2 = registry()
    r2.add_finished("cmpl-c-0-aaaaaaaa", ((1,),), None, now=0.0, serial=1)
    r2.add_finished("cmpl-c-0-cccccccc", ((2,),), None, now=0.0, serial=2)
    res = r2.add_registration(reg("cmpl-c-0-bbbbbbbb"), SENDER, now=0.0)
    assert res.event == "reg.ambiguous"
    assert sorted(kinds(res)) == ["FailEntry", "FailEntry", "Refuse"]
    assert {a.p_request_id for a in res.actions if isinstance(a, FailEntry)} == {
        "cmpl-c-0-aaaaaaaa",
        "cmpl-c-0-cccccccc",
    }
    # P's exact id (sequential legs) is never ambiguous.
    r3 = registry()
    r3.add_finished("cmpl-c-0-aaaaaaaa", ((1,),), None, now=0.0)
    r3.add_finished("cmpl-c-0-cccccccc", ((2,),), None, now=0.0)
    (post,) = r3.add_registration(reg("d", pid="cmpl-c-0-cccccccc"), SENDER, now=0.0).actions
    assert isinstance(post, Post) and post.p_request_id == "cmpl-c-0-cccccccc"


@pytest.mark.parametrize("blocks_first", [True, False])
def test_an_exact_p_id_never_pulls_in_a_sibling_that_shares_its_prefix(blocks_first: bool) -> None:
    """Ids used verbatim on both sides (``job-00000000``, ``job-00000001``): the tail looks like
    an engine suffix, but a registration naming P's id exactly means that request only."""
    r = registry()
    mine = reg("job-00000001", pid="job-00000001", blocks=(7, 8))
    if blocks_first:
        r.add_finished("job-00000000", ((1,),), None, now=0.0, serial=1)
        assert r.add_registration(mine, SENDER, now=0.0).event == "reg.stored"
    else:
        assert r.add_registration(mine, SENDER, now=0.0).event == "reg.stored"
        assert r.add_finished("job-00000000", ((1,),), None, now=0.0, serial=1).actions == []
    assert r.sizes()["served"] == 0
    (post,) = r.add_finished("job-00000001", ((2,),), None, now=0.0, serial=2).actions
    assert isinstance(post, Post) and post.p_request_id == "job-00000001"
    assert post.registration.block_groups == mine.block_groups
    # A router id without a suffix still finds P's suffixed request by its base id.
    r.add_finished("cmpl-r-0-aaaaaaaa", ((3,),), None, now=0.0, serial=3)
    (routed,) = r.add_registration(reg("cmpl-r-0-bbbbbbbb", pid="cmpl-r-0"), SENDER, now=0.0).actions
    assert isinstance(routed, Post) and routed.p_request_id == "cmpl-r-0-aaaaaaaa"


def test_a_duplicate_live_transfer_id_fails_both_requests() -> None:
    r = registry()
    r.add_finished("p-1", ((1,),), "T", now=0.0, serial=1)
    r.add_registration(reg("d-other", tid="U"), SENDER, now=0.0)
    res = r.add_finished("p-2", ((2,),), "T", now=0.0, serial=2)
    assert {(a.p_request_id, a.serial) for a in res.actions if isinstance(a, FailEntry)} == {("p-1", 1), ("p-2", 2)}
    # A registration for T now is refused, never written.
    res = r.add_registration(reg("d-t", tid="T"), SENDER, now=0.0)
    assert kinds(res) == ["Refuse"]


def test_restaging_replaces_a_pending_registration_and_is_refused_once_written() -> None:
    r = registry()
    r.add_registration(reg("d-1", tid="T", blocks=(1, 2)), SENDER, now=0.0)
    res = r.add_registration(reg("d-1", tid="T", blocks=(3, 4)), SENDER, now=0.0)
    assert res.event == "reg.replaced"
    (post,) = r.add_finished("p-1", ((9, 9 + 1),), "T", now=0.0).actions
    assert isinstance(post, Post) and post.registration.block_groups == ((3, 4),)
    assert r.add_registration(reg("d-1", tid="T", blocks=(3, 4)), SENDER, now=0.0).event == "reg.duplicate"
    res = r.add_registration(reg("d-1", tid="T", blocks=(5, 6)), SENDER, now=0.0)
    assert kinds(res) == ["Refuse"] and "re-registered" in res.actions[0].reason  # type: ignore[union-attr]
    # Another agent claiming the same slot is refused, the first binding stands.
    assert kinds(r.add_registration(reg("d-1", tid="T", blocks=(3, 4)), "intruder", now=0.0)) == ["Refuse"]


def test_a_stale_registration_is_never_written() -> None:
    r = registry(lease=3.0)
    r.add_registration(reg("d-1", tid="T"), SENDER, now=0.0)
    res = r.add_finished("p-1", ((1,),), "T", now=2.5)  # > 2/3 lease without a heartbeat
    assert kinds(res) == ["Refuse"] and "stale" in res.actions[0].reason  # type: ignore[union-attr]
    r.add_registration(reg("d-2", tid="U"), SENDER, now=0.0)
    r.heartbeat(("U",), SENDER, now=2.0)  # D still waits for it
    assert kinds(r.add_finished("p-2", ((1,),), "U", now=2.5)) == ["Post"]


def test_heartbeats_extend_only_from_the_registering_agent() -> None:
    r = registry()
    r.add_finished("p-1", ((1,),), "T", now=0.0)
    r.add_registration(reg("d-1", tid="T"), SENDER, now=0.0)
    assert r.heartbeat(("T",), "intruder", now=1.0) == ([], 0, 1)
    assert r.heartbeat(("T", "nope"), SENDER, now=1.0) == (["p-1"], 0, 1)


def test_aborts_are_exact_and_only_from_the_registering_agent() -> None:
    r = registry()
    # Before anything: remembered for that slot and sender only.
    assert r.abort(Abort(request_id="d-1"), "intruder", now=0.0).event == "abort.remembered"
    assert kinds(r.add_registration(reg("d-1"), "intruder", now=0.0)) == ["Refuse"]
    assert r.add_registration(reg("d-1"), SENDER, now=0.0).event == "reg.stored"
    # Pending: only its sender may abort it; the keys it named free P's blocks on arrival.
    assert r.abort(Abort(request_id="d-1"), "intruder", now=0.0).event == "abort.ignored"
    r.add_registration(reg("d-2", tid="T2"), SENDER, now=0.0)
    assert kinds(r.abort(Abort(request_id="d-2"), SENDER, now=0.0)) == ["Refuse"]
    assert kinds(r.add_finished("p-2", ((1,),), "T2", now=0.0)) == ["FailEntry"]
    # Served: cancel; after P is done: answered.
    r.add_finished("p-3", ((1,),), "T3", now=0.0)
    r.add_registration(reg("d-3", tid="T3"), SENDER, now=0.0)
    assert kinds(r.abort(Abort(request_id="d-3"), SENDER, now=0.0)) == ["CancelServed"]
    r.forget("p-3", "pushed", transfer_id="T3", serial=0, now=1.0)
    (answer,) = r.abort(Abort(request_id="d-3"), SENDER, now=1.0).actions
    assert isinstance(answer, AnswerAbort) and "pushed" in answer.reason
    assert not isinstance(answer, CancelServed)


def test_a_pinned_slot_is_answered_however_many_requests_ended_since_and_others_by_count() -> None:
    """P told D its WRITE "may still land" (Forget.pinned): D holds the blocks until P's final
    answer and asks again. If that answer was lost, P must still give it after its memory of
    the newest endings (``tombstone_keep``) moved on, until ``tombstone_ttl``; an unpinned
    slot's memory goes by count, as before."""
    r = registry(ttl=10.0, tombstone_keep=2)
    for i, pinned in ((1, (0,)), (2, ())):
        r.add_finished(f"p-{i}", ((1,),), f"T{i}", now=0.0)
        r.add_registration(registration(f"d-{i}", (5, 6), tid=f"T{i}", generation=100 + i), SENDER, now=0.0)
        r.forget(f"p-{i}", "failed", transfer_id=f"T{i}", serial=0, now=1.0, pinned=pinned)
    for i in range(3, 8):  # newer endings push the counted memory past both slots
        r.add_finished(f"p-{i}", ((1,),), None, now=1.0)
        r.forget(f"p-{i}", "pushed", transfer_id=None, serial=0, now=1.0)
    (answer,) = r.abort(Abort(request_id="d-1", generation=101), SENDER, now=2.0).actions
    assert isinstance(answer, AnswerAbort) and "failed" in answer.reason and answer.generation == 101
    assert r.abort(Abort(request_id="d-2", generation=102), SENDER, now=2.0).event == "abort.remembered"
    # Only for the slot's own sender, and never for another generation of it.
    assert r.abort(Abort(request_id="d-1", generation=101), "intruder", now=2.0).event != "abort.answered"
    assert r.abort(Abort(request_id="d-1", generation=7), SENDER, now=2.0).event != "abort.answered"
    assert r.sizes()["owed_slots"] == 1
    r.prune(12.0, lambda _: None)
    assert r.sizes()["owed_slots"] == 0  # by time: tombstone_ttl


def test_forget_is_exact_and_ignores_an_earlier_incarnation() -> None:
    r = registry()
    r.add_finished("cmpl-f-0-aaaaaaaa", ((1,),), None, now=0.0, serial=4)
    assert r.forget("cmpl-f-0-aaaaaaaa", "expired", transfer_id=None, serial=3, now=0.0).event == "request.forget_stale"
    assert r.sizes()["finished"] == 1
    r.forget("cmpl-f-0-aaaaaaaa", "expired", transfer_id=None, serial=4, now=0.0)
    assert r.sizes()["finished"] == 0
    # A registration naming it exactly is answered; one by base id only waits for its own.
    assert kinds(r.add_registration(reg("d-a", pid="cmpl-f-0-aaaaaaaa"), SENDER, now=0.0)) == ["Refuse"]
    assert r.add_registration(reg("cmpl-f-0-bbbbbbbb"), SENDER, now=0.0).event == "reg.stored"


def test_orphans_are_refused_after_their_ttl_and_tombstones_pruned() -> None:
    r = registry(orphan=5.0, ttl=5.0)
    r.add_registration(reg("d-1"), SENDER, now=0.0)
    r.add_finished("p-9", ((1,),), None, now=0.0)
    r.forget("p-9", "pushed", transfer_id=None, serial=0, now=0.0)
    orphans: list[Any] = []
    r.prune(4.0, orphans.append)
    assert orphans == []
    r.prune(6.0, orphans.append)
    assert [o.registration.request_id for o in orphans] == ["d-1"]
    sizes = r.sizes()
    assert sizes["pending_registrations"] == 0
    assert sizes["tombstones"] == 1  # the refused slot: a late copy of it is dropped, not stored
    late = r.add_registration(reg("d-1"), SENDER, now=7.0)
    assert (late.event, kinds(late), r.sizes()["pending_registrations"]) == ("reg.duplicate", [], 0)
    r.prune(20.0, orphans.append)
    assert r.sizes()["tombstones"] == 0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["finish", "register", "forget", "abort", "heartbeat"]),
            st.integers(0, 3),  # request number
            st.booleans(),  # with transfer id
            st.sampled_from([SENDER, "intruder"]),
        ),
        max_size=40,
    )
)
def test_random_sequences_never_post_twice_or_to_a_stranger(ops: list[tuple[str, int, bool, str]]) -> None:
    """Whatever arrives in whatever order: at most one WRITE per (P request, D rank), only ever
    to an agent that registered that D request (never to one that merely sent a heartbeat or an
    abort), and the indexes stay consistent."""
    r = registry()
    posts: list[Post] = []
    registered: dict[str, set[str]] = {}
    for op, n, with_tid, sender in ops:
        tid = f"T{n}" if with_tid else None
        if op == "finish":
            res = r.add_finished(f"cmpl-{n}-0-aaaaaaaa", ((n,),), tid, now=0.0)
        elif op == "register":
            res = r.add_registration(reg(f"cmpl-{n}-0-bbbbbbbb", tid=tid), sender, now=0.0)
            registered.setdefault(f"cmpl-{n}-0-bbbbbbbb", set()).add(sender)
        elif op == "forget":
            res = r.forget(f"cmpl-{n}-0-aaaaaaaa", "pushed", transfer_id=tid, serial=0, now=0.0)
        elif op == "abort":
            res = r.abort(Abort(request_id=f"cmpl-{n}-0-bbbbbbbb", transfer_id=tid), sender, now=0.0)
        else:
            r.heartbeat((tid or f"cmpl-{n}-0",), sender, now=0.0)
            continue
        posts += [a for a in res.actions if isinstance(a, Post)]
        assert all(isinstance(a, (Post, Refuse, FailEntry, CancelServed, AnswerAbort)) for a in res.actions)
    keys = [(p.p_request_id, p.serial, p.registration.decode_tp_rank) for p in posts]
    assert len(keys) == len(set(keys)), "two WRITEs for one P request and D rank"
    for p in posts:
        assert p.sender in registered[p.registration.request_id]
    sizes = r.sizes()
    assert sizes["regs_by_tid"] <= sizes["pending_registrations"]
    assert sizes["regs_by_id"] == sizes["regs_by_base"] == sizes["pending_registrations"]


def test_another_agent_naming_a_live_d_id_never_takes_its_slot() -> None:
    # With transfer ids: the stranger's registration (it cannot know the id) never pairs.
    r = registry()
    assert r.add_registration(reg("d-1"), "stranger", now=0.0).event == "reg.stored"
    r.add_registration(reg("d-1", tid="T"), SENDER, now=0.0)
    (post,) = r.add_finished("p-1", ((1,),), "T", now=0.0).actions
    assert isinstance(post, Post) and post.sender == SENDER
    # Without: both could pair, so neither is written and P's request fails visibly.
    r2 = registry()
    r2.add_registration(reg("cmpl-q-0-bbbbbbbb"), "stranger", now=0.0)
    r2.add_registration(reg("cmpl-q-0-bbbbbbbb"), SENDER, now=0.0)
    res = r2.add_finished("cmpl-q-0-aaaaaaaa", ((1,),), None, now=0.0)
    assert sorted(kinds(res)) == ["FailEntry", "Refuse", "Refuse"]
    # The stranger cannot abort the real registration either.
    r3 = registry()
    r3.add_registration(reg("d-3", tid="T3"), SENDER, now=0.0)
    assert r3.abort(Abort(request_id="d-3"), "stranger", now=0.0).event == "abort.ignored"
    assert kinds(r3.add_finished("p-3", ((1,),), "T3", now=0.0)) == ["Post"]


def test_a_reused_d_id_with_other_blocks_is_refused_at_once_not_left_to_the_watchdog() -> None:
    r = registry()
    r.add_finished("p-1", ((1,),), "T", now=0.0)
    r.add_registration(reg("d-1", tid="T", blocks=(5,)), SENDER, now=0.0)
    r.forget("p-1", "pushed", transfer_id="T", serial=0, now=1.0)
    res = r.add_registration(reg("d-1", tid="T", blocks=(7,)), SENDER, now=1.0)
    assert kinds(res) == ["Refuse"] and "already pushed" in res.actions[0].reason  # type: ignore[union-attr]
    # The same blocks again (D's allocator may hand them back to the id's next request): P
    # cannot tell it from a late copy and will not write twice, so it is refused as well. A
    # late copy's D request has P's answer already and drops this one (first answer wins).
    res = r.add_registration(reg("d-1", tid="T", blocks=(5,)), SENDER, now=1.0)
    assert kinds(res) == ["Refuse"] and res.event == "reg.refused"
    # Naming another P request exactly, it is a new registration of the reused id: served.
    assert r.add_registration(reg("d-1", tid="T2", blocks=(5,)), SENDER, now=2.0).event == "reg.stored"
    assert kinds(r.add_finished("p-2", ((2,),), "T2", now=2.5)) == ["Post"]
    r.forget("p-2", "pushed", transfer_id="T2", serial=0, now=3.0)
    assert r.add_registration(reg("d-1", pid="p-3", blocks=(5,)), SENDER, now=4.0).event == "reg.stored"
    # Named by base id only, P cannot tell a new one from a copy: refused, with or without the
    # same blocks.
    r2 = registry()
    r2.add_finished("cmpl-q-0-aaaaaaaa", ((1,),), None, now=0.0)
    assert kinds(r2.add_registration(reg("cmpl-q-0-bbbbbbbb", blocks=(5,)), SENDER, now=0.0)) == ["Post"]
    r2.forget("cmpl-q-0-aaaaaaaa", "pushed", transfer_id=None, serial=0, now=1.0)
    for blocks in ((5,), (6,)):
        res = r2.add_registration(reg("cmpl-q-0-bbbbbbbb", blocks=blocks), SENDER, now=2.0)
        assert kinds(res) == ["Refuse"], res.event


# ---------------------------------------------------------------------------------------------
# Late, duplicated and sibling messages never reopen what ended (no byte into freed blocks)
# ---------------------------------------------------------------------------------------------
def test_a_heartbeat_for_a_sibling_request_does_not_keep_a_stale_registration_fresh() -> None:
    """D heartbeats each waiting registration by its exact key. One D stopped heartbeating (it
    aborted; the abort was lost) must go stale even while D heartbeats another request of the
    same base id (a client's retry): P would otherwise write into blocks D freed."""
    r = registry(lease=30.0)  # stale after 20 s without D's word
    r.add_registration(reg("cmpl-x-0-bbbbbbbb", pid="cmpl-x-0-aaaaaaaa"), SENDER, now=0.0)
    assert r.heartbeat(("cmpl-x-0-cccccccc",), SENDER, now=19.0) == ([], 0, 1)
    res = r.add_finished("cmpl-x-0-aaaaaaaa", ((1, 2),), None, now=25.0, serial=1)
    assert kinds(res) == ["Refuse"] and "stale" in res.actions[0].reason  # type: ignore[union-attr]
    # Its own key keeps it fresh.
    r.add_registration(reg("cmpl-y-0-bbbbbbbb", pid="cmpl-y-0-aaaaaaaa"), SENDER, now=30.0)
    assert r.heartbeat(("cmpl-y-0-aaaaaaaa",), SENDER, now=49.0) == ([], 1, 0)
    assert kinds(r.add_finished("cmpl-y-0-aaaaaaaa", ((3,),), None, now=55.0, serial=2)) == ["Post"]


@pytest.mark.parametrize("how", ["aborted", "stale", "orphan", "request ended"])
def test_a_late_copy_of_a_registration_p_refused_or_d_aborted_is_dropped(how: str) -> None:
    """D failed it and may have given its blocks to another request: a duplicated or late copy
    is never stored again (P would write into those blocks), and gets no answer that could
    reach a new D request reusing the id."""
    r = registry(lease=3.0, orphan=5.0)
    d = reg("cmpl-z-0-bbbbbbbb", tid="T" if how == "stale" else None)
    r.add_registration(d, SENDER, now=0.0)
    if how == "aborted":
        assert kinds(r.abort(Abort(request_id=d.request_id), SENDER, now=1.0)) == ["Refuse"]
    elif how == "stale":
        assert kinds(r.add_finished("p-1", ((1,),), "T", now=2.5)) == ["Refuse"]
    elif how == "orphan":
        orphans: list[Any] = []
        r.prune(6.0, orphans.append)
        assert len(orphans) == 1
    else:  # P gave up on the request the registration names before its blocks came
        r = registry(lease=3.0)
        d = reg("d-1", pid="p-1")
        r.add_registration(d, SENDER, now=0.0)
        assert kinds(r.forget("p-1", "expired", transfer_id=None, serial=0, now=1.0)) == ["Refuse"]
    late = r.add_registration(d, SENDER, now=6.5)
    assert (late.event, kinds(late)) == ("reg.duplicate", [])
    assert r.sizes()["pending_registrations"] == 0
    # Whatever P request turns up next never meets it.
    res = r.add_finished("cmpl-z-0-aaaaaaaa", ((1, 2),), None, now=7.0, serial=9)
    assert "Post" not in kinds(res)
    # D reusing its id with other blocks is a new registration.
    assert r.add_registration(reg(d.request_id, blocks=(8, 9)), SENDER, now=7.5).event in {"reg.stored", "reg.matched"}


def test_an_abort_is_spent_with_its_request_and_never_fails_a_reused_id() -> None:
    r = registry()
    r.add_registration(reg("d-1", pid="p-1"), SENDER, now=0.0)
    r.abort(Abort(request_id="d-1", remote_request_id="p-1"), SENDER, now=1.0)
    assert kinds(r.add_finished("p-1", ((1,),), None, now=2.0, serial=1)) == ["FailEntry"]
    assert r.sizes()["aborted_keys"] == 0
    r.forget("p-1", "failed", transfer_id=None, serial=1, now=3.0)
    # The id's next request: its blocks first, then its registration.
    assert kinds(r.add_finished("p-1", ((2,),), None, now=11.0, serial=2)) == []
    assert kinds(r.add_registration(reg("d-2", pid="p-1"), SENDER, now=11.5)) == ["Post"]
    # An abort whose request ended before its blocks came is spent by the Forget.
    r.add_registration(reg("d-3", tid="T3"), SENDER, now=12.0)
    r.abort(Abort(request_id="d-3"), SENDER, now=12.5)
    assert r.sizes()["aborted_keys"] == 1
    r.forget("p-3", "cancelled", transfer_id="T3", serial=3, now=13.0)
    assert r.sizes()["aborted_keys"] == 0


@pytest.mark.parametrize("key", ["tid", "pid"])
def test_a_registration_naming_again_what_its_d_rank_aborted_is_served_not_freed(key: str) -> None:
    """D aborted a pending registration for a P request (its client cancelled the decode leg),
    then registered a new D request for the same P request (the leg sent again). The abort is
    spent: P's blocks, when they come, go to the new registration. Another agent cannot spend
    it, and a late copy of the aborted registration is still dropped."""
    names = {"tid": "T"} if key == "tid" else {"pid": "p-1"}
    tid = "T" if key == "tid" else None
    r = registry()
    r.add_registration(reg("d-1", **names), SENDER, now=0.0)
    assert kinds(r.abort(Abort(request_id="d-1"), SENDER, now=0.1)) == ["Refuse"]
    assert r.sizes()["aborted_keys"] == 1
    assert r.add_registration(reg("d-1", **names), SENDER, now=0.2).event == "reg.duplicate"  # late copy
    assert r.add_registration(reg("d-x", **names), "intruder", now=0.2).event == "reg.stored"
    assert r.sizes()["aborted_keys"] == 1  # not another agent's to spend
    assert r.add_registration(reg("d-2", blocks=(7,), **names), SENDER, now=0.3).event == "reg.stored"
    assert r.sizes()["aborted_keys"] == 0
    res = r.add_finished("p-1", ((1,),), tid, now=0.4)
    # Two live registrations name it (the intruder's too): never guessed between, never freed
    # as aborted.
    assert res.event != "blocks.aborted_by_decode"
    r2 = registry()
    r2.add_registration(reg("d-1", **names), SENDER, now=0.0)
    r2.abort(Abort(request_id="d-1"), SENDER, now=0.1)
    r2.add_registration(reg("d-2", blocks=(7,), **names), SENDER, now=0.3)
    (post,) = r2.add_finished("p-1", ((1,),), tid, now=0.4).actions
    assert isinstance(post, Post) and post.registration.request_id == "d-2"


def test_a_late_copy_is_told_from_a_new_registration_by_how_it_names_p_not_by_p_entry() -> None:
    """A registration carrying a transfer id may be served by a P entry without one (paired by
    P's id). Its late copy still names P's request as it did, so it is refused, even once a new
    P request reuses the id; only a registration naming P's request otherwise is new."""
    r = registry()
    r.add_finished("p-1", ((1,),), None, now=0.0)
    assert kinds(r.add_registration(reg("d-1", tid="T", pid="p-1"), SENDER, now=0.0)) == ["Post"]
    r.forget("p-1", "pushed", transfer_id=None, serial=0, now=1.0)
    r.add_finished("p-1", ((2,),), None, now=2.0, serial=7)  # the id reused on P
    assert kinds(r.add_registration(reg("d-1", tid="T", pid="p-1"), SENDER, now=3.0)) == ["Refuse"]
    # Naming it otherwise (another transfer id): new, and it pairs with the live p-1 by P's id.
    assert kinds(r.add_registration(reg("d-1", tid="T2", pid="p-1"), SENDER, now=3.0)) == ["Post"]


# --- generations (issue 29) ---------------------------------------------------------------------
def _gen(reg_: Registration, generation: int) -> Registration:
    import msgspec

    return msgspec.structs.replace(reg_, generation=generation)


G1, G2 = (7 << 32) | 1, (7 << 32) | 2


def test_an_abort_naming_another_generation_ends_nothing_and_the_right_one_ends_the_registration() -> None:
    r = registry()
    r.add_registration(_gen(reg("d-1"), G2), "D", 0.0)
    stale = r.abort(Abort(request_id="d-1", generation=G1), "D", 1.0)
    assert stale.event == "abort.stale" and "matcher.stale_generation.push_abort" in stale.counters
    assert len(r.pending) == 1
    live = r.abort(Abort(request_id="d-1", generation=G2), "D", 2.0)
    assert live.event == "abort.dropped_registration" and not r.pending


def test_a_late_copy_of_an_earlier_staging_never_replaces_the_newer_one() -> None:
    r = registry()
    newer = _gen(reg("d-1", pid="p-1"), G2)
    r.add_registration(newer, "D", 0.0)
    res = r.add_registration(_gen(reg("d-1", pid="p-1"), G1), "D", 1.0)
    assert res.event == "reg.stale" and not res.actions
    (p,) = r.pending.values()
    assert p.registration.generation == G2


def test_a_registration_past_ds_deadline_is_refused_and_never_stored() -> None:
    r = registry()
    res = r.add_registration(_gen(reg("d-1"), G1), "D", 10.0, deadline=9.5)
    assert res.event == "reg.refused" and "matcher.expired" in res.counters and not r.pending
