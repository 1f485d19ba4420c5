"""P's side of two integrity rules, over the fake fabric with bytes checked on D.

* A push never outlives D's interest: every WRITE of it (each layer group of a layer-wise push,
  each chunk of a staged one), not only the first, is checked against D's deadline, D's abort
  and P's lease just before it is posted; a push stopped that way is never reported pushed, and
  the stuck-WRITE timer runs from the push's first WRITE, not from its latest layer.
* A cancel is believed only on proof: P never releases a WRITE still in progress to cancel it.
  It keeps the handle and polls it until NIXL says it ended, telling D meanwhile that it "may
  still land"; only then does D hear the final word. A WRITE still running at
  ``pinned_write_limit`` is released then, counted and logged at error level.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from scenario_kit import stat

from pushactors.core.config import PushConfig
from pushactors.logs import EventCapture
from pushactors.protocol import ABORT_PREFIX, Gathered, LayersReady
from pushactors.testing import FaultContext, LayeredPrefill, PushPair, SimEngine, SimSpec, completion_of
from pushactors.testing.fabric import FakeFabric
from pushactors.transport.directory import InProcessDirectory

pytestmark = pytest.mark.timeout(120)

TOKENS = 48  # three blocks
P_ID, D_ID = "pi-1-aaaaaaaa", "pi-1-bbbbbbbb"
# Safe by every timing rule: D promises its blocks 2 s past each heartbeat (2/3 lease), and its
# quarantine (3.2 s) outlasts that plus write_timeout plus two ticks.
SAFE: dict[str, Any] = {
    "lease_duration": 3.0,
    "write_timeout": 1.0,
    "abort_quarantine": 3.2,
    "reaper_tick": 0.05,
    "registration_timeout": 60.0,
}
STAGED: dict[str, Any] = {
    "staging_bytes": 8 << 20,
    "staging_min_runs": 1,
    "staging_min_bytes": 1,
    "staging_gather_runs": 0,
}


def _heartbeat(ctx: FaultContext) -> bool:
    return ctx.op == "NOTIF" and ctx.notif.startswith((b"HB:", b"HB@"))


def _abort(ctx: FaultContext) -> bool:
    return ctx.op == "NOTIF" and ctx.notif.startswith(ABORT_PREFIX)


def _held(pair: PushPair) -> int:
    snap = pair.prefill.workers[0].runtime.snapshot("matcher")
    return int(snap["matcher"].get("pending_registrations", 0))


def _registered(pair: PushPair, d_id: str = D_ID, p_id: str = P_ID, key: str = "k", **expect: Any) -> list[int]:
    """D registers ``d_id`` for P's ``p_id`` and P holds the registration; D's blocks."""
    params = pair.prefill.scheduler.decode_params(p_id, None)
    rec = pair.decode.expect(d_id, TOKENS, params, key=key, **expect)
    pair.pump(lambda: _held(pair) >= 1, what="D's registration held by P")
    return list(rec.blocks)


def _layer_landed(pair: PushPair, d_id: str, layer: str) -> bool:
    """Whether any byte of ``layer`` in ``d_id``'s blocks was written (D's blocks start zeroed)."""
    rec = pair.decode.recvs[d_id]
    t = pair.decode.kv[0][layer]
    return any(bool(t[:, b].any()) for b in rec.blocks)


def _pause(pair: PushPair, seconds: float, what: str) -> None:
    """Keep both engines stepping for ``seconds``."""
    until = time.monotonic() + seconds
    pair.pump(lambda: time.monotonic() >= until, timeout=seconds + 30.0, what=what)


def _reuse(pair: PushPair, d_id: str) -> None:
    """D is done with ``d_id``: its blocks go back to the pool."""
    pair.decode.finish_recv(d_id)
    pair.decode.received.pop(d_id, None)


class SplitPair(PushPair):
    """A :class:`PushPair` whose P and D run different settings (``p`` and ``d`` over ``common``)."""

    def __init__(self, *, spec: SimSpec, common: dict[str, Any], p: dict[str, Any], d: dict[str, Any]) -> None:
        self.fabric = FakeFabric()
        self.directory = InProcessDirectory()
        p_end = self.directory.endpoint("prefill-host")
        d_end = self.directory.endpoint("decode-host")
        self.p_endpoint, self.d_endpoint = p_end, d_end
        self.prefill = SimEngine(
            PushConfig(engine_id="prefill", role="producer", **{**common, **p}),
            agent_factory=self.fabric,
            source=self.directory,
            publisher_for_rank=lambda _r: p_end,
            spec=spec,
            seed=0,
        )
        try:
            self.decode = SimEngine(
                PushConfig(engine_id="decode", role="consumer", **{**common, **d}),
                agent_factory=self.fabric,
                source=self.directory,
                publisher_for_rank=lambda _r: d_end,
                spec=spec,
                seed=1,
            )
        except BaseException:
            self.prefill.shutdown(10.0)
            raise


# ------------------------------------------------------------------------------------------------
# A layer-wise or chunked push that outlives D's interest
# ------------------------------------------------------------------------------------------------
def test_a_layerwise_push_whose_abort_was_lost_never_writes_into_the_next_requests_blocks() -> None:
    """D aborts after P wrote the first layers, and the abort is lost. P's forward goes on,
    a layer every 0.2 s (each one used to restart P's stuck-WRITE timer, so the push never
    looked stuck), past D's promise and past D's quarantine; D gives the blocks to request B,
    which lands. P must not write A's later layers into B's blocks, and must never report A
    pushed. Settings are safe by every timing rule."""
    spec = SimSpec(num_layers=32, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", **SAFE) as pair:
        pair.fabric.faults.drop_notif(match=_abort, times=None)
        blocks = _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="a")
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted >= 1, what="layer 0's WRITE")
        assert pair.decode.scheduler.abort_recv(D_ID)
        b_id, b_p = "pi-b-bbbbbbbb", "pi-b-aaaaaaaa"
        b_started = False
        while prefill.done < len(prefill.layers):
            _pause(pair, 0.2, "the next layer's compute")
            prefill.compute(prefill.done + 1)
            if D_ID in pair.received and not b_started:
                # D is done with A (its quarantine ended, or P answered): B gets the blocks.
                assert pair.received[D_ID] is not None
                _reuse(pair, D_ID)
                params = pair.prefill.prefill(b_p, TOKENS, key="b")
                pair.decode.expect(b_id, TOKENS, params, key="b", blocks=blocks)
                b_started = True
        prefill.finish()
        assert b_started, "D never let A's blocks go"
        pair.pump(lambda: b_id in pair.received and P_ID in pair.sent, what="B landed and A over on P")
        _pause(pair, 0.3, "anything late")
        assert pair.received[b_id] is None
        checked, wrong = pair.decode.verify(b_id)
        assert checked > 0 and wrong == 0, f"{wrong} bytes of A's later layers landed in B's blocks"
        assert pair.sent[P_ID] is not None, "A reported pushed, though D gave up on it"
        assert pair.sent[b_p] is None


def test_a_layer_computed_after_ds_deadline_is_never_written_and_the_push_fails_on_both_sides() -> None:
    """D's heartbeats are lost, so its promise for the registration is never renewed. The
    forward's later layers reach P's writer only after that promise passed (the writer was
    busy): none of them may be written (D may have reused the blocks), the push fails on P's
    engine and D hears the failure. Before, only the push's first WRITE was checked."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", **SAFE) as pair:
        pair.fabric.faults.drop_notif(match=_heartbeat, times=None)
        _registered(pair)
        held_at = time.monotonic()  # D sent it before: its deadline is at most 2/3 lease from here
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="a")
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0's WRITE")
        pair.pump(lambda: _layer_landed(pair, D_ID, "layer.0"), what="layer 0 in D's blocks")
        busy = pair.prefill.workers[0].ctx.faults.hold_handler("writer", LayersReady)
        prefill.compute(4)
        keep = SAFE["lease_duration"] * 2 / 3
        _pause(pair, max(0.0, held_at + keep + 0.2 - time.monotonic()), "D's deadline to pass")
        busy.set()
        pair.pump(lambda: P_ID in pair.sent and D_ID in pair.received, what="the push to fail on both sides")
        prefill.finish()
        _pause(pair, 0.2, "anything late")
        assert pair.sent[P_ID] is not None and pair.received[D_ID] is not None
        assert pair.fabric.stats.transfers_posted == 1, "a layer was written past D's deadline"
        for layer in ("layer.1", "layer.2", "layer.3"):
            assert not _layer_landed(pair, D_ID, layer), f"{layer} written past D's deadline"
        assert stat(pair.prefill, "write.past_deadline") >= 1


