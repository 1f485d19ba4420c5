"""Staged pushes: scattered blocks travel as one image (P gathers, one WRITE of a few spans,
D scatters before it reports). Checked by meaning, with slots and descriptor lists accounted."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import pushactors.actors.stager as stager_mod
from pushactors.core.staging import (
    RowGrid,
    SlotPool,
    StagingArea,
    chunked,
    grid_runs,
    grid_spans,
    image_of,
    scatter_rows,
    spans,
)
from pushactors.protocol import PUSH_REG_PREFIX, Registration, decode_notification, encode_registration
from pushactors.testing.engine import SimSpec
from pushactors.testing.faults import notif_contains
from pushactors.testing.pair import PushPair
from pushactors.transport.copies import ByteViews, copy_grids, copy_rows

# staging_gather_runs=0: P gathers whatever its pieces look like (the gather path under test);
# tests of pushes whose pieces P writes straight into D's slot set it themselves.
STAGED = {"staging_bytes": 8 << 20, "staging_min_runs": 1, "staging_min_bytes": 1, "staging_gather_runs": 0}


# --- plain parts ---------------------------------------------------------------------------
def test_slot_pool_allocates_first_fit_and_coalesces() -> None:
    pool = SlotPool(4096, align=256)
    a, b, c = pool.alloc(300), pool.alloc(256), pool.alloc(1000)
    assert (a, b, c) == (0, 512, 768)
    assert pool.alloc(4096) is None and pool.alloc(0) is None
    pool.free(b)
    assert pool.alloc(200) == 512  # the hole is reused
    pool.free(512)
    pool.free(a)
    pool.free(c)
    pool.free(c)  # twice: harmless
    assert pool.slots == 0 and pool.used_bytes == 0
    assert pool.alloc(4096) == 0  # every hole merged back into one


def test_spans_merge_touching_and_overlapping_ranges() -> None:
    off, length = spans(np.array([100, 0, 10, 50, 60]), np.array([10, 10, 5, 10, 5]))
    assert off.tolist() == [0, 50, 100] and length.tolist() == [15, 15, 10]
    e = spans(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
    assert len(e[0]) == 0


def test_chunked_cuts_spans_at_chunk_boundaries() -> None:
    parts = chunked(np.array([0, 100]), np.array([70, 50]), 40)
    assert [(o.tolist(), n.tolist()) for o, n in parts] == [([0], [40]), ([40, 100], [30, 10]), ([110], [40])]
    assert len(chunked(np.array([0]), np.array([10]), 0)) == 1


def test_copy_rows_moves_many_ranges_at_once() -> None:
    a = torch.arange(4096, dtype=torch.int32)  # 16 KiB
    b = torch.zeros(4096, dtype=torch.int32)
    views = ByteViews([a, b])
    src = np.uint64(a.data_ptr()) + np.arange(0, 16384, 1024, dtype=np.uint64)  # 16 rows of 512 bytes
    dst = np.uint64(b.data_ptr()) + np.arange(16384 - 1024, -1, -1024, dtype=np.uint64)
    n = copy_rows(views, src, dst, np.full(16, 512, dtype=np.uint64))
    assert n == 16 * 512
    got, want = b.view(16, 256), a.view(16, 256)
    for i in range(16):
        assert torch.equal(got[15 - i, :128], want[i, :128])
        assert int(got[15 - i, 128:].abs().sum()) == 0
    with pytest.raises(ValueError, match="outside"):
        copy_rows(views, np.array([8], dtype=np.uint64), dst[:1], np.array([4], dtype=np.uint64))
    with pytest.raises(ValueError, match="past the end"):
        copy_rows(views, src[-1:], dst[:1], np.array([2048], dtype=np.uint64))


def test_copy_rows_refuses_every_row_not_wholly_inside_one_tensor() -> None:
    """Rows all inside one tensor pass by their lowest start and highest end; anything else is
    checked row by row. No row may reach past its tensor: not by spanning two tensors, not by a
    length that wraps a 64-bit address around, and nothing is copied when one row is bad."""
    a = torch.zeros(4096, dtype=torch.uint8)
    b = torch.zeros(4096, dtype=torch.uint8)
    c = torch.arange(256, dtype=torch.int64).view(torch.uint8)  # 2 KiB of known bytes
    views = ByteViews([a, b, c])
    pa, pb, pc = (np.uint64(t.data_ptr()) for t in (a, b, c))
    rows = np.array([0, 1024, 2048], dtype=np.uint64)

    def refused(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> None:
        before = a.clone(), b.clone()
        with pytest.raises(ValueError):
            copy_rows(views, src.astype(np.uint64), dst.astype(np.uint64), lens.astype(np.uint64))
        assert torch.equal(a, before[0]) and torch.equal(b, before[1])  # nothing moved

    ok = np.full(3, 512, dtype=np.uint64)
    assert copy_rows(views, pc + rows[:2] // 2, pa + rows[:2], ok[:2]) == 1024  # one tensor each side
    assert torch.equal(a[:512], c[:512]) and torch.equal(a[1024:1536], c[512:1024])
    refused(pc + rows[:2] // 2, pa + rows[:2] + 3072, ok[:2])  # the second row runs past a's end
    refused(pc + rows // 2, np.array([pa, pb, pb + 4000]), ok)  # the last row runs past b's end
    wrap = np.array([2**64 - 4096], dtype=np.uint64)  # a + 16 + this wraps to just below a
    refused(np.array([pc]), np.array([pa + 16]), wrap)
    refused(np.array([pc, pc]), np.array([pa, pb + 16]), np.array([512, 2**64 - 4096], dtype=np.uint64))
    # offset 16 + (2**64 - 8) is 8 modulo 2**64: a check in uint64 arithmetic would pass it
    refused(np.array([pc + 16]), np.array([pa + 16]), np.array([2**64 - 8], dtype=np.uint64))
    refused(np.array([pc, pc + 16]), np.array([pa, pb + 16]), np.array([8, 2**64 - 8], dtype=np.uint64))
    outside = max(pa, pb, pc) + np.uint64(1 << 30)  # no tensor there
    refused(np.array([pc]), np.array([outside]), ok[:1])


def test_copy_rows_proves_rows_a_group_at_a_time() -> None:
    """Many rows are proven in groups by their lowest start and highest end: groups wholly in
    one tensor pass at once, a group that straddles two tensors is searched row by row, and
    one bad row anywhere, even inside a group that otherwise lies in one tensor, refuses the
    whole copy with nothing moved."""
    from pushactors.transport.copies import ROW_GROUP

    a = torch.arange(16384, dtype=torch.int32).view(torch.uint8)  # 64 KiB each
    b = (torch.arange(16384, dtype=torch.int32) + 1 << 20).view(torch.uint8)
    stage = torch.zeros(1 << 17, dtype=torch.uint8)
    views = ByteViews([a, b, stage])
    n = ROW_GROUP * 3  # in a, then a group straddling a and b, then in b
    half = n // 2 + 5
    src = np.array(
        [a.data_ptr() + i * 512 for i in range(half)] + [b.data_ptr() + i * 512 for i in range(n - half)],
        dtype=np.uint64,
    )
    dst = np.uint64(stage.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(512)
    lens = np.full(n, 256, dtype=np.uint64)
    which = views.locate(src, lens)
    ia, ib = (next(k for k, sp in enumerate(views.spans) if sp[0] == t.data_ptr()) for t in (a, b))
    assert which.tolist() == [ia] * half + [ib] * (n - half)
    assert copy_rows(views, src, dst, lens) == n * 256
    for i in range(n):
        t, k = (a, i) if i < half else (b, i - half)
        assert torch.equal(stage[i * 512 : i * 512 + 256], t[k * 512 : k * 512 + 256])
        assert int(stage[i * 512 + 256 : (i + 1) * 512].sum()) == 0
    for bad in (5, n - 3):  # a row running past its tensor's end, in a group of one tensor
        rows = src.copy()
        rows[bad] = np.uint64((a if bad < half else b).data_ptr() + 65536 - 128)
        before = stage.clone()
        with pytest.raises(ValueError, match="past the end"):
            copy_rows(views, rows, dst + np.uint64(256), lens)
        assert torch.equal(stage, before)


# On a GPU both paths run: the fused kernel (Triton) and the torch indexing path.
DEVICES = ["cpu", *(["cuda", "cuda-torch"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["gather", "scatter", "general", "mixed", "odd"])
def test_copy_rows_matches_a_byte_by_byte_reference(device: str, shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows across several tensors, gathered into one run, scattered from one, both sides
    scattered, mixed lengths, and odd offsets and lengths (byte elements): every destination
    byte equals the reference copy, and bytes no row names stay as they were."""
    from pushactors.transport import copies

    if device == "cuda-torch":
        monkeypatch.setattr(copies, "FUSED", False)
        device = "cuda"
    rng = np.random.default_rng(sum(map(ord, shape)))
    row = 4096
    kv = [torch.from_numpy(rng.integers(0, 255, 64 * row, dtype=np.uint8)).to(device) for _ in range(3)]
    stage = torch.zeros(256 * row, dtype=torch.uint8, device=device)
    views = ByteViews([*kv, stage])
    blocks = [(t, int(b)) for t in range(3) for b in rng.permutation(64)[:20]]
    rng.shuffle(blocks)  # type: ignore[arg-type]
    if shape in ("gather", "scatter"):
        blocks.sort(key=lambda tb: tb[0])  # region by region, like an image: one run per tensor
    lens = np.full(len(blocks), row, dtype=np.uint64)
    if shape == "mixed":
        lens = rng.choice([row, row // 2, 256], len(blocks)).astype(np.uint64)
    if shape == "odd":
        lens = rng.choice([row - 1, 3, 1], len(blocks)).astype(np.uint64)
    shift = 1 if shape == "odd" else 0  # rows that start one byte into a block
    kv_addr = np.array([kv[t].data_ptr() + b * row + shift for t, b in blocks], dtype=np.uint64)
    run = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.uint64)
    stage_addr = np.uint64(stage.data_ptr()) + run
    if shape in ("gather", "mixed", "odd"):
        src, dst = kv_addr, stage_addr
    elif shape == "scatter":
        src, dst = stage_addr, kv_addr
        stage.copy_(torch.from_numpy(rng.integers(0, 255, stage.numel(), dtype=np.uint8)).to(device))
    else:  # both sides scattered: P's blocks into a shuffled set of the staging rows
        slots = rng.permutation(256)[: len(blocks)]
        src, dst = kv_addr, np.uint64(stage.data_ptr()) + slots.astype(np.uint64) * np.uint64(row)
    before = {t.data_ptr(): t.cpu().numpy().copy() for t in [*kv, stage]}
    want = {k: v.copy() for k, v in before.items()}

    def locate(addr: int) -> tuple[int, int]:
        for base, data in before.items():
            if base <= addr < base + len(data):
                return base, addr - base
        raise AssertionError(addr)

    for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True):
        sb, so = locate(s)
        db, do = locate(d)
        want[db][do : do + n] = before[sb][so : so + n]
    assert copy_rows(views, src, dst, lens) == int(lens.sum())
    for t in [*kv, stage]:
        assert np.array_equal(t.cpu().numpy(), want[t.data_ptr()])


