"""Engine meta: what the scheduler hands its workers each step, and kv_transfer_params."""

from __future__ import annotations

from typing import Union

import msgspec
from msgspec import Struct

from .fields import (
    BlockGroups,
    EngineId,
    Host,
    Port,
    Reason,
    RequestId,
    Size,
)


# ============================================================================================
# Engine meta: scheduler → workers, once per engine step
# ============================================================================================
class StagedRegistration(Struct, frozen=True, kw_only=True, tag="staged_reg"):
    """D side: blocks allocated for a remote prefill; each D rank registers them with P."""

    request_id: RequestId
    block_ids: BlockGroups
    remote_engine_id: EngineId
    remote_host: Host
    remote_port: Port
    remote_tp_size: Size
    remote_pp_size: Size = 1
    transfer_id: Union[RequestId, None] = None
    remote_request_id: Union[RequestId, None] = None
    deadline: float  # scheduler clock
    skip_blocks: tuple[int, ...] = ()  # per group, D's cached blocks before these
    # D's own side channel, when the scheduler serves it (vLLM); else the worker's publisher.
    decode_host: Union[Host, None] = None
    decode_port: Union[Port, None] = None


class FinishedPush(Struct, frozen=True, kw_only=True, tag="finished_push"):
    """P side: a finished prefill whose blocks stay leased until they are pushed."""

    request_id: RequestId
    block_ids: BlockGroups
    transfer_id: Union[RequestId, None] = None
    deadline: float  # scheduler clock
    # Announced before the step whose forward computes its last prompt tokens: layer-wise, the
    # worker marks its layers as the forward saves them (PushConfig.push_mode); whole, it
    # hands the blocks over when that forward ends (PushConfig.whole_push_start).
    announced: bool = False


class AbortedRecv(Struct, frozen=True, kw_only=True, tag="aborted_recv"):
    """D side: the engine gave up on a request whose blocks may already be registered."""

    request_id: RequestId


class CancelledPush(Struct, frozen=True, kw_only=True, tag="cancelled_push"):
    """P side: a request that will not finish (aborted, failed): its registrations are refused."""

    request_id: RequestId
    transfer_id: Union[RequestId, None] = None
    reason: Reason = "aborted on P"


class RejectedRecv(Struct, frozen=True, kw_only=True, tag="rejected_recv"):
    """D side: the scheduler could not register a request (bad kv_transfer_params); every rank
    reports it as a failed receive so the engine ends it visibly."""

    request_id: RequestId
    reason: Reason


class PushConnectorMeta(Struct, frozen=True, kw_only=True, tag="push_meta"):
    registrations: tuple[StagedRegistration, ...] = ()
    finished: tuple[FinishedPush, ...] = ()
    aborted: tuple[AbortedRecv, ...] = ()
    rejected: tuple[RejectedRecv, ...] = ()
    cancelled: tuple[CancelledPush, ...] = ()
    clock: float  # the scheduler's time.monotonic() when this meta was built

    @property
    def empty(self) -> bool:
        """Nothing for the workers this step (the engine may skip handing it over)."""
        return not (self.registrations or self.finished or self.aborted or self.rejected or self.cancelled)


class KVTransferParams(Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The kv_transfer_params of one engine request (vLLM-compatible field names)."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: Union[EngineId, None] = None
    remote_host: Union[Host, None] = None
    remote_port: Union[Port, None] = None
    remote_tp_size: Union[Size, None] = None
    remote_pp_size: Size = 1
    remote_request_id: Union[RequestId, None] = None
    transfer_id: Union[RequestId, None] = None
    # The transfer id names one router request of several prompts (each its own engine request,
    # the prompt's index in its id): each leg is keyed by ``<transfer_id>/<base id>``, so the
    # sub-requests stay apart and none pairs with a request of an earlier router request.
    transfer_per_prompt: bool = False
    remote_block_ids: Union[list[object], None] = None
    # vLLM's own connectors name P's sizes tp_size / pp_size; accepted as aliases.
    tp_size: Union[Size, None] = None
    pp_size: Union[Size, None] = None


def parse_kv_transfer_params(params: object) -> KVTransferParams:
    """Validate a request's kv_transfer_params; raise ValueError with a clear reason."""
    try:
        parsed = msgspec.convert(params, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid kv_transfer_params: {exc}") from None
    if parsed.remote_tp_size is None and parsed.tp_size is not None:
        parsed = msgspec.structs.replace(parsed, remote_tp_size=parsed.tp_size)
    if parsed.pp_size is not None and isinstance(params, dict) and "remote_pp_size" not in params:
        parsed = msgspec.structs.replace(parsed, remote_pp_size=parsed.pp_size)
    if parsed.do_remote_prefill:
        missing = [
            f
            for f in ("remote_engine_id", "remote_host", "remote_port", "remote_tp_size")
            if getattr(parsed, f) is None
        ]
        if missing:
            raise ValueError("invalid kv_transfer_params: do_remote_prefill needs " + ", ".join(missing))
    return parsed
