"""Faults 12–17 (issue 5): time — leases, tombstones, heartbeats, the watchdog.

Over the fake fabric, one test per scenario; see docs/reliability.md for the table.
"""

from __future__ import annotations

import time

import pytest
from scenario_kit import (
    D_AGENT,
    P_AGENT,
    TOKENS,
    actor,
    addr,
    assert_clean,
    assert_landed,
    evict_d_from_p,
    legs,
    make_pair,
    posted,
    stat,
    timed_pump,
    untouched,
)

from pushactors.logs import EventCapture
from pushactors.protocol import (
    ABORT_PREFIX,
    HEARTBEAT_PREFIX,
    MAX_HEARTBEAT_NOTIF_BYTES,
    decode_notification,
    encode_heartbeat,
    notification_kind,
)
from pushactors.testing import wait_until

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# 12–17: time (leases, tombstones, heartbeats, watchdog)
# =============================================================================================
def test_12_push_reg_after_p_lease_expired_is_answered_at_once() -> None:
    with make_pair(lease_duration=0.5, registration_timeout=30.0) as pair:
        p_id, d_id = "r12-aaaaaaaa", "r12-bbbbbbbb"
        params = pair.prefill.prefill(p_id, TOKENS, key="r12")
        pair.pump(lambda: p_id in pair.sent, what="P's lease to expire")
        assert "lease" in (pair.sent[p_id] or "")
        pair.decode.expect(d_id, TOKENS, params, key="r12")
        elapsed = timed_pump(pair, lambda: d_id in pair.received, what="D to hear P's refusal")
        assert elapsed < 5.0, "D waited for its watchdog instead of P's push failure"
        assert "expired" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.timed_out") == 0
        assert stat(pair.prefill, "matcher.refused") == 1
        assert posted(pair) == 0
        assert untouched(pair.decode, d_id)
        assert_clean(pair)


@pytest.mark.parametrize("parked", ["registration", "push"])
def test_13_handshake_completing_after_lease_expiry_posts_no_write(parked: str, events: EventCapture) -> None:
    """P's handshake with D is slower than P's lease: the lease frees P's blocks meanwhile, and
    what is replayed after the handshake (the registration, or the matched push itself) is
    answered with a push failure (tombstone), never written."""
    slow = 1.5
    with make_pair(lease_duration=0.5, registration_timeout=30.0, handshake_timeout=5.0, engine_ttl=0.2) as pair:
        if parked == "registration":
            pair.directory.delays[addr(pair.d_endpoint)] = slow
            p_id, d_id = legs(pair, "r13")
        else:
            # D registered and was admitted; P forgot D's agent (idle), so the push itself
            # parks on a new, slow handshake when P's blocks finish.
            p_id, d_id = "r13p-aaaaaaaa", "r13p-bbbbbbbb"
            pair.decode.expect(d_id, TOKENS, pair.prefill.scheduler.decode_params(p_id), key="r13p")
            pair.pump(
                lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1,
                what="D's registration to be admitted",
            )
            evict_d_from_p(pair)
            pair.directory.delays[addr(pair.d_endpoint)] = slow
            # D's heartbeats would (rightly) keep the matched lease alive: lose them.
            pair.fabric.faults.drop_notif(match=lambda c: notification_kind(c.notif) == "heartbeat", times=None)
            pair.prefill.prefill(p_id, TOKENS, key="r13p")
        t0 = time.monotonic()
        pair.pump(lambda: p_id in pair.sent, what="P's lease to expire")
        assert "lease" in (pair.sent[p_id] or "")
        assert not pair.prefill.held
        assert d_id not in pair.received
        assert actor(pair.prefill, "writer").sizes()["awaiting"] >= 1  # still parked on the handshake
        pair.pump(lambda: d_id in pair.received, what="D to hear P's refusal")
        elapsed = time.monotonic() - t0
        assert "expired" in (pair.received[d_id] or "")
        assert elapsed < 5.0, "D waited for its watchdog"
        # The late handshake replayed what was parked on it, and that posted nothing.
        applied = events.where(event="handshake.applied", rank="prefill/pp0/tp0")
        assert applied and applied[-1]["replayed"] >= 1
        assert posted(pair) == 0
        assert untouched(pair.decode, d_id)
        assert_clean(pair)


def test_14_lease_expiry_without_registration_frees_p() -> None:
    lease = 0.5
    with make_pair(lease_duration=lease) as pair:
        p_id = "r14-aaaaaaaa"
        pair.prefill.prefill(p_id, TOKENS, key="r14")
        elapsed = timed_pump(pair, lambda: p_id in pair.sent, what="P's lease to expire")
        assert lease * 0.9 <= elapsed < lease + 1.5
        assert "lease" in (pair.sent[p_id] or "")
        assert stat(pair.prefill, "lease.expired") == 1
        assert stat(pair.prefill, "push.expired") == 1
        assert actor(pair.prefill, "reaper").sizes()["leases"] == 0
        # The matcher hears of it just after the report (Forget): its entry goes too.
        wait_until(lambda: actor(pair.prefill, "matcher").sizes()["finished"] == 0, what="the matcher to forget")
        assert actor(pair.prefill, "writer").sizes()["pushes"] == 0
        assert posted(pair) == 0
        assert_clean(pair)


