"""core/timeline.py: each push's critical steps stamped in memory (PushConfig.timeline)."""

from __future__ import annotations

import threading

import pytest

from pushactors.core.config import ConfigError, PushConfig
from pushactors.core.timeline import STEPS, Timeline
from pushactors.testing import PushPair, SimSpec

P_ID, D_ID = "tl-1-aaaaaaaa", "tl-1-bbbbbbbb"
VERIFY_STEPS = {"p.digested", "d.verify_start", "d.verified"}


def test_the_first_stamp_of_a_step_wins_and_take_empties_it() -> None:
    t = Timeline()
    t.mark("a", "p.post_start", 1.0)
    t.mark("a", "p.post_start", 2.0)  # a second post of the same request (layer-wise: never)
    t.mark("a", "p.done", 3.0)
    t.mark("b", "d.read", 4.0)
    assert t.take() == {"a": {"p.post_start": 1.0, "p.done": 3.0}, "b": {"d.read": 4.0}}
    assert t.take() == {} and len(t) == 0


def test_only_the_latest_requests_are_kept_and_the_rest_counted() -> None:
    t = Timeline(capacity=2)
    for i, rid in enumerate("abc"):
        t.mark(rid, "p.done", float(i))
    t.mark("b", "d.read", 9.0)  # a request still kept takes more steps without pushing any out
    assert t.take() == {"b": {"p.done": 1.0, "d.read": 9.0}, "c": {"p.done": 2.0}}
    assert t.dropped == 1


