"""Registration generations (docs/protocol.md, 'Generations and deadlines'): every answer names
the registration it answers, and D lands or fails a request only on an answer naming its live
generation. Over the fake fabric, with bytes checked on D."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pushactors.core.generations import GenerationMint, incarnation_of
from pushactors.protocol import ABORT_PREFIX, PUSH_REG_PREFIX, Completion, decode_notification, encode_completion
from pushactors.testing import PushPair, SimSpec, completion_of

pytestmark = pytest.mark.timeout(120)

P_AGENT, D_AGENT = "prefill-pp0-tp0", "decode-pp0-tp0"
TOKENS = 48  # three blocks


def _stat(engine: Any, name: str) -> int:
    return int(sum(w.stats().get(name, 0) for w in engine.workers))


def _recording(pair: PushPair, d_id: str) -> list[bytes]:
    """Every completion P attaches for ``d_id``, as it went on the wire (nothing is changed)."""
    seen: list[bytes] = []
    pair.fabric.faults.drop_notif(
        match=lambda c: completion_of(d_id)(c) and (seen.append(bytes(c.notif)) or False), times=None
    )
    return seen


def _reuse(pair: PushPair, d_id: str) -> None:
    """D is done with ``d_id``: its blocks go back to the pool and the id may be used again."""
    pair.decode.finish_recv(d_id)
    pair.decode.received.pop(d_id, None)


def test_a_replayed_completion_of_an_earlier_use_never_lands_the_id_used_again() -> None:
    """D reuses a request id on the same blocks; P's completion of the first use arrives again
    (a late copy, or a signed one replayed) before P has prefilled the second. D must not report
    the second landed: the copy names the first registration's generation."""
    spec = SimSpec(num_layers=2, num_blocks=16, shuffle_blocks=False)
    with PushPair(p_spec=spec, lease_duration=30.0, registration_timeout=6.0) as pair:
        d_id = "job-7-bbbbbbbb"
        seen = _recording(pair, d_id)
        params = pair.prefill.prefill("job-7-aaaaaaaa", TOKENS, key="first")
        first = pair.decode.expect(d_id, TOKENS, params, key="first")
        pair.pump(lambda: d_id in pair.received, what="the first use")
        assert pair.received[d_id] is None and pair.decode.verify(d_id)[1] == 0
        (old,) = seen
        first_gen = decode_notification(old)
        assert isinstance(first_gen, Completion) and first_gen.generation
        blocks = list(first.blocks)
        _reuse(pair, d_id)
        # The second use: same id, same blocks, another P request, not prefilled yet.
        params2 = pair.prefill.scheduler.decode_params("job-7-second-aaaaaaaa", None)
        pair.decode.expect(d_id, TOKENS, params2, key="second", blocks=blocks)
        pair.pump(lambda: _held(pair) == 1, what="the second registration held by P")
        pair.fabric.get(D_AGENT).inject_notif(P_AGENT, old)  # from P's own agent: not a stranger
        pair.pump(lambda: _stat(pair.decode, "reaper.notif_stale_generation.completion") == 1, what="the copy dropped")
        for _ in range(20):
            pair.step()
        assert d_id not in pair.received  # not landed on a copy of the first answer
        pair.prefill.prefill("job-7-second-aaaaaaaa", TOKENS, key="second")
        pair.pump(lambda: d_id in pair.received, what="the second push")
        assert pair.received[d_id] is None
        checked, wrong = pair.decode.verify(d_id)  # the second request's KV, not the first's
        assert checked > 0 and wrong == 0
        second = decode_notification(seen[1])
        assert isinstance(second, Completion) and second.generation > first_gen.generation


def test_a_reused_id_after_an_abort_is_served_at_once_not_left_to_the_watchdog() -> None:
    """D aborts a registration P still holds, then reuses the id on the same blocks for another
    P request. P must tell the new registration from a late copy of the aborted one and serve
    it: within seconds, not at D's registration watchdog."""
    spec = SimSpec(num_layers=2, num_blocks=16, shuffle_blocks=False)
    with PushPair(p_spec=spec, lease_duration=30.0, registration_timeout=300.0) as pair:
        d_id = "job-9-bbbbbbbb"
        params = pair.prefill.scheduler.decode_params("job-9-first", None)
        rec = pair.decode.expect(d_id, TOKENS, params, key="first")
        pair.pump(lambda: _held(pair) == 1, what="the registration held by P")
        assert pair.decode.scheduler.abort_recv(d_id)
        pair.pump(lambda: d_id in pair.received, what="the abort answered")
        assert pair.received[d_id] is not None
        blocks = list(rec.blocks)
        _reuse(pair, d_id)
        params2 = pair.prefill.prefill("job-9-second-aaaaaaaa", TOKENS, key="second")
        pair.decode.expect(d_id, TOKENS, params2, key="second", blocks=blocks)
        pair.pump(lambda: d_id in pair.received, timeout=5.0, what="the reused id served within 5 s")
        assert pair.received[d_id] is None
        checked, wrong = pair.decode.verify(d_id)
        assert checked > 0 and wrong == 0


