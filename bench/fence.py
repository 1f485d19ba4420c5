"""Fencing over NIXL/UCX: can D cut off P's access to a region by deregistering it?

    pushactors bench fence [--device cpu|cuda] [--process-model auto|two-process|in-process]
                           [--sizes 1048576,67108864,536870912] [--reps 5] [--quick]
    python bench/fence.py  [same options]

A decode engine (D) that gives up on a push wants a *fence*: after it, a WRITE that the prefill
(P) posts late, with what it learned before (D's metadata as loaded, descriptor lists prepared
from it, a transfer handle made from those), must not change D's memory. The cheapest fence D
could raise alone is to deregister the region and register it again (a fresh registration; on
an RDMA NIC, a new memory key). This measures whether that works with NIXL's UCX backend, and
what it costs.

**Late WRITE** (``late_write``). Every variant runs in fresh processes (so a crash, or a
transport left in error, is the variant's own, and a crash is reported as ``crashed``). D
registers a region (``REGION`` bytes, zeroed); P loads D's metadata (``add_remote_agent``),
prepares both descriptor lists (one descriptor: the whole region) and WRITEs a first pattern,
which must land (``sanity``). Then D acts, without telling P:

* ``reregister``: ``deregister_memory`` then ``register_memory`` of the same buffer;
* ``deregister``: ``deregister_memory`` only;
* ``realloc``: deregister, free the buffer, allocate a new one of the same size and register it
  (``same_address`` says whether the allocator handed back the old address);

and P WRITEs a second pattern over the old descriptors, in one of three ways:

* ``old_xfer``: posts again the transfer handle it made for the first WRITE;
* ``new_xfer``: makes a new transfer from the descriptor lists prepared before;
* ``new_dlist``: prepares the remote descriptor list again, from D's metadata as first loaded,
  and makes a transfer from it.

``reregister:reloaded`` is the control: P reloads D's fresh metadata (``remove_remote_agent`` +
``add_remote_agent``) and prepares again, so that WRITE must land. For each variant: ``status``
of the late WRITE (``DONE``/``ERR`` as NIXL reports it; ``raised``: a NIXL call raised;
``timeout``: still in progress after ``WRITE_TIMEOUT`` s, or a process did not answer;
``crashed``: a process died), ``landed`` (every byte of D's region, the new buffer for
``realloc``, holds the late pattern after up to ``SETTLE_S`` s), ``landed_bytes``, ``error``,
and ``log``: lines of the processes' UCX log and stderr (NIXL's log) that mention an error, a
failure or a disconnection. The region is fenced only where ``landed`` is false.

**Costs** (medians of ``--reps``, after one untimed round): ``reregister_ms``: D's
``deregister_memory`` + ``register_memory`` of one region of each ``--sizes`` (allocated and
touched first); ``reload_ms``: D's ``get_agent_metadata`` after a re-registration, then P's
``remove_remote_agent`` + ``add_remote_agent`` of it + ``prep_xfer_dlist`` of ``DESCS``
descriptors into D's region (``total``), and apart from it the first WRITE after the reload
(the agents reconnect: ``remove_remote_agent`` disconnects them), whose bytes D checks.

P and D are two processes (``multiprocessing``, spawn) by default, as in a deployment;
``--process-model auto`` falls back to both agents in one (child) process when the two-process
sanity WRITE fails, and says so (``process_model``, ``fallback_reason``). With ``--device cuda``
the regions are VRAM (torch tensors) and P and D must be two processes (UCX's ``cuda_ipc``).
Agents are ``nixl_agent`` with the UCX backend and no progress thread, as pushactors makes them;
D's process polls its notifications while idle (progress for transports that need the target).
The UCX protocols that carried the WRITEs come from ``UCX_PROTO_INFO=y`` (UCX's log of the
processes, ``UCX_LOG_FILE``), unless ``UCX_PROTO_INFO`` or ``UCX_LOG_FILE`` is set already.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

ACTIONS = ("reregister", "deregister", "realloc")
METHODS = ("old_xfer", "new_xfer", "new_dlist")
CONTROL = "reregister:reloaded"
VARIANTS = (*(f"{a}:{m}" for a in ACTIONS for m in METHODS), CONTROL)
STATUSES = ("DONE", "ERR", "raised", "timeout", "crashed", "not_run")
PROCESS_MODELS = ("auto", "two-process", "in-process")
MIB = 1 << 20
SIZES = (1 * MIB, 64 * MIB, 512 * MIB)
QUICK_SIZES = (1 * MIB, 16 * MIB)
REPS = 5
QUICK_REPS = 3
REGION = 1 * MIB  # D's region in the late-write variants and the reload cost
DESCS = 256  # descriptors of the re-prepared list (REGION / DESCS bytes each)
SANITY = 0x11  # the first WRITE's byte
LATE = 0xA5  # the late WRITE's byte
WRITE_TIMEOUT = 10.0  # a WRITE still in progress after this is "timeout"
SETTLE_S = 0.2  # how long D waits for the bytes of a WRITE reported DONE
ANSWER_TIMEOUT = 120.0  # a process that does not answer a command in this is "timeout"
_clock = time.perf_counter


# ------------------------------------------------------------------------------------------------
# Buffers: numpy arrays in DRAM, torch tensors in VRAM
# ------------------------------------------------------------------------------------------------
class Memory:
    """Allocation, addresses and byte checks of one device's buffers (uint8)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.mem_type = "VRAM" if device == "cuda" else "DRAM"
        self.dev_id = 0
        if device == "cuda":
            import torch

            torch.cuda.set_device(0)
            self.dev_id = torch.cuda.current_device()

    def alloc(self, nbytes: int, value: int) -> Any:
        if self.device == "cuda":
            import torch

            buf = torch.full((nbytes,), value, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            return buf
        return np.full(nbytes, value, dtype=np.uint8)  # written: every page touched

    def addr(self, buf: Any) -> int:
        return int(buf.data_ptr()) if self.device == "cuda" else int(buf.ctypes.data)

    def fill(self, buf: Any, value: int) -> None:
        if self.device == "cuda":
            buf.fill_(value)
        else:
            buf.fill(value)
        self.sync()

    def count(self, buf: Any, value: int) -> int:
        if self.device == "cuda":
            self.sync()
            return int((buf == value).sum().item())
        return int(np.count_nonzero(buf == value))

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def release(self) -> None:
        """Give freed memory back (torch's caching allocator keeps it otherwise)."""
        gc.collect()
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def rows(self, addr: int, nbytes: int, descs: int = 1) -> np.ndarray:
        """``descs`` equal descriptors over ``nbytes`` from ``addr``: an Nx3 (addr, len, dev) array."""
        length = nbytes // descs
        starts = addr + np.arange(descs, dtype=np.uint64) * np.uint64(length)
        return np.stack(
            [starts, np.full(descs, length, dtype=np.uint64), np.full(descs, self.dev_id, dtype=np.uint64)], axis=1
        ).astype(np.uint64)


def _make_agent(name: str) -> Any:
    from pushactors.transport.nixl import import_nixl_api

    api = import_nixl_api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError(f"NIXL has no UCX backend here (have {list(agent.backends)})")
    return agent


def _median_ms(values: Sequence[float]) -> float:
    return round(statistics.median(values) * 1e3, 4)


# ------------------------------------------------------------------------------------------------
# D: the region's owner
# ------------------------------------------------------------------------------------------------
class DSide:
    def __init__(self, device: str, size: int) -> None:
        self.mem = Memory(device)
        self.agent = _make_agent("fence-D")
        self.size = size
        self.buf: Any = self.mem.alloc(size, 0)
        self.reg: Any = self._register(self.buf)

    def _register(self, buf: Any) -> Any:
        return self.agent.register_memory(self.mem.rows(self.mem.addr(buf), self.size), self.mem.mem_type)

    def info(self) -> dict[str, Any]:
        return {
            "md": self.agent.get_agent_metadata(),
            "addr": self.mem.addr(self.buf),
            "dev": self.mem.dev_id,
            "mem_type": self.mem.mem_type,
        }

    def progress(self) -> None:
        self.agent.get_new_notifs()

    def act(self, action: str) -> dict[str, Any]:
        """Deregister (and re-register, or reallocate) the region, telling P nothing."""
        old = self.mem.addr(self.buf)
        self.agent.deregister_memory(self.reg)
        self.reg = None
        if action == "reregister":
            self.reg = self._register(self.buf)
        elif action == "realloc":
            self.buf = None
            self.mem.release()
            self.buf = self.mem.alloc(self.size, 0)
            self.reg = self._register(self.buf)
        elif action != "deregister":
            raise ValueError(f"unknown action {action!r}")
        new = self.mem.addr(self.buf)
        return {"old_addr": old, "new_addr": new, "same_address": old == new, **self.info()}

    def check(self, value: int, settle_s: float = SETTLE_S) -> int:
        """Bytes of the region holding ``value``, waiting up to ``settle_s`` for all of them."""
        deadline = _clock() + settle_s
        while True:
            n = self.mem.count(self.buf, value)
            if n == self.size or _clock() >= deadline:
                return n
            self.progress()
            time.sleep(0.001)

    def cost_reregister(self, sizes: list[int], reps: int) -> dict[str, dict[str, float]]:
        """Per size: deregister + register of one region, medians over ``reps`` (one untimed first)."""
        out: dict[str, dict[str, float]] = {}
        for size in sizes:
            buf = self.mem.alloc(size, 1)
            rows = self.mem.rows(self.mem.addr(buf), size)
            reg = self.agent.register_memory(rows, self.mem.mem_type)
            dereg_s, reg_s, total_s = [], [], []
            for i in range(reps + 1):
                t0 = _clock()
                self.agent.deregister_memory(reg)
                t1 = _clock()
                reg = self.agent.register_memory(rows, self.mem.mem_type)
                t2 = _clock()
                if i:
                    dereg_s.append(t1 - t0)
                    reg_s.append(t2 - t1)
                    total_s.append(t2 - t0)
            self.agent.deregister_memory(reg)
            del buf, reg
            self.mem.release()
            out[str(size)] = {
                "deregister_ms": _median_ms(dereg_s),
                "register_ms": _median_ms(reg_s),
                "total_ms": _median_ms(total_s),
            }
        return out

    def reregister_and_metadata(self) -> tuple[bytes, float]:
        """Re-register the region (untimed), then time ``get_agent_metadata``."""
        self.agent.deregister_memory(self.reg)
        self.reg = self._register(self.buf)
        t0 = _clock()
        md = self.agent.get_agent_metadata()
        return md, _clock() - t0


# ------------------------------------------------------------------------------------------------
# P: the writer
# ------------------------------------------------------------------------------------------------
class PSide:
    def __init__(self, device: str, size: int) -> None:
        self.mem = Memory(device)
        self.agent = _make_agent("fence-P")
        self.size = size
        self.src = self.mem.alloc(size, 0)
        self.agent.register_memory(self.mem.rows(self.mem.addr(self.src), size), self.mem.mem_type)
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.mem.rows(self.mem.addr(self.src), size), self.mem.mem_type
        )
        self.progress_peer: Callable[[], None] | None = None  # D's progress, when both share this process
        self.peer = ""
        self.remote_rows: np.ndarray | None = None
        self.remote: Any = None
        self.handle: Any = None  # the first WRITE's transfer, kept to post again
        self.local_n: Any = None
        self.remote_n: Any = None

    def load(self, md: bytes, addr: int, dev: int) -> str:
        self.peer = self.agent.add_remote_agent(md)
        self.remote_rows = self.mem.rows(addr, self.size)
        self.remote_rows[:, 2] = dev
        self.remote = self.agent.prep_xfer_dlist(self.peer, self.remote_rows, self.mem.mem_type)
        return str(self.peer)

    def reload(self, md: bytes, addr: int, dev: int) -> str:
        """Forget D's metadata and load its fresh one; prepare the remote list again."""
        self.agent.remove_remote_agent(self.peer)
        return self.load(md, addr, dev)

    def _wait(self, handle: Any, state: str, timeout: float) -> str:
        deadline = _clock() + timeout
        while state == "PROC":
            if _clock() >= deadline:
                return "timeout"
            if self.progress_peer is not None:
                self.progress_peer()
            state = self.agent.check_xfer_state(handle)
        return state

    def write(self, method: str, value: int, timeout: float = WRITE_TIMEOUT) -> dict[str, Any]:
        """WRITE ``value`` over D's whole region; ``method`` picks the transfer (module doc)."""
        self.mem.fill(self.src, value)
        stage = "make"
        handle = None
        t0 = _clock()
        try:
            if method == "sanity":
                handle = self.handle = self.agent.make_prepped_xfer("WRITE", self.local, [0], self.remote, [0])
            elif method == "old_xfer":
                handle = self.handle
            elif method == "new_xfer":
                handle = self.agent.make_prepped_xfer("WRITE", self.local, [0], self.remote, [0])
            elif method == "new_dlist":
                stage = "prep"
                remote = self.agent.prep_xfer_dlist(self.peer, self.remote_rows, self.mem.mem_type)
                stage = "make"
                handle = self.agent.make_prepped_xfer("WRITE", self.local, [0], remote, [0])
            else:
                raise ValueError(f"unknown method {method!r}")
            stage = "post"
            state = self.agent.transfer(handle)
            stage = "poll"
            state = self._wait(handle, state, timeout)
        except Exception as exc:
            return {"status": "raised", "error": f"{stage}: {type(exc).__name__}: {exc}", "ms": None}
        ms = round((_clock() - t0) * 1e3, 3)
        error = None
        if state == "ERR":
            error = f"{'post' if stage == 'post' else 'check_xfer_state'} reported ERR"
        elif state == "timeout":
            error = f"still in progress after {timeout} s"
        return {"status": state, "error": error, "ms": ms}

    def timed_reload(self, md: bytes, addr: int, dev: int, descs: int, value: int) -> dict[str, float | str]:
        """Reload D's metadata, prepare ``descs`` descriptors over its region, then one WRITE."""
        t0 = _clock()
        self.agent.remove_remote_agent(self.peer)
        t1 = _clock()
        self.peer = self.agent.add_remote_agent(md)
        t2 = _clock()
        if self.remote_n is not None:
            self.agent.release_dlist_handle(self.remote_n)
        rows = self.mem.rows(addr, self.size, descs)
        rows[:, 2] = dev
        self.remote_n = self.agent.prep_xfer_dlist(self.peer, rows, self.mem.mem_type)
        t3 = _clock()
        if self.local_n is None:
            self.local_n = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self.mem.rows(self.mem.addr(self.src), self.size, descs), self.mem.mem_type
            )
        self.mem.fill(self.src, value)
        idx = np.arange(descs, dtype=np.int32)
        t4 = _clock()
        handle = self.agent.make_prepped_xfer("WRITE", self.local_n, idx, self.remote_n, idx)
        state = self._wait(handle, self.agent.transfer(handle), WRITE_TIMEOUT)
        t5 = _clock()
        self.agent.release_xfer_handle(handle)
        return {
            "remove_s": t1 - t0,
            "add_s": t2 - t1,
            "prep_s": t3 - t2,
            "write_s": t5 - t4,
            "state": state,
        }


