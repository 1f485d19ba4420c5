"""kv_transfer_params in llm-d's routing-sidecar shapes, with no vLLM: P's answer carries the push
identity the sidecar caches, and D accepts the decode legs the sidecar builds from it (serial:
P's answer copied; concurrent: the cached identity plus per-request fields). The same shapes
against real vLLM engines: tests/test_vllm_llmd.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pushactors import PushConfig, PushScheduler
from pushactors.integrations.transfer_params import (
    PUSH_IDENTITY_FIELDS,
    check_decode_params,
    prefill_answer,
    push_identity,
)
from pushactors.protocol import parse_kv_transfer_params

# What llm-d's sidecar puts in the prefill leg (pkg/sidecar/proxy/connector_nixlv2.go, NIXL push).
LLMD_PREFILL_LEG = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
    "transfer_id": "xfer-5b6e4a52-8e8c-11f0-9f0b-0242ac120002",
}


def p_scheduler(tp: int = 2, pp: int = 1) -> PushScheduler:
    return PushScheduler(
        PushConfig(engine_id="prefill-0"), side_channel_host="10.0.0.1", side_channel_port=5600, tp_size=tp, pp_size=pp
    )


def d_scheduler() -> PushScheduler:
    return PushScheduler(
        PushConfig(engine_id="decode-0", role="consumer"), side_channel_host="10.0.0.2", side_channel_port=5700
    )


def answer_of(p: PushScheduler, rid: str, blocks: list[int], leg: dict[str, Any]) -> dict[str, Any]:
    """P's answer as the connector returns it, after the JSON trip to the router and back."""
    delay, out = p.request_finished(rid, [blocks], leg)
    assert delay is True and out is not None
    answer = prefill_answer(out, tp_size=p.tp_size, pp_size=p.pp_size, block_ids=blocks)
    decoded: dict[str, Any] = json.loads(json.dumps(answer))
    return decoded


def staged(d: PushScheduler, rid: str, params: dict[str, Any]) -> Any:
    """What the connector's D does with a decode leg: check it, then stage its registration."""
    check_decode_params(params)
    d.stage_registration(rid, [0, 1], params)
    (reg,) = d.build_connector_meta().registrations
    return reg


def test_p_answers_an_llmd_prefill_leg_with_the_push_identity_it_caches() -> None:
    p = p_scheduler(tp=2)
    answer = answer_of(p, "cmpl-abc-0-1a2b3c4d", [3, 4, 5], dict(LLMD_PREFILL_LEG))
    assert answer["transfer_mode"] == "push"
    assert push_identity(answer) == {
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 2,
        "transfer_mode": "push",
        "pp_size": 1,
    }
    # Our names and the pull proxies' stay in the same answer.
    assert answer["remote_tp_size"] == 2 and answer["remote_pp_size"] == 1
    assert answer["remote_request_id"] == "cmpl-abc-0-1a2b3c4d"
    assert answer["transfer_id"] == LLMD_PREFILL_LEG["transfer_id"]
    assert answer["remote_block_ids"] == [[3, 4, 5]]
    assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False


def test_the_identity_is_the_same_in_every_answer_of_one_engine() -> None:
    # The sidecar keeps its cached identity (and sends legs at once) only while P's answers
    # repeat it field for field; a changing one sends every request serially.
    p = p_scheduler()
    identities = [
        push_identity(
            answer_of(
                p, f"cmpl-r{i}-0-0000000{i}", list(range(i + 1)), {**LLMD_PREFILL_LEG, "transfer_id": f"xfer-{i}"}
            )
        )
        for i in range(4)
    ]
    assert identities[0] is not None and all(i == identities[0] for i in identities)


def test_identity_fields_are_json_strings_or_numbers_never_null() -> None:
    # The sidecar drops an identity with a null or non-scalar field, even an optional one.
    answer = answer_of(p_scheduler(), "cmpl-x-0-00000000", [1], dict(LLMD_PREFILL_LEG))
    for name in PUSH_IDENTITY_FIELDS:
        if name in answer:
            assert isinstance(answer[name], (str, int)) and not isinstance(answer[name], bool), name
    assert push_identity({**answer, "dcp_size": None}) is None
    assert push_identity({**answer, "remote_port": None}) is None
    assert push_identity({**answer, "tp_size": True}) is None
    assert push_identity({k: v for k, v in answer.items() if k != "transfer_mode"}) is None
    assert push_identity({**answer, "transfer_mode": "pull"}) is None
    assert push_identity([answer]) is None


