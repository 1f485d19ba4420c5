"""Layer-wise pushes (``push_mode = "layerwise"``): P WRITEs each group of layers into D's
blocks as the forward computes it; D hears once, when every layer landed. Thread-free tests of
the plain parts, then pairs over the fake fabric with bytes checked on D."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from pushactors.core.blocks import KVLayout, KVRegion, PairedLayout, RemoteLayout
from pushactors.core.config import ConfigError, PushConfig
from pushactors.core.layerwise import LayerGroups, LayerReadiness, StepLayers
from pushactors.testing import LayeredPrefill, PushPair, SimSpec
from pushactors.testing.pair import wait_until

pytestmark = pytest.mark.timeout(120)

TOKENS = 48  # three blocks
P_ID, D_ID = "lw-1-aaaaaaaa", "lw-1-bbbbbbbb"


# --- plain parts ---------------------------------------------------------------------------------
def _layout(names: list[list[str]]) -> KVLayout:
    regions = tuple(
        KVRegion(base_addr=0x10000 * (i + 1), block_len=64, stride=64, num_blocks=8, members=tuple(ms))
        for i, ms in enumerate(names)
    )
    return KVLayout(regions=regions, mem_type="DRAM", block_size=16)


def test_layer_groups_follow_the_forward_order_and_a_region_waits_for_its_last_layer() -> None:
    # Names out of registration order, K/V halves of one layer, and a region of two layers.
    layout = _layout(
        [["m.layers.10.attn"], ["m.layers.2.attn[0]"], ["m.layers.2.attn[1]"], ["m.layers.0.attn", "m.layers.1.attn"]]
    )
    g = LayerGroups.of(layout, 1)
    assert g.names == ("m.layers.0.attn", "m.layers.1.attn", "m.layers.2.attn", "m.layers.10.attn")
    assert g.count == 4 and g.group_of_region == (3, 2, 2, 1)  # the two-layer region: after layer 1
    g2 = LayerGroups.of(layout, 3)
    assert g2.count == 2 and g2.group_of_region == (1, 0, 0, 0) and g2.size(1) == 1
    assert LayerGroups.of(layout, 100).count == 1


def test_a_step_counts_complete_leading_groups_only_in_order_and_once_per_layer() -> None:
    g = LayerGroups.of(_layout([[f"l.{i}"] for i in range(5)]), 2)
    step = StepLayers(g)
    assert step.saved("l.1") is None  # group 0 still misses l.0
    assert step.saved("l.1") is None  # saved twice counts once
    assert step.saved("unknown") is None
    assert step.saved("l.0") == 1
    assert step.saved("l.3") is None and step.saved("l.4") is None  # group 2 done, group 1 not
    assert step.saved("l.2") == 3  # groups 1 and 2 at once


class _Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_readiness_counts_a_device_mark_only_once_its_event_completed() -> None:
    r = LayerReadiness(clock=lambda: 5.0)
    r.mark("a", 1, 0)
    first, second = _Event(), _Event()
    r.mark("a", 1, 2, first)
    r.mark("a", 1, 4, second)
    assert r.ready("a", 1) == 0 and r.pending_events()
    second.done = True  # events of one stream complete in order: the first is not done yet
    assert r.ready("a", 1) == 0
    first.done = True
    assert r.ready("a", 1) == 4 and not r.pending_events()
    assert r.ready("a", 2) == 0  # another incarnation of the id knows nothing
    assert r.prune(older_than=6.0) == 1 and len(r) == 0


def test_plans_per_layer_group_partition_the_whole_plan() -> None:
    """Every piece of the whole WRITE is in exactly one layer group's WRITE, at the same
    indices into the same prepared lists."""
    names = [[f"l.{i}"] for i in range(6)]
    local = _layout(names)
    remote = RemoteLayout(
        engine_id="d",
        agent_name="d/0/0",
        regions=_layout(names).regions,
        block_size=16,
        physical_blocks_per_logical=1,
        tp_size=1,
        tp_rank=0,
        pp_size=1,
        pp_rank=0,
        mem_type="DRAM",
    )
    paired = PairedLayout(local, (0, 1), remote, range(0, 1), 1)
    p_blocks, d_blocks = ((1, 5, 2),), ((7, 0, 3),)
    whole = paired.plan(p_blocks, d_blocks)
    groups = LayerGroups.of(local, 4)
    parts = [paired.plan(p_blocks, d_blocks, layer_group=(groups.group_of_region, g)) for g in range(groups.count)]
    assert [p.num_descs for p in parts] == [4 * 3, 2 * 3]
    pairs = sorted(
        zip(
            np.concatenate([p.local_idx for p in parts]).tolist(),
            np.concatenate([p.remote_idx for p in parts]).tolist(),
            strict=True,
        )
    )
    assert pairs == sorted(zip(whole.local_idx.tolist(), whole.remote_idx.tolist(), strict=True))
    assert sum(p.nbytes for p in parts) == whole.nbytes


def test_the_settings_refuse_an_unknown_mode_and_a_group_of_no_layers() -> None:
    with pytest.raises(ConfigError):
        PushConfig(engine_id="p", push_mode="eager")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        PushConfig(engine_id="p", push_mode="layerwise", layers_per_write=0)


# --- pairs over the fake fabric ------------------------------------------------------------------
def _held(pair: PushPair) -> int:
    snap = pair.prefill.workers[0].runtime.snapshot("matcher")
    return int(snap["matcher"].get("pending_registrations", 0))


def _registered(pair: PushPair, key: str = "k", **expect: Any) -> None:
    params = pair.prefill.scheduler.decode_params(P_ID, None)
    pair.decode.expect(D_ID, TOKENS, params, key=key, **expect)
    pair.pump(lambda: _held(pair) == 1, what="D's registration held by P")


def _layer_bytes_landed(pair: PushPair, layer: str) -> bool:
    """Whether every block D registered holds something in ``layer`` (D's blocks start zeroed)."""
    rec = pair.decode.recvs[D_ID]
    t = pair.decode.kv[0][layer]
    return all(bool(t[:, b].any()) for b in rec.blocks)


def test_each_layer_is_written_as_it_is_computed_and_d_hears_once_all_landed() -> None:
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0) as pair:
        _registered(pair)
        prefill: LayeredPrefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        assert pair.fabric.stats.transfers_posted == 0  # announced: nothing computed yet
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0's WRITE")
        pair.pump(lambda: _layer_bytes_landed(pair, "layer.0"), what="layer 0 in D's blocks")
        assert not _layer_bytes_landed(pair, "layer.1")  # not computed: never written
        prefill.compute(3)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 3, what="layers 1 and 2")
        for _ in range(20):
            pair.step()
        assert D_ID not in pair.received  # three of four layers landed: D waits
        assert not _layer_bytes_landed(pair, "layer.3")
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the last layer")
        assert pair.received[D_ID] is None and pair.sent[P_ID] is None
        checked, wrong = pair.decode.verify(D_ID)
        assert checked == 3 * 2048 * 2 * 4 and wrong == 0
        assert pair.fabric.stats.transfers_posted == 4
        assert pair.prefill.free_blocks == spec.num_blocks  # P's lease let go