# ------------------------------------------------------------------------------------------------
# The processes: each serves commands for its sides (D, P, or both) over a pipe
# ------------------------------------------------------------------------------------------------
def _serve(roles: tuple[str, ...], device: str, size: int, log_path: str, conn: Connection) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if log_path and "UCX_PROTO_INFO" not in os.environ and "UCX_LOG_FILE" not in os.environ:
        os.environ["UCX_PROTO_INFO"] = "y"
        os.environ["UCX_LOG_FILE"] = log_path
    if log_path:  # NIXL's own log (and a crash's traceback) goes to stderr: keep it beside UCX's
        sys.stderr.flush()
        fd = os.open(log_path.replace("ucx-", "stderr-"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.enable()  # a segfault leaves the Python stack in that log
    try:
        sides: dict[str, Any] = {}
        for role in roles:
            sides[role] = DSide(device, size) if role == "D" else PSide(device, size)
        d = sides.get("D")
        if d is not None and "P" in sides:
            sides["P"].progress_peer = d.progress
        conn.send(("ready", sides["D"].info() if d is not None else {}))
        while True:
            if d is not None:
                while not conn.poll(0.001):
                    d.progress()
            cmd = conn.recv()
            if cmd[0] == "stop":
                conn.send(("stopped", None))
                return
            role, op, args = cmd
            try:
                conn.send(("ok", getattr(sides[role], op)(*args)))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))


