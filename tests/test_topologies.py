"""Every KV layout × TP pairing × PP × block-size ratio, verified by meaning on the fake fabric.

P fills each element of its blocks with a value that encodes (layer, K/V, token, global head,
dim) from *its* layout; D checks each element of *its* blocks for its own heads and positions
from *its* layout (:mod:`pushactors.testing.kvfill`). A head slice landing on the wrong head,
token or K/V half fails here even when every byte count is right — see the swapped-head tests.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import pushactors.core.blocks as blocks_mod
from pushactors.core.layout import pair_template
from pushactors.core.topology import rank_heads
from pushactors.testing.engine import LAYOUTS, SimSpec
from pushactors.testing.pair import PushPair

PER_LAYER = ("cpu", "nhd", "kv_nhd", "kv_hnd", "split_nhd")
BLOCK_OUTERMOST = ("blhnc", "blnhc", "bhlnc")
ATTENTION = tuple(x for x in LAYOUTS if not x.startswith("mla"))
TP_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)]


def push(
    p_spec: SimSpec,
    d_spec: SimSpec,
    *,
    p_tp: int = 1,
    d_tp: int = 1,
    p_pp: int = 1,
    tokens: int = 45,
    cached_blocks: int = 0,
    key: str = "prompt-A",
) -> PushPair:
    """Push one request P → D and return the settled pair (still open: the caller closes)."""
    pair = PushPair(p_tp=p_tp, d_tp=d_tp, p_pp=p_pp, p_spec=p_spec, d_spec=d_spec)
    try:
        pair.prefill.prefill("p-1", tokens, key=key, transfer_id="t-1")
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": pair.p_endpoint.host,
            "remote_port": pair.p_endpoint.port,
            "remote_tp_size": p_tp,
            "remote_pp_size": p_pp,
            "transfer_id": "t-1",
        }
        pair.decode.expect("d-1", tokens, params, key=key, cached_blocks=cached_blocks)
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="the push to settle")
    except BaseException:
        pair.close()
        raise
    return pair


def expected_elements(spec: SimSpec, tp: int, tokens: int) -> int:
    """Elements D must hold over all its ranks for ``tokens`` positions."""
    kv = 1 if spec.layout.startswith("mla") else 2
    heads = sum(len(rank_heads(r, tp, spec.model_heads)) for r in range(tp))
    return tokens * spec.num_layers * kv * heads * spec.head_dim


def landed(pair: PushPair, *, tokens: int, first_token: int = 0) -> None:
    d = pair.decode
    assert pair.received["d-1"] is None, pair.received["d-1"]
    assert pair.sent["p-1"] is None, pair.sent["p-1"]
    checked, wrong = d.verify("d-1")
    assert wrong == 0, f"{wrong // d.spec.elem_size} wrong elements, e.g. {d.wrong_elements('d-1')}"
    want = expected_elements(d.spec, d.tp_size, tokens - first_token) * d.spec.elem_size
    assert checked == want, (checked, want)


def exact_bytes(pair: PushPair, tokens: int, cached_blocks: int = 0) -> None:
    """Each element of D is written exactly once: no duplicate writes of a replicated head,
    nothing outside D's blocks (bytes moved = D's registered blocks × its heads)."""
    d = pair.decode.spec
    kv = 1 if d.layout.startswith("mla") else 2
    heads = sum(len(rank_heads(r, pair.decode.tp_size, d.model_heads)) for r in range(pair.decode.tp_size))
    blocks = -(-tokens // d.block_size) - cached_blocks
    want = blocks * d.block_size * d.num_layers * kv * heads * d.head_dim * d.elem_size
    assert pair.fabric.stats.bytes_moved == want


def spec(layout: str, **kw: Any) -> SimSpec:
    return SimSpec(layout=layout, **{"num_blocks": 24, **kw})


# --- every layout, every TP pairing ------------------------------------------------------------
@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS, ids=[f"tp{p}to{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("layout", ATTENTION)
def test_same_layout_every_tp_pair(layout: str, p_tp: int, d_tp: int) -> None:
    with push(spec(layout), spec(layout), p_tp=p_tp, d_tp=d_tp) as pair:
        landed(pair, tokens=45)
        exact_bytes(pair, 45)


MIXED = list(zip(ATTENTION, ATTENTION[3:] + ATTENTION[:3], strict=True))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 4)], ids=["tp2to1", "tp1to2", "tp2to4"])
@pytest.mark.parametrize(("p_layout", "d_layout"), MIXED, ids=[f"{p}-to-{d}" for p, d in MIXED])
def test_p_and_d_layouts_differ(p_layout: str, d_layout: str, p_tp: int, d_tp: int) -> None:
    """P NHD into D HND (and every other rotation): pairing is by meaning, not by position."""
    with push(spec(p_layout), spec(d_layout), p_tp=p_tp, d_tp=d_tp) as pair:
        landed(pair, tokens=45)
        exact_bytes(pair, 45)


# --- MLA and GQA: replicated heads --------------------------------------------------------------
MLA_PAIRS = [(1, 2), (2, 1), (1, 1), (2, 4), (4, 2)]


@pytest.mark.parametrize(("p_tp", "d_tp"), MLA_PAIRS, ids=[f"tp{p}to{d}" for p, d in MLA_PAIRS])
@pytest.mark.parametrize(("p_layout", "d_layout"), [("mla", "mla"), ("mla", "mla_blhnc"), ("mla_blhnc", "mla")])
def test_mla_latent_reaches_every_d_rank_once(p_layout: str, d_layout: str, p_tp: int, d_tp: int) -> None:
    with push(spec(p_layout), spec(d_layout), p_tp=p_tp, d_tp=d_tp) as pair:
        landed(pair, tokens=45)
        exact_bytes(pair, 45)  # P_tp > D_tp: one P rank writes, the others only complete


GQA = [(2, 4, 2), (2, 2, 4), (2, 4, 4), (2, 4, 1), (2, 1, 4), (1, 2, 1), (1, 1, 2), (4, 8, 2)]


@pytest.mark.parametrize(("kv_heads", "p_tp", "d_tp"), GQA, ids=[f"h{h}-tp{p}to{d}" for h, p, d in GQA])
@pytest.mark.parametrize(("p_layout", "d_layout"), [("nhd", "cpu"), ("blhnc", "kv_nhd"), ("split_nhd", "bhlnc")])
def test_gqa_fewer_heads_than_ranks(p_layout: str, d_layout: str, kv_heads: int, p_tp: int, d_tp: int) -> None:
    with push(spec(p_layout, kv_heads=kv_heads), spec(d_layout, kv_heads=kv_heads), p_tp=p_tp, d_tp=d_tp) as pair:
        landed(pair, tokens=45)
        exact_bytes(pair, 45)


def test_replicated_heads_completion_counts_stay_exact() -> None:
    """GQA 2 heads, P TP4 → D TP2: P ranks 1 and 3 hold heads ranks 0 and 2 write; they send a
    completion without a WRITE, and D finishes on exactly its expected count."""
    with push(spec("nhd", kv_heads=2), spec("cpu", kv_heads=2), p_tp=4, d_tp=2) as pair:
        landed(pair, tokens=45)
        assert pair.fabric.stats.transfers_done == 2  # one WRITE per D rank
        assert sum(w.stats().get("write.posted", 0) for w in pair.prefill.workers) == 2
        assert [r.failure for r in pair.decode.reports_of("d-1", "recv")] == [None, None]


# --- PP-sharded P ------------------------------------------------------------------------------
PP_CASES = [
    ("cpu", "cpu", 1, 1),
    ("nhd", "blhnc", 1, 1),
    ("blhnc", "bhlnc", 2, 1),
    ("bhlnc", "nhd", 1, 2),
    ("split_nhd", "kv_hnd", 2, 4),
    ("mla", "mla_blhnc", 2, 1),
    ("mla_blhnc", "mla", 1, 2),
]


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_tp", "d_tp"), PP_CASES, ids=["-".join(map(str, c)) for c in PP_CASES]
)
def test_pp2_prefill_each_stage_writes_its_layers(p_layout: str, d_layout: str, p_tp: int, d_tp: int) -> None:
    with push(spec(p_layout), spec(d_layout), p_tp=p_tp, d_tp=d_tp, p_pp=2) as pair:
        landed(pair, tokens=45)
        exact_bytes(pair, 45)
        # every P stage wrote (its own layers): a WRITE from each stage's writing ranks
        posted = {pp: 0 for pp in range(2)}
        for (pp, _), w in zip(pair.prefill.ranks, pair.prefill.workers, strict=True):
            posted[pp] += w.stats().get("write.posted", 0)
        assert posted[0] == posted[1] > 0


# --- block sizes that differ by an integer ratio ------------------------------------------------
RATIOS = [
    # (P block, P kernel blocks, D block, D kernel blocks, cached D blocks)
    (16, 1, 32, 1, 0),
    (32, 1, 16, 1, 0),
    (16, 1, 64, 2, 0),
    (64, 2, 16, 1, 0),
    (32, 1, 16, 1, 3),
    (16, 1, 32, 2, 1),
]


@pytest.mark.parametrize(("p_bs", "p_k", "d_bs", "d_k", "cached"), RATIOS, ids=["-".join(map(str, r)) for r in RATIOS])
@pytest.mark.parametrize(("p_layout", "d_layout"), [("nhd", "cpu"), ("blhnc", "nhd"), ("mla", "mla_blhnc")])
def test_block_size_ratio(p_layout: str, d_layout: str, p_bs: int, p_k: int, d_bs: int, d_k: int, cached: int) -> None:
    tokens = 150
    p = spec(p_layout, block_size=p_bs, kernel_blocks=p_k, num_blocks=16)
    d = spec(d_layout, block_size=d_bs, kernel_blocks=d_k, num_blocks=16)
    with push(p, d, p_tp=2, d_tp=1, tokens=tokens, cached_blocks=cached) as pair:
        landed(pair, tokens=tokens, first_token=cached * d_bs)


def test_block_sizes_that_do_not_divide_fail_the_request_visibly() -> None:
    with push(spec("nhd", block_size=16), spec("cpu", block_size=24), tokens=45) as pair:
        assert pair.received["d-1"] is not None and "block size" in pair.received["d-1"]
        assert pair.sent["p-1"] is not None
        assert pair.decode.verify("d-1")[1] > 0  # nothing landed


# --- the semantic check catches wrong slices ----------------------------------------------------
def test_a_swapped_head_is_caught_though_every_count_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the pairing so P's heads 0 and 1 trade places in D: the WRITE moves exactly the
    right number of bytes into exactly D's blocks, and the semantic check still fails."""

    def swapped(local: Any, remote: Any, units: Any, heads: range) -> Any:
        # One template per head (so heads do not merge into one run), then trade the remote
        # offsets of heads 0 and 1: same lengths, same blocks, wrong places.
        parts = [pair_template(local, remote, units, range(h, h + 1)) for h in heads]
        parts[0], parts[1] = replace(parts[0], roff=parts[1].roff), replace(parts[1], roff=parts[0].roff)
        cat = {f: np.concatenate([getattr(t, f) for t in parts]) for f in ("lpos", "loff", "rpos", "roff", "length")}
        return replace(parts[0], **cat)

    monkeypatch.setattr(blocks_mod, "pair_template", swapped)
    with push(spec("hnd"), spec("hnd"), p_tp=1, d_tp=1) as pair:
        assert pair.received["d-1"] is None  # the transport saw nothing wrong
        exact_bytes(pair, 45)  # and every byte count matches
        checked, wrong = pair.decode.verify("d-1")
        assert checked > 0 and wrong > 0
        examples = pair.decode.wrong_elements("d-1")
        assert any("head 0" in e for e in examples) or any("head 1" in e for e in examples)


