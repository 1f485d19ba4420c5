"""The vLLM connector's KV layout derivation, checked against the tensors vLLM 0.32 really builds.

vLLM 0.32 allocates one int8 buffer, views it as ``[L, B, H, N, C-bytes]`` in the stride order of
the resolved :class:`KVCacheLayout` (``compute_layout_strides`` / ``create_kv_cache_views``) and
hands the connector one ``[B, H, N, C]`` view per layer (``.view(dtype)``). :func:`vllm_kv` builds
exactly those views on CPU; with vLLM installed, :func:`test_hand_built_views_match_vllm` checks
them against vLLM's own functions.

Each layout is described (:func:`describe_kv_caches`), turned into regions and paired; a push is
then played by copying bytes through the paired descriptors (``ctypes.memmove``), and D's KV is
checked by meaning: every element (layer, K/V, token, global head, dim) where D's layout says it
is (:mod:`pushactors.testing.kvfill`), and, independently of any pushactors description, through
the attention backends' own views (FlashAttention's ``transpose(1, 2).split(head_size, -1)``,
the CPU backend's ``view(B, H, 2N, D).chunk(2, dim=2)``).

Needs no vLLM: where it is not installed the connector module is imported over stand-ins for
the two vLLM modules it imports (removed again right after).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import importlib
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from pushactors.core.blocks import KVLayout, PairedLayout, PlanError, RemoteLayout
from pushactors.core.config import ConfigError, PushConfig
from pushactors.core.topology import rank_heads, write_heads, write_targets
from pushactors.testing import kvfill
from pushactors.testing.kvfill import KVMemory


# ------------------------------------------------------------------------------------------------
# The connector module, with or without vLLM
# ------------------------------------------------------------------------------------------------
def _vllm_installed() -> bool:
    try:
        importlib.import_module("vllm.v1.kv_cache_interface")
    except ImportError:
        return False
    return True


HAVE_VLLM = _vllm_installed()


def _stand_ins() -> dict[str, types.ModuleType]:
    """Just what ``pushactors.integrations.vllm`` imports from vLLM at module level."""

    class KVConnectorBase_V1:
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._role = role
            self._kv_cache_config = kv_cache_config

    class KVConnectorRole(enum.IntEnum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorStats:
        def __init__(self, data: dict[str, Any] | None = None) -> None:
            self.data = data or {}

    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector"]
    names += ["vllm.distributed.kv_transfer.kv_connector.v1"]
    mods = {n: types.ModuleType(n) for n in names}
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    base.KVConnectorBase_V1 = KVConnectorBase_V1  # type: ignore[attr-defined]
    base.KVConnectorRole = KVConnectorRole  # type: ignore[attr-defined]
    for cls in ("KVConnectorHandshakeMetadata", "KVConnectorMetadata", "KVConnectorTransferResults", "SupportsHMA"):
        setattr(base, cls, type(cls, (), {}))
    metrics = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    metrics.KVConnectorStats = KVConnectorStats  # type: ignore[attr-defined]
    metrics.KVConnectorPromMetrics = type("KVConnectorPromMetrics", (), {})  # type: ignore[attr-defined]
    mods[base.__name__] = base
    mods[metrics.__name__] = metrics
    return mods


def _import_connector() -> types.ModuleType:
    if HAVE_VLLM:
        return importlib.import_module("pushactors.integrations.vllm")
    stand_ins = _stand_ins()
    saved = {n: sys.modules.get(n) for n in stand_ins}
    sys.modules.update(stand_ins)
    try:
        sys.modules.pop("pushactors.integrations.vllm", None)
        return importlib.import_module("pushactors.integrations.vllm")
    finally:
        # Nothing else in this process may mistake the stand-ins for vLLM.
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod
        sys.modules.pop("pushactors.integrations.vllm", None)


conn = _import_connector()
describe_kv_caches = conn.describe_kv_caches


# ------------------------------------------------------------------------------------------------
# vLLM 0.32's KV tensors, built by hand
# ------------------------------------------------------------------------------------------------
# KVCacheLayout stride orders over the logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py).
ORDERS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
HEAD = 8  # head size
BLOCK = 16  # tokens per block
NBLOCKS = 8


def vllm_kv(
    layout: str,
    *,
    heads: int,
    content: int = 2 * HEAD,
    tokens: int = BLOCK,
    blocks: int = NBLOCKS,
    names: Sequence[str] = NAMES,
    dtype: torch.dtype = torch.float16,
) -> dict[str, torch.Tensor]:
    """What vLLM 0.32's ``allocate_kv_cache`` hands the connector for one KV cache group:
    one int8 buffer viewed ``[L, B, H, N, C bytes]`` with ``compute_layout_strides``' strides
    (innermost first in the layout's order; the block stride of a block-outermost layout is all
    layers' pages), then per layer ``view_5d[l].view(dtype)``: ``[B, H, N, C]``."""
    es = torch.empty((), dtype=dtype).element_size()
    shape = (len(names), blocks, heads, tokens, content * es)
    strides = [0] * 5
    step = 1
    for dim in reversed(ORDERS[layout]):
        strides[dim] = step
        step *= shape[dim]
    buf = torch.zeros(step, dtype=torch.int8)
    view = torch.as_strided(buf, shape, strides, 0)
    return {name: view[i].view(dtype) for i, name in enumerate(names)}


def old_kv(
    inner: str, *, heads: int, blocks: int = NBLOCKS, dtype: torch.dtype = torch.float16
) -> dict[str, torch.Tensor]:
    """The older per-layer ``[2, B, N, H, D]`` (``"NHD"``) or ``[2, B, H, N, D]`` K/V tensors."""
    shape = (2, blocks, BLOCK, heads, HEAD) if inner == "NHD" else (2, blocks, heads, BLOCK, HEAD)
    return {name: torch.zeros(shape, dtype=dtype) for name in NAMES}


@dataclass
class Rank:
    layout: KVLayout
    tensors: Mapping[str, torch.Tensor]  # as registered (views)
    raw: Mapping[str, torch.Tensor]  # as vLLM handed them
    tp_rank: int
    tp_size: int
    dims: str | None = None

    def remote(self) -> RemoteLayout:
        return RemoteLayout(
            engine_id="decode-0",
            agent_name=f"decode-0-{self.tp_rank}",
            regions=self.layout.regions,
            block_size=self.layout.block_size,
            physical_blocks_per_logical=self.layout.physical_blocks_per_logical,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            pp_size=1,
            pp_rank=0,
            mem_type="DRAM",
            kv_heads=self.layout.kv_heads,
        )


def make_rank(
    layout: str,
    tp_rank: int,
    tp_size: int,
    *,
    kv_heads: int = 4,
    mla: bool = False,
    cpu: bool = False,
    block_size: int = BLOCK,
    dtype: torch.dtype = torch.float16,
    dims: str | None = None,
) -> Rank:
    """One rank's KV as vLLM builds it, described by the connector's derivation (or ``dims``)."""
    heads = len(rank_heads(tp_rank, tp_size, 1 if mla else kv_heads))
    if layout in ("KBNHD", "KBHND"):
        raw = old_kv(layout[2:], heads=heads, dtype=dtype)
    else:
        raw = vllm_kv(layout, heads=heads, content=HEAD if mla else 2 * HEAD, tokens=block_size, dtype=dtype)
    desc = describe_kv_caches(
        raw,
        kv_heads=kv_heads,
        head_size=HEAD,
        head_size_v=0 if mla else HEAD,
        use_mla=mla,
        tp_size=tp_size,
        block_size=block_size,
        num_blocks=NBLOCKS,
        cpu_pages=cpu,
    )
    assert desc.dims is not None, desc.reason
    tensors, use = (desc.tensors, desc.dims) if dims is None else (raw, dims)
    kv = KVLayout.from_tensors(
        tensors,
        block_size=block_size,
        num_blocks=NBLOCKS,
        physical_blocks_per_logical=desc.blocks_per_logical,
        dims=use,
        kv_heads=desc.kv_heads,
    )
    kv.check_heads(tp_rank, tp_size)
    return Rank(kv, tensors, raw, tp_rank, tp_size, use)


@dataclass
class Pushed:
    pairings: list[PairedLayout] = field(default_factory=list)
    nbytes: int = 0
    descs: int = 0


def push(
    p_ranks: Sequence[Rank], d_ranks: Sequence[Rank], p_blocks: list[int], d_blocks: list[int], skip: int = 0
) -> Pushed:
    """Every P rank's WRITEs into its D ranks, played with memmove through the paired descriptors."""
    out = Pushed()
    d_tp = d_ranks[0].tp_size
    for p in p_ranks:
        kv_heads = p.layout.kv_heads
        assert kv_heads is not None
        for d_rank in write_targets(p.tp_rank, p.tp_size, d_tp):
            heads = write_heads(p.tp_rank, p.tp_size, d_rank, d_tp, kv_heads)
            paired = PairedLayout(p.layout, (p.tp_rank, p.tp_size), d_ranks[d_rank].remote(), heads, kv_heads)
            plan = paired.plan([p_blocks], [d_blocks], [skip])
            local = paired.local_descriptors()[plan.local_idx]
            remote = paired.remote_descriptors()[plan.remote_idx]
            assert np.array_equal(local[:, 1], remote[:, 1])
            for (src, n, _), (dst, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
                ctypes.memmove(int(dst), int(src), int(n))
            assert int(local[:, 1].sum()) == plan.nbytes
            out.pairings.append(paired)
            out.nbytes += plan.nbytes
            out.descs += plan.num_descs
    return out


def fill_p(p_ranks: Sequence[Rank], blocks: list[int], key: str) -> None:
    for p in p_ranks:
        kvfill.fill(KVMemory(p.tensors.values()), kvfill.elements(p.layout, p.tp_rank, p.tp_size, blocks), key)


def check_d(d: Rank, blocks: list[int], key: str, skip: int = 0) -> kvfill.Check:
    el = kvfill.elements(d.layout, d.tp_rank, d.tp_size, blocks, first_block=skip)
    return kvfill.check(KVMemory(d.tensors.values()), el, key)


def stray_bytes(d: Rank, blocks: list[int], skip: int = 0) -> int:
    """Non-zero bytes of D's memory outside the elements of its registered blocks."""
    el = kvfill.elements(d.layout, d.tp_rank, d.tp_size, blocks, first_block=skip)
    stray = 0
    seen: set[int] = set()
    for t in d.tensors.values():
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        flat = torch.empty(0, dtype=torch.uint8)
        flat.set_(st, 0, (st.nbytes(),), (1,))
        mask = np.ones(st.nbytes(), dtype=bool)
        off = el.addr.astype(np.int64) - st.data_ptr()
        inside = (off >= 0) & (off < st.nbytes())
        mask[(off[inside][:, None] + np.arange(el.elem_size)).ravel()] = False
        stray += int(np.count_nonzero(flat.numpy()[mask]))
    return stray


def meaning_ok(
    p_ranks: Sequence[Rank], d_ranks: Sequence[Rank], p_blocks: list[int], d_blocks: list[int], skip: int = 0
) -> Pushed:
    key = "req-" + "-".join(str(b) for b in p_blocks)
    fill_p(p_ranks, p_blocks, key)
    for d in d_ranks:
        assert not check_d(d, d_blocks, key, skip).ok  # before the push: the check can fail
    pushed = push(p_ranks, d_ranks, p_blocks, d_blocks, skip)
    for d in d_ranks:
        result = check_d(d, d_blocks, key, skip)
        assert result.ok, result.examples
        assert d.layout.kv_heads is not None
        heads = len(rank_heads(d.tp_rank, d.tp_size, d.layout.kv_heads))
        halves = len(d.layout.regions[0].kv_indices) * (2 if d.layout.regions[0].kv_part is not None else 1)
        assert result.checked == len(NAMES) * len(d_blocks) * d.layout.block_size * heads * HEAD * halves
        assert stray_bytes(d, d_blocks, skip) == 0
    return pushed


# ------------------------------------------------------------------------------------------------
# Derivation and regions, per layout
# ------------------------------------------------------------------------------------------------
# fp16, 2 heads on the rank, 16 tokens, head size 8: C = 16 elements, a page is 1024 bytes.
PAGE = 2 * BLOCK * 2 * HEAD * 2


@pytest.mark.parametrize(
    ("layout", "described"),
    [
        ("LBNHC", "[token=16, head=2, kv=2, dim=8] × 2 B"),
        ("LBHNC", "[head=2, token=16, kv=2, dim=8] × 2 B"),
    ],
)
def test_per_layer_layouts_are_one_region_per_layer(layout: str, described: str) -> None:
    kv = vllm_kv(layout, heads=2)
    desc = describe_kv_caches(kv, kv_heads=4, head_size=HEAD, head_size_v=HEAD, use_mla=False, tp_size=2)
    assert (desc.dims, desc.kv_heads, desc.blocks_per_logical) == ("BHNC", 4, 1)
    assert desc.tensors["model.layers.0.self_attn.attn"] is kv["model.layers.0.self_attn.attn"]
    layout_ = KVLayout.from_tensors(desc.tensors, block_size=BLOCK, dims=desc.dims, kv_heads=desc.kv_heads)
    layout_.check_heads(1, 2)
    assert len(layout_.regions) == 3
    for i, r in enumerate(layout_.regions):
        assert r.shape is not None
        assert r.members == (NAMES[i],)
        assert (r.block_len, r.stride, r.num_blocks) == (PAGE, PAGE, NBLOCKS)
        assert r.base_addr == kv[NAMES[0]].data_ptr() + i * NBLOCKS * PAGE  # layer-outer regions
        assert r.shape.describe() == described
        head, tok = r.shape.axis("head"), r.shape.axis("token")
        assert head is not None and tok is not None
        if layout == "LBNHC":
            assert (head.size, head.stride, tok.stride) == (2, 2 * HEAD * 2, 2 * 2 * HEAD * 2)
        else:
            assert (head.size, head.stride, tok.stride) == (2, BLOCK * 2 * HEAD * 2, 2 * HEAD * 2)
        assert (r.shape.stride("kv"), r.shape.stride("dim"), r.shape.size("dim")) == (HEAD * 2, 2, HEAD)


@pytest.mark.parametrize(
    ("layout", "described", "layer_stride"),
    [
        ("BLHNC", "[layer=3, head=2, token=16, kv=2, dim=8] × 2 B", PAGE),
        ("BLNHC", "[layer=3, token=16, head=2, kv=2, dim=8] × 2 B", PAGE),
        ("BHLNC", "[head=2, layer=3, token=16, kv=2, dim=8] × 2 B", BLOCK * 2 * HEAD * 2),
    ],
)
def test_block_outermost_layouts_coalesce_into_one_region(layout: str, described: str, layer_stride: int) -> None:
    kv = vllm_kv(layout, heads=2)
    desc = describe_kv_caches(kv, kv_heads=2, head_size=HEAD, head_size_v=HEAD, use_mla=False, block_size=BLOCK)
    assert (desc.dims, desc.kv_heads) == ("BHNC", 2)
    layout_ = KVLayout.from_tensors(desc.tensors, block_size=BLOCK, dims=desc.dims, kv_heads=desc.kv_heads)
    (r,) = layout_.regions
    assert r.shape is not None
    assert r.members == tuple(NAMES)
    assert r.shape.describe() == described
    assert r.shape.axis("layer") is not None and r.shape.stride("layer") == layer_stride
    assert (r.stride, r.block_len, r.num_blocks) == (3 * PAGE, 3 * PAGE, NBLOCKS)
    assert r.base_addr == kv[NAMES[0]].data_ptr()


def test_mla_latent_is_one_head() -> None:
    kv = vllm_kv("LBHNC", heads=1, content=40, dtype=torch.bfloat16)
    for tp in (1, 2, 4):
        desc = describe_kv_caches(
            kv, kv_heads=16, head_size=40, head_size_v=0, use_mla=True, tp_size=tp, block_size=BLOCK
        )
        assert (desc.dims, desc.kv_heads) == ("BHND", 1)
    layout_ = KVLayout.from_tensors(desc.tensors, block_size=BLOCK, dims=desc.dims, kv_heads=desc.kv_heads)
    layout_.check_heads(3, 4)
    assert len(layout_.regions) == 3
    r = layout_.regions[0]
    assert r.shape is not None
    assert r.shape.describe() == "[token=16, dim=40] × 2 B"
    assert r.shape.axis("kv") is None and r.kv_indices == (None,)
    assert (r.block_len, r.stride) == (BLOCK * 40 * 2, BLOCK * 40 * 2)


@pytest.mark.parametrize(
    ("inner", "described"), [("NHD", "[token=16, head=2, dim=8] × 2 B"), ("HND", "[head=2, token=16, dim=8] × 2 B")]
)
def test_old_split_layouts(inner: str, described: str) -> None:
    kv = old_kv(inner, heads=2)
    desc = describe_kv_caches(kv, kv_heads=2, head_size=HEAD, head_size_v=HEAD, use_mla=False, block_size=BLOCK)
    assert (desc.dims, desc.kv_heads) == ("KB" + inner, 2)
    layout_ = KVLayout.from_tensors(desc.tensors, block_size=BLOCK, dims=desc.dims, kv_heads=2)
    assert len(layout_.regions) == 6  # K and V regions per layer
    parts = {name: sorted(r.kv_part for r in layout_.regions if r.members == (name,)) for name in NAMES}
    assert parts == {name: [0, 1] for name in NAMES}
    t = kv[NAMES[0]]
    k, v = sorted((r for r in layout_.regions if r.members == (NAMES[0],)), key=lambda r: r.kv_part or 0)
    assert v.base_addr - k.base_addr == t.stride(0) * 2
    assert k.shape is not None and k.shape.describe() == described
    assert (k.block_len, k.stride) == (BLOCK * 2 * HEAD * 2, BLOCK * 2 * HEAD * 2)


def test_cpu_pages_are_k_then_v_per_head() -> None:
    """The CPU backend reads a head's [N, 2D] page as [2N, D] and chunks it: K is the first N
    rows. Described as [B, H, 2, N, D], the very view the backend takes."""
    kv = vllm_kv("LBHNC", heads=2)
    desc = describe_kv_caches(
        kv, kv_heads=2, head_size=HEAD, head_size_v=HEAD, use_mla=False, block_size=BLOCK, cpu_pages=True
    )
    assert desc.dims == "BHKND"
    t, view = kv[NAMES[0]], desc.tensors[NAMES[0]]
    k, v = t.view(NBLOCKS, 2, 2 * BLOCK, HEAD).chunk(2, dim=2)  # vLLM cpu_attn.py
    assert view.data_ptr() == t.data_ptr()
    assert view[:, :, 0].stride() == k.stride() and view[:, :, 0].data_ptr() == k.data_ptr()
    assert view[:, :, 1].data_ptr() == v.data_ptr()
    layout_ = KVLayout.from_tensors(desc.tensors, block_size=BLOCK, dims=desc.dims, kv_heads=2)
    r = layout_.regions[0]
    assert r.shape is not None and r.shape.describe() == "[head=2, kv=2, token=16, dim=8] × 2 B"
    # The CPU backend accepts only LBHNC: an NHD page cannot be viewed its way.
    nhd = describe_kv_caches(
        vllm_kv("LBNHC", heads=2), kv_heads=2, head_size=HEAD, head_size_v=HEAD, use_mla=False, cpu_pages=True
    )
    assert nhd.dims is None and "LBHNC" in nhd.reason


def test_kernel_blocks_split_a_vllm_block() -> None:
    """A 32-token vLLM block in two 16-token kernel blocks: dim 0 holds B × 2 kernel blocks."""
    kv = vllm_kv("LBNHC", heads=2, blocks=2 * NBLOCKS)
    desc = describe_kv_caches(
        kv, kv_heads=2, head_size=HEAD, head_size_v=HEAD, use_mla=False, block_size=32, num_blocks=NBLOCKS
    )
    assert (desc.dims, desc.blocks_per_logical) == ("BHNC", 2)
    layout_ = KVLayout.from_tensors(
        desc.tensors, block_size=32, physical_blocks_per_logical=2, dims=desc.dims, kv_heads=2
    )
    assert layout_.tokens_per_block == 16 and layout_.regions[0].num_blocks == 2 * NBLOCKS


@pytest.mark.parametrize(
    ("build", "kwargs", "reason"),
    [
        # K and V of different head sizes: no equal K|V halves in C.
        (lambda: vllm_kv("LBNHC", heads=2, content=HEAD + 4), {"head_size_v": 4}, "V head size"),
        # A Mamba state view: [B, 1, 1, bytes] int8.
        (lambda: vllm_kv("LBHNC", heads=1, content=96, tokens=1, dtype=torch.int8), {}, "heads"),
        # Padded content (C wider than K + V).
        (lambda: vllm_kv("LBNHC", heads=2, content=2 * HEAD + 8), {}, "content elements"),
        # Not this rank's share of heads (the model has 8: TP 2 holds 4 per rank).
        (lambda: vllm_kv("LBNHC", heads=2), {"kv_heads": 8, "tp_size": 2}, "heads"),
        # Compressed states: 16 states per 64-token block.
        (lambda: vllm_kv("LBNHC", heads=2), {"block_size": 64, "num_blocks": NBLOCKS}, "states"),
        # 5-D with as many tokens as heads: which is which cannot be told.
        (lambda: {"l": torch.zeros(2, NBLOCKS, 2, 2, HEAD)}, {}, "token dim"),
        # 3-D tensors.
        (lambda: {"l": torch.zeros(NBLOCKS, 2, 64)}, {}, "3-D"),
    ],
)
def test_what_cannot_be_described_is_opaque(
    build: Callable[[], dict[str, torch.Tensor]], kwargs: dict[str, Any], reason: str
) -> None:
    args: dict[str, Any] = {"kv_heads": 2, "head_size": HEAD, "head_size_v": HEAD, "use_mla": False, **kwargs}
    kv = build()
    desc = describe_kv_caches(kv, **args)
    assert desc.dims is None and desc.kv_heads is None
    assert reason in desc.reason
    # Opaque still registers: whole blocks as bytes (NHD pages flattened per block).
    layout_ = KVLayout.from_tensors(desc.tensors, block_size=BLOCK, num_blocks=NBLOCKS)
    assert not layout_.structured
    first = next(iter(kv.values()))
    assert layout_.regions[0].base_addr == first.data_ptr()


def test_opaque_nhd_pages_register_whole_blocks() -> None:
    kv = vllm_kv("LBNHC", heads=2, content=HEAD + 4)
    with pytest.raises(Exception, match="not contiguous"):
        KVLayout.from_tensors(kv, block_size=BLOCK, num_blocks=NBLOCKS)  # the raw permuted view
    desc = describe_kv_caches(kv, kv_heads=2, head_size=HEAD, head_size_v=4, use_mla=False)
    layout_ = KVLayout.from_tensors(desc.tensors, block_size=BLOCK, num_blocks=NBLOCKS)
    page = 2 * BLOCK * (HEAD + 4) * 2
    assert [(r.block_len, r.stride, r.num_blocks) for r in layout_.regions] == [(page, page, NBLOCKS)] * 3


# ------------------------------------------------------------------------------------------------
# Pushes between layouts, checked by meaning
# ------------------------------------------------------------------------------------------------
P_BLOCKS = [5, 1, 3]
D_BLOCKS = [2, 7, 0]


def test_nhd_tp2_to_hnd_tp1() -> None:
    p = [make_rank("LBNHC", r, 2) for r in range(2)]
    d = [make_rank("LBHNC", 0, 1)]
    pushed = meaning_ok(p, d, P_BLOCKS, D_BLOCKS)
    # Each P rank fills its 2 heads of D's 4: half of every layer's K and V.
    assert pushed.nbytes == 3 * len(D_BLOCKS) * (4 * BLOCK * 2 * HEAD * 2)
    assert [pl.heads for pl in pushed.pairings] == [range(0, 2), range(2, 4)]


def test_nhd_tp1_to_hnd_tp2() -> None:
    p = [make_rank("LBNHC", 0, 1)]
    d = [make_rank("LBHNC", r, 2) for r in range(2)]
    pushed = meaning_ok(p, d, P_BLOCKS, D_BLOCKS)
    assert [pl.heads for pl in pushed.pairings] == [range(0, 2), range(2, 4)]
    # HND on D: a head's tokens are one run there, but NHD on P interleaves heads per token.
    assert all(pl.descs_per_block > 1 for pl in pushed.pairings)


def test_mla_tp1_to_tp2() -> None:
    p = [make_rank("LBHNC", 0, 1, mla=True, dtype=torch.bfloat16)]
    d = [make_rank("LBHNC", r, 2, mla=True, dtype=torch.bfloat16) for r in range(2)]
    pushed = meaning_ok(p, d, P_BLOCKS, D_BLOCKS)
    # The one latent head is replicated: every D rank gets it whole, a block per descriptor per layer.
    assert [pl.heads for pl in pushed.pairings] == [range(0, 1), range(0, 1)]
    assert [pl.descs_per_block for pl in pushed.pairings] == [3, 3]


def test_blhnc_whole_blocks() -> None:
    p = [make_rank("BLHNC", 0, 1)]
    d = [make_rank("BLHNC", 0, 1)]
    pushed = meaning_ok(p, d, P_BLOCKS, D_BLOCKS)
    (paired,) = pushed.pairings
    assert paired.descs_per_block == 1  # every layer of a block in one descriptor
    assert pushed.descs == len(D_BLOCKS)


def test_bhlnc_tp1_to_blnhc_tp2() -> None:
    p = [make_rank("BHLNC", 0, 1)]
    d = [make_rank("BLNHC", r, 2) for r in range(2)]
    meaning_ok(p, d, P_BLOCKS, D_BLOCKS)


def test_old_split_to_hnd_tp2() -> None:
    p = [make_rank("KBNHD", 0, 1)]
    d = [make_rank("LBHNC", r, 2) for r in range(2)]
    meaning_ok(p, d, P_BLOCKS, D_BLOCKS)


def test_larger_p_blocks_need_d_prefix_count() -> None:
    """P's 32-token blocks into D's 16-token ones after D's own 1-block prefix hit: P places the
    tokens only with D's skip count (the connector's ``skip_blocks``)."""
    p = [make_rank("LBNHC", 0, 1, block_size=32)]
    d = [make_rank("LBHNC", r, 2) for r in range(2)]
    paired = PairedLayout(p[0].layout, (0, 1), d[0].remote(), range(0, 2), 4)
    with pytest.raises(PlanError, match="cached"):
        paired.plan([[4, 1]], [[6, 2, 5]])
    meaning_ok(p, d, [4, 1], [6, 2, 5], skip=1)


@pytest.mark.parametrize("p_layout", ["LBNHC", "LBHNC", "BLNHC"])
def test_gpu_layouts_to_cpu_tp1(p_layout: str) -> None:
    p = [make_rank(p_layout, r, 2) for r in range(2)]
    d = [make_rank("LBHNC", 0, 1, cpu=True)]
    meaning_ok(p, d, P_BLOCKS, D_BLOCKS)


# ------------------------------------------------------------------------------------------------
# The same, read through the attention backends' own views
# ------------------------------------------------------------------------------------------------
def truth(layer: int, kv: int, positions: torch.Tensor, heads: range) -> torch.Tensor:
    """What K (kv 0) or V (1) of ``heads`` at ``positions`` holds: ``[tokens, heads, dim]``,
    every (layer, K/V, head, dim, position) a different int16."""
    h = torch.tensor(list(heads))[None, :, None]
    d = torch.arange(HEAD)[None, None, :]
    pos = positions[:, None, None]
    return (layer + 4 * kv + 8 * h + 64 * d + 512 * pos).to(torch.int16)


def cpu_kv(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM cpu_attn.py: ``kv_cache.view(B, H, 2N, D).chunk(2, dim=2)``, each [B, H, N, D]."""
    b, h, n, _ = t.shape
    k, v = t.view(b, h, 2 * n, -1).chunk(2, dim=2)
    return k, v


def flash_kv(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM flash_attn.py: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``, each [B, N, H, D]."""
    k, v = t.transpose(1, 2).split(HEAD, dim=-1)
    return k, v


def write_backend(rank: Rank, blocks: list[int], cpu: bool) -> None:
    heads = rank_heads(rank.tp_rank, rank.tp_size, 4)
    for li, name in enumerate(NAMES):
        halves = cpu_kv(rank.raw[name]) if cpu else flash_kv(rank.raw[name])
        for kv, half in enumerate(halves):
            for i, b in enumerate(blocks):
                want = truth(li, kv, i * BLOCK + torch.arange(BLOCK), heads)  # [N, H, D]
                half[b] = want.transpose(0, 1) if cpu else want


def read_backend_ok(rank: Rank, blocks: list[int], cpu: bool) -> bool:
    heads = rank_heads(rank.tp_rank, rank.tp_size, 4)
    for li, name in enumerate(NAMES):
        halves = cpu_kv(rank.raw[name]) if cpu else flash_kv(rank.raw[name])
        for kv, half in enumerate(halves):
            for i, b in enumerate(blocks):
                got = half[b].transpose(0, 1) if cpu else half[b]
                if not torch.equal(got, truth(li, kv, i * BLOCK + torch.arange(BLOCK), heads)):
                    return False
    return True


@pytest.mark.parametrize(
    ("p_side", "d_side"),
    [
        (("LBHNC", True, 1), ("LBNHC", False, 2)),  # CPU P into GPU NHD D, TP 1 -> 2
        (("LBNHC", False, 2), ("LBHNC", True, 1)),  # GPU NHD P into CPU D, TP 2 -> 1
        (("LBNHC", False, 2), ("LBHNC", False, 1)),  # NHD -> HND, TP 2 -> 1
        (("BLNHC", False, 1), ("BHLNC", False, 2)),
    ],
)
def test_backend_views_agree(p_side: tuple[str, bool, int], d_side: tuple[str, bool, int]) -> None:
    (pl, p_cpu, p_tp), (dl, d_cpu, d_tp) = p_side, d_side
    p = [make_rank(pl, r, p_tp, cpu=p_cpu, dtype=torch.int16) for r in range(p_tp)]
    d = [make_rank(dl, r, d_tp, cpu=d_cpu, dtype=torch.int16) for r in range(d_tp)]
    for rank in p:
        write_backend(rank, P_BLOCKS, p_cpu)
    assert not any(read_backend_ok(rank, D_BLOCKS, d_cpu) for rank in d)
    push(p, d, P_BLOCKS, D_BLOCKS)
    assert all(read_backend_ok(rank, D_BLOCKS, d_cpu) for rank in d)


def test_cpu_pages_described_as_gpu_pages_push_wrong_kv() -> None:
    """Negative control: the old assumption (a CPU page is [B, H, N, K|V] like the GPU's)
    scrambles tokens and K/V as soon as the other side reads its pages differently."""
    p = [make_rank("LBHNC", 0, 1, cpu=True, dtype=torch.int16, dims="BHNC")]
    d = [make_rank("LBNHC", r, 2, dtype=torch.int16) for r in range(2)]
    write_backend(p[0], P_BLOCKS, cpu=True)
    push(p, d, P_BLOCKS, D_BLOCKS)
    assert not any(read_backend_ok(rank, D_BLOCKS, cpu=False) for rank in d)


# ------------------------------------------------------------------------------------------------
# Settings, layout request, PP rules, skip_blocks, registration
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    num_head_slots: int | None = None
    state_content_bytes: int | None = None


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True)
class MambaSpec:
    block_size: int
    shapes: tuple[tuple[int, ...], ...] = ((4, 8),)
    mamba_cache_mode: str = "align"  # one a push serves (vLLM: "none", "align" or "all")


class GDNStateSpec(MambaSpec):  # an SSM spec whose own name does not say Mamba
    pass


def fake_vllm(
    *,
    role: str = "kv_producer",
    pp: int = 1,
    tp: int = 1,
    device: str = "cuda",
    extra: dict[str, Any] | None = None,
    block_size: int = BLOCK,
    heads: int = 4,
    mla: bool = False,
) -> SimpleNamespace:
    model = SimpleNamespace(
        get_total_num_kv_heads=lambda: heads,
        get_head_size=lambda: HEAD,
        use_mla=mla,
        hf_config=SimpleNamespace(architectures=["TinyLlama"]),
        model="tiny",
        dtype="bfloat16",
    )
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="engine-0", kv_role=role, kv_connector_extra_config=extra or {}),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        device_config=SimpleNamespace(device_type=device),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        model_config=model,
    )


