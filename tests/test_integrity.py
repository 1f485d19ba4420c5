"""Integrity: a request's KV lands only in that request's blocks, from the peers it names — or
the request fails visibly. One test per finding of the integrity review (fake fabric, real
actors); each failed on the code before the request registry and per-request peer binding.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from scenario_kit import (
    D_AGENT,
    P_AGENT,
    TOKENS,
    actor,
    agent,
    assert_clean,
    assert_landed,
    extra_decode,
    is_write_to,
    legs,
    make_pair,
    posted,
    pump_all,
    stat,
    timed_pump,
    untouched,
)

from pushactors.core.blocks import KVLayout
from pushactors.core.config import ConfigError, PushConfig
from pushactors.engine.scheduler import PushScheduler
from pushactors.engine.worker import PushWorker
from pushactors.logs import EventCapture
from pushactors.protocol import (
    MAX_DESCRIPTOR_ROWS,
    Abort,
    AbortRecv,
    BlocksFinished,
    CompatSpec,
    HandshakeError,
    PushFailure,
    RecvNotified,
    Registration,
    WatchRecv,
    check_request_id,
    compatibility_hash,
    decode_handshake,
    decode_notification,
    encode_abort,
    encode_completion,
    encode_heartbeat,
    encode_push_failure,
    encode_registration,
    registration_limit,
)
from pushactors.testing import Gate, PushPair, SimEngine, agent_info, wait_until

pytestmark = pytest.mark.timeout(90)

STRANGER = "mallory-pp0-tp0"


def is_write_from(src: str) -> Any:
    return lambda ctx: ctx.op == "WRITE" and ctx.src == src


def stranger_agent(pair: PushPair) -> Any:
    """A third agent on the fabric that knows P and D (as a process that fetched their metadata)."""
    mallory = pair.fabric.agent(STRANGER)
    for name in (P_AGENT, D_AGENT):
        mallory.add_remote_agent(pair.fabric.get(name).get_agent_metadata())
    return mallory


# ------------------------------------------------------------------------------------------------
# D accepts completions and push failures only from the P ranks a request registered with
# ------------------------------------------------------------------------------------------------
def test_a_strangers_completion_never_stands_in_for_a_p_ranks_slice() -> None:
    # P TP 2 -> D TP 1: each P rank writes half of every block. Rank 1's WRITE is held; rank 0's
    # completion plus a stranger's must not finish the request.
    with make_pair(p_tp=2, d_tp=1, lease_duration=30.0, registration_timeout=30.0) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(agent("prefill", 1)))
        mallory = stranger_agent(pair)
        p_id, d_id = legs(pair, "i01")
        pair.pump(lambda: posted(pair) == 2, what="both WRITEs posted")
        pair.pump(lambda: stat(pair.decode, "notif.kind.completion") >= 1, what="rank 0's completion")
        mallory.send_notif(D_AGENT, encode_completion(d_id, 2))
        mallory.send_notif(D_AGENT, encode_push_failure(PushFailure(request_id=d_id, reason="forged")))
        pair.pump(lambda: stat(pair.decode, "reaper.notif_wrong_sender") == 2, what="the forgeries dropped")
        assert d_id not in pair.received, "a stranger's completion finished the request"
        gate.open()
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None
        assert_landed(pair.decode, d_id)
        assert_clean(pair)


def test_a_forged_completion_while_the_write_is_held_lands_nothing_as_done() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        mallory = stranger_agent(pair)
        p_id, d_id = legs(pair, "i02")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE posted")
        mallory.send_notif(D_AGENT, encode_completion(d_id, 1))
        pair.pump(lambda: stat(pair.decode, "reaper.notif_wrong_sender") == 1, what="the forgery dropped")
        assert d_id not in pair.received
        assert untouched(pair.decode, d_id)  # and D did not report zero-filled blocks as landed
        gate.open()
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None
        assert_landed(pair.decode, d_id)
        assert_clean(pair)


# ------------------------------------------------------------------------------------------------
# P binds peers at registration, and only contacts trusted addresses
# ------------------------------------------------------------------------------------------------
def impostor(pair: PushPair, *, engine_id: str = "decode", metadata: bytes | None = None) -> tuple[Any, Any]:
    """A process claiming D's engine id at an address of its own, with its own agent and memory
    (``metadata``: the agent metadata its side channel hands out instead of its own)."""
    endpoint = pair.directory.endpoint("evil-host")
    evil = pair.fabric.agent("evil-agent")
    spec = pair.decode.spec
    shape = (2, spec.num_blocks, spec.block_bytes)
    kv = {f"layer.{i}": torch.zeros(shape, dtype=torch.uint8) for i in range(spec.num_layers)}
    layout = KVLayout.from_tensors(kv, block_size=spec.block_size, num_blocks=spec.num_blocks)
    evil.register_memory(np.array([(m.addr, m.length, m.device_id) for m in layout.memory], dtype=np.uint64), "DRAM")
    info = agent_info(engine_id, evil, layout)
    if metadata is not None:
        info = msgspec.structs.replace(info, agent_metadata=metadata)
    compat = compatibility_hash(CompatSpec(model="sim", dtype="uint8", kv_shape=(spec.block_bytes,)))
    endpoint.publish(info, compat)
    evil.add_remote_agent(pair.fabric.get(P_AGENT).get_agent_metadata())
    return evil, (endpoint, kv)


def reg_from(pair: PushPair, d_id: str, host: str, port: int, **changes: Any) -> Registration:
    fields: dict[str, Any] = dict(
        request_id=d_id,
        decode_engine_id="decode",
        decode_host=host,
        decode_port=port,
        decode_tp_size=1,
        local_block_ids=(1, 2, 3),
        remote_engine_id="prefill",
        remote_host=pair.p_endpoint.host,
        remote_port=pair.p_endpoint.port,
        remote_tp_size=1,
    )
    fields.update(changes)
    return Registration(**fields)


def test_a_registration_naming_ds_engine_at_another_address_never_displaces_the_real_d() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        evil, (endpoint, evil_kv) = impostor(pair)
        # The impostor registers first, for an id of its own, from its own (verified) agent.
        evil.send_notif(P_AGENT, encode_registration(reg_from(pair, "evil-1-bbbbbbbb", endpoint.host, endpoint.port)))
        wait_until(
            lambda: any(p.host == "evil-host" for p, _ in pair.directory.fetches), what="P to look the impostor up"
        )
        pair.pump(lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1, what="stored")
        # The real D's requests still go through, byte-exact, into D's memory only.
        for n in ("i03a", "i03b"):
            p_id, d_id = legs(pair, n, transfer_id=f"tx-{n}")
            pair.pump(lambda d_id=d_id, p_id=p_id: d_id in pair.received and p_id in pair.sent)
            assert pair.received[d_id] is None and pair.sent[p_id] is None
            assert_landed(pair.decode, d_id)
        assert stat(pair.prefill, "reg.rejected_sender") == 0
        assert all(int(t.count_nonzero()) == 0 for t in evil_kv.values()), "P wrote into the impostor"
        assert_clean(pair)


def test_trusted_peers_keep_p_from_contacting_any_other_address(events: EventCapture) -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0, trusted_peers=("decode-host",)) as pair:
        evil, (endpoint, _) = impostor(pair)
        evil.send_notif(P_AGENT, encode_registration(reg_from(pair, "evil-2-bbbbbbbb", endpoint.host, endpoint.port)))
        pair.pump(lambda: stat(pair.prefill, "reg.untrusted") == 1, what="the untrusted registration dropped")
        assert not any(p.host == "evil-host" for p, _ in pair.directory.fetches), "P contacted an untrusted address"
        assert events.named("reg.rejected")
        p_id, d_id = legs(pair, "i04")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None
        assert_landed(pair.decode, d_id)
        assert_clean(pair)


def test_config_trusts_engine_ids_and_networks() -> None:
    cfg = PushConfig(engine_id="p", trusted_peers=("decode-0", "10.1.0.0/16", "::1", "decode-host"))
    assert cfg.trusts("decode-0", "192.168.0.9")
    assert cfg.trusts("other", "10.1.200.3")
    assert cfg.trusts("other", "::1") and cfg.trusts("other", "[::1]")
    assert cfg.trusts("other", "decode-host")
    assert not cfg.trusts("other", "10.2.0.1")
    assert not cfg.trusts("other", "evil-host")
    assert PushConfig(engine_id="p").trusts("anyone", "anywhere")


# ------------------------------------------------------------------------------------------------
# Heartbeats and aborts: only from the D agent that registered; exact, never by base id
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sender", ["stranger", "d_itself"])
def test_an_abort_for_an_id_nobody_has_yet_kills_no_later_request(sender: str) -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        mallory = stranger_agent(pair)
        p_id, d_id = "i05-aaaaaaaa", "i05-bbbbbbbb"
        abort = Abort(request_id="i05-cccccccc", transfer_id=None, remote_request_id=p_id, reason="early")
        if sender == "stranger":
            mallory.send_notif(P_AGENT, encode_abort(abort))
            mallory.send_notif(P_AGENT, encode_abort(Abort(request_id=d_id, remote_request_id=p_id)))
            mallory.send_notif(P_AGENT, encode_heartbeat([p_id, d_id]))
        else:
            # A stale abort from D's own agent for a D id of an earlier request.
            pair.fabric.get(P_AGENT).inject_notif(D_AGENT, encode_abort(abort))
        pair.pump(lambda: stat(pair.prefill, "notif.kind.push_abort") >= 1, what="the abort arrived")
        params = pair.prefill.prefill(p_id, TOKENS, key="i05")
        pair.decode.expect(d_id, TOKENS, params, key="i05")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert_landed(pair.decode, d_id)
        assert_clean(pair)


def test_a_reused_id_is_not_failed_by_the_earlier_requests_tombstone() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        p1, d1 = legs(pair, "i06")
        pair.pump(lambda: d1 in pair.received and p1 in pair.sent)
        assert pair.received[d1] is None
        # The client sends the same id again: same base id, new engine suffixes, D's leg first.
        p2, d2 = "i06-cccccccc", "i06-dddddddd"
        params = pair.prefill.scheduler.decode_params("i06")
        pair.decode.expect(d2, TOKENS, params, key="i06-again")
        pair.pump(lambda: stat(pair.prefill, "notif.kind.push_reg") == 2, what="D's second registration")
        pair.prefill.prefill(p2, TOKENS, key="i06-again")
        pair.pump(lambda: d2 in pair.received and p2 in pair.sent)
        assert pair.received[d2] is None and pair.sent[p2] is None
        assert_landed(pair.decode, d2)
        assert_clean(pair)


# ------------------------------------------------------------------------------------------------
# Matching never guesses
# ------------------------------------------------------------------------------------------------
def test_two_live_p_requests_with_one_transfer_id_both_fail_and_nothing_lands() -> None:
    # What a router that derives transfer ids from a client header produces for a retry.
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        pa, pb, da, _db = "i07a-aaaaaaaa", "i07b-aaaaaaaa", "i07a-bbbbbbbb", "i07b-bbbbbbbb"
        params_a = pair.prefill.prefill(pa, TOKENS, key="i07a", transfer_id="tx-client-header")
        pair.prefill.prefill(pb, TOKENS, key="i07b", transfer_id="tx-client-header")
        pair.prefill.step()
        pair.decode.expect(da, TOKENS, params_a, key="i07a")
        pair.pump(lambda: pa in pair.sent and pb in pair.sent and da in pair.received)
        assert pair.sent[pa] and pair.sent[pb], "an ambiguous transfer id was pushed"
        assert "transfer id" in (pair.sent[pb] or "")
        assert pair.received[da] is not None
        assert posted(pair) == 0
        assert untouched(pair.decode, da)
        assert stat(pair.prefill, "matcher.ambiguous") >= 1
        assert_clean(pair)


def test_d_fails_both_requests_that_share_one_live_transfer_id() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        params = pair.prefill.scheduler.decode_params("i08", "tx-shared")
        pair.decode.expect("i08a-bbbbbbbb", TOKENS, params, key="i08a")
        pair.decode.step()
        pair.decode.expect("i08b-bbbbbbbb", TOKENS, params, key="i08b")
        pair.pump(lambda: {"i08a-bbbbbbbb", "i08b-bbbbbbbb"} <= set(pair.received), what="both to fail")
        assert all("transfer id" in (pair.received[d] or "") for d in ("i08a-bbbbbbbb", "i08b-bbbbbbbb"))
        assert posted(pair) == 0
        assert_clean(pair)


def test_an_ambiguous_base_id_fails_every_request_involved() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        # Two live P requests whose ids differ only in the engine suffix, no transfer ids, and
        # a D registration that names only the base: it could belong to either.
        pair.prefill.prefill("cmpl-i09-0-aaaaaaaa", TOKENS, key="a")
        pair.prefill.prefill("cmpl-i09-0-cccccccc", TOKENS, key="c")
        pair.prefill.step()
        params = pair.prefill.scheduler.decode_params("cmpl-i09-0")
        d_id = "cmpl-i09-0-bbbbbbbb"
        pair.decode.expect(d_id, TOKENS, params, key="a")
        pair.pump(
            lambda: d_id in pair.received and {"cmpl-i09-0-aaaaaaaa", "cmpl-i09-0-cccccccc"} <= set(pair.sent),
            what="every request involved to fail",
        )
        assert pair.received[d_id] and "live requests" in (pair.received[d_id] or "")
        assert pair.sent["cmpl-i09-0-aaaaaaaa"] and pair.sent["cmpl-i09-0-cccccccc"]
        assert posted(pair) == 0 and untouched(pair.decode, d_id)
        assert_clean(pair)


# ------------------------------------------------------------------------------------------------
# Registrations are exact
# ------------------------------------------------------------------------------------------------
@dataclass
class Restage:
    """A re-stage scenario: D's request staged on ``first``, P's WRITE into those blocks held
    in flight (``gate`` lets it go)."""

    pair: PushPair
    p_id: str
    d_id: str
    params: dict[str, Any]
    first: list[int]
    gate: Gate

    def stage_again(self) -> list[int]:
        """The engine stages the request again, on new blocks (P only ever heard of ``first``)."""
        second = self.pair.decode.allocate(3)
        self.pair.decode.scheduler.stage_registration(self.d_id, second, self.params)
        return second

    def assert_failed_once_and_second_untouched(self, second: list[int]) -> None:
        """Failed (never "landed" into blocks P did not write), reported once; P never wrote
        the second blocks. Then the engine frees both sets and nothing is left anywhere."""
        pair, d_id = self.pair, self.d_id
        assert "re-staged" in (pair.received[d_id] or "")
        assert stat(pair.decode, "recv.failed") == 1 and stat(pair.decode, "recv.finished") == 0
        assert sum(w.stats().get("report.duplicate", 0) for w in pair.decode.workers) == 0
        for layer in pair.decode.kv[0].values():
            assert int(layer[:, second].count_nonzero()) == 0
        pair.decode.release(self.first + second)
        assert_clean(pair)


@contextmanager
def write_in_flight(n: str) -> Iterator[Restage]:
    """Request ``n`` staged on D, P's WRITE into its first blocks posted and held."""
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        p_id, d_id = f"{n}-aaaaaaaa", f"{n}-bbbbbbbb"
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        params = pair.prefill.prefill(p_id, TOKENS, key=n)
        first = pair.decode.allocate(3)
        pair.decode.scheduler.stage_registration(d_id, first, params)
        pair.pump(lambda: posted(pair) == 1, what="the WRITE into the first blocks")
        yield Restage(pair, p_id, d_id, params, first, gate)