class Crashed(RuntimeError):
    """A process died: ``role``'s."""

    def __init__(self, role: str, text: str) -> None:
        super().__init__(text)
        self.role = role


class Hung(RuntimeError):
    """A process did not answer in time."""


class Pair:
    """D and P, in two processes or in one, on ``device``."""

    def __init__(self, model: str, device: str, size: int, logdir: Path, *, timeout: float = ANSWER_TIMEOUT) -> None:
        if model not in ("two-process", "in-process"):
            raise ValueError(f"process model {model!r}")
        if device == "cuda" and model != "two-process":
            raise ValueError("VRAM needs P and D in two processes (UCX cuda_ipc)")
        ctx = mp.get_context("spawn")
        self.timeout = timeout
        self.logdir = logdir
        self._conns: dict[str, Connection] = {}
        self._procs: dict[str, Any] = {}
        groups = [("D",), ("P",)] if model == "two-process" else [("D", "P")]
        try:
            for roles in groups:
                label = "+".join(roles)
                parent, child = ctx.Pipe()
                log = str(logdir / f"ucx-{label}.log")
                proc = ctx.Process(
                    target=_serve, args=(roles, device, size, log, child), name=f"fence-{label}", daemon=True
                )
                proc.start()
                child.close()
                for role in roles:
                    self._conns[role] = parent
                    self._procs[role] = proc
            self.d_info: dict[str, Any] = self._answer("D", "start")
            if model == "two-process":
                self._answer("P", "start")
        except BaseException:
            self.close()
            raise

    def _answer(self, role: str, what: str) -> Any:
        conn, proc = self._conns[role], self._procs[role]
        if not conn.poll(self.timeout):
            raise Hung(f"{role} did not answer {what!r} in {self.timeout:g} s")
        try:
            event = conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            proc.join(5)
            raise Crashed(role, f"{role}'s process died (exit code {proc.exitcode}) during {what!r}") from None
        if event[0] == "error":
            raise RuntimeError(event[1])
        return event[1]

    def call(self, role: str, op: str, *args: Any) -> Any:
        try:
            self._conns[role].send((role, op, args))
        except (BrokenPipeError, OSError):
            proc = self._procs[role]
            proc.join(5)
            raise Crashed(role, f"{role}'s process died (exit code {proc.exitcode}) before {op!r}") from None
        return self._answer(role, op)

    def close(self) -> None:
        for conn in set(self._conns.values()):
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(("stop",))
        for proc in set(self._procs.values()):
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in set(self._conns.values()):
            conn.close()
        self._conns, self._procs = {}, {}

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------
# The experiments
# ------------------------------------------------------------------------------------------------
def late_write(model: str, device: str, variant: str, logdir: Path) -> dict[str, Any]:
    """One variant in fresh processes: sanity WRITE, D's action, the late WRITE."""
    action, method = variant.split(":")
    logdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"status": "not_run", "landed": False, "landed_bytes": 0, "error": None}
    out["sanity"] = {"status": "not_run", "landed": False}
    step = "start"
    try:
        with Pair(model, device, REGION, logdir) as pair:
            d = pair.d_info
            step = "load"
            pair.call("P", "load", d["md"], d["addr"], d["dev"])
            step = "sanity"
            sanity = pair.call("P", "write", "sanity", SANITY)
            sanity_bytes = pair.call("D", "check", SANITY)
            out["sanity"] = {"status": sanity["status"], "landed": sanity_bytes == REGION, "error": sanity["error"]}
            step = action
            acted = pair.call("D", "act", action)
            if action == "realloc":
                out["same_address"] = acted["same_address"]
            if method == "reloaded":
                step = "reload"
                pair.call("P", "reload", acted["md"], acted["new_addr"], acted["dev"])
                method = "new_xfer"
            step = f"late WRITE ({method})"
            late = pair.call("P", "write", method, LATE)
            out.update(status=late["status"], error=late["error"], ms=late["ms"])
            step = "check"
            landed = pair.call("D", "check", LATE)
            out.update(landed=landed == REGION, landed_bytes=landed)
    except (Crashed, Hung, Exception) as exc:
        # After the late WRITE answered (step "check"), its status stays and this is added to it.
        text = f"{step}: {exc}" if isinstance(exc, (Crashed, Hung)) else f"{step}: {type(exc).__name__}: {exc}"
        if isinstance(exc, Crashed):
            out["crashed"] = exc.role
        if out["status"] == "not_run":
            out["status"] = "crashed" if isinstance(exc, Crashed) else "timeout" if isinstance(exc, Hung) else "raised"
        out["error"] = f"{out['error']}; then {text}" if out["error"] else text
    log = log_errors(logdir)
    if log:
        out["log"] = log
    return out


