"""Staged-push copy kernels alone: gather a request's scattered blocks into one staging run and
scatter it back, beside a plain device copy of the same bytes (the bound) in the same run.

    python bench/copy_rows_bench.py [--device cuda] [--layers 32] [--blocks 256] [--json PATH]

The shape is the 8B request of ``pushactors bench big``: per layer one tensor of 64 KiB blocks
(vLLM's per-layer page, K and V together), 256 blocks per layer scattered over a pool of 1024.
Cases: ``copy_rows`` as the stager calls it (host work + kernels + sync), with the fused kernel
and with the torch indexing path; on CUDA also the fused kernel's device time alone (CUDA
events around one launch with the row table already on the device) for a few block sizes.
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

from pushactors.core.rowgrid import RowGrid
from pushactors.transport import copies
from pushactors.transport.copies import ByteViews, copy_grids, copy_rows


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--block-bytes", type=int, default=64 << 10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=Path("runs/bench/copy_rows.json"))
    ap.add_argument("--profile", action="store_true", help="print where a fused gather's host time goes")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rng = np.random.default_rng(0)
    row = args.block_bytes
    kv = [torch.empty(args.pool * row, dtype=torch.uint8, device=dev) for _ in range(args.layers)]
    nbytes = args.layers * args.blocks * row
    stage = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    views = ByteViews([*kv, stage])
    blocks = rng.permutation(args.pool)[: args.blocks].astype(np.uint64)
    kv_addr = np.concatenate([np.uint64(t.data_ptr()) + blocks * np.uint64(row) for t in kv])
    stage_addr = np.uint64(stage.data_ptr()) + np.arange(len(kv_addr), dtype=np.uint64) * np.uint64(row)
    lens = np.full(len(kv_addr), row, dtype=np.uint64)
    cuda = dev.type == "cuda"
    stream = torch.cuda.Stream(device=dev) if cuda else None  # type: ignore[no-untyped-call]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    gbps = lambda s: round(nbytes / s / 1e9, 1)  # noqa: E731
    res: dict[str, Any] = {"device": str(dev), "bytes": nbytes, "rows": len(kv_addr), "row_bytes": row}
    src_big = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t = timed(lambda: stage.copy_(src_big), args.reps, sync)
    res["device_copy"] = {"ms": round(t * 1e3, 3), "GBps": gbps(t)}
    for fused in [True, False] if cuda else [False]:
        copies.FUSED = fused
        name = "fused" if fused else "torch"
        g = timed(lambda: copy_rows(views, kv_addr, stage_addr, lens, stream), args.reps, sync)
        s = timed(lambda: copy_rows(views, stage_addr, kv_addr, lens, stream), args.reps, sync)
        res[f"copy_rows_{name}"] = {
            "gather_ms": round(g * 1e3, 3),
            "gather_GBps": gbps(g),
            "scatter_ms": round(s * 1e3, 3),
            "scatter_GBps": gbps(s),
        }
    copies.FUSED = True
    # The same rows as a grid (layers × blocks), as a staged push hands them to the stager.
    pool_blocks = blocks.astype(np.int64)
    kv_grid = RowGrid(
        src=np.array([t.data_ptr() for t in kv], dtype=np.int64),
        src_stride=np.full(len(kv), row, dtype=np.int64),
        dst=stage.data_ptr() + np.arange(len(kv), dtype=np.int64) * args.blocks * row,
        dst_stride=np.full(len(kv), row, dtype=np.int64),
        length=np.zeros(len(kv), dtype=np.int64),
        src_block=pool_blocks,
        src_off=np.zeros(args.blocks, dtype=np.int64),
        dst_block=np.arange(args.blocks, dtype=np.int64),
        dst_off=np.zeros(args.blocks, dtype=np.int64),
        piece_length=np.full(args.blocks, row, dtype=np.int64),
    )
    back = RowGrid(
        kv_grid.dst, kv_grid.dst_stride, kv_grid.src, kv_grid.src_stride, kv_grid.length,
        kv_grid.dst_block, kv_grid.dst_off, kv_grid.src_block, kv_grid.src_off, kv_grid.piece_length,
    )  # fmt: skip
    host: list[float] = []

    def grid_copy(g: RowGrid) -> None:
        copy_grids(views, [g], stream)
        host.append(views.last_host_s)

    g = timed(lambda: grid_copy(kv_grid), args.reps, sync)
    g_host = statistics.median(host)
    host.clear()
    s = timed(lambda: grid_copy(back), args.reps, sync)
    res["copy_grids"] = {
        "gather_ms": round(g * 1e3, 3),
        "gather_GBps": gbps(g),
        "gather_host_ms": round(g_host * 1e3, 3),
        "scatter_ms": round(s * 1e3, 3),
        "scatter_GBps": gbps(s),
        "scatter_host_ms": round(statistics.median(host) * 1e3, 3),
    }
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            copy_rows(views, kv_addr, stage_addr, lens, stream)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if cuda and copies._kernel() is not False:
        kernel = copies._kernel()
        base = views.spans[0][2]
        b = np.uint64(base.data_ptr())
        table = np.stack(((kv_addr - b).view(np.int64), (stage_addr - b).view(np.int64), lens.astype(np.int64))) // 8
        on_dev = torch.from_numpy(np.ascontiguousarray(table).ravel()).to(dev)
        n_rows = len(kv_addr)
        flat = base[: base.numel() // 8 * 8].view(torch.int64)
        kernels = {}
        for block_bytes in (4096, 8192, 16384, 32768, 65536):
            for warps in (4, 8):
                blk = block_bytes // 8
                grid = (len(kv_addr), -(-row // block_bytes))

                def launch(blk: int = blk, grid: tuple[int, int] = grid, warps: int = warps) -> None:
                    kernel[grid](flat, on_dev, n_rows, BLOCK=blk, VEC=2, num_warps=warps)

                launch()
                sync()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                times = []
                for _ in range(args.reps):
                    start.record()  # type: ignore[no-untyped-call]
                    launch()
                    end.record()  # type: ignore[no-untyped-call]
                    end.synchronize()  # type: ignore[no-untyped-call]
                    times.append(start.elapsed_time(end) / 1e3)  # type: ignore[no-untyped-call]
                k = statistics.median(times)
                kernels[f"{block_bytes // 1024}KiB_w{warps}"] = {"ms": round(k * 1e3, 3), "GBps": gbps(k)}
        res["fused_kernel_device_time"] = kernels
    print(json.dumps(res, indent=1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