def test_a_restaged_request_with_new_blocks_fails_visibly_and_once() -> None:
    with write_in_flight("i10") as r:
        second = r.stage_again()
        r.pair.pump(lambda: stat(r.pair.decode, "recv.restaged") == 1, what="the re-stage seen")
        r.gate.open()
        r.pair.pump(lambda: r.d_id in r.pair.received and r.p_id in r.pair.sent)
        r.assert_failed_once_and_second_untouched(second)  # reported after P answered


def test_a_completion_is_never_taken_while_the_engines_re_stage_waits_in_the_reapers_mailbox() -> None:
    """The engine re-stages a request while P's WRITE into its first blocks is in flight, and
    the re-stage still waits in a busy reaper's mailbox when that WRITE lands. The writer's own
    take of the completion must not judge it on the registry the reaper has not brought up to
    date: the request's current blocks hold nothing of its KV, so it fails, never lands."""
    with write_in_flight("i10b") as r:
        pair, d_id = r.pair, r.d_id
        busy = pair.decode.workers[0].ctx.faults.hold_handler("reaper", WatchRecv, match=lambda m: m.request_id == d_id)
        second = r.stage_again()
        pair.decode.step()  # the re-stage is handed to the reaper, whose turn is held
        r.gate.open()
        pair.pump(lambda: stat(pair.decode, "notif.kind.completion") == 1, what="D's writer to read the completion")
        pair.pump(lambda: r.p_id in pair.sent, what="P's push to settle")
        assert d_id not in pair.received, "reported before the reaper applied the re-stage"
        busy.set()
        pair.pump(lambda: d_id in pair.received)
        assert stat(pair.decode, "recv.taken") == 0
        r.assert_failed_once_and_second_untouched(second)