def costs(model: str, device: str, sizes: list[int], reps: int, logdir: Path) -> dict[str, Any]:
    """Re-registration per size, and P's reload of D's fresh metadata with ``DESCS`` descriptors."""
    logdir.mkdir(parents=True, exist_ok=True)
    with Pair(model, device, REGION, logdir) as pair:
        rereg = pair.call("D", "cost_reregister", sizes, reps)
        d = pair.d_info
        pair.call("P", "load", d["md"], d["addr"], d["dev"])
        rows: list[dict[str, Any]] = []
        landed = 0
        for i in range(reps + 1):
            value = 1 + i % 250
            md, md_s = pair.call("D", "reregister_and_metadata")
            r = pair.call("P", "timed_reload", md, d["addr"], d["dev"], DESCS, value)
            ok = r["state"] == "DONE" and pair.call("D", "check", value) == REGION
            landed += ok
            if i:
                rows.append({**r, "md_s": md_s, "md_bytes": len(md)})
    totals = [r["md_s"] + r["remove_s"] + r["add_s"] + r["prep_s"] for r in rows]
    return {
        "reregister": rereg,
        "reload": {
            "total_ms": _median_ms(totals),
            "get_agent_metadata_ms": _median_ms([r["md_s"] for r in rows]),
            "remove_remote_agent_ms": _median_ms([r["remove_s"] for r in rows]),
            "add_remote_agent_ms": _median_ms([r["add_s"] for r in rows]),
            f"prep_{DESCS}_descs_ms": _median_ms([r["prep_s"] for r in rows]),
            "first_write_after_reload_ms": _median_ms([r["write_s"] for r in rows]),
            "first_write_bytes": REGION,
            "writes_landed": f"{landed}/{reps + 1}",
            "metadata_bytes": rows[0]["md_bytes"] if rows else None,
            "descs": DESCS,
        },
    }


