"""The plan of a staged push (core/staged_plan.py), on real layouts and no thread: which way P
writes its parts of D's image (straight runs, one gathered chunk, several chunks, nothing),
what it refuses, and that the rows it plans cover every piece exactly once."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import numpy as np
import pytest
from test_blocks import remote_layout

from pushactors.core.blocks import KVLayout, KVRegion, PairedLayout, PlanError
from pushactors.core.staged_plan import Chunks, Empty, OneChunk, StagedPlan, Straight, plan_staged
from pushactors.core.staging import grid_rows
from pushactors.core.topology import write_heads
from pushactors.protocol import StagingInfo

BLOCK = 256  # bytes of one block, on both sides (TP 1 → TP 1)
P_L0, P_L1 = 0x100000, 0x200000  # P's regions (layers l0, l1), 32 blocks each
D_STAGING = StagingInfo(addr=0x5000000, length=1 << 20)
SLOT = (0x1000, 0x2000)  # (offset, bytes) of D's slot in its buffer
D_ADDR = D_STAGING.addr + SLOT[0]
P_STAGING = 0x7000000  # our staging buffer
P_OFF = 0x10000  # the slot alloc gives us
SLOT_BASE = P_STAGING + P_OFF
SCATTERED = (9, 2, 15, 4, 11)  # P's blocks: no two consecutive
D_BLOCKS = (40, 41, 42, 43, 44)
IMAGE = 2 * len(D_BLOCKS) * BLOCK  # both layers' 5 blocks: 2560 bytes


class Alloc:
    """P's staging area as the plan sees it: records each request, gives ``offset``."""

    def __init__(self, offset: int | None = P_OFF) -> None:
        self.offset = offset
        self.calls: list[int] = []

    def __call__(self, nbytes: int) -> int | None:
        self.calls.append(nbytes)
        return self.offset


def whole_pair(*, d_order: tuple[str, str] = ("l0", "l1"), p_l0: int = P_L0) -> PairedLayout:
    """TP 1 → TP 1, opaque blocks of one head: every block written whole. ``d_order``: the
    layers of D's regions 0 and 1 (its image holds them in that order)."""
    local = KVLayout(
        regions=(KVRegion(p_l0, BLOCK, BLOCK, 32, members=("l0",)), KVRegion(P_L1, BLOCK, BLOCK, 32, members=("l1",))),
        mem_type="DRAM",
        block_size=16,
    )
    remote = remote_layout(
        (
            KVRegion(0x900000, BLOCK, BLOCK, 64, members=(d_order[0],)),
            KVRegion(0xA00000, BLOCK, BLOCK, 64, members=(d_order[1],)),
        )
    )
    return PairedLayout(local, (0, 1), remote, range(0, 1), 1)


def half_pair(p_rank: int) -> PairedLayout:
    """P TP 2 → D TP 1 (2 opaque heads): P rank ``p_rank`` writes its head, one half of each of
    D's blocks."""
    local = KVLayout(
        regions=(KVRegion(P_L0, 128, 128, 32, members=("l0",)), KVRegion(P_L1, 128, 128, 32, members=("l1",))),
        mem_type="DRAM",
        block_size=16,
    )
    remote = remote_layout(
        (KVRegion(0x900000, BLOCK, BLOCK, 64, members=("l0",)), KVRegion(0xA00000, BLOCK, BLOCK, 64, members=("l1",)))
    )
    return PairedLayout(local, (p_rank, 2), remote, write_heads(p_rank, 2, 0, 1, 2), 2)


def plan(
    paired: PairedLayout,
    p_blocks: tuple[int, ...] = SCATTERED,
    d_blocks: tuple[int, ...] = D_BLOCKS,
    *,
    alloc: Alloc | None = None,
    limit: int = 0,
    chunk: int = 0,
    d_staging: StagingInfo | None = D_STAGING,
    slot: tuple[int, int] = SLOT,
) -> StagedPlan:
    return plan_staged(
        paired,
        (p_blocks,),
        (d_blocks,),
        (),
        remote_layout=paired.remote,
        d_staging=d_staging,
        slot=slot,
        gather_runs_limit=limit,
        chunk_bytes=chunk,
        alloc=alloc,
        staging_addr=P_STAGING,
    )