def test_duplicated_block_ids_and_reserved_id_prefixes_are_refused_at_staging() -> None:
    sched = PushScheduler(PushConfig(engine_id="d"), side_channel_host="h", side_channel_port=1)
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h", "remote_port": 2,
              "remote_tp_size": 1}  # fmt: skip
    with pytest.raises(ValueError, match="duplicated"):
        sched.stage_registration("r-1", [4, 4, 5], params)
    for rid in ("HB:x", "PUSH_REG:x", "PUSH_FAIL:x", "PUSH_ABORT:x", "PUSH_DIGEST:x", "PAMAC1:x"):
        with pytest.raises(ValueError, match="cannot be sent"):
            sched.stage_registration(rid, [1], params)
        with pytest.raises(ValueError):
            check_request_id(rid)
    # Ids that merely contain such text are fine.
    assert check_request_id("cmpl-HB:x-0") == "cmpl-HB:x-0"
    # On the wire: a registration with duplicated ids or a reserved id does not decode.
    for bad in (dict(local_block_ids=[1, 1]), dict(request_id="HB:x")):
        fields = dict(type="push_reg", request_id="r", decode_engine_id="d", decode_host="h", decode_port=1,
                      decode_tp_size=1, local_block_ids=[1], remote_engine_id="p", remote_host="h",
                      remote_port=1, remote_tp_size=1)  # fmt: skip
        fields.update(bad)
        with pytest.raises(ValueError):
            decode_notification(b"PUSH_REG:" + msgspec.msgpack.encode(fields))


