"""Reliability scenarios of issue 5 (SPEC §6–7), over the fake fabric, one test per scenario.

Every test ends each request visibly and checks what that means: which requests finished or
failed and why, that the bytes of successful ones landed, that P's blocks came back and D's
requests were reported (nothing hangs), and that no WRITE was posted where none may be.
Durations are short; nothing sleeps: where a test proves that something does *not* happen it
first waits for a positive event that comes after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import pytest
import torch

from pushactors.actors.base import ActorKilled
from pushactors.actors.handshake import Handshake
from pushactors.actors.matcher import Matcher
from pushactors.actors.reaper import Reaper
from pushactors.actors.writer import Writer
from pushactors.config import PushConfig
from pushactors.directory import DirectoryEndpoint
from pushactors.logs import EventCapture
from pushactors.protocol import (
    ABORT_PREFIX,
    HEARTBEAT_PREFIX,
    PUSH_FAIL_PREFIX,
    PUSH_REG_PREFIX,
    AgentInfo,
    ClockSample,
    CompatSpec,
    HandshakeEnvelope,
    MalformedMessage,
    PushFailure,
    Registration,
    compatibility_hash,
    decode_notification,
    encode_completion,
    encode_heartbeat,
    encode_push_failure,
    encode_registration,
    notification_kind,
)
from pushactors.scheduler import PushScheduler
from pushactors.testing import FaultContext, PushPair, SimEngine, SimSpec, pattern_row, raw_registration, wait_until

pytestmark = pytest.mark.timeout(60)

# Short durations: every scenario runs in well under a few seconds.
FAST: dict[str, Any] = {
    "reaper_tick": 0.01,
    "lease_duration": 1.0,
    "registration_timeout": 2.0,
    "abort_quarantine": 0.4,
    "handshake_timeout": 2.0,
    # Scenarios time the quarantine itself; the soak runs with the enforced safe timing.
    "allow_unsafe_quarantine": True,
}
TOKENS = 40  # 3 blocks of 16 tokens


def make_pair(**overrides: Any) -> PushPair:
    return PushPair(**{**FAST, **overrides})


def agent(engine: str, tp: int = 0) -> str:
    return f"{engine}-pp0-tp{tp}"


P_AGENT = agent("prefill")
D_AGENT = agent("decode")


def addr(endpoint: DirectoryEndpoint) -> tuple[str, int]:
    return (endpoint.host, endpoint.port)


def stat(engine: SimEngine, name: str, rank: int | None = None) -> int:
    workers = engine.workers if rank is None else [engine.workers[rank]]
    return sum(w.stats().get(name, 0) for w in workers)


def posted(pair: PushPair) -> int:
    return pair.fabric.stats.transfers_posted


def actor(engine: SimEngine, name: str, rank: int = 0) -> Any:
    return engine.workers[rank].runtime.view(name)  # reads its tables through its mailbox


def pump_all(
    engines: Iterable[SimEngine], until: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition"
) -> None:
    """Step every engine until ``until()`` holds (PushPair.pump for more than two engines)."""
    engines = list(engines)

    def stepped() -> bool:
        for e in engines:
            e.step()
        return until()

    wait_until(stepped, timeout=timeout, interval=0.001, what=what)


def timed_pump(pair: PushPair, until: Callable[[], bool], *, timeout: float = 10.0, what: str = "condition") -> float:
    start = time.monotonic()
    pair.pump(until, timeout=timeout, what=what)
    return time.monotonic() - start


def legs(pair: PushPair, n: str, *, tokens: int = TOKENS, transfer_id: str | None = None) -> tuple[str, str]:
    """Both legs of request ``n`` at once (as a push router sends them): (P id, D id)."""
    p_id, d_id = f"{n}-aaaaaaaa", f"{n}-bbbbbbbb"
    params = pair.prefill.prefill(p_id, tokens, key=n, transfer_id=transfer_id)
    pair.decode.expect(d_id, tokens, params, key=n)
    return p_id, d_id


def rank_bytes(engine: SimEngine, d_id: str, rank: int, lo: int = 0, hi: int | None = None) -> tuple[int, int, int]:
    """(checked, wrong, non-zero) bytes in [lo, hi) of every block row of ``d_id`` on D rank ``rank``."""
    rec = engine.recvs[d_id]
    per_rank = engine.spec.block_bytes // engine.tp_size
    hi = per_rank if hi is None else hi
    checked = wrong = nonzero = 0
    for layer, t in enumerate(engine.kv[rank].values()):
        for half in range(2):
            view = t[half] if engine.spec.layout == "split" else t[:, half]
            for i, block in enumerate(rec.blocks):
                want = pattern_row(rec.key, layer, half, rec.first_position + i, per_rank, rank * per_rank)[lo:hi]
                got = view[block][lo:hi]
                checked += hi - lo
                wrong += int((got != want).sum())
                nonzero += int(torch.count_nonzero(got))
    return checked, wrong, nonzero


def untouched(engine: SimEngine, d_id: str) -> bool:
    """No byte of ``d_id``'s blocks was written on any D rank (pools start zeroed)."""
    return all(rank_bytes(engine, d_id, r)[2] == 0 for r in range(engine.tp_size))


def assert_landed(engine: SimEngine, d_id: str) -> None:
    checked, wrong = engine.verify(d_id)
    assert checked == len(engine.recvs[d_id].blocks) * engine.spec.block_bytes * 2 * engine.spec.num_layers
    assert wrong == 0, f"{d_id}: {wrong} wrong bytes"


def assert_clean(pair: PushPair, *more: SimEngine, timeout: float = 10.0) -> None:
    """Nothing hangs: every lease and watchdog cleared, P's blocks back, D's requests reported."""
    engines = [pair.prefill, pair.decode, *more]
    pump_all(
        engines,
        lambda: not any(e.has_pending_push_work() for e in engines),
        timeout=timeout,
        what="every lease and watchdog to clear",
    )
    assert not pair.prefill.held, f"P still holds {sorted(pair.prefill.held)}"
    assert pair.prefill.free_blocks == pair.prefill.spec.num_blocks
    for e in engines:
        for w in e.workers:
            assert w.pending() == (0, 0), f"{e.config.engine_id} rank {w.ctx.tp_rank} holds {w.pending()}"
    for d in (pair.decode, *more):
        for rid, rec in list(d.recvs.items()):
            assert rec.done or rec.failed is not None, f"{rid} was never reported"
            d.finish_recv(rid)
        assert d.free_blocks == d.spec.num_blocks