def kv_config(*specs: Any, num_blocks: int = NBLOCKS) -> SimpleNamespace:
    return SimpleNamespace(
        num_blocks=num_blocks,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=list(NAMES)) for s in specs],
    )


ATTN = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=HEAD, head_size_v=HEAD)


@pytest.mark.parametrize("value", [None, "NHD", "HND", "LBNHC", "LBHNC", "BLHNC", "BLNHC", "BHLNC"])
def test_kv_cache_layout_setting_accepts(value: str | None) -> None:
    data: dict[str, Any] = {"engine_id": "e"} if value is None else {"engine_id": "e", "kv_cache_layout": value}
    assert PushConfig.from_dict(data).kv_cache_layout == value
    assert conn.PushActorsConnector.get_required_kvcache_layout(fake_vllm(extra=data)) == value


@pytest.mark.parametrize("value", ["LHBNC", "nhd", "", 3])
def test_kv_cache_layout_setting_refuses(value: Any) -> None:
    with pytest.raises(ConfigError, match="kv_cache_layout"):
        PushConfig.from_dict({"engine_id": "e", "kv_cache_layout": value})
    with pytest.raises(ConfigError, match="kv_cache_layout"):
        conn.PushActorsConnector.get_required_kvcache_layout(fake_vllm(extra={"kv_cache_layout": value}))
    if isinstance(value, str):
        with pytest.raises(ConfigError, match="kv_cache_layout"):
            PushConfig(engine_id="e", kv_cache_layout=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, "LBHNC", "HND"])