def _grid(kv: list[torch.Tensor], stage: torch.Tensor, rng: np.random.Generator, *, gather: bool) -> RowGrid:
    """Every tensor of ``kv`` (a link) × 12 of its blocks (pieces), each piece a part of the
    block at an offset, with a per-link length on top: a gather into ``stage`` or a scatter out."""
    row = 4096
    blocks = rng.permutation(64)[:12].astype(np.int64)
    off = rng.choice([0, 256, 512], 12).astype(np.int64)
    plen = rng.choice([1024, 2048], 12).astype(np.int64)
    klen = np.array([0, 256, 512][: len(kv)], dtype=np.int64)
    kv_base = np.array([t.data_ptr() for t in kv], dtype=np.int64)
    kv_side = dict(base=kv_base, stride=np.full(len(kv), row), block=blocks, off=off)
    st_side = dict(
        base=stage.data_ptr() + np.arange(len(kv), dtype=np.int64) * 12 * row,
        stride=np.full(len(kv), row),
        block=np.arange(12, dtype=np.int64),
        off=np.zeros(12, dtype=np.int64),
    )
    s, d = (kv_side, st_side) if gather else (st_side, kv_side)
    return RowGrid(
        s["base"], s["stride"].astype(np.int64), d["base"], d["stride"].astype(np.int64), klen,
        s["block"], s["off"], d["block"], d["off"], plen,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "scatter"])