def test_15_heartbeats_reorder_expiries_and_never_strand_expired_leases(events: EventCapture) -> None:
    """A is leased first and its WRITE is held: D's heartbeats keep A's lease alive. B and C,
    leased after A, get no registration: they expire on time although A heads the heap."""
    lease = 1.0
    with make_pair(lease_duration=lease, heartbeat_interval=0.1, registration_timeout=10.0) as pair:
        gate = pair.fabric.faults.hold_transfer()
        a_p, a_d = "r15a-aaaaaaaa", "r15a-bbbbbbbb"
        params = pair.prefill.prefill(a_p, TOKENS, key="r15a")
        pair.prefill.step()
        t_a = time.monotonic()
        pair.decode.expect(a_d, TOKENS, params, key="r15a")
        pair.pump(lambda: posted(pair) == 1, what="A's WRITE to be posted")
        others = ["r15b-aaaaaaaa", "r15c-aaaaaaaa"]
        for rid in others:
            pair.prefill.prefill(rid, TOKENS, key=rid)
        pair.prefill.step()
        t_b = time.monotonic()
        pair.pump(lambda: all(r in pair.sent for r in others), what="B and C to expire")
        elapsed = time.monotonic() - t_b
        assert lease * 0.9 <= elapsed < lease + 1.0, "an expired lease was stranded behind the heartbeated head"
        assert all("lease" in (pair.sent[r] or "") for r in others)
        # A's own lease was due before B's: only the heartbeats kept it.
        assert time.monotonic() - t_a > lease
        assert a_p not in pair.sent
        assert actor(pair.prefill, "reaper").sizes()["leases"] == 1
        assert any(e.get("extended", 0) > 0 for e in events.named("lease.extended"))
        assert {e["request_id"] for e in events.named("lease.expired")} == set(others)
        gate.open()
        pair.pump(lambda: a_p in pair.sent and a_d in pair.received)
        assert pair.sent[a_p] is None and pair.received[a_d] is None
        assert_landed(pair.decode, a_d)
        assert stat(pair.prefill, "lease.expired") == 2
        assert_clean(pair)


def test_16_heartbeats_for_unknown_ids_are_counted_and_ignored(events: EventCapture) -> None:
    lease = 0.6
    with make_pair(lease_duration=lease) as pair:
        x = "r16-aaaaaaaa"
        pair.prefill.prefill(x, TOKENS, key="r16")
        pair.prefill.step()
        t0 = time.monotonic()
        p_agent = pair.fabric.get(P_AGENT)
        p_agent.inject_notif(D_AGENT, encode_heartbeat(["ghost-1", "ghost-2"]))
        # A real P id, but from an agent that never registered for it: not a keep-alive either.
        p_agent.inject_notif("intruder-pp0-tp0", encode_heartbeat([x]))
        pair.pump(lambda: stat(pair.prefill, "matcher.heartbeat_unknown") == 3, what="the heartbeats to be resolved")
        resolved = events.where(event="heartbeat.resolved", rank="prefill/pp0/tp0")
        assert len(resolved) == 2 and all(e["extended"] == 0 for e in resolved)
        assert not events.named("lease.extended")
        pair.pump(lambda: x in pair.sent, what="X's lease to expire")
        assert time.monotonic() - t0 < lease + 1.0
        assert "lease" in (pair.sent[x] or "")
        assert stat(pair.prefill, "notif.received") == 2
        assert stat(pair.prefill, "notif.malformed") == 0
        assert stat(pair.prefill, "matcher.handler_error") == 0
        assert posted(pair) == 0
        assert_clean(pair)


def _heartbeats(ids: list[str]) -> list[bytes]:
    """``ids`` as HB: notifications as large as P decodes (MAX_HEARTBEAT_NOTIF_BYTES; D's own
    writer sends at most half that)."""
    out: list[bytes] = []
    chunk: list[str] = []
    size = len(HEARTBEAT_PREFIX)
    for rid in ids:
        if chunk and size + len(rid) + 1 > MAX_HEARTBEAT_NOTIF_BYTES:
            out.append(encode_heartbeat(chunk))
            chunk, size = [], len(HEARTBEAT_PREFIX)
        chunk.append(rid)
        size += len(rid) + 1
    out.append(encode_heartbeat(chunk))
    return out


