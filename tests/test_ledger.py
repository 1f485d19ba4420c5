"""Thread-free unit tests of D's request registry (``pushactors.core.ledger``)."""

from __future__ import annotations

from typing import Any

from pushactors.core.ledger import DRegistry, FreeSlot, Report, SendAbort, SendRegistration
from pushactors.protocol import PeerKey, Registration, WatchRecv

P0 = PeerKey("prefill", "h", 1, 0, 0)
P1 = PeerKey("prefill", "h", 1, 0, 1)
STRANGER = PeerKey("mallory", "evil", 9, 0, 0)


def watch(d_id: str = "d-1", *, blocks: tuple[int, ...] = (1, 2), tid: str | None = None, ranks: int = 1,
          deadline: float = 100.0, slot: tuple[int, int] | None = None) -> WatchRecv:  # fmt: skip
    reg = Registration(
        request_id=d_id,
        decode_engine_id="decode",
        decode_host="d",
        decode_port=2,
        decode_tp_size=1,
        local_block_ids=blocks,
        remote_engine_id="prefill",
        remote_host="h",
        remote_port=1,
        remote_tp_size=ranks,
        transfer_id=tid,
        staging_slot=slot,
    )
    return WatchRecv(
        request_id=d_id,
        expected=ranks,
        deadline=deadline,
        registration=reg,
        peers=(P0, P1)[:ranks],
        heartbeat_id=tid or d_id,
        nbytes=64,
    )


def reports(res: Any) -> list[tuple[str, str | None]]:
    return [(a.request_id, a.reason) for a in res.actions if isinstance(a, Report)]


def test_a_request_lands_once_every_expected_p_rank_completed() -> None:
    d = DRegistry(quarantine=5.0)
    assert [type(a) for a in d.watch(watch(ranks=2), now=0.0).actions] == [SendRegistration]
    assert reports(d.notified("d-1", ok=True, peer=P0, final=True, reason="", now=0.0)) == []
    assert d.notified("d-1", ok=True, peer=P0, final=True, reason="", now=0.0).event == "notif.duplicate"
    assert d.notified("d-1", ok=True, peer=STRANGER, final=True, reason="", now=0.0).event == "notif.rejected"
    assert d.notified("d-1", ok=True, peer=None, final=True, reason="", now=0.0).event == "notif.rejected"
    assert reports(d.notified("d-1", ok=True, peer=P1, final=True, reason="", now=0.0)) == [("d-1", None)]
    assert d.sizes() == {"recvs": 0, "recv_tids": 0, "recv_waiting": 0}


def test_an_aborted_request_quarantines_and_a_pinned_write_holds_it_past_the_quarantine() -> None:
    d = DRegistry(quarantine=5.0)
    d.watch(watch(), now=0.0)
    res = d.abort("d-1", "aborted by engine", now=1.0)
    assert [type(a) for a in res.actions] == [SendAbort] and reports(res) == []
    d.notified("d-1", ok=False, peer=P0, final=False, reason="could not cancel", now=2.0)
    res = d.due(now=7.0)  # quarantine over, but the WRITE may still land
    assert res.held == ["d-1"] and reports(res) == []
    res = d.notified("d-1", ok=True, peer=P0, final=True, reason="", now=8.0)  # it settled
    assert reports(res) == [("d-1", "aborted by engine")]


def test_a_pinned_write_holds_the_blocks_at_most_pinned_write_limit() -> None:
    """P said its WRITE may still land and then fell silent (link down, final word lost): D
    reuses the blocks once the configured bound on a WRITE's life passed, not before, and
    without a bound (None) keeps them until P answers or dies."""
    d = DRegistry(quarantine=5.0, pinned_limit=12.0)
    d.watch(watch(), now=0.0)
    d.abort("d-1", "aborted by engine", now=1.0)
    d.notified("d-1", ok=False, peer=P0, final=False, reason="cancelled; may still land", now=2.0)
    res = d.due(now=6.0)
    assert res.held == ["d-1"] and reports(res) == []
    assert d.deadlines.get("d-1") == 11.0  # asked again a quarantine later
    res = d.due(now=11.0)
    assert res.held == ["d-1"] and d.deadlines.get("d-1") == 14.0  # the limit comes first
    res = d.due(now=14.0)
    assert reports(res) == [("d-1", "aborted by engine")] and "recv.pinned_limit_passed" in res.counters
    assert d.sizes() == {"recvs": 0, "recv_tids": 0, "recv_waiting": 0}
    forever = DRegistry(quarantine=5.0)
    forever.watch(watch(), now=0.0)
    forever.abort("d-1", "aborted by engine", now=1.0)
    forever.notified("d-1", ok=False, peer=P0, final=False, reason="may still land", now=2.0)
    assert forever.due(now=10_000.0).held == ["d-1"]