def extra_decode(pair: PushPair, engine_id: str = "decode2", **overrides: Any) -> SimEngine:
    """A second decode engine on the pair's fabric and directory."""
    endpoint = pair.directory.endpoint(f"{engine_id}-host")
    return SimEngine(
        PushConfig(engine_id=engine_id, role="consumer", **{**FAST, **overrides}),
        agent_factory=pair.fabric,
        source=pair.directory,
        publisher_for_rank=lambda _r: endpoint,
        spec=SimSpec(),
        seed=11,
    )


def with_hash(compat_hash: str) -> Callable[[bytes], bytes]:
    """A directory tamper that re-signs a handshake payload with another compatibility hash."""

    def tamper(raw: bytes) -> bytes:
        env = msgspec.msgpack.decode(raw, type=HandshakeEnvelope)
        return msgspec.msgpack.encode(HandshakeEnvelope(env.version, compat_hash, env.body))

    return tamper


def shifted_clock(seconds: float) -> Callable[[bytes], bytes]:
    """A directory tamper that serves the peer's clock sample shifted by ``seconds``."""

    def tamper(raw: bytes) -> bytes:
        env = msgspec.msgpack.decode(raw, type=HandshakeEnvelope)
        info = msgspec.msgpack.decode(env.body, type=AgentInfo)
        clock = ClockSample(monotonic=info.clock.monotonic + seconds, wall=info.clock.wall + seconds)
        body = msgspec.msgpack.encode(msgspec.structs.replace(info, clock=clock))
        return msgspec.msgpack.encode(HandshakeEnvelope(env.version, env.compat_hash, body))

    return tamper


def is_write_to(dst: str) -> Callable[[FaultContext], bool]:
    return lambda c: c.op == "WRITE" and c.dst == dst


def is_write_from(src: str) -> Callable[[FaultContext], bool]:
    return lambda c: c.op == "WRITE" and c.src == src


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


# =============================================================================================
# 05–11: P cannot write, or the WRITE goes wrong
# =============================================================================================
def evict_d_from_p(pair: PushPair, *engines: SimEngine) -> None:
    """Wait until P's writer forgot D's agent (idle past a tiny engine_ttl)."""
    p_agent = pair.fabric.get(P_AGENT)
    pump_all(
        [pair.prefill, pair.decode, *engines],
        lambda: D_AGENT not in p_agent.remote_agents,
        what="P to evict idle D",
    )


@pytest.mark.parametrize("case", ["d_unreachable", "d_unreachable_after_match", "unpairable_layout"])
def test_05_p_to_d_handshake_fails_p_frees_and_d_is_told_when_it_can(case: str) -> None:
    if case == "d_unreachable":
        # D is up and registered, but P cannot reach D's side channel: P cannot verify (or
        # answer) the registration, so no WRITE; P's lease frees P (SPEC §7); D's watchdog +
        # quarantine bound D (P cannot tell D anything).
        with make_pair(lease_duration=0.5, registration_timeout=1.0) as pair:
            pair.directory.refused.add(addr(pair.d_endpoint))
            p_id, d_id = legs(pair, "r5")
            t0 = time.monotonic()
            pair.pump(lambda: p_id in pair.sent, what="P to free its blocks")
            p_elapsed = time.monotonic() - t0
            pair.pump(lambda: d_id in pair.received, what="D to fail the receive")
            d_elapsed = time.monotonic() - t0
            assert "lease" in (pair.sent[p_id] or "")
            assert p_elapsed < 0.5 + 1.5
            assert stat(pair.prefill, "handshake.failed.refused") == 1
            assert stat(pair.prefill, "reg.unverified") == 1
            assert "registration timeout" in (pair.received[d_id] or "")
            assert 0.9 <= d_elapsed < 1.0 + 0.4 + 2.0
            assert posted(pair) == 0
            assert untouched(pair.decode, d_id)
            assert_clean(pair)
    elif case == "d_unreachable_after_match":
        # D's registration was admitted and waits for P's blocks; P then forgot D's agent (idle)
        # and D's side channel went away: when P's blocks finish, the push parks on a new
        # handshake with D, which fails. P fails the push and frees at once (no lease wait).
        with make_pair(lease_duration=30.0, registration_timeout=3.0, engine_ttl=0.2) as pair:
            p_id, d_id = "r5c-aaaaaaaa", "r5c-bbbbbbbb"
            pair.decode.expect(d_id, TOKENS, pair.prefill.scheduler.decode_params(p_id), key="r5c")
            pair.pump(
                lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1,
                what="D's registration to be admitted",
            )
            evict_d_from_p(pair)
            pair.directory.refused.add(addr(pair.d_endpoint))
            pair.prefill.prefill(p_id, TOKENS, key="r5c")
            elapsed = timed_pump(pair, lambda: p_id in pair.sent, what="P to fail the push")
            assert elapsed < 2.0, "P waited for its 30 s lease"
            assert "handshake with decode/pp0/tp0 failed (refused)" in (pair.sent[p_id] or "")
            assert not pair.prefill.held
            pair.pump(lambda: d_id in pair.received, what="D's watchdog")
            assert "registration timeout" in (pair.received[d_id] or "")
            assert posted(pair) == 0
            assert untouched(pair.decode, d_id)
            assert_clean(pair)
    else:
        # Same compatibility hash, but D's layout lacks layers P must write: the WRITE is
        # refused, D gets a push failure at once, P frees at once.
        with make_pair(
            registration_timeout=30.0, lease_duration=30.0, p_spec=SimSpec(num_layers=4), d_spec=SimSpec(num_layers=2)
        ) as pair:
            p_id, d_id = legs(pair, "r5")
            elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
            assert elapsed < 5.0
            assert "invalid WRITE" in (pair.received[d_id] or "")
            assert "invalid WRITE" in (pair.sent[p_id] or "")
            assert stat(pair.prefill, "write.refused") == 1
            assert stat(pair.prefill, "push_fail.sent") == 1
            assert posted(pair) == 0
            assert untouched(pair.decode, d_id)
            assert_clean(pair)


