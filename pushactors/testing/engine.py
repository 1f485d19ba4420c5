"""A small stand-in for an inference engine, to drive P and D workers end to end.

:class:`SimEngine` owns a block pool, per-rank KV tensors, one :class:`PushScheduler` and one
:class:`PushWorker` per TP rank, and steps them the way an engine loop does: build the connector
meta, hand it to every worker, gather ``get_finished`` from every rank (a request is done when
all ranks reported it, like vLLM's output aggregator) and free blocks.

KV content: with an opaque layout (``split``/``fused``) it is a deterministic function of the
request's key, layer, K/V half, token-block position and byte offset within the *whole* (all TP
ranks) block. With a described layout (``cpu``, ``nhd``, ``kv_hnd``, ``blhnc``, ``mla``, … see
:data:`LAYOUTS`) every element encodes (layer, K/V, token, global head, dim)
(:mod:`pushactors.testing.kvfill`), so D checks each element it holds for its own heads and
positions whatever P's layout, TP, PP or block size was.

Every report a rank hands back is recorded per request id (:attr:`SimEngine.report_log`); a
report a rank did not owe — a second one for an id it already reported, or one for an id never
handed to it — is marked a duplicate and counted (:attr:`SimEngine.duplicate_reports`). The
engine still aggregates it as before, so a caller that checks its step reports sees it too.
"""

from __future__ import annotations

import functools
import math
import random
import time
import zlib
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ..core.config import PushConfig
from ..core.outbox import FinishedReport
from ..engine.scheduler import PushScheduler
from ..engine.worker import PushWorker
from ..protocol import CompatSpec
from ..transport.agent import AgentFactory
from ..transport.directory import MetadataPublisher, MetadataSource
from . import kvfill
from .kvfill import KVMemory

# Described layouts: how the KV tensors of one rank are built, and the dims that name them.
# Per-layer ones are vLLM's [B, H, N, C] page view (C = K|V side by side) in some memory order;
# ``kv_*`` keep K and V as an outer dim of the page; ``split_nhd`` is the older
# [2, B, N, H, D] with K and V apart; ``bl*``/``bh*`` put every layer in one block.
LAYOUTS = ("cpu", "nhd", "hnd", "kv_nhd", "kv_hnd", "split_nhd", "blhnc", "blnhc", "bhlnc", "mla", "mla_blhnc")


@dataclass(frozen=True)
class SimSpec:
    num_layers: int = 4
    num_blocks: int = 256
    block_size: int = 16  # tokens per block
    block_bytes: int = 2048  # opaque layouts: bytes of one layer's K (or V) block, all TP ranks
    device: str = "cpu"
    # Opaque: "split": [2, num_blocks, bytes] per layer (K and V regions); "fused":
    # [num_blocks, 2, bytes]. Described: one of LAYOUTS.
    layout: str = "split"
    # Scattered block ids (a fragmented pool) or in-order ones (descriptors merge).
    shuffle_blocks: bool = True
    # Benchmarks measure the transport alone: no per-request KV fill on P or check on D.
    fill_and_verify: bool = True
    # Described layouts: the model's KV heads (all TP ranks; MLA uses 1), head dim, element size.
    kv_heads: int = 4
    head_dim: int = 8
    elem_size: int = 2
    kernel_blocks: int = 1  # physical (kernel) blocks per logical block
    # > 0: a hybrid model (described layouts, whole pushes): odd layers attend to the last this
    # many tokens, a second KV cache group whose blocks behind the window are the null block
    # (id 0, never allocated), as vLLM's hybrid allocator keeps them.
    sliding_window: int = 0

    @property
    def described(self) -> bool:
        return self.layout in LAYOUTS

    def windowed(self, name: str) -> bool:
        """Whether layer ``name`` (``layer.<i>``) is a sliding-window layer."""
        return bool(self.sliding_window) and int(name.rsplit(".", 1)[1]) % 2 == 1

    def behind_window(self, num_tokens: int) -> int:
        """Sliding-window blocks no later token reads after a prompt of ``num_tokens``."""
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size if self.sliding_window else 0

    @property
    def model_heads(self) -> int:
        return 1 if self.layout.startswith("mla") else self.kv_heads


_INV_131 = pow(131, -1, 251)
NULL_BLOCK = 0  # a hybrid model's null block (vLLM's block 0): never allocated, never written