def test_cpu_takes_its_default_layout(value: str | None) -> None:
    cfg = fake_vllm(device="cpu", extra={"kv_cache_layout": value} if value else {})
    conn.check_vllm_settings(cfg, conn.config_from_vllm(cfg))


@pytest.mark.parametrize("value", ["NHD", "LBNHC", "BLHNC", "BLNHC", "BHLNC"])
def test_cpu_refuses_other_layouts(value: str) -> None:
    cfg = fake_vllm(device="cpu", extra={"kv_cache_layout": value})
    with pytest.raises(ConfigError, match="CPU"):
        conn.check_vllm_settings(cfg, conn.config_from_vllm(cfg))
    with pytest.raises(ConfigError, match="CPU"):
        conn.PushActorsConnector(vllm_config=cfg, role=conn.KVConnectorRole.WORKER, kv_cache_config=kv_config(ATTN))
    gpu = fake_vllm(device="cuda", extra={"kv_cache_layout": value})
    conn.check_vllm_settings(gpu, conn.config_from_vllm(gpu))


def test_platform_from_device_config() -> None:
    assert conn.platform_is_cpu(fake_vllm(device="cpu"))
    assert not conn.platform_is_cpu(fake_vllm(device="cuda"))
    cfg = fake_vllm()
    cfg.device_config = SimpleNamespace(device=torch.device("cpu"))
    assert conn.platform_is_cpu(cfg)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_pp_on_decode_is_refused(role: str) -> None:
    cfg = fake_vllm(role="kv_consumer", pp=2)
    with pytest.raises(ConfigError, match="PP on the decode side is not supported"):
        conn.PushActorsConnector(
            vllm_config=cfg, role=getattr(conn.KVConnectorRole, role), kv_cache_config=kv_config(ATTN)
        )
    conn.check_vllm_settings(fake_vllm(role="kv_consumer", pp=1), conn.config_from_vllm(fake_vllm(role="kv_consumer")))
    producer = fake_vllm(role="kv_producer", pp=2)
    conn.check_vllm_settings(producer, conn.config_from_vllm(producer), kv_config(ATTN))