def test_06_write_submission_raises() -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        rule = pair.fabric.faults.raise_on_transfer(times=1)
        p_id, d_id = legs(pair, "r6")
        elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
        assert rule.hits == 1
        assert elapsed < 5.0
        assert "WRITE submission failed" in (pair.sent[p_id] or "")
        assert "WRITE submission failed" in (pair.received[d_id] or "")
        assert stat(pair.prefill, "write.submit_failed") == 1
        assert stat(pair.prefill, "push.pushed") == 0
        assert stat(pair.decode, "recv.finished") == 0
        assert posted(pair) == 0
        assert pair.fabric.get(P_AGENT).live_handles == 0
        assert untouched(pair.decode, d_id)
        # The pipeline goes on.
        p2, d2 = legs(pair, "r6b")
        pair.pump(lambda: d2 in pair.received and p2 in pair.sent)
        assert pair.received[d2] is None and pair.sent[p2] is None
        assert_landed(pair.decode, d2)
        assert_clean(pair)


def test_07_write_ends_in_err() -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        rule = pair.fabric.faults.err_transfer(times=1)
        p_id, d_id = legs(pair, "r7")
        elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
        assert rule.hits == 1
        assert elapsed < 5.0
        assert "ERR" in (pair.sent[p_id] or "")
        assert "ERR" in (pair.received[d_id] or "")
        assert pair.fabric.stats.transfers_err == 1
        assert stat(pair.prefill, "write.failed") == 1
        assert stat(pair.prefill, "push.pushed") == 0
        assert stat(pair.decode, "recv.finished") == 0
        assert pair.fabric.get(P_AGENT).live_handles == 0  # the handle was released
        assert untouched(pair.decode, d_id)
        p2, d2 = legs(pair, "r7b")
        pair.pump(lambda: d2 in pair.received and p2 in pair.sent)
        assert pair.received[d2] is None and pair.sent[p2] is None
        assert_landed(pair.decode, d2)
        assert_clean(pair)


def test_08_one_of_several_writes_fails_failure_reported_after_all_settle(events: EventCapture) -> None:
    """P TP=1 → D TP=2: one P rank writes two D ranks. The WRITE to D rank 1 ends in ERR while
    the one to D rank 0 is held: P reports (and frees) only once the held one settled."""
    with make_pair(p_tp=1, d_tp=2, registration_timeout=30.0, lease_duration=30.0) as pair:
        pair.fabric.faults.err_transfer(match=is_write_to(agent("decode", 1)))
        gate = pair.fabric.faults.hold_transfer(match=is_write_to(agent("decode", 0)))
        p_id, d_id = legs(pair, "r8")
        pair.pump(
            lambda: (
                pair.fabric.stats.transfers_err == 1
                and posted(pair) == 2
                and stat(pair.decode, "recv.failed", rank=1) == 1
            ),
            what="the ERR WRITE to settle and D rank 1 to hear it",
        )
        for _ in range(5):
            pair.step()
        assert p_id not in pair.sent, "P reported while a sibling WRITE is still in flight"
        assert pair.prefill.held, "P freed blocks a WRITE is still reading"
        assert actor(pair.prefill, "writer").sizes()["in_flight"] == 1
        assert d_id not in pair.received  # D rank 0 still waits
        gate.open()
        pair.pump(lambda: p_id in pair.sent and d_id in pair.received, what="the held WRITE to settle")
        assert "ERR" in (pair.sent[p_id] or "")
        assert "ERR" in (pair.received[d_id] or "")
        checked, wrong, _ = rank_bytes(pair.decode, d_id, 0)
        assert checked > 0 and wrong == 0  # the held WRITE landed whole
        assert rank_bytes(pair.decode, d_id, 1)[2] == 0  # the ERR one wrote nothing
        fin = [e for e in events.named("push.finished") if e.get("request_id") == p_id]
        assert len(fin) == 1 and fin[0]["outcome"] == "failed"
        assert_clean(pair)


@pytest.mark.parametrize("p_answers", [True, False], ids=["p_answers_abort", "p_silent"])
def test_09_lost_completion_is_failed_by_d_watchdog(p_answers: bool, events: EventCapture) -> None:
    """The WRITE landed but its completion was lost. D's watchdog fails the request: at once when
    P answers the watchdog's abort ("already pushed"), else when the quarantine ends."""
    quarantine = 3.0 if p_answers else 0.4
    with make_pair(registration_timeout=1.0, abort_quarantine=quarantine, lease_duration=30.0) as pair:
        p_id, d_id = "r9-aaaaaaaa", "r9-bbbbbbbb"
        dropped = pair.fabric.faults.drop_notif(match=lambda c: c.notif == encode_completion(d_id, 1))
        if not p_answers:
            pair.fabric.faults.drop_notif(match=lambda c: c.notif.startswith(ABORT_PREFIX), times=None)
        params = pair.prefill.prefill(p_id, TOKENS, key="r9")
        pair.decode.expect(d_id, TOKENS, params, key="r9")
        elapsed = timed_pump(pair, lambda: d_id in pair.received and p_id in pair.sent, what="both legs to end")
        assert dropped.hits == 1
        assert pair.sent[p_id] is None  # P's WRITE did succeed
        assert "registration timeout" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.timed_out") == 1
        if p_answers:
            assert events.where(event="abort.answered", actor="writer", rank="prefill/pp0/tp0")
            assert 0.9 <= elapsed < 1.0 + quarantine - 1.0, "P's answer did not end the quarantine"
        else:
            assert events.named("recv.quarantine_ended")
            assert elapsed >= 1.0 + quarantine - 0.05
        assert posted(pair) == 1
        assert_clean(pair)