@functools.lru_cache(maxsize=16)
def _cycle(nbytes: int) -> torch.Tensor:
    # Byte j of a row is ((j + s) * 131) % 251 for a row shift s: every row is a window of
    # this one tensor, so filling and checking KV copies memory instead of computing it.
    return ((torch.arange(nbytes + 251, dtype=torch.int64) * 131) % 251).to(torch.uint8)


def _shift(key: str, layer: int, half: int, position: int, offset: int) -> int:
    seed = zlib.crc32(f"{key}|{layer}|{half}".encode())
    h = (seed + position * 40503) % 251
    return (h * _INV_131 + offset) % 251


def pattern_row(key: str, layer: int, half: int, position: int, nbytes: int, offset: int = 0) -> torch.Tensor:
    """Bytes ``offset … offset+nbytes`` of token-block ``position`` of ``key`` (a view)."""
    s = _shift(key, layer, half, position, offset)
    return _cycle(nbytes)[s : s + nbytes]


def pattern(key: str, layer: int, half: int, positions: np.ndarray, nbytes: int, offset: int = 0) -> np.ndarray:
    """The rows of :func:`pattern_row` for several positions, as one array."""
    return np.stack([pattern_row(key, layer, half, int(p), nbytes, offset).numpy() for p in positions])


@dataclass
class RecvRecord:
    request_id: str
    key: str
    blocks: list[int]
    first_position: int  # token-block position of blocks[0] (after a prefix hit)
    num_tokens: int | None = None  # prompt length: tokens past it in the last block are not KV
    done: bool = False
    failed: str | None = None
    # A hybrid model's groups: (registered blocks, token-block position of the first, layers).
    groups: tuple[tuple[list[int], int, frozenset[str]], ...] = ()


ReportKind = Literal["send", "recv"]


@dataclass(frozen=True)
class ReportRecord:
    """One rank's report of one request, as :meth:`SimEngine.collect` received it."""

    kind: ReportKind  # "send": P's finished_sending; "recv": D's finished or failed receive
    rank: int
    failure: str | None  # the reason of a failed report, None for a success
    duplicate: bool  # the rank did not owe this report (already reported, or never handed it)


@dataclass
class StepReport:
    finished_sending: set[str] = field(default_factory=set)
    failed_sending: dict[str, str] = field(default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)


