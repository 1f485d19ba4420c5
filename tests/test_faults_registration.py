"""Faults 01–04 (issue 5): D's registration cannot reach P.

Over the fake fabric, one test per scenario; see docs/reliability.md for the table.
"""

from __future__ import annotations

import pytest
from scenario_kit import (
    D_AGENT,
    P_AGENT,
    addr,
    agent,
    assert_clean,
    is_write_from,
    legs,
    make_pair,
    posted,
    rank_bytes,
    stat,
    timed_pump,
    untouched,
    with_hash,
)

from pushactors.logs import EventCapture
from pushactors.protocol import (
    PUSH_REG_PREFIX,
    CompatSpec,
    compatibility_hash,
)

pytestmark = pytest.mark.timeout(60)


# =============================================================================================
# 01–04: D's registration cannot reach P
# =============================================================================================
@pytest.mark.parametrize("fault", ["refused", "timeout"])
def test_01_d_to_p_handshake_refused_or_timeout_fails_the_receive(fault: str) -> None:
    with make_pair(lease_duration=0.5, registration_timeout=30.0, handshake_timeout=0.3) as pair:
        p_addr = addr(pair.p_endpoint)
        if fault == "refused":
            pair.directory.refused.add(p_addr)
        else:
            pair.directory.delays[p_addr] = 5.0  # longer than handshake_timeout
        p_id, d_id = legs(pair, "r1")
        elapsed = timed_pump(pair, lambda: d_id in pair.received, what="D to fail the receive")
        why = pair.received[d_id]
        assert why is not None and "handshake with prefill/pp0/tp0 failed" in why and f"({fault})" in why
        assert elapsed < 5.0, "failed by the 30 s watchdog, not by the handshake failure"
        assert stat(pair.decode, "recv.timed_out") == 0
        assert stat(pair.decode, f"handshake.failed.{fault}") == 1
        # P never heard of D's request: its lease frees its blocks.
        pair.pump(lambda: p_id in pair.sent, what="P's lease to expire")
        assert "lease" in (pair.sent[p_id] or "")
        assert posted(pair) == 0
        assert stat(pair.prefill, "notif.received") == 0
        assert_clean(pair)


OTHER_COMPAT = CompatSpec(model="another-model", dtype="uint8", kv_shape=(2048,))


@pytest.mark.parametrize("side", ["p_payload", "d_payload"])
def test_02_wrong_compatibility_hash_fails_the_receive_without_a_write(side: str) -> None:
    """p_payload: D's handshake to P sees another model (D fails at once). d_payload: P's
    handshake to D does (P cannot verify D's registration: no WRITE, P's lease frees P, D's
    watchdog and quarantine bound D)."""
    reg_timeout = 30.0 if side == "p_payload" else 1.0
    with make_pair(lease_duration=0.5, registration_timeout=reg_timeout) as pair:
        target = pair.p_endpoint if side == "p_payload" else pair.d_endpoint
        pair.directory.tamper[addr(target)] = with_hash(compatibility_hash(OTHER_COMPAT))
        p_id, d_id = legs(pair, "r2")
        elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
        why = pair.received[d_id]
        assert why is not None
        if side == "p_payload":
            assert "incompatible" in why
            assert stat(pair.decode, "handshake.failed.incompatible") == 1
            assert elapsed < 5.0
        else:
            assert "registration timeout" in why
            assert stat(pair.prefill, "handshake.failed.incompatible") == 1
            assert stat(pair.prefill, "reg.unverified") == 1
            assert elapsed >= reg_timeout * 0.9
        assert "lease" in (pair.sent[p_id] or "")
        assert posted(pair) == 0
        assert untouched(pair.decode, d_id)
        assert_clean(pair)


@pytest.mark.parametrize("case", ["load_fails", "agent_gone"])
def test_03_no_p_agent_at_send_time_fails_the_receive(case: str) -> None:
    with make_pair(registration_timeout=30.0) as pair:
        if case == "load_fails":
            rule = pair.fabric.faults.fail_add_remote(match=lambda c: c.src == D_AGENT and c.dst == P_AGENT)
        else:
            # A first request loads P's agent on D; then the agent disappears under the writer.
            p0, d0 = legs(pair, "r0")
            pair.pump(lambda: d0 in pair.received and p0 in pair.sent)
            assert pair.received[d0] is None and pair.sent[p0] is None
            pair.fabric.get(D_AGENT).remove_remote_agent(P_AGENT)
        before = posted(pair)
        p_id, d_id = legs(pair, "r3")
        elapsed = timed_pump(pair, lambda: d_id in pair.received, what="D to fail the receive")
        why = pair.received[d_id] or ""
        if case == "load_fails":
            assert rule.hits == 1
            assert "add_remote_agent" in why
        else:
            assert "sending PUSH_REG" in why and "not loaded" in why
            assert stat(pair.decode, "notif.send_failed") >= 1
        assert elapsed < 5.0
        pair.pump(lambda: p_id in pair.sent, what="P's lease to expire")
        assert "lease" in (pair.sent[p_id] or "")
        assert posted(pair) == before
        assert untouched(pair.decode, d_id)
        assert_clean(pair)


def test_04_push_reg_send_fails_for_one_of_several_p_ranks(events: EventCapture) -> None:
    """P TP=2 → D TP=1: the PUSH_REG to P rank 1 cannot be sent. D fails the request, but only
    once P rank 0 (which did get it) answered: its WRITE may still be landing in D's blocks."""
    with make_pair(p_tp=2, d_tp=1, registration_timeout=30.0) as pair:
        bad = pair.fabric.faults.fail_send_notif(
            match=lambda c: c.src == D_AGENT and c.dst == agent("prefill", 1) and c.notif.startswith(PUSH_REG_PREFIX)
        )
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(agent("prefill", 0)))
        p_id, d_id = legs(pair, "r4")
        pair.pump(
            lambda: (
                bad.hits == 1 and posted(pair) == 1 and bool(events.where(event="recv.undelivered", request_id=d_id))
            ),
            what="the failed send to rank 1 and rank 0's WRITE",
        )
        for _ in range(5):
            pair.step()
        assert d_id not in pair.received, "D reported while P rank 0's WRITE is still in flight"
        gate.open()
        pair.pump(lambda: d_id in pair.received, what="D to fail the receive")
        why = pair.received[d_id] or ""
        assert "sending PUSH_REG" in why
        # Rank 0's head slice landed whole; rank 1's slice was never written.
        checked, wrong, _ = rank_bytes(pair.decode, d_id, 0, 0, 1024)
        assert checked > 0 and wrong == 0
        assert rank_bytes(pair.decode, d_id, 0, 1024, 2048)[2] == 0
        # P rank 1 never got a registration: its lease frees it; P reports once both ranks did.
        pair.pump(lambda: p_id in pair.sent, what="P rank 1's lease to expire")
        assert "lease" in (pair.sent[p_id] or "")
        assert stat(pair.prefill, "write.done", rank=0) == 1
        assert stat(pair.prefill, "write.posted", rank=1) == 0
        assert_clean(pair)
