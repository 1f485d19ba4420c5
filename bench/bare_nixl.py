"""Bare NIXL baselines: two processes, one WRITE with a notification, no pushactors in between.

    .venv/bin/python bench/bare_nixl.py [--device cuda] [--mib 512] [--descs 1,8192] [--reps 5]

Each of two spawned processes allocates its regions (one torch tensor each, on ``--device``,
as a KV cache has one tensor per layer), registers them with a NIXL agent
(:class:`pushactors.transport.nixl.NixlAgent`, UCX) and hands its metadata to the parent, which
passes it to the other process (both load each other). For a WRITE the
initiator prepares the two descriptor lists once (outside the timing), then per repetition
times ``make_prepped_xfer`` + ``transfer`` + polling ``check_xfer_state`` until DONE, with a
notification attached. The target polls its notifications, records when each one arrived
(``time.monotonic``, one clock for every process of a host) and answers each with a
notification of its own, which the initiator waits for before the next repetition: one WRITE
in flight at a time. The parent checks that every notification arrived.

:class:`BarePair` is what ``pushactors bench`` uses; run this file for a quick look.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

ACK = b"bare-ack"


@dataclass
class WriteTimes:
    """Per repetition, in seconds (warm-up repetitions dropped)."""

    post: list[float]  # make_prepped_xfer + transfer returned
    done: list[float]  # post → check_xfer_state DONE (initiator)
    seen: list[float]  # post → notification seen by the target (shared monotonic clock)
    notifs: int  # notifications the target saw, warm-up included
    # How long the initiator's first check_xfer_state call took (with ``check_after``: the one
    # made that long after the post, when the copy has ended and only its completion is left).
    # Only repetitions that made one: a post that returned DONE itself needed no check, and a 0
    # for it would read as a free check (``done_at_post`` counts those).
    first_check: list[float] = field(default_factory=list)
    done_at_post: int = 0
    # The post's two NIXL calls apart: make_prepped_xfer, then transfer (what the writer's
    # ``write.posted`` event reports as make_ms / transfer_ms, to compare in one run).
    make: list[float] = field(default_factory=list)
    transfer: list[float] = field(default_factory=list)


def _worker(name: str, sizes: list[int], device: str, conn: Connection) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import torch

        from pushactors.transport.nixl import NixlAgent

        if device == "cuda":
            torch.cuda.set_device(0)
        bufs = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
        dev_id = bufs[0].device.index or 0
        mem_type = "VRAM" if bufs[0].device.type == "cuda" else "DRAM"
        agent = NixlAgent(name)
        rows = np.array([[b.data_ptr(), b.numel(), dev_id] for b in bufs], dtype=np.uint64)
        agent.register_memory(rows, mem_type)
        conn.send(("ready", agent.get_agent_metadata(), [b.data_ptr() for b in bufs], dev_id, mem_type))
        _serve(agent, bufs, mem_type, conn)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


def _sync(buf: Any) -> None:
    if buf.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _serve(agent: Any, bufs: list[Any], mem_type: str, conn: Connection) -> None:
    peer = ""
    dlists: dict[str, tuple[Any, Any, int]] = {}
    while True:
        cmd = conn.recv()
        op = cmd[0]
        if op == "stop":
            conn.send(("stopped",))
            return
        if op == "peer":
            peer = agent.add_remote_agent(cmd[1])
            conn.send(("ok", peer))
        elif op == "prep":
            # (key, local rows, remote rows): rows are absolute (addr, len, dev) on each side.
            _, key, local_rows, remote_rows = cmd
            old = dlists.pop(key, None)
            if old is not None:
                agent.release_dlist_handle(old[0])
                agent.release_dlist_handle(old[1])
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, mem_type)
            rh = agent.prep_xfer_dlist(peer, remote_rows, mem_type)
            dlists[key] = (lh, rh, len(local_rows))
            conn.send(("ok", len(local_rows)))
        elif op == "write":
            _, key, reps, tag, check_after, ahead = cmd
            lh, rh, n = dlists[key]
            idx = np.arange(n, dtype=np.int32)
            out: list[tuple[float, float, float, float, float]] = []
            for i in range(reps):
                notif = f"{tag}:{i}".encode()
                if ahead:
                    # Made before the clock starts, its notification given at the post: what
                    # a push armed ahead does.
                    made = agent.make_prepped_xfer("WRITE", lh, idx, rh, idx, b"")
                t0 = time.monotonic()
                if ahead:
                    handle, tm = made, t0
                    state = agent.transfer(handle, notif)
                else:
                    handle = agent.make_prepped_xfer("WRITE", lh, idx, rh, idx, notif)
                    tm = time.monotonic()
                    state = agent.transfer(handle)
                t1 = time.monotonic()
                while check_after and time.monotonic() < t1 + check_after:
                    pass  # no NIXL call meanwhile: the copy runs on, unprogressed
                first = -1.0  # no check made: the post itself returned DONE (or ERR)
                if state not in ("DONE", "ERR"):
                    c0 = time.monotonic()
                    state = agent.check_xfer_state(handle)
                    first = time.monotonic() - c0
                while state not in ("DONE", "ERR"):
                    state = agent.check_xfer_state(handle)
                t2 = time.monotonic()
                agent.release_xfer_handle(handle)
                if state == "ERR":
                    raise RuntimeError(f"bare WRITE {notif!r} ended in ERR")
                _wait_ack(agent, peer, notif)
                out.append((t0, t1, t2, first, tm))
            conn.send(("written", out))
        elif op == "expect":
            # Target: answer "armed", then record the arrival of `count` notifications.
            _, count, tag, poll_s = cmd
            conn.send(("armed",))
            seen: dict[bytes, float] = {}
            prefix = f"{tag}:".encode()
            while len(seen) < count:
                notifs = agent.get_new_notifs()
                if not notifs and poll_s:
                    time.sleep(poll_s)
                for sender, msgs in notifs.items():
                    now = time.monotonic()
                    for m in msgs:
                        m = bytes(m)
                        if m.startswith(prefix):
                            seen[m] = now
                            agent.send_notif(sender, ACK + b":" + m)
            conn.send(("seen", {k.decode(): v for k, v in seen.items()}))
        elif op == "copy":
            import torch

            _, region, size, reps = cmd
            buf = bufs[region]
            src = buf[:size]
            dst = torch.empty_like(src)
            times = []
            for _ in range(reps):
                _sync(buf)
                t0 = time.monotonic()
                dst.copy_(src)
                _sync(buf)
                times.append(time.monotonic() - t0)
            del dst
            conn.send(("copied", times))
        else:
            raise ValueError(f"unknown command {op!r}")


def _wait_ack(agent: Any, peer: str, notif: bytes, timeout: float = 60.0) -> None:
    want = ACK + b":" + notif
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for msgs in agent.get_new_notifs().values():
            if any(bytes(m) == want for m in msgs):
                return
    raise TimeoutError(f"no answer from {peer} to {notif!r}")


class BarePair:
    """Two processes, each with the same registered regions (``sizes`` bytes, one allocation
    each) on ``device``."""

    def __init__(self, sizes: int | Sequence[int], device: str = "cpu", *, timeout: float = 180.0) -> None:
        ctx = mp.get_context("spawn")
        self.sizes = [sizes] if isinstance(sizes, int) else [int(n) for n in sizes]
        self.device = device
        self.timeout = timeout
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        info = []
        try:
            for name in ("bare-initiator", "bare-target"):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(name, self.sizes, device, child), name=name, daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            for conn in self._conns:
                info.append(self._expect(conn, "ready"))
            (_, md_p, p_ptrs, self.p_dev, _), (_, md_d, d_ptrs, self.d_dev, _) = info
            self.p_ptrs = np.array(p_ptrs, dtype=np.uint64)
            self.d_ptrs = np.array(d_ptrs, dtype=np.uint64)
            self._call(0, ("peer", md_d), "ok")
            self._call(1, ("peer", md_p), "ok")
        except BaseException:
            self.close()
            raise
        self._tags = 0

    def _expect(self, conn: Connection, kind: str) -> tuple[Any, ...]:
        if not conn.poll(self.timeout):
            raise TimeoutError(f"bare NIXL process did not answer {kind!r} in {self.timeout}s")
        event = conn.recv()
        if event[0] == "error":
            raise RuntimeError(f"bare NIXL process failed:\n{event[1]}")
        if event[0] != kind:
            raise RuntimeError(f"bare NIXL process answered {event[0]!r}, expected {kind!r}")
        return tuple(event)

    def _call(self, who: int, cmd: tuple[Any, ...], kind: str) -> tuple[Any, ...]:
        self._conns[who].send(cmd)
        return self._expect(self._conns[who], kind)

    def prep(
        self,
        key: str,
        src: np.ndarray,
        dst: np.ndarray,
        lengths: np.ndarray,
        *,
        src_region: np.ndarray | int = 0,
        dst_region: np.ndarray | int = 0,
    ) -> None:
        """Descriptor lists for ``key``: byte offsets into a region of the initiator and of the
        target, and lengths (one row per descriptor, in WRITE order)."""
        src, dst, lengths = (np.asarray(a, dtype=np.uint64) for a in (src, dst, lengths))
        sr = np.broadcast_to(np.asarray(src_region, dtype=np.int64), src.shape)
        dr = np.broadcast_to(np.asarray(dst_region, dtype=np.int64), dst.shape)
        limit = np.array(self.sizes, dtype=np.uint64)
        if bool(((src + lengths) > limit[sr]).any() or ((dst + lengths) > limit[dr]).any()):
            raise ValueError("descriptors reach past their region")
        local = np.stack([self.p_ptrs[sr] + src, lengths, np.full_like(src, self.p_dev)], axis=1)
        remote = np.stack([self.d_ptrs[dr] + dst, lengths, np.full_like(dst, self.d_dev)], axis=1)
        self._call(0, ("prep", key, local, remote), "ok")

    def write(
        self,
        key: str,
        reps: int,
        *,
        warmup: int = 1,
        poll_s: float = 0.0,
        check_after: float = 0.0,
        made_ahead: bool = False,
    ) -> WriteTimes:
        """``warmup + reps`` WRITEs of list ``key``, one at a time, each with a notification.
        ``check_after``: the initiator first asks NIXL about each WRITE that long after posting
        it (its first check's duration is in ``first_check``).

        The target checks for notifications every ``poll_s`` seconds (0: without pause). On a
        machine of few cores a target spinning on its notifications slows the copy itself
        (measured on the 2-core CI machine: 64 MiB over DRAM took about twice as long), so
        throughput runs poll the way a decode engine does, about every millisecond.
        ``made_ahead``: each WRITE is made before its clock starts and gets its notification
        at ``transfer`` (a push armed ahead): the post is ``transfer`` alone."""
        self._tags += 1
        tag = f"w{self._tags}"
        total = warmup + reps
        self._call(1, ("expect", total, tag, poll_s), "armed")
        _, rows = self._call(0, ("write", key, total, tag, check_after, made_ahead), "written")
        _, seen = self._expect(self._conns[1], "seen")
        if len(seen) != total:
            raise RuntimeError(f"target saw {len(seen)} of {total} notifications")
        rows = rows[warmup:]
        seen_at = [seen[f"{tag}:{i}"] for i in range(warmup, total)]
        return WriteTimes(
            post=[t1 - t0 for t0, t1, _, _, _ in rows],
            done=[t2 - t0 for t0, _, t2, _, _ in rows],
            seen=[s - t0 for (t0, _, _, _, _), s in zip(rows, seen_at, strict=True)],
            notifs=len(seen),
            first_check=[c for _, _, _, c, _ in rows if c >= 0],
            done_at_post=sum(1 for _, _, _, c, _ in rows if c < 0),
            make=[tm - t0 for t0, _, _, _, tm in rows],
            transfer=[t1 - tm for _, t1, _, _, tm in rows],
        )

    def copy(self, nbytes: int, reps: int, *, warmup: int = 1, region: int = 0) -> list[float]:
        """Seconds of a device copy (torch ``copy_``) of ``nbytes`` of ``region`` into a new
        tensor, inside the initiator."""
        _, times = self._call(0, ("copy", region, nbytes, warmup + reps), "copied")
        return list(times[warmup:])

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(("stop",))
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []

    def __enter__(self) -> BarePair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def even_descs(nbytes: int, descs: int, *, gap: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``descs`` descriptors of equal length covering ``nbytes`` (offsets, offsets, lengths)."""
    length = nbytes // descs
    off = np.arange(descs, dtype=np.uint64) * np.uint64(length + gap)
    return off, off.copy(), np.full(descs, length, dtype=np.uint64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--mib", type=int, default=512, help="bytes per WRITE, in MiB")
    ap.add_argument("--descs", default="1,8192", help="descriptor counts to try (equal lengths)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--poll", type=float, default=0.001, help="target's pause between notification checks, s")
    args = ap.parse_args()
    nbytes = args.mib << 20
    with BarePair(nbytes, args.device) as pair:
        for n in (int(x) for x in args.descs.split(",")):
            pair.prep(f"d{n}", *even_descs(nbytes, n))
            t = pair.write(f"d{n}", args.reps, poll_s=args.poll)
            done = statistics.median(t.done)
            print(
                f"{n:>7} descs: post→DONE {done * 1e3:8.2f} ms = {nbytes / done / 1e9:7.2f} GB/s; "
                f"post→notification {statistics.median(t.seen) * 1e3:8.2f} ms; "
                f"posting {statistics.median(t.post) * 1e3:.2f} ms"
            )
        copy = statistics.median(pair.copy(nbytes, args.reps))
        print(f"device copy: {copy * 1e3:.2f} ms = {nbytes / copy / 1e9:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