@pytest.mark.parametrize("spec", [MambaSpec(block_size=BLOCK), GDNStateSpec(block_size=BLOCK)])
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_mamba_with_pp_is_refused(spec: Any, role: str) -> None:
    cfg = fake_vllm(role="kv_producer", pp=2)
    with pytest.raises(ConfigError, match="Mamba"):
        conn.PushActorsConnector(
            vllm_config=cfg, role=getattr(conn.KVConnectorRole, role), kv_cache_config=kv_config(ATTN, spec)
        )
    # A uniform-type group names its layers' specs inside.
    uniform = SimpleNamespace(kv_cache_specs={"a": ATTN, "m": spec})
    with pytest.raises(ConfigError, match="Mamba"):
        conn.check_vllm_settings(cfg, conn.config_from_vllm(cfg), kv_config(uniform))
    flat = fake_vllm(role="kv_producer", pp=1)
    conn.check_vllm_settings(flat, conn.config_from_vllm(flat), kv_config(ATTN, spec))


def test_real_mamba_spec_is_recognised() -> None:
    """vLLM's own MambaSpec (and its subclasses) counts as Mamba state for the PP refusal."""
    got = in_vllm(
        "import torch, json\n"
        "from vllm.v1.kv_cache_interface import MambaSpec\n"
        "from pushactors.integrations.vllm import _is_mamba\n"
        f"spec = MambaSpec(block_size={BLOCK}, shapes=((4, 8),), dtypes=(torch.float32,))\n"
        "print(json.dumps([_is_mamba(spec), [c.__name__ for c in type(spec).__mro__]]))\n"
    )
    assert got[0] is True and "MambaSpec" in got[1]