def expected_pieces(p_blocks: tuple[int, ...], *, d_order: tuple[str, str] = ("l0", "l1")) -> list[tuple[int, int]]:
    """(P address, image offset) of every block-sized piece: D's region ``j`` sits at image
    offset ``j × 5 blocks``, its ``i``-th registered block at ``i × BLOCK`` in it."""
    p_base = {"l0": P_L0, "l1": P_L1}
    return sorted(
        (p_base[layer] + b * BLOCK, j * len(D_BLOCKS) * BLOCK + i * BLOCK)
        for j, layer in enumerate(d_order)
        for i, b in enumerate(p_blocks)
    )


def pieces_of(src: Any, dst: Any, lens: Any, dst_base: int, unit: int = BLOCK) -> list[tuple[int, int]]:
    """Rows cut into ``unit``-byte pieces: (source, destination − ``dst_base``), sorted."""
    out: list[tuple[int, int]] = []
    for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True):
        assert n % unit == 0 and n > 0
        out += [(s + k, d - dst_base + k) for k in range(0, n, unit)]
    return sorted(out)


def assert_disjoint_inside(dst: Any, lens: Any, lo: int, hi: int) -> None:
    """Every range [dst, dst + len) lies in [lo, hi), and no two overlap."""
    ranges = sorted(zip(dst.tolist(), lens.tolist(), strict=True))
    assert ranges[0][0] >= lo and ranges[-1][0] + ranges[-1][1] <= hi
    for (a, n), (b, _) in pairwise(ranges):
        assert a + n <= b, (a, n, b)


# --- straight ------------------------------------------------------------------------------
def test_blocks_in_order_are_written_straight_as_one_run_per_layer() -> None:
    alloc = Alloc()
    p = plan(whole_pair(), (4, 5, 6, 7, 8), alloc=alloc, limit=128)
    assert isinstance(p, Straight) and not p.direct
    assert p.local_rows.tolist() == [[P_L0 + 4 * BLOCK, 5 * BLOCK], [P_L1 + 4 * BLOCK, 5 * BLOCK]]
    assert p.image_addrs.tolist() == [D_ADDR, D_ADDR + 5 * BLOCK]
    assert p.pieces == 10 and p.nbytes == IMAGE
    assert alloc.calls == []  # no slot taken here
    got = pieces_of(p.local_rows[:, 0], p.image_addrs, p.local_rows[:, 1], D_ADDR)
    assert got == expected_pieces((4, 5, 6, 7, 8))


def test_runs_up_to_the_limit_go_straight_and_one_more_is_gathered() -> None:
    """P's blocks 9, 10 | 2 | 15, 16 are 3 runs a layer, 6 in all: a limit of 6 writes them
    straight, a limit of 5 gathers."""
    blocks = (9, 10, 2, 15, 16)
    alloc = Alloc()
    p = plan(whole_pair(), blocks, alloc=alloc, limit=6)
    assert isinstance(p, Straight) and not p.direct
    assert p.local_rows.tolist() == [
        [P_L0 + 9 * BLOCK, 2 * BLOCK],
        [P_L0 + 2 * BLOCK, BLOCK],
        [P_L0 + 15 * BLOCK, 2 * BLOCK],
        [P_L1 + 9 * BLOCK, 2 * BLOCK],
        [P_L1 + 2 * BLOCK, BLOCK],
        [P_L1 + 15 * BLOCK, 2 * BLOCK],
    ]
    assert (p.image_addrs - D_ADDR).tolist() == [0, 512, 768, 1280, 1792, 2048]
    assert p.pieces == 10 and alloc.calls == []
    gathered = plan(whole_pair(), blocks, alloc=alloc, limit=5)
    assert isinstance(gathered, OneChunk)
    assert alloc.calls == [IMAGE]