def _held(pair: PushPair) -> int:
    snap = pair.prefill.workers[0].runtime.snapshot("matcher")
    return int(snap["matcher"].get("pending_registrations", 0))


def test_generations_are_distinct_ordered_within_an_incarnation_and_new_across_restarts() -> None:
    mint = GenerationMint()
    gens = [mint.next() for _ in range(1000)]
    assert len(set(gens)) == 1000 and gens == sorted(gens)
    assert {incarnation_of(g) for g in gens} == {mint.incarnation} and 0 < gens[0] < 1 << 63
    other = GenerationMint()
    assert other.incarnation != mint.incarnation or other.next() != gens[0]


@pytest.mark.parametrize("rid", ["r-1", "a:b:3", "x:1:g5", "g:2"])
def test_a_completion_round_trips_its_generation_whatever_colons_the_id_holds(rid: str) -> None:
    for gen in (0, 1, (1 << 63) - 1):
        assert decode_notification(encode_completion(rid, 4, gen)) == Completion(rid, 4, gen)


def test_a_registration_arriving_after_ds_deadline_is_never_written() -> None:
    """D's registration is delayed on the way; D gives up (its abort lost), sits out its
    quarantine and gives the blocks to another request, which lands. Then the old registration
    reaches P, whose prefill for it has just finished. P judges freshness by D's deadline (on
    its estimate of D's clock), not by when the registration arrived: it refuses, and the other
    request's bytes stay as they landed."""
    spec = SimSpec(num_layers=2, num_blocks=16, shuffle_blocks=False)
    timing = {"lease_duration": 3.0, "write_timeout": 0.5, "abort_quarantine": 2.7, "registration_timeout": 30.0}
    with PushPair(p_spec=spec, **timing) as pair:
        late, other = "late-1-bbbbbbbb", "other-1-bbbbbbbb"
        pair.fabric.faults.delay_notif(3.6, match=lambda c: c.notif.startswith(PUSH_REG_PREFIX), times=1)
        pair.fabric.faults.drop_notif(match=lambda c: c.notif.startswith(ABORT_PREFIX), times=None)
        params = pair.prefill.scheduler.decode_params("late-1-aaaaaaaa", None)
        rec = pair.decode.expect(late, TOKENS, params, key="late")
        pair.pump(lambda: pair.fabric.stats.notifs_sent >= 1, what="the registration sent (and held up)")
        assert pair.decode.scheduler.abort_recv(late)
        pair.pump(lambda: late in pair.received, what="D's quarantine to end")
        assert pair.received[late] is not None
        blocks = list(rec.blocks)
        _reuse(pair, late)
        params2 = pair.prefill.prefill("other-1-aaaaaaaa", TOKENS, key="other")
        pair.decode.expect(other, TOKENS, params2, key="other", blocks=blocks)
        pair.pump(lambda: other in pair.received, what="the other request on the same blocks")
        assert pair.received[other] is None and pair.decode.verify(other)[1] == 0
        pair.prefill.prefill("late-1-aaaaaaaa", TOKENS, key="late")  # P's prefill ends now
        pair.pump(lambda: "late-1-aaaaaaaa" in pair.sent, timeout=15.0, what="P's late request to end")
        assert pair.sent["late-1-aaaaaaaa"] is not None  # never pushed
        assert _stat(pair.prefill, "matcher.expired") == 1
        checked, wrong = pair.decode.verify(other)  # nothing landed over the other request
        assert checked > 0 and wrong == 0
        assert pair.fabric.stats.transfers_posted == 1  # only the other request's WRITE


@pytest.mark.parametrize(
    "raw",
    [b"r-1:4:g", b"r-1:4:gzz", b"r-1:4:g" + b"f" * 17, b"r-1:4:g8000000000000000", b"r-1:4:G1"],
)
def test_a_completion_with_a_bad_generation_is_malformed_not_a_guess(raw: bytes) -> None:
    from pushactors.protocol import MalformedMessage

    with pytest.raises(MalformedMessage):
        decode_notification(raw)