def test_10_duplicate_completion_is_counted_once(events: EventCapture) -> None:
    """P TP=2 → D TP=1: D waits for two completions. Rank 0's arrives twice while rank 1's
    WRITE is held; D must not count the copy as rank 1's and finish early."""
    with make_pair(p_tp=2, d_tp=1, registration_timeout=30.0, lease_duration=30.0) as pair:
        p_id, d_id = "r10-aaaaaaaa", "r10-bbbbbbbb"
        dup = pair.fabric.faults.duplicate_notif(
            match=lambda c: c.src == agent("prefill", 0) and c.notif == encode_completion(d_id, 2)
        )
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(agent("prefill", 1)))
        params = pair.prefill.prefill(p_id, TOKENS, key="r10")
        pair.decode.expect(d_id, TOKENS, params, key="r10")
        pair.pump(lambda: stat(pair.decode, "reaper.duplicate_notif") == 1, what="the duplicate to be seen")
        assert dup.hits == 1
        for _ in range(5):
            pair.step()
        assert d_id not in pair.received, "D finished with only one P rank's slice written"
        assert rank_bytes(pair.decode, d_id, 0, 1024, 2048)[2] == 0  # rank 1's slice not there yet
        gate.open()
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert events.where(event="notif.duplicate", request_id=d_id)
        assert_clean(pair)


def test_11_duplicate_push_reg_gives_one_write() -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        dup = pair.fabric.faults.duplicate_notif(match=lambda c: c.notif.startswith(PUSH_REG_PREFIX))
        p_id, d_id = "r11-aaaaaaaa", "r11-bbbbbbbb"
        params = pair.prefill.prefill(p_id, TOKENS, key="r11")
        pair.prefill.step()
        pair.decode.expect(d_id, TOKENS, params, key="r11")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert dup.hits == 1
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert stat(pair.prefill, "matcher.duplicate_registration") == 1
        assert stat(pair.prefill, "write.posted") == 1
        assert posted(pair) == 1
        assert_clean(pair)


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
            pair.fabric.faults.drop_notif(match=lambda c: c.notif.startswith(HEARTBEAT_PREFIX), times=None)
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


# =============================================================================================
# 18–20: aborts
# =============================================================================================
@pytest.mark.parametrize("when", ["before_meta", "parked_on_handshake"])
def test_18_d_abort_before_registration_went_out(when: str, events: EventCapture) -> None:
    with make_pair(registration_timeout=30.0, handshake_timeout=5.0) as pair:
        d_id = "r18-bbbbbbbb"
        params = pair.prefill.scheduler.decode_params("r18-aaaaaaaa")
        slow = 1.5
        if when == "parked_on_handshake":
            pair.directory.delays[addr(pair.p_endpoint)] = slow
        pair.decode.expect(d_id, TOKENS, params, key="r18")
        t0 = time.monotonic()
        if when == "parked_on_handshake":
            pair.decode.step()  # the registration reaches D's writer and parks on the handshake
            wait_until(lambda: actor(pair.decode, "writer").sizes()["awaiting"] == 1, what="the parked registration")
        assert pair.decode.scheduler.abort_recv(d_id)
        pair.pump(lambda: d_id in pair.received, what="D to report the aborted request")
        elapsed = time.monotonic() - t0
        assert pair.received[d_id] is not None
        if when == "before_meta":
            assert "aborted before registration" in (pair.received[d_id] or "")
            assert not pair.directory.fetches  # nothing was ever sent or fetched
        else:
            assert "aborted" in (pair.received[d_id] or "")
            assert elapsed < slow, "D waited for the handshake to report the abort"
            # The handshake completes later: nothing is left to replay, nothing is sent.
            pair.pump(
                lambda: bool(events.where(event="handshake.applied", rank="decode/pp0/tp0")),
                what="the slow handshake to complete",
            )
            assert events.where(event="handshake.applied", rank="decode/pp0/tp0")[0]["replayed"] == 0
        assert pair.fabric.stats.notifs_sent == 0, "a PUSH_REG (or anything) was sent for an aborted request"
        assert stat(pair.prefill, "notif.received") == 0
        assert posted(pair) == 0
        assert_clean(pair)


@pytest.mark.parametrize("write", ["settles_first", "outlives_quarantine"])
def test_19_d_abort_after_registration_quarantines_until_write_settled(write: str, events: EventCapture) -> None:
    """D aborts while P's WRITE into its blocks is in flight (held). D must not report (release)
    the blocks until that WRITE settled or P confirmed it will not write (SPEC §7).

    settles_first: the WRITE is released before the quarantine bound. outlives_quarantine: it is
    stuck longer than D's quarantine while P is alive and knows it is in flight: P must cancel it
    when the abort arrives and answer D."""
    quarantine = 3.0 if write == "settles_first" else 0.4
    with make_pair(
        registration_timeout=30.0, lease_duration=30.0, abort_quarantine=quarantine, write_timeout=1.5
    ) as pair:
        gate = pair.fabric.faults.hold_transfer()
        p_id, d_id = legs(pair, "r19")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE to be posted")
        released_in_flight: list[int] = []

        def reported() -> bool:
            """Also records whether D reported while the WRITE into its blocks could still land."""
            if d_id in pair.received and not released_in_flight:
                released_in_flight.append(pair.fabric.in_flight())
            return d_id in pair.received

        assert pair.decode.scheduler.abort_recv(d_id)
        t_abort = time.monotonic()
        pair.pump(
            lambda: reported() or bool(events.where(msg="cancel_push", rank="prefill/pp0/tp0")),
            what="P to see the abort",
        )
        for _ in range(5):
            reported()
            pair.step()
        if write == "settles_first":
            if pair.fabric.in_flight():
                assert not reported(), "D released blocks a WRITE may still land in"
            gate.open()
            t_open = time.monotonic()
            pair.pump(lambda: reported() and p_id in pair.sent, what="the WRITE to settle")
            assert time.monotonic() - t_open < 1.0
            assert time.monotonic() - t_abort < quarantine, "released by the quarantine bound, not by the settle"
        else:
            pair.pump(reported, what="D to report the aborted request")
            gate.open()
            pair.fabric.progress()
            pair.pump(lambda: p_id in pair.sent, what="P to settle")
        assert "aborted" in (pair.received[d_id] or "")
        assert released_in_flight == [0], "D released its blocks while P's WRITE into them was still in flight"
        if pair.sent[p_id] is not None:  # the WRITE was cancelled: nothing may have landed
            assert untouched(pair.decode, d_id)
        assert_clean(pair)