class RecordingScheduler:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[list[int]], dict[str, Any], Any]] = []

    def stage_registration(
        self, request_id: str, block_ids: list[list[int]], params: dict[str, Any], *, skip_blocks: Any = None
    ) -> None:
        self.calls.append((request_id, block_ids, params, skip_blocks))

    def reject_recv(self, request_id: str, reason: str) -> None:
        raise AssertionError(f"rejected {request_id}: {reason}")


def scheduler_connector(sched: Any, *, block_size: int = BLOCK, **kw: Any) -> Any:
    """A scheduler-role connector around ``sched``, without vLLM's config (whole pushes, as
    the connector's default)."""
    return conn.PushActorsConnector.around(PushConfig(engine_id="test-0"), scheduler=sched, block_size=block_size, **kw)


@pytest.mark.parametrize(
    ("cached", "external", "skip", "blocks"), [(0, 40, 0, [10, 11, 12]), (32, 50, 2, [12, 13, 14, 15])]
)
def test_registration_passes_d_prefix_hit(cached: int, external: int, skip: int, blocks: list[int]) -> None:
    sched = RecordingScheduler()
    c = scheduler_connector(sched)
    params = {"do_remote_prefill": True, "remote_engine_id": "p-0"}
    request = SimpleNamespace(request_id="r1", kv_transfer_params=params, prompt_token_ids=[0] * (cached + external))
    assert c.get_num_new_matched_tokens(request, cached) == (external, True)  # D's own hit: cached
    all_blocks = SimpleNamespace(get_block_ids=lambda: ([10, 11, 12, 13, 14, 15, 16],))
    c.update_state_after_alloc(request, all_blocks, external)
    assert sched.calls == [("r1", [blocks], params, skip)]
    c.update_state_after_alloc(request, all_blocks, external)  # registered once
    assert len(sched.calls) == 1


