"""pushactors in Ray Serve LLM's prefill/decode app: a connector backend for ``PushActorsConnector``.

Ray Serve LLM (ray 2.60) builds a P/D app as ingress -> decode deployment (its own engine, and
the orchestrator of each request) -> prefill deployment, and lets a KV connector steer the
orchestrator through a *connector backend* registered under the connector's name. This module
is that backend for pushactors::

    from ray.serve.llm import build_pd_openai_app
    from pushactors.integrations.ray_serve import kv_transfer_config, register_backend

    register_backend()                      # once, in the driver, before serve.run; idempotent
    app = build_pd_openai_app({
        "prefill_config": {..., "engine_kwargs": {..., "kv_transfer_config": kv_transfer_config("kv_producer")}},
        "decode_config": {..., "engine_kwargs": {..., "kv_transfer_config": kv_transfer_config("kv_consumer")}},
    })

What the backend does, per replica and per request:

- ``setup()`` runs in every P and D replica before its vLLM engine starts. It fixes what the
  engine's connector reads from ``kv_transfer_config``: ``side_channel_host`` (the Ray node's
  address unless given), ``side_channel_port`` (P: a given port plus the replica's port
  offset, or else a free port of the node; D: any) and a unique ``engine_id``
  (``<engine_id or role>-<host>-<port>``).
- ``replica_metadata()`` publishes P's push identity (engine id, side channel, TP/PP size):
  Serve hands it to the decode orchestrator with the P replica it picked for a request
  (``requires_peer_binding``), so nobody types P's identity anywhere.
- ``prepare_prefill_request`` / ``prepare_decode_request`` shape the two legs, which Ray then
  sends **at the same time** (``concurrent_handoff``): P's leg asks P to keep its KV for a remote
  decode (one token, not streamed); D's leg names the picked P, so D registers its blocks with
  P while P computes. Both legs carry one ``transfer_id`` (128 random bits minted per request,
  never taken from the client) by which P and D pair them, and one request id.

Importing this module does not import Ray (nor vLLM): :func:`register_backend` and the
backend class (:func:`backend_class`, or ``PushActorsBackend`` as a module attribute) import it
when first used. The registry it uses is Ray's ``KVConnectorBackendFactory``, an internal API
of ray 2.60 (``ray.llm._internal``), which this module is written and tested against.
"""

from __future__ import annotations

import importlib
import random
import secrets
import socket
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .transfer_params import TRANSFER_MODE_PUSH

CONNECTOR_NAME = "PushActorsConnector"
CONNECTOR_MODULE = "pushactors.integrations.vllm"
BACKEND_PATH = f"{__name__}:PushActorsBackend"
RAY_VERSION = "2.60.0"  # the ray[serve] version this backend is built and tested against

_FACTORY_MODULE = "ray.llm._internal.serve.engines.vllm.kv_transfer.factory"
_BASE_MODULE = "ray.llm._internal.serve.engines.vllm.kv_transfer.base"
# Requests whose P leg was shaped and whose D leg was not yet: at most this many remembered.
_PENDING_MAX = 4096
# What P's replica metadata carries (all JSON strings and numbers).
IDENTITY_FIELDS = ("engine_id", "host", "port", "tp_size", "pp_size")


class RayUnavailableError(ImportError):
    """Ray Serve LLM is not installed (``pip install "ray[serve]==2.60.0"`` and its llm packages)."""


def _ray_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise RayUnavailableError(
            f"pushactors' Ray Serve backend needs Ray Serve LLM ({name}: {exc}); install "
            f'"ray[serve]=={RAY_VERSION}" and the llm extra\'s packages (docs/deployment.md, "Ray Serve LLM")'
        ) from exc


def ray_available() -> bool:
    """Whether Ray Serve LLM's connector-backend registry can be imported here."""
    try:
        _ray_module(_FACTORY_MODULE)
    except RayUnavailableError:
        return False
    return True


