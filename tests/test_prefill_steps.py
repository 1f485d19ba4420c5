"""The vLLM scheduler side of announced pushes (no vLLM here): which step ends a P request's
prefill, with which blocks, announced once; everything else left to the whole push."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

from pushactors.core.config import PushConfig
from pushactors.engine.scheduler import PushScheduler
from pushactors.integrations.prefill_steps import PrefillSteps, pushable_layerwise


def _scheduler(mode: str = "layerwise") -> PushScheduler:
    cfg = PushConfig(engine_id="p", role="producer", push_mode=mode)  # type: ignore[arg-type]
    return PushScheduler(cfg, side_channel_host="127.0.0.1", side_channel_port=5555)


def _request(rid: str, prompt: int, *, max_tokens: int = 1, remote: bool = True) -> Any:
    params = {"do_remote_decode": True} if remote else {}
    return NS(
        request_id=rid,
        prompt_token_ids=list(range(prompt)),
        kv_transfer_params=params,
        sampling_params=NS(max_tokens=max_tokens),
    )


def _output(scheduled: dict[str, int], new: list[Any] = (), cached: Any = None) -> Any:  # type: ignore[assignment]
    empty = NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return NS(num_scheduled_tokens=scheduled, scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or empty)


def test_only_one_token_remote_decode_requests_are_pushed_layer_wise() -> None:
    assert pushable_layerwise(_request("a", 10))
    assert not pushable_layerwise(_request("b", 10, max_tokens=4))  # it keeps decoding on P
    assert not pushable_layerwise(_request("c", 10, remote=False))


def test_a_prefill_in_one_step_is_announced_with_its_blocks_in_that_step() -> None:
    sched = _scheduler()
    steps = PrefillSteps(sched)
    steps.track(_request("r1", 40))
    new = NS(req_id="r1", block_ids=([4, 9, 2],), num_computed_tokens=0)
    assert steps.step(_output({"r1": 40}, [new])) == ["r1"]
    meta = sched.build_connector_meta()
    (fin,) = meta.finished
    assert fin.request_id == "r1" and fin.announced and fin.block_ids == ((4, 9, 2),)
    assert len(steps) == 0
    # request_finished only answers: the push is under way, the blocks stay leased.
    delay, out = sched.request_finished("r1", [4, 9, 2], {"do_remote_decode": True})
    assert delay and out is not None and not sched.build_connector_meta().finished


def test_a_chunked_prefill_is_announced_in_the_step_of_its_last_chunk_with_every_block() -> None:
    sched = _scheduler()
    steps = PrefillSteps(sched)
    steps.track(_request("r2", 100))
    new = NS(req_id="r2", block_ids=([1, 2],), num_computed_tokens=0)
    assert steps.step(_output({"r2": 32}, [new])) == []
    cached = NS(req_ids=["r2"], resumed_req_ids=set(), new_block_ids=[([3, 4],)], num_computed_tokens=[32])
    assert steps.step(_output({"r2": 32}, cached=cached)) == []
    cached = NS(req_ids=["r2"], resumed_req_ids=set(), new_block_ids=[([5, 6, 7],)], num_computed_tokens=[64])
    assert steps.step(_output({"r2": 36}, cached=cached)) == ["r2"]
    (fin,) = sched.build_connector_meta().finished
    assert fin.block_ids == ((1, 2, 3, 4, 5, 6, 7),)


def test_a_resumed_request_starts_its_blocks_over() -> None:
    sched = _scheduler()
    steps = PrefillSteps(sched)
    steps.track(_request("r3", 40))
    steps.step(_output({"r3": 16}, [NS(req_id="r3", block_ids=([1],), num_computed_tokens=0)]))
    cached = NS(req_ids=["r3"], resumed_req_ids={"r3"}, new_block_ids=[([8, 9, 10],)], num_computed_tokens=[0])
    assert steps.step(_output({"r3": 40}, cached=cached)) == ["r3"]
    assert sched.build_connector_meta().finished[0].block_ids == ((8, 9, 10),)


def test_whole_pushes_are_announced_for_the_forwards_end_unless_they_start_at_the_next_step() -> None:
    whole = _scheduler("whole")  # whole_push_start="forward_end", the default
    steps = PrefillSteps(whole)
    steps.track(_request("r4", 16))
    assert steps.step(_output({"r4": 16}, [NS(req_id="r4", block_ids=([1, 5],), num_computed_tokens=0)])) == ["r4"]
    (fin,) = whole.build_connector_meta().finished
    assert fin.announced and fin.block_ids == ((1, 5),)
    delay, out = whole.request_finished("r4", [1, 5], {"do_remote_decode": True})
    assert delay and out is not None and not whole.build_connector_meta().finished  # only answers

    cfg = PushConfig(engine_id="p", role="producer", whole_push_start="next_step")
    later = PushScheduler(cfg, side_channel_host="127.0.0.1", side_channel_port=5555)
    steps = PrefillSteps(later)
    steps.track(_request("r5", 16))
    assert steps.step(_output({"r5": 16}, [NS(req_id="r5", block_ids=([1],), num_computed_tokens=0)])) == []
    assert not later.build_connector_meta().finished  # request_finished pushes it, a step later
    later.request_finished("r5", [1], {"do_remote_decode": True})
    (fin,) = later.build_connector_meta().finished
    assert not fin.announced and fin.block_ids == ((1,),)