def test_copy_grids_match_a_byte_by_byte_reference(device: str, gather: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid's rows, built on the device by the fused kernel on a GPU and on the host
    elsewhere, move exactly the bytes of the reference copy of each (link, piece) row; on a
    GPU with the fused kernel the host builds no rows."""
    from pushactors.transport import copies

    torch_path = device == "cuda-torch"
    if torch_path:
        monkeypatch.setattr(copies, "FUSED", False)
        device = "cuda"
    rng = np.random.default_rng(7 if gather else 8)
    row = 4096
    kv = [torch.from_numpy(rng.integers(0, 255, 64 * row, dtype=np.uint8)).to(device) for _ in range(3)]
    stage = torch.from_numpy(rng.integers(0, 255, 3 * 12 * row, dtype=np.uint8)).to(device)
    views = ByteViews([*kv, stage])
    grid = _grid(kv, stage, rng, gather=gather)
    before = {t.data_ptr(): t.cpu().numpy().copy() for t in [*kv, stage]}
    want = {k: v.copy() for k, v in before.items()}

    def at(addr: int) -> tuple[int, int]:
        base = next(b for b, data in before.items() if b <= addr < b + len(data))
        return base, addr - base

    for k in range(grid.links):
        for j in range(grid.pieces):
            s = int(grid.src[k] + grid.src_stride[k] * grid.src_block[j] + grid.src_off[j])
            d = int(grid.dst[k] + grid.dst_stride[k] * grid.dst_block[j] + grid.dst_off[j])
            n = int(grid.length[k] + grid.piece_length[j])
            (sb, so), (db, do) = at(s), at(d)
            want[db][do : do + n] = before[sb][so : so + n]
    built: list[int] = []
    real_rows = copies.copy_rows
    monkeypatch.setattr(copies, "copy_rows", lambda *a, **k: built.append(len(a[1])) or real_rows(*a, **k))
    assert copy_grids(views, [grid]) == grid.nbytes == sum(int(n) for n in grid.rows()[2])
    for t in [*kv, stage]:
        assert np.array_equal(t.cpu().numpy(), want[t.data_ptr()])
    fused = device == "cuda" and not torch_path and copies.fused_available()
    assert built == ([] if fused else [len(grid)])


@pytest.mark.parametrize("device", DEVICES)
def test_a_grid_copy_made_ready_runs_right_after_other_copies(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """D's scatter is made ready ahead (its row table on the device) and run later, after other
    copies reused the pinned buffer that table came from: it still moves exactly its own rows."""
    from pushactors.transport import copies

    if device == "cuda-torch":
        monkeypatch.setattr(copies, "FUSED", False)
        device = "cuda"
    rng = np.random.default_rng(21)
    row = 4096
    kv = [torch.from_numpy(rng.integers(0, 255, 64 * row, dtype=np.uint8)).to(device) for _ in range(3)]
    stage = torch.from_numpy(rng.integers(0, 255, 3 * 12 * row, dtype=np.uint8)).to(device)
    views = ByteViews([*kv, stage])
    ahead = _grid(kv, stage, rng, gather=False)
    ready = copies.prepare_grids(views, [ahead], None, settle=True)
    want = [t.cpu().numpy().copy() for t in kv]
    src, dst, length = ahead.rows()
    flat_stage = stage.cpu().numpy().copy()
    for s_addr, d_addr, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        k = next(i for i, t in enumerate(kv) if t.data_ptr() <= d_addr < t.data_ptr() + t.numel())
        d_off, s_off = d_addr - kv[k].data_ptr(), s_addr - stage.data_ptr()
        want[k][d_off : d_off + n] = flat_stage[s_off : s_off + n]
    for _ in range(3):  # other copies in between, each filling the pinned buffer anew (a gather into the stage)
        copy_grids(views, [_grid(kv, stage, rng, gather=True)])
    # the gathers changed the stage: put back what the ready copy is to move
    stage.copy_(torch.from_numpy(flat_stage).to(device))
    assert ready.run() == ahead.nbytes
    for t, w in zip(kv, want, strict=True):
        assert np.array_equal(t.cpu().numpy(), w)


def test_copy_grids_refuse_every_row_outside_its_tensor() -> None:
    """A grid's rows are proven link by link (lowest start to highest end in one tensor);
    otherwise each row is checked, and one bad row, a negative term or an end past any
    address refuses the copy with nothing moved. A link whose range straddles two tensors
    while each of its rows lies in one still copies."""
    rng = np.random.default_rng(3)
    row = 4096
    kv = [torch.zeros(64 * row, dtype=torch.uint8) for _ in range(3)]
    stage = torch.from_numpy(rng.integers(1, 255, 3 * 12 * row, dtype=np.uint8))
    views = ByteViews([*kv, stage])
    grid = _grid(kv, stage, rng, gather=False)  # stage → kv blocks

    def refused(g: RowGrid) -> None:
        before = [t.clone() for t in kv]
        with pytest.raises(ValueError):
            copy_grids(views, [g])
        assert all(torch.equal(t, b) for t, b in zip(kv, before, strict=True))

    far = grid.dst_block.copy()
    far[5] = 2**30  # one block far past the end of every tensor
    refused(RowGrid(**{**_fields(grid), "dst_block": far}))
    last = grid.dst_block.copy()
    last[0] = 63
    refused(RowGrid(**{**_fields(grid), "dst_block": last, "piece_length": grid.piece_length + row}))  # past the end
    refused(RowGrid(**{**_fields(grid), "dst_off": grid.dst_off - 300}))  # negative offsets
    refused(RowGrid(**{**_fields(grid), "dst_stride": grid.dst_stride * 2**50}))  # ends past any address
    # One link whose two rows sit in two tensors: its range from lowest start to highest end
    # spans the gap between them, so it is not proven at once, yet each row is inside one and
    # the copy goes row by row, correctly.
    lo, hi = sorted(kv[:2], key=lambda t: t.data_ptr())
    one = np.ones(1, dtype=np.int64)
    two = RowGrid(
        src=one * stage.data_ptr(), src_stride=one * 512, dst=one * lo.data_ptr(),
        dst_stride=one * (hi.data_ptr() - lo.data_ptr()), length=one * 512,
        src_block=np.arange(2, dtype=np.int64), src_off=np.zeros(2, dtype=np.int64),
        dst_block=np.arange(2, dtype=np.int64), dst_off=np.zeros(2, dtype=np.int64),
        piece_length=np.zeros(2, dtype=np.int64),
    )  # fmt: skip
    assert copy_grids(views, [two]) == 1024
    assert torch.equal(lo[:512], stage[:512]) and torch.equal(hi[:512], stage[512:1024])


def test_grid_spans_are_the_spans_of_every_row() -> None:
    """The WRITE of a one-chunk staged push covers the spans of its grids' destinations,
    computed per piece and shifted per link; links with unequal strides or lengths take every
    row. Either way: exactly the spans of all rows."""
    rng = np.random.default_rng(5)
    kv = [torch.zeros(64 * 4096, dtype=torch.uint8) for _ in range(3)]
    stage = torch.zeros(3 * 12 * 4096, dtype=torch.uint8)
    for _ in range(20):
        g = _grid(kv, stage, rng, gather=True)
        if rng.integers(2):  # unequal per-link lengths and strides
            g = RowGrid(**{**_fields(g), "dst_stride": g.dst_stride + np.array([0, 0, 64])})
        else:
            g = RowGrid(**{**_fields(g), "length": np.zeros(3, dtype=np.int64)})
        tiled = RowGrid(
            **{**_fields(g), "dst_block": np.arange(12, dtype=np.int64), "dst_off": np.zeros(12, dtype=np.int64)}
        )
        for grids in ([g], [g, tiled], [tiled]):
            _, dst, length = (np.concatenate(a) for a in zip(*(x.rows() for x in grids), strict=True))
            want = spans(dst, length)
            got = grid_spans(grids)
            assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def _joinable_grid(rng: np.random.Generator) -> RowGrid:
    """A grid like a staging plan's when P's blocks are partly in order: links (layers) × pieces
    (a whole block, or its two halves), blocks drawn in runs of consecutive ids."""
    links, block = int(rng.integers(1, 5)), 256
    ids: list[int] = []
    while len(ids) < int(rng.integers(1, 24)):
        start = int(rng.integers(0, 43))
        ids.extend(range(start, start + int(rng.integers(1, 6))))
    if rng.integers(3) == 0:  # every block in order: a link's last byte touches the next link's first
        ids = list(range(48))
    halves = bool(rng.integers(2))
    p_block = np.repeat(np.array(ids, dtype=np.int64), 2 if halves else 1)
    p_off = np.tile(np.array([0, block // 2] if halves else [0], dtype=np.int64), len(ids))
    piece = np.full(len(p_block), block // 2 if halves else block, dtype=np.int64)
    d_block = np.repeat(np.arange(len(ids), dtype=np.int64), 2 if halves else 1)
    stride = np.full(links, block, dtype=np.int64)
    src = np.arange(links, dtype=np.int64) * (48 * block) + (1 << 20)
    dst = np.arange(links, dtype=np.int64) * (len(ids) * block)  # D's image: layers back to back
    g = RowGrid(src, stride, dst, stride.copy(), np.zeros(links, dtype=np.int64), p_block, p_off, d_block, p_off, piece)
    if links > 1 and rng.integers(3) == 0:  # one link laid out unlike the others: rows, not pieces
        g = RowGrid(**{**_fields(g), "src_stride": stride + np.arange(links, dtype=np.int64) * 512})
    return g


def test_grid_runs_join_contiguous_rows_and_never_across_links() -> None:
    """What a straight staged push posts: every row, neighbours contiguous on both sides joined,
    never two links' rows in one run (links may be separate registrations). Checked against
    joining the rows one by one; a limit below the count gives None, at the count the runs."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        grids = [_joinable_grid(rng) for _ in range(int(rng.integers(1, 3)))]
        want: list[list[int]] = []
        for gi, g in enumerate(grids):
            src, dst, length = g.rows()
            link = np.repeat(np.arange(g.links), g.pieces)
            for s, d, n, k in zip(src.tolist(), dst.tolist(), length.tolist(), link.tolist(), strict=True):
                last = want[-1] if want else None
                if last is not None and last[3:] == [gi, k] and last[0] + last[2] == s and last[1] + last[2] == d:
                    last[2] += n
                else:
                    want.append([s, d, n, gi, k])
        got = grid_runs(grids)
        assert got is not None
        assert [list(r) for r in zip(*(a.tolist() for a in got), strict=True)] == [w[:3] for w in want]
        assert sum(int(x) for x in got[2]) == sum(g.nbytes for g in grids)
        assert grid_runs(grids, len(want) - 1) is None
        assert grid_runs(grids, len(want)) is not None


def test_grid_runs_refuse_an_impossible_row() -> None:
    g = _joinable_grid(np.random.default_rng(3))
    bad = RowGrid(**{**_fields(g), "src_off": g.src_off - (1 << 40)})
    with pytest.raises(ValueError, match="negative"):
        grid_runs([bad])


def _fields(g: RowGrid) -> dict[str, Any]:
    return {f: getattr(g, f) for f in RowGrid.__dataclass_fields__}


def test_image_and_scatter_rows_follow_d_regions() -> None:
    from pushactors.core.blocks import KVRegion

    regions = (KVRegion(1 << 20, 64, 128, 10), KVRegion(1 << 21, 32, 32, 10, group=1))
    image = image_of(regions, ((3, 7), (1,)), 2)
    assert image.bases == (0, 256) and image.nbytes == 256 + 64
    src, dst, lens = scatter_rows(regions, ((3, 7), (1,)), 2, 1 << 30)
    assert lens.tolist() == [64] * 4 + [32] * 2
    assert (dst[:4] - np.uint64(1 << 20)).tolist() == [6 * 128, 7 * 128, 14 * 128, 15 * 128]
    assert (src - np.uint64(1 << 30)).tolist() == [0, 64, 128, 192, 256, 288]


# --- end to end on the fake fabric ---------------------------------------------------------------
def push(
    p_spec: SimSpec,
    d_spec: SimSpec,
    *,
    p_tp: int = 1,
    d_tp: int = 1,
    tokens: int = 200,
    cached: int = 0,
    before: Any = None,
    **config: Any,
) -> PushPair:
    pair = PushPair(p_tp=p_tp, d_tp=d_tp, p_spec=p_spec, d_spec=d_spec, **{**STAGED, **config})
    try:
        if before is not None:
            before(pair)
        pair.prefill.prefill("p-1", tokens, key="prompt", transfer_id="t-1")
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": pair.p_endpoint.host,
            "remote_port": pair.p_endpoint.port,
            "remote_tp_size": p_tp,
            "transfer_id": "t-1",
        }
        pair.decode.expect("d-1", tokens, params, key="prompt", cached_blocks=cached)
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="the staged push")
    except BaseException:
        pair.close()
        raise
    return pair