def test_marks_from_several_threads_are_all_kept() -> None:
    t = Timeline()

    def stamp(n: int) -> None:
        for i in range(500):
            t.mark(f"r{n}-{i}", "d.poll", float(i))

    threads = [threading.Thread(target=stamp, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(t.take()) == 2000


def _steps(pair: PushPair) -> tuple[dict[str, float], dict[str, float]]:
    p_tl, d_tl = pair.prefill.workers[0].ctx.timeline, pair.decode.workers[0].ctx.timeline
    assert p_tl is not None and d_tl is not None
    return p_tl.take().get(P_ID, {}), d_tl.take().get(D_ID, {})


def test_a_whole_push_stamps_every_step_in_order_on_both_sides() -> None:
    with PushPair(timeline=True) as pair:
        pair.prefill.prefill(P_ID, 48, key="k")
        params = pair.prefill.scheduler.decode_params(P_ID, None)
        pair.decode.expect(D_ID, 48, params, key="k")
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        p, d = _steps(pair)
    assert list(p) == [s for s in STEPS if s.startswith("p.") and s not in VERIFY_STEPS]
    assert list(d) == [s for s in STEPS if s.startswith("d.") and s not in VERIFY_STEPS]
    assert p["p.post_start"] <= p["p.post_end"] <= p["p.done"]
    # One clock: D cannot read the completion before P began the post it rides on (the post's
    # end and P's DONE are stamped after calls D may already have been answered by).
    assert p["p.post_start"] <= d["d.read"]
    assert d["d.poll"] <= d["d.read"] <= d["d.received"]


def test_a_verified_push_stamps_ps_digest_and_ds_check_after_every_byte_and_digest_is_in() -> None:
    with PushPair(timeline=True, verify="all") as pair:
        pair.prefill.prefill(P_ID, 48, key="k")
        params = pair.prefill.scheduler.decode_params(P_ID, None)
        pair.decode.expect(D_ID, 48, params, key="k")
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        assert pair.decode.workers[0].ctx.metrics.snapshot().get("recv.verified") == 1
        p, d = _steps(pair)
    assert set(p) == {s for s in STEPS if s.startswith("p.")}
    assert set(d) == {s for s in STEPS if s.startswith("d.")}
    # P digests after its post; D's pass begins once the bytes landed (maybe before P's digest
    # is read), and the request lands after the check.
    assert p["p.post_end"] <= p["p.digested"]
    assert d["d.verify_start"] <= d["d.verified"] <= d["d.received"] and d["d.read"] <= d["d.received"]
    assert p["p.post_start"] <= d["d.verify_start"]


def test_a_layerwise_push_stamps_the_last_layers_post() -> None:
    spec = SimSpec(num_layers=4, num_blocks=32, shuffle_blocks=False)
    with PushPair(p_spec=spec, push_mode="layerwise", lease_duration=30.0, timeline=True) as pair:
        params = pair.prefill.scheduler.decode_params(P_ID, None)
        pair.decode.expect(D_ID, 48, params, key="k")
        pair.pump(lambda: pair.prefill.workers[0].runtime.snapshot()["matcher"].get("pending_registrations") == 1)
        prefill = pair.prefill.prefill_layers(P_ID, 48, key="k")
        prefill.compute(3)
        pair.pump(lambda: pair.fabric.stats.transfers_posted == 3, what="layers 0-2")
        assert _steps(pair) == ({}, {})  # nothing stamped before the last layer's post
        prefill.finish()
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        p, d = _steps(pair)
    assert p["p.post_start"] <= p["p.post_end"] <= p["p.done"]
    assert p["p.post_start"] <= d["d.read"] and d["d.poll"] <= d["d.read"] <= d["d.received"]


def test_a_completion_for_another_generation_from_the_bound_p_stamps_nothing() -> None:
    """A late completion (it answers another registration of the request) from the very agent
    D handshook with is not the one that lands the request: D's steps stay unstamped until the
    live one comes."""
    from pushactors.protocol.wire import encode_completion

    with PushPair(timeline=True) as pair:
        params = pair.prefill.scheduler.decode_params(P_ID, None)
        pair.decode.expect(D_ID, 48, params, key="k")
        p_writer = pair.prefill.workers[0]
        pair.pump(lambda: p_writer.runtime.snapshot()["matcher"].get("pending_registrations") == 1)
        d_writer = pair.decode.workers[0]
        stale = encode_completion(D_ID, 1, 0x5EED)  # not the generation D registered
        pair.fabric.get(d_writer.ctx.agent_name).inject_notif(p_writer.ctx.agent_name, stale)
        pair.pump(lambda: d_writer.stats().get("notif.kind.completion", 0) == 1, what="the stale completion read")
        timeline = d_writer.ctx.timeline
        assert timeline is not None and timeline.take() == {} and D_ID not in pair.received
        pair.prefill.prefill(P_ID, 48, key="k")
        pair.pump(lambda: D_ID in pair.received, what="the push")
        assert pair.received[D_ID] is None
        assert list(timeline.take()[D_ID]) == ["d.poll", "d.read", "d.received"]


def test_the_setting_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="timeline must be true or false"):
        PushConfig(engine_id="e", timeline="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="timeline"):
        PushConfig.from_dict({"engine_id": "e", "timeline": 1})


def test_off_by_default_nothing_is_kept() -> None:
    with PushPair() as pair:
        assert pair.prefill.workers[0].ctx.timeline is None and pair.decode.workers[0].ctx.timeline is None


def test_a_completion_from_an_agent_no_handshake_bound_stamps_nothing() -> None:
    """Only a sender verified as a P rank may stamp D's steps: a stranger's completion (forged,
    or from a P whose handshake never happened) is dropped as before and leaves no trace here."""
    from pushactors.protocol.wire import encode_completion

    with PushPair(timeline=True) as pair:
        d_writer = pair.decode.workers[0]
        stranger = pair.fabric.agent("stranger")
        stranger.add_remote_agent(pair.fabric.get(d_writer.ctx.agent_name).get_agent_metadata())
        stranger.send_notif(d_writer.ctx.agent_name, encode_completion(D_ID, 1, 1))
        pair.pump(lambda: d_writer.stats().get("notif.kind.completion", 0) >= 1, what="the stranger's completion read")
        timeline = d_writer.ctx.timeline
        assert timeline is not None and timeline.take() == {}


def test_d_reports_a_request_to_the_engine_before_it_stamps_the_timeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first decode token waits on D's report; the timeline's stamps are history."""
    with PushPair(timeline=True) as pair:
        ctx = pair.decode.workers[0].ctx
        assert ctx.timeline is not None
        order: list[str] = []
        report, mark = ctx.outbox.received, ctx.timeline.mark

        def reported(request_id: str) -> None:
            order.append("report")
            report(request_id)

        def stamped(request_id: str, step: str, at: float) -> None:
            order.append(step)
            mark(request_id, step, at)

        monkeypatch.setattr(ctx.outbox, "received", reported)
        monkeypatch.setattr(ctx.timeline, "mark", stamped)
        pair.prefill.prefill(P_ID, 48, key="k")
        params = pair.prefill.scheduler.decode_params(P_ID, None)
        pair.decode.expect(D_ID, 48, params, key="k")
        pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
        assert pair.received[D_ID] is None and pair.decode.verify(D_ID)[1] == 0
        assert order == ["report", "d.poll", "d.read", "d.received"]
        steps = ctx.timeline.take()[D_ID]
        assert steps["d.poll"] <= steps["d.read"] <= steps["d.received"]