# ============================================================================================
# Configuration
# ============================================================================================
def kv_transfer_config(role: str, *, kv_buffer_device: str = "cuda", **extra: Any) -> dict[str, Any]:
    """The ``engine_kwargs["kv_transfer_config"]`` of a P (``"kv_producer"``) or D
    (``"kv_consumer"``) deployment; ``extra`` goes to ``kv_connector_extra_config`` (any
    :class:`~pushactors.core.config.PushConfig` setting, docs/vllm.md "Settings"). Leave
    ``side_channel_host``/``side_channel_port`` and ``engine_id`` out: :meth:`setup` fixes them
    per replica (a ``side_channel_port`` given is P's base port, the replica's offset added)."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"role {role!r}: expected kv_producer (P), kv_consumer (D) or kv_both")
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_buffer_device": kv_buffer_device,
        "kv_connector_extra_config": dict(extra),
    }


def register_backend(name: str = CONNECTOR_NAME) -> bool:
    """Register the backend with Ray Serve LLM under ``name`` (the ``kv_connector`` of the
    deployments' ``kv_transfer_config``), for every process of the Ray cluster. Call it in the
    driver before ``serve.run`` (before or after ``ray.init``). Idempotent: True when this call
    registered it, False when it already was. Raises ValueError when ``name`` is registered to
    another backend, :class:`RayUnavailableError` without Ray Serve LLM."""
    factory = _ray_module(_FACTORY_MODULE).KVConnectorBackendFactory
    if not factory.is_registered(name):
        try:
            factory.register_backend(name, BACKEND_PATH)
            return True
        except ValueError:
            if not factory.is_registered(name):
                raise
    registered = factory.get_backend_class(name)
    if not (isinstance(registered, type) and issubclass(registered, PushActorsBackendMixin)):
        raise ValueError(
            f"Ray Serve LLM's connector backend {name!r} is {registered!r}, not pushactors' "
            f"({BACKEND_PATH}): unregister it first (KVConnectorBackendFactory.unregister_backend)"
        )
    return False


def build_pd_app(prefill_config: Any, decode_config: Any, **pd_serving_args: Any) -> Any:
    """:func:`register_backend`, then Ray's ``build_pd_openai_app`` (the OpenAI app: ingress ->
    decode orchestrator -> prefill) for these two ``LLMConfig``\\s (or their dicts)."""
    register_backend()
    build = _ray_module("ray.serve.llm").build_pd_openai_app
    return build({"prefill_config": prefill_config, "decode_config": decode_config, **pd_serving_args})


# ============================================================================================
# Request shaping (pure: no Ray needed)
# ============================================================================================
def new_transfer_id() -> str:
    """Unguessable and unique: P and D pair a request's legs by it (as ``pushactors router``)."""
    return f"tx-{secrets.token_hex(16)}"


def keyed_per_prompt(request: Any) -> bool:
    """Whether one client request becomes several engine requests on each side (several
    prompts, or ``n`` > 1): then each leg is keyed by ``<transfer_id>/<its base id>``."""
    n = getattr(request, "n", None)
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return True
    if getattr(request, "messages", None) is not None:
        return False  # a chat request is one conversation
    prompt = getattr(request, "prompt", None)
    single = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int))
    return not single


def peer_identity(peer: object) -> dict[str, Any]:
    """P's push identity from the replica metadata Serve handed the orchestrator; ValueError
    (naming what is missing) when the picked replica did not publish one."""
    if not isinstance(peer, Mapping) or peer.get("connector") != CONNECTOR_NAME:
        raise ValueError(
            f"the prefill replica Ray Serve picked published no pushactors identity (replica metadata {peer!r}): "
            f"run the prefill deployment with kv_connector {CONNECTOR_NAME!r} too"
        )
    identity = {f: peer.get(f) for f in IDENTITY_FIELDS}
    bad = [
        f
        for f, v in identity.items()
        if isinstance(v, bool) or not isinstance(v, str if f in ("engine_id", "host") else int) or v in ("", 0)
    ]
    if bad:
        raise ValueError(f"the prefill replica's metadata lacks a usable {', '.join(bad)}: {dict(peer)!r}")
    return identity