def test_a_quarantine_held_by_a_pinned_write_outlives_a_disconnect_and_ends_when_p_is_dead() -> None:
    """A disconnect may be a broken link to a P whose WRITE still runs: only a P confirmed dead
    (or its final answer) frees blocks it said the WRITE may still land in."""
    d = DRegistry(quarantine=5.0)
    d.watch(watch(), now=0.0)
    d.abort("d-1", "aborted by engine", now=0.0)
    d.notified("d-1", ok=False, peer=P0, final=False, reason="pinned", now=0.0)
    held = d.due(now=6.0)
    assert held.held == ["d-1"] and [type(a) for a in held.actions] == [SendAbort]  # asked again
    assert reports(d.peer_gone(P0, "prefill-pp0-tp0", "disconnected", now=7.0)) == []
    assert d.due(now=11.0).held == ["d-1"]
    assert reports(d.peer_dead(P0, "prefill-pp0-tp0", "side channel refused")) == [("d-1", "aborted by engine")]


def test_the_watchdog_fails_then_quarantines() -> None:
    d = DRegistry(quarantine=5.0)
    d.watch(watch(deadline=10.0), now=0.0)
    res = d.due(now=10.0)
    assert res.timed_out == ["d-1"] and [type(a) for a in res.actions] == [SendAbort]
    res = d.due(now=15.0)
    assert res.quarantine_ended == ["d-1"]
    assert reports(res) == [("d-1", "push not completed before registration timeout")]


def test_an_abort_just_before_the_watchdog_still_quarantines_in_full() -> None:
    """The blocks stay D's only after P heard the abort or its lease lapsed: an abort 0.5 s
    before the registration's watchdog keeps them the whole quarantine, not the 0.5 s left."""
    d = DRegistry(quarantine=5.0)
    d.watch(watch(deadline=10.0), now=0.0)
    d.abort("d-1", "aborted by engine", now=9.5)
    res = d.due(now=10.0)
    assert reports(res) == [] and res.quarantine_ended == [] and res.timed_out == []
    assert reports(d.due(now=14.4)) == []
    res = d.due(now=14.5)
    assert res.quarantine_ended == ["d-1"] and reports(res) == [("d-1", "aborted by engine")]


def test_a_restage_with_other_blocks_fails_once_and_an_identical_one_is_idempotent() -> None:
    d = DRegistry(quarantine=5.0)
    d.watch(watch(blocks=(1, 2)), now=0.0)
    assert d.watch(watch(blocks=(1, 2)), now=0.0).event == "recv.duplicate"
    res = d.watch(watch(blocks=(3, 4)), now=0.0)
    assert res.event == "recv.restaged" and [type(a) for a in res.actions] == [SendAbort]
    assert reports(d.notified("d-1", ok=True, peer=P0, final=True, reason="", now=1.0)) == [
        ("d-1", "re-staged with different blocks while its push was pending")
    ]


def test_a_restage_gives_back_the_staging_slot_its_unsent_registration_took() -> None:
    """The second registration of a re-staged request is never sent (the request fails), so
    no WRITE can land in the slot it took: that slot goes back now; the first slot only once
    the request settles (P may be writing into it)."""
    d = DRegistry(quarantine=5.0)
    d.watch(watch(blocks=(1, 2), slot=(0, 4096)), now=0.0)
    assert d.watch(watch(blocks=(1, 2), slot=(0, 4096)), now=0.0).actions == []  # the same slot
    res = d.watch(watch(blocks=(3, 4), slot=(4096, 4096)), now=0.0)
    freed = [a.registration.staging_slot for a in res.actions if isinstance(a, FreeSlot)]
    assert freed == [(4096, 4096)]
    res = d.notified("d-1", ok=True, peer=P0, final=True, reason="", now=1.0)
    assert [a.registration.staging_slot for a in res.actions if isinstance(a, Report) and a.registration] == [(0, 4096)]


def kinds(res: Any) -> list[tuple[str, str]]:
    """The actions in order, as (kind, D request id)."""
    out = []
    for a in res.actions:
        if isinstance(a, SendAbort):
            out.append(("abort", a.ledger.watch.request_id))
        elif isinstance(a, SendRegistration):
            out.append(("register", a.registration.request_id))
        elif isinstance(a, Report):
            out.append(("report", a.request_id))
        elif isinstance(a, FreeSlot):
            out.append(("free_slot", a.registration.request_id))
    return out