class SimEngine:
    def __init__(
        self,
        config: PushConfig,
        *,
        agent_factory: AgentFactory,
        source: MetadataSource,
        publisher_for_rank: Callable[[int], MetadataPublisher],
        tp_size: int = 1,
        pp_size: int = 1,
        spec: SimSpec = SimSpec(),
        seed: int = 0,
    ) -> None:
        self.config = config
        self.spec = spec
        self.tp_size = tp_size
        self.pp_size = pp_size
        if not spec.described and spec.block_bytes % tp_size:
            raise ValueError("block_bytes must split evenly across TP ranks")
        if spec.num_layers % pp_size:
            raise ValueError("num_layers must split evenly across PP stages")
        if spec.sliding_window and not spec.described:
            raise ValueError("a hybrid (sliding_window) model needs a described layout")
        self.rng = random.Random(seed)
        publishers = [publisher_for_rank(r) for r in range(tp_size)]
        self.scheduler = PushScheduler(
            config,
            side_channel_host=publishers[0].host,
            side_channel_port=publishers[0].port,
            tp_size=tp_size,
            pp_size=pp_size,
        )
        if spec.described:
            dtype = f"int{8 * spec.elem_size}"
            compat = CompatSpec(model="sim", dtype=dtype, kv_shape=(spec.model_heads, spec.head_dim))
        else:
            compat = CompatSpec(model="sim", dtype="uint8", kv_shape=(spec.block_bytes,))
        # Ranks in (pp, tp) order: every one reports every request.
        self.ranks = [(pp, tp) for pp in range(pp_size) for tp in range(tp_size)]
        self.workers = [
            PushWorker(
                config,
                agent_factory=agent_factory,
                source=source,
                publisher=publishers[tp],
                tp_rank=tp,
                tp_size=tp_size,
                pp_rank=pp,
                pp_size=pp_size,
                compat=compat,
            )
            for pp, tp in self.ranks
        ]
        per_stage = spec.num_layers // pp_size
        self.kv: list[dict[str, torch.Tensor]] = []
        for (pp, tp), w in zip(self.ranks, self.workers, strict=True):
            names = [f"layer.{i}" for i in range(pp * per_stage, (pp + 1) * per_stage)]
            if spec.described:
                kv, dims = build_kv(spec, names, tp, tp_size)
                w.register_kv_caches(
                    kv,
                    block_size=spec.block_size,
                    num_blocks=spec.num_blocks * spec.kernel_blocks,
                    physical_blocks_per_logical=spec.kernel_blocks,
                    groups={n: int(spec.windowed(n)) for n in names} if spec.sliding_window else None,
                    dims=dims,
                    kv_heads=spec.model_heads,
                )
            else:
                per_rank = spec.block_bytes // tp_size
                shape = (2, spec.num_blocks, per_rank) if spec.layout == "split" else (spec.num_blocks, 2, per_rank)
                kv = {n: torch.zeros(shape, dtype=torch.uint8, device=spec.device) for n in names}
                w.register_kv_caches(kv, block_size=spec.block_size, num_blocks=spec.num_blocks)
            self.kv.append(kv)
        self.memory = [KVMemory(kv.values()) for kv in self.kv]
        self.last_check: dict[str, list[kvfill.Check]] = {}
        free = list(range(1 if spec.sliding_window else 0, spec.num_blocks))  # hybrid: 0 is the null block
        if spec.shuffle_blocks:
            self.rng.shuffle(free)
        self._free: deque[int] = deque(free)
        self.held: dict[str, list[int]] = {}  # P: blocks under lease
        self.recvs: dict[str, RecvRecord] = {}
        self.sent: dict[str, str | None] = {}  # P id -> failure reason, None when pushed
        self.received: dict[str, str | None] = {}  # D id -> failure reason, None when landed
        # D id -> when the last rank's transport knew its outcome (time.monotonic()).
        self.ended_at: dict[str, float] = {}
        self._reports: Counter[tuple[str, str]] = Counter()
        self._failures: dict[tuple[str, str], str] = {}
        # Every rank report per request id, and the ranks that still owe one per (kind, id).
        self.report_log: defaultdict[str, list[ReportRecord]] = defaultdict(list)
        self._owed: dict[tuple[ReportKind, str], set[int]] = {}
        self._duplicates: list[tuple[str, ReportRecord]] = []

    # --- blocks ------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def take(self, blocks: list[int]) -> list[int]:
        """Allocate exactly these block ids (each must be free): a test chooses where KV goes."""
        free = set(self._free)
        missing = [b for b in blocks if b not in free]
        if missing or len(set(blocks)) != len(blocks):
            raise MemoryError(f"blocks {missing or blocks} are not all free and distinct")
        wanted = set(blocks)
        self._free = deque(b for b in self._free if b not in wanted)
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return max(1, math.ceil(num_tokens / self.spec.block_size))

    # --- P -------------------------------------------------------------------------------------
    def prefill(
        self, request_id: str, num_tokens: int, *, key: str, transfer_id: str | None = None, per_prompt: bool = False
    ) -> dict[str, Any]:
        """Run a prefill: fill its blocks with KV, finish it, lease its blocks. Returns the
        decode leg's kv_transfer_params. ``per_prompt``: the transfer id is a router request's
        of several prompts (see ``KVTransferParams.transfer_per_prompt``)."""
        block_ids: list[int] | list[list[int]]
        if self.spec.sliding_window:
            # Full attention holds every block; the window's blocks behind it are freed (null).
            total, behind = self.blocks_for(num_tokens), self.spec.behind_window(num_tokens)
            full, window = self.allocate(total), self.allocate(total - behind)
            self.write_kv(full, key, first_position=0, layers=self._layers(windowed=False))
            self.write_kv(window, key, first_position=behind, layers=self._layers(windowed=True), group=1)
            block_ids, blocks = [full, [NULL_BLOCK] * behind + window], full + window
        else:
            blocks = block_ids = self.allocate(self.blocks_for(num_tokens))
            self.write_kv(blocks, key, first_position=0)
        params: dict[str, Any] = {"do_remote_decode": True}
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
            if per_prompt:
                params["transfer_per_prompt"] = True
        delay, out = self.scheduler.request_finished(request_id, block_ids, params)
        assert delay and out is not None
        self.held[request_id] = blocks
        self._owe("send", request_id)
        return out

    def prefill_layers(
        self, request_id: str, num_tokens: int, *, key: str, transfer_id: str | None = None
    ) -> LayeredPrefill:
        """Start a layer-wise prefill (``push_mode = "layerwise"``): the request is announced
        and handed to the workers now, as before a real forward; the returned handle computes
        its layers (:meth:`LayeredPrefill.compute`) and ends the forward
        (:meth:`LayeredPrefill.finish`, which returns the decode leg's params)."""
        blocks = self.allocate(self.blocks_for(num_tokens))
        params: dict[str, Any] = {"do_remote_decode": True}
        if transfer_id is not None:
            params["transfer_id"] = transfer_id
        if not self.scheduler.request_finishing(request_id, blocks, params):
            self.release(blocks)
            raise ValueError("announced prefills need push_mode='layerwise' or whole_push_start='forward_end'")
        self.held[request_id] = blocks
        self._owe("send", request_id)
        meta = self.scheduler.build_connector_meta()  # the step's meta, before its forward
        for w in self.workers:
            w.start_load_kv(meta)
        return LayeredPrefill(self, request_id, blocks, params, key)

    def forward(
        self,
        request_id: str,
        num_tokens: int,
        *,
        key: str,
        layerwise: bool,
        layer_work: Callable[[str], None] | None = None,
    ) -> tuple[float, dict[str, Any]]:
        """A prefill computed layer by layer, as an engine's forward: ``layer_work(name)`` runs
        each layer's kernels (then its KV is written). Layer-wise, each layer is saved to the
        workers as it is queued (with a CUDA event on a GPU); whole, the request is handed over
        at the forward's end (``whole_push_start = "forward_end"``, announced before it) or
        finished after it (``"next_step"``). The request's blocks are in ``held`` before the
        first layer runs. Returns (time.monotonic() when the last layer's work had run, the
        decode leg's params): the moment a push can start at the earliest."""
        cuda = self.spec.device.startswith("cuda")

        def event() -> Any:
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record()
            return ev

        config = self.scheduler.config
        if layerwise or (config.push_mode == "whole" and config.whole_push_start == "forward_end"):
            # Announced before the forward, as vLLM's scheduler does: layer-wise, each layer
            # is pushed as it is saved; whole, the blocks go over at the forward's end.
            lp = self.prefill_layers(request_id, num_tokens, key=key)
            for i, name in enumerate(self.layer_names()):
                if layer_work is not None:
                    layer_work(name)
                lp.compute(i + 1, event=event if cuda else None)
            if cuda:
                torch.cuda.synchronize()
            ended = time.monotonic()
            return ended, lp.finish()
        blocks = self.allocate(self.blocks_for(num_tokens))
        self.held[request_id] = blocks  # from here on, as layer-wise: ``layer_work`` may write them
        for name in self.layer_names():
            if layer_work is not None:
                layer_work(name)
            self.write_kv(blocks, key, first_position=0, layers={name})
        if cuda:
            torch.cuda.synchronize()
        ended = time.monotonic()
        delay, out = self.scheduler.request_finished(request_id, blocks, {"do_remote_decode": True})
        assert delay and out is not None
        self._owe("send", request_id)
        return ended, out

    def layer_names(self) -> list[str]:
        """Every layer of the model, in forward order (all PP stages)."""
        return [n for kv in self.kv for n in kv]

    def _layers(self, *, windowed: bool) -> set[str]:
        return {n for n in self.layer_names() if self.spec.windowed(n) == windowed}

    def write_kv(
        self, blocks: list[int], key: str, first_position: int, layers: set[str] | None = None, group: int = 0
    ) -> None:
        """Fill ``blocks`` (of KV cache group ``group``) with the KV of ``key`` (only ``layers``, when given)."""
        if not self.spec.fill_and_verify:
            return
        if self.spec.described:
            for i, w in enumerate(self.workers):
                el = self._elements(i, w, blocks, first_position, group)
                kvfill.fill(self.memory[i], el if layers is None else el.of_layers(layers), key)
            return
        per_rank = self.spec.block_bytes // self.tp_size
        for rank, kv in enumerate(self.kv):
            for layer, (name, t) in enumerate(kv.items()):
                if layers is not None and name not in layers:
                    continue
                for half in range(2):
                    view = self._half(t, half)
                    for i, block in enumerate(blocks):
                        row = pattern_row(key, layer, half, first_position + i, per_rank, rank * per_rank)
                        view[block].copy_(row)

    def _half(self, t: torch.Tensor, half: int) -> torch.Tensor:
        return t[half] if self.spec.layout == "split" else t[:, half]

    # --- D -------------------------------------------------------------------------------------
    def expect(
        self,
        request_id: str,
        num_tokens: int,
        params: dict[str, Any],
        *,
        key: str,
        cached_blocks: int = 0,
        blocks: list[int] | None = None,
    ) -> RecvRecord:
        """Allocate blocks for a remote prefill (after ``cached_blocks`` of prefix hit) and
        stage their registration. ``blocks`` chooses the exact block ids (they must be free).
        A hybrid model registers per group, its window's blocks behind it skipped (null)."""
        total = self.blocks_for(num_tokens)
        if self.spec.sliding_window:
            if blocks is not None:
                raise ValueError("a hybrid model's blocks are allocated per group, not chosen")
            first = max(cached_blocks, self.spec.behind_window(num_tokens))
            full, window = self.allocate(total - cached_blocks), self.allocate(total - first)
            self.scheduler.stage_registration(request_id, [full, window], params, skip_blocks=[cached_blocks, first])
            groups = (
                (full, cached_blocks, frozenset(self._layers(windowed=False))),
                (window, first, frozenset(self._layers(windowed=True))),
            )
            rec = RecvRecord(request_id, key, full + window, cached_blocks, num_tokens, groups=groups)
            self.recvs[request_id] = rec
            self._owe("recv", request_id)
            return rec
        if blocks is not None:
            if len(blocks) != total - cached_blocks:
                raise ValueError(f"{request_id} needs {total - cached_blocks} blocks, {len(blocks)} given")
            blocks = self.take(blocks)
        else:
            blocks = self.allocate(total - cached_blocks)
        self.scheduler.stage_registration(request_id, blocks, params, skip_blocks=cached_blocks)
        rec = RecvRecord(request_id, key, blocks, cached_blocks, num_tokens)
        self.recvs[request_id] = rec
        self._owe("recv", request_id)
        return rec

    def verify(self, request_id: str) -> tuple[int, int]:
        """(bytes checked, bytes wrong) of a received request's blocks on every rank."""
        rec = self.recvs[request_id]
        per_rank = self.spec.block_bytes // self.tp_size
        checked = wrong = 0
        if not self.spec.fill_and_verify:
            return 0, 0
        if self.spec.described and rec.groups:
            return self._verify_groups(rec)
        if self.spec.described:
            checks = [
                kvfill.check(
                    self.memory[i], self._elements(i, w, rec.blocks, rec.first_position).before(rec.num_tokens), rec.key
                )
                for i, w in enumerate(self.workers)
            ]
            self.last_check[request_id] = checks
            es = self.spec.elem_size
            return sum(c.checked for c in checks) * es, sum(c.wrong for c in checks) * es
        for rank, kv in enumerate(self.kv):
            for layer, t in enumerate(kv.values()):
                for half in range(2):
                    view = self._half(t, half)
                    for i, block in enumerate(rec.blocks):
                        want = pattern_row(rec.key, layer, half, rec.first_position + i, per_rank, rank * per_rank)
                        got = view[block].cpu()
                        checked += per_rank
                        if not torch.equal(got, want):
                            wrong += int((got != want).sum())
        return checked, wrong

    def _verify_groups(self, rec: RecvRecord) -> tuple[int, int]:
        """A hybrid model: each group's registered blocks in its own layers, and the null
        block's bytes (every layer), which no push may write: all must still be 0."""
        checks: list[kvfill.Check] = []
        es = self.spec.elem_size
        null_written = 0
        for i, w in enumerate(self.workers):
            for group, (blocks, first, layers) in enumerate(rec.groups):
                el = self._elements(i, w, blocks, first, group).of_layers(set(layers)).before(rec.num_tokens)
                checks.append(kvfill.check(self.memory[i], el, rec.key))
            for group in range(len(rec.groups)):
                null = self._elements(i, w, [NULL_BLOCK], 0, group)
                null_written += int(np.count_nonzero(self.memory[i].read(null.addr, es).reshape(-1, es).any(axis=1)))
        self.last_check[rec.request_id] = checks
        return sum(c.checked for c in checks) * es, (sum(c.wrong for c in checks) + null_written) * es

    def _elements(
        self, i: int, w: PushWorker, blocks: list[int], first_position: int, group: int = 0
    ) -> kvfill.Elements:
        assert w.layout is not None
        _, tp = self.ranks[i]
        return kvfill.elements(w.layout, tp, self.tp_size, blocks, first_block=first_position, group=group)

    def wrong_elements(self, request_id: str) -> tuple[str, ...]:
        """The first wrong elements :meth:`verify` found for ``request_id``, described."""
        return tuple(e for c in self.last_check.get(request_id, ()) for e in c.examples)

    # --- the engine loop -----------------------------------------------------------------------
    def step(self) -> StepReport:
        meta = self.scheduler.build_connector_meta()
        for w in self.workers:
            w.start_load_kv(meta)
        return self.collect([w.get_finished() for w in self.workers])

    # --- reports -----------------------------------------------------------------------------
    def _owe(self, kind: ReportKind, request_id: str) -> None:
        """Every rank owes one report of ``request_id`` (handed to the workers this step)."""
        self._owed[(kind, request_id)] = set(range(len(self.workers)))

    def _record(self, kind: ReportKind, rank: int, request_id: str, failure: str | None) -> None:
        owed = self._owed.get((kind, request_id))
        duplicate = owed is None or rank not in owed
        if owed is not None and not duplicate:
            owed.discard(rank)
            if not owed:
                del self._owed[(kind, request_id)]
        record = ReportRecord(kind, rank, failure, duplicate)
        self.report_log[request_id].append(record)
        if duplicate:
            self._duplicates.append((request_id, record))

    @property
    def duplicate_reports(self) -> int:
        """Rank reports that were not owed: a second report of one request, or an unknown id."""
        return len(self._duplicates)

    @property
    def duplicates(self) -> list[tuple[str, ReportRecord]]:
        """(request id, record) of every report counted in :attr:`duplicate_reports`."""
        return list(self._duplicates)

    def reports_of(self, request_id: str, kind: ReportKind | None = None) -> list[ReportRecord]:
        """Every rank report received for ``request_id`` (of ``kind``, if given), in order."""
        return [r for r in self.report_log.get(request_id, ()) if kind is None or r.kind == kind]

    def collect(self, reports: list[FinishedReport]) -> StepReport:
        out = StepReport()
        for rank, rep in enumerate(reports):
            for rid in rep.finished_sending:
                self._reports[("send", rid)] += 1
                if rid in rep.failed_sending:
                    self._failures[("send", rid)] = rep.failed_sending[rid]
                self._record("send", rank, rid, rep.failed_sending.get(rid))
            for rid in rep.finished_recving:
                self._reports[("recv", rid)] += 1
                self._record("recv", rank, rid, None)
            for rid, at in rep.ended_at.items():
                self.ended_at[rid] = max(at, self.ended_at.get(rid, at))
            for rid, reason in rep.failed_recving.items():
                self._reports[("recv", rid)] += 1
                self._failures[("recv", rid)] = reason
                self._record("recv", rank, rid, reason)
        for (kind, rid), n in list(self._reports.items()):
            if n < len(self.workers):
                continue
            del self._reports[(kind, rid)]
            why: str | None = self._failures.pop((kind, rid), None)
            if kind == "send":
                out.finished_sending.add(rid)
                self.sent[rid] = why
                if why is not None:
                    out.failed_sending[rid] = why
                self.release(self.held.pop(rid, []))
            else:
                rec = self.recvs.get(rid)
                self.received[rid] = why
                if why is not None:
                    out.failed_recving[rid] = why
                    if rec is not None:
                        rec.failed = why
                else:
                    out.finished_recving.add(rid)
                    if rec is not None:
                        rec.done = True
        self.scheduler.update_connector_output(out.finished_sending, out.finished_recving, out.failed_recving)
        return out

    def finish_recv(self, request_id: str) -> None:
        """The decode of a received request ended: its blocks go back to the pool."""
        rec = self.recvs.pop(request_id)
        self.release(rec.blocks)

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    def shutdown(self, timeout: float = 10.0) -> None:
        for w in self.workers:
            w.shutdown(timeout=timeout)


