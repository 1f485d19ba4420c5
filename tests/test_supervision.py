"""An actor that dies anyway is detected and the rank fails what it held, visibly."""

from __future__ import annotations

import time

from pushactors.protocol import HeartbeatArrived, PostPush
from pushactors.testing import PushPair, wait_until


def test_dead_matcher_fails_held_requests_and_marks_rank_unhealthy() -> None:
    with PushPair(reaper_tick=0.02) as pair:
        # Requests P holds (finished, no registration yet) and D holds (registered, P silent).
        for i in range(3):
            pair.prefill.prefill(f"p{i}-aaaaaaaa", 40, key=f"k{i}")
        pair.prefill.step()
        other_engine_alive = pair.decode.workers[0].runtime.writer
        p_worker = pair.prefill.workers[0]
        p_worker.ctx.faults.fail_handler("matcher", HeartbeatArrived, kill=True)
        p_worker.runtime.matcher.tell(HeartbeatArrived(ids=("x",), sender="test"))

        wait_until(lambda: not p_worker.healthy, timeout=5, what="supervisor to notice the dead matcher")
        assert "matcher actor died" in (p_worker.unhealthy_reason or "")
        pair.pump(lambda: len(pair.sent) == 3, timeout=5, what="held requests reported failed")
        assert all("matcher actor died" in (why or "") for why in pair.sent.values())
        assert not pair.prefill.held  # their blocks came back to the pool
        # The rank's other actors were stopped (NIXL released); other engines keep running.
        assert not p_worker.runtime.writer.is_alive()
        assert other_engine_alive.is_alive()
        # New work on the dead rank fails at once instead of hanging.
        pair.prefill.prefill("late-aaaaaaaa", 10, key="late")
        pair.pump(lambda: "late-aaaaaaaa" in pair.sent, timeout=5)
        assert pair.sent["late-aaaaaaaa"]


def test_dead_writer_fails_decode_side_requests() -> None:
    with PushPair(reaper_tick=0.02, abort_quarantine=0.5, write_timeout=0.1, lease_duration=0.5) as pair:
        params = pair.prefill.scheduler.decode_params("r-0")
        pair.decode.expect("r-0-bbbbbbbb", 40, params, key="k")
        d_reaper = pair.decode.workers[0].runtime.view("reaper")
        pair.pump(lambda: d_reaper.sizes()["recvs"] == 1, timeout=5, what="the registration to reach D's actors")
        # Kill D's writer via a message it will be told anyway.
        d_worker = pair.decode.workers[0]
        d_worker.ctx.faults.fail_handler("writer", PostPush, kill=True)
        d_worker.runtime.writer.tell(
            PostPush(request_id="x", block_ids=((),), registration=_any_registration(), expected_targets=1)
        )
        killed = time.monotonic()
        wait_until(lambda: not d_worker.healthy, timeout=5, what="supervisor to notice the dead writer")
        pair.pump(lambda: "r-0-bbbbbbbb" in pair.received, timeout=5, what="D request failed by supervision")
        # Its blocks are given back only after the quarantine: P may still have been writing.
        assert time.monotonic() - killed >= 0.5
        assert "writer actor died" in (pair.received["r-0-bbbbbbbb"] or "")


def test_handler_exception_keeps_the_pipeline_running() -> None:
    with PushPair() as pair:
        faults = pair.prefill.workers[0].ctx.faults
        faults.fail_handler("matcher", HeartbeatArrived)  # raises once, in the handler's place
        m = pair.prefill.workers[0].runtime.matcher
        m.tell(HeartbeatArrived(ids=("a",), sender="t"))
        wait_until(lambda: faults.raised == 1)
        params = pair.prefill.prefill("ok-aaaaaaaa", 40, key="k")
        pair.decode.expect("ok-bbbbbbbb", 40, params, key="k")
        pair.pump(lambda: "ok-bbbbbbbb" in pair.received)
        assert pair.received["ok-bbbbbbbb"] is None
        assert pair.decode.verify("ok-bbbbbbbb")[1] == 0
        assert pair.prefill.workers[0].healthy
        assert pair.prefill.workers[0].stats()["matcher.handler_error"] == 1


def _any_registration():
    from pushactors.protocol import Registration

    return Registration(
        request_id="x",
        decode_engine_id="d",
        decode_host="h",
        decode_port=1,
        decode_tp_size=1,
        local_block_ids=(1,),
        remote_engine_id="p",
        remote_host="h",
        remote_port=1,
        remote_tp_size=1,
    )


def test_a_stopped_actor_is_seen_at_once_by_the_hooks_and_the_supervisor() -> None:
    # The hooks look at the actors' refs only once one has said it stopped, and the supervisor
    # sleeps until one rings: a death must still reach them, whichever way the actor stopped.
    with PushPair() as pair:
        killed = pair.prefill.workers[0]
        killed.ctx.faults.fail_handler("matcher", HeartbeatArrived, kill=True)
        killed.runtime.matcher.tell(HeartbeatArrived(ids=("x",), sender="test"))
        wait_until(lambda: "matcher" in killed.ctx.stopped, timeout=5, what="the matcher to stop")
        assert killed.ctx.stopped[0] == "matcher"
        assert killed.runtime.check() == "matcher"
        assert not killed.healthy

        stopped = pair.decode.workers[0]
        assert stopped.runtime.check() is None and stopped.ctx.stopped == []
        stopped.runtime.reaper.stop()  # from outside, through Pykka's own stop
        assert stopped.ctx.stopped[0] == "reaper"
        assert stopped.runtime.check() == "reaper"
        assert not stopped.healthy
        # The death was handled: the rank's other actors are stopped too.
        wait_until(lambda: len(stopped.ctx.stopped) == 5, timeout=10, what="the rank's other actors to stop")