def test_layers_computed_before_the_registration_go_at_once_when_it_arrives() -> None:
    spec = SimSpec(num_layers=4, num_blocks=32)
    with PushPair(p_spec=spec, push_mode="layerwise", layers_per_write=2, lease_duration=30.0) as pair:
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(3)  # group 0 done, group 1 half done
        params = pair.prefill.scheduler.decode_params(P_ID, None)
        pair.decode.expect(D_ID, TOKENS, params, key="k")
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="group 0 on the registration")
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        assert pair.fabric.stats.transfers_posted == 2  # two layers per WRITE


def test_a_layer_write_that_fails_ends_the_request_visibly_on_both_sides_and_frees_p() -> None:
    spec = SimSpec(num_layers=4, num_blocks=32)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0) as pair:
        seen = {"n": 0}

        def second(_: Any) -> bool:
            seen["n"] += 1
            return seen["n"] == 2

        pair.fabric.faults.err_transfer(match=second)
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(2)
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the failure on both sides")
        assert pair.received[D_ID] is not None and pair.sent[P_ID] is not None
        prefill.finish()  # the forward goes on; nothing more is written
        for _ in range(20):
            pair.step()
        assert pair.fabric.stats.transfers_posted == 2
        assert pair.prefill.free_blocks == spec.num_blocks  # D's blocks are its engine's to free