def test_a_lapsed_lease_stops_an_open_layerwise_push() -> None:
    """P's lease on the request lapses mid-forward (D's heartbeats come further apart than P's
    lease here) while D still waits: no layer computed after the lapse is written, the push is
    not reported pushed, and D is told it failed. Before, the expiry stopped only WRITEs not
    opened yet, and the open push went on to write every layer."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    common = {"registration_timeout": 60.0, "write_timeout": 5.0, "reaper_tick": 0.05, "push_mode": "layerwise"}
    # P: a 1.5 s lease (a heartbeat extends it by 1 s) and a quarantine safe for it; D: a 30 s
    # lease, so it beats every 5 s and promises its blocks for 20 s.
    with SplitPair(
        spec=spec, common=common, p={"lease_duration": 1.5, "abort_quarantine": 6.2}, d={"lease_duration": 30.0}
    ) as pair:
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="a")
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0's WRITE")
        pair.pump(lambda: stat(pair.prefill, "lease.expired") >= 1, what="P's lease to lapse")
        started = time.monotonic()
        pair.pump(lambda: P_ID in pair.sent or time.monotonic() - started > 1.0, what="P to end it, or 1 s")
        prefill.compute(4)
        pair.pump(lambda: P_ID in pair.sent and D_ID in pair.received, what="the push to fail on both sides")
        prefill.finish()
        _pause(pair, 0.2, "anything late")
        assert pair.sent[P_ID] is not None and pair.received[D_ID] is not None
        assert pair.fabric.stats.transfers_posted == 1, "a layer was written after P's lease lapsed"
        assert not _layer_landed(pair, D_ID, "layer.1") and not _layer_landed(pair, D_ID, "layer.3")


def test_a_layerwise_push_is_judged_stuck_from_its_first_write_not_its_latest_layer() -> None:
    """A forward whose layers come every 0.15 s and a write_timeout of 0.5 s: each layer's post
    used to restart the stuck timer, so the push never looked stuck however long it ran. The
    timer runs from the push's first WRITE: past write_timeout no further layer is written, D
    hears that a WRITE may still land and then the failure, and P's engine the failure."""
    spec = SimSpec(num_layers=16, num_blocks=32, shuffle_blocks=False)
    cfg = {**SAFE, "write_timeout": 0.5, "abort_quarantine": 2.7}
    with PushPair(p_spec=spec, push_mode="layerwise", **cfg) as pair:
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="a")
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0's WRITE")
        first = time.monotonic()
        while prefill.done < len(prefill.layers):
            _pause(pair, 0.15, "the next layer's compute")
            prefill.compute(prefill.done + 1)
        prefill.finish()
        pair.pump(lambda: P_ID in pair.sent and D_ID in pair.received, what="the push to end on both sides")
        took = time.monotonic() - first
        assert took > 1.5  # the forward took three write_timeouts
        assert pair.sent[P_ID] is not None and pair.received[D_ID] is not None
        # Stopped a write_timeout (plus a tick or two of housekeeping) after its first WRITE.
        assert pair.fabric.stats.transfers_posted < len(prefill.layers) // 2
        assert not _layer_landed(pair, D_ID, "layer.15")
        assert stat(pair.prefill, "write.timed_out") == 1
        assert stat(pair.decode, "recv.write_pinned") >= 1