def test_d_accepts_the_serial_decode_leg_p_answer_copied_with_the_transfer_id() -> None:
    p, d = p_scheduler(tp=2), d_scheduler()
    answer = answer_of(p, "cmpl-abc-0-1a2b3c4d", [7, 8], dict(LLMD_PREFILL_LEG))
    leg = {**answer, "transfer_id": LLMD_PREFILL_LEG["transfer_id"]}
    reg = staged(d, "cmpl-abc-0-9f8e7d6c", leg)
    assert (reg.remote_engine_id, reg.remote_host, reg.remote_port) == ("prefill-0", "10.0.0.1", 5600)
    assert (reg.remote_tp_size, reg.remote_pp_size) == (2, 1)
    assert reg.transfer_id == LLMD_PREFILL_LEG["transfer_id"]
    assert reg.remote_request_id == "cmpl-abc-0-1a2b3c4d"


def test_d_accepts_the_concurrent_decode_leg_built_from_the_cached_identity() -> None:
    p, d = p_scheduler(tp=2), d_scheduler()
    identity = push_identity(answer_of(p, "cmpl-first-0-00000001", [1], dict(LLMD_PREFILL_LEG)))
    assert identity is not None
    # Exactly what the sidecar sends D while P computes (no remote_block_ids, no remote_tp_size).
    leg = json.loads(
        json.dumps(
            {
                **identity,
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_request_id": "6f1c2e90-8e8c-11f0-9f0b-0242ac120002",
                "transfer_id": "xfer-6f1c2e91-8e8c-11f0-9f0b-0242ac120002",
            }
        )
    )
    reg = staged(d, "cmpl-6f1c2e90-8e8c-11f0-9f0b-0242ac120002-0-abcdef01", leg)
    assert (reg.remote_engine_id, reg.remote_host, reg.remote_port) == ("prefill-0", "10.0.0.1", 5600)
    assert (reg.remote_tp_size, reg.remote_pp_size) == (2, 1)
    assert reg.transfer_id == "xfer-6f1c2e91-8e8c-11f0-9f0b-0242ac120002"  # pairs with P's leg


def test_our_own_decode_leg_still_works_unchanged() -> None:
    d = d_scheduler()
    leg = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_tp_size": 1,
        "transfer_id": "t-1",
    }
    reg = staged(d, "cmpl-ours-0-00000000", leg)
    assert (reg.remote_tp_size, reg.remote_pp_size, reg.transfer_id) == (1, 1, "t-1")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"transfer_mode": "pull"}, "transfer_mode 'pull'"),
        ({"transfer_mode": "read"}, "transfer_mode 'read'"),
        ({"transfer_mode": 1}, "transfer_mode 1"),
        ({"dcp_size": 2}, "dcp_size 2"),
        ({"dcp_size": True}, "dcp_size True"),
        ({"tp_size": 2, "remote_tp_size": 1}, "remote_tp_size 1 and tp_size 2 disagree"),
        ({"pp_size": 2, "remote_pp_size": 1}, "remote_pp_size 1 and pp_size 2 disagree"),
    ],
)
def test_a_decode_leg_asking_for_what_d_cannot_do_is_refused_with_its_reason(
    change: dict[str, Any], reason: str
) -> None:
    leg = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "transfer_mode": "push",
        **change,
    }
    with pytest.raises(ValueError, match="invalid kv_transfer_params") as info:
        check_decode_params(leg)
    assert reason in str(info.value)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"remote_host": None}, "needs remote_host"),
        ({"tp_size": None}, "needs remote_tp_size"),
        ({"remote_port": "5600"}, "remote_port"),
        ({"remote_port": 70000}, "remote_port"),
        ({"tp_size": 0}, "tp_size"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ],
)
def test_malformed_identity_fields_fail_the_request_with_a_reason(change: dict[str, Any], reason: str) -> None:
    # The connector turns this ValueError into a failed receive of that one request.
    leg = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "transfer_mode": "push",
        **change,
    }
    with pytest.raises(ValueError, match="invalid kv_transfer_params") as info:
        check_decode_params(leg)
        parse_kv_transfer_params(leg)
    assert reason in str(info.value)


def test_an_llmd_prefill_leg_cancelled_on_p_fails_ds_registration_by_its_transfer_id() -> None:
    # The sidecar cancels P's leg when D's fails first, or the client leaves: P leases nothing,
    # and the push failure it sends names the transfer id D registered under.
    p = p_scheduler()
    assert p.request_cancelled("cmpl-c-0-00000000", dict(LLMD_PREFILL_LEG), reason="aborted on P")
    meta = p.build_connector_meta()
    assert not meta.finished
    (cancelled,) = meta.cancelled
    assert cancelled.transfer_id == LLMD_PREFILL_LEG["transfer_id"]