def test_d_aborting_mid_forward_stops_the_layers_not_yet_written() -> None:
    spec = SimSpec(num_layers=4, num_blocks=32)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, registration_timeout=60.0) as pair:
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0")
        assert pair.decode.scheduler.abort_recv(D_ID)
        pair.pump(lambda: P_ID in pair.sent, what="P's push to end on D's abort")
        assert pair.sent[P_ID] is not None
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received, what="D's abort answered")
        assert pair.received[D_ID] is not None
        assert pair.fabric.stats.transfers_posted == 1  # layers 1-3 never written
        pair.pump(lambda: pair.prefill.free_blocks == spec.num_blocks, what="P's blocks back")


def test_a_staged_registration_waits_for_every_layer_then_goes_the_staged_way() -> None:
    spec = SimSpec(num_layers=2, num_blocks=32, layout="hnd")
    staged = dict(staging_bytes=8 << 20, staging_min_runs=1, staging_min_bytes=1, staging_gather_runs=0)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, **staged) as pair:
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(1)
        for _ in range(30):
            pair.step()
        assert pair.fabric.stats.transfers_posted == 0  # the image needs every layer
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received, what="the staged push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0


def test_a_whole_mode_engine_never_writes_an_announced_request_before_its_forward_ends() -> None:
    """A P scheduler that announces (layer-wise) with a worker that pushes whole requests: the
    blocks reach the matcher only at wait_for_save, never before the KV is computed."""
    spec = SimSpec(num_layers=2, num_blocks=32)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0) as pair:
        for w in pair.prefill.workers:
            w.layer_groups = None  # as if this rank were configured for whole pushes
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(1)
        for _ in range(30):
            pair.step()
        assert pair.fabric.stats.transfers_posted == 0
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received, what="the whole push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        assert pair.fabric.stats.transfers_posted == 1


def test_marks_duplicated_or_arriving_after_the_push_ended_write_nothing() -> None:
    """LayersReady comes only from this rank's worker, but may repeat a count (a layer saved
    twice) or arrive after the push ended (the step's end mark): neither posts a WRITE or
    re-opens the request in the writer's tables."""
    from pushactors.protocol import LayersReady

    spec = SimSpec(num_layers=2, num_blocks=32)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0) as pair:
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(1)
        worker = pair.prefill.workers[0]
        (rid, serial), *_ = worker.step_layered
        worker.ctx.peers.to_writer(LayersReady(requests=((rid, serial),), ready=1))  # the same count again
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0, once")
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        worker.ctx.peers.to_writer(LayersReady(requests=((rid, serial),), ready=2))  # after the end
        worker.ctx.peers.to_writer(LayersReady(requests=((rid, serial + 7),), ready=2))  # never announced
        for _ in range(30):
            pair.step()
        assert pair.fabric.stats.transfers_posted == 2 and pair.received[D_ID] is None
        sizes = worker.runtime.refs["writer"].proxy().sizes().get(timeout=5.0)
        assert sizes["layerwise_announced"] == sizes["layerwise_open"] == sizes["layerwise_marks"] == 0
        assert sizes["layerwise_retired"] == 0


def test_each_poll_asks_nixl_only_about_layer_writes_still_running() -> None:
    """A layer-wise push is one chunk per layer group: a poll that asked NIXL about every chunk
    posted so far would cost the writer a call per landed layer on every tick (32 on an 8B
    model), on the critical path of the last layer. A chunk seen DONE is never asked again."""
    spec = SimSpec(num_layers=8, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0) as pair:
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        for n in range(1, 8):
            prefill.compute(n)
            pair.pump(lambda n=n: pair.fabric.stats.transfers_done >= n, what=f"layer {n - 1} landed")
            for _ in range(5):
                pair.step()  # the writer keeps polling while the forward computes
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the last layer")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        assert pair.fabric.stats.transfers_posted == 8
        assert pair.fabric.stats.done_rechecks == 0