@pytest.mark.parametrize("chunk", [16 << 10], ids=["chunks"])
def test_a_staged_chunk_gathered_after_ds_deadline_is_never_written(chunk: int) -> None:
    """A staged push in chunks: chunk 0 is written, and the later chunks' gathers come back to
    P's writer only after D's promise passed (its heartbeats lost, the writer busy). No later
    chunk is written into D's slot; the push fails on both sides and both slots come back."""
    s = SimSpec(layout="hnd", num_blocks=48)
    config = {**STAGED, **SAFE, "staging_chunk_bytes": chunk}
    with PushPair(p_spec=s, d_spec=s, **config) as pair:
        pair.fabric.faults.drop_notif(match=_heartbeat, times=None)
        busy = pair.prefill.workers[0].ctx.faults.hold_handler("writer", Gathered, match=lambda m: m.chunk == 1)
        params = pair.prefill.prefill(P_ID, 200, key="a", transfer_id="t-1")
        pair.decode.expect(D_ID, 200, params, key="a")
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="chunk 0's WRITE")
        posted_at = time.monotonic()  # after D sent its registration: its deadline is before
        keep = SAFE["lease_duration"] * 2 / 3
        _pause(pair, max(0.0, posted_at + keep + 0.2 - time.monotonic()), "D's deadline to pass")
        busy.set()
        pair.pump(lambda: P_ID in pair.sent and D_ID in pair.received, what="the push to fail on both sides")
        assert pair.sent[P_ID] is not None and pair.received[D_ID] is not None
        assert pair.fabric.stats.transfers_posted == 1, "a chunk was written past D's deadline"
        assert stat(pair.prefill, "write.past_deadline") >= 1
        pair.pump(
            lambda: all(
                w.ctx.staging is None or w.ctx.staging.sizes()["staging_slots"] == 0
                for e in (pair.prefill, pair.decode)
                for w in e.workers
            ),
            what="both staging pools back",
        )


