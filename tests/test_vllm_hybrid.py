"""Hybrid KV caches (vLLM's hybrid allocator): pushes per KV cache group, checked by meaning.

Sliding window + full attention, and state-space (Mamba / linear attention) + full attention.

A real vLLM 0.32 ``KVCacheConfig`` for a model of full-attention and sliding-window layers is built
with vLLM's own classes (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``), its KV
tensors with ``create_kv_cache_views``, and each request's block ids per group by vLLM's own
``KVCacheManager``: P's as ``request_finished_all_groups`` gets them (behind-the-window blocks
freed to the null block), D's as ``update_state_after_alloc`` gets them for a remote prefill.
The connector's registration, regions and pairing then play the push through the paired
descriptors (``ctypes.memmove``, as the layout tests do), and D is checked by meaning: every
page D's window or full attention reads holds P's page of the same layer and token positions,
and nothing else of D changed (its null block least of all).

The state-space model's config comes from vLLM's ``MambaSpec`` in both mamba cache modes the push
serves (``align``: prefix caching, ``none``); P has computed all but the last prompt token, D
registers for those. D must end with P's state page in the one block its state group reads, the
attention blocks of every pushed token, and nothing else changed.

vLLM runs in its own environment (``PUSHACTORS_VLLM_PYTHON``); the push runs here.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_vllm_layout import conn, fake_vllm, in_vllm, scheduler_connector

from pushactors.core.blocks import KVLayout, LayoutError, PairedLayout, RemoteLayout, model_heads
from pushactors.core.topology import write_heads
from pushactors.integrations.kv_groups import FULL, NULL_BLOCK, SLIDING_WINDOW, STATE, CacheGroup, CacheGroups

BLOCK, HEAD, HEADS, WINDOW, LAYERS = 16, 8, 2, 40, 4
PROMPTS = (5, 16, 39, 40, 41, 56, 57, 100, 160, 203)  # tokens: inside, at and past the window's edges
FILLER = 37  # tokens of a request allocated first, so block ids are not trivial

_SCRIPT = """
import json, torch
import vllm.v1.kv_cache_interface as kvi
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request
from pushactors.integrations.kv_groups import CacheGroups

BLOCK, HEAD, HEADS, WINDOW, LAYERS, PROMPTS, FILLER = {args}
cfg = VllmConfig()
cfg.cache_config.kv_cache_layout = "LBHNC"
cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
spec = {{}}
for i in range(LAYERS):
    kw = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    name = f"model.layers.{{i}}.self_attn.attn"
    spec[name] = kvi.SlidingWindowSpec(sliding_window=WINDOW, **kw) if i % 2 else kvi.FullAttentionSpec(**kw)
groups = ku.get_kv_cache_groups(cfg, spec)
kvc = ku.get_kv_cache_config_from_groups(cfg, groups, 64 * 1024 * LAYERS)
layout = KVCacheLayout["LBHNC"]
tensors = []
for t in kvc.kv_cache_tensors:
    raw = torch.zeros(t.size, dtype=torch.int8)
    views = kvi.create_kv_cache_views(raw, spec[t.layers[0]], kvc.num_blocks, layout, t)
    tensors.append(dict(size=t.size, layers=list(t.layers),
                        views=[[list(v.shape), list(v.stride()), v.data_ptr() - raw.data_ptr()] for v in views]))

def manager():
    return KVCacheManager(kvc, max_model_len=4096, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                          enable_caching=False)

def request(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), None)

cases = []
for n in PROMPTS:
    p, d = manager(), manager()
    for m in (p, d):
        m.allocate_slots(request("filler", FILLER + n % 7), FILLER + n % 7)
    # P: the prompt computed, then what _connector_finished hands request_finished_all_groups.
    r = request("p", n)
    p.allocate_slots(r, n)
    r.num_computed_tokens = n
    p.remove_skipped_blocks(request_id="p", processed_computed_tokens=n, num_prompt_tokens=n)
    p_ids = [list(g) for g in p.get_block_ids_for_computed_tokens(request_id="p", num_computed_tokens=n)]
    # D: a remote prefill of the whole prompt, as the scheduler allocates it (async load).
    r = request("d", n)
    computed, local = d.get_computed_blocks(r)[:2]
    d.allocate_slots(r, 0, num_new_computed_tokens=local, new_computed_blocks=computed,
                     num_external_computed_tokens=n - local, delay_cache_blocks=True)
    d_ids = [list(g) for g in d.get_blocks("d").get_block_ids()]
    cases.append(dict(tokens=n, local=local, p=p_ids, d=d_ids))

