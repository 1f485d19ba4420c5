"""PushScheduler: the engine scheduler's side, with no threads and no NIXL."""

from __future__ import annotations

import pytest

from pushactors import PushConfig, PushScheduler


def make(clock_value: list[float] | None = None, **cfg) -> PushScheduler:
    now = clock_value or [100.0]
    return PushScheduler(
        PushConfig(engine_id="eng", **cfg),
        side_channel_host="10.0.0.1",
        side_channel_port=5600,
        tp_size=2,
        pp_size=1,
        clock=lambda: now[0],
    )


def test_request_finished_leases_blocks_and_returns_decode_params() -> None:
    s = make(lease_duration=30.0)
    delay, params = s.request_finished("p-1", [3, 4, 5], {"do_remote_decode": True, "transfer_id": "t1"})
    assert delay is True
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "eng",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_tp_size": 2,
        "remote_pp_size": 1,
        "remote_request_id": "p-1",
        "transfer_id": "t1",
    }
    assert s.has_pending_push_work()
    meta = s.build_connector_meta()
    assert [f.request_id for f in meta.finished] == ["p-1"]
    assert meta.finished[0].block_ids == ((3, 4, 5),)
    assert meta.finished[0].deadline == pytest.approx(130.0)
    assert meta.clock == 100.0
    assert s.build_connector_meta().empty  # handed over once
    assert s.has_pending_push_work()  # still leased until a worker reports it
    s.update_connector_output(finished_sending=["p-1"])
    assert not s.has_pending_push_work()


@pytest.mark.parametrize("params", [None, {}, {"do_remote_decode": False}, {"do_remote_prefill": True}])
def test_request_finished_without_remote_decode_frees_normally(params) -> None:
    s = make()
    assert s.request_finished("p", [1], params) == (False, None)
    assert not s.has_pending_push_work()


def test_stage_registration_arms_watchdog_until_received_or_failed() -> None:
    s = make(registration_timeout=60.0)
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_host": "h",
        "remote_port": 1,
        "remote_tp_size": 1,
        "remote_request_id": "p-1",
    }
    s.stage_registration("d-1", [[7, 8], [9]], params)
    s.stage_registration("d-2", [1], params)
    meta = s.build_connector_meta()
    assert [r.request_id for r in meta.registrations] == ["d-1", "d-2"]
    assert meta.registrations[0].block_ids == ((7, 8), (9,))
    assert meta.registrations[0].deadline == pytest.approx(160.0)
    assert meta.registrations[0].remote_request_id == "p-1"
    s.update_connector_output(finished_recving=["d-1"])
    assert s.has_pending_push_work()
    s.update_connector_output(failed_recving=["d-2"])
    assert not s.has_pending_push_work()


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_prefill": True},
        {
            "do_remote_prefill": True,
            "remote_engine_id": "P",
            "remote_host": "h",
            "remote_port": "x",
            "remote_tp_size": 1,
        },
        {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1, "remote_tp_size": 0},
        {"do_remote_prefill": False},
        ["not", "a", "map"],
    ],
)
def test_bad_kv_transfer_params_fail_that_request_only(params) -> None:
    s = make()
    with pytest.raises(ValueError, match="kv_transfer_params"):
        s.stage_registration("d", [1], params)
    assert not s.has_pending_push_work()
    assert s.build_connector_meta().empty


def remote_prefill(**sizes: int) -> dict[str, object]:
    """A D request's kv_transfer_params naming P engine "P" (TP 1 unless ``sizes`` say)."""
    return {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1,
            "remote_tp_size": 1, **sizes}  # fmt: skip


def test_abort_before_the_meta_left_drops_the_registration() -> None:
    s = make()
    params = remote_prefill()
    s.stage_registration("d", [1], params)
    assert s.abort_recv("d") is True
    meta = s.build_connector_meta()
    # Never registered: no abort to P, but every worker still reports it, freeing the blocks.
    assert not meta.registrations and not meta.aborted
    assert [(r.request_id, r.reason) for r in meta.rejected] == [("d", "aborted before registration")]
    s.update_connector_output(failed_recving=["d"])
    assert not s.has_pending_push_work()
    assert s.abort_recv("never-seen") is False
    s.stage_registration("e", [1], params)
    s.build_connector_meta()
    assert s.abort_recv("e") is True  # registered: quarantined until a worker reports it
    meta = s.build_connector_meta()
    assert [a.request_id for a in meta.aborted] == ["e"]
    assert s.has_pending_push_work()
    s.update_connector_output(failed_recving=["e"])
    assert not s.has_pending_push_work()


@pytest.mark.parametrize(
    ("p_tp", "p_pp"),
    [(65536, 65536), (1, 65536), (65536, 1), (3, 1)],  # billions of P ranks, too many, ..., TP not dividing 2
)
def test_p_sizes_no_deployment_has_are_refused_before_any_list_is_built(p_tp: int, p_pp: int) -> None:
    """kv_transfer_params come from a client or router: sizes within the wire's limits but
    meaning billions of P ranks (each rank would list its sources on the engine's thread) are
    a clear error for that request, raised by the scheduler before any worker sees them."""
    s = make()
    params = remote_prefill(remote_tp_size=p_tp, remote_pp_size=p_pp)
    with pytest.raises(ValueError, match=r"P ranks|divide"):
        s.stage_registration("d-1", [1], params)
    assert s.build_connector_meta().registrations == ()