def metric(engine: Any, name: str) -> int:
    return sum(w.stats().get(name, 0) for w in engine.workers)


def slots_free(pair: PushPair) -> bool:
    return all(
        w.ctx.staging is None or w.ctx.staging.sizes()["staging_slots"] == 0
        for e in (pair.prefill, pair.decode)
        for w in e.workers
    )


CASES = [
    ("hnd", "hnd", 1, 1, 0),
    ("nhd", "blhnc", 2, 1, 0),
    ("cpu", "nhd", 1, 2, 3),
    ("mla", "mla_blhnc", 2, 1, 1),
    ("bhlnc", "split_nhd", 2, 4, 2),
]


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_tp", "d_tp", "cached"), CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_staged_push_lands_by_meaning(p_layout: str, d_layout: str, p_tp: int, d_tp: int, cached: int) -> None:
    p, d = SimSpec(layout=p_layout, num_blocks=48), SimSpec(layout=d_layout, num_blocks=48)
    with push(p, d, p_tp=p_tp, d_tp=d_tp, cached=cached) as pair:
        assert pair.received["d-1"] is None and pair.sent["p-1"] is None
        checked, wrong = pair.decode.verify("d-1")
        assert checked > 0 and wrong == 0, pair.decode.wrong_elements("d-1")
        assert metric(pair.decode, "recv.staged") == d_tp  # every D rank scattered its image
        assert metric(pair.prefill, "write.staged") == metric(pair.prefill, "write.posted") > 0
        pair.pump(lambda: slots_free(pair), what="staging slots back")


def test_same_tp_scattered_push_is_one_descriptor() -> None:
    """The point of staging: a request scattered over many blocks and 4 layers moves as one
    descriptor instead of one per block per layer."""
    s = SimSpec(layout="hnd", num_blocks=64)
    with push(s, s, tokens=16 * 40) as pair:
        assert pair.decode.verify("d-1")[1] == 0
        assert pair.fabric.stats.descriptors == 1
        # One chunk: its WRITE carries the completion, as a direct push's does, so D learns the
        # image landed from the fabric, not from a poll of P and a separate notification.
        assert sum(a.calls["send_notif"] for n, a in pair.fabric.agents.items() if n.startswith("prefill")) == 0
        assert pair.fabric.stats.notifs_sent == 2  # the registration and the completion
    with push(s, s, tokens=16 * 40, staging_bytes=0) as direct:
        assert direct.decode.verify("d-1")[1] == 0
        assert direct.fabric.stats.descriptors >= 40  # scattered blocks: one run per block and layer


def test_p_without_room_writes_straight_into_ds_image() -> None:
    """P's staging buffer is full: its pieces go straight from its blocks into D's slot, and D
    still scatters a correct image."""

    def exhaust_p(pair: PushPair) -> None:
        for w in pair.prefill.workers:
            assert w.ctx.staging is not None
            w.ctx.staging = StagingArea(w.ctx.staging.addr, 0)

    p, d = SimSpec(layout="nhd", num_blocks=48), SimSpec(layout="hnd", num_blocks=48)
    with push(p, d, p_tp=2, d_tp=1, before=exhaust_p) as pair:
        assert pair.decode.verify("d-1")[1] == 0, pair.decode.wrong_elements("d-1")
        assert metric(pair.prefill, "staging.direct") == 2 and metric(pair.prefill, "write.image_direct") == 2
        assert metric(pair.decode, "recv.staged") == 1


def test_p_blocks_in_order_are_written_straight_into_ds_slot() -> None:
    """P's blocks in order, D's scattered: P's pieces join into one run per layer, so P writes
    those runs straight into D's slot (no gather, no slot of its own: one copy less through
    the same memory) and D still scatters a correct image. The same request with scattered
    blocks on P, or staging_gather_runs=0, is gathered."""
    from pushactors.logs import capture_events

    p = SimSpec(layout="hnd", num_blocks=48, shuffle_blocks=False)
    d = SimSpec(layout="hnd", num_blocks=48)
    config = {"staging_gather_runs": 128}
    with capture_events() as events, push(p, d, **config) as pair:
        assert pair.decode.verify("d-1")[1] == 0, pair.decode.wrong_elements("d-1")
        assert metric(pair.prefill, "staging.straight") == 1 and metric(pair.prefill, "write.staged") == 0
        assert metric(pair.decode, "recv.staged") == 1
        assert pair.fabric.stats.descriptors == p.num_layers  # one run per layer: 13 blocks each
        assert not [e for e in events if e.get("event") == "stage.gathered"]
        (posted,) = [e for e in events if e.get("event") == "write.posted"]
        assert posted["descs"] == 13 * p.num_layers and posted["posted_descs"] == p.num_layers
        assert 0 <= posted["plan_ms"] <= posted["post_ms"]
        # The completion rides on the WRITE: no notification of P's own.
        assert sum(a.calls["send_notif"] for n, a in pair.fabric.agents.items() if n.startswith("prefill")) == 0
        pair.pump(lambda: slots_free(pair), what="staging slots back")
    with push(SimSpec(layout="hnd", num_blocks=48), d, staging_gather_runs=2 * p.num_layers) as gathered:
        assert gathered.decode.verify("d-1")[1] == 0
        assert metric(gathered.prefill, "write.staged") == 1 and metric(gathered.prefill, "staging.straight") == 0
    with push(p, d, staging_gather_runs=0) as always:
        assert always.decode.verify("d-1")[1] == 0
        assert metric(always.prefill, "write.staged") == 1 and metric(always.prefill, "staging.straight") == 0


