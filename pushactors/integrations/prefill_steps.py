"""Scheduler side of announced pushes in vLLM (layer-wise, and whole ones started at the forward's end).

A P request's push starts before its forward only if the scheduler knows, when it builds a
step, that this step computes the request's last prompt tokens. :class:`PrefillSteps` keeps the
requests that may be pushed layer-wise (a remote decode asked for, one token to generate, as
every P/D proxy sends) and their blocks as the scheduler hands them out, and announces each to
:meth:`~pushactors.engine.scheduler.PushScheduler.request_finishing` in the step that ends its
prefill. Plain: no vLLM import; it reads the scheduler output's fields by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.scheduler import PushScheduler


@dataclass
class _Prefill:
    request: Any
    prompt_tokens: int
    blocks: list[list[int]] = field(default_factory=list)  # per KV-cache group


def pushable_layerwise(request: Any) -> bool:
    """A request that ends with its prefill (one token), for a remote decode."""
    params = getattr(request, "kv_transfer_params", None) or {}
    sampling = getattr(request, "sampling_params", None)
    return bool(params.get("do_remote_decode")) and getattr(sampling, "max_tokens", None) == 1


class PrefillSteps:
    def __init__(
        self, scheduler: PushScheduler, pushed: Callable[[list[list[int]], int], list[list[int]]] | None = None
    ) -> None:
        self.scheduler = scheduler
        self._live: dict[str, _Prefill] = {}
        # The blocks a push may read of a request's lists and prompt length (state groups: one).
        self._pushed = pushed

    def track(self, request: Any) -> None:
        """The scheduler allocated blocks for ``request`` (update_state_after_alloc)."""
        if request.request_id in self._live or not pushable_layerwise(request):
            return
        prompt = len(getattr(request, "prompt_token_ids", None) or ())
        if prompt:
            self._live[request.request_id] = _Prefill(request, prompt)

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def step(self, scheduler_output: Any) -> list[str]:
        """Follow this step's blocks; announce the requests whose prefill it ends. Returns them."""
        if not self._live:
            return []
        scheduled: dict[str, int] = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        computed: dict[str, int] = {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            p = self._live.get(new.req_id)
            if p is not None:
                p.blocks = [list(g) for g in new.block_ids]
                computed[new.req_id] = int(new.num_computed_tokens)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
            for i, rid in enumerate(getattr(cached, "req_ids", ()) or ()):
                p = self._live.get(rid)
                if p is None:
                    continue
                added = cached.new_block_ids[i]
                if added is not None:
                    if rid in resumed or not p.blocks:
                        p.blocks = [list(g) for g in added]
                    else:
                        for g, more in enumerate(added):
                            p.blocks[g].extend(more)
                computed[rid] = int(cached.num_computed_tokens[i])
        announced = []
        for rid, done in computed.items():
            p = self._live[rid]
            if done + scheduled.get(rid, 0) < p.prompt_tokens:
                continue  # a chunk of the prompt: its last one comes in a later step
            del self._live[rid]
            blocks = p.blocks if self._pushed is None else self._pushed(p.blocks, p.prompt_tokens)
            if self.scheduler.request_finishing(rid, blocks, p.request.kv_transfer_params):
                announced.append(rid)
        return announced

    def __len__(self) -> int:
        return len(self._live)