@pytest.mark.parametrize("order", ["registered_first", "cancelled_first"])
def test_20_p_request_aborted_tells_d_at_once(order: str) -> None:
    with make_pair(registration_timeout=30.0) as pair:
        p_id, d_id = "r20-aaaaaaaa", "r20-bbbbbbbb"
        params = pair.prefill.scheduler.decode_params(p_id)
        matcher = actor(pair.prefill, "matcher")
        if order == "registered_first":
            pair.decode.expect(d_id, TOKENS, params, key="r20")
            pair.pump(lambda: matcher.sizes()["pending_registrations"] == 1, what="the registration to reach P")
            assert pair.prefill.scheduler.request_cancelled(p_id, {"do_remote_decode": True})
        else:
            assert pair.prefill.scheduler.request_cancelled(p_id, {"do_remote_decode": True})
            pair.prefill.step()
            wait_until(lambda: matcher.sizes()["tombstones"] >= 1, what="P to tombstone the request")
            pair.decode.expect(d_id, TOKENS, params, key="r20")
        elapsed = timed_pump(pair, lambda: d_id in pair.received, what="D to hear the push failure")
        assert elapsed < 5.0
        assert "aborted on P" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.timed_out") == 0
        assert matcher.sizes()["pending_registrations"] == 0
        assert posted(pair) == 0
        assert_clean(pair)


# =============================================================================================
# 23–24: engines and actors
# =============================================================================================
def test_23_engine_ttl_eviction_skips_engines_with_transfers_in_flight(events: EventCapture) -> None:
    ttl = 0.3
    with make_pair(engine_ttl=ttl, lease_duration=30.0, registration_timeout=30.0) as pair:
        d2 = extra_decode(pair, engine_ttl=ttl, lease_duration=30.0, registration_timeout=30.0)
        try:
            engines = [pair.prefill, pair.decode, d2]
            p_agent = pair.fabric.get(P_AGENT)
            gate = pair.fabric.faults.hold_transfer(match=is_write_to(D_AGENT))
            p1, d1 = legs(pair, "r23a")
            p2, d2_id = "r23b-aaaaaaaa", "r23b-cccccccc"
            d2.expect(d2_id, TOKENS, pair.prefill.prefill(p2, TOKENS, key="r23b"), key="r23b")
            pump_all(engines, lambda: d2_id in d2.received and posted(pair) == 2, what="D2's push and D's WRITE")
            assert d2.received[d2_id] is None
            assert_landed(d2, d2_id)
            assert set(p_agent.remote_agents) == {D_AGENT, agent("decode2")}
            pump_all(engines, lambda: agent("decode2") not in p_agent.remote_agents, what="idle D2 to be evicted")
            # A sweep after both engines were idle past the TTL keeps the one with a WRITE in flight.
            mark = time.time() + ttl + 0.05
            pump_all(
                engines,
                lambda: any(
                    e["ts"] > mark
                    for e in events.where(actor="writer", rank="prefill/pp0/tp0")
                    if e.get("event") in ("engines.kept", "engines.evicted")
                ),
                what="a later eviction sweep",
            )
            assert D_AGENT in p_agent.remote_agents, "evicted an engine with a transfer in flight"
            assert p1 not in pair.sent and d1 not in pair.received
            gate.open()
            pump_all(engines, lambda: p1 in pair.sent and d1 in pair.received)
            assert pair.sent[p1] is None and pair.received[d1] is None
            assert_landed(pair.decode, d1)
            # Now idle too: cleaned up on both sides.
            pump_all(engines, lambda: not p_agent.remote_agents, what="D to be evicted once idle")
            pump_all(engines, lambda: not pair.fabric.get(agent("decode2")).remote_agents, what="D2 to evict idle P")
            assert any("decode2/pp0/tp0" in e.get("evicted", []) for e in events.named("engines.evicted"))
            assert_clean(pair, d2)
        finally:
            d2.shutdown()


class _Kill:
    """A message only these tests send: its handler kills the actor."""

    request_id = None


def _killer(self: Any, message: Any, note: Any) -> None:
    raise ActorKilled("injected by test_24")


ACTORS = {"writer": Writer, "matcher": Matcher, "reaper": Reaper, "handshake": Handshake}