def test_the_forwards_end_returns_once_the_last_layer_write_is_posted() -> None:
    """wait_for_save hands the last layers over and waits (layerwise_save_wait) until the
    push has ended on P's side (vLLM: "block until all saves are done"): the engine thread does
    not run on into its next step while the WRITE that ends the push needs the interpreter.
    No polling here: the counts hold the moment finish() returns."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, layerwise_save_wait=1.0) as pair:
        _registered(pair)
        # The last layer's WRITE (the one carrying the completion) takes a while to land.
        pair.fabric.faults.slow_transfer(0.2, match=lambda ctx: ctx.op == "WRITE" and bool(ctx.notif))
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(3)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 3, what="layers 0-2")
        prefill.finish()  # layer 3 is saved, then the forward ends
        assert pair.fabric.stats.transfers_posted == 4 and pair.fabric.stats.transfers_done == 4
        stats = pair.prefill.workers[0].stats()
        assert stats["layers.save_waited"] == 1 and "layers.save_wait_timeout" not in stats
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0


def test_the_forwards_end_goes_on_before_p_releases_the_push(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine waiting in wait_for_save goes on once the last WRITE landed and the completion
    left, not after the writer released the push's WRITEs and lists (one NIXL call each:
    32 layer groups and more on a real model)."""
    import pushactors.engine.worker as worker_module
    from pushactors.testing.fabric import FakeNixlAgent

    order: list[str] = []

    class Saved(threading.Event):
        handed_over = False  # the event wait_for_save hands the writer (other events: not asked)

        def set(self) -> None:
            if self.handed_over:
                order.append("engine goes on")
            super().set()

    def layers_ready(**fields: Any) -> Any:
        if fields.get("saved") is not None:
            fields["saved"].handed_over = True
        return ready(**fields)

    ready = worker_module.LayersReady

    release = FakeNixlAgent.release_xfer_handle

    def released(agent: FakeNixlAgent, handle: Any) -> None:
        if handle.notif and "released" not in order:
            order.append("released")  # the last WRITE, the completion riding on it
        release(agent, handle)

    monkeypatch.setattr(worker_module.threading, "Event", Saved)
    monkeypatch.setattr(worker_module, "LayersReady", layers_ready)
    monkeypatch.setattr(FakeNixlAgent, "release_xfer_handle", released)
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, layerwise_save_wait=1.0) as pair:
        # The last layer's device event never completes on its own: only the forward's end
        # (wait_for_save, which waits for the device) hands that layer over and posts it.
        prefill, _ = _last_layer_behind_its_event(pair)
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        assert pair.prefill.workers[0].stats()["layers.save_waited"] == 1
    assert order[:2] == ["engine goes on", "released"], order


