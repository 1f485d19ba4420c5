"""Verified pushes' digests alone (``verify``): what P adds to a push and D to its landing,
beside a plain device copy of the same bytes (the bound) in the same run.

    python bench/verify_cost.py [--device cuda] [--layers 32] [--blocks 256] [--json PATH]

The shape is the 8B request of ``pushactors bench big``: per layer one tensor of 64 KiB blocks
(vLLM's per-layer page, K and V together), 256 blocks per layer scattered over a pool of 1024:
512 MiB. Cases: D's digest of its blocks (what a landing waits for), P's digest of the same
pieces weighed at D's addresses (what a whole push's completion waits for), and P's digest of
one layer (what the last WRITE of a layer-wise push waits for). Each is timed end to end, host
work and device sync included, as the writer runs it. On a GPU with Triton the digests are the
fused pass; ``d_blocks_torch_ms`` is D's through the torch path, for comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pushactors.core.blocks import KVRegion
from pushactors.transport import digest_kernel
from pushactors.transport.copies import ByteViews
from pushactors.transport.digest import KVDigest, block_pieces, region_chunks, region_offsets


def timed(fn: Any, reps: int, sync: Any) -> float:
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--block-bytes", type=int, default=64 * 1024)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="time the fused pass's shapes (pages per program, warps)")
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    tensors = [
        torch.randint(0, 256, (args.pool, args.block_bytes), dtype=torch.uint8, generator=gen).to(device)
        for _ in range(args.layers)
    ]
    regions = [
        KVRegion(t.data_ptr(), args.block_bytes, args.block_bytes, args.pool, members=(f"layer.{i}",))
        for i, t in enumerate(tensors)
    ]
    kv = KVDigest(ByteViews(tensors))
    rng = np.random.default_rng(0)
    blocks = tuple(int(b) for b in rng.choice(args.pool, args.blocks, replace=False))
    addrs, lengths, owner = block_pieces(regions, (blocks,), 1)
    chunk = region_chunks(len(regions))[owner]
    offsets = region_offsets(regions, addrs, owner)
    nbytes = int(lengths.sum())
    # P's source: another pool of the same shape holding the request's KV in its first blocks,
    # in order; the pieces land in D's scattered blocks.
    src_tensors = [torch.zeros_like(t) for t in tensors]
    for s, t in zip(src_tensors, tensors, strict=True):
        s[: args.blocks] = t[list(blocks)]
    src = np.concatenate(
        [t.data_ptr() + np.arange(args.blocks, dtype=np.uint64) * np.uint64(args.block_bytes) for t in src_tensors]
    ).astype(np.uint64)
    p_kv = KVDigest(ByteViews(src_tensors))
    layer = owner == 0
    flat = torch.cat([t[list(blocks)].reshape(-1) for t in tensors])
    out = torch.empty_like(flat)
    result = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "bytes": nbytes,
        "layers": args.layers,
        "blocks": args.blocks,
        "copy_ms": timed(lambda: out.copy_(flat), args.reps, sync) * 1e3,
        "d_blocks_ms": timed(lambda: kv.sums(addrs, owner, offsets, lengths, chunk, 8), args.reps, sync) * 1e3,
        "p_pieces_ms": timed(lambda: p_kv.sums(src, owner, offsets, lengths, chunk, 8), args.reps, sync) * 1e3,
        "p_one_layer_ms": timed(
            lambda: p_kv.sums(src[layer], owner[layer], offsets[layer], lengths[layer], chunk[layer], 8),
            args.reps,
            sync,
        )
        * 1e3,
    }
    # The fixed part: one 4 KiB piece (the host work, the launch, the wait for the result).
    one = slice(0, 1)
    small = (addrs[one], owner[one], offsets[one], np.full(1, 4096, np.uint64), chunk[one], 8)
    result["one_page_ms"] = round(timed(lambda: kv.sums(*small), args.reps, sync) * 1e3, 3)
    if args.sweep and result.get("fused", digest_kernel.available(device)):
        # The fused pass's shape: pages per program and warps, D's digest of the whole request.
        sweep = {}
        kept = (digest_kernel.PAGES_PER_PROGRAM, digest_kernel.NUM_WARPS)
        for pages in (1, 2, 4, 8, 16):
            for warps in (4, 8):
                digest_kernel.PAGES_PER_PROGRAM, digest_kernel.NUM_WARPS = pages, warps
                ms = timed(lambda: kv.sums(addrs, owner, offsets, lengths, chunk, 8), args.reps, sync) * 1e3
                sweep[f"pages{pages}_warps{warps}"] = round(ms, 3)
        digest_kernel.PAGES_PER_PROGRAM, digest_kernel.NUM_WARPS = kept
        result["sweep_d_blocks_ms"] = sweep
    # The same digest through the torch path (the fused pass off): what a host without Triton pays.
    kv.fused = p_kv.fused = False
    result["d_blocks_torch_ms"] = timed(lambda: kv.sums(addrs, owner, offsets, lengths, chunk, 8), 2, sync) * 1e3
    kv.fused = p_kv.fused = True
    result["fused"] = digest_kernel.available(device)
    d_sums = kv.sums(addrs, owner, offsets, lengths, chunk, 8)
    assert d_sums == p_kv.sums(src, owner, offsets, lengths, chunk, 8), "P and D disagree"
    for key in ("copy_ms", "d_blocks_ms", "p_pieces_ms", "p_one_layer_ms", "d_blocks_torch_ms"):
        result[key] = round(result[key], 3)
    result["d_GBps"] = round(nbytes / result["d_blocks_ms"] / 1e6, 1)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