# ------------------------------------------------------------------------------------------------
# A cancel believed only on proof
# ------------------------------------------------------------------------------------------------
def _mode_config(mode: str) -> tuple[SimSpec, dict[str, Any]]:
    if mode == "staged":
        return SimSpec(layout="hnd", num_blocks=48), {**STAGED, "staging_chunk_bytes": 16 << 10}
    if mode == "layerwise":
        return SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False), {"push_mode": "layerwise"}
    return SimSpec(num_layers=2, num_blocks=32, shuffle_blocks=False), {}


def _start(pair: PushPair, mode: str, p_id: str, d_id: str, key: str) -> tuple[list[int], LayeredPrefill | None]:
    """Both legs of a request; a layer-wise forward computes every layer but the last."""
    if mode == "layerwise":
        blocks = _registered(pair, d_id, p_id, key)
        prefill = pair.prefill.prefill_layers(p_id, TOKENS, key=key)
        prefill.compute(3)
        return blocks, prefill
    tokens = 200 if mode == "staged" else TOKENS
    params = pair.prefill.prefill(p_id, tokens, key=key, transfer_id=f"t-{key}" if mode == "staged" else None)
    rec = pair.decode.expect(d_id, tokens, params, key=key)
    return list(rec.blocks), None


@pytest.mark.parametrize("ends", ["done", "err"])
@pytest.mark.parametrize("mode", ["direct", "staged", "layerwise"])
def test_a_stuck_write_is_never_released_to_cancel_it_and_d_hears_the_final_word_only_once_it_ended(
    mode: str, ends: str
) -> None:
    """P's WRITEs hang past write_timeout, and releasing one would not stop it (``release_continues``:
    the copy lands later all the same, as a started cma, cuda_ipc or RDMA copy does). P must not
    release them: D hears "may still land" and keeps its blocks (or slot) for as long as they run,
    and nothing final is said on either side. Once NIXL says they ended, D hears the final word;
    nothing of them ever lands later, in blocks D gave to the next request."""
    spec, extra = _mode_config(mode)
    config = {
        **extra,
        "lease_duration": 30.0,
        "write_timeout": 0.5,
        "abort_quarantine": 30.0,
        "registration_timeout": 60.0,
    }
    with PushPair(p_spec=spec, d_spec=spec, **config) as pair:
        gate = pair.fabric.faults.hold_transfer()
        if ends == "err":
            pair.fabric.faults.err_transfer(times=None)
        pair.fabric.faults.release_continues(times=None, runs_on=0.5)
        try:
            first_p, first_d = "pi-1-aaaaaaaa", "pi-1-bbbbbbbb"
            blocks, prefill = _start(pair, mode, first_p, first_d, "first")
            pair.pump(lambda: pair.fabric.stats.transfers_posted >= 1, what="a WRITE in flight")
            pair.pump(lambda: stat(pair.decode, "recv.write_pinned") >= 1, what="D told it may still land")
            if prefill is not None:
                prefill.finish()  # the last layer, computed after P judged the push stuck
            posted = pair.fabric.stats.transfers_posted
            # Three write_timeouts: long past when P used to cancel and give its final word.
            _pause(pair, 1.5, "the WRITE to stay stuck")
            assert first_d not in pair.received, f"D freed blocks under a live WRITE: {pair.received}"
            assert first_p not in pair.sent, f"P freed blocks under a live WRITE: {pair.sent}"
            assert pair.fabric.in_flight() == posted, "a stuck WRITE was released"
            assert pair.fabric.stats.transfers_cancelled == 0
            assert pair.fabric.stats.transfers_posted == posted  # no layer or chunk after the timeout
            assert stat(pair.prefill, "write.timed_out") == 1
        finally:
            gate.open()
        pair.pump(lambda: first_d in pair.received and first_p in pair.sent, what="both sides to end it")
        landed = mode == "direct" and ends == "done"  # a push in parts, once stuck, stays failed
        assert (pair.received[first_d] is None) == landed and (pair.sent[first_p] is None) == landed
        if landed:
            assert pair.decode.verify(first_d)[1] == 0
        assert pair.fabric.in_flight() == 0
        pair.fabric.faults.clear()
        # D reuses the blocks at once for the next request: nothing of the first lands in them.
        _reuse(pair, first_d)
        second_p, second_d = "pi-2-aaaaaaaa", "pi-2-bbbbbbbb"
        if mode == "layerwise":
            params = pair.prefill.scheduler.decode_params(second_p, None)
            pair.decode.expect(second_d, TOKENS, params, key="second", blocks=blocks)
            nxt = pair.prefill.prefill_layers(second_p, TOKENS, key="second")
            nxt.finish()
        elif mode == "staged":
            pair.prefill.prefill(second_p, 200, key="second", transfer_id="t-second")
            pair.decode.expect(second_d, 200, pair.prefill.scheduler.decode_params(second_p, "t-second"), key="second")
        else:
            params = pair.prefill.prefill(second_p, TOKENS, key="second")
            pair.decode.expect(second_d, TOKENS, params, key="second", blocks=blocks)
        pair.pump(lambda: second_d in pair.received, what="the second push")
        _pause(pair, 0.8, "a late copy, if any was let go")
        assert pair.received[second_d] is None
        checked, wrong = pair.decode.verify(second_d)
        assert checked > 0 and wrong == 0, f"{wrong} bytes of the first request in the second's blocks"
        assert pair.fabric.stats.transfers_landed_after_release == 0