class RecordingWorker:
    def __init__(self, tp_rank: int, tp_size: int) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.kwargs: dict[str, Any] = {}
        self.layout: KVLayout | None = None

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], **kwargs: Any) -> Any:
        assert "replicated_kv" not in kwargs  # MLA is kv_heads=1, never "replicated"
        self.kwargs = kwargs
        self.layout = KVLayout.from_tensors(kv_caches, **kwargs)
        self.layout.check_heads(self.tp_rank, self.tp_size)
        return SimpleNamespace(regions=self.layout.region_infos)


def registered(
    kv: dict[str, torch.Tensor], cfg: SimpleNamespace, kvc: Any, *, tp_rank: int = 0, cpu: bool = False
) -> RecordingWorker:
    worker = RecordingWorker(tp_rank, int(cfg.parallel_config.tensor_parallel_size))
    c = conn.PushActorsConnector.around(
        PushConfig(engine_id="test-0"),
        worker=worker,
        vllm_config=cfg,
        kv_cache_config=kvc,
        tp_size=worker.tp_size,
        block_size=int(cfg.cache_config.block_size),
        cpu=cpu,
    )
    c.register_kv_caches(kv)
    return worker


def test_register_describes_vllm_tensors(events: Any) -> None:
    kv = vllm_kv("BLNHC", heads=2)
    worker = registered(kv, fake_vllm(tp=2), kv_config(ATTN), tp_rank=1)
    assert (worker.kwargs["dims"], worker.kwargs["kv_heads"]) == ("BHNC", 4)
    assert worker.kwargs["num_blocks"] == NBLOCKS and worker.kwargs["physical_blocks_per_logical"] == 1
    (event,) = events.named("connector.kv_registered")
    assert (event["dims"], event["kv_heads"], event["regions"]) == ("BHNC", 4, 1)
    assert not events.named("connector.layout_opaque")