@pytest.mark.parametrize(
    "raw", [b"HB@:a", b"HB@abc:a", b"HB@nan:a", b"HB@-1.0:a", b"HB@1e300:a", b"HB@5.0", b"HB@" + b"9" * 40 + b":a"]
)
def test_a_heartbeat_with_a_bad_deadline_is_malformed(raw: bytes) -> None:
    from pushactors.protocol import MalformedMessage

    with pytest.raises(MalformedMessage):
        decode_notification(raw)


def test_a_heartbeat_round_trips_ds_deadline_and_ids_may_not_look_like_one() -> None:
    from pushactors.protocol import Heartbeat, check_request_id, encode_heartbeat

    assert decode_notification(encode_heartbeat(["a", "b:c"], 1234.5)) == Heartbeat(("a", "b:c"), 1234.5)
    assert decode_notification(encode_heartbeat(["a"])) == Heartbeat(("a",), 0.0)
    with pytest.raises(ValueError):
        check_request_id("HB@5")  # its completion would read as a heartbeat


# ------------------------------------------------------------------------------------------------
# Class 3: a cancel that returns while the copy goes on
# ------------------------------------------------------------------------------------------------
CANCEL = {"lease_duration": 30.0, "write_timeout": 1.0, "abort_quarantine": 30.0}


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_a_cancelled_write_that_runs_on_never_lands_in_blocks_d_reused(staged: bool) -> None:
    """P's WRITE is stuck past write_timeout, and releasing it would return while the copy runs
    on and lands a second later (as cma, cuda_ipc and RDMA copies do). P never releases it to
    cancel it: D hears "may still land" and keeps its blocks (or staging slot) until NIXL reports
    the WRITE ended (here in ERR), and only then the failure. The next request written into the
    same blocks keeps every byte, and no copy of the first ever ran unowned."""
    spec = SimSpec(num_layers=2, num_blocks=16, shuffle_blocks=False, layout="hnd" if staged else "nhd")
    config: dict[str, Any] = dict(CANCEL)
    if staged:
        config.update(staging_bytes=8 << 20, staging_min_runs=1, staging_min_bytes=1, staging_gather_runs=0)
    with PushPair(p_spec=spec, registration_timeout=60.0, **config) as pair:
        first = "d-first-bbbbbbbb"
        stuck = completion_of(first)
        gate = pair.fabric.faults.hold_transfer(match=stuck)
        pair.fabric.faults.err_transfer(match=stuck, times=None)
        pair.fabric.faults.release_continues(match=stuck, times=None, runs_on=1.0)
        try:
            params = pair.prefill.prefill("p-first-aaaaaaaa", TOKENS, key="first")
            reg = pair.decode.expect(first, TOKENS, params, key="first")
            blocks = list(reg.blocks)
            pair.pump(lambda: _stat(pair.decode, "recv.write_pinned") >= 1, what="P to say it may still land")
            until = time.monotonic() + 2 * CANCEL["write_timeout"]
            pair.pump(lambda: first in pair.received or time.monotonic() > until, what="two write_timeouts")
            assert first not in pair.received, "D let go of blocks a stuck WRITE may still land in"
            assert pair.fabric.in_flight() == 1 and pair.fabric.stats.transfers_cancelled == 0
        finally:
            gate.open()  # NIXL reports the WRITE ended (ERR): now P's failure is final
        pair.pump(lambda: first in pair.received, timeout=20, what="the stuck push to fail")
        assert pair.received[first] is not None  # failed, visibly
        # D reuses the blocks (and slot) for the next request at once.
        _reuse(pair, first)
        second = "d-second-bbbbbbbb"
        params2 = pair.prefill.prefill("p-second-aaaaaaaa", TOKENS, key="second")
        pair.decode.expect(second, TOKENS, params2, key="second", blocks=blocks)
        pair.pump(lambda: second in pair.received, what="the second push")
        assert pair.received[second] is None
        until = time.monotonic() + 1.5
        pair.pump(lambda: time.monotonic() > until, what="a late copy's time to land, were there one")
        checked, wrong = pair.decode.verify(second)
        assert checked > 0 and wrong == 0, f"{wrong} bytes of the first request's late copy in the second's blocks"
        assert pair.fabric.stats.transfers_landed_after_release == 0
        assert pair.sent["p-first-aaaaaaaa"] is not None and pair.sent["p-second-aaaaaaaa"] is None