cg = CacheGroups.from_vllm(kvc, BLOCK)
print(json.dumps(dict(
    num_blocks=kvc.num_blocks, tensors=tensors, cases=cases,
    groups=[dict(kind=g.kind, block_size=g.block_size, window=g.window, layers=list(g.layers)) for g in cg.groups],
    null=p.block_pool.null_block.block_id, refusal=cg.refusal(), layer_groups=cg.layer_groups(),
)))
"""


@functools.lru_cache(maxsize=1)
def vllm_hybrid() -> dict[str, Any]:
    """vLLM's KV cache config, tensors and block ids for the sliding-window + full model."""
    args = (BLOCK, HEAD, HEADS, WINDOW, LAYERS, PROMPTS, FILLER)
    return in_vllm(_SCRIPT.format(args=repr(args)))  # type: ignore[no-any-return]


@dataclass
class Side:
    """One engine's KV memory as vLLM allocated it, registered as the connector does."""

    buffers: list[torch.Tensor]
    tensors: dict[str, torch.Tensor]  # vLLM's per-layer views
    layout: KVLayout

    def page(self, layer: str, block: int) -> bytes:
        t = self.tensors[layer][block]
        return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())

    def remote(self) -> RemoteLayout:
        return RemoteLayout(
            engine_id="decode-0",
            agent_name="decode-0-0",
            regions=self.layout.regions,
            block_size=self.layout.block_size,
            physical_blocks_per_logical=self.layout.physical_blocks_per_logical,
            tp_size=1,
            tp_rank=0,
            pp_size=1,
            pp_rank=0,
            mem_type="DRAM",
            kv_heads=self.layout.kv_heads,
        )


def cache_groups(info: dict[str, Any]) -> CacheGroups:
    return CacheGroups(
        tuple(CacheGroup(g["kind"], g["block_size"], g["window"], tuple(g["layers"])) for g in info["groups"])
    )