def test_16b_a_heartbeat_storm_from_ds_own_agent_never_expires_an_unrelated_lease() -> None:
    """D's own agent heartbeats 100k ids (almost all unknown to P), over and over, while an
    unrelated request with a 1.5 s lease is pushed. P's writer hands on the heartbeats one poll
    read as one message per agent (ids deduplicated), and the matcher resolves a heartbeat a
    slice per mailbox message, sending the rest back to its own mailbox, so the request's blocks
    and registration wait behind one slice of each queued heartbeat, not behind all of them: the
    push lands. (With whole heartbeats per message the backlog of 45 storms, seconds of
    matcher work, sits in front of them and the lease expires.)"""
    lease = 1.5
    storms, ids_per_storm = 45, 100_000
    with make_pair(lease_duration=lease, registration_timeout=30.0) as pair:
        # Both sides know each other first: the storm, not a first handshake, is under test.
        w_p, w_d = legs(pair, "r16w")
        pair.pump(lambda: w_p in pair.sent and w_d in pair.received, what="the warm-up push")
        assert pair.received[w_d] is None
        # Mostly unknown: ghosts, plus the ended warm-up request (tombstoned, no lease to extend).
        storm = _heartbeats([f"g{i:x}" for i in range(ids_per_storm - 1)] + [w_p])
        assert all(len(decode_notification(n).ids) > 8_000 for n in storm[:-1])  # type: ignore[union-attr]
        p_agent = pair.fabric.get(P_AGENT)
        routed = stat(pair.prefill, "notif.kind.heartbeat")
        sent = 0

        def blow(times: int = 1) -> None:
            nonlocal sent
            for _ in range(times):
                for payload in storm:
                    p_agent.inject_notif(D_AGENT, payload)
                sent += len(storm)

        blow(storms)
        # P's writer has handed every storm notification to the matcher: they all wait in its
        # mailbox, ahead of anything the request sends it.
        wait_until(
            lambda: stat(pair.prefill, "notif.kind.heartbeat") - routed >= sent, timeout=30.0, what="the storm routed"
        )
        backlog = stat(pair.prefill, "matcher.heartbeat_unknown")
        assert backlog < storms * ids_per_storm * 0.8, "the matcher drained the storm before the request came"
        t0 = time.monotonic()
        p_id, d_id = legs(pair, "r16s")
        last = time.monotonic()

        def landed_while_blowing() -> bool:
            nonlocal last
            if time.monotonic() - last > 0.2:  # and it goes on: another storm every 200 ms
                blow()
                last = time.monotonic()
            return p_id in pair.sent and d_id in pair.received

        pair.pump(landed_while_blowing, timeout=30.0, what="the unrelated request to end")
        took = time.monotonic() - t0
        assert pair.received[d_id] is None, f"the push failed after {took:.2f}s: {pair.received[d_id]}"
        assert pair.sent[p_id] is None, pair.sent[p_id]
        assert_landed(pair.decode, d_id)
        assert stat(pair.prefill, "lease.expired") == 0
        assert stat(pair.prefill, "matcher.heartbeat_requeued") > 0
        # Storms read in one poll reached the matcher as one heartbeat (the same ids, once).
        assert stat(pair.prefill, "heartbeat.coalesced") > 0
        # Every heartbeat the matcher was given is resolved in the end (one slice per mailbox
        # message, each slice counting its unknown ids): two reads through its mailbox in a row
        # that see no slice run in between find none left. Nothing of the storm extended a lease
        # or failed a handler.
        seen = [-1]

        def drained() -> bool:
            actor(pair.prefill, "matcher").sizes()  # every slice queued before this one has run
            unknown = stat(pair.prefill, "matcher.heartbeat_unknown")
            quiet, seen[0] = unknown == seen[0], unknown
            return quiet

        wait_until(drained, timeout=60.0, what="the matcher to resolve the whole storm")
        assert stat(pair.prefill, "matcher.heartbeat_unknown") >= ids_per_storm
        assert stat(pair.prefill, "matcher.handler_error") == 0
        assert_clean(pair)


@pytest.mark.parametrize("p_answers", [True, False], ids=["p_answers_abort", "p_silent"])
def test_17_d_watchdog_fails_a_request_p_never_finishes(p_answers: bool, events: EventCapture) -> None:
    quarantine = 3.0 if p_answers else 0.4
    reg_timeout = 1.0
    with make_pair(registration_timeout=reg_timeout, abort_quarantine=quarantine) as pair:
        if not p_answers:
            pair.fabric.faults.drop_notif(match=lambda c: c.notif.startswith(ABORT_PREFIX), times=None)
        d_id = "r17-bbbbbbbb"
        params = pair.prefill.scheduler.decode_params("r17-aaaaaaaa")  # a prefill that never ends
        pair.decode.expect(d_id, TOKENS, params, key="r17")
        elapsed = timed_pump(pair, lambda: d_id in pair.received, what="D's watchdog")
        assert "registration timeout" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.timed_out") == 1
        if p_answers:
            assert reg_timeout * 0.9 <= elapsed < reg_timeout + quarantine - 1.0
            assert events.where(event="abort.dropped_registration", rank="prefill/pp0/tp0")
            assert actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 0
        else:
            assert elapsed >= reg_timeout + quarantine - 0.05
            assert events.named("recv.quarantine_ended")
        assert posted(pair) == 0
        assert_clean(pair)