@pytest.mark.parametrize(
    ("side", "name"),
    [
        ("prefill", "writer"),
        ("prefill", "matcher"),
        ("prefill", "reaper"),
        ("prefill", "handshake"),
        ("decode", "reaper"),
        ("decode", "writer"),
    ],
)
def test_24_actor_crash_fails_its_requests_and_marks_the_rank_unhealthy(
    side: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(ACTORS[name]._handlers, _Kill, _killer)
    with make_pair(registration_timeout=1.0, abort_quarantine=0.4, lease_duration=30.0) as pair:
        engine = getattr(pair, side)
        worker = engine.workers[0]
        waiting = "r24w-bbbbbbbb"  # D waits for a prefill that never ends
        pair.decode.expect(waiting, TOKENS, pair.prefill.scheduler.decode_params("r24w-aaaaaaaa"), key="w")
        if side == "prefill":
            gate = pair.fabric.faults.hold_transfer()
            a_p, a_d = legs(pair, "r24a")  # its WRITE stays in flight
            b_p = "r24b-aaaaaaaa"  # finished, never registered
            pair.prefill.prefill(b_p, TOKENS, key="r24b")
            pair.pump(lambda: posted(pair) == 1, what="A's WRITE to be posted")
        else:
            pair.pump(
                lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1,
                what="D's registration to reach P",
            )
        worker.runtime.refs[name].tell(_Kill())
        wait_until(lambda: not worker.healthy, timeout=5, what="the supervisor to notice")
        assert f"{name} actor died" in (worker.unhealthy_reason or "")
        if side == "prefill":
            pair.pump(lambda: a_p in pair.sent and b_p in pair.sent, what="P's requests to be failed")
            assert all(f"{name} actor died" in (pair.sent[r] or "") for r in (a_p, b_p))
            assert not pair.prefill.held
            assert pair.fabric.in_flight() == 0, "the rank's WRITE kept running after it was failed"
            # D is bounded by its watchdog and quarantine: P cannot answer any more.
            pair.pump(lambda: a_d in pair.received and waiting in pair.received, what="D's watchdog")
            assert "registration timeout" in (pair.received[a_d] or "")
            gate.open()
            pair.fabric.progress()
            assert pair.fabric.stats.transfers_done == 0
            assert untouched(pair.decode, a_d)
            late = "r24c-aaaaaaaa"
            pair.prefill.prefill(late, TOKENS, key="late")
            pair.pump(lambda: late in pair.sent, timeout=5, what="new work on the dead rank to fail")
            assert "actor died" in (pair.sent[late] or "")
        else:
            pair.pump(lambda: waiting in pair.received, timeout=5, what="D's request to be failed")
            assert f"{name} actor died" in (pair.received[waiting] or "")
            late = "r24c-bbbbbbbb"
            pair.decode.expect(late, TOKENS, pair.prefill.scheduler.decode_params("r24c-aaaaaaaa"), key="late")
            pair.pump(lambda: late in pair.received, timeout=5, what="new work on the dead rank to fail")
            assert "actor died" in (pair.received[late] or "")
        assert stat(engine, "rank.actor_died") == 1
        other = pair.decode if side == "prefill" else pair.prefill
        assert other.workers[0].healthy
        assert_clean(pair)


# =============================================================================================
# 25–29: input validation and security
# =============================================================================================
def test_25_notification_for_an_unknown_request_is_ignored_and_counted(events: EventCapture) -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        d_agent = pair.fabric.get(D_AGENT)
        d_agent.inject_notif(P_AGENT, encode_completion("ghost-bbbbbbbb", 1))
        d_agent.inject_notif(P_AGENT, encode_push_failure(PushFailure(request_id="ghost2-bbbbbbbb", reason="x")))
        pair.fabric.get(P_AGENT).inject_notif(D_AGENT, encode_completion("ghost3-bbbbbbbb", 1))
        pair.pump(
            lambda: (
                stat(pair.decode, "reaper.notif_unknown_request") == 2
                and stat(pair.prefill, "reaper.notif_unknown_request") == 1
            ),
            what="the unknown notifications to be seen",
        )
        assert not pair.received and not pair.sent
        p_id, d_id = legs(pair, "r25")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        # A completion replayed after the request was reported is unknown too: no second report.
        d_agent.inject_notif(P_AGENT, encode_completion(d_id, 1))
        pair.pump(lambda: stat(pair.decode, "reaper.notif_unknown_request") == 3, what="the replay to be seen")
        assert stat(pair.decode, "recv.finished") == 1
        assert stat(pair.decode, "recv.failed") == 0
        assert len(events.named("notif.ignored")) == 4
        assert all(w.healthy for e in (pair.prefill, pair.decode) for w in e.workers)
        assert_clean(pair)


MALFORMED = [
    # PUSH_REG
    PUSH_REG_PREFIX + b"\xc1\xc1",
    PUSH_REG_PREFIX + msgspec.msgpack.encode([1, 2, 3]),
    raw_registration(request_id=None),
    raw_registration(request_id=7),
    raw_registration(local_block_ids=[1, -2]),
    raw_registration(local_block_ids=[[1], 2]),
    raw_registration(decode_tp_rank=3),
    # completion
    b"no-separator",
    b"rid:zero",
    b"rid:0",
    b":1",
    b"\xff\xfe:1",
    b"a\x01b:1",
    # heartbeat
    HEARTBEAT_PREFIX,
    HEARTBEAT_PREFIX + b",,,",
    HEARTBEAT_PREFIX + b"\xff",
    # push failure
    PUSH_FAIL_PREFIX + b"\xc1",
    PUSH_FAIL_PREFIX + msgspec.msgpack.encode({"type": "push_fail"}),
    PUSH_FAIL_PREFIX + msgspec.msgpack.encode({"type": "push_fail", "request_id": "a,b"}),
    # abort
    ABORT_PREFIX,
    ABORT_PREFIX + msgspec.msgpack.encode({"type": "push_abort", "request_id": ""}),
    ABORT_PREFIX + msgspec.msgpack.encode({"type": "push_abort", "request_id": "x", "decode_tp_rank": -1}),
    # garbage
    b"",
    b"\x00\x01\x02\x03",
    bytes(range(256)),
]


def test_26_malformed_notifications_of_every_kind_are_counted_and_dropped() -> None:
    for raw in MALFORMED:
        with pytest.raises(MalformedMessage):
            decode_notification(raw)
    kinds: dict[str, int] = {}
    for raw in MALFORMED:
        kinds[notification_kind(raw)] = kinds.get(notification_kind(raw), 0) + 1
    assert set(kinds) == {"push_reg", "completion", "heartbeat", "push_fail", "push_abort"}
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        targets = [(pair.prefill, P_AGENT, D_AGENT), (pair.decode, D_AGENT, P_AGENT)]
        for _, name, peer in targets:
            for i, raw in enumerate(MALFORMED):
                pair.fabric.get(name).inject_notif(peer if i % 2 else "stranger-pp0-tp0", raw)
        # D is decode-only: it drops every PUSH_REG unread (reg.not_producer), malformed or not.
        want = {P_AGENT: len(MALFORMED), D_AGENT: len(MALFORMED) - kinds["push_reg"]}
        pair.pump(
            lambda: all(stat(e, "notif.malformed") == want[name] for e, name, _ in targets),
            what="every malformed notification to be dropped",
        )
        assert stat(pair.decode, "reg.not_producer") == kinds["push_reg"]
        for engine, name, _ in targets:
            for kind, n in kinds.items():
                if kind == "push_reg" and name == D_AGENT:
                    continue
                assert stat(engine, f"notif.malformed.{kind}") == n, (engine.config.engine_id, kind)
            for a in ("writer", "matcher", "reaper", "handshake"):
                assert stat(engine, f"{a}.handler_error") == 0
            assert engine.workers[0].healthy
        assert not pair.sent and not pair.received
        assert posted(pair) == 0
        # The pipeline keeps working.
        p_id, d_id = legs(pair, "r26")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert_clean(pair)


def test_27_block_ids_beyond_d_capacity_are_refused_without_a_write(events: EventCapture) -> None:
    with make_pair(registration_timeout=30.0) as pair:
        p_id, d_id = "r27-aaaaaaaa", "r27-bbbbbbbb"
        params = pair.prefill.prefill(p_id, TOKENS, key="r27")
        capacity = pair.decode.spec.num_blocks
        # D's own staging refuses ids its memory does not have: the request fails at once with
        # a clear reason, and no registration leaves D.
        pair.decode.scheduler.stage_registration(d_id, [capacity - 2, capacity - 1, capacity], params)
        elapsed = timed_pump(pair, lambda: d_id in pair.received, what="D to refuse the staging")
        assert elapsed < 5.0
        assert "beyond" in (pair.received[d_id] or "")
        assert stat(pair.decode, "notif.kind.push_reg") == 0
        # A D that registers such ids anyway (its verified agent) is refused by P, which
        # checks them against what D advertised, and never plans the WRITE.
        good = "r27-cccccccc"
        pair.decode.expect(good, TOKENS, params, key="r27")
        pump_all([pair.prefill, pair.decode], lambda: good in pair.received, what="the good request")
        assert pair.received[good] is None
        assert_landed(pair.decode, good)
        over = Registration(
            request_id="r27-dddddddd",
            decode_engine_id="decode",
            decode_host=pair.d_endpoint.host,
            decode_port=pair.d_endpoint.port,
            decode_tp_size=1,
            local_block_ids=(capacity - 1, capacity),
            remote_engine_id="prefill",
            remote_host=pair.p_endpoint.host,
            remote_port=pair.p_endpoint.port,
            remote_tp_size=1,
        )
        pair.fabric.get(P_AGENT).inject_notif(D_AGENT, encode_registration(over))
        wait_until(lambda: stat(pair.prefill, "reg.over_capacity") == 1, what="P to refuse the registration")
        assert any("capacity" in str(e.get("reason")) for e in events.where(request_id="r27-dddddddd"))
        assert actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 0
        assert posted(pair) == 1
        assert pair.fabric.get(P_AGENT).calls["make_prepped_xfer"] == 1
        assert_clean(pair)


def test_28_push_reg_from_an_agent_of_another_engine_is_refused(events: EventCapture) -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        p_id, d_id = "r28-aaaaaaaa", "r28-bbbbbbbb"
        params = pair.prefill.prefill(p_id, TOKENS, key="r28")
        pair.prefill.step()
        rec = pair.decode.expect(d_id, TOKENS, params, key="r28")
        # Another engine's agent claims to be D's rank 0 and aims P's KV at D's blocks.
        forged = Registration(
            request_id="forged-bbbbbbbb",
            decode_engine_id="decode",
            decode_host=pair.d_endpoint.host,
            decode_port=pair.d_endpoint.port,
            decode_tp_size=1,
            local_block_ids=tuple(rec.blocks),
            remote_engine_id="prefill",
            remote_host=pair.p_endpoint.host,
            remote_port=pair.p_endpoint.port,
            remote_tp_size=1,
            remote_request_id=p_id,
        )
        pair.fabric.get(P_AGENT).inject_notif(agent("decode2"), encode_registration(forged))
        wait_until(lambda: stat(pair.prefill, "reg.rejected_sender") == 1, what="the forged registration")
        assert not [e for e in events.where(request_id="forged-bbbbbbbb") if e.get("actor") == "matcher"], (
            "the forged registration reached the matcher"
        )
        assert actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 0
        assert posted(pair) == 0
        assert p_id not in pair.sent
        # The legitimate registration still works.
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert posted(pair) == 1
        assert stat(pair.prefill, "reg.rejected_sender") == 1
        assert_clean(pair)


P_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill",
    "remote_host": "prefill-host",
    "remote_port": 20000,
    "remote_tp_size": 1,
}