def side(
    info: dict[str, Any], *, cpu: bool, groups: dict[str, int] | None = None, only: set[str] | None = None
) -> Side:
    buffers: list[torch.Tensor] = []
    views: dict[str, torch.Tensor] = {}
    for t in info["tensors"]:
        raw = torch.zeros(t["size"], dtype=torch.int8)
        buffers.append(raw)
        for name, (shape, stride, off) in zip(t["layers"], t["views"], strict=True):
            # vLLM's float16 views: strides in elements, offsets in bytes.
            views[name] = torch.as_strided(raw.view(torch.float16), shape, stride, off // 2)
    if only is not None:
        views = {k: v for k, v in views.items() if k in only}
    desc = conn.describe_kv_caches(
        views,
        kv_heads=HEADS,
        head_size=HEAD,
        head_size_v=HEAD,
        use_mla=False,
        block_size=BLOCK,
        num_blocks=info["num_blocks"],
        cpu_pages=cpu,
    )
    assert desc.dims is not None, desc.reason
    layout = KVLayout.from_tensors(
        desc.tensors,
        block_size=BLOCK,
        num_blocks=info["num_blocks"],
        dims=desc.dims,
        kv_heads=desc.kv_heads,
        groups=cache_groups(info).layer_groups() if groups is None else groups,
    )
    return Side(buffers, views, layout)


def fill(s: Side, rng: np.random.Generator) -> None:
    for raw in s.buffers:
        raw.copy_(torch.from_numpy(rng.integers(1, 256, raw.numel(), dtype=np.uint8).view(np.int8)))


def snapshot(s: Side) -> list[bytes]:
    return [bytes(raw.numpy().view(np.uint8)) for raw in s.buffers]


def play(p: Side, d: Side, p_ids: list[list[int]], d_ids: list[list[int]], skips: list[int]) -> int:
    paired = PairedLayout(p.layout, (0, 1), d.remote(), range(HEADS), HEADS)
    plan = paired.plan(p_ids, d_ids, skips)
    local = paired.local_descriptors()[plan.local_idx]
    remote = paired.remote_descriptors()[plan.remote_idx]
    for (src, n, _), (dst, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
        ctypes.memmove(int(dst), int(src), int(n))
    return plan.nbytes


def read_by_d(group: CacheGroup, tokens: int) -> range:
    """Block positions D's attention reads for its first decode (the token after the prompt)."""
    last = -(-tokens // group.block_size)
    if group.kind == SLIDING_WINDOW:
        return range(max(0, tokens - group.window + 1) // group.block_size, last)
    return range(last)


# ------------------------------------------------------------------------------------------------
# vLLM's groups, as the connector reads them
# ------------------------------------------------------------------------------------------------
def test_groups_of_a_sliding_window_and_full_model() -> None:
    info = vllm_hybrid()
    kinds = [(g["kind"], g["window"], g["block_size"]) for g in info["groups"]]
    assert sorted(kinds) == [(FULL, 0, BLOCK), (SLIDING_WINDOW, WINDOW, BLOCK)]
    assert info["refusal"] is None and info["null"] == NULL_BLOCK
    # Every layer is in exactly one group, the one vLLM put it in.
    assert sorted(info["layer_groups"]) == [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    for i, g in enumerate(info["groups"]):
        assert all(info["layer_groups"][name] == i for name in g["layers"])


def test_vllm_frees_behind_the_window_on_both_sides() -> None:
    """What the connector is handed: null blocks behind the window, on P and on D alike."""
    info = vllm_hybrid()
    cg = cache_groups(info)
    sw = next(i for i, g in enumerate(cg.groups) if g.kind == SLIDING_WINDOW)
    long = [c for c in info["cases"] if c["tokens"] - WINDOW + 1 >= BLOCK]
    assert long, "no prompt long enough to leave a block behind the window"
    for c in long:
        for ids in (c["p"][sw], c["d"][sw]):
            assert ids[0] == NULL_BLOCK and ids[-1] != NULL_BLOCK, c
    for c in info["cases"]:
        full = 1 - sw
        assert NULL_BLOCK not in c["p"][full] and NULL_BLOCK not in c["d"][full]


# ------------------------------------------------------------------------------------------------
# The push, by meaning
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cpu", [False, True], ids=["gpu_pages", "cpu_pages"])
def test_each_group_pushes_what_d_reads_and_nothing_else(cpu: bool) -> None:
    info = vllm_hybrid()
    cg = cache_groups(info)
    rng = np.random.default_rng(7)
    for case in info["cases"]:
        n = case["tokens"]
        p, d = side(info, cpu=cpu), side(info, cpu=cpu)
        fill(p, rng)
        before = snapshot(d)
        groups, skips = cg.registration(case["d"], case["local"], n - case["local"])
        assert cg.unheld(case["p"], n) is None
        nbytes = play(p, d, case["p"], groups, skips)
        page = len(p.page(cg.groups[0].layers[0], 1))
        assert nbytes == sum(len(ids) * len(g.layers) * page for ids, g in zip(groups, cg.groups, strict=True))
        written: set[tuple[str, int]] = set()
        for gi, g in enumerate(cg.groups):
            # D registered no null block, and every block D reads.
            assert NULL_BLOCK not in groups[gi]
            registered = range(skips[gi], skips[gi] + len(groups[gi]))
            assert set(read_by_d(g, n)) <= set(registered), (n, g.kind, skips[gi], len(groups[gi]))
            for layer in g.layers:
                for pos, d_block in zip(registered, groups[gi], strict=True):
                    assert d.page(layer, d_block) == p.page(layer, case["p"][gi][pos]), (n, layer, pos)
                    written.add((layer, d_block))
        # Nothing else of D changed: every other page of every layer is as it was.
        after = snapshot(d)
        for layer, t in d.tensors.items():
            buf = next(
                i for i, b in enumerate(d.buffers) if b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            )
            for b in range(info["num_blocks"]):
                if (layer, b) in written:
                    continue
                off = t[b].data_ptr() - d.buffers[buf].data_ptr()
                size = t[b].numel() * 2
                assert after[buf][off : off + size] == before[buf][off : off + size], (n, layer, b)


def test_registering_d_null_blocks_would_write_them() -> None:
    """Negative control: the blocks vLLM hands D include null blocks behind the window;
    registered as they come, the push writes P's KV into D's null block."""
    info = vllm_hybrid()
    cg = cache_groups(info)
    sw = next(i for i, g in enumerate(cg.groups) if g.kind == SLIDING_WINDOW)
    case = next(c for c in info["cases"] if c["d"][sw][0] == NULL_BLOCK)
    p, d = side(info, cpu=False), side(info, cpu=False)
    fill(p, np.random.default_rng(1))
    layer = cg.groups[sw].layers[0]
    assert set(d.page(layer, NULL_BLOCK)) == {0}
    play(p, d, case["p"], case["d"], [0] * len(cg.groups))
    assert set(d.page(layer, NULL_BLOCK)) != {0}


def test_p_that_freed_what_d_reads_refuses_to_push() -> None:
    """P computed past the prompt (its window moved on): the blocks D's window reads are gone."""
    info = vllm_hybrid()
    cg = cache_groups(info)
    sw = next(i for i, g in enumerate(cg.groups) if g.kind == SLIDING_WINDOW)
    case = next(c for c in info["cases"] if c["tokens"] >= 100)
    freed = [list(ids) for ids in case["p"]]
    first = freed[sw].index(next(b for b in freed[sw] if b != NULL_BLOCK))
    freed[sw][first] = NULL_BLOCK
    why = cg.unheld(freed, case["tokens"])
    assert why is not None and "P freed" in why


# ------------------------------------------------------------------------------------------------
# Pairing by layer name and cache group
# ------------------------------------------------------------------------------------------------
def test_a_layer_in_another_group_on_d_fails_the_pairing() -> None:
    info = vllm_hybrid()
    p = side(info, cpu=False)
    swapped = {name: 1 - g for name, g in cache_groups(info).layer_groups().items()}
    d = side(info, cpu=False, groups=swapped)
    with pytest.raises(LayoutError, match="group differs"):
        PairedLayout(p.layout, (0, 1), d.remote(), range(HEADS), HEADS)


def test_remote_only_layers_are_ignored_and_a_missing_local_layer_fails() -> None:
    info = vllm_hybrid()
    names = sorted(cache_groups(info).layer_groups())
    full = side(info, cpu=False)
    part = side(info, cpu=False, only=set(names[:2]))  # a PP stage's layers
    PairedLayout(part.layout, (0, 1), full.remote(), range(HEADS), HEADS)  # D holds more: fine
    with pytest.raises(LayoutError, match="does not advertise layer"):
        PairedLayout(full.layout, (0, 1), part.remote(), range(HEADS), HEADS)


# ------------------------------------------------------------------------------------------------
# The connector's hooks
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int = BLOCK
    num_kv_heads: int = HEADS
    head_size: int = HEAD
    head_size_v: int = HEAD


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = WINDOW


@dataclass(frozen=True)
class MambaSpec:
    block_size: int = BLOCK
    mamba_cache_mode: str = "align"
    num_speculative_blocks: int = 0


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(FullAttentionSpec):
    attention_chunk_size: int = 32


def kv_config(*specs: Any) -> SimpleNamespace:
    return SimpleNamespace(
        num_blocks=64,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=[f"layer.{i}"]) for i, s in enumerate(specs)],
    )


class RecordingScheduler:
    def __init__(self) -> None:
        self.staged: list[tuple[str, Any, Any]] = []
        self.finished: list[tuple[str, Any]] = []
        self.cancelled: list[tuple[str, str]] = []

    def stage_registration(self, request_id: str, block_ids: Any, params: Any, *, skip_blocks: Any = None) -> None:
        self.staged.append((request_id, block_ids, skip_blocks))

    def reject_recv(self, request_id: str, reason: str) -> None:
        raise AssertionError(f"rejected {request_id}: {reason}")

    def announced(self, request_id: str) -> bool:
        return False

    def request_finished(self, request_id: str, block_ids: Any, params: Any) -> tuple[bool, dict[str, Any]]:
        self.finished.append((request_id, block_ids))
        return True, {"remote_engine_id": "prefill-0"}

    def request_cancelled(self, request_id: str, params: Any, reason: str = "") -> bool:
        self.cancelled.append((request_id, reason))
        return True


def hybrid_connector(sched: RecordingScheduler) -> Any:
    return scheduler_connector(sched, kv_cache_config=kv_config(FullAttentionSpec(), SlidingWindowSpec()))


def test_d_registers_per_group_without_null_blocks() -> None:
    sched = RecordingScheduler()
    c = hybrid_connector(sched)
    request = SimpleNamespace(
        request_id="r1",
        kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "p"},
        prompt_token_ids=list(range(100)),
    )
    # 100 tokens, 16 cached: the window (40) reads from token 61, block 3 on.
    assert c.get_num_new_matched_tokens(request, 16) == (84, True)
    blocks = SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 21, 22, 23, 24]))
    c.update_state_after_alloc(request, blocks, 84)
    assert sched.staged == [("r1", [[6, 7, 8, 9, 10, 11], [21, 22, 23, 24]], [1, 3])]
    assert c.get_loaded_kv_cache_group_ids(request) == (0, 1)


