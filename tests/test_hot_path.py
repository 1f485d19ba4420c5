"""The hot path's structure, counted exactly (no timing): how many mailbox hand-offs a push
takes from P's ``start_load_kv`` to D's ``get_finished``, and where its WRITE is planned."""

from __future__ import annotations

import pytest

from pushactors.logs import capture_events
from pushactors.testing import PushPair, SimSpec

pytestmark = pytest.mark.timeout(60)

P_ID, D_ID = "hot-1-aaaaaaaa", "hot-1-bbbbbbbb"


def mailbox_events(events: list[dict[str, object]]) -> list[dict[str, object]]:
    """The one event per mailbox message (ticks log their own, without ``wait_ms``)."""
    return [e for e in events if "wait_ms" in e and "msg" in e]


def test_a_push_whose_registration_is_held_takes_two_hand_offs() -> None:
    with PushPair(p_spec=SimSpec(num_layers=2, num_blocks=16)) as pair:
        params = pair.prefill.scheduler.decode_params("hot-1", None)
        pair.decode.expect(D_ID, 32, params, key="hot")  # D registers while P prefills
        p_writer = pair.prefill.workers[0].runtime
        pair.pump(lambda: p_writer.snapshot()["matcher"].get("pending_registrations") == 1, what="registration held")
        with capture_events() as events:
            pair.prefill.prefill(P_ID, 32, key="hot")
            pair.pump(lambda: D_ID in pair.received and P_ID in pair.sent, what="the push")
            d_metrics = pair.decode.workers[0].runtime.ctx.metrics
            # The reaper hears of the completion too, off the request's path (below).
            pair.pump(lambda: d_metrics.get("recv.finished") == 1, what="D's reaper to count the completion")
        assert pair.received[D_ID] is None and pair.sent[P_ID] is None
        handled = mailbox_events(list(events))
        # Every mailbox message on either side that carries this request after P finished it.
        p_side = [(e["actor"], e["msg"]) for e in handled if e.get("request_id") == P_ID]
        d_side = [(e["actor"], e["msg"]) for e in handled if e.get("request_id") == D_ID]
        # The critical path: worker → matcher (match), matcher → writer (a planned WRITE); on
        # D the writer that reads the completion reports the request itself (core/claims.py),
        # and the engine reads it on its next get_finished. The lease's arm and clear, the
        # matcher's forget and D's reaper counting the completion are side paths.
        assert [m for m in p_side if m[1] in ("blocks_finished", "post_push")] == [
            ("matcher", "blocks_finished"),
            ("writer", "post_push"),
        ]
        assert set(p_side) - {("matcher", "blocks_finished"), ("writer", "post_push")} <= {
            ("reaper", "arm_lease"),
            ("reaper", "clear_lease"),
            ("matcher", "forget"),
        }
        assert d_side == [("reaper", "recv_notified")]
        assert d_metrics.get("recv.taken") == 1
        (notified,) = [e for e in handled if e.get("request_id") == D_ID]
        assert notified["taken"] is True
        # The writer posted the matcher's plan: it planned nothing itself.
        assert pair.prefill.workers[0].runtime.ctx.metrics.get("write.preplanned") == 1


def test_write_settled_says_how_often_p_asked_nixl_about_the_write() -> None:
    """UCX moves a WRITE only while P progresses it: the settle event of a WRITE that ran on
    after its post says how often P asked NIXL about it since (at least the ask that saw it
    end, after every ask while it was held) and the longest gap between asks."""
    with PushPair(p_spec=SimSpec(num_layers=2, num_blocks=16)) as pair:
        gate = pair.fabric.faults.hold_transfer(match=lambda ctx: ctx.op == "WRITE")
        params = pair.prefill.scheduler.decode_params("hot-2", None)
        with capture_events() as events:
            pair.decode.expect("hot-2-bbbbbbbb", 32, params, key="hot")
            pair.prefill.prefill("hot-2-aaaaaaaa", 32, key="hot")
            pair.pump(lambda: pair.fabric.stats.transfers_posted == 1, what="the WRITE posted")
            gate.open()
            # P reports the request sent after its settle event; D may know first (the
            # completion leaves from the check that saw the WRITE end).
            pair.pump(lambda: "hot-2-bbbbbbbb" in pair.received and "hot-2-aaaaaaaa" in pair.sent, what="the push")
        (settled,) = [e for e in events if e["event"] == "write.settled" and e["request_id"] == "hot-2-aaaaaaaa"]
        assert settled["checks"] >= 2  # asked while held, then the ask that saw it end
        assert 0.0 < settled["check_gap_ms"] <= settled["ms"]
        assert 0.0 <= settled["seen_ms"] <= settled["ms"]  # the check that saw it end, before the event


def test_d_says_when_the_poll_that_read_a_completion_began_and_p_where_a_layer_post_went() -> None:
    """The readings that tell D's pick-up from P's WRITE: ``notif.routed`` carries how long
    after the writer's previous poll the one that read it began (``poll_gap_ms``) and how
    long since it began (``read_ms``); each ``write.layer_posted`` splits its post time."""
    from pushactors.testing import LayeredPrefill

    spec = SimSpec(num_layers=2, num_blocks=16)
    with PushPair(p_spec=spec, push_mode="layerwise") as pair:
        params = pair.prefill.scheduler.decode_params("hot-3", None)
        with capture_events() as events:
            pair.decode.expect("hot-3-bbbbbbbb", 32, params, key="hot")
            p_writer = pair.prefill.workers[0].runtime
            pair.pump(lambda: p_writer.snapshot()["matcher"].get("pending_registrations") == 1, what="held")
            prefill: LayeredPrefill = pair.prefill.prefill_layers("hot-3-aaaaaaaa", 32, key="hot")
            prefill.compute(2)
            prefill.finish()
            # Both sides' events: D logs the routing after it reported the request, P its last
            # post after the completion riding on it may have landed.
            pair.pump(
                lambda: (
                    "hot-3-bbbbbbbb" in pair.received
                    and "hot-3-aaaaaaaa" in pair.sent
                    and any(e["event"] == "notif.routed" and e.get("kind") == "Completion" for e in list(events))
                ),
                what="the push",
            )
        (routed,) = [e for e in events if e["event"] == "notif.routed" and e.get("kind") == "Completion"]
        # None: this was D's writer's first poll (its ticks start with its first work).
        assert routed["poll_gap_ms"] is None or routed["poll_gap_ms"] > 0.0
        assert routed["read_ms"] >= 0.0
        assert 0.0 <= routed["nixl_ms"] <= routed["read_ms"]
        posts = [e for e in events if e["event"] == "write.layer_posted"]
        assert len(posts) == 2
        for post in posts:
            assert {"prep_ms", "make_ms", "transfer_ms"} <= set(post)
            assert post["make_ms"] + post["transfer_ms"] <= post["post_ms"]