def test_without_room_the_pieces_go_straight_as_every_run() -> None:
    blocks = (9, 10, 2, 15, 16)
    full = Alloc(None)
    p = plan(whole_pair(), blocks, alloc=full, limit=5)
    assert isinstance(p, Straight) and p.direct  # "staging.direct": only for want of room
    assert full.calls == [IMAGE]
    assert len(p.local_rows) == 6 and p.pieces == 10 and p.nbytes == IMAGE
    assert pieces_of(p.local_rows[:, 0], p.image_addrs, p.local_rows[:, 1], D_ADDR) == expected_pieces(blocks)
    # No staging buffer here at all: the same runs, and nothing asked.
    none = plan(whole_pair(), blocks, alloc=None, limit=5)
    assert isinstance(none, Straight) and none.direct
    assert none.local_rows.tolist() == p.local_rows.tolist()
    assert none.image_addrs.tolist() == p.image_addrs.tolist()
    # Scattered blocks: one run per piece, far over the limit, still every one.
    scattered = plan(whole_pair(), SCATTERED, alloc=Alloc(None), limit=0)
    assert isinstance(scattered, Straight) and scattered.direct and len(scattered.local_rows) == 10
    got = pieces_of(scattered.local_rows[:, 0], scattered.image_addrs, scattered.local_rows[:, 1], D_ADDR)
    assert got == expected_pieces(SCATTERED)


# --- one chunk -----------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [0, IMAGE, 1 << 30])
def test_scattered_blocks_with_room_are_gathered_in_one_chunk(chunk: int) -> None:
    alloc = Alloc()
    p = plan(whole_pair(), alloc=alloc, chunk=chunk)
    assert isinstance(p, OneChunk)
    assert alloc.calls == [IMAGE]
    assert (p.p_off, p.slot_base, p.d_addr) == (P_OFF, SLOT_BASE, D_ADDR)
    assert (p.nbytes, p.pieces, p.runs) == (IMAGE, 10, 1)
    assert p.span_off.tolist() == [0] and p.span_len.tolist() == [IMAGE]  # the image is whole
    src, dst, lens = grid_rows(p.grids_shifted)
    assert pieces_of(src, dst, lens, SLOT_BASE) == expected_pieces(SCATTERED)
    assert_disjoint_inside(dst, lens, SLOT_BASE, SLOT_BASE + IMAGE)
    assert int(lens.sum()) == p.nbytes


def test_two_p_sources_write_disjoint_halves_whose_spans_have_holes() -> None:
    """P TP 2 → D TP 1: each P rank writes one head, 128 bytes of each 256-byte block of D's
    image; the two ranks' rows cover the whole image exactly once."""
    blocks, d_blocks = (9, 2, 15), (40, 41, 42)
    image = 2 * 3 * BLOCK
    rows: list[tuple[int, int]] = []
    for rank in (0, 1):
        p = plan(half_pair(rank), blocks, d_blocks, alloc=Alloc())
        assert isinstance(p, OneChunk)
        assert p.span_off.tolist() == [rank * 128 + k * BLOCK for k in range(6)]
        assert p.span_len.tolist() == [128] * 6
        assert (p.nbytes, p.pieces, p.runs) == (768, 6, 6)
        src, dst, lens = grid_rows(p.grids_shifted)
        assert src.tolist() == [P_L0 + b * 128 for b in blocks] + [P_L1 + b * 128 for b in blocks]
        assert_disjoint_inside(dst, lens, SLOT_BASE, SLOT_BASE + image)
        rows += [(d - SLOT_BASE, n) for d, n in zip(dst.tolist(), lens.tolist(), strict=True)]
    rows.sort()
    assert sum(n for _, n in rows) == image
    assert [d for d, _ in rows] == list(range(0, image, 128))  # every half once, no overlap