@pytest.mark.parametrize(
    ("p_layout", "d_layout", "p_tp", "d_tp", "cached"), CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_straight_staged_push_lands_by_meaning(p_layout: str, d_layout: str, p_tp: int, d_tp: int, cached: int) -> None:
    """P's blocks in order in every layout and TP pairing: whether P's pieces join into few
    runs (written straight) or not (head slices: gathered), D's image is right."""
    p = SimSpec(layout=p_layout, num_blocks=48, shuffle_blocks=False)
    d = SimSpec(layout=d_layout, num_blocks=48)
    with push(p, d, p_tp=p_tp, d_tp=d_tp, cached=cached, staging_gather_runs=1 << 20) as pair:
        checked, wrong = pair.decode.verify("d-1")
        assert checked > 0 and wrong == 0, pair.decode.wrong_elements("d-1")
        assert metric(pair.decode, "recv.staged") == d_tp
        assert metric(pair.prefill, "staging.straight") == metric(pair.prefill, "write.posted") > 0
        assert metric(pair.prefill, "write.staged") == 0
        pair.pump(lambda: slots_free(pair), what="staging slots back")


def test_d_without_room_takes_the_direct_path() -> None:
    """D's buffer cannot hold the image: no slot is offered (counted), the push goes direct."""
    s = SimSpec(layout="hnd", num_blocks=48)
    with push(s, s, staging_bytes=64 << 10) as pair:
        assert pair.decode.verify("d-1")[1] == 0
        assert metric(pair.decode, "staging.full") == 1 and metric(pair.decode, "recv.staged") == 0


def test_small_or_contiguous_pushes_are_not_staged() -> None:
    s = SimSpec(layout="hnd", num_blocks=48, shuffle_blocks=False)
    with push(s, s, staging_min_runs=8, staging_min_bytes=1) as pair:  # in-order blocks: 1 run
        assert pair.decode.verify("d-1")[1] == 0 and metric(pair.decode, "recv.staged") == 0
    t = SimSpec(layout="hnd", num_blocks=48)
    with push(t, t, staging_min_runs=1, staging_min_bytes=1 << 30) as pair:
        assert pair.decode.verify("d-1")[1] == 0 and metric(pair.decode, "recv.staged") == 0


def test_gather_failure_fails_the_request_and_frees_every_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("device copy failed")

    monkeypatch.setattr(stager_mod, "copy_rows", broken)
    s = SimSpec(layout="hnd", num_blocks=48)
    with push(s, s) as pair:
        assert pair.sent["p-1"] is not None and "gather" in pair.sent["p-1"]
        assert pair.received["d-1"] is not None
        pair.pump(lambda: slots_free(pair), what="staging slots back")
        assert pair.decode.verify("d-1")[1] > 0  # nothing landed


def test_write_error_on_a_staged_push_fails_visibly_and_frees_slots() -> None:
    s = SimSpec(layout="hnd", num_blocks=48)
    pair = PushPair(p_spec=s, d_spec=s, **STAGED)
    try:
        pair.fabric.faults.err_transfer()
        pair.prefill.prefill("p-1", 200, key="prompt", transfer_id="t-1")
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": pair.p_endpoint.host,
            "remote_port": pair.p_endpoint.port,
            "remote_tp_size": 1,
            "transfer_id": "t-1",
        }
        pair.decode.expect("d-1", 200, params, key="prompt")
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent)
        assert pair.sent["p-1"] is not None and pair.received["d-1"] is not None
        pair.pump(lambda: slots_free(pair), what="staging slots back")
        assert pair.prefill.free_blocks == 48
    finally:
        pair.close()


def test_a_slot_outside_ds_buffer_is_refused() -> None:
    """P checks the slot a registration names against D's advertised buffer: a slot past its
    end (a forged or stale registration) is refused, never written."""
    end = STAGED["staging_bytes"]
    s = SimSpec(layout="hnd", num_blocks=48)
    with push(s, s, before=lambda pair: forge_slot(pair, lambda slot: (end - 256, slot[1]))) as pair:
        assert pair.received["d-1"] is not None and "outside" in pair.received["d-1"]
        assert pair.fabric.stats.bytes_moved == 0
        pair.pump(lambda: slots_free(pair), what="staging slots back")


def forge_slot(pair: PushPair, change: Any) -> None:
    """D's registration reaches P with its staging slot changed by ``change(slot)`` (``slot``
    None when D named none): what a forged or stale registration from D's own agent says."""

    def rewrite(raw: bytes) -> bytes:
        reg = decode_notification(raw)
        assert isinstance(reg, Registration)
        return encode_registration(msgspec.structs.replace(reg, staging_slot=change(reg.staging_slot)))

    pair.fabric.faults.rewrite_notif(rewrite, notif_contains(PUSH_REG_PREFIX))