@pytest.mark.parametrize("reached_p", [True, False], ids=["first-leg-registered-at-p", "first-leg-lost"])
def test_a_decode_leg_sent_again_before_the_first_is_aborted_lands_after_that_abort(reached_p: bool) -> None:
    """A client (llm-d's sidecar, when P's answer names another identity) cancels D's leg and
    sends it again under the same transfer id; vLLM's abort of the first may come after the
    second. The second waits, unregistered, for the first to end; the first's abort reaches P
    before the second's registration, and P serves the second (the abort does not free P's
    blocks under it). Bytes land in the second's blocks only."""
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        params = pair.prefill.scheduler.decode_params("i12", "tx-again")
        if not reached_p:
            pair.fabric.faults.drop_notif(times=1)  # the first leg's registration is lost
        first, second, p_id = "i12a-bbbbbbbb", "i12b-bbbbbbbb", "i12-aaaaaaaa"
        pair.decode.expect(first, TOKENS, params, key="i12")
        if reached_p:
            pair.pump(lambda: stat(pair.prefill, "notif.kind.push_reg") == 1, what="the first leg's registration")
        else:
            pair.pump(lambda: pair.fabric.stats.notifs_dropped == 1, what="the first leg's registration lost")
        pair.decode.expect(second, TOKENS, params, key="i12")
        pair.pump(lambda: stat(pair.decode, "recv.deferred") == 1, what="the second leg to wait")
        assert stat(pair.prefill, "notif.kind.push_reg") == (1 if reached_p else 0)
        assert pair.decode.scheduler.abort_recv(first)
        pair.pump(lambda: stat(pair.prefill, "notif.kind.push_reg") == (2 if reached_p else 1), what="2nd reg.")
        pair.prefill.prefill(p_id, TOKENS, key="i12", transfer_id="tx-again")
        pair.pump(lambda: {first, second} <= set(pair.received) and p_id in pair.sent)
        assert pair.received[second] is None and pair.sent[p_id] is None
        assert pair.received[first] is not None
        assert_landed(pair.decode, second)
        assert untouched(pair.decode, first)
        assert_clean(pair)


# ------------------------------------------------------------------------------------------------
# Blocks are never reused under a live WRITE
# ------------------------------------------------------------------------------------------------
def test_an_aborted_requests_blocks_stay_held_past_the_quarantine_while_ps_write_may_still_land(
    events: EventCapture,
) -> None:
    """D aborts a request while P's WRITE into its blocks is in flight. P never releases that
    WRITE to cancel it (a release may not stop a copy already started): it tells D the WRITE may
    still land. D keeps the blocks past its quarantine, for as long as the WRITE runs, and
    reports the request failed once, after the WRITE settled."""
    quarantine = 0.3
    with make_pair(lease_duration=30.0, registration_timeout=30.0, abort_quarantine=quarantine) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        cancel = pair.fabric.faults.refuse_cancel(times=None)  # hit only if P tries to release it
        p_id, d_id = legs(pair, "i11")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE posted")
        aborted_at = time.monotonic()
        assert pair.decode.scheduler.abort_recv(d_id)
        pair.pump(lambda: stat(pair.decode, "recv.write_pinned") >= 1, what="P to say it may still land")
        # Well past the quarantine the blocks are still held: the WRITE may land any moment.
        pair.pump(lambda: stat(pair.decode, "recv.quarantine_held") >= 1, what="the quarantine to be held")
        pair.pump(lambda: time.monotonic() - aborted_at > 3 * quarantine, what="time to pass")
        assert d_id not in pair.received, "D released blocks a WRITE may still land in"
        gate.open()
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is not None  # aborted: failed, once, after the WRITE settled
        assert stat(pair.decode, "recv.failed") == 1
        assert cancel.hits == 0, "P released a WRITE in flight to cancel it"
        assert_clean(pair)


# ------------------------------------------------------------------------------------------------
# Containment and liveness
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("side", "actor_name", "message"),
    [("prefill", "matcher", BlocksFinished)],
)
def test_a_handler_that_raises_ends_its_request_at_once(side: str, actor_name: str, message: type) -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        engine = getattr(pair, side)
        engine.workers[0].ctx.faults.fail_handler(actor_name, message)
        start = time.monotonic()
        p_id, d_id = legs(pair, f"i12-{actor_name}")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent, timeout=10)
        assert time.monotonic() - start < 5.0, "waited for a lease or watchdog"
        assert pair.received[d_id] is not None  # failed visibly, not landed
        assert stat(engine, f"{actor_name}.handler_error") == 1
        assert_clean(pair)


def test_a_reaper_handler_that_raises_on_a_registration_fails_the_decode_request_at_once() -> None:
    """D's reaper fails while taking a registration: the D request fails at once (not by its
    watchdog), nothing is sent to P, whose lease then ends its side."""
    with make_pair(lease_duration=1.0, registration_timeout=30.0) as pair:
        pair.decode.workers[0].ctx.faults.fail_handler("reaper", WatchRecv)
        start = time.monotonic()
        p_id, d_id = legs(pair, "i12-reaper")
        pair.pump(lambda: d_id in pair.received, timeout=10)
        assert time.monotonic() - start < 5.0, "waited for the watchdog"
        assert pair.received[d_id] is not None  # failed visibly, not landed
        assert stat(pair.decode, "reaper.handler_error") == 1
        assert stat(pair.prefill, "notif.kind.push_reg") == 0
        pair.pump(lambda: p_id in pair.sent, timeout=10)
        assert untouched(pair.decode, d_id)
        assert_clean(pair)


def test_a_completion_the_writer_reported_stays_landed_when_the_reapers_handler_then_raises() -> None:
    """The writer reports a completion that lands its request on its own (core/claims.py) and
    tells the reaper; the reaper's handler of that message raising must not fail a request
    whose every byte landed, nor report it twice."""
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        pair.decode.workers[0].ctx.faults.fail_handler("reaper", RecvNotified)
        p_id, d_id = legs(pair, "i12-taken")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent, timeout=10)
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        assert stat(pair.decode, "recv.taken") == 1
        # The writer reported it first; the reaper's (failing) turn comes after.
        pair.pump(lambda: stat(pair.decode, "reaper.handler_error") == 1, what="the reaper's handler to raise")
        assert pair.received[d_id] is None
        assert_landed(pair.decode, d_id)
        assert_clean(pair)


def test_a_tick_that_keeps_failing_marks_the_rank_unhealthy_and_fails_what_it_holds() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0, max_tick_failures=5) as pair:
        p_id, _d_id = legs(pair, "i13")
        pair.prefill.workers[0].ctx.faults.fail_tick("writer", times=None)
        worker = pair.prefill.workers[0]
        pair.pump(lambda: not worker.healthy, what="the rank to turn unhealthy")
        pair.pump(lambda: p_id in pair.sent, what="P's request to fail")
        assert pair.sent[p_id] and "writer" in (pair.sent[p_id] or "")