# --- chunks --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("chunk", "cut"),
    [
        (1024, [[0, 256, 512, 768], [1024, 1280, 1536, 1792], [2048, 2304]]),
        # A piece belongs to the chunk its start falls in (768 runs past 1000: still chunk 0)
        (1000, [[0, 256, 512, 768], [1024, 1280, 1536, 1792], [2048, 2304]]),
        (600, [[0, 256, 512], [768, 1024], [1280, 1536, 1792], [2048, 2304]]),
        (IMAGE - 1, [list(range(0, IMAGE, BLOCK))]),  # one byte short of one chunk: Chunks of one
    ],
)
def test_chunks_are_cut_at_chunk_bytes_of_the_image_in_image_order(chunk: int, cut: list[list[int]]) -> None:
    """D holds l1 before l0, so P's rows (l0's first) come out of image order and are sorted
    before the cut."""
    order = ("l1", "l0")
    alloc = Alloc()
    p = plan(whole_pair(d_order=order), alloc=alloc, chunk=chunk)
    assert isinstance(p, Chunks)
    assert alloc.calls == [IMAGE]
    assert (p.p_off, p.slot_base, p.d_addr) == (P_OFF, SLOT_BASE, D_ADDR)
    assert (p.nbytes, p.pieces, p.runs) == (IMAGE, 10, 1)
    assert [c.img.tolist() for c in p.chunks] == cut
    for i, c in enumerate(p.chunks):
        assert c.src.dtype == c.dst.dtype == c.lengths.dtype == np.uint64
        assert all(i * chunk <= o < (i + 1) * chunk for o in c.img.tolist())
        assert c.lens.tolist() == [BLOCK] * len(c.img) and c.lengths.tolist() == c.lens.tolist()
        assert c.dst.tolist() == [SLOT_BASE + o for o in c.img.tolist()]
    # The first chunk is D's first region: l1's blocks, in D's registered order
    assert p.chunks[0].src.tolist()[:3] == [P_L1 + b * BLOCK for b in SCATTERED[:3]]
    src = np.concatenate([c.src for c in p.chunks])
    dst = np.concatenate([c.dst for c in p.chunks])
    lens = np.concatenate([c.lengths for c in p.chunks])
    assert pieces_of(src, dst, lens, SLOT_BASE) == expected_pieces(SCATTERED, d_order=order)
    assert_disjoint_inside(dst, lens, SLOT_BASE, SLOT_BASE + IMAGE)
    assert int(lens.sum()) == p.nbytes


def test_chunks_count_the_spans_between_holes() -> None:
    p = plan(half_pair(1), (9, 2, 15), (40, 41, 42), alloc=Alloc(), chunk=512)
    assert isinstance(p, Chunks)
    assert [c.img.tolist() for c in p.chunks] == [[128, 384], [640, 896], [1152, 1408]]
    assert (p.nbytes, p.pieces, p.runs) == (768, 6, 6)
    assert p.chunks[0].src.tolist() == [P_L0 + 9 * 128, P_L0 + 2 * 128]


# --- nothing, and refusals -----------------------------------------------------------------
def test_nothing_registered_is_an_empty_plan() -> None:
    alloc = Alloc()
    assert isinstance(plan(whole_pair(), (1, 2), (), alloc=alloc, limit=128), Empty)
    assert alloc.calls == []


def test_a_slot_ending_at_ds_buffer_end_is_accepted() -> None:
    p = plan(whole_pair(), (4, 5, 6, 7, 8), alloc=Alloc(), limit=128, slot=(D_STAGING.length - IMAGE, IMAGE))
    assert isinstance(p, Straight)
    end = D_STAGING.addr + D_STAGING.length
    assert p.image_addrs.tolist() == [end - IMAGE, end - 5 * BLOCK]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("no_buffer", "advertises no staging buffer"),
        ("outside", "lies outside D's 1048576-byte buffer"),
        ("small_slot", "D's image needs 2560 bytes, its slot holds 2559"),
        ("impossible_row", "a copy row ends beyond any address"),
        ("more_than_p_has", "D registered 5 blocks after -3 cached, but P has only 2"),
    ],
)
@pytest.mark.parametrize("chunk", [0, 1024])
def test_refusals_are_plan_errors_before_any_slot(case: str, match: str, chunk: int) -> None:
    alloc = Alloc()
    kw: dict[str, Any] = {"alloc": alloc, "chunk": chunk}
    paired = whole_pair()
    p_blocks: tuple[int, ...] = SCATTERED
    if case == "no_buffer":
        kw["d_staging"] = None
    elif case == "outside":
        kw["slot"] = (D_STAGING.length - IMAGE + 1, IMAGE)
    elif case == "small_slot":
        kw["slot"] = (0, IMAGE - 1)
    elif case == "impossible_row":
        paired = whole_pair(p_l0=2**63 - 16 * BLOCK)  # P's block 15 ends at 2**63
    else:
        p_blocks = (1, 2)
    with pytest.raises(PlanError, match=match) as info:
        plan(paired, p_blocks, **kw)
    assert isinstance(info.value, ValueError)  # the writer's except clause catches it as before
    assert alloc.calls == []