BAD_PARAMS: list[tuple[object, str]] = [
    ({"do_remote_prefill": True}, "remote_engine_id"),
    ({**P_PARAMS, "remote_engine_id": None}, "remote_engine_id"),
    ({**P_PARAMS, "remote_port": "http"}, "remote_port"),
    ({**P_PARAMS, "remote_port": 70000}, "remote_port"),
    ({**P_PARAMS, "remote_tp_size": 0}, "remote_tp_size"),
    ({**P_PARAMS, "remote_engine_id": 5}, "remote_engine_id"),
    ({**P_PARAMS, "transfer_id": "a,b"}, "transfer_id"),
    ({**P_PARAMS, "do_remote_prefill": False}, "remote prefill"),
    ("not a mapping", "kv_transfer_params"),
    (None, "kv_transfer_params"),
]


def test_29_malformed_kv_transfer_params_fail_that_request_only() -> None:
    with make_pair(d_tp=2, registration_timeout=30.0, lease_duration=30.0) as pair:
        sched = pair.decode.scheduler
        for i, (params, field) in enumerate(BAD_PARAMS):
            with pytest.raises(ValueError, match=field):
                sched.stage_registration(f"bad{i}-bbbbbbbb", [1, 2], params)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="transfer_id"):
            pair.prefill.scheduler.request_finished("badp-aaaaaaaa", [1], {"do_remote_decode": True, "transfer_id": 7})
        assert pair.decode.scheduler.build_connector_meta().empty  # nothing was staged
        # The vLLM-style path: the connector rejects the request; every D rank reports it failed.
        d_id = "r29-bbbbbbbb"
        try:
            sched.stage_registration(d_id, [1, 2], {**P_PARAMS, "remote_port": "http"})
        except ValueError as exc:
            sched.reject_recv(d_id, str(exc))
        pair.pump(lambda: d_id in pair.received, what="the rejected request to be reported")
        assert "remote_port" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.failed") == 0  # reported by the workers without touching the actors
        assert not pair.decode.has_pending_push_work()
        # The engine keeps running.
        p_id, ok = legs(pair, "r29ok")
        pair.pump(lambda: ok in pair.received and p_id in pair.sent)
        assert pair.received[ok] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, ok)
        assert posted(pair) == 2  # one WRITE per D rank of the good request only
        assert_clean(pair)