def build_kv(spec: SimSpec, names: list[str], tp_rank: int, tp_size: int) -> tuple[dict[str, torch.Tensor], str]:
    """One rank's KV tensors in ``spec.layout``, and the dims that describe them."""
    from ..core.topology import rank_heads

    heads = len(rank_heads(tp_rank, tp_size, spec.model_heads))
    b, n, d, nl = spec.num_blocks * spec.kernel_blocks, spec.block_size // spec.kernel_blocks, spec.head_dim, len(names)
    dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[spec.elem_size]

    def z(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=spec.device)

    layout = spec.layout
    if layout == "cpu":  # vLLM's CPU backend: per head all of K's tokens, then all of V's
        return {x: z(b, heads, 2, n, d) for x in names}, "BHKND"
    if layout == "hnd":  # [B, H, N, C] in memory order (vLLM LBHNC on GPU), C = K|V
        return {x: z(b, heads, n, 2 * d) for x in names}, "BHNC"
    if layout == "nhd":  # the same view over [B, N, H, C] memory (vLLM LBNHC)
        return {x: z(b, n, heads, 2 * d).permute(0, 2, 1, 3) for x in names}, "BHNC"
    if layout == "kv_nhd":  # K/V outer inside the page: [B, 2, N, H, D]
        return {x: z(b, 2, n, heads, d) for x in names}, "BKNHD"
    if layout == "kv_hnd":  # [B, 2, H, N, D]
        return {x: z(b, 2, heads, n, d) for x in names}, "BKHND"
    if layout == "split_nhd":  # K and V apart: [2, B, N, H, D]
        return {x: z(2, b, n, heads, d) for x in names}, "KBNHD"
    if layout == "mla":  # one latent per token: [B, 1, N, D]
        return {x: z(b, 1, n, d) for x in names}, "BHND"
    if layout == "blhnc":
        t = z(b, nl, heads, n, 2 * d)
        return {x: t[:, i] for i, x in enumerate(names)}, "BHNC"
    if layout == "blnhc":
        t = z(b, nl, n, heads, 2 * d)
        return {x: t[:, i].permute(0, 2, 1, 3) for i, x in enumerate(names)}, "BHNC"
    if layout == "bhlnc":
        t = z(b, heads, nl, n, 2 * d)
        return {x: t[:, :, i] for i, x in enumerate(names)}, "BHNC"
    if layout == "mla_blhnc":
        t = z(b, nl, 1, n, d)
        return {x: t[:, i] for i, x in enumerate(names)}, "BHND"
    raise ValueError(f"unknown layout {layout!r}")