def prefill_params(transfer_id: str, *, per_prompt: bool = False) -> dict[str, Any]:
    """P's leg: keep the KV for a remote decode, paired with D's leg by ``transfer_id``."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
        "transfer_id": transfer_id,
    }
    if per_prompt:
        params["transfer_per_prompt"] = True
    return params


def decode_params(identity: Mapping[str, Any], transfer_id: str, *, per_prompt: bool = False) -> dict[str, Any]:
    """D's leg: receive the prompt's KV by push from the P ``identity`` names (our names and vLLM's)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": identity["engine_id"],
        "remote_host": identity["host"],
        "remote_port": identity["port"],
        "remote_tp_size": identity["tp_size"],
        "tp_size": identity["tp_size"],
        "remote_pp_size": identity["pp_size"],
        "pp_size": identity["pp_size"],
        "transfer_mode": TRANSFER_MODE_PUSH,
        "transfer_id": transfer_id,
    }
    if per_prompt:
        params["transfer_per_prompt"] = True
    return params


def clamp_to_one_token(request: Any) -> None:
    """P's leg computes the prompt and one token, not streamed (in place)."""
    request.max_tokens = 1
    if hasattr(request, "max_completion_tokens"):
        request.max_completion_tokens = 1
    if getattr(request, "min_tokens", None):
        request.min_tokens = 0  # vLLM refuses min_tokens > max_tokens
    request.stream = False
    if hasattr(request, "stream_options"):
        request.stream_options = None


# ============================================================================================
# Ports and addresses of the replica's node
# ============================================================================================
def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str) -> int:
    """A port of ``host`` that binds now, from below the ephemeral range when there is room (a
    port from ``bind(0)`` may be taken by any outgoing connection before the engine binds it)."""
    low, rng = 20000, random.SystemRandom()
    high = _ephemeral_low()
    for _ in range(64 if high - low >= 1000 else 0):
        port = rng.randrange(low, high)
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, port))
            return port
        except OSError:
            continue
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _node_ip() -> str:
    return str(_ray_module("ray.util").get_node_ip_address())


# ============================================================================================
# The backend
# ============================================================================================
_pending_init = threading.Lock()


