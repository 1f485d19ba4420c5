"""Memory of ended requests is bounded by live work plus a constant, not by rate × timeout:
after 2,000 settled requests with default timeouts, at most 64 stale entries per rank, and
forgetting one never lets a late copy of a registration be written again."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pushactors.core.generations import GenerationMint, ReplayWindow, ReplayWindows
from pushactors.core.registry import Post, PRegistry
from pushactors.testing import PushPair, SimSpec, registration

SENDER = "decode-pp0-tp0"


def test_a_window_tells_new_seen_and_too_old_generations_in_any_order() -> None:
    w = ReplayWindow(size=8)
    for g in (5, 3, 9):
        assert w.check(g) == "new"
        w.mark(g)
    assert [w.check(g) for g in (3, 5, 9)] == ["seen"] * 3
    assert w.check(4) == "new" and w.check(8) == "new"  # gaps: registrations for other P ranks
    assert w.check(1) == "too_old"  # 9 - 1 >= 8: cannot be told from a copy any more
    w.mark(100)  # a jump past the whole window keeps only the newest
    assert w.check(100) == "seen" and w.check(99) == "new" and w.check(92) == "too_old"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=300), max_size=120))
def test_a_window_never_calls_a_generation_it_took_new(order: list[int]) -> None:
    w = ReplayWindow(size=64)
    taken: set[int] = set()
    for g in order:
        verdict = w.check(g)
        if g in taken:
            assert verdict != "new", f"{g} taken before, read as new"
        if verdict == "new":
            w.mark(g)
            taken.add(g)
        if g not in taken:
            assert verdict == "too_old"  # only ever refused, never silently dropped


def test_a_forgotten_peers_next_window_refuses_everything_older() -> None:
    windows = ReplayWindows(size=64, max_peers=2)
    mint = GenerationMint(incarnation=7)
    old = [mint.next() for _ in range(3)]
    for g in old:
        windows.mark("d-a", g)
    windows.mark("d-b", GenerationMint(incarnation=8).next())
    windows.mark("d-c", GenerationMint(incarnation=9).next())  # d-a's window is dropped
    assert len(windows) == 2
    newer = mint.next()
    assert windows.check("d-a", newer) == "new"
    windows.mark("d-a", newer)
    assert all(windows.check("d-a", g) == "too_old" for g in old)


def test_a_late_copy_is_dropped_after_its_tombstone_is_forgotten() -> None:
    """tombstone_keep=0: P remembers nothing of the request it served, yet a copy of the
    registration (same generation) arriving later — even when P's id is used again — is never
    written: the window has seen its generation."""
    r = PRegistry(lease_duration=30.0, tombstone_ttl=600.0, orphan_ttl=480.0, tombstone_keep=0)
    mint = GenerationMint(incarnation=3)
    reg = registration("d-1", (5, 6), remote_request_id="p-1", generation=mint.next())
    r.add_finished("p-1", ((1,),), None, now=0.0, serial=1)
    (post,) = r.add_registration(reg, SENDER, now=0.0).actions
    assert isinstance(post, Post)
    r.forget("p-1", "pushed", transfer_id=None, serial=1, now=1.0)
    assert r.sizes()["tombstones"] == 0
    r.add_finished("p-1", ((2,),), None, now=2.0, serial=2)  # P reuses its id
    late = r.add_registration(reg, SENDER, now=2.0)
    assert late.actions == [] and "matcher.late_registration_dropped" in late.counters
    # A new registration of D's (a new generation) for it is served.
    again = registration("d-1", (5, 6), remote_request_id="p-1", generation=mint.next())
    assert [type(a) for a in r.add_registration(again, SENDER, now=2.0).actions] == [Post]


def test_two_thousand_settled_requests_leave_at_most_64_stale_entries_per_rank() -> None:
    spec = SimSpec(num_layers=2, num_blocks=256, shuffle_blocks=False)
    with PushPair(p_spec=spec) as pair:  # default timeouts: lease 30 s, tombstones 600 s
        batch = 32
        for start in range(0, 2000, batch):
            ids = [f"job-{i:08d}" for i in range(start, min(2000, start + batch))]
            for rid in ids:
                pair.decode.expect(rid, 16, pair.prefill.prefill(rid, 16, key=rid), key=rid)
            pair.pump(lambda ids=ids: all(rid in pair.received for rid in ids), what="a batch to land")
            for rid in ids:
                assert pair.received[rid] is None and pair.decode.verify(rid)[1] == 0
                pair.decode.finish_recv(rid)
        pair.pump(pair.settled, what="everything to settle")
        assert sum(1 for v in pair.sent.values() if v is None) == 2000
        for side, engine in (("P", pair.prefill), ("D", pair.decode)):
            tables = engine.workers[0].runtime.snapshot()
            stale = (
                tables["writer"]["tombstones"]
                + tables["writer"]["unreleased"]
                + tables["matcher"]["tombstones"]
                + tables["matcher"]["early_aborts"]
                + tables["matcher"]["aborted_keys"]
            )
            assert stale <= 64, f"{side}: {stale} stale entries: {tables}"
            assert tables["reaper"]["lease_heap"] <= 3 * tables["reaper"]["leases"] + 64
            assert tables["matcher"]["replay_windows"] <= 1