def test_get_finished_never_blocks_and_reports_each_request_once() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0, abort_quarantine=0.3) as pair:
        _p_id, d_id = legs(pair, "i14")
        d_worker = pair.decode.workers[0]
        # The request lands; before the engine collects it, D's reaper dies. The death timer
        # must not report it again once the engine took the success.
        d_worker.start_load_kv(pair.decode.scheduler.build_connector_meta())  # D's step, not collected
        wait_until(lambda: (pair.prefill.step(), stat(pair.decode, "recv.finished") == 1)[1], what="landed")
        d_worker.ctx.faults.fail_handler("reaper", AbortRecv, kill=True)
        d_worker.runtime.reaper.tell(AbortRecv(request_id="nobody"))
        wait_until(lambda: not d_worker.runtime.reaper.is_alive(), what="the reaper to die")
        slowest = 0.0
        reports: list[Any] = []
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            reports.append(d_worker.get_finished())
            slowest = max(slowest, time.monotonic() - t0)
            pair.prefill.step()
        # Stopping a dead rank's actors takes seconds; none of it may run on the engine thread
        # (generous bound for a loaded CI box; it was ~5 s per actor before).
        assert slowest < 1.0, f"get_finished blocked for {slowest * 1e3:.1f} ms"
        landed = sum(d_id in r.finished_recving for r in reports)
        failed = sum(d_id in r.failed_recving for r in reports)
        assert landed + failed == 1, f"{d_id} reported {landed + failed} times"
        assert not d_worker.healthy
        assert d_worker.pending() == (0, 0)


# ------------------------------------------------------------------------------------------------
# Bounds
# ------------------------------------------------------------------------------------------------
def test_notification_sizes_are_bounded_before_decoding() -> None:
    limit = registration_limit(256)
    assert limit < 8 * 1024
    big = b"PUSH_REG:" + msgspec.msgpack.encode({"request_id": "x" * 10, "pad": "y" * limit})
    with pytest.raises(ValueError, match="over the limit"):
        decode_notification(big, registration_bytes=limit)
    with pytest.raises(ValueError, match="over the limit"):
        decode_notification(b"x" * 20000 + b":1")
    with make_pair(lease_duration=30.0) as pair:
        mallory = stranger_agent(pair)
        mallory.send_notif(P_AGENT, big)
        pair.pump(lambda: stat(pair.prefill, "notif.malformed.push_reg") == 1, what="the oversized PUSH_REG dropped")
        p_id, d_id = legs(pair, "i15")
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None


def test_an_agent_info_advertising_too_many_blocks_is_refused() -> None:
    region = dict(type="region", base_addr=4096, block_len=1, stride=1, num_blocks=MAX_DESCRIPTOR_ROWS + 1)
    info = dict(type="agent_info", engine_id="d", agent_name="a", agent_metadata=b"", mem_type="DRAM",
                tp_size=1, tp_rank=0, block_size=16, regions=[region],
                clock=dict(type="clock", monotonic=0.0, wall=0.0))  # fmt: skip
    raw = msgspec.msgpack.encode([1, "h", msgspec.msgpack.encode(info)])  # the versioned envelope
    with pytest.raises(HandshakeError, match="blocks advertised"):
        decode_handshake(raw, expected_hash="h", expected_engine=None)


def test_the_remote_agent_table_is_bounded_and_never_evicts_a_busy_peer() -> None:
    timing = {"lease_duration": 2.0, "max_remote_agents": 1}
    with make_pair(registration_timeout=30.0, **timing) as pair:
        d2 = extra_decode(pair, registration_timeout=3.0, **timing)
        try:
            engines = [pair.prefill, pair.decode, d2]
            gate = pair.fabric.faults.hold_transfer(match=lambda ctx: ctx.op == "WRITE" and ctx.dst == D_AGENT)
            p1, d1 = legs(pair, "i16a")
            pump_all(engines, lambda: posted(pair) == 1, what="D's WRITE in flight")
            p2, d2_id = "i16b-aaaaaaaa", "i16b-cccccccc"
            d2.expect(d2_id, TOKENS, pair.prefill.prefill(p2, TOKENS, key="i16b"), key="i16b")
            # The table is full with a busy peer: D2 cannot be verified (P's lease and D2's
            # watchdog end both legs), D is kept.
            pump_all(engines, lambda: d2_id in d2.received and p2 in pair.sent, what="D2 refused")
            assert stat(pair.prefill, "handshake.failed.capacity") >= 1
            assert pair.sent[p2] is not None
            gate.open()
            pump_all(engines, lambda: d1 in pair.received and p1 in pair.sent)
            assert pair.received[d1] is None
            assert_landed(pair.decode, d1)
            # Idle now: D2's next request evicts D and goes through.
            p3, d3 = "i16c-aaaaaaaa", "i16c-cccccccc"
            d2.expect(d3, TOKENS, pair.prefill.prefill(p3, TOKENS, key="i16c"), key="i16c")
            pump_all(engines, lambda: d3 in d2.received and p3 in pair.sent)
            assert d2.received[d3] is None
            assert stat(pair.prefill, "remote.evicted_for_room") >= 1
            assert_clean(pair, d2)
        finally:
            d2.shutdown()


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        {"lease_duration": -1.0},
        {"lease_duration": math.nan},
        {"write_timeout": math.inf},
        {"engine_id": ""},
        {"role": "prefill"},
        {"abort_quarantine": 1.0},  # below 2/3 lease + write_timeout
        {"heartbeat_interval": 25.0},  # leases would lapse between beats
        {"auth_keys": {"k": "short"}, "auth_key_id": "k"},
        {"auth_keys": {"k": "0123456789abcdef0123"}, "auth_key_id": "other"},
    ],
)
def test_push_config_validates_on_construction(bad: dict[str, Any]) -> None:
    fields = {"engine_id": "e", **bad}
    with pytest.raises(ConfigError):
        PushConfig(**fields)
    with pytest.raises(ConfigError):
        PushConfig.from_dict(fields)


def test_pipeline_parallelism_on_the_decode_side_is_refused_at_configuration() -> None:
    cfg = PushConfig(engine_id="d", role="consumer")
    with pytest.raises(ConfigError, match="decode side"):
        PushScheduler(cfg, side_channel_host="h", side_channel_port=1, pp_size=2)
    with pytest.raises(ConfigError, match="decode side"):
        PushWorker(cfg, agent_factory=None, source=None, publisher=None, pp_size=2)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# Authenticated control messages (opt-in)
# ------------------------------------------------------------------------------------------------
KEYS = {"auth_keys": {"k1": "0123456789abcdef0123"}, "auth_key_id": "k1"}