@pytest.mark.parametrize("spin", [0.01, 0.0], ids=["spun", "no-spin"])
def test_the_last_layer_write_is_checked_at_once_not_at_the_next_tick(spin: float) -> None:
    """UCX finishes a WRITE, and sends the completion riding on it, only while P progresses:
    the handler that posts the last layer checks it in a tight loop (``poll_spin``), as a whole
    push's post does, instead of leaving it to the next tick. Earlier layers are not spun on:
    the forward needs the interpreter more. Ticks here are 50 ms apart."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    slow = {
        "poll_interval_busy": 0.05,
        "poll_interval_idle": 0.05,
        "poll_interval_await": 0.05,
        "poll_spin_in_flight": 0.0,
    }
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, poll_spin=spin, **slow) as pair:
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(3)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 3, what="layers 0-2")
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        stats = pair.prefill.workers[0].stats()
        assert stats.get("write.spin_settled", 0) == (1 if spin else 0)


_SLOW_TICKS: dict[str, Any] = {
    "poll_interval_busy": 0.2,
    "poll_interval_idle": 0.2,
    "poll_interval_await": 0.2,
    "poll_spin_in_flight": 0.0,
    "reaper_tick": 0.2,
}


def _last_layer_behind_its_event(pair: PushPair) -> tuple[LayeredPrefill, list[_Event]]:
    """Registered; four layers computed, layers 0-2 posted, layer 3 queued behind a device event
    not completed yet (the returned marks: set the last one's ``done`` to complete it)."""
    _registered(pair)
    marks = [_Event() for _ in range(4)]
    for e in marks[:3]:
        e.done = True
    made = iter(marks)
    prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
    prefill.compute(4, event=lambda: next(made))
    pair.pump(lambda: pair.fabric.stats.transfers_posted == 3, what="layers 0-2")
    return prefill, marks


def _last_layer_posted_by_a_poll(pair: PushPair) -> LayeredPrefill:
    """Layers 0-2 computed and posted; layer 3 queued behind a device event that completes only
    once every message is handled, so the writer's poll (not a handler) posts its WRITE."""
    prefill, marks = _last_layer_behind_its_event(pair)
    writer = pair.prefill.workers[0]
    # The writer has handled the four layers' messages (its mailbox is FIFO): none is left that
    # could post layer 3 from a handler.
    writer.runtime.barrier()
    assert writer.stats().get("write.spin_settled", 0) == 0
    assert pair.fabric.stats.transfers_posted == 3  # layer 3's event has not completed
    marks[3].done = True  # the device ran the last layer: the next poll posts its WRITE
    # No engine step meanwhile: a step's message would post it from a handler instead.
    wait_until(lambda: pair.fabric.stats.transfers_posted == 4, timeout=30.0, what="the last layer's WRITE")
    writer.runtime.barrier()  # that poll has returned
    return prefill


@pytest.mark.parametrize("spin", [0.01, 0.0], ids=["spun", "no-spin"])
def test_a_last_layer_seen_by_a_poll_is_checked_in_that_poll(spin: float) -> None:
    """On a GPU the last layer's WRITE is posted by a poll that finds its CUDA event complete,
    not by a message handler. That poll asks NIXL about it in a tight loop (``poll_spin``)
    before it returns, so the completion riding on it leaves then, not a turn of the writer's
    loop later. The fabric takes 2 ms to land each WRITE; ticks are 200 ms apart."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, poll_spin=spin, **_SLOW_TICKS) as pair:
        pair.fabric.faults.slow_transfer(0.002, match=lambda ctx: ctx.op == "WRITE")
        prefill = _last_layer_posted_by_a_poll(pair)
        assert pair.prefill.workers[0].stats().get("write.spin_settled", 0) == (1 if spin else 0)
        pair.pump(lambda: D_ID in pair.received, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        prefill.finish()
        pair.pump(lambda: P_ID in pair.sent, what="P's side of the push")
        assert pair.sent[P_ID] is None
        assert pair.prefill.free_blocks == spec.num_blocks


def test_a_push_closed_by_its_last_post_is_freed_only_after_that_write_is_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Freeing a layer-wise push's plans costs the writer 50-80 µs at 4k tokens on an H100
    host: done between the last layer's post and the check its completion leaves from, it sat
    on every push's critical path. The poll that posts the last WRITE frees the push only
    after asking NIXL about that WRITE; nothing of it is kept once the push ended."""
    from pushactors.actors.writer.push.layered import LayeredPush
    from pushactors.testing.fabric import FakeNixlAgent

    order: list[str] = []
    check = FakeNixlAgent.check_xfer_state

    def checked(agent: FakeNixlAgent, handle: Any) -> Any:
        if handle.notif and "checked" not in order:
            order.append("checked")  # the last WRITE: the completion rides on it
        return check(agent, handle)

    monkeypatch.setattr(FakeNixlAgent, "check_xfer_state", checked)
    monkeypatch.setattr(LayeredPush, "__del__", lambda self: order.append("freed"), raising=False)
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, **_SLOW_TICKS) as pair:
        prefill = _last_layer_posted_by_a_poll(pair)
        pair.pump(lambda: D_ID in pair.received, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        prefill.finish()
        pair.pump(lambda: P_ID in pair.sent, what="P's side of the push")
        writer = pair.prefill.workers[0]
        sizes = writer.runtime.refs["writer"].proxy().sizes().get(timeout=5.0)
        assert sizes["layerwise_retired"] == sizes["layerwise_open"] == 0
    assert order[:2] == ["checked", "freed"], order


def test_a_last_layer_write_a_poll_posted_that_fails_ends_the_request_on_both_sides() -> None:
    """The poll's tight loop only asks: a last WRITE that ends in ERR leaves it at once, is not
    counted as settled by it, and the poll's own check fails the push: D hears of it, P reports
    it, P's blocks are let go."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, poll_spin=0.01, **_SLOW_TICKS) as pair:
        writes = {"n": 0}

        def fourth(ctx: Any) -> bool:
            if ctx.op != "WRITE":
                return False
            writes["n"] += 1
            return writes["n"] == 4

        pair.fabric.faults.err_transfer(match=fourth)
        prefill = _last_layer_posted_by_a_poll(pair)
        assert pair.prefill.workers[0].stats().get("write.spin_settled", 0) == 0
        pair.pump(lambda: D_ID in pair.received, what="D hears of the failure")
        assert pair.received[D_ID] is not None
        prefill.finish()
        pair.pump(lambda: P_ID in pair.sent, what="P's side of the push")
        assert pair.sent[P_ID] is not None
        pair.pump(lambda: pair.prefill.free_blocks == spec.num_blocks, what="P's blocks back")


def test_a_forwards_end_that_waits_in_vain_only_counts_it_and_the_push_still_ends() -> None:
    """A registration that is not there yet leaves nothing to post: the writer answers at
    once. A wait too short for any answer is counted and logged, never fails the request."""
    spec = SimSpec(num_layers=4, num_blocks=32)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, layerwise_save_wait=1e-6) as pair:
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        params = prefill.finish()  # no registration yet: nothing to post
        assert pair.fabric.stats.transfers_posted == 0
        stats = pair.prefill.workers[0].stats()
        assert stats.get("layers.save_waited", 0) + stats.get("layers.save_wait_timeout", 0) == 1
        pair.decode.expect(D_ID, TOKENS, params, key="k")
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push after the forward")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        assert pair.fabric.stats.transfers_posted == 4  # every layer, each its own WRITE


def test_write_settled_names_the_layer_write_that_held_the_push_up() -> None:
    """A layer-wise push is several WRITEs; its settle event says which one took longest from
    its post to being seen DONE (here the second layer's, held by the fabric), so a slow push
    shows whether the last layer or an earlier one kept D waiting."""
    from pushactors.logs import capture_events

    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0) as pair:
        writes = iter(range(1 << 10))
        gate = pair.fabric.faults.hold_transfer(match=lambda ctx: ctx.op == "WRITE" and next(writes) == 1, times=1)
        with capture_events() as events:
            _registered(pair)
            prefill: LayeredPrefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
            prefill.compute(4)
            prefill.finish()
            pair.pump(lambda: pair.fabric.stats.transfers_posted == 4, what="every layer's WRITE")
            for _ in range(10):
                pair.step()
            assert D_ID not in pair.received  # layer 1 has not landed: D is not told
            gate.open()
            pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None
        (settled,) = [e for e in events if e["event"] == "write.settled" and e["request_id"] == P_ID]
        assert settled["chunks"] == 4 and settled["slowest_chunk"] == 1
        assert settled["slowest_chunk_ms"] > 0.0


def _p_agent(pair: PushPair) -> Any:
    (agent,) = [a for name, a in pair.fabric.agents.items() if name.startswith("prefill")]
    return agent


RUNS = dict(post_runs_min_pieces=0)  # every layer's WRITE goes as runs, in lists of its own


def test_the_last_layer_write_is_posted_with_lists_prepared_when_the_push_opened() -> None:
    """Only the last layer's post is on the critical path (after the forward's last layer):
    its descriptor lists are prepared when the push opens, so that post only makes and posts
    the transfer. Every other layer's lists are prepared at its post."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, d_spec=spec, push_mode="layerwise", lease_duration=30.0, **RUNS) as pair:
        _registered(pair)
        agent = _p_agent(pair)
        before, live = agent.calls["prep_xfer_dlist"], agent.live_dlists
        prefill: LayeredPrefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(3)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 3, what="layers 0-2")
        assert agent.calls["prep_xfer_dlist"] - before == 2 + 3 * 2  # the last layer's, then each posted one's
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the last layer")
        assert agent.calls["prep_xfer_dlist"] - before == 8  # the last post prepared nothing
        assert pair.received[D_ID] is None
        checked, wrong = pair.decode.verify(D_ID)
        assert checked == 3 * 2048 * 2 * 4 and wrong == 0
        pair.pump(lambda: agent.live_dlists == live, what="the push's lists released")


