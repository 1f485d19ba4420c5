"""Run Ray Serve LLM's prefill/decode app with ``PushActorsConnector`` on a local Ray cluster.

    python -m pushactors.testing.ray_serve_app --model DIR --http-port N --control-port M --logs DIR

Run it with the Python of a vLLM environment that has Ray Serve LLM (``.venv-vllm``). It starts
a local Ray instance (logical CPUs only: each engine's deployment asks a ``{"CPU": 2}``
bundle), registers pushactors' backend (:mod:`pushactors.integrations.ray_serve`), and deploys
Ray's own P/D app (``build_pd_openai_app``: ingress -> decode orchestrator -> prefill) with one
P and one D replica of a local model, CPU KV cache, and each connector logging JSON lines under
``--logs``. OpenAI requests go to ``http://127.0.0.1:<http-port>/v1/...``.

A small JSON control server on ``--control-port`` lets a test (in another Python) steer it:

- ``GET /status``: ``phase`` (``starting``, ``running``, ``failed``, ``stopping``), the app's
  and deployments' status, and the ALIVE replica actors of P and D (name, pid, node).
- ``GET /metadata``: the replica metadata of the P replica (what Serve hands the orchestrator).
- ``POST /reference`` ``{"bodies": [...]}``: the completions computed by D's engine alone (its
  replica's ``_run_request``: no orchestration, no remote prefill), in order.
- ``POST /freeze`` ``{"role": "prefill"}``: SIGSTOP the replica's engine processes (its
  children): requests in flight on it stay there.
- ``POST /kill`` ``{"role": "prefill"}``: ``ray.kill`` the replica actor (Serve then starts a new
  one); its engine processes are killed too if they outlive it (the answer says which).
- ``POST /shutdown``: ``serve.shutdown()`` and ``ray.shutdown()``, then the process exits (as on
  SIGTERM).

Every step is logged to stdout with its time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

APP = "pd"
ROLES = {"prefill": "Prefill:", "decode": "Decode:"}


def _mod(name: str) -> Any:
    """Ray and psutil come with the vLLM environment this runs in, not with pushactors."""
    return importlib.import_module(name)


def log(msg: str, **fields: Any) -> None:
    extra = " ".join(f"{k}={v}" for k, v in fields.items())
    print(f"[ray_serve_app {time.time():.3f}] {msg} {extra}".rstrip(), flush=True)


def llm_config(args: argparse.Namespace, role: str) -> dict[str, Any]:
    from pushactors.integrations.ray_serve import kv_transfer_config

    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    extra: dict[str, Any] = {
        "log_json": os.path.join(args.logs, f"{role}.jsonl"),
        "handshake_timeout": args.handshake_timeout,
        "registration_timeout": args.registration_timeout,
    }
    if args.lease_duration:
        extra["lease_duration"] = args.lease_duration
    return {
        "model_loading_config": {"model_id": args.model_id, "model_source": args.model},
        "accelerator_config": {"kind": "cpu"},
        "deployment_config": {"num_replicas": 1},
        "engine_kwargs": {
            "dtype": "bfloat16",
            "max_model_len": 1024,
            "enforce_eager": True,
            "max_num_seqs": 8,
            "kv_transfer_config": kv_transfer_config(kv_role, kv_buffer_device="cpu", **extra),
        },
        "runtime_env": {
            "env_vars": {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "0" if role == "prefill" else "1",
                "NIXL_LOG_LEVEL": "WARN",
                "PYTHONUNBUFFERED": "1",
            }
        },
    }


class App:
    """The Ray cluster, the Serve app and what the control server asks of them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.phase = "starting"
        self.error: str | None = None
        self.stopped = threading.Event()
        self.ray_ready = threading.Event()
        self._stop_lock = threading.Lock()
        self.deployments: dict[str, str] = {}  # role -> deployment name
        self.registered: list[bool] = []  # what each register_backend() call returned

    # --- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        ray, serve = _mod("ray"), _mod("ray.serve")

        from pushactors.integrations.ray_serve import build_pd_app, register_backend

        t0 = time.monotonic()
        ray.init(
            num_cpus=self.args.num_cpus,
            include_dashboard=False,
            object_store_memory=self.args.object_store_mb * 1024 * 1024,
        )
        self.ray_ready.set()
        log("ray.init", s=f"{time.monotonic() - t0:.1f}", resources=json.dumps(ray.cluster_resources()))
        # Registered for the whole cluster; again (idempotent), and once more by build_pd_app.
        self.registered = [register_backend(), register_backend()]
        serve.start(http_options={"host": "127.0.0.1", "port": self.args.http_port})
        app = build_pd_app(llm_config(self.args, "prefill"), llm_config(self.args, "decode"))
        t1 = time.monotonic()
        serve.run(app, name=APP, route_prefix="/")
        for name in serve.status().applications[APP].deployments:
            for role, prefix in ROLES.items():
                if name.startswith(prefix):
                    self.deployments[role] = name
        self.phase = "running"
        log("serve.run", s=f"{time.monotonic() - t1:.1f}", total_s=f"{time.monotonic() - t0:.1f}")

    # --- queries -------------------------------------------------------------------------------
    def replicas(self, role: str | None = None) -> list[dict[str, Any]]:
        state = _mod("ray._private.state")

        out = []
        for info in state.actors().values():
            cls = str(info.get("ActorClassName") or "")
            if info.get("State") != "ALIVE" or not cls.startswith(f"ServeReplica:{APP}:"):
                continue
            deployment = cls.split(":", 2)[2]
            r = next((k for k, v in self.deployments.items() if v == deployment), None)
            if r is None:
                r = next((k for k, p in ROLES.items() if deployment.startswith(p)), "ingress")
            if role is None or r == role:
                out.append(
                    {
                        "role": r,
                        "deployment": deployment,
                        "name": info.get("Name"),
                        "pid": info.get("Pid"),
                        "node_ip": (info.get("Address") or {}).get("IPAddress"),
                    }
                )
        return out

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"phase": self.phase, "error": self.error, "registered": self.registered}
        # Only once ray.init() returned: a Ray call before it would start a second Ray instance.
        if self.ray_ready.is_set() and self.phase in ("starting", "running"):
            try:
                st = _mod("ray.serve").status().applications.get(APP)
                if st is not None:
                    out["app"] = str(st.status)
                    out["deployments"] = {
                        name: {"status": str(d.status), "replicas": {str(k): v for k, v in d.replica_states.items()}}
                        for name, d in st.deployments.items()
                    }
                out["replicas"] = self.replicas()
            except Exception as exc:  # the cluster is still coming up
                out["status_error"] = repr(exc)
        return out

    def handle(self, role: str) -> Any:
        return _mod("ray.serve").get_deployment_handle(self.deployments[role], app_name=APP)

    def metadata(self) -> dict[str, Any]:
        return dict(self.handle("prefill").record_replica_metadata.remote().result(timeout_s=30))

    def reference(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """D's engine alone: each body through the decode replica's plain LLMServer path."""
        CompletionRequest = _mod("ray.llm._internal.serve.core.configs.openai_api_models").CompletionRequest

        h = self.handle("decode").options(stream=True)
        gens = [h._run_request.remote(CompletionRequest(**b), engine_method="completions") for b in bodies]
        out = []
        for gen in gens:
            chunks = [c for item in gen for c in (item if isinstance(item, list) else [item])]
            dumped = [c.model_dump() if hasattr(c, "model_dump") else c for c in chunks]
            out.append(dumped[0] if len(dumped) == 1 else {"chunks": dumped})
        return out

    # --- faults --------------------------------------------------------------------------------
    @staticmethod
    def _children(pid: int) -> list[Any]:
        psutil = _mod("psutil")
        try:
            return list(psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            return []

    def _one(self, role: str) -> dict[str, Any]:
        found = self.replicas(role)
        if len(found) != 1:
            raise RuntimeError(f"expected one ALIVE {role} replica, found {found}")
        return found[0]

    def freeze(self, role: str) -> dict[str, Any]:
        replica = self._one(role)
        pids = [p.pid for p in self._children(int(replica["pid"]))]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        log("froze", role=role, replica=replica["name"], pids=pids)
        return {**replica, "frozen": pids}

    def kill(self, role: str) -> dict[str, Any]:
        psutil, ray = _mod("psutil"), _mod("ray")
        replica = self._one(role)
        procs = [psutil.Process(int(replica["pid"])), *self._children(int(replica["pid"]))]
        actor = ray.get_actor(replica["name"], namespace="serve")
        t_kill = time.time()
        ray.kill(actor, no_restart=True)
        log("killed", role=role, replica=replica["name"], pids=[p.pid for p in procs])
        _, alive = psutil.wait_procs(procs, timeout=5)
        leftover = [p.pid for p in alive]
        for p in alive:  # engine processes Ray left behind: a crash takes them too
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        return {**replica, "t_kill": t_kill, "pids": [p.pid for p in procs], "killed_after_ray": leftover}

    # --- stop ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        with self._stop_lock:
            if self.stopped.is_set():
                return
            self.phase = "stopping"
            t0 = time.monotonic()
            # Ray's processes (GCS, raylet, agents, workers, engines) all descend from this one
            # now; some of its agents outlive ray.shutdown() (ray 2.60), so they are reaped here.
            started = self._children(os.getpid())
            try:
                ray, serve = _mod("ray"), _mod("ray.serve")
                if ray.is_initialized():
                    try:
                        serve.shutdown()
                    finally:
                        ray.shutdown()
            except Exception:
                log("shutdown error", tb=traceback.format_exc())
            t1 = time.monotonic()
            leftover = self._reap(started, timeout=10.0)
            log(
                "shut down",
                s=f"{time.monotonic() - t0:.1f}",
                ray_shutdown_s=f"{t1 - t0:.1f}",
                processes=len(started),
                killed_after_shutdown=leftover,
            )
            self.stopped.set()

    @staticmethod
    def _reap(procs: list[Any], timeout: float) -> list[str]:
        """Wait for ``procs`` to exit; SIGKILL those still there after ``timeout``."""
        psutil = _mod("psutil")
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        names = []
        for p in alive:
            try:
                names.append(f"{p.pid}:{p.name()}")
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        return names


def control_server(app: App, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, code: int, body: Any) -> None:
            data = json.dumps(body, default=str).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _run(self, fn: Any) -> None:
            if app.phase != "running":
                self._reply(409, {"error": f"the app is {app.phase}"})
                return
            try:
                self._reply(200, fn())
            except Exception as exc:
                self._reply(500, {"error": repr(exc), "traceback": traceback.format_exc()})

        def do_GET(self) -> None:
            if self.path == "/status":
                self._reply(200, app.status())
            elif self.path == "/metadata":
                self._run(app.metadata)
            else:
                self._reply(404, {"error": self.path})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path == "/reference":
                self._run(lambda: app.reference(body["bodies"]))
            elif self.path == "/freeze":
                self._run(lambda: app.freeze(body.get("role", "prefill")))
            elif self.path == "/kill":
                self._run(lambda: app.kill(body.get("role", "prefill")))
            elif self.path == "/shutdown":
                self._reply(200, {"stopping": True})
                threading.Thread(target=app.shutdown, daemon=True).start()
            else:
                self._reply(404, {"error": self.path})

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local model directory")
    p.add_argument("--model-id", default="tiny")
    p.add_argument("--http-port", type=int, required=True)
    p.add_argument("--control-port", type=int, required=True)
    p.add_argument("--logs", required=True, help="directory for the connectors' JSON-lines logs")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray node")
    p.add_argument("--object-store-mb", type=int, default=256)
    p.add_argument("--lease-duration", type=float, default=0.0, help="the connectors' lease_duration (0: default)")
    p.add_argument("--handshake-timeout", type=float, default=20.0)
    p.add_argument("--registration-timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    os.makedirs(args.logs, exist_ok=True)
    app = App(args)
    server = control_server(app, args.control_port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=app.shutdown, daemon=True).start())
    log("control server up", port=args.control_port)
    try:
        app.start()
    except Exception:
        app.error = traceback.format_exc()
        app.phase = "failed"
        log("start failed", tb=app.error)
        app.shutdown()
    app.stopped.wait()
    server.shutdown()
    return 0 if app.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