def test_register_cpu_pages(events: Any) -> None:
    kv = vllm_kv("LBHNC", heads=4)
    worker = registered(kv, fake_vllm(device="cpu"), kv_config(FullAttentionSpec(BLOCK, 4, HEAD, HEAD)), cpu=True)
    assert worker.kwargs["dims"] == "BHKND"
    assert events.named("connector.kv_registered")[0]["regions"] == 3


def test_register_mla(events: Any) -> None:
    kv = vllm_kv("LBHNC", heads=1, content=HEAD, dtype=torch.bfloat16)
    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD, head_size_v=0)
    worker = registered(kv, fake_vllm(tp=2, heads=1, mla=True), kv_config(spec), tp_rank=1)
    assert (worker.kwargs["dims"], worker.kwargs["kv_heads"]) == ("BHND", 1)
    assert events.named("connector.kv_registered")[0]["dims"] == "BHND"


@pytest.mark.parametrize(
    ("spec", "kv", "reason"),
    [
        (
            MambaSpec(block_size=BLOCK),
            lambda: vllm_kv("LBHNC", heads=1, content=96, tokens=1, dtype=torch.int8),
            "Mamba",
        ),
        (
            FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=HEAD, head_size_v=4),
            lambda: vllm_kv("LBNHC", heads=2, content=HEAD + 4),
            "V head size",
        ),
        (
            FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=HEAD, head_size_v=HEAD, num_head_slots=1),
            lambda: vllm_kv("LBNHC", heads=2),
            "packed",
        ),
    ],
)
def test_register_opaque_warns(events: Any, spec: Any, kv: Callable[[], dict[str, torch.Tensor]], reason: str) -> None:
    worker = registered(kv(), fake_vllm(heads=2), kv_config(spec))
    assert worker.kwargs["dims"] is None and worker.kwargs["kv_heads"] is None
    assert worker.layout is not None and not worker.layout.structured
    (warning,) = events.named("connector.layout_opaque")
    assert reason in warning["reason"] and warning["level"] == "warning"
    (event,) = events.named("connector.kv_registered")
    assert event["dims"] is None and event["regions"] == 3