def test_with_auth_every_unsigned_or_forged_notification_is_dropped() -> None:
    with make_pair(lease_duration=30.0, registration_timeout=30.0, **KEYS) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        p_id, d_id = legs(pair, "i17")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE posted")
        # Impersonation NIXL cannot see: P's own agent name on an unsigned completion.
        pair.fabric.get(D_AGENT).inject_notif(P_AGENT, encode_completion(d_id, 1))
        pair.fabric.get(P_AGENT).inject_notif(D_AGENT, encode_abort(Abort(request_id=d_id)))
        pair.pump(
            lambda: (
                stat(pair.decode, "notif.unauthenticated") == 1 and stat(pair.prefill, "notif.unauthenticated") == 1
            ),
            what="both forgeries dropped",
        )
        assert d_id not in pair.received
        gate.open()
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent)
        assert pair.received[d_id] is None
        assert_landed(pair.decode, d_id)
        assert_clean(pair)


def test_an_engine_without_the_key_cannot_register() -> None:
    fabric_pair = PushPair(lease_duration=1.0, registration_timeout=30.0, allow_unsafe_quarantine=True,
                           abort_quarantine=0.4, reaper_tick=0.01)  # fmt: skip
    with fabric_pair as pair:
        # Re-create P with a key D does not have: D's registrations are unsigned to P.
        keyed = SimEngine(
            PushConfig(engine_id="prefill2", role="producer", lease_duration=1.0, **KEYS),
            agent_factory=pair.fabric,
            source=pair.directory,
            publisher_for_rank=lambda _r: pair.directory.endpoint("prefill2-host"),
            spec=pair.prefill.spec,
        )
        try:
            p_id, d_id = "i18-aaaaaaaa", "i18-bbbbbbbb"
            params = keyed.prefill(p_id, TOKENS, key="i18")
            pair.decode.expect(d_id, TOKENS, params, key="i18")
            pump_all([keyed, pair.decode], lambda: p_id in keyed.sent, what="P's lease to end it")
            assert keyed.sent[p_id] is not None
            assert sum(w.stats().get("notif.unauthenticated", 0) for w in keyed.workers) >= 1
            assert sum(w.stats().get("write.posted", 0) for w in keyed.workers) == 0
        finally:
            keyed.shutdown()


def test_a_registration_that_finds_ps_agent_gone_is_resent_to_its_next_incarnation() -> None:
    # D still holds the agent of a P that restarted (nothing was sent to it meanwhile): the first
    # send fails with NIXL's "remote disconnected". That registration never reached anyone, so D
    # asks P's side channel again and resends it, instead of failing the request (it did: HTTP 500).
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        p1, d1 = legs(pair, "i19a")
        pair.pump(lambda: d1 in pair.received and p1 in pair.sent)
        pair.fabric.faults.disconnect_notif(match=lambda ctx: ctx.src == D_AGENT and ctx.notif.startswith(b"PUSH_REG:"))
        p2, d2 = legs(pair, "i19b")
        pair.pump(lambda: d2 in pair.received and p2 in pair.sent)
        assert pair.received[d2] is None and pair.sent[p2] is None
        assert_landed(pair.decode, d2)
        assert stat(pair.decode, "reg.resent_after_peer_gone") == 1
        assert stat(pair.decode, "remote.gone") == 1
        assert_clean(pair)


def test_registrations_parked_while_ps_agent_is_forgotten_reach_its_next_incarnation() -> None:
    # Seen in real vLLM (2P1D, P0 restarted): of several registrations staged together for
    # the restarted P, the first found the old agent gone; the others, parked for the new
    # incarnation's handshake, were failed too ("P rank gone") although nothing of theirs had
    # reached the old agent. Only requests whose registration reached it may fail.
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        p1, d1 = legs(pair, "i19c")
        pair.pump(lambda: d1 in pair.received and p1 in pair.sent)
        pair.fabric.faults.disconnect_notif(match=lambda ctx: ctx.src == D_AGENT and ctx.notif.startswith(b"PUSH_REG:"))
        names = ["i19d", "i19e", "i19f"]
        params = {n: pair.prefill.prefill(f"{n}-aaaaaaaa", TOKENS, key=n) for n in names}
        for n in names:  # staged in one engine step: all watched before D hears the agent is gone
            pair.decode.expect(f"{n}-bbbbbbbb", TOKENS, params[n], key=n)
        done = [(f"{n}-aaaaaaaa", f"{n}-bbbbbbbb") for n in names]
        pair.pump(lambda: all(d in pair.received and p in pair.sent for p, d in done))
        for p_id, d_id in done:
            assert pair.received[d_id] is None, pair.received[d_id]
            assert pair.sent[p_id] is None
            assert_landed(pair.decode, d_id)
        assert stat(pair.decode, "remote.gone") == 1
        assert stat(pair.decode, "recv.peer_gone") == 0
        assert_clean(pair)


def test_when_p_is_certainly_dead_d_releases_its_requests_without_sitting_out_the_quarantine() -> None:
    # P returned its prefill and died before pushing. D notices (a heartbeat fails: remote
    # disconnected), fails the request and would hold its blocks for the whole quarantine in
    # case that P still writes. Its side channel now refuses: the process is gone, nothing of
    # it can land, so D reports the request at once.
    with make_pair(
        lease_duration=30.0, registration_timeout=60.0, abort_quarantine=30.0, heartbeat_interval=0.1
    ) as pair:
        params = pair.prefill.scheduler.decode_params("i20")  # P's leg never finishes here
        d_id = "i20-bbbbbbbb"
        pair.decode.expect(d_id, TOKENS, params, key="i20")
        pair.pump(lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1, what="registered")
        pair.directory.refused.add((pair.p_endpoint.host, pair.p_endpoint.port))
        pair.fabric.faults.disconnect_notif(match=lambda ctx: ctx.src == D_AGENT, times=None)
        start = time.monotonic()
        pair.pump(lambda: d_id in pair.received, timeout=20, what="D to fail the request")
        assert time.monotonic() - start < 10.0, "D sat out its quarantine"
        assert pair.received[d_id] is not None
        assert stat(pair.decode, "remote.dead") == 1
        assert untouched(pair.decode, d_id)