@pytest.mark.parametrize("chunk", [0, 4096], ids=["one-chunk", "chunks"])
def test_a_grid_with_an_impossible_row_is_refused_before_any_slot(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """A staging plan whose rows could not exist (a negative offset, as a planning bug would
    give) is refused as an invalid WRITE before P takes a slot or copies a byte: both sides
    end the request visibly and every slot and block comes back."""
    from pushactors.core import blocks as blocks_mod

    real = blocks_mod.PairedLayout.staged_grids

    def negative(self: Any, *args: Any) -> Any:
        grids = real(self, *args)
        return [RowGrid(**{**_fields(g), "src_off": g.src_off - 1}) for g in grids]

    monkeypatch.setattr(blocks_mod.PairedLayout, "staged_grids", negative)
    s = SimSpec(layout="hnd", num_blocks=48)
    with push(s, s, staging_chunk_bytes=chunk) as pair:
        assert pair.sent["p-1"] is not None and "invalid WRITE" in pair.sent["p-1"]
        assert pair.received["d-1"] is not None
        assert pair.fabric.stats.bytes_moved == 0 and metric(pair.prefill, "write.refused") == 1
        assert metric(pair.prefill, "write.posted") == 0
        pair.pump(lambda: slots_free(pair), what="staging slots back")


def test_chunks_are_gathered_and_written_one_after_another() -> None:
    """A staged push in chunks: one WRITE per chunk, the completion only after the last one,
    and D reports once with every element right."""
    from pushactors.logs import capture_events

    s = SimSpec(layout="hnd", num_blocks=48)
    with capture_events() as events, push(s, s, staging_chunk_bytes=16 << 10) as pair:
        assert pair.decode.verify("d-1")[1] == 0
        image = 13 * 4 * 2048  # 13 blocks × 4 layers × one block of one layer
        chunks = -(-image // (16 << 10))
        assert pair.fabric.stats.transfers_done == chunks
        # Where each step's time went: the host's part of every copy, the plan's of the post.
        copies = [e for e in events if e.get("event") in ("stage.gathered", "stage.scattered")]
        assert sorted(e["event"] for e in copies) == ["stage.gathered"] * chunks + ["stage.scattered"]
        assert all(0 <= e["host_ms"] <= e["ms"] for e in copies), copies
        (posted,) = [e for e in events if e.get("event") == "write.posted"]
        assert posted["chunks"] == chunks and 0 <= posted["plan_ms"] <= posted["handle_ms"]
        assert pair.fabric.stats.notifs_sent == 2  # the registration and one completion
        # Chunks may land in any order: the completion goes on its own, once all are DONE.
        assert sum(a.calls["send_notif"] for n, a in pair.fabric.agents.items() if n.startswith("prefill")) == 1
        assert [r.failure for r in pair.decode.reports_of("d-1", "recv")] == [None]
        pair.pump(lambda: slots_free(pair), what="staging slots back")


def test_d_abort_during_a_staged_push_keeps_the_slot_until_p_settles() -> None:
    """D aborts while chunk WRITEs into its slot are held in flight: D must not report (and so
    not reuse the slot or the blocks) until they ended, past write_timeout too (P never
    releases a stuck WRITE to cancel it: a copy already started would run on); then every slot
    on both sides is free."""
    s = SimSpec(layout="hnd", num_blocks=48)
    config = {
        **STAGED,
        "staging_chunk_bytes": 16 << 10,
        "abort_quarantine": 0.3,
        "write_timeout": 1.0,
        "allow_unsafe_quarantine": True,
    }
    pair = PushPair(p_spec=s, d_spec=s, **config)
    try:
        gate = pair.fabric.faults.hold_transfer()
        pair.prefill.prefill("p-1", 200, key="prompt", transfer_id="t-1")
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "prefill",
            "remote_host": pair.p_endpoint.host,
            "remote_port": pair.p_endpoint.port,
            "remote_tp_size": 1,
            "transfer_id": "t-1",
        }
        pair.decode.expect("d-1", 200, params, key="prompt")
        pair.pump(lambda: pair.fabric.in_flight() > 0, what="chunk WRITEs in flight")
        assert pair.decode.scheduler.abort_recv("d-1")
        held_until = time.monotonic() + config["write_timeout"] + 0.5
        pair.pump(lambda: "d-1" in pair.received or time.monotonic() > held_until, what="past write_timeout")
        assert "d-1" not in pair.received, "D reported while a chunk WRITE into its slot was in flight"
        assert pair.fabric.in_flight() > 0 and pair.fabric.stats.transfers_cancelled == 0
        gate.open()
        pair.pump(lambda: "d-1" in pair.received, what="D to report the abort")
        assert pair.fabric.in_flight() == 0
        pair.pump(lambda: "p-1" in pair.sent and slots_free(pair), what="P to settle, slots back")
        assert "abort" in (pair.received["d-1"] or "")
    finally:
        pair.close()


def test_a_slot_smaller_than_ds_image_is_refused() -> None:
    """A registration whose slot cannot hold D's image (stale or forged) is refused by P: no
    byte is written past the slot into whatever follows it in D's buffer."""
    s = SimSpec(layout="hnd", num_blocks=48)
    with push(s, s, before=lambda pair: forge_slot(pair, lambda slot: (slot[0], slot[1] // 2))) as pair:
        assert pair.received["d-1"] is not None and "slot holds" in pair.received["d-1"]
        assert pair.fabric.stats.bytes_moved == 0
        pair.pump(lambda: slots_free(pair), what="staging slots back")


def test_a_slot_from_a_d_without_a_staging_buffer_is_refused() -> None:
    """D names a slot but advertises no staging buffer: P has nowhere to write, so it refuses."""
    s = SimSpec(layout="hnd", num_blocks=48)
    with push(s, s, staging_bytes=0, before=lambda pair: forge_slot(pair, lambda _: (0, 1 << 20))) as pair:
        assert pair.received["d-1"] is not None and "no staging buffer" in pair.received["d-1"]
        assert pair.fabric.stats.bytes_moved == 0


def test_a_duplicated_gathered_is_dropped() -> None:
    """The stager's answer arriving twice (a replay) posts no second WRITE: the push lands once
    and every slot comes back."""
    from pushactors.logs import capture_events

    def twice(pair: PushPair) -> None:
        for worker in pair.prefill.workers:
            worker.ctx.faults.repeat_handler("stager", stager_mod.Gather, times=None)

    s = SimSpec(layout="hnd", num_blocks=48)
    with capture_events() as events, push(s, s, before=twice) as pair:
        assert events.named("write.gather_stale")  # the second answer came, and was dropped
        assert pair.received["d-1"] is None and pair.decode.verify("d-1")[1] == 0
        assert pair.fabric.stats.transfers_done == 1
        pair.pump(lambda: slots_free(pair), what="staging slots back")


def test_a_restaged_request_gives_back_every_staging_slot() -> None:
    """D stages a live request again (other blocks) while P writes its first slot: the request
    fails, the first slot is freed once P's WRITE settled, and the slot the second
    registration took (never sent) is freed too. Nothing of D's staging pool is left taken."""
    from scenario_kit import FAST, P_AGENT, is_write_from, posted, stat

    s = SimSpec(layout="hnd", num_blocks=48)
    config = {**FAST, **STAGED, "lease_duration": 30.0, "registration_timeout": 30.0}
    with PushPair(p_spec=s, d_spec=s, **config) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        params = pair.prefill.prefill("p-1", 200, key="k", transfer_id="t-1")
        pair.decode.scheduler.stage_registration("d-1", pair.decode.allocate(13), params)
        pair.pump(lambda: posted(pair) >= 1, what="the WRITE into the first slot")
        pair.decode.scheduler.stage_registration("d-1", pair.decode.allocate(13), params)
        pair.pump(lambda: stat(pair.decode, "recv.restaged") == 1, what="the re-stage seen")
        gate.open()
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="both sides to end")
        assert "re-staged" in (pair.received["d-1"] or "")
        staging = pair.decode.workers[0].ctx.staging
        assert staging is not None
        pair.pump(lambda: staging.sizes()["staging_slots"] == 0, timeout=5, what="D's staging slots back")
        assert staging.sizes()["staging_used"] == 0
        # The scatter made ready for the first registration went with its slot (ForgetScatter).
        sizes = pair.decode.workers[0].runtime.view("stager").sizes()
        assert sizes["prepared_scatters"] == 0 and sizes["prepared_scatter_bytes"] == 0, sizes


def test_ds_scatter_is_made_ready_while_the_push_is_on_the_way() -> None:
    """D makes a staged registration's scatter ready when it starts watching it (rows checked,
    the copy built), so the Scatter after the completion only runs it; the image still lands
    in the right blocks, and nothing stays prepared once the request is reported."""
    from pushactors.logs import capture_events

    s = SimSpec(layout="hnd", num_blocks=48)
    with capture_events() as events, push(s, s) as pair:
        assert pair.decode.verify("d-1")[1] == 0, pair.decode.wrong_elements("d-1")
        names = [e.get("event") for e in events if e.get("actor") == "stager" and e.get("request_id") == "d-1"]
        assert names == ["stage.prepared", "stage.scattered"], names
        (scattered,) = [e for e in events if e.get("event") == "stage.scattered"]
        (ready,) = [e for e in events if e.get("event") == "stage.prepared"]
        assert scattered["prepared"] is True and scattered["rows"] == ready["rows"] == 13 * s.num_layers
        sizes = pair.decode.workers[0].runtime.view("stager").sizes()
        assert sizes["prepared_scatters"] == 0


def test_a_scatter_made_ready_for_another_registration_of_the_id_is_not_used() -> None:
    """A request id comes back (re-staged, then registered anew) with other blocks, the first
    registration's ForgetScatter is lost, and making the new scatter ready fails: the copy
    still made for the first registration (same id, its slot likely the same offset) must not
    run, or the KV would land in the first blocks. The Scatter builds its own rows and every
    element lands where the new registration says."""
    from scenario_kit import FAST, P_AGENT, is_write_from, posted, stat

    from pushactors.logs import capture_events
    from pushactors.protocol import ForgetScatter, PrepareScatter

    s = SimSpec(layout="hnd", num_blocks=64)
    config = {**FAST, **STAGED, "lease_duration": 30.0, "registration_timeout": 30.0}
    with capture_events() as events, PushPair(p_spec=s, d_spec=s, **config) as pair:
        faults = pair.decode.workers[0].ctx.faults
        faults.fail_handler("stager", ForgetScatter, times=None)  # every ForgetScatter lost
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        params = pair.prefill.prefill("p-1", 200, key="k", transfer_id="t-1")
        pair.decode.scheduler.stage_registration("d-1", pair.decode.allocate(13), params)
        pair.pump(lambda: posted(pair) >= 1, what="the WRITE into the first slot")
        pair.decode.scheduler.stage_registration("d-1", pair.decode.allocate(13), params)
        pair.pump(lambda: stat(pair.decode, "recv.restaged") == 1, what="the re-stage seen")
        gate.open()
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="both sides to end")
        assert [e["event"] for e in events if e.get("event", "").startswith("stage.prep")] == ["stage.prepared"]
        faults.fail_handler("stager", PrepareScatter, times=None)  # making it ready fails from here
        raised = faults.raised
        assert raised >= 1  # the first registration's ForgetScatter was lost: its ready copy stays
        pair.decode.received.pop("d-1")
        pair.prefill.prefill("p-2", 200, key="k2", transfer_id="t-2")
        pair.decode.expect("d-1", 200, _staged_params(pair, "t-2"), key="k2")
        pair.pump(lambda: "d-1" in pair.received and "p-2" in pair.sent, what="the new push")
        assert pair.received["d-1"] is None and pair.decode.verify("d-1")[1] == 0, pair.decode.wrong_elements("d-1")
        assert faults.raised > raised  # the new registration's scatter was not made ready
        assert [e["event"] for e in events if e.get("event", "").startswith("stage.prep")] == ["stage.prepared"]
        (scattered,) = [e for e in events if e.get("event") == "stage.scattered"]
        assert scattered["prepared"] is False


@pytest.mark.parametrize("room", ["none", "one"])
def test_scatters_made_ready_are_bounded_by_the_bytes_they_hold(room: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepared scatters hold their rows (every row, on the host path) until the push lands.
    With no room for one, none is kept; with room for one, the second pushes the first out,
    whose Scatter then builds its own rows. Every push still lands where it should, and
    nothing stays held afterwards."""
    from scenario_kit import FAST, P_AGENT, is_write_from, stat

    from pushactors.logs import capture_events

    s = SimSpec(layout="hnd", num_blocks=64)
    rows = 13 * s.num_layers
    monkeypatch.setattr(stager_mod, "PREPARED_SCATTER_BYTES", 0 if room == "none" else rows * 24 + 8)
    config = {**FAST, **STAGED, "lease_duration": 30.0, "registration_timeout": 30.0}
    with capture_events() as events, PushPair(p_spec=s, d_spec=s, **config) as pair:
        gate = pair.fabric.faults.hold_transfer(match=is_write_from(P_AGENT))
        for i in (1, 2):
            pair.prefill.prefill(f"p-{i}", 200, key=f"k{i}", transfer_id=f"t-{i}")
            pair.decode.expect(f"d-{i}", 200, _staged_params(pair, f"t-{i}"), key=f"k{i}")
            pair.pump(
                lambda i=i: any(e.get("event") == "stage.prepared" and e.get("request_id") == f"d-{i}" for e in events),
                what=f"d-{i}'s scatter made ready",
            )
        gate.open()
        pair.pump(lambda: {"d-1", "d-2"} <= set(pair.received), what="both pushes")
        for i in (1, 2):
            assert pair.received[f"d-{i}"] is None and pair.decode.verify(f"d-{i}")[1] == 0
        prepared = {e["request_id"]: e for e in events if e.get("event") == "stage.prepared"}
        assert all(e["bytes_held"] == rows * 24 for e in prepared.values())  # the host path's rows
        scattered = {e["request_id"]: e["prepared"] for e in events if e.get("event") == "stage.scattered"}
        if room == "none":
            assert [e["kept"] for e in prepared.values()] == [False, False]
            assert scattered == {"d-1": False, "d-2": False}
        else:
            assert [e["kept"] for e in prepared.values()] == [True, True]
            assert scattered == {"d-1": False, "d-2": True}
            assert stat(pair.decode, "stage.prepared_evicted") == 1
        sizes = pair.decode.workers[0].runtime.view("stager").sizes()
        assert sizes["prepared_scatters"] == 0 and sizes["prepared_scatter_bytes"] == 0, sizes


def _staged_params(pair: PushPair, tid: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill",
        "remote_host": pair.p_endpoint.host,
        "remote_port": pair.p_endpoint.port,
        "remote_tp_size": 1,
        "transfer_id": tid,
    }


@pytest.mark.parametrize("failure", ["chunk ERR", "gather failed"])
def test_a_failed_chunked_push_keeps_ds_slot_until_no_chunk_can_land(
    failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One chunk of a staged push fails while the others are in flight and NIXL will not cancel
    them. Until none of them can land, D must not hear that the push is over: it would free its
    slot and hand it to another request, and the stale chunks would land in that one's image
    (scattered and reported landed with another request's bytes). D is told the WRITE may still
    land (it keeps the slot); once the chunks end, both sides fail the request and free it all."""
    from scenario_kit import stat

    s = SimSpec(layout="hnd", num_blocks=48)
    # The live chunks are waited for, past write_timeout too (D then hears they may still land).
    pair = PushPair(p_spec=s, d_spec=s, **{**STAGED, "staging_chunk_bytes": 16 << 10, "write_timeout": 1.0})
    posted: list[int] = []

    def first(_ctx: Any) -> bool:  # asked once per WRITE
        posted.append(len(posted))
        return failure == "chunk ERR" and posted[-1] == 0

    if failure == "gather failed":
        real = stager_mod.copy_rows
        calls = iter(range(1 << 20))

        def flaky(*a: Any, **k: Any) -> Any:
            if next(calls) == 2:
                raise RuntimeError("device copy failed")
            return real(*a, **k)

        monkeypatch.setattr(stager_mod, "copy_rows", flaky)
    pair.fabric.faults.err_transfer(match=first, times=None)
    pair.fabric.faults.slow_transfer(0.2, match=lambda _c: failure == "chunk ERR" and posted[-1] == 0)
    gate = pair.fabric.faults.hold_transfer(match=lambda _c: failure != "chunk ERR" or posted[-1] != 0)
    pair.fabric.faults.release_continues(times=None)  # a release would not stop them
    try:
        pair.prefill.prefill("p-1", 200, key="prompt", transfer_id="t-1")
        pair.decode.expect("d-1", 200, _staged_params(pair, "t-1"), key="prompt")
        pair.pump(lambda: stat(pair.decode, "recv.write_pinned") >= 1, what="D told a chunk may still land")
        d_staging = pair.decode.workers[0].ctx.staging
        assert d_staging is not None
        assert "d-1" not in pair.received and "p-1" not in pair.sent
        assert pair.fabric.in_flight() > 0 and d_staging.sizes()["staging_slots"] == 1
        gate.open()
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="both sides to end it")
        assert pair.received["d-1"] is not None and pair.sent["p-1"] is not None
        assert pair.fabric.in_flight() == 0 and pair.fabric.stats.transfers_landed_after_release == 0
        p_staging = pair.prefill.workers[0].ctx.staging
        assert p_staging is not None
        pair.pump(
            lambda: d_staging.sizes()["staging_slots"] == 0 and p_staging.sizes()["staging_slots"] == 0,
            what="both staging pools back",
        )
    finally:
        gate.open()
        pair.close()


@pytest.mark.parametrize(("chunk", "writes"), [(0, 1), (16 << 10, 7)], ids=["one-chunk", "chunks"])
def test_an_abort_of_chunks_stuck_past_write_timeout_frees_the_slot_only_after_they_ended(
    chunk: int, writes: int
) -> None:
    """D aborts while chunk WRITEs are stuck in flight. P never releases a live WRITE on an
    abort (see the direct-path test in test_faults_abort), nor at write_timeout, where it used
    to cancel them (a release that NIXL refuses, or one that returns while the copy runs on,
    proves nothing): D reports (and frees its slot) only once they ended."""
    s = SimSpec(layout="hnd", num_blocks=48)
    config = {
        **STAGED,
        "staging_chunk_bytes": chunk,
        "abort_quarantine": 0.3,
        "write_timeout": 0.5,
        "allow_unsafe_quarantine": True,
    }
    pair = PushPair(p_spec=s, d_spec=s, **config)
    gate = pair.fabric.faults.hold_transfer()
    try:
        pair.fabric.faults.refuse_cancel(times=1)  # were a release tried, it would be refused
        pair.prefill.prefill("p-1", 200, key="prompt", transfer_id="t-1")
        pair.decode.expect("d-1", 200, _staged_params(pair, "t-1"), key="prompt")
        pair.pump(lambda: pair.fabric.in_flight() >= writes, what="every chunk WRITE in flight")
        assert pair.decode.scheduler.abort_recv("d-1")
        held_until = time.monotonic() + 3 * config["write_timeout"]
        pair.pump(lambda: "d-1" in pair.received or time.monotonic() > held_until, what="three write_timeouts")
        assert "d-1" not in pair.received, "D let go of a slot stuck chunks may still land in"
        assert pair.fabric.in_flight() == writes and pair.fabric.stats.transfers_cancelled == 0
        gate.open()
        pair.pump(lambda: "d-1" in pair.received, timeout=10, what="D to report the abort")
        assert pair.fabric.in_flight() == 0  # nothing could land in the slot D let go
        assert pair.received["d-1"] is not None
        pair.pump(lambda: "p-1" in pair.sent and slots_free(pair), what="P to settle, slots back")
    finally:
        gate.open()
        pair.close()


@pytest.mark.parametrize(("chunk", "writes"), [(0, 1), (16 << 10, 7)], ids=["one-chunk", "chunks"])
def test_an_abort_mid_staged_write_frees_the_slots_only_after_every_chunk_ended(chunk: int, writes: int) -> None:
    """D aborts while the chunk WRITEs of a staged push run, and releasing one would not stop it
    (``release_continues``: a started copy runs on). P releases none: the push fails once they
    ended, and only then do D free its slot and P its own."""
    from scenario_kit import stat

    s = SimSpec(layout="hnd", num_blocks=48)
    config = {**STAGED, "staging_chunk_bytes": chunk, "abort_quarantine": 0.3, "allow_unsafe_quarantine": True}
    pair = PushPair(p_spec=s, d_spec=s, **config)
    gate = pair.fabric.faults.hold_transfer()
    pair.fabric.faults.release_continues(times=None)
    try:
        pair.prefill.prefill("p-1", 200, key="prompt", transfer_id="t-1")
        pair.decode.expect("d-1", 200, _staged_params(pair, "t-1"), key="prompt")
        pair.pump(lambda: pair.fabric.in_flight() >= writes, what="every chunk WRITE in flight")
        assert pair.decode.scheduler.abort_recv("d-1")
        t0 = time.monotonic()
        freed = lambda: "d-1" in pair.received or "p-1" in pair.sent  # noqa: E731
        pair.pump(lambda: freed() or time.monotonic() - t0 > 0.9, what="past D's quarantine")
        assert not freed(), f"a slot freed under live chunk WRITEs: D {pair.received}, P {pair.sent}"
        assert stat(pair.decode, "recv.write_pinned") >= 1  # said again on each re-sent abort
        gate.open()
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="both sides to end it")
        assert pair.fabric.in_flight() == 0 and pair.fabric.stats.transfers_landed_after_release == 0
        pair.pump(lambda: slots_free(pair), what="both staging pools back")
    finally:
        gate.open()
        pair.close()


def test_a_chunk_whose_post_raised_waits_for_the_chunks_still_running() -> None:
    """The second chunk's WRITE raises at post while the first runs (and a release would not
    stop it). The push fails, but only once the first chunk ended: the raised handle, never
    posted, must not make the whole push look ended (its state query raised, which was read as
    ERR, and every chunk was released and both sides reported)."""
    s = SimSpec(layout="hnd", num_blocks=48)
    pair = PushPair(p_spec=s, d_spec=s, **{**STAGED, "staging_chunk_bytes": 16 << 10})
    asked: list[int] = []

    def second(_ctx: Any) -> bool:  # asked once per WRITE
        asked.append(len(asked))
        return asked[-1] == 1

    pair.fabric.faults.raise_on_transfer(match=second, times=1)
    gate = pair.fabric.faults.hold_transfer()
    pair.fabric.faults.release_continues(times=None)
    try:
        pair.prefill.prefill("p-1", 200, key="prompt", transfer_id="t-1")
        pair.decode.expect("d-1", 200, _staged_params(pair, "t-1"), key="prompt")
        t0 = time.monotonic()
        ended = lambda: "d-1" in pair.received or "p-1" in pair.sent  # noqa: E731
        pair.pump(lambda: ended() or time.monotonic() - t0 > 1.5, what="an end, or 1.5 s")
        assert not ended(), f"reported over with a chunk still running: P {pair.sent}, D {pair.received}"
        assert pair.fabric.in_flight() >= 1
        gate.open()
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="both sides to fail it")
        assert pair.received["d-1"] is not None and pair.sent["p-1"] is not None
        assert pair.fabric.stats.transfers_landed_after_release == 0
        pair.pump(lambda: slots_free(pair), what="both staging pools back")
    finally:
        gate.open()
        pair.close()