def test_compat_has_no_block_size() -> None:
    a = conn.compat_from_vllm(fake_vllm(block_size=16))
    b = conn.compat_from_vllm(fake_vllm(block_size=128))
    assert a == b and a.kv_shape == (4, HEAD, 0)
    mla = conn.compat_from_vllm(fake_vllm(heads=1, mla=True))
    assert mla.kv_shape == (1, HEAD, 1) and mla != conn.compat_from_vllm(fake_vllm(heads=1))


# ------------------------------------------------------------------------------------------------
# The hand-built tensors are vLLM's
# ------------------------------------------------------------------------------------------------
def in_vllm(code: str) -> Any:
    """Run ``code`` (which prints one JSON value) in vLLM's environment: this interpreter when
    it has vLLM, else ``PUSHACTORS_VLLM_PYTHON`` (CI keeps vLLM in its own venv)."""
    py = sys.executable if HAVE_VLLM else os.environ.get("PUSHACTORS_VLLM_PYTHON")
    if not py:
        if os.environ.get("PUSHACTORS_REQUIRE_VLLM"):
            raise RuntimeError("PUSHACTORS_REQUIRE_VLLM is set but neither vLLM nor PUSHACTORS_VLLM_PYTHON is")
        pytest.skip("needs vLLM (the .venv-vllm environment, or PUSHACTORS_VLLM_PYTHON)")
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_VIEWS_SCRIPT = """
import json, torch
import vllm.v1.kv_cache_interface as kvi
from vllm.v1.kv_cache_layout import KVCacheLayout
BLOCK, HEAD, NBLOCKS, NAMES = {block}, {head}, {nblocks}, {names}
def views(layout, mla):
    lay = KVCacheLayout[layout]
    if mla:
        spec = kvi.MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=40, dtype=torch.bfloat16)
    else:
        spec = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=HEAD, dtype=torch.float16)
    packed = spec.page_size_bytes * len(NAMES) if lay.is_block_outermost else None
    layer_stride, block_stride, *_ = kvi.compute_layout_strides(
        spec, NBLOCKS, len(NAMES), lay, fixed_strides=(None, packed, None, None, None))
    size = spec.page_size_bytes * NBLOCKS * len(NAMES)
    tensor = kvi.KVCacheTensor(size=size, layers=list(NAMES), layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return [[list(v.shape), list(v.stride()), v.data_ptr() - raw.data_ptr()]
            for v in kvi.create_kv_cache_views(raw, spec, NBLOCKS, lay, tensor)]
print(json.dumps({{name: views(name if name != "MLA" else "LBHNC", name == "MLA") for name in {layouts!r}}}))
"""


@functools.lru_cache(maxsize=1)
def vllm_views() -> dict[str, Any]:
    """Every layout's per-layer views as vLLM creates them, in one vLLM process."""
    script = _VIEWS_SCRIPT.format(block=BLOCK, head=HEAD, nblocks=NBLOCKS, names=list(NAMES), layouts=[*ORDERS, "MLA"])
    return in_vllm(script)  # type: ignore[no-any-return]


@pytest.mark.parametrize("layout", [*ORDERS, "MLA"])
def test_hand_built_views_match_vllm(layout: str) -> None:
    mla = layout == "MLA"
    if mla:
        mine = vllm_kv("LBHNC", heads=1, content=40, dtype=torch.bfloat16)
    else:
        mine = vllm_kv(layout, heads=2)
    base = mine[NAMES[0]].data_ptr()
    ours = [(tuple(t.shape), tuple(t.stride()), t.data_ptr() - base) for t in mine.values()]
    theirs = [(tuple(s), tuple(st), off) for s, st, off in vllm_views()[layout]]
    assert ours == theirs


@pytest.mark.parametrize("how", ["aborted_while_waiting_for_blocks", "external_hit_dropped_by_vllm"])
def test_no_scheduler_state_outlives_a_request_that_never_registered(how: str) -> None:
    """get_num_new_matched_tokens notes D's local hit for a remote-prefill request. vLLM may then
    abort it before its blocks are allocated (allocation failed, client gone), or drop the
    external hit (skip_reading_prefix_cache: update_state_after_alloc with 0 tokens): the note
    must go with the request either way."""
    from pushactors import PushScheduler

    sched = PushScheduler(
        PushConfig(engine_id="decode-0", role="consumer"), side_channel_host="127.0.0.1", side_channel_port=5700
    )
    c = scheduler_connector(sched, block_size=16)
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_tp_size": 1,
    }
    for i in range(20):
        req = SimpleNamespace(
            request_id=f"cmpl-{i}-0-0000abcd",
            kv_transfer_params=dict(params),
            prompt_token_ids=list(range(100)),
            status=SimpleNamespace(name="FINISHED_ABORTED"),
        )
        assert c.get_num_new_matched_tokens(req, 32) == (68, True)
        if how == "external_hit_dropped_by_vllm":
            c.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6, 7],)), 0)
            req.status = SimpleNamespace(name="FINISHED_STOPPED")
        assert c.request_finished(req, [1, 2, 3]) == (False, None)
    assert c.scheduler_tables() == {"registered": 0, "local_hits": 0}
    assert sched.build_connector_meta().registrations == ()


def test_compat_model_is_the_connectors_own_key_not_a_transport_setting() -> None:
    """docs/vllm.md gives compat_model; PushConfig must not see it (unknown field) while the
    compatibility hash takes it."""
    cfg = fake_vllm(device="cpu", extra={"compat_model": "MyArch"})
    assert conn.config_from_vllm(cfg).engine_id  # no ConfigError
    assert conn.compat_from_vllm(cfg, "MyArch").model == "MyArch"
