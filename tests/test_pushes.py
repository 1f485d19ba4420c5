"""Thread-free unit tests of P's push bookkeeping (``pushactors.actors.writer.push.book``)."""

from __future__ import annotations

from pushactors.actors.writer.push.book import PushBook
from pushactors.actors.writer.remotes import RemotePeer
from pushactors.protocol import PeerKey, PostPush, Registration
from pushactors.testing import registration


def reg(rank: int = 0, d_tp: int = 1) -> Registration:
    return registration("d-1", (1,), rank=rank, d_tp=d_tp, decode=("decode", "h", 1))


def post(rank: int = 0, expected: int = 1, serial: int = 1, p_id: str = "p-1") -> PostPush:
    return PostPush(
        request_id=p_id, block_ids=((1,),), registration=reg(rank, expected), expected_targets=expected, serial=serial
    )


def remote() -> RemotePeer:
    return RemotePeer(PeerKey("decode", "h", 1, 0, 0), "decode-pp0-tp0", None, 0.0, 0.0)


def test_a_push_is_over_only_when_every_target_settled() -> None:
    book = PushBook(tombstone_ttl=60.0)
    state, t0, why = book.open(post(0, expected=2), now=0.0)
    assert state is not None and t0 is not None and why == ""
    r = remote()
    t0.posted("h0", r, 100, now=1.0)
    assert r.in_flight == 1 and book.outcome(state) is None
    assert t0.end(ok=True) is r and r.in_flight == 0
    assert book.outcome(state) is None  # rank 1 has not even registered
    _, t1, _ = book.open(post(1, expected=2), now=2.0)
    assert t1 is not None
    t1.end(ok=False, reason="WRITE ended in ERR")
    assert book.outcome(state) == ("failed", "WRITE ended in ERR")
    assert book.busy_peers() == set()


def test_expiry_ends_a_push_with_nothing_in_flight_and_names_why() -> None:
    book = PushBook(tombstone_ttl=60.0)
    state, target, _ = book.open(post(0, expected=2), now=0.0)
    assert state is not None and target is not None
    assert book.busy_peers() == {PeerKey("decode", "h", 1, 0, 0)}
    state.expired = "lease_expired"
    # Nothing in flight: an expired push is over even with a target never posted ...
    assert book.outcome(state) == ("expired", "lease_expired")
    target.posted("h", remote(), 10, now=1.0)
    assert book.outcome(state) is None  # ... but never while a WRITE may still read its blocks
    target.end(ok=False, reason="lease_expired")
    assert book.outcome(state) == ("failed", "lease_expired")
    state2, _, _ = book.open(post(0, p_id="p-2"), now=0.0)
    assert state2 is not None
    state2.targets.clear()
    state2.expired = "lease_expired"
    assert book.outcome(state2) == ("expired", "lease_expired")


def test_an_ended_incarnation_is_refused_and_a_new_one_is_not() -> None:
    book = PushBook(tombstone_ttl=60.0)
    state, _, _ = book.open(post(serial=3), now=0.0)
    assert state is not None
    book.close("p-1", "pushed", 3, now=1.0)
    assert book.open(post(serial=3), now=2.0)[2] == "request already pushed on P"
    assert book.open(post(serial=2), now=2.0)[2] == "request already pushed on P"
    fresh, target, why = book.open(post(serial=4), now=2.0)
    assert fresh is not None and target is not None and why == ""
    assert book.open(post(serial=5), now=2.0)[2] == "request id is busy with an earlier incarnation on P"
    assert book.open(post(serial=4), now=2.0)[2] == "D rank already served for this request"
    assert book.sizes() == {"pushes": 1, "in_flight": 0, "tombstones": 1, "unreleased": 1}


def test_a_tombstone_goes_once_the_matcher_and_the_reaper_released_that_incarnation() -> None:
    """The writer remembers an ended P request only while the matcher or the reaper may still
    send something about it: 2,000 requests leave no tombstone behind, not 2,000 for 600 s."""
    book = PushBook(tombstone_ttl=600.0)
    for i in range(2000):
        book.open(post(p_id=f"p-{i}", serial=i + 1), now=0.0)
        book.close(f"p-{i}", "pushed", i + 1, now=0.0)
        assert not book.released(f"p-{i}", i + 1, "matcher")
        assert book.ended(f"p-{i}", i + 1) == "pushed"  # the reaper may still expire it
        assert book.released(f"p-{i}", i + 1, "reaper")
    assert book.sizes() == {"pushes": 0, "in_flight": 0, "tombstones": 0, "unreleased": 0}
    # A release of another incarnation, or a repeated one, drops nothing.
    book.open(post(p_id="p-x", serial=7), now=0.0)
    book.close("p-x", "failed", 7, now=0.0)
    assert not book.released("p-x", 6, "matcher") and not book.released("p-x", 6, "reaper")
    assert not book.released("p-x", 7, "matcher") and not book.released("p-x", 7, "matcher")
    assert book.ended("p-x", 7) == "failed"
    assert book.released("p-x", 7, "reaper") and book.ended("p-x", 7) is None


def test_a_push_names_the_d_ranks_told_a_write_may_still_land() -> None:
    """Those ranks hold their blocks until P's final answer: Forget.pinned carries them."""
    book = PushBook(tombstone_ttl=60.0)
    state, t0, _ = book.open(post(0, expected=3), now=0.0)
    _, t2, _ = book.open(post(2, expected=3), now=0.0)
    assert state is not None and t0 is not None and t2 is not None
    assert state.pinned_ranks == ()
    t2.pinned = True
    assert state.pinned_ranks == (2,)
    t0.pinned = True
    assert state.pinned_ranks == (0, 2)