def test_a_write_still_running_at_pinned_write_limit_is_released_counted_and_failed(events: EventCapture) -> None:
    """A WRITE that never ends: P tells D it may still land at write_timeout and keeps polling
    it; at pinned_write_limit (the bound D keeps such blocks by, too) P releases it, counts it,
    logs it at error level and gives both sides the final failure."""
    spec = SimSpec(num_layers=2, num_blocks=32, shuffle_blocks=False)
    config = {
        "lease_duration": 30.0,
        "write_timeout": 0.5,
        "pinned_write_limit": 1.5,
        "abort_quarantine": 30.0,
        "registration_timeout": 60.0,
    }
    with PushPair(p_spec=spec, **config) as pair:
        gate = pair.fabric.faults.hold_transfer(match=completion_of(D_ID))
        try:
            params = pair.prefill.prefill(P_ID, TOKENS, key="a")
            pair.decode.expect(D_ID, TOKENS, params, key="a")
            pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="the WRITE in flight")
            posted_at = time.monotonic()
            pair.pump(lambda: stat(pair.decode, "recv.write_pinned") >= 1, what="D told it may still land")
            pair.pump(lambda: P_ID in pair.sent and D_ID in pair.received, what="the pin limit to end it")
            took = time.monotonic() - posted_at
            assert took >= 1.4, f"released {took:.2f}s after its post, before pinned_write_limit"
            assert pair.sent[P_ID] is not None and pair.received[D_ID] is not None
            assert "pinned_write_limit" in (pair.sent[P_ID] or "")
            assert stat(pair.prefill, "write.released_at_pin_limit") == 1
            assert events.where(event="write.released_at_pin_limit", level="error")
        finally:
            gate.open()


@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_a_release_nixl_refuses_at_pinned_write_limit_is_tried_again_and_d_hears_only_after(mode: str) -> None:
    """At pinned_write_limit P releases a WRITE still running, and NIXL refuses the first
    release: the WRITE (or the refused chunk) is kept and released on the next pass, and only
    then is the final word sent. D's own limit is far off here, so only P's word frees D."""
    spec, extra = _mode_config(mode)
    common = {
        **extra,
        "lease_duration": 30.0,
        "write_timeout": 0.5,
        "abort_quarantine": 30.0,
        "registration_timeout": 60.0,
    }
    with SplitPair(spec=spec, common=common, p={"pinned_write_limit": 1.0}, d={}) as pair:
        gate = pair.fabric.faults.hold_transfer()
        try:
            pair.fabric.faults.refuse_cancel(times=1)
            _start(pair, mode, P_ID, D_ID, "a")
            pair.pump(lambda: pair.fabric.stats.transfers_posted >= 1, what="a WRITE in flight")
            pair.pump(lambda: D_ID in pair.received, what="P's final word at its pin limit")
            assert pair.fabric.in_flight() == 0, "D heard the final word while a WRITE NIXL kept was in flight"
            assert pair.received[D_ID] is not None
            assert stat(pair.prefill, "write.release_refused") == 1
            assert stat(pair.prefill, "write.released_at_pin_limit") == 1
            pair.pump(lambda: P_ID in pair.sent, what="P's engine told")
            assert pair.sent[P_ID] is not None
        finally:
            gate.open()