def test_two_live_requests_with_one_transfer_id_are_never_both_registered_and_both_fail() -> None:
    d = DRegistry(quarantine=5.0, reuse_wait=2.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    res = d.watch(watch("d-b", tid="T"), now=0.0)
    assert res.event == "recv.deferred" and res.actions == []  # waits, unregistered
    assert d.sizes()["recv_waiting"] == 1 and "d-b" not in d.ledgers
    assert d.due(1.9).actions == []
    res = d.due(2.0)  # d-a still live after reuse_wait: P could not tell them apart
    assert kinds(res) == [("report", "d-b"), ("abort", "d-a")]
    assert all("transfer id 'T' is used by" in (r or "") for _, r in reports(res))
    # Once d-a is over the transfer id is free again.
    d.notified("d-a", ok=False, peer=P0, final=True, reason="refused", now=3.0)
    assert d.watch(watch("d-c", tid="T"), now=3.0).event == "recv.watching"


def test_a_leg_sent_again_before_the_engine_aborted_the_first_registers_after_that_abort() -> None:
    """A client cancelled D's leg and sent it again (llm-d does, when P's answer names another
    identity); vLLM's abort of the first may come after the second leg."""
    d = DRegistry(quarantine=5.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    assert d.watch(watch("d-b", tid="T", blocks=(7,)), now=0.1).event == "recv.deferred"
    res = d.abort("d-a", "aborted by engine", now=0.2)
    # The first's abort goes to P before the second's registration (one channel, in order).
    assert kinds(res) == [("abort", "d-a"), ("register", "d-b")]
    assert "d-b" in d.ledgers and d.sizes()["recv_waiting"] == 0
    # Each answer counts for its own request only.
    assert reports(d.notified("d-b", ok=True, peer=P0, final=True, reason="", now=0.3)) == [("d-b", None)]
    assert reports(d.notified("d-a", ok=False, peer=P0, final=True, reason="aborted", now=0.3)) == [
        ("d-a", "aborted by engine")
    ]


def test_a_leg_sent_again_after_the_first_was_aborted_registers_at_once() -> None:
    d = DRegistry(quarantine=5.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    d.abort("d-a", "aborted by engine", now=0.1)  # quarantined: P has not answered the abort yet
    res = d.watch(watch("d-b", tid="T", blocks=(7,)), now=0.2)
    assert res.event == "recv.watching" and kinds(res) == [("register", "d-b")]


def test_a_waiting_request_fails_when_the_holder_landed_or_failed_otherwise() -> None:
    """Landed: the id is spent (P pushed its request). Failed otherwise (P refused it, its
    push failed): P may hold the id as ambiguous or ended. Either way the waiting request
    fails at once, never registered (its blocks untouched)."""
    d = DRegistry(quarantine=5.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    d.watch(watch("d-b", tid="T"), now=0.0)
    res = d.notified("d-a", ok=True, peer=P0, final=True, reason="", now=0.5)
    assert kinds(res) == [("report", "d-a"), ("report", "d-b")]
    assert reports(res)[0] == ("d-a", None) and "transfer id 'T'" in (reports(res)[1][1] or "")
    d.watch(watch("d-c", tid="U"), now=1.0)
    d.watch(watch("d-d", tid="U"), now=1.0)
    res = d.notified("d-c", ok=False, peer=P0, final=True, reason="refused: ambiguous", now=1.5)
    assert [k for k in kinds(res) if k[0] != "abort"] == [("report", "d-c"), ("report", "d-d")]
    assert not [a for a in res.actions if isinstance(a, SendRegistration)]
    assert d.sizes() == {"recvs": 0, "recv_tids": 0, "recv_waiting": 0}


def test_a_waiting_request_its_engine_aborts_ends_unregistered_and_the_holder_goes_on() -> None:
    d = DRegistry(quarantine=5.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    d.watch(watch("d-b", tid="T"), now=0.0)
    res = d.abort("d-b", "aborted by engine", now=0.1)
    assert kinds(res) == [("report", "d-b")] and reports(res) == [("d-b", "aborted by engine")]
    assert d.due(10.0).actions == []  # its wait's deadline went with it
    assert reports(d.notified("d-a", ok=True, peer=P0, final=True, reason="", now=0.2)) == [("d-a", None)]


def test_a_third_request_on_one_transfer_id_fails_all_three() -> None:
    d = DRegistry(quarantine=5.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    d.watch(watch("d-b", tid="T"), now=0.0)
    res = d.watch(watch("d-c", tid="T"), now=0.0)
    assert sorted(kinds(res)) == [("abort", "d-a"), ("report", "d-b"), ("report", "d-c")]
    assert res.event == "recv.ambiguous"


def test_a_waiting_request_staged_again_waits_as_its_newest_staging() -> None:
    d = DRegistry(quarantine=5.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    first = watch("d-b", tid="T", slot=(0, 64))
    d.watch(first, now=0.0)
    assert d.watch(first, now=0.1).event == "recv.duplicate"
    res = d.watch(watch("d-b", tid="T", blocks=(5,), slot=(64, 64)), now=0.1)
    assert kinds(res) == [("free_slot", "d-b")]  # the first staging's slot: nothing was sent for it
    res = d.abort("d-a", "aborted by engine", now=0.2)
    (reg,) = [a.registration for a in res.actions if isinstance(a, SendRegistration)]
    assert reg.local_block_ids == ((5,),) and reg.staging_slot == (64, 64)


def test_a_request_on_the_id_of_one_that_failed_otherwise_still_fails_at_once() -> None:
    """A holder that failed (not by its engine's abort) keeps its id while quarantined: P may
    have refused that id as ambiguous, or ended its request. A new request under it fails."""
    d = DRegistry(quarantine=5.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    d.due(100.0)  # d-a's watchdog fired: failed, quarantined
    res = d.watch(watch("d-b", tid="T"), now=100.0)
    assert res.event == "recv.ambiguous" and kinds(res) == [("report", "d-b")]


def test_a_dead_p_releases_only_requests_already_failed_that_waited_on_it() -> None:
    d = DRegistry(quarantine=30.0)
    d.watch(watch("d-a"), now=0.0)
    d.watch(watch("d-b"), now=0.0)
    d.peer_gone(P0, "prefill-pp0-tp0", "disconnected", now=1.0, delivered=("d-a",))  # d-b is being resent
    d.notified("d-a", ok=False, peer=P0, final=False, reason="pinned", now=1.0)  # even a pinned WRITE
    res = d.peer_dead(P0, "prefill-pp0-tp0", "its side channel refuses connections")
    assert reports(res) == [("d-a", "P rank prefill-pp0-tp0 gone: disconnected")]
    assert "d-b" in d.ledgers  # waits for its resent registration


def test_a_gone_agent_fails_only_the_requests_whose_registration_reached_it() -> None:
    """P restarted under the same agent name. Of three requests for that rank, one reached the
    old agent; the others were parked for the next incarnation (the agent was already
    forgotten): they keep waiting and land when the new P answers."""
    d = DRegistry(quarantine=5.0)
    for rid in ("d-a", "d-b", "d-c"):
        d.watch(watch(rid), now=0.0)
    res = d.peer_gone(P0, "prefill-pp0-tp0", "disconnected", now=1.0, delivered=("d-a",))
    assert res.fields["affected"] == 1 and res.fields["kept"] == 2
    assert d.ledgers["d-a"].failed_reason == "P rank prefill-pp0-tp0 gone: disconnected"
    assert d.ledgers["d-b"].failed_reason is None and d.ledgers["d-c"].failed_reason is None
    assert reports(d.notified("d-b", ok=True, peer=P0, final=True, reason="", now=2.0)) == [("d-b", None)]
    assert reports(d.notified("d-c", ok=True, peer=P0, final=True, reason="", now=2.0)) == [("d-c", None)]
    # Without the list (a sender that cannot say), every request waiting on the rank fails.
    d.watch(watch("d-d"), now=3.0)
    assert d.peer_gone(P0, "prefill-pp0-tp0", "disconnected", now=4.0).fields["affected"] == 1
    assert d.ledgers["d-d"].failed_reason == "P rank prefill-pp0-tp0 gone: disconnected"


def test_an_answer_naming_another_generation_neither_lands_nor_fails_nor_pins_the_live_one() -> None:
    import msgspec

    live, old = (3 << 32) | 9, (3 << 32) | 8
    w = watch()
    w = msgspec.structs.replace(w, registration=msgspec.structs.replace(w.registration, generation=live))
    d = DRegistry(quarantine=5.0)
    d.watch(w, now=0.0)
    for ok, final in ((True, True), (False, True), (False, False)):
        res = d.notified("d-1", ok=ok, peer=P0, final=final, reason="old", now=1.0, generation=old)
        kind = "completion" if ok else "push_fail"
        assert res.event == "notif.stale" and f"reaper.notif_stale_generation.{kind}" in res.counters
        assert not res.actions
    ledger = d.ledgers["d-1"]
    assert ledger.answers == 0 and not ledger.pinned and not ledger.aborted
    assert reports(d.notified("d-1", ok=True, peer=P0, final=True, reason="", now=2.0, generation=live)) == [
        ("d-1", None)
    ]


def test_an_actor_error_about_a_waiting_request_ends_it_once() -> None:
    d = DRegistry(quarantine=5.0, reuse_wait=2.0)
    d.watch(watch("d-a", tid="T"), now=0.0)
    d.watch(watch("d-b", tid="T"), now=0.0)
    assert d.knows("d-b") and d.knows("d-a") and not d.knows("d-c")
    res = d.fail("d-b", "D reaper error: boom", now=0.5)
    assert reports(res) == [("d-b", "D reaper error: boom")] and not d.knows("d-b")
    assert d.due(3.0).actions == []  # no second report when its wait would have ended
    assert "d-a" in d.ledgers and not d.ledgers["d-a"].aborted