def test_an_inconclusive_death_check_is_asked_again_until_the_side_channel_refuses() -> None:
    # The same, but D looks while P is still going down: its side channel drops the first two
    # fetches unanswered (a killed process's port lingers for a moment). That proves nothing
    # either way, so D asks again, backing off, and releases the request once the port refuses.
    with make_pair(
        lease_duration=30.0, registration_timeout=60.0, abort_quarantine=30.0, heartbeat_interval=0.1
    ) as pair:
        params = pair.prefill.scheduler.decode_params("i22")
        d_id = "i22-bbbbbbbb"
        pair.decode.expect(d_id, TOKENS, params, key="i22")
        pair.pump(lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1, what="registered")
        address = (pair.p_endpoint.host, pair.p_endpoint.port)
        pair.directory.refused.add(address)
        pair.directory.disconnects[address] = 2
        pair.fabric.faults.disconnect_notif(match=lambda ctx: ctx.src == D_AGENT, times=None)
        start = time.monotonic()
        pair.pump(lambda: d_id in pair.received, timeout=20, what="D to fail the request")
        assert time.monotonic() - start < 10.0, "D sat out its quarantine"
        assert pair.received[d_id] is not None
        assert stat(pair.decode, "remote.death_check_retried") == 2
        assert stat(pair.decode, "remote.dead") == 1
        assert pair.directory.disconnects[address] == 0
        assert untouched(pair.decode, d_id)


def test_a_p_that_answers_as_itself_is_not_declared_dead() -> None:
    # NIXL lost the link, but the same P process answers its side channel: it may still write,
    # so D's failed request sits out its quarantine (blocks held, not reported) and D stops asking.
    with make_pair(
        lease_duration=3.0,
        registration_timeout=60.0,
        abort_quarantine=3.0,
        heartbeat_interval=0.1,
        allow_unsafe_quarantine=True,
    ) as pair:
        params = pair.prefill.scheduler.decode_params("i23")
        d_id = "i23-bbbbbbbb"
        pair.decode.expect(d_id, TOKENS, params, key="i23")
        pair.pump(lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1, what="registered")
        address = (pair.p_endpoint.host, pair.p_endpoint.port)
        pair.directory.disconnects[address] = 1
        pair.fabric.faults.disconnect_notif(match=lambda ctx: ctx.src == D_AGENT, times=1)
        pair.pump(lambda: stat(pair.decode, "remote.gone") == 1, timeout=10, what="D to see P gone")
        start = time.monotonic()
        pair.pump(lambda: d_id in pair.received, timeout=20, what="the quarantine to end")
        assert time.monotonic() - start >= 2.0, "released before its quarantine"
        assert pair.received[d_id] is not None
        assert stat(pair.decode, "remote.death_check_retried") == 1
        assert stat(pair.decode, "remote.dead") == 0


def test_a_handshake_handler_that_raises_fails_the_work_parked_on_it() -> None:
    # D's registration was parked behind D's handshake with P; if applying that handshake
    # raises, the parked work must end now, not wait for D's watchdog.
    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        from pushactors.protocol import HandshakeCompleted

        pair.decode.workers[0].ctx.faults.fail_handler("writer", HandshakeCompleted)
        _, d_id = legs(pair, "i21")
        start = time.monotonic()
        pair.pump(lambda: d_id in pair.received, timeout=10)
        assert time.monotonic() - start < 5.0, "waited for the watchdog"
        assert "writer error" in (pair.received[d_id] or "")
        assert stat(pair.decode, "writer.handler_error") == 1


def test_a_reused_d_id_gets_its_own_kv_even_in_the_same_blocks() -> None:
    """An engine that does not suffix ids reuses a D id once its request ended, and its
    allocator may hand out the same blocks. Naming another P request, the new registration is
    served (with that request's KV) at once; P never answers it from the old slot's memory."""
    with make_pair(lease_duration=30.0, registration_timeout=20.0) as pair:
        d_id = "cmpl-abc-0"
        params = pair.prefill.prefill("p-1", TOKENS, key="one")
        blocks = list(pair.decode.expect(d_id, TOKENS, params, key="one").blocks)
        pair.pump(lambda: d_id in pair.received and "p-1" in pair.sent, what="the first request")
        assert pair.received[d_id] is None
        pair.decode.finish_recv(d_id)
        del pair.decode.received[d_id]
        params = pair.prefill.prefill("p-2", TOKENS, key="two")
        pair.decode.expect(d_id, TOKENS, params, key="two", blocks=blocks)
        # Answered well inside D's watchdog (20 s), which would otherwise end it.
        timed_pump(pair, lambda: d_id in pair.received and "p-2" in pair.sent, timeout=10.0, what="the second request")
        assert pair.received[d_id] is None and pair.sent["p-2"] is None
        assert_landed(pair.decode, d_id)  # the second prompt's KV, checked by meaning


def test_a_p_agent_name_claimed_elsewhere_stays_bound_while_d_awaits_its_completions() -> None:
    """P's payload answers at a second address too (P restarted elsewhere under its engine id,
    or a side channel replaying it) while a D request waits for that P rank's completion. D
    must not rebind the agent name to the new address: the real P's completion would be
    refused as a stranger's and a push that landed would fail. The second address is an
    agent_conflict until the wait is over."""
    with make_pair(lease_duration=30.0, registration_timeout=4.0) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        p_id, d_id = legs(pair, "a1")
        pair.pump(lambda: posted(pair) == 1, what="the first WRITE in flight")
        w = pair.prefill.workers[0]
        other = pair.directory.endpoint("prefill-host2")
        other.publish(w.agent_info, w.compat_hash)
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": other.host,
            "remote_port": other.port,
            "remote_tp_size": 1,
            "remote_request_id": "b1-aaaaaaaa",
        }
        pair.decode.expect("b1-bbbbbbbb", TOKENS, params, key="b1")
        pair.pump(lambda: "b1-bbbbbbbb" in pair.received, what="the second address refused")
        assert pair.received["b1-bbbbbbbb"] is not None
        assert stat(pair.decode, "handshake.failed.agent_conflict") == 1
        assert stat(pair.decode, "remote.moved") == 0
        gate.open()
        pair.pump(lambda: d_id in pair.received and p_id in pair.sent, timeout=20, what="the first request")
        assert pair.sent[p_id] is None and pair.received[d_id] is None
        assert_landed(pair.decode, d_id)
        assert stat(pair.decode, "reaper.notif_wrong_sender") == 0
        assert actor(pair.decode, "writer").sizes()["answers_expected"] == 0  # answered: nothing kept


