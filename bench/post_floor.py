"""What one NIXL post costs depending on how the posting thread lives, with no pushactors in it.

    .venv/bin/python bench/post_floor.py [--reps 300] [--bytes 4096] [--device cuda] [--progress-thread]

Two NIXL agents in one process (DRAM, UCX), one prepared descriptor each side; every case times
``transfer`` of a WRITE made ahead (its notification given at the post, as an armed push posts),
then waits for it to end and for the target to see the notification. Cases:

* ``tight``: back to back, as the bare-NIXL baseline of ``pushactors bench`` posts;
* ``after idle``: 2 ms of sleep before each post (the core may idle, as the writer's does
  between pushes);
* ``after idle, woken by a queue``: the post is made on a thread woken through a queue after
  those 2 ms, as a mailbox wakes the writer;
* ``after idle, 200 µs spin first``: the same sleep, then 200 µs of spinning before the post;
* ``beside idle threads``: back to back, with six threads waiting on queues with timeouts
  (as a rank's actors wait on their mailboxes);
* ``beside a thread running Python``: back to back, with a thread spinning bytecode (it holds
  the interpreter whenever the post gives it up).

``--progress-thread`` builds both agents as a rank does by default (NIXL's progress thread on,
sleeping on UCX's events, ``nixl_progress_delay``); ``--device cuda`` puts both buffers in VRAM
(in one process UCX moves them with ``cuda_copy``/``cuda_ipc``).

Prints p50/p90 µs of ``transfer`` per case.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--progress-thread", action="store_true", help="NIXL's progress thread on (the default of a rank)")
    args = ap.parse_args()

    import torch

    from pushactors.core.config import PushConfig
    from pushactors.transport.agent import LOCAL_AGENT
    from pushactors.transport.nixl import NixlAgent

    delay_us = int(PushConfig(engine_id="post-floor").nixl_progress_delay * 1e6)
    p, d = (
        NixlAgent(name, progress_thread=args.progress_thread, progress_delay_us=delay_us)
        for name in ("post-floor-p", "post-floor-d")
    )
    mem, dev = ("VRAM", 0) if args.device == "cuda" else ("DRAM", 0)
    src = torch.zeros(1 << 20, dtype=torch.uint8, device=args.device)
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device=args.device)
    p.register_memory(np.array([[src.data_ptr(), src.numel(), dev]]), mem)
    d.register_memory(np.array([[dst.data_ptr(), dst.numel(), dev]]), mem)
    p.add_remote_agent(d.get_agent_metadata())
    d.add_remote_agent(p.get_agent_metadata())
    n = args.bytes
    lh = p.prep_xfer_dlist(LOCAL_AGENT, np.array([[src.data_ptr(), n, dev]]), mem)
    rh = p.prep_xfer_dlist(d.name, np.array([[dst.data_ptr(), n, dev]]), mem)
    idx = np.arange(1, dtype=np.int64)
    seq = iter(range(1 << 30))

    def post() -> float:
        handle = p.make_prepped_xfer("WRITE", lh, idx, rh, idx, b"")
        t0 = time.perf_counter()
        state = p.transfer(handle, f"n{next(seq)}".encode())
        took = time.perf_counter() - t0
        # Both ends progress in turn (one process, no progress threads): the WRITE ends
        # and its notification arrives only while both are polled.
        seen = False
        deadline = time.monotonic() + 5
        while state not in ("DONE", "ERR") or not seen:
            if state not in ("DONE", "ERR"):
                state = p.check_xfer_state(handle)
            seen = seen or bool(d.get_new_notifs())
            if time.monotonic() > deadline:
                raise TimeoutError(f"WRITE {state}, notification seen: {seen}")
        p.release_xfer_handle(handle)
        return took

    def case(label: str, one: Callable[[], float], reps: int = args.reps) -> None:
        times = sorted(one() for _ in range(reps))
        p50, p90 = statistics.median(times), times[int(0.9 * len(times))]
        print(f"| {label} | {p50 * 1e6:.1f} | {p90 * 1e6:.1f} |", flush=True)

    def after_idle() -> float:
        time.sleep(0.002)
        return post()

    def after_idle_spun() -> float:
        time.sleep(0.002)
        until = time.perf_counter() + 200e-6
        while time.perf_counter() < until:
            pass
        return post()

    mailbox: queue.SimpleQueue[float] = queue.SimpleQueue()
    answers: queue.SimpleQueue[float] = queue.SimpleQueue()

    def writer_like() -> None:
        while mailbox.get() >= 0:
            answers.put(post())

    writer = threading.Thread(target=writer_like, daemon=True)
    writer.start()

    def woken() -> float:
        time.sleep(0.002)
        mailbox.put(0.0)
        return answers.get()

    thread = "progress thread on" if args.progress_thread else "no progress thread"
    print(f"{args.device}, {n} bytes, {thread}\n")
    print("| case | transfer p50 µs | p90 µs |\n|---|---|---|")
    case("tight", post)
    case("after idle (2 ms sleep)", after_idle)
    case("after idle, woken by a queue", woken)
    case("after idle, 200 µs spin first", after_idle_spun)
    mailbox.put(-1.0)
    stop = threading.Event()

    def wait_loop() -> None:
        while not stop.is_set():
            stop.wait(0.02)

    for _ in range(6):
        threading.Thread(target=wait_loop, daemon=True).start()
    case("beside 6 threads waiting with timeouts", post)
    stop.set()
    stop2 = threading.Event()

    def spin() -> None:
        x = 0
        while not stop2.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    case("beside a thread running Python", post, max(10, args.reps // 10))
    stop2.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