def test_p_finishes_with_every_group() -> None:
    sched = RecordingScheduler()
    c = hybrid_connector(sched)
    params = {"do_remote_decode": True}
    request = SimpleNamespace(
        request_id="r2",
        kv_transfer_params=params,
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
        num_prompt_tokens=100,
    )
    delay, out = c.request_finished_all_groups(request, ([5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 21, 22, 23, 24]))
    assert delay and sched.finished == [("r2", [[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 21, 22, 23, 24]])]
    assert out is not None and out["remote_block_ids"] == [[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 21, 22, 23, 24]]
    # A P whose window moved past what D reads fails the push visibly instead.
    request.request_id = "r3"
    assert c.request_finished_all_groups(request, ([5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 0, 22, 23, 24])) == (False, None)
    assert sched.cancelled and sched.cancelled[0][0] == "r3" and "P freed" in sched.cancelled[0][1]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (MambaSpec(mamba_cache_mode="all"), "mamba_cache_mode 'all'"),
        (MambaSpec(num_speculative_blocks=2), "2 speculative scratch blocks"),
        (ChunkedLocalAttentionSpec(), "ChunkedLocalAttentionSpec"),
    ],
)
def test_what_a_push_cannot_serve_is_refused_at_start(spec: Any, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        conn.PushActorsConnector(fake_vllm(), conn.KVConnectorRole.SCHEDULER, kv_config(FullAttentionSpec(), spec))


def test_layerwise_pushes_of_state_are_refused_at_start() -> None:
    vllm = fake_vllm(extra={"push_mode": "layerwise"})
    with pytest.raises(ValueError, match="layer-wise pushes of Mamba/linear-attention state"):
        conn.PushActorsConnector(vllm, conn.KVConnectorRole.SCHEDULER, kv_config(MambaSpec(), FullAttentionSpec()))


def test_a_window_is_part_of_what_p_and_d_must_agree_on() -> None:
    hybrid = CacheGroups.from_vllm(kv_config(FullAttentionSpec(), SlidingWindowSpec()), BLOCK)
    full = CacheGroups.from_vllm(kv_config(FullAttentionSpec()), BLOCK)
    plain = conn.compat_from_vllm(fake_vllm())
    assert conn.compat_from_vllm(fake_vllm(), groups=full) == plain  # non-hybrid models: as before
    windowed = conn.compat_from_vllm(fake_vllm(), groups=hybrid)
    assert windowed != plain and "sliding_window:40@16" in windowed.model
    other = CacheGroups.from_vllm(kv_config(FullAttentionSpec(), SlidingWindowSpec(block_size=32)), BLOCK)
    assert conn.compat_from_vllm(fake_vllm(), groups=other) != windowed


def test_p_lists_open_with_the_null_block_only() -> None:
    """P's own lists may open with the null block repeated (blocks freed behind a window);
    any other repeat, and any repeat in D's registered blocks, is refused."""
    from pushactors import PushScheduler
    from pushactors.core.config import PushConfig

    sched = PushScheduler(
        PushConfig(engine_id="prefill-0", role="producer"), side_channel_host="127.0.0.1", side_channel_port=5600
    )
    params = {"do_remote_decode": True}
    delay, _ = sched.request_finished("r1", [[5, 6, 7, 8], [0, 0, 0, 21]], params)
    (finished,) = sched.build_connector_meta().finished
    assert delay and finished.block_ids == ((5, 6, 7, 8), (0, 0, 0, 21))
    for bad in ([[5, 6], [0, 21, 0]], [[5, 6, 5], [0, 21]], [[5, 6], [21, 0, 21]]):
        with pytest.raises(ValueError, match="duplicated"):
            sched.request_finished("r2", bad, params)
    with pytest.raises(ValueError, match="duplicated"):
        sched.stage_registration(
            "d1",
            [[5, 6], [0, 0, 21]],
            {
                "do_remote_prefill": True,
                "remote_engine_id": "prefill-0",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "remote_tp_size": 1,
            },
        )


# ------------------------------------------------------------------------------------------------
# State-space groups (Mamba / linear attention)
# ------------------------------------------------------------------------------------------------
STATE_PROMPTS = (2, 5, 16, 17, 18, 33, 40, 100)  # prompt tokens; P computes all but the last
MAX_LEN = 256  # the model length: a state group's block size in mamba cache mode "none"

_STATE_SCRIPT = """
import json, torch
import vllm.v1.kv_cache_interface as kvi
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as ku
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request
from pushactors.integrations.kv_groups import CacheGroups

BLOCK, HEAD, HEADS, LAYERS, PROMPTS, FILLER, MODE, MAX_LEN = {args}
cfg = VllmConfig()
cfg.cache_config.kv_cache_layout = "LBHNC"
cfg.cache_config.mamba_cache_mode = MODE
cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
page = BLOCK * HEADS * HEAD * 2 * 2
# As vLLM sizes a hybrid: the state page padded to the attention page; in mode "none" the state
# group's block size is the model length (one state block per request).
state_block = BLOCK if MODE == "align" else MAX_LEN
spec = {{}}
for i in range(LAYERS):
    if i % 2:
        spec[f"model.layers.{{i}}.self_attn.attn"] = kvi.FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    else:
        spec[f"model.layers.{{i}}.linear_attn"] = kvi.MambaSpec(
            block_size=state_block, shapes=((3, 16), (2, 8, 8)), dtypes=(torch.float16, torch.float32),
            page_size_padded=page, mamba_cache_mode=MODE)
groups = ku.get_kv_cache_groups(cfg, spec)
kvc = ku.get_kv_cache_config_from_groups(cfg, groups, 64 * page * LAYERS)
layout = KVCacheLayout["LBHNC"]
tensors = []
for t in kvc.kv_cache_tensors:
    raw = torch.zeros(t.size, dtype=torch.int8)
    views = kvi.create_kv_cache_views(raw, spec[t.layers[0]], kvc.num_blocks, layout, t)
    tensors.append(dict(size=t.size, layers=list(t.layers), views=[
        [list(v.shape), list(v.stride()), v.data_ptr() - raw.data_ptr(), str(v.dtype).split(".")[-1]] for v in views]))
ku.init_none_hash(sha256)
hasher = ku.get_request_block_hasher(BLOCK, sha256) if MODE == "align" else None

def manager():
    return KVCacheManager(kvc, max_model_len=MAX_LEN, scheduler_block_size=state_block, hash_block_size=BLOCK,
                          enable_caching=MODE == "align")

def request(rid, n):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), None, block_hasher=hasher)

cases = []
for n in PROMPTS:
    p, d = manager(), manager()
    for m in (p, d):
        m.allocate_slots(request("filler", FILLER + n % 7), FILLER + n % 7)
    # P: the prompt less its last token computed (the stop short), as request_finished gets it.
    pushed = n - 1 if n > 1 else n
    r = request("p", pushed)
    p.allocate_slots(r, pushed)
    r.num_computed_tokens = pushed
    p.remove_skipped_blocks(request_id="p", processed_computed_tokens=pushed, num_prompt_tokens=pushed)
    p_ids = [list(g) for g in p.get_block_ids_for_computed_tokens(request_id="p", num_computed_tokens=pushed)]
    # D: a remote prefill of those tokens, as the scheduler allocates it (async load).
    r = request("d", n)
    computed, local = d.get_computed_blocks(r)[:2]
    d.allocate_slots(r, 0, num_new_computed_tokens=local, new_computed_blocks=computed,
                     num_external_computed_tokens=pushed - local, delay_cache_blocks=True)
    d_ids = [list(g) for g in d.get_blocks("d").get_block_ids()]
    cases.append(dict(tokens=n, pushed=pushed, local=local, p=p_ids, d=d_ids))

cg = CacheGroups.from_vllm(kvc, BLOCK)
print(json.dumps(dict(
    num_blocks=kvc.num_blocks, tensors=tensors, cases=cases, describe=cg.describe(), refusal=cg.refusal(),
    groups=[dict(kind=g.kind, block_size=g.block_size, mode=g.mode, layers=list(g.layers)) for g in cg.groups],
)))
"""


@functools.lru_cache(maxsize=2)
def vllm_state(mode: str) -> dict[str, Any]:
    """vLLM's KV cache config, tensors and block ids for a Mamba + full-attention model."""
    args = (BLOCK, HEAD, HEADS, LAYERS, STATE_PROMPTS, FILLER, mode, MAX_LEN)
    return in_vllm(_STATE_SCRIPT.format(args=repr(args)))  # type: ignore[no-any-return]


def state_groups(info: dict[str, Any]) -> CacheGroups:
    return CacheGroups(
        tuple(CacheGroup(g["kind"], g["block_size"], layers=tuple(g["layers"]), mode=g["mode"]) for g in info["groups"])
    )


def state_side(info: dict[str, Any]) -> Side:
    """An engine's KV memory registered as the connector registers a model with state: opaque."""
    buffers: list[torch.Tensor] = []
    views: dict[str, torch.Tensor] = {}
    for t in info["tensors"]:
        raw = torch.zeros(t["size"], dtype=torch.int8)
        buffers.append(raw)
        for name, (shape, stride, off, dtype) in zip(t["layers"], t["views"], strict=True):
            typed = raw.view(getattr(torch, dtype))
            views[name] = torch.as_strided(typed, shape, stride, off // typed.element_size())
    desc = conn.opaque_kv_caches(views, "Mamba/SSM state is not per-token KV", num_blocks=info["num_blocks"])
    assert desc.dims is None and desc.blocks_per_logical == 1
    layout = KVLayout.from_tensors(
        desc.tensors, block_size=BLOCK, num_blocks=info["num_blocks"], groups=state_groups(info).layer_groups()
    )
    return Side(buffers, views, layout)


def play_opaque(p: Side, d: Side, p_ids: list[list[int]], d_ids: list[list[int]], skips: list[int]) -> int:
    """P's WRITE into D as P's writer pairs opaque layouts (same TP), through the descriptors."""
    remote = d.remote()
    kv_heads = model_heads(p.layout, remote, 1, 1)
    paired = PairedLayout(p.layout, (0, 1), remote, write_heads(0, 1, 0, 1, kv_heads), kv_heads)
    plan = paired.plan(p_ids, d_ids, skips)
    local = paired.local_descriptors()[plan.local_idx]
    far = paired.remote_descriptors()[plan.remote_idx]
    for (src, n, _), (dst, _, _) in zip(local.tolist(), far.tolist(), strict=True):
        ctypes.memmove(int(dst), int(src), int(n))
    return plan.nbytes


def page_range(s: Side, layer: str, block: int) -> tuple[int, int, int]:
    """(buffer index, byte offset, bytes) of a layer's page in its buffer."""
    t = s.tensors[layer]
    ptr = t[block].data_ptr()
    buf = next(i for i, b in enumerate(s.buffers) if b.data_ptr() <= ptr < b.data_ptr() + b.numel())
    return buf, ptr - s.buffers[buf].data_ptr(), t[block].numel() * t.element_size()


@pytest.mark.parametrize("mode", ["align", "none"])
def test_groups_of_a_state_space_and_full_model(mode: str) -> None:
    info = vllm_state(mode)
    assert info["refusal"] is None
    block = BLOCK if mode == "align" else MAX_LEN
    assert info["describe"] == f"state:{mode}@{block}+full@{BLOCK}"
    cg = state_groups(info)
    assert cg.backoff == 1 and cg.stateful
    state = next(g for g in cg.groups if g.kind == STATE)
    # vLLM keeps one live state block per request, where the connector looks for it.
    for c in info["cases"]:
        ids = c["p"][cg.groups.index(state)]
        slot = state.state_slot(c["pushed"])
        assert ids[slot] != NULL_BLOCK and all(b == NULL_BLOCK for b in ids[:slot]), (mode, c)


@pytest.mark.parametrize("mode", ["align", "none"])
def test_state_groups_push_the_state_block_and_nothing_else(mode: str) -> None:
    info = vllm_state(mode)
    cg = state_groups(info)
    rng = np.random.default_rng(11)
    for case in info["cases"]:
        n, pushed, local = case["tokens"], case["pushed"], case["local"]
        p, d = state_side(info), state_side(info)
        fill(p, rng)
        before = snapshot(d)
        assert cg.unheld(case["p"], pushed) is None
        groups, skips = cg.registration(case["d"], local, pushed - local)
        p_ids = cg.pushed(case["p"], pushed)
        nbytes = play_opaque(p, d, p_ids, groups, skips)
        written: list[tuple[int, int, int]] = []
        expected = 0
        for gi, g in enumerate(cg.groups):
            assert NULL_BLOCK not in groups[gi]
            if g.kind == STATE:
                # One block: D's state slot for the pushed tokens gets P's state after them.
                assert len(groups[gi]) == 1 and skips[gi] == g.state_slot(pushed), (n, skips)
                pairs = [(case["p"][gi][g.state_slot(pushed)], groups[gi][0])]
            else:
                # Every attention block from D's prefix hit to the last pushed token.
                assert skips[gi] == local // g.block_size and len(groups[gi]) == -(-pushed // g.block_size) - skips[gi]
                pairs = list(zip(case["p"][gi][skips[gi] :], groups[gi], strict=True))
            for layer in g.layers:
                for p_block, d_block in pairs:
                    assert d.page(layer, d_block) == p.page(layer, p_block), (mode, n, layer, p_block, d_block)
                    written.append(page_range(d, layer, d_block))
                    expected += len(p.page(layer, p_block))
        assert nbytes == expected
        # Nothing else of D changed, the state pages' padding and D's null block included.
        after = snapshot(d)
        for buf in range(len(d.buffers)):
            keep = np.ones(len(before[buf]), dtype=bool)
            for b, off, size in written:
                if b == buf:
                    keep[off : off + size] = False
            old = np.frombuffer(before[buf], dtype=np.uint8)
            new = np.frombuffer(after[buf], dtype=np.uint8)
            assert np.array_equal(old[keep], new[keep]), (mode, n, buf)


def test_registering_a_state_group_as_tokens_would_write_d_null_block() -> None:
    """Negative control (align mode): D's state list opens with null blocks. Registered as a
    token group would be, the push writes P's pages into D's null block."""
    info = vllm_state("align")
    cg = state_groups(info)
    si = next(i for i, g in enumerate(cg.groups) if g.kind == STATE)
    case = next(c for c in info["cases"] if c["d"][si][0] == NULL_BLOCK)
    p, d = state_side(info), state_side(info)
    fill(p, np.random.default_rng(3))
    layer = cg.groups[si].layers[0]
    assert set(d.page(layer, NULL_BLOCK)) == {0}
    play_opaque(p, d, case["p"], case["d"], [0] * len(cg.groups))
    assert set(d.page(layer, NULL_BLOCK)) != {0}


def test_p_without_its_state_block_refuses_to_push() -> None:
    info = vllm_state("align")
    cg = state_groups(info)
    si = next(i for i, g in enumerate(cg.groups) if g.kind == STATE)
    case = next(c for c in info["cases"] if c["pushed"] > BLOCK)
    lost = [list(ids) for ids in case["p"]]
    lost[si][cg.groups[si].state_slot(case["pushed"])] = NULL_BLOCK
    why = cg.unheld(lost, case["pushed"])
    assert why is not None and "no state block" in why


def state_connector(sched: RecordingScheduler, *, tp: int = 1, mode: str = "align") -> Any:
    return scheduler_connector(
        sched, kv_cache_config=kv_config(MambaSpec(mamba_cache_mode=mode), FullAttentionSpec()), tp_size=tp
    )


class PRequest(SimpleNamespace):
    def get_skip_reading_prefix_cache(self) -> bool:
        return bool(self.skip_prefix)


def p_request(tokens: int, *, skip_prefix: bool = False) -> PRequest:
    ids = list(range(1, tokens + 1))
    return PRequest(
        request_id="p1",
        kv_transfer_params={"do_remote_decode": True},
        prompt_token_ids=ids,
        _all_token_ids=list(ids),
        num_prompt_tokens=tokens,
        max_tokens=12,
        skip_prefix=skip_prefix,
    )


def test_p_stops_one_token_short_and_d_loads_all_but_the_last() -> None:
    sched = RecordingScheduler()
    c = state_connector(sched)
    r = p_request(40)
    c.on_new_request(r)
    assert (r.num_prompt_tokens, len(r.prompt_token_ids), len(r._all_token_ids), r.max_tokens) == (39, 39, 39, 1)
    c.on_new_request(r)  # again (a preempted request comes back): not cut twice
    assert r.num_prompt_tokens == 39
    # A request that reads no prefix cache, and a one-token prompt, are left whole.
    for whole in (p_request(40, skip_prefix=True), p_request(1)):
        c.on_new_request(whole)
        assert whole.num_prompt_tokens == len(whole.prompt_token_ids) and whole.max_tokens == 12
    # The first's state is past what D loads: never pushed, D's request fails visibly.
    unpushable = p_request(40, skip_prefix=True)
    c.on_new_request(unpushable)
    unpushable.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert c.request_finished_all_groups(unpushable, ([0, 0, 9], [5, 6, 8])) == (False, None)
    assert [rid for rid, _ in sched.cancelled] == ["p1"]
    assert "whole prompt" in sched.cancelled[0][1] and not sched.finished
    d = SimpleNamespace(
        request_id="d1", kv_transfer_params={"do_remote_prefill": True}, prompt_token_ids=list(range(40))
    )
    assert c.get_num_new_matched_tokens(d, 0) == (39, True)
    assert c.get_num_new_matched_tokens(d, 32) == (7, True)
    assert c.get_num_new_matched_tokens(d, 39) == (0, False)
    # Without a state group nothing changes.
    plain = scheduler_connector(RecordingScheduler(), kv_cache_config=kv_config(FullAttentionSpec()))
    r = p_request(40)
    plain.on_new_request(r)
    assert r.num_prompt_tokens == 40
    assert plain.get_num_new_matched_tokens(d, 0) == (40, True)


def test_p_pushes_only_its_state_block() -> None:
    sched = RecordingScheduler()
    c = state_connector(sched)
    request = SimpleNamespace(
        request_id="r2",
        kv_transfer_params={"do_remote_decode": True},
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
        num_prompt_tokens=39,  # cut short by on_new_request
    )
    # Align mode: an earlier state (kept for the prefix cache) before the live one.
    delay, out = c.request_finished_all_groups(request, ([7, 0, 9], [5, 6, 8]))
    assert delay and sched.finished == [("r2", [[0, 0, 9], [5, 6, 8]])]
    assert out is not None and out["remote_block_ids"] == [[0, 0, 9], [5, 6, 8]]


class RejectingScheduler(RecordingScheduler):
    def __init__(self) -> None:
        super().__init__()
        self.rejected: list[tuple[str, str]] = []

    def reject_recv(self, request_id: str, reason: str) -> None:
        self.rejected.append((request_id, reason))


def test_d_registers_the_state_slot_and_refuses_a_p_of_another_tp() -> None:
    sched = RejectingScheduler()
    c = state_connector(sched, tp=1)
    params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_tp_size": 1}
    request = SimpleNamespace(request_id="r1", kv_transfer_params=params)
    blocks = SimpleNamespace(get_block_ids=lambda: ([0, 0, 31], [5, 6, 7]))
    c.update_state_after_alloc(request, blocks, 39)
    assert sched.staged == [("r1", [[31], [5, 6, 7]], [2, 0])] and not sched.rejected
    # D's own prefix hit (32 tokens, its state block 30 among them): the state slot after the
    # pushed tokens is the one registered, the attention blocks past the hit.
    hit = SimpleNamespace(request_id="r3", kv_transfer_params=dict(params), prompt_token_ids=list(range(40)))
    assert c.get_num_new_matched_tokens(hit, 32) == (7, True)
    c.update_state_after_alloc(hit, SimpleNamespace(get_block_ids=lambda: ([0, 30, 31], [5, 6, 7])), 7)
    assert sched.staged[-1] == ("r3", [[31], [7]], [2, 2])
    sched.staged.pop()
    other = SimpleNamespace(request_id="r2", kv_transfer_params={**params, "remote_tp_size": 2})
    c.update_state_after_alloc(other, blocks, 39)
    assert len(sched.staged) == 1
    assert sched.rejected and sched.rejected[0][0] == "r2" and "equal TP sizes" in sched.rejected[0][1]


def test_a_state_group_is_part_of_what_p_and_d_must_agree_on() -> None:
    align = CacheGroups.from_vllm(kv_config(MambaSpec(mamba_cache_mode="align"), FullAttentionSpec()), BLOCK)
    none = CacheGroups.from_vllm(kv_config(MambaSpec(mamba_cache_mode="none"), FullAttentionSpec()), BLOCK)
    a, b = conn.compat_from_vllm(fake_vllm(), groups=align), conn.compat_from_vllm(fake_vllm(), groups=none)
    assert a != b and "state:align@16" in a.model and "state:none@16" in b.model