def test_a_swapped_head_in_d_memory_is_caught() -> None:
    """After a correct push, trading two heads' bytes in D (what an NHD page cut as if it were
    head-major does) leaves sums and counts equal and fails the check."""
    with push(spec("nhd"), spec("nhd")) as pair:
        landed(pair, tokens=45)
        t = next(iter(pair.decode.kv[0].values()))  # [B, H, N, C] view over NHD memory
        block = pair.decode.recvs["d-1"].blocks[0]
        before = int(t[block].sum())
        h0 = t[block, 0].clone()
        t[block, 0] = t[block, 1]
        t[block, 1] = h0
        assert int(t[block].sum()) == before
        _, wrong = pair.decode.verify("d-1")
        assert wrong > 0
        assert any("head 0" in e or "head 1" in e for e in pair.decode.wrong_elements("d-1"))


def test_another_prompts_kv_is_caught() -> None:
    """D expects prompt B; P pushed prompt A's KV: every element is wrong."""
    with push(spec("cpu"), spec("cpu")) as pair:
        pair.decode.recvs["d-1"].key = "prompt-B"
        checked, wrong = pair.decode.verify("d-1")
        assert checked > 0 and wrong > checked // 2


# --- descriptor counts are structural ------------------------------------------------------------
@pytest.mark.parametrize("layout", BLOCK_OUTERMOST)
def test_block_outermost_whole_block_is_one_descriptor(layout: str) -> None:
    """Same TP, same block-outermost layout: every layer of a block moves as one descriptor."""
    s = SimSpec(layout=layout, num_blocks=24, shuffle_blocks=False)
    with push(s, s, tokens=16 * 8) as pair:
        landed(pair, tokens=16 * 8)
        # 8 blocks in order on both sides: they merge into one descriptor for the whole WRITE
        assert pair.fabric.stats.per_transfer_merged == [1]


def test_descriptors_per_block_follow_the_layout() -> None:
    """Descriptor counts for a head slice (P TP1 → D TP2, 4 layers of 16 tokens): a head-major
    page is one run per layer (``[H, N, K|V]``) or per K/V half (``[2, H, N, D]``), a
    token-major one a run per token; BHLNC keeps a head slice contiguous across every layer."""
    counts = {}
    for layout in ("cpu", "nhd", "kv_hnd", "kv_nhd", "split_nhd", "blhnc", "blnhc", "bhlnc"):
        with push(spec(layout), spec(layout), p_tp=1, d_tp=2, tokens=48) as pair:
            landed(pair, tokens=48)
            stats = pair.fabric.stats
            assert stats.transfers_done == 2
            counts[layout] = stats.descriptors / (2 * 3)  # two WRITEs of three blocks
    n, layers = 16, 4
    assert counts == {
        "cpu": layers,
        "nhd": layers * n,
        "kv_hnd": layers * 2,
        "kv_nhd": layers * 2 * n,
        "split_nhd": layers * 2 * n,
        "blhnc": layers,
        "blnhc": layers * n,
        "bhlnc": 1,
    }