def test_the_lists_prepared_ahead_are_released_when_the_push_ends_before_its_last_layer() -> None:
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    cfg = dict(push_mode="layerwise", lease_duration=30.0, registration_timeout=60.0, **RUNS)
    with PushPair(p_spec=spec, d_spec=spec, **cfg) as pair:  # type: ignore[arg-type]
        _registered(pair)
        agent = _p_agent(pair)
        live = agent.live_dlists
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0")
        assert agent.live_dlists == live + 4  # layer 0's lists and the last layer's
        assert pair.decode.scheduler.abort_recv(D_ID)
        pair.pump(lambda: P_ID in pair.sent, what="P's push to end on D's abort")
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received, what="D's abort answered")
        assert pair.fabric.stats.transfers_posted == 1
        pair.pump(lambda: agent.live_dlists == live, what="every list of the push released")


@pytest.mark.parametrize("refused_call", ["prep_xfer_dlist", "make_prepped_xfer"])
def test_a_last_layer_write_that_cannot_be_made_ahead_is_made_at_its_post_and_the_push_lands(
    refused_call: str,
) -> None:
    """Preparing the last layer's lists and making its WRITE when the push opens is an
    optimisation: if NIXL refuses then, it is counted and logged, and the last post prepares and
    makes what is missing itself, as every other post does."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, d_spec=spec, push_mode="layerwise", lease_duration=30.0) as pair:
        _registered(pair)
        agent = _p_agent(pair)
        live, handles, real = agent.live_dlists, agent.live_handles, getattr(agent, refused_call)
        refused: list[bool] = []

        def refuse_first(*args: Any) -> Any:
            if not refused:
                refused.append(True)
                raise RuntimeError("NIXL_ERR_BACKEND: injected")
            return real(*args)

        setattr(agent, refused_call, refuse_first)
        prefill: LayeredPrefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(4)
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert refused and pair.received[D_ID] is None and pair.sent[P_ID] is None
        checked, wrong = pair.decode.verify(D_ID)
        assert checked == 3 * 2048 * 2 * 4 and wrong == 0
        metrics = pair.prefill.workers[0].runtime.ctx.metrics
        assert metrics.get("write.prep_ahead_failed") == 1 and not metrics.get("write.failed")
        pair.pump(
            lambda: agent.live_dlists == live and agent.live_handles == handles, what="every list and WRITE released"
        )


def _record_posts(agent: Any) -> list[tuple[int, bytes]]:
    """Wrap the fake agent's ``transfer``: each post's (descriptor rows copied, notification)."""
    posts: list[tuple[int, bytes]] = []
    real = agent.transfer

    def transfer(handle: Any, notif_msg: bytes = b"") -> Any:
        state = real(handle, notif_msg)
        posts.append((len(handle.src), handle.notif))
        return state

    agent.transfer = transfer
    return posts


def test_the_last_layer_write_is_made_when_the_push_opens_as_runs_and_only_posted_at_the_end() -> None:
    """After the forward's last layer, P only posts: that WRITE was made when the push opened
    (no make_prepped_xfer on the critical path), as runs even below post_runs_min_pieces (its
    lists are prepared ahead too), and it carries the completion. Earlier layers go by index."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, d_spec=spec, push_mode="layerwise", lease_duration=30.0) as pair:
        assert pair.prefill.workers[0].config.post_runs_min_pieces > 6  # 6 pieces: by index, normally
        _registered(pair)
        agent = _p_agent(pair)
        posts = _record_posts(agent)
        handles = agent.live_handles
        prefill: LayeredPrefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(3)
        pair.pump(lambda: len(posts) == 3, what="layers 0-2")
        assert [rows for rows, _ in posts] == [6, 6, 6]  # by index: one descriptor per block, K and V
        made = agent.calls["make_prepped_xfer"]
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the last layer")
        assert agent.calls["make_prepped_xfer"] == made  # the last post made nothing
        assert len(posts) == 4 and posts[-1][0] == 2  # two runs, K and V: three blocks in order on both sides
        assert posts[-1][1] and not any(n for _, n in posts[:3])  # the completion rode on it
        assert pair.received[D_ID] is None and pair.sent[P_ID] is None
        checked, wrong = pair.decode.verify(D_ID)
        assert checked == 3 * 2048 * 2 * 4 and wrong == 0
        pair.pump(lambda: agent.live_handles == handles, what="every WRITE of the push released")