# ------------------------------------------------------------------------------------------------
# UCX's log: the protocols chosen for WRITEs, and error lines
# ------------------------------------------------------------------------------------------------
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s?")


def _log_lines(logdir: Path) -> list[str]:
    lines: list[str] = []
    for path in sorted([*logdir.rglob("ucx-*.log*"), *logdir.rglob("stderr-*.log")]):
        with contextlib.suppress(OSError):
            lines += [_LOG_PREFIX.sub("", x).rstrip() for x in path.read_text(errors="replace").splitlines()]
    return lines


def put_protocols(logdir: Path) -> list[str]:
    """``UCX_PROTO_INFO`` tables of remote memory writes: "<title>: <range> <description> <config>"."""
    found: list[str] = []
    titles: list[str] = []
    in_rows = False
    for line in _log_lines(logdir):
        s = line.strip()
        if not s.startswith("|"):
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if len(cells) == 1:
            if in_rows:
                titles, in_rows = [], False
            titles.append(cells[0])
        elif cells[0] == "Range":
            in_rows = True
        elif in_rows and any("remote memory write" in t for t in titles):
            found.append(f"{' / '.join(titles)}: {' '.join(cells)}")
    return list(dict.fromkeys(found))


def log_errors(logdir: Path, limit: int = 6) -> list[str]:
    """Lines of the processes' UCX log and stderr (NIXL's log) that mention an error, a failure or
    a disconnection (not UCX's protocol tables)."""
    hits = [
        x
        for x in _log_lines(logdir)
        if not x.lstrip().startswith(("|", "+")) and re.search(r"error|fail|disconnect|fault", x, re.I)
    ]
    return list(dict.fromkeys(hits))[:limit]


