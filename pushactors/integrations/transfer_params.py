"""The kv_transfer_params routers read from P's answer and write into D's request (no vLLM needed).

Three kinds of router drive a pushactors P/D pair, and each is served by the same fields:

- ``pushactors router`` sends both legs at once with P's identity in D's leg (our names:
  ``remote_tp_size``, ``remote_pp_size``) and a ``transfer_id`` it minted for both legs;
- sequential proxies built for vLLM's pull connectors copy P's answer to D verbatim;
- push routers such as llm-d's routing sidecar (``--kv-connector nixlv2`` in its NIXL push mode)
  copy P's first answer to D and cache P's *push identity* from it: ``remote_engine_id``,
  ``remote_host``, ``remote_port``, ``tp_size`` and ``transfer_mode: "push"`` (required), with
  ``pp_size`` and ``dcp_size`` when present. Later requests to that P endpoint go out on both legs
  at once, D's leg carrying exactly that identity plus ``do_remote_prefill``,
  ``do_remote_decode: false``, ``remote_request_id`` (the router's request id) and the
  ``transfer_id`` also sent to P. The router keeps a cached identity only while P's answers
  repeat it field for field, and takes only JSON strings and numbers as its values.

:func:`prefill_answer` builds P's answer so that all three find their fields in it;
:func:`check_decode_params` refuses, with one clear reason, a decode leg that asks for what a
pushactors D cannot do (field presence and types are checked by
:func:`~pushactors.protocol.parse_kv_transfer_params`); :func:`push_identity` is the identity a
push router takes from an answer (``None`` when it would take none).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

TRANSFER_MODE_PUSH = "push"

# P's push identity as a push router caches it: field -> whether P's answer must carry it.
PUSH_IDENTITY_FIELDS: Mapping[str, bool] = {
    "remote_engine_id": True,
    "remote_host": True,
    "remote_port": True,
    "tp_size": True,
    "transfer_mode": True,
    "pp_size": False,
    "dcp_size": False,
}

# Our name and vLLM's name of each of P's sizes: a leg may carry both, never two values.
_SIZE_ALIASES = (("remote_tp_size", "tp_size"), ("remote_pp_size", "pp_size"))

IdentityValue = Union[str, int, float]


def prefill_answer(
    decode_params: Mapping[str, Any],
    *,
    tp_size: int,
    pp_size: int,
    block_ids: Sequence[int] | Sequence[Sequence[int]],
) -> dict[str, Any]:
    """P's answer to a prefill leg: ``decode_params`` (P's identity under our names, from
    :meth:`~pushactors.engine.scheduler.PushScheduler.decode_params`) plus vLLM's names of P's
    sizes, the finished blocks (pull connectors' ``remote_block_ids``, per KV cache group; a
    pushactors D ignores them) and ``transfer_mode: "push"``. Every value a push router caches
    is a string or a number, the same in every answer of one P engine."""
    answer = dict(decode_params)
    flat = [b for b in block_ids if isinstance(b, int)]
    # One group's flat list (vLLM's hybrid allocator off), else one list per KV cache group.
    groups = [flat]
    if len(flat) != len(block_ids):
        groups = [[int(b) for b in g] for g in block_ids if not isinstance(g, int)]
    answer.update(tp_size=tp_size, pp_size=pp_size, remote_block_ids=groups, transfer_mode=TRANSFER_MODE_PUSH)
    return answer


def push_identity(params: object) -> dict[str, IdentityValue] | None:
    """The fields a push router caches from P's answer ``params``: every required field of
    :data:`PUSH_IDENTITY_FIELDS` and the optional ones present, each a string or a number; None
    unless ``transfer_mode`` is ``"push"`` and all of that holds (the router then caches
    nothing and sends the legs of the next request to this P one after the other)."""
    if not isinstance(params, Mapping) or params.get("transfer_mode") != TRANSFER_MODE_PUSH:
        return None
    identity: dict[str, IdentityValue] = {}
    for name, required in PUSH_IDENTITY_FIELDS.items():
        if name not in params and not required:
            continue
        value = params.get(name)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            return None
        identity[name] = value
    return identity


def check_decode_params(params: Mapping[str, Any]) -> None:
    """Refuse a decode leg's params that a pushactors D cannot serve; ValueError names the field.

    - ``transfer_mode``, when given, must be ``"push"``: a D asked to read P's blocks itself (a
      pull-mode router or another connector's params) would wait for a push nobody sends.
    - ``dcp_size``, when given, must be 1: P's KV split by decode context parallelism is not a
      layout pushactors moves.
    - Where a leg carries both our name and vLLM's name of one of P's sizes (``remote_tp_size``
      and ``tp_size``, ``remote_pp_size`` and ``pp_size``), they must agree.
    """
    mode = params.get("transfer_mode")
    if mode is not None and mode != TRANSFER_MODE_PUSH:
        raise ValueError(
            f"invalid kv_transfer_params: transfer_mode {mode!r}; this engine receives KV only by push "
            f"(send transfer_mode {TRANSFER_MODE_PUSH!r} or leave it out)"
        )
    dcp = params.get("dcp_size")
    if dcp is not None and (isinstance(dcp, bool) or dcp != 1):
        raise ValueError(
            f"invalid kv_transfer_params: dcp_size {dcp!r}; pushactors moves KV of P engines without decode "
            "context parallelism only (dcp_size 1)"
        )
    for ours, vllms in _SIZE_ALIASES:
        a, b = params.get(ours), params.get(vllms)
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"invalid kv_transfer_params: {ours} {a!r} and {vllms} {b!r} disagree (both name P's size)"
            )