def test_a_last_layer_write_made_ahead_is_released_unposted_when_the_push_ends_before_it() -> None:
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    cfg = dict(push_mode="layerwise", lease_duration=30.0, registration_timeout=60.0)
    with PushPair(p_spec=spec, d_spec=spec, **cfg) as pair:  # type: ignore[arg-type]
        _registered(pair)
        agent = _p_agent(pair)
        handles, dlists = agent.live_handles, agent.live_dlists
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0")
        assert agent.live_handles == handles + 2  # layer 0's, and the last layer's: made, not posted
        assert pair.decode.scheduler.abort_recv(D_ID)
        pair.pump(lambda: P_ID in pair.sent, what="P's push to end on D's abort")
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received, what="D's abort answered")
        assert pair.fabric.stats.transfers_posted == 1  # the made WRITE never went
        pair.pump(
            lambda: agent.live_handles == handles and agent.live_dlists == dlists, what="the push's WRITEs and lists"
        )


def test_a_push_stuck_past_write_timeout_posts_no_further_layer() -> None:
    """A layer's WRITE stuck past write_timeout: P never releases it (a release would not stop a
    copy already started), but it stops the push, so the layers the forward computes after
    that are never written into D; the push ends, failed, once the stuck WRITE has."""
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    cfg = dict(push_mode="layerwise", lease_duration=30.0, registration_timeout=60.0, write_timeout=0.3)
    with PushPair(p_spec=spec, d_spec=spec, **cfg) as pair:  # type: ignore[arg-type]
        gate = pair.fabric.faults.hold_transfer(times=1)
        pair.fabric.faults.release_continues(times=None)  # were it released, it would land later
        _registered(pair)
        prefill = pair.prefill.prefill_layers(P_ID, TOKENS, key="k")
        prefill.compute(1)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="layer 0, held")
        metrics = pair.prefill.workers[0].runtime.ctx.metrics
        pair.pump(lambda: metrics.get("write.timed_out") >= 1, what="write_timeout")
        prefill.compute(4)
        prefill.finish()
        for _ in range(40):
            pair.step()
        assert pair.fabric.stats.transfers_posted == 1  # nothing more went into D's blocks
        assert not _layer_bytes_landed(pair, "layer.1") and not _layer_bytes_landed(pair, "layer.3")
        assert D_ID not in pair.received and P_ID not in pair.sent  # the stuck WRITE still runs
        assert pair.fabric.in_flight() == 1 and pair.fabric.stats.transfers_cancelled == 0
        gate.open()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, timeout=20, what="the push ended")
        assert pair.sent[P_ID] is not None and pair.received[D_ID] is not None
        assert pair.fabric.stats.transfers_landed_after_release == 0