def test_a_gather_handler_error_on_a_later_chunk_fails_the_push_and_frees_both_slots() -> None:
    """The stager's handler raises on chunk 1 of a push in chunks: its reply must name chunk 1
    (the writer counts replies per chunk). Named chunk 0, it was dropped as stale: the push
    hung until D's watchdog and P's slot was never freed."""
    from scenario_kit import stat

    from pushactors.protocol import Gather

    s = SimSpec(layout="hnd", num_blocks=48)
    config = {**STAGED, "staging_chunk_bytes": 16 << 10, "lease_duration": 30.0, "registration_timeout": 30.0}
    with PushPair(p_spec=s, d_spec=s, **config) as pair:
        pair.prefill.workers[0].ctx.faults.fail_handler("stager", Gather, match=lambda m: m.chunk == 1)
        pair.prefill.prefill("p-1", 200, key="k", transfer_id="t-1")
        pair.decode.expect("d-1", 200, _staged_params(pair, "t-1"), key="k")
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="both sides to fail it")
        assert pair.received["d-1"] is not None and pair.sent["p-1"] is not None
        assert stat(pair.prefill, "recv.timed_out") == 0 and stat(pair.decode, "recv.timed_out") == 0
        pair.pump(lambda: slots_free(pair), what="both staging pools back")


