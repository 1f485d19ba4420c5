"""Start and stop real vLLM OpenAI servers (and the router) for end-to-end tests and benches.

Servers run in their own process groups so a test can always tear down every process they
spawned (API server, engine core, workers). Nothing here imports vLLM: servers are started with
the Python of a vLLM environment, given as ``python``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The tiny model's KV on vLLM's CPU backend: blocks of 128 tokens, 2 layers, one layer's block
# 1 KV head × 128 tokens × (64 K + 64 V) × bf16.
TINY_BLOCK, TINY_LAYERS, TINY_BLOCK_BYTES = 128, 2, 32768


def vllm_python_or_skip() -> str:
    """The vLLM environment's python for a test module (``PUSHACTORS_VLLM_PYTHON``). Without
    it the module is skipped, or fails when ``PUSHACTORS_REQUIRE_VLLM`` is set (CI)."""
    python = os.environ.get("PUSHACTORS_VLLM_PYTHON")
    if python:
        return python
    if os.environ.get("PUSHACTORS_REQUIRE_VLLM"):
        raise RuntimeError("PUSHACTORS_REQUIRE_VLLM is set but PUSHACTORS_VLLM_PYTHON is not")
    import pytest

    pytest.skip(
        "set PUSHACTORS_VLLM_PYTHON to a vLLM environment's python (.ci/bootstrap-vllm)", allow_module_level=True
    )


PUSHACTORS_CONNECTOR = {
    "kv_connector": "PushActorsConnector",
    "kv_connector_module_path": "pushactors.integrations.vllm",
}


@dataclass
class ServerSpec:
    name: str
    port: int
    kv_transfer_config: dict[str, Any] | None = None
    cpu_bind: str = "0"
    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


class Process:
    """A child process in its own session, logged to a file, killed as a group."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        self.cmd, self.env = cmd, env
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._launch("wb")

    def _launch(self, mode: str) -> None:
        self._log = open(self.log_path, mode)  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a crash would: no shutdown hooks run anywhere."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def restart(self) -> None:
        """Run the same command again (same ports, same engine id); the log is appended to."""
        self.stop()
        self._launch("ab")

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # The group may hold children that outlived the leader (engine core, workers).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    url = ""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def affinity(self) -> list[ThreadAffinity]:
        """Every thread of every process this one started, with its CPU affinity."""
        return thread_affinities(group_pids(self.proc.pid)) if self.alive() else []

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class VllmServer(Process):
    def __init__(self, python: str, model_dir: str, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.url = f"http://127.0.0.1:{spec.port}"
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--port",
            str(spec.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--max-num-seqs",
            "8",
            *spec.args,
        ]
        if spec.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(spec.kv_transfer_config)]
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=spec.cpu_bind,
            NIXL_LOG_LEVEL="WARN",
            PYTHONUNBUFFERED="1",
        )
        env.update(spec.env)
        super().__init__(spec.name, cmd, log_dir / f"{spec.name}.log", env)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return str(resp.read().decode())


@dataclass(frozen=True)
class ThreadAffinity:
    """One thread of an engine process and the CPUs it may run on (``Cpus_allowed_list``)."""

    pid: int
    tid: int
    process: str  # the process's name (vLLM renames its engine core and workers)
    thread: str
    cpus: str


def _proc_field(status: str, name: str) -> str:
    for line in status.splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


def group_pids(pgid: int) -> list[int]:
    """Every live process of a process group (a server and the children vLLM spawns)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid:
                pids.append(int(entry.name))
        except (ProcessLookupError, PermissionError):
            continue
    return sorted(pids)


def thread_affinities(pids: list[int]) -> list[ThreadAffinity]:
    """Each thread's CPU affinity, read from ``/proc/<pid>/task/<tid>/status`` (threads that
    end meanwhile are left out)."""
    out = []
    for pid in pids:
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tids = sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for tid in tids:
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            out.append(
                ThreadAffinity(pid, tid, process, _proc_field(status, "Name"), _proc_field(status, "Cpus_allowed_list"))
            )
    return out


def affinity_summary(threads: list[ThreadAffinity]) -> dict[str, dict[str, list[str]]]:
    """Per process (``name[pid]``): CPU list -> the threads allowed exactly those CPUs."""
    out: dict[str, dict[str, list[str]]] = {}
    for t in threads:
        by_cpus = out.setdefault(f"{t.process}[{t.pid}]", {})
        label = t.thread + ("*" if t.tid == t.pid else "")  # * marks the process's main thread
        by_cpus.setdefault(t.cpus, []).append(label)
    return out


def wait_healthy(servers: list[Any], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                raise RuntimeError(f"{s.name} exited during start-up:\n{s.tail()}")
            if s.healthy():
                pending.remove(s)
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy after {timeout}s: {[s.name for s in pending]}\n{pending[0].tail()}")
            time.sleep(0.5)  # polling a child server's health endpoint until its deadline


class RouterProcess(Process):
    def __init__(self, args: list[str], port: int, log_dir: Path, name: str = "router") -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pushactors", "router", "--port", str(port), *args]
        super().__init__(name, cmd, log_dir / f"{name}.log", dict(os.environ))


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)$")
    for line in text.splitlines():
        m = pattern.match(line)
        if not m:
            continue
        lbl = m.group(1) or ""
        if all(f'{k}="{v}"' in lbl for k, v in labels.items()):
            total += float(m.group(2))
    return total


def build_tiny_model(python: str, out_dir: Path, seed: int = 0) -> Path:
    if (out_dir / "config.json").exists():
        return out_dir
    subprocess.run(
        [python, "-m", "pushactors.testing.tiny_model", str(out_dir), "--seed", str(seed)],
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    return out_dir