# ------------------------------------------------------------------------------------------------
# The suite
# ------------------------------------------------------------------------------------------------
def nixl_version() -> str | None:
    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return None


def _note(args: argparse.Namespace, text: str) -> None:
    if getattr(args, "progress", True):
        print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def parse_sizes(value: Any, quick: bool) -> list[int]:
    if value is None:
        return list(QUICK_SIZES if quick else SIZES)
    parts = value.split(",") if isinstance(value, str) else list(value)
    items = [int(x) for x in parts if str(x).strip()]
    if not items or min(items) < 1:
        raise ValueError(f"--sizes must be positive byte counts, not {value!r}")
    return items


def _label(size: int) -> str:
    return f"{size // MIB}MiB" if size % MIB == 0 else f"{size}B"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every late-write variant, then the costs; the result as written to JSON."""
    device = getattr(args, "device", None) or "cpu"
    quick = bool(getattr(args, "quick", False))
    requested = getattr(args, "process_model", None) or "auto"
    if requested not in PROCESS_MODELS:
        raise ValueError(f"--process-model must be one of {PROCESS_MODELS}, not {requested!r}")
    if device == "cuda" and requested == "in-process":
        raise ValueError("--device cuda needs --process-model two-process (or auto): VRAM goes over UCX cuda_ipc")
    sizes = parse_sizes(getattr(args, "sizes", None), quick)
    reps = getattr(args, "reps", None) or (QUICK_REPS if quick else REPS)
    started = time.monotonic()
    model = "two-process" if requested in ("auto", "two-process") else "in-process"
    fallback_reason = None
    with tempfile.TemporaryDirectory(prefix="fence-") as tmp:
        root = Path(tmp)
        late: dict[str, dict[str, Any]] = {}
        for variant in VARIANTS:
            _note(args, f"late WRITE {variant} ({model})")
            late[variant] = late_write(model, device, variant, root / model / variant.replace(":", "-"))
            if (
                requested == "auto"
                and model == "two-process"
                and device != "cuda"
                and not late[variant]["sanity"]["landed"]
            ):
                fallback_reason = f"two-process sanity WRITE of {variant} failed: {late[variant]}"
                model = "in-process"
                _note(args, f"falling back to in-process: {fallback_reason}")
                late = {}
                break
        if fallback_reason is not None:
            for variant in VARIANTS:
                _note(args, f"late WRITE {variant} ({model})")
                late[variant] = late_write(model, device, variant, root / model / variant.replace(":", "-"))
        _note(args, f"costs: re-registration of {', '.join(_label(s) for s in sizes)}; reload ({reps} reps)")
        cost = costs(model, device, sizes, reps, root / model / "costs")
        protocols = put_protocols(root / model)
    not_landed = [v for v, r in late.items() if v != CONTROL and not r["landed"]]
    return {
        "suite": "fence",
        "device": device,
        "memory": "VRAM" if device == "cuda" else "DRAM",
        "process_model": model,
        "process_model_requested": requested,
        "fallback_reason": fallback_reason,
        "region_bytes": REGION,
        "late_write": late,
        "not_landed_variants": not_landed,
        "landed_variants": [v for v, r in late.items() if v != CONTROL and r["landed"]],
        "reregister_ms": {_label(int(s)): v["total_ms"] for s, v in cost["reregister"].items()},
        "reregister_detail_ms": {_label(int(s)): v for s, v in cost["reregister"].items()},
        "reload_ms": cost["reload"],
        "reps": reps,
        "nixl": nixl_version(),
        "ucx": {
            "UCX_TLS": os.environ.get("UCX_TLS", "default"),
            "put_protocols": protocols,
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "ptrace_scope": _read("/proc/sys/kernel/yama/ptrace_scope"),
        },
        "seconds": round(time.monotonic() - started, 2),
    }


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def render(result: dict[str, Any]) -> str:
    head = (
        f"fencing by re-registration, {result['memory']} ({result['process_model']}; {result['nixl']}; "
        f"UCX_TLS {result['ucx']['UCX_TLS']})"
    )
    lines = ["| variant | sanity | late WRITE | landed | error |", "|---|---|---|---|---|"]
    for variant, r in result["late_write"].items():
        sanity = f"{r['sanity']['status']}{'' if r['sanity']['landed'] else ' (not landed)'}"
        landed = "yes" if r["landed"] else f"no ({r['landed_bytes']} B)"
        if "same_address" in r:
            landed += f"; same address: {r['same_address']}"
        lines.append(f"| {variant} | {sanity} | {r['status']} | {landed} | {r['error'] or ''} |")
    cost = ", ".join(f"{k}: {v:.3f} ms" for k, v in result["reregister_ms"].items())
    reload = result["reload_ms"]
    tail = [
        f"deregister + register: {cost}",
        f"reload (get_agent_metadata + remove + add + prep {reload['descs']} descs): {reload['total_ms']:.3f} ms; "
        f"first WRITE after it: {reload['first_write_after_reload_ms']:.3f} ms ({reload['writes_landed']} landed)",
        "WRITE protocols: " + ("; ".join(result["ucx"]["put_protocols"]) or "not found"),
    ]
    return head + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(tail)


def json_path(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "json", None) or "runs/bench/fence.json")


def cli(args: argparse.Namespace) -> int:
    """Measure, print the table, write the JSON."""
    try:
        result = run(args)
    except ValueError as exc:
        print(f"pushactors bench fence: {exc}", file=sys.stderr)
        return 2
    result["args"] = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list, type(None)))}
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    path = json_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(render(result))
    print(f"\nJSON: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench/fence.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="DRAM (cpu) or VRAM (cuda)")
    ap.add_argument("--process-model", default="auto", choices=PROCESS_MODELS, help="P and D in two processes or one")
    ap.add_argument("--sizes", default=None, help="regions re-registered, bytes (1 MiB, 64 MiB, 512 MiB)")
    ap.add_argument("--reps", type=int, default=None, help=f"timed repetitions of each cost ({REPS})")
    ap.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, {QUICK_REPS} repetitions")
    ap.add_argument("--json", default=None, help="where to write the results (runs/bench/fence.json)")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no lines on stderr")
    return cli(ap.parse_args(argv))


if __name__ == "__main__":
    # Run as a file: make the spawned processes find this module as ``fence``.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