def test_a_scatter_handler_error_after_its_slot_was_freed_never_frees_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """D's stager freed a request's slot, then raised (here: reporting it). The error path must
    not free the slot a second time: the offset may already belong to the next request, and
    two live requests would share one image."""
    s = SimSpec(layout="hnd", num_blocks=48)
    with PushPair(p_spec=s, d_spec=s, **STAGED) as pair:
        d_ctx = pair.decode.workers[0].ctx
        staging = d_ctx.staging
        assert staging is not None
        frees: list[int] = []
        real_free = staging.free
        monkeypatch.setattr(staging, "free", lambda off: (frees.append(off), real_free(off))[1])
        real_received = d_ctx.outbox.received

        def received(rid: str) -> None:
            real_received(rid)
            if rid == "d-1":
                raise RuntimeError("reporting failed")

        monkeypatch.setattr(d_ctx.outbox, "received", received)
        pair.prefill.prefill("p-1", 200, key="k", transfer_id="t-1")
        pair.decode.expect("d-1", 200, _staged_params(pair, "t-1"), key="k")
        pair.pump(lambda: "d-1" in pair.received, what="d-1 reported")
        pair.pump(lambda: d_ctx.metrics.get("stager.handler_error") >= 1, what="the stager's error handled")
        assert len(frees) == 1


def test_only_the_stager_gives_back_a_slot_of_a_request_that_ended_without_a_scatter() -> None:
    """Plain, no threads. The reaper fails a staged request it could not watch: it frees
    nothing itself and tells the stager (ForgetScatter), which gives the slot back once, and
    not again when that message's handling is reported failed afterwards."""
    import msgspec

    from pushactors.actors.base import RankContext
    from pushactors.actors.reaper import Reaper
    from pushactors.actors.stager import Stager
    from pushactors.core.config import PushConfig
    from pushactors.protocol import ForgetScatter, WatchRecv
    from pushactors.testing import registration

    class Sink:
        def __init__(self) -> None:
            self.told: list[Any] = []

        def tell(self, message: Any) -> None:
            self.told.append(message)

    ctx = RankContext(config=PushConfig(engine_id="decode"), engine_id="decode")
    sinks = {name: Sink() for name in ("writer", "matcher", "reaper", "handshake", "stager")}
    for name, sink in sinks.items():
        setattr(ctx.peers, name, sink)
    staging = ctx.staging = StagingArea(0x10000, 1 << 20)
    offset = staging.alloc(4096)
    assert offset is not None
    reg = msgspec.structs.replace(registration("d-1", (5, 6)), staging_slot=(offset, 4096))
    watch = WatchRecv(request_id="d-1", expected=1, deadline=0.0, registration=reg, peers=(), heartbeat_id="d-1")
    Reaper(ctx).on_handler_error(watch, RuntimeError("boom"))
    assert ctx.outbox.drain().failed_recving.keys() == {"d-1"}
    assert staging.sizes()["staging_slots"] == 1  # not the reaper's to free
    (forget,) = sinks["stager"].told
    assert isinstance(forget, ForgetScatter) and forget.registration == reg

    frees: list[int] = []
    real_free = staging.free
    staging.free = lambda off: (frees.append(off), real_free(off))[1]  # type: ignore[method-assign]
    stager = Stager(ctx)
    stager.actor_ref.tell(forget)
    while not stager.actor_inbox.empty():
        stager.on_receive(stager.actor_inbox.get().message)
    assert frees == [offset] and staging.sizes()["staging_slots"] == 0
    stager.on_handler_error(forget, RuntimeError("after the free"))
    assert frees == [offset]  # the offset may be another request's by now
    # A ForgetScatter whose handling failed before the free still gives its slot back.
    again = staging.alloc(4096)
    assert again is not None
    other = msgspec.structs.replace(reg, staging_slot=(again, 4096))
    Stager(ctx).on_handler_error(ForgetScatter(request_id="d-1", registration=other), RuntimeError("early"))
    assert frees == [offset, again] and staging.sizes()["staging_slots"] == 0