# =============================================================================================
# 30–32: clocks, shutdown, slow handshakes
# =============================================================================================
@pytest.mark.parametrize("case", ["scheduler_ahead_1000s", "scheduler_behind_1000s", "peer_clock_shifted"])
def test_30_clock_offset_between_processes(case: str, events: EventCapture) -> None:
    if case == "peer_clock_shifted":
        shift = 500.0
        with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
            pair.directory.tamper[addr(pair.p_endpoint)] = shifted_clock(shift)
            p_id, d_id = legs(pair, "r30")
            pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
            assert pair.received[d_id] is None and pair.sent[p_id] is None
            assert_landed(pair.decode, d_id)
            to_p = events.where(event="handshake.completed", rank="decode/pp0/tp0", peer="prefill/pp0/tp0")
            to_d = events.where(event="handshake.completed", rank="prefill/pp0/tp0", peer="decode/pp0/tp0")
            assert len(to_p) == 1 and len(to_d) == 1
            assert abs(to_p[0]["clock_offset_ms"] - shift * 1e3) < 200  # the peer runs 500 s ahead
            assert abs(to_d[0]["clock_offset_ms"]) < 200  # same process: no offset
            assert_clean(pair)
        return
    offset = 1000.0 if case == "scheduler_ahead_1000s" else -1000.0
    lease, reg_timeout = 0.6, 1.0
    with make_pair(lease_duration=lease, registration_timeout=reg_timeout, abort_quarantine=3.0) as pair:
        for engine in (pair.prefill, pair.decode):
            old = engine.scheduler
            engine.scheduler = PushScheduler(
                engine.config,
                side_channel_host=old.host,
                side_channel_port=old.port,
                tp_size=old.tp_size,
                clock=lambda: time.monotonic() + offset,
            )
        p_id, d_id = "r30-aaaaaaaa", "r30x-bbbbbbbb"  # different base ids: they never pair
        pair.prefill.prefill(p_id, TOKENS, key="r30")
        pair.decode.expect(d_id, TOKENS, pair.prefill.scheduler.decode_params("r30x-aaaaaaaa"), key="r30x")
        t0 = time.monotonic()
        pair.pump(lambda: p_id in pair.sent, what="P's lease to expire on the worker's clock")
        p_elapsed = time.monotonic() - t0
        pair.pump(lambda: d_id in pair.received, what="D's watchdog on the worker's clock")
        d_elapsed = time.monotonic() - t0
        assert lease * 0.8 <= p_elapsed < lease + 1.5, f"lease expired after {p_elapsed:.2f}s"
        assert "lease" in (pair.sent[p_id] or "")
        assert reg_timeout * 0.8 <= d_elapsed < reg_timeout + 1.5, f"watchdog fired after {d_elapsed:.2f}s"
        assert "registration timeout" in (pair.received[d_id] or "")
        assert_clean(pair)


def test_31_shutdown_with_transfers_in_flight_is_bounded_and_fails_them() -> None:
    with make_pair(registration_timeout=30.0, lease_duration=30.0) as pair:
        gate = pair.fabric.faults.hold_transfer()  # never opened before shutdown
        ids = [legs(pair, f"r31-{i}") for i in range(3)]
        pair.pump(lambda: posted(pair) == 3, what="three WRITEs in flight")
        waiting = "r31w-bbbbbbbb"
        pair.decode.expect(waiting, TOKENS, pair.prefill.scheduler.decode_params("r31w-aaaaaaaa"), key="w")
        pair.pump(lambda: actor(pair.decode, "reaper").sizes()["recvs"] == 4, what="D's fourth registration")
        timeout = 1.0
        t0 = time.monotonic()
        report = pair.prefill.workers[0].shutdown(timeout=timeout)
        elapsed = time.monotonic() - t0
        assert elapsed < timeout + 0.5, f"shutdown took {elapsed:.2f}s"
        p_ids = {p for p, _ in ids}
        assert p_ids <= set(report.finished_sending)
        assert all("shutdown" in report.failed_sending.get(p, "") for p in p_ids)
        pair.prefill.collect([report])
        assert not pair.prefill.held
        assert pair.fabric.in_flight() == 0
        assert pair.fabric.stats.transfers_cancelled == 3
        # P told D, which fails those requests at once; D's own shutdown fails what still waits.
        pair.pump(lambda: all(d in pair.received for _, d in ids), what="D to hear the cancellations")
        assert all("shutdown" in (pair.received[d] or "") for _, d in ids)
        t0 = time.monotonic()
        d_report = pair.decode.workers[0].shutdown(timeout=timeout)
        assert time.monotonic() - t0 < timeout + 0.5
        assert "shut down" in d_report.failed_recving.get(waiting, "")
        pair.decode.collect([d_report])
        gate.open()
        pair.fabric.progress()
        assert pair.fabric.stats.transfers_done == 0
        assert all(untouched(pair.decode, d) for _, d in ids)
        assert_clean(pair)


def test_32_one_slow_handshake_serves_many_requests_and_delays_no_other_engine(events: EventCapture) -> None:
    slow = 2.0
    with make_pair(lease_duration=15.0, registration_timeout=20.0, handshake_timeout=10.0) as pair:
        d2 = extra_decode(pair, lease_duration=15.0, registration_timeout=20.0)
        try:
            engines = [pair.prefill, pair.decode, d2]
            pair.directory.delays[addr(pair.d_endpoint)] = slow  # P's handshake with D is slow
            many = [legs(pair, f"r32-{i}") for i in range(30)]
            pump_all(
                engines,
                lambda: any(p.engine_id == "decode" for p, _ in pair.directory.fetches),
                what="P's slow fetch to start",
            )
            t0 = time.monotonic()
            others = []
            for i in range(5):
                p_id, d_id = f"r32o-{i}-aaaaaaaa", f"r32o-{i}-cccccccc"
                d2.expect(d_id, TOKENS, pair.prefill.prefill(p_id, TOKENS, key=f"o{i}"), key=f"o{i}")
                others.append((p_id, d_id))
            pump_all(engines, lambda: all(d in d2.received for _, d in others), what="D2's pushes")
            assert time.monotonic() - t0 < slow, "requests to another engine waited for the slow handshake"
            assert not any(d in pair.received for _, d in many)
            assert all(d2.received[d] is None for _, d in others)
            pump_all(engines, lambda: all(d in pair.received for _, d in many), timeout=20, what="the slow pushes")
            for p_id, d_id in many:
                assert pair.received[d_id] is None and pair.sent[p_id] is None
                assert_landed(pair.decode, d_id)
            for _, d_id in others:
                assert_landed(d2, d_id)
            to_d = [p for p, _ in pair.directory.fetches if p.engine_id == "decode"]
            assert len(to_d) == 1, f"{len(to_d)} fetches of the slow peer"
            applied = events.where(event="handshake.applied", rank="prefill/pp0/tp0", peer="decode/pp0/tp0")
            assert len(applied) == 1 and applied[0]["replayed"] == 30
            assert posted(pair) == 35
            assert_clean(pair, d2)
        finally:
            d2.shutdown()