def test_prompts_of_one_router_request_share_its_transfer_id_and_never_meet_another_requests_kv() -> None:
    """A router request of two prompts: one minted transfer id, keyed per prompt. Both prompts
    land their own KV whatever order the legs come in. Then a request reusing the client's
    X-Request-Id, whose P leg of an earlier attempt was left unmatched (its D leg never came),
    gets its own prompt's KV, never the stale one, though D registers before its P finished."""
    with make_pair(lease_duration=3.0, registration_timeout=20.0) as pair:
        t1 = "tx-0001"
        params = {}
        for i in (0, 1):  # prefill first for prompt 0, registration first for prompt 1
            if i == 0:
                params = pair.prefill.prefill(
                    f"cmpl-X-{i}-aaaaaaaa", TOKENS, key=f"p{i}", transfer_id=t1, per_prompt=True
                )
                pair.decode.expect(f"cmpl-X-{i}-bbbbbbbb", TOKENS, params, key=f"p{i}")
            else:
                pair.decode.expect(f"cmpl-X-{i}-bbbbbbbb", TOKENS, params, key=f"p{i}")
                pair.prefill.prefill(f"cmpl-X-{i}-aaaaaaaa", TOKENS, key=f"p{i}", transfer_id=t1, per_prompt=True)
        both = ("cmpl-X-0-bbbbbbbb", "cmpl-X-1-bbbbbbbb")
        pair.pump(lambda: all(d in pair.received for d in both), what="both prompts")
        for d in both:
            assert pair.received[d] is None
            assert_landed(pair.decode, d)
        # The earlier attempt of the next request: P finished, its D leg never registers.
        stale = pair.prefill.prefill("cmpl-Y-0-aaaaaaaa", TOKENS, key="stale", transfer_id="tx-0002", per_prompt=True)
        # The retry reuses X-Request-Id "Y" with a fresh transfer id; D registers first.
        retry = {**stale, "transfer_id": "tx-0003"}
        retry.pop("remote_request_id")
        pair.decode.expect("cmpl-Y-0-dddddddd", TOKENS, retry, key="fresh")
        pair.pump(lambda: actor(pair.prefill, "matcher").sizes()["pending_registrations"] == 1, what="D first")
        pair.prefill.prefill("cmpl-Y-0-cccccccc", TOKENS, key="fresh", transfer_id="tx-0003", per_prompt=True)
        pair.pump(lambda: "cmpl-Y-0-dddddddd" in pair.received, what="the retry")
        assert pair.received["cmpl-Y-0-dddddddd"] is None
        assert_landed(pair.decode, "cmpl-Y-0-dddddddd")  # prompt "fresh", checked by meaning
        pair.pump(lambda: "cmpl-Y-0-aaaaaaaa" in pair.sent, what="the stale P leg's lease to lapse")
        assert pair.sent["cmpl-Y-0-aaaaaaaa"] is not None


def test_a_reply_carrying_another_agents_metadata_binds_nothing_and_unloads_nobody() -> None:
    """A hostile side channel answers with its own agent name (the registration's sender) but
    the real D's public metadata blob. P must refuse the handshake (the name the reply claims is
    not the agent its metadata loads), keep the real D bound where it is and loaded in NIXL, and
    its WRITE in flight to D must still land; idle-engine sweeps must never unload D."""
    from pushactors.actors.pykka_internals import actor_object

    with make_pair(engine_ttl=0.3, lease_duration=30.0, registration_timeout=30.0) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_to(D_AGENT))
        p1, d1 = legs(pair, "m2")
        pair.pump(lambda: posted(pair) == 1, what="the WRITE to the real D in flight")
        evil, (endpoint, _) = impostor(pair, metadata=pair.fabric.get(D_AGENT).get_agent_metadata())
        evil.send_notif(P_AGENT, encode_registration(reg_from(pair, "evil-2-bbbbbbbb", endpoint.host, endpoint.port)))
        pair.pump(lambda: stat(pair.prefill, "handshake.failed.agent_mismatch") == 1, what="the reply refused")
        writer = actor_object(pair.prefill.workers[0].runtime.refs["writer"])
        table = writer.links.table  # type: ignore[union-attr]
        assert {k.host for k, r in table.remotes.items() if r.agent_name == D_AGENT} == {pair.d_endpoint.host}
        deadline = time.monotonic() + 1.5
        pair.pump(lambda: time.monotonic() > deadline, what="a few idle-engine sweeps")
        assert D_AGENT in pair.fabric.get(P_AGENT).remote_agents
        gate.open()
        pair.pump(lambda: d1 in pair.received and p1 in pair.sent, what="the real push")
        assert pair.received[d1] is None and pair.sent[p1] is None
        assert_landed(pair.decode, d1)


def test_a_matcher_error_on_a_reused_p_id_ends_that_incarnation_at_once() -> None:
    """The matcher fails while handling the blocks of the second request under a reused P id:
    that request ends at once (its serial travels with the failure), not when its lease runs
    out; the first request's tombstone must not swallow it as a late message."""
    from pushactors.protocol import BlocksFinished

    with make_pair(lease_duration=30.0, registration_timeout=30.0) as pair:
        p_id = "reuse-aaaaaaaa"
        params = pair.prefill.prefill(p_id, TOKENS, key="k1")
        pair.decode.expect("one-bbbbbbbb", TOKENS, params, key="k1")
        pair.pump(lambda: "one-bbbbbbbb" in pair.received and p_id in pair.sent, what="the first request")
        del pair.prefill.sent[p_id]
        pair.prefill.workers[0].ctx.faults.fail_handler("matcher", BlocksFinished)
        params = pair.prefill.prefill(p_id, TOKENS, key="k2")
        pair.decode.expect("two-bbbbbbbb", TOKENS, params, key="k2")
        pair.pump(lambda: "two-bbbbbbbb" in pair.received and p_id in pair.sent, timeout=10, what="the second")
        assert pair.sent[p_id] is not None and "matcher error" in pair.sent[p_id]
        assert pair.received["two-bbbbbbbb"] is not None


def test_ids_used_verbatim_that_share_a_prefix_each_land_only_their_own_kv() -> None:
    """P and D use one id per request, verbatim (``job-00000000`` … ``job-00000007``): their
    tails look like engine suffixes. D registers all of them first; P prefills them one at a
    time in reverse. Each lands its own KV, none is written with a sibling's."""
    from pushactors.testing import SimSpec

    spec = SimSpec(num_layers=2, num_blocks=64, shuffle_blocks=False)
    ids = [f"job-{i:08d}" for i in range(8)]
    with PushPair(p_spec=spec) as pair:
        for rid in ids:
            pair.decode.expect(rid, 32, pair.prefill.scheduler.decode_params(rid), key=rid)
        for n, rid in enumerate(reversed(ids), start=1):
            pair.prefill.prefill(rid, 32, key=rid)
            pair.pump(lambda rid=rid: rid in pair.received, what=f"{rid} to land")
            assert pair.received[rid] is None
            checked, wrong = pair.decode.verify(rid)
            assert checked > 0 and wrong == 0, f"{rid}: {wrong} wrong bytes"
            assert len(pair.received) == n, "a sibling landed with another request's push"
        assert all(pair.sent[rid] is None for rid in ids)
