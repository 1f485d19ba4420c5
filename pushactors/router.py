"""A small router for disaggregated serving: OpenAI-compatible ``/v1/completions``.

``concurrent`` (default) sends the prefill leg to P and the decode leg to D at the same time: in
push mode D needs only P's identity (engine id, side-channel address, TP/PP size), which the
router knows up front, and a ``transfer_id`` ties the two legs together. ``sequential`` waits
for P's response and hands its ``kv_transfer_params`` to D, as pull connectors need.

    pushactors router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --prefill-engine-id prefill-0 --prefill-side-channel 127.0.0.1:5600 --port 8000

Needs ``aiohttp`` (``pip install 'pushactors[router]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from .logs import configure_logging, get_logger

_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


@dataclass(frozen=True)
class PrefillIdentity:
    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class RouterConfig:
    prefill_url: str
    decode_url: str
    mode: str = "concurrent"  # or "sequential"
    prefill: PrefillIdentity | None = None  # required for concurrent legs
    timeout: float = 600.0


def prefill_body(body: dict[str, Any], transfer_id: str | None) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, asks P to keep its KV for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _DROP_FOR_PREFILL}
    params: dict[str, Any] = {"do_remote_decode": True}
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    out.update(kv_transfer_params=params, max_tokens=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_params_for(prefill: PrefillIdentity, transfer_id: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.host,
        "remote_port": prefill.port,
        "remote_tp_size": prefill.tp_size,
        "tp_size": prefill.tp_size,
        "remote_pp_size": prefill.pp_size,
        "pp_size": prefill.pp_size,
    }
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    return params


class Router:
    def __init__(self, config: RouterConfig) -> None:
        if config.mode not in ("concurrent", "sequential"):
            raise ValueError(f"unknown router mode {config.mode!r}")
        if config.mode == "concurrent" and config.prefill is None:
            raise ValueError(
                "concurrent legs need the prefill engine's identity (--prefill-engine-id, --prefill-side-channel)"
            )
        self.config = config
        self.log = get_logger(actor="router", mode=config.mode)
        self._session: ClientSession | None = None
        self.served = 0
        self.failed = 0

    async def start(self, app: web.Application) -> None:
        self._session = ClientSession(timeout=ClientTimeout(total=self.config.timeout))

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "mode": self.config.mode, "served": self.served, "failed": self.failed}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "request body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "request body must be a JSON object"}}, status=400)
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        # A transfer id must name exactly one prompt; multi-prompt requests match by base id.
        single = isinstance(body.get("prompt"), str) or (
            isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], int)
        )
        transfer_id = f"tx-{rid}" if single else None
        started = time.monotonic()
        if self.config.mode == "concurrent":
            response = await self._concurrent(request, body, rid, transfer_id)
        else:
            response = await self._sequential(request, body, rid, transfer_id)
        self.log.info("router.request", request_id=rid, ms=round((time.monotonic() - started) * 1e3, 2))
        return response

    async def _prefill(self, body: dict[str, Any], rid: str, transfer_id: str | None) -> tuple[int, Any]:
        assert self._session is not None
        async with self._session.post(
            f"{self.config.prefill_url}/v1/completions",
            json=prefill_body(body, transfer_id),
            headers={"X-Request-Id": rid},
        ) as resp:
            payload = await resp.json(content_type=None)
            return resp.status, payload

    async def _decode(self, request: web.Request, body: dict[str, Any], rid: str) -> web.StreamResponse:
        assert self._session is not None
        async with self._session.post(
            f"{self.config.decode_url}/v1/completions", json=body, headers={"X-Request-Id": rid}
        ) as resp:
            out = web.StreamResponse(
                status=resp.status, headers={"Content-Type": resp.headers.get("Content-Type", "application/json")}
            )
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            if resp.status == 200:
                self.served += 1
            else:
                self.failed += 1
            return out

    async def _concurrent(
        self, request: web.Request, body: dict[str, Any], rid: str, transfer_id: str | None
    ) -> web.StreamResponse:
        assert self.config.prefill is not None
        d_body = dict(body)
        d_body["kv_transfer_params"] = decode_params_for(self.config.prefill, transfer_id)
        prefill = asyncio.create_task(self._prefill(body, rid, transfer_id))
        decode = asyncio.create_task(self._decode(request, d_body, rid))
        done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
        if prefill in done:
            status, payload = (
                prefill.result() if not prefill.exception() else (599, {"error": repr(prefill.exception())})
            )
            if status != 200 and not decode.done():
                # P failed: D would wait for a push that never comes. Abort it and say why.
                decode.cancel()
                self.failed += 1
                self.log.warning("router.prefill_failed", request_id=rid, status=status)
                return web.json_response({"error": {"message": f"prefill failed: {payload}"}}, status=502)
        try:
            return await decode
        finally:
            if not prefill.done():
                await asyncio.wait({prefill}, timeout=self.config.timeout)

    async def _sequential(
        self, request: web.Request, body: dict[str, Any], rid: str, transfer_id: str | None
    ) -> web.StreamResponse:
        status, payload = await self._prefill(body, rid, transfer_id)
        if status != 200:
            self.failed += 1
            return web.json_response({"error": {"message": f"prefill failed: {payload}"}}, status=502)
        params = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
        d_body = dict(body)
        if params:
            d_body["kv_transfer_params"] = params
        return await self._decode(request, d_body, rid)


def parse_endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected host:port, got {text!r}")
    return host, int(port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, help="base URL of the prefill server")
    p.add_argument("--decode", required=True, help="base URL of the decode server")
    p.add_argument("--mode", choices=["concurrent", "sequential"], default="concurrent")
    p.add_argument("--prefill-engine-id", help="P's engine id (concurrent legs)")
    p.add_argument("--prefill-side-channel", type=parse_endpoint, help="P's side channel host:port (concurrent legs)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--prefill-pp", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--log-json", help="write router events as JSON lines here")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pushactors router", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    if args.log_json:
        configure_logging(json_path=args.log_json)
    identity = None
    if args.prefill_engine_id and args.prefill_side_channel:
        host, port = args.prefill_side_channel
        identity = PrefillIdentity(args.prefill_engine_id, host, port, args.prefill_tp, args.prefill_pp)
    router = Router(
        RouterConfig(
            prefill_url=args.prefill.rstrip("/"),
            decode_url=args.decode.rstrip("/"),
            mode=args.mode,
            prefill=identity,
            timeout=args.timeout,
        )
    )
    web.run_app(router.app(), host=args.host, port=args.port, print=None)
    return 0