class PushActorsBackendMixin:
    """The backend's behaviour; :func:`backend_class` joins it with Ray's ``BaseConnectorBackend``
    (which provides ``__init__(llm_config)`` and ``_compute_port_offset``)."""

    requires_peer_binding = True  # D's leg needs the picked P's identity before dispatch
    concurrent_handoff = True  # ... and nothing from P's answer: both legs go at once

    llm_config: Any
    _identity: dict[str, Any] | None = None
    _pending: OrderedDict[int, tuple[Any, str, bool]]
    _pending_lock: threading.Lock

    # --- set-up, in the replica, before the engine starts ----------------------------------------
    def _kv_config(self) -> dict[str, Any]:
        ktc = self.llm_config.engine_kwargs.get("kv_transfer_config")
        if not isinstance(ktc, dict):
            raise ValueError("PushActorsConnector backend: engine_kwargs has no kv_transfer_config dict")
        return ktc

    def _port_offset(self) -> int:
        compute = getattr(self, "_compute_port_offset", None)
        if compute is None:
            return 0
        try:
            return int(compute())
        except Exception:  # no Serve replica context (a script or a test calling setup())
            return 0

    def setup(self) -> None:
        """Fix this engine's side channel and engine id in ``kv_transfer_config`` (read by the
        connector when the engine starts) and remember them as P's identity."""
        if self._identity is not None:
            return
        ktc = self._kv_config()
        extra = ktc.get("kv_connector_extra_config")
        if not isinstance(extra, dict):
            extra = ktc["kv_connector_extra_config"] = {}
        role = str(ktc.get("kv_role") or "kv_both")
        host = str(extra.get("side_channel_host") or _node_ip())
        base_port = int(extra.get("side_channel_port") or 0)
        if base_port:
            port = base_port + self._port_offset()
        elif role != "kv_consumer":
            port = free_port(host)  # P: fixed now, so it can be published before the engine starts
        else:
            port = 0  # D: any; its registrations carry D's address
        extra["side_channel_host"], extra["side_channel_port"] = host, port
        name = str(ktc.get("engine_id") or {"kv_producer": "prefill", "kv_consumer": "decode"}.get(role, "engine"))
        ktc["engine_id"] = f"{name}-{host}-{port or secrets.token_hex(3)}"
        kwargs = self.llm_config.engine_kwargs
        self._identity = {
            "connector": CONNECTOR_NAME,
            "engine_id": ktc["engine_id"],
            "host": host,
            "port": port,
            "tp_size": int(kwargs.get("tensor_parallel_size") or 1),
            "pp_size": int(kwargs.get("pipeline_parallel_size") or 1),
            "kv_role": role,
        }

    def replica_metadata(self) -> dict[str, Any]:
        """This replica's push identity (published by Serve once, after the engine started)."""
        return dict(self._identity or {})

    # --- per request, in the decode orchestrator -------------------------------------------------
    def _remember(self, request: Any, transfer_id: str, per_prompt: bool) -> None:
        with _pending_init:
            if not hasattr(self, "_pending"):
                self._pending, self._pending_lock = OrderedDict(), threading.Lock()
        with self._pending_lock:
            self._pending[id(request)] = (request, transfer_id, per_prompt)
            while len(self._pending) > _PENDING_MAX:
                self._pending.popitem(last=False)

    def _recall(self, request: Any) -> tuple[str, bool] | None:
        if not hasattr(self, "_pending"):
            return None
        with self._pending_lock:
            entry = self._pending.pop(id(request), None)
        if entry is None or entry[0] is not request:
            return None
        return entry[1], entry[2]

    @staticmethod
    def _leg_request_id(request: Any) -> str:
        """The id both legs reach their engines under: the client's ``request_id`` when it set
        one, else the Serve request id (the HTTP ``X-Request-Id``, as Ray's own server stamps it),
        so P's and D's engine ids (``cmpl-<id>-<i>-<hex>``) match Ray's logs and errors."""
        if "request_id" not in getattr(request, "model_fields_set", ("request_id",)):
            try:
                context = _ray_module("ray.serve.context")._serve_request_context.get()
            except (RayUnavailableError, AttributeError, LookupError):
                context = None
            rid = getattr(context, "request_id", None)
            if isinstance(rid, str) and rid:
                return rid
        return str(request.request_id)

    def prepare_prefill_request(self, *, request: Any, peer: dict[str, Any] | None) -> Any:
        """P's leg: a copy of the client's request, one token, not streamed, with a fresh
        ``transfer_id`` (remembered for this request's D leg)."""
        peer_identity(peer)  # refuse at once when the picked P is not a pushactors engine
        transfer_id, per_prompt = new_transfer_id(), keyed_per_prompt(request)
        self._remember(request, transfer_id, per_prompt)
        leg = request.model_copy(deep=True)
        leg.request_id = self._leg_request_id(request)  # set explicitly: Ray's server keeps it
        leg.kv_transfer_params = prefill_params(transfer_id, per_prompt=per_prompt)
        clamp_to_one_token(leg)
        return leg

    def prepare_decode_request(self, *, request: Any, peer: dict[str, Any] | None, prefill_response: Any = None) -> Any:
        """D's leg: the client's request, its KV to come by push from the picked P (``peer``),
        with the ``transfer_id`` of the P leg shaped for this request."""
        identity = peer_identity(peer)
        leg = request.model_copy(deep=True)
        leg.request_id = self._leg_request_id(request)
        recalled = self._recall(request)
        answer = getattr(prefill_response, "kv_transfer_params", None)
        if isinstance(answer, Mapping):
            # Sequential hand-off (P answered first): P's answer names P and the transfer.
            leg.kv_transfer_params = dict(answer)
            return leg
        if recalled is None:
            raise ValueError("no prefill leg was shaped for this request: D's leg could not be paired with one")
        transfer_id, per_prompt = recalled
        leg.kv_transfer_params = decode_params(identity, transfer_id, per_prompt=per_prompt)
        return leg


_backend_cls: type[Any] | None = None
_backend_lock = threading.Lock()


def backend_class() -> type[Any]:
    """``PushActorsBackend``: :class:`PushActorsBackendMixin` on Ray's ``BaseConnectorBackend``
    (built on first use, so that importing this module needs no Ray)."""
    global _backend_cls
    with _backend_lock:
        if _backend_cls is None:
            base = _ray_module(_BASE_MODULE).BaseConnectorBackend
            _backend_cls = type(
                "PushActorsBackend",
                (PushActorsBackendMixin, base),
                {
                    "__module__": __name__,
                    "__qualname__": "PushActorsBackend",
                    "__doc__": "Ray Serve LLM's connector backend for PushActorsConnector (module docstring).",
                },
            )
        return _backend_cls


def __getattr__(name: str) -> Any:
    if name == "PushActorsBackend":
        return backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
