"""Builders for protocol messages in tests: one place that knows every field's default."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from ..protocol import PUSH_REG_PREFIX, AgentInfo, ClockSample, Registration

DECODE = ("decode", "decode-host", 31000)
PREFILL = ("prefill", "prefill-host", 32000)


def registration(
    request_id: str = "d-1",
    blocks: tuple[int, ...] | tuple[tuple[int, ...], ...] = (5, 6),
    *,
    rank: int = 0,
    d_tp: int = 1,
    decode: tuple[str, str, int] = DECODE,
    prefill: tuple[str, str, int] = PREFILL,
    p_tp: int = 1,
    p_pp: int = 1,
    tid: str | None = None,
    remote_request_id: str | None = None,
    generation: int = 0,
) -> Registration:
    """A D rank's registration of ``blocks`` for ``request_id``, aimed at a P engine
    (``generation`` 0: one from a peer that mints none)."""
    return Registration(
        request_id=request_id,
        decode_engine_id=decode[0],
        decode_host=decode[1],
        decode_port=decode[2],
        decode_tp_size=d_tp,
        decode_tp_rank=rank,
        local_block_ids=blocks,  # type: ignore[arg-type]
        remote_engine_id=prefill[0],
        remote_host=prefill[1],
        remote_port=prefill[2],
        remote_tp_size=p_tp,
        remote_pp_size=p_pp,
        transfer_id=tid,
        remote_request_id=remote_request_id,
        generation=generation,
    )


def raw_registration(**changes: Any) -> bytes:
    """A ``PUSH_REG:`` notification with any field set to anything (``None`` removes it): for
    tests of malformed input, which a :class:`Registration` refuses to build."""
    fields: dict[str, Any] = {
        "type": "push_reg",
        "request_id": "m-bbbbbbbb",
        "decode_engine_id": "decode",
        "decode_host": "h",
        "decode_port": 1,
        "decode_tp_size": 1,
        "local_block_ids": [1, 2],
        "remote_engine_id": "prefill",
        "remote_host": "h",
        "remote_port": 1,
        "remote_tp_size": 1,
    }
    fields.update(changes)
    return PUSH_REG_PREFIX + msgspec.msgpack.encode({k: v for k, v in fields.items() if v is not None})


def agent_info(
    engine_id: str, agent: Any, layout: Any, *, tp_size: int = 1, tp_rank: int = 0, mem_type: str = "DRAM"
) -> AgentInfo:
    """What a rank whose NIXL ``agent`` registered ``layout`` advertises over its side channel."""
    return AgentInfo(
        engine_id=engine_id,
        agent_name=agent.name,
        agent_metadata=agent.get_agent_metadata(),
        mem_type=mem_type,  # type: ignore[arg-type]
        tp_size=tp_size,
        tp_rank=tp_rank,
        block_size=layout.block_size,
        regions=layout.region_infos,
        clock=ClockSample(monotonic=time.monotonic(), wall=time.time()),
    )
