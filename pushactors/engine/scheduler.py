"""The scheduler-side API (vLLM's scheduler connector role): no threads, no NIXL.

D side: after blocks are allocated for a remote prefill, :meth:`PushScheduler.stage_registration`
queues the registration and arms the watchdog. P side: :meth:`PushScheduler.request_finished`
keeps a finished prefill's blocks under a lease and returns the decode leg's
kv_transfer_params. :meth:`build_connector_meta` hands both to the workers once per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..core.config import ConfigError, PushConfig
from ..core.ids import base_request_id
from ..core.topology import check_sources
from ..logs import get_logger
from ..protocol import (
    AbortedRecv,
    BlockGroups,
    CancelledPush,
    FinishedPush,
    KVTransferParams,
    PushConnectorMeta,
    RejectedRecv,
    StagedRegistration,
    check_request_id,
    normalize_block_groups,
    parse_kv_transfer_params,
)


class PushScheduler:
    """The engine scheduler's side of the transport (vLLM's scheduler connector role).

    Runs on the engine's scheduler thread, in the process that schedules requests; it has no
    threads and never touches NIXL. It queues what the workers must do (D's registrations, P's
    finished prefills, aborts, rejections, cancels) and hands it over once per step with
    :meth:`build_connector_meta`; the workers' reports come back through
    :meth:`update_connector_output`. A request is done only when every worker rank reported it:
    the engine merges the ranks' reports (vLLM does) before calling that. Not thread-safe: call
    it from one thread."""

    def __init__(
        self,
        config: PushConfig,
        *,
        side_channel_host: str,
        side_channel_port: int,
        tp_size: int = 1,
        pp_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if pp_size > 1 and config.role == "consumer":
            raise ConfigError(
                "pipeline parallelism on the decode side is not supported: use pp_size=1 on D "
                "(docs/protocol.md, 'Topologies')"
            )
        self.config = config
        self.engine_id = config.engine_id
        self.host = side_channel_host
        self.port = side_channel_port
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.clock = clock
        self.log = get_logger(actor="scheduler", engine=config.engine_id)
        self._staged: list[StagedRegistration] = []
        self._finished: list[FinishedPush] = []
        self._aborted: list[AbortedRecv] = []
        self._rejected: list[RejectedRecv] = []
        self._cancelled: list[CancelledPush] = []
        self._leases: dict[str, float] = {}  # P: finished, blocks held
        self._announced: set[str] = set()  # P, layer-wise: announced before their last forward
        self._pushed_early: set[str] = set()  # ... and reported sent before request_finished
        self._watchdogs: dict[str, float] = {}  # D: registered, waiting for KV

    # --- D -------------------------------------------------------------------------------------
    def stage_registration(
        self,
        request_id: str,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
        params: KVTransferParams | dict[str, Any],
        *,
        skip_blocks: int | Sequence[int] | None = None,
    ) -> None:
        """Queue D's registration of ``block_ids`` (logical, per KV group) for a remote prefill.

        ``skip_blocks``: blocks of the prompt D already holds before these (its prefix hit),
        one count or one per group; P needs it when the two engines' block sizes differ.

        Raises ValueError for kv_transfer_params that cannot name a P engine; the caller fails
        that one request and the engine goes on.
        """
        p = params if isinstance(params, KVTransferParams) else parse_kv_transfer_params(params)
        check_request_id(request_id)
        if self.pp_size > 1:
            raise ValueError("this engine is pipeline-parallel: PP on the decode side is not supported")
        if not p.do_remote_prefill:
            raise ValueError("kv_transfer_params do not ask for a remote prefill")
        assert p.remote_tp_size
        check_sources(self.tp_size, p.remote_tp_size, p.remote_pp_size)  # before any rank builds a list
        groups = normalize_block_groups(list(block_ids))
        if skip_blocks is None:
            skips: tuple[int, ...] = ()
        elif isinstance(skip_blocks, int):
            skips = (skip_blocks,) * len(groups)
        else:
            skips = tuple(int(n) for n in skip_blocks)
        if skips and (len(skips) != len(groups) or min(skips) < 0):
            raise ValueError(f"skip_blocks {skips} does not give one non-negative count per KV group")
        deadline = self.clock() + self.config.registration_timeout
        assert p.remote_engine_id and p.remote_host is not None and p.remote_port is not None and p.remote_tp_size
        self._staged.append(
            StagedRegistration(
                request_id=request_id,
                block_ids=groups,
                remote_engine_id=p.remote_engine_id,
                remote_host=p.remote_host,
                remote_port=p.remote_port,
                remote_tp_size=p.remote_tp_size,
                remote_pp_size=p.remote_pp_size,
                # Each side composes a per-prompt key from its own id: the router sends both legs
                # one X-Request-Id, and a several-prompt response names only one P request.
                transfer_id=leg_transfer_id(p, request_id),
                remote_request_id=p.remote_request_id,
                deadline=deadline,
                skip_blocks=skips,
                decode_host=self.host,
                decode_port=self.port,
            )
        )
        self._watchdogs[request_id] = deadline

    def reject_recv(self, request_id: str, reason: str) -> None:
        """D: a request that cannot be registered fails through the workers like any other
        receive (every rank reports it), so the engine ends it with a clear error."""
        self._rejected.append(RejectedRecv(request_id=request_id, reason=reason[:4000]))
        self._watchdogs[request_id] = self.clock() + self.config.registration_timeout

    def abort_recv(self, request_id: str) -> bool:
        """The engine gave up on a D request. Returns False if it was not waiting for KV.

        Either way a waiting request is still reported by every worker (as a failed receive),
        which is when its blocks may be reused: at once if its registration never left the
        scheduler, else once P answered or can no longer write (quarantine).
        """
        if request_id not in self._watchdogs:
            return False
        if any(s.request_id == request_id for s in self._staged):
            self._staged = [s for s in self._staged if s.request_id != request_id]
            self._rejected.append(RejectedRecv(request_id=request_id, reason="aborted before registration"))
            return True
        self._aborted.append(AbortedRecv(request_id=request_id))
        return True

    # --- P -------------------------------------------------------------------------------------
    def request_finished(
        self,
        request_id: str,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
        params: KVTransferParams | dict[str, Any] | None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the blocks of a finished prefill for its push. Returns (delay_free, params)."""
        if isinstance(params, KVTransferParams):
            p = params
        elif isinstance(params, dict) and params.get("do_remote_decode"):
            # Only a request that asks for a remote decode is validated here; anything else
            # (a D-side request, no params at all) is freed the ordinary way.
            p = parse_kv_transfer_params(params)
        else:
            return False, None
        if not p.do_remote_decode:
            return False, None
        if request_id in self._pushed_early:
            # Its push ended (and was reported) already: nothing reads the blocks any more.
            self._pushed_early.discard(request_id)
            return False, self.decode_params(request_id, p.transfer_id, per_prompt=p.transfer_per_prompt)
        if request_id in self._announced:
            # Announced before its forward: the push is under way; the lease keeps the blocks.
            self._announced.discard(request_id)
            return True, self.decode_params(request_id, p.transfer_id, per_prompt=p.transfer_per_prompt)
        groups: BlockGroups = normalize_block_groups(list(block_ids), freed_prefix=True)
        deadline = self.clock() + self.config.lease_duration
        self._finished.append(
            FinishedPush(
                request_id=request_id, block_ids=groups, transfer_id=leg_transfer_id(p, request_id), deadline=deadline
            )
        )
        self._leases[request_id] = deadline
        return True, self.decode_params(request_id, p.transfer_id, per_prompt=p.transfer_per_prompt)

    def request_finishing(
        self,
        request_id: str,
        block_ids: Sequence[int] | Sequence[Sequence[int]],
        params: KVTransferParams | dict[str, Any] | None,
    ) -> bool:
        """P: the prefill of this request ends in the step about to be built, and it ends the
        request (one token, as every P/D proxy asks). Its blocks go to the workers with this
        step's meta, before its forward: layer-wise (``push_mode = "layerwise"``), the writer
        WRITEs each layer group as the forward marks it computed; whole (``whole_push_start =
        "forward_end"``), the blocks go to the actors when the forward ends. Its lease runs
        from now; :meth:`request_finished` then only answers. False: not announced (the push
        starts after :meth:`request_finished`)."""
        if request_id in self._announced or not self.announces:
            return False
        p = params if isinstance(params, KVTransferParams) else None
        if p is None:
            if not isinstance(params, dict) or not params.get("do_remote_decode"):
                return False
            p = parse_kv_transfer_params(params)
        if not p.do_remote_decode:
            return False
        groups: BlockGroups = normalize_block_groups(list(block_ids), freed_prefix=True)
        deadline = self.clock() + self.config.lease_duration
        self._finished.append(
            FinishedPush(
                request_id=request_id,
                block_ids=groups,
                transfer_id=leg_transfer_id(p, request_id),
                deadline=deadline,
                announced=True,
            )
        )
        self._leases[request_id] = deadline
        self._announced.add(request_id)
        return True

    @property
    def announces(self) -> bool:
        """Pushes start before :meth:`request_finished` for requests the engine announces."""
        return self.config.push_mode == "layerwise" or self.config.whole_push_start == "forward_end"

    def announced(self, request_id: str) -> bool:
        """Announced layer-wise: its push is under way, whatever ends the request on P."""
        return request_id in self._announced

    def request_cancelled(self, request_id: str, params: dict[str, Any] | None, reason: str = "aborted on P") -> bool:
        """P: a prefill that was meant for a remote decode ended without KV to push (aborted,
        failed). D's registration for it is answered with a push failure instead of waiting."""
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return False
        tid = params.get("transfer_id")
        if isinstance(tid, str) and tid and params.get("transfer_per_prompt") is True:
            tid = f"{tid}/{base_request_id(request_id)}"
        self._cancelled.append(
            CancelledPush(
                request_id=request_id, transfer_id=tid if isinstance(tid, str) and tid else None, reason=reason
            )
        )
        return True

    def decode_params(
        self, request_id: str, transfer_id: str | None = None, *, per_prompt: bool = False
    ) -> dict[str, Any]:
        """kv_transfer_params for the decode leg that pulls from (is pushed by) this engine."""
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_tp_size": self.tp_size,
            "remote_pp_size": self.pp_size,
            "remote_request_id": request_id,
        }
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
            if per_prompt:
                params["transfer_per_prompt"] = True
        return params

    # --- every step ----------------------------------------------------------------------------
    def build_connector_meta(self) -> PushConnectorMeta:
        """Everything queued since the last step, for every worker rank (the same meta goes to
        all of them), and the scheduler's clock. Call once per engine step, also when idle."""
        meta = PushConnectorMeta(
            registrations=tuple(self._staged),
            finished=tuple(self._finished),
            aborted=tuple(self._aborted),
            rejected=tuple(self._rejected),
            cancelled=tuple(self._cancelled),
            clock=self.clock(),
        )
        self._staged.clear()
        self._finished.clear()
        self._aborted.clear()
        self._rejected.clear()
        self._cancelled.clear()
        return meta

    def update_connector_output(
        self,
        finished_sending: Iterable[str] = (),
        finished_recving: Iterable[str] = (),
        failed_recving: Iterable[str] = (),
    ) -> None:
        """The ids every worker rank reported this step (merged over the ranks): P's
        finished sends end their leases (free their blocks now), D's finished or failed
        receives end their watchdogs (schedule them now; a failed one's blocks hold no valid
        KV: recompute or fail it)."""
        for rid in finished_sending:
            self._leases.pop(rid, None)
            if rid in self._announced:
                self._announced.discard(rid)
                self._pushed_early.add(rid)
        for rid in finished_recving:
            self._watchdogs.pop(rid, None)
        for rid in failed_recving:
            self._watchdogs.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """True while any lease or registration is open: keep the engine stepping."""
        return bool(
            self._leases
            or self._watchdogs
            or self._staged
            or self._finished
            or self._aborted
            or self._rejected
            or self._cancelled
        )

    def pending(self) -> dict[str, int]:
        """Open P leases and D watchdogs (for stats)."""
        return {"leases": len(self._leases), "watchdogs": len(self._watchdogs)}


def leg_transfer_id(p: KVTransferParams, name: str) -> str | None:
    """The transfer id a leg is matched by: the router's own, or for a router request of
    several prompts, that id with the prompt's base id (``name``: this side's own request id),
    so every prompt's legs pair with each other and with nothing else."""
    if p.transfer_id is None or not p.transfer_per_prompt:
        return p.transfer_id
    return f"{p.transfer_id}/{base_request_id(name)}"