class LayeredPrefill:
    """A layer-wise prefill's forward, driven by a test: layers are computed (filled, then
    saved to the workers that hold them, as vLLM's save_kv_layer does) in order."""

    def __init__(self, engine: SimEngine, request_id: str, blocks: list[int], params: dict[str, Any], key: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.blocks = blocks
        self.params = params
        self.key = key
        self.layers = engine.layer_names()
        self.done = 0

    def compute(self, upto: int | None = None, *, event: Callable[[], Any] | None = None) -> None:
        """Compute layers ``done .. upto`` (default: every remaining one); ``event`` makes the
        device event each save waits on (a CUDA event recorded then)."""
        end = len(self.layers) if upto is None else min(upto, len(self.layers))
        eng = self.engine
        for name in self.layers[self.done : end]:
            eng.write_kv(self.blocks, self.key, first_position=0, layers={name})
            for kv, w in zip(eng.kv, eng.workers, strict=True):
                if name in kv:
                    w.save_kv_layer(name, event)
        self.done = max(self.done, end)

    def finish(self) -> dict[str, Any]:
        """The forward is over (wait_for_save) and the request ends: its decode leg's params."""
        self.compute()
        for w in self.engine.workers:
            w.wait_for_save()
        _, out = self.engine.scheduler.request_finished(self.request_id, self.blocks, self.params)
        assert out is not None
        return out
