"""What a NIXL call costs from a busy Python process: one WRITE at a time, timed per call.

    .venv/bin/python bench/nixl_threads.py [--device cuda] [--sizes 65536,536870912] [--reps 60]

Two spawned processes (initiator and target, one region each, the target progressing its
agent without pause). The initiator posts one WRITE with a notification at a time and times
``transfer`` (wall and the thread's own CPU) and ``transfer`` → ``check_xfer_state`` DONE, in
these modes:

- ``main``: from the main thread, the descriptor lists prepared once;
- ``main, fresh lists``: the lists prepared and released around every WRITE (as a push posted
  as runs does);
- ``thread``: from a second thread (as the writer actor posts), lists prepared once;
- ``main, one busy thread``: while another thread of the process runs Python without pause;
  also with the interpreter's switch interval at 0.5 and 0.1 ms (``sys.setswitchinterval``),
  as an engine whose own thread is busy in Python could set it.

NIXL's Python calls let go of the GIL while they run, so when any other thread of the process
wants the GIL, the caller gets it back only once that thread blocks or the interpreter's switch
interval (``sys.getswitchinterval()``, 5 ms by default) runs out: the last mode shows it. In a
rank the other threads (matcher, reaper, the engine) are not busy all the time, but each of
their bursts lands on whichever NIXL call is in progress then.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from pushactors.testing.node import PythonLoad

MODES = (
    "main",
    "main, fresh lists",
    "thread",
    "main, one busy thread",
    "main, one busy thread, switch 0.5 ms",
    "main, one busy thread, switch 0.1 ms",
    "main",
)


def _target(device: str, nbytes: int, conn: Connection) -> None:
    import torch

    from pushactors.transport.nixl import NixlAgent

    if device == "cuda":
        torch.cuda.set_device(0)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    agent = NixlAgent("target")
    mem = "VRAM" if device == "cuda" else "DRAM"
    agent.register_memory(np.array([[buf.data_ptr(), nbytes, 0]], dtype=np.uint64), mem)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while not conn.poll(0):  # progress without pause: small WRITEs move only while both ends do
        agent.get_new_notifs()
    conn.recv()


@dataclass
class _Initiator:
    agent: Any
    peer: str
    mem: str

    def lists(self, local: np.ndarray, remote: np.ndarray) -> tuple[Any, Any]:
        from pushactors.transport.nixl import LOCAL_AGENT

        return self.agent.prep_xfer_dlist(LOCAL_AGENT, local, self.mem), self.agent.prep_xfer_dlist(
            self.peer, remote, self.mem
        )

    def write(self, lists: tuple[Any, Any]) -> tuple[float, float, float]:
        """One WRITE with a notification: (transfer wall, transfer thread CPU, until DONE)."""
        idx = np.zeros(1, dtype=np.int64)
        handle = self.agent.make_prepped_xfer("WRITE", lists[0], idx, lists[1], idx, b"n" * 200)
        c0, t0 = time.thread_time(), time.perf_counter()
        state = self.agent.transfer(handle)
        t1, c1 = time.perf_counter(), time.thread_time()
        while state not in ("DONE", "ERR"):
            state = self.agent.check_xfer_state(handle)
        t2 = time.perf_counter()
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"the WRITE ended {state}")
        return t1 - t0, c1 - c0, t2 - t0


def _run_mode(ini: _Initiator, local: np.ndarray, remote: np.ndarray, mode: str, reps: int) -> list[tuple[float, ...]]:
    kept = ini.lists(local, remote)
    samples: list[tuple[float, ...]] = []

    def run() -> None:
        for _ in range(reps + 10):
            if "fresh" in mode:
                lists = ini.lists(local, remote)
                samples.append(ini.write(lists))
                for h in lists:
                    ini.agent.release_dlist_handle(h)
            else:
                samples.append(ini.write(kept))

    switch = sys.getswitchinterval()
    if "switch" in mode:
        sys.setswitchinterval(float(mode.rsplit(" ", 2)[1]) / 1e3)
    busy = PythonLoad(1.0) if "busy" in mode else None  # Python without pause, as the nodes' load
    try:
        if mode == "thread":
            t = threading.Thread(target=run)
            t.start()
            t.join()
        else:
            run()
    finally:
        if busy:
            busy.stop()
        sys.setswitchinterval(switch)
        for h in kept:
            ini.agent.release_dlist_handle(h)
    return samples[10:]  # warm-up dropped


def measure(device: str, sizes: list[int], reps: int) -> list[dict[str, Any]]:
    import torch

    from pushactors.transport.nixl import NixlAgent

    top = max(sizes)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(device, top, theirs), daemon=True)
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        meta, dptr = mine.recv()
        if device == "cuda":
            torch.cuda.set_device(0)
        buf = torch.ones(top, dtype=torch.uint8, device=device)
        mem = "VRAM" if device == "cuda" else "DRAM"
        agent = NixlAgent("initiator")
        agent.register_memory(np.array([[buf.data_ptr(), top, 0]], dtype=np.uint64), mem)
        ini = _Initiator(agent, agent.add_remote_agent(meta), mem)
        for size in sizes:
            local = np.array([[buf.data_ptr(), size, 0]], dtype=np.uint64)
            remote = np.array([[dptr, size, 0]], dtype=np.uint64)
            for mode in MODES:
                samples = _run_mode(ini, local, remote, mode, reps)
                rows.append(
                    {
                        "bytes": size,
                        "mode": mode,
                        "transfer_us_p50": round(statistics.median(s[0] for s in samples) * 1e6, 1),
                        "transfer_cpu_us_p50": round(statistics.median(s[1] for s in samples) * 1e6, 1),
                        "done_us_p50": round(statistics.median(s[2] for s in samples) * 1e6, 1),
                        "reps": len(samples),
                    }
                )
    finally:
        mine.send("bye")
        proc.join(timeout=30)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--sizes", default="65536,536870912", help="bytes per WRITE, comma separated")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    print(f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms")
    print("| bytes | mode | transfer µs (thread CPU µs) | transfer → DONE µs |")
    print("|---|---|---|---|")
    for r in measure(args.device, sizes, args.reps):
        cpu = r["transfer_cpu_us_p50"]
        print(f"| {r['bytes']} | {r['mode']} | {r['transfer_us_p50']} ({cpu}) | {r['done_us_p50']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
