"""The fused digest pass (pushactors/transport/digest_kernel.py) agrees with the digest's
definition and with the torch path, byte for byte, over pieces from several tensors, pieces
that cross pages and long runs that are cut; a flipped byte changes it.

The kernel runs on a GPU natively. On a CPU it runs under Triton's interpreter, in a child
process (the interpreter is chosen when the kernel is built), where Triton is installed; the
piece cutting is checked everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pushactors.core.blocks import KVRegion
from pushactors.transport import digest_kernel
from pushactors.transport.copies import ByteViews
from pushactors.transport.digest import KVDigest, block_pieces, reference_digest, region_chunks, region_offsets

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


def test_pieces_are_cut_at_d_pages_into_bounded_parts_that_cover_them_exactly() -> None:
    span = digest_kernel.PIECE_PAGES << digest_kernel.PAGE_SHIFT
    rng = np.random.default_rng(1)
    dst = (rng.integers(0, 1 << 24, 200) * 8).astype(np.uint64)
    lengths = (rng.integers(1, 1 << 16, 200) * 8).astype(np.uint64)
    src = (rng.integers(-(1 << 20), 1 << 20, 200) * 8).astype(np.int64)
    tag = np.arange(200, dtype=np.int64)
    s, d, n, (t,) = digest_kernel.cut_pieces(src, dst, lengths, [tag])
    assert int(n.sum()) == int(lengths.sum())
    assert np.all(d // np.uint64(span) == (d + n - np.uint64(1)) // np.uint64(span))  # none crosses a part
    # Each part is its piece's bytes at the same distance on both sides, in order.
    moved = (d - dst[t]).astype(np.int64)
    assert np.all(s - src[t] == moved) and np.all(moved >= 0) and np.all(d + n <= dst[t] + lengths[t])
    assert np.all(np.diff(t) >= 0)
    # Pieces within one part are left as they are (the common case: one block per piece).
    small = np.array([0, span, 3 * span + 64], dtype=np.uint64)
    same = digest_kernel.cut_pieces(src[:3], small, np.full(3, 4096, np.uint64), [tag[:3]])
    assert same[1] is small


CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from pushactors.core.blocks import KVRegion
    from pushactors.transport import digest_kernel
    from pushactors.transport.copies import ByteViews
    from pushactors.transport.digest import KVDigest, block_pieces, reference_digest, region_chunks, region_offsets

    device = torch.device(DEVICE)
    assert digest_kernel.available(device), "the fused pass is not available here"
    layers, pool, block = 5, 48, 16 * 1024
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randint(0, 256, (pool, block), dtype=torch.uint8, generator=gen).to(device) for _ in range(layers)]
    regions = [KVRegion(t.data_ptr(), block, block, pool, members=(f"l{i}",)) for i, t in enumerate(tensors)]
    kv = KVDigest(ByteViews(tensors))

    def both(src, owner, dst, lengths, chunk, chunks):
        kv.fused = True
        fused = kv.sums(src, owner, dst, lengths, chunk, chunks)
        kv.fused = False
        plain = kv.sums(src, owner, dst, lengths, chunk, chunks)
        assert fused == plain, (fused, plain)
        return fused

    rng = np.random.default_rng(3)
    blocks = tuple(int(b) for b in rng.choice(pool, 20, replace=False))
    addrs, lengths, owner = block_pieces(regions, (blocks,), 1)
    chunk = region_chunks(layers)[owner]
    offsets = region_offsets(regions, addrs, owner)
    whole = both(addrs, owner, offsets, lengths, chunk, layers)
    assert all(n == 20 * block for _, n in whole)
    kv.fused = True
    ready = kv.prepare(addrs, owner, offsets, lengths, chunk, layers)  # made ready ahead, run later
    assert ready.fused is not None and ready.size > 0

    # Pieces that start inside a page and cross several, from tensors other than the first,
    # landing at other offsets than they are read from.
    src = addrs + np.uint64(1032)
    cut = np.full(len(addrs), 3 * 4096 + 200, dtype=np.uint64)
    both(src, owner, offsets + np.uint64(2056), cut, chunk, layers)

    # Long runs (a layer's blocks in order, many pages): cut into parts, the same sums.
    runs = np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
    run_len = np.full(layers, 40 * block, dtype=np.uint64)
    both(runs, np.arange(layers), np.zeros(layers, np.uint64), run_len, np.arange(layers), layers)

    # The definition, byte by byte, for a short piece of the last tensor.
    t = tensors[-1]
    piece = bytes(t[5, 8:136].cpu().numpy())
    kv.fused = True
    got = kv.sums(
        np.array([t.data_ptr() + 5 * block + 8], np.uint64), np.array([layers - 1]),
        np.array([9 * block + 16], np.uint64), np.array([128], np.uint64), np.array([0]), 1,
    )
    assert got[0][0] == reference_digest(piece, layers - 1, 9 * block + 16), got

    # One flipped byte in one block changes its chunk and no other.
    tensors[2][blocks[4], 777] ^= 1
    kv.fused = True
    flipped = kv.sums(addrs, owner, offsets, lengths, chunk, layers)
    changed = [c for c in range(layers) if flipped[c] != whole[c]]
    assert changed == [int(region_chunks(layers)[2])], changed
    assert kv.run(ready) == flipped  # the bytes are read when it runs, not when it was made ready
    print("fused digest ok")
    """
)


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed: the fused pass is a GPU path")
def test_fused_pass_agrees_with_the_definition() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = dict(os.environ)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # Triton's interpreter runs the kernel on the host
    out = subprocess.run(
        [sys.executable, "-c", CHECK.replace("DEVICE", repr(device))],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and "fused digest ok" in out.stdout, out.stderr[-4000:]


def test_without_a_kernel_the_torch_path_serves() -> None:
    """On a CPU without the interpreter the fused pass says no, and the digest still holds."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the fused pass applies here; the test above covers it")
    assert not digest_kernel.available(torch.device("cpu"))
    t = torch.arange(4096, dtype=torch.int64).view(torch.uint8)
    kv = KVDigest(ByteViews([t]))
    region = KVRegion(t.data_ptr(), 4096, 4096, 8, members=("l",))
    addrs, lengths, owner = block_pieces([region], ((3,),), 1)
    got = kv.sums(addrs, owner, region_offsets([region], addrs, owner), lengths, region_chunks(1)[owner], 1)
    assert got[0] == (reference_digest(bytes(t[3 * 4096 : 4 * 4096].numpy()), 0, 3 * 4096), 4096)


def test_block_pieces_list_every_block_of_every_region_of_its_group_region_by_region() -> None:
    """D's pieces, built per KV group at once: each region's physical blocks of its group, at
    base + block × stride, in region order (hybrid groups interleaved among the layers)."""
    rng = np.random.default_rng(5)
    for _ in range(100):
        groups = [tuple(int(b) for b in rng.choice(64, rng.integers(0, 9), replace=False)) for _ in range(3)]
        regions = [
            KVRegion(int(rng.integers(1, 1 << 30)) * 256, 512, 1024, 64, members=(f"l{i}",), group=int(rng.integers(4)))
            for i in range(int(rng.integers(1, 10)))
        ]
        ratio = int(rng.integers(1, 3))
        addrs, lengths, owner = block_pieces(regions, groups, ratio)
        want = [
            (r.base_addr + (b * ratio + k) * r.stride, r.block_len, i)
            for i, r in enumerate(regions)
            if r.group < len(groups)
            for b in groups[r.group]
            for k in range(ratio)
        ]
        assert list(zip(addrs.tolist(), lengths.tolist(), owner.tolist(), strict=True)) == want
