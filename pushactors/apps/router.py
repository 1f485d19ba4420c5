"""A small router for disaggregated serving: OpenAI-compatible ``/v1/completions``.

``concurrent`` (default) sends the prefill leg to P and the decode leg to D at the same time: in
push mode D needs only P's identity (engine id, side-channel address, TP/PP size), which the
router knows up front, and a ``transfer_id`` ties the two legs together. ``sequential`` waits
for P's response and hands its ``kv_transfer_params`` to D, as pull connectors need.

    pushactors router --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        --prefill-engine-id prefill-0 --prefill-side-channel 127.0.0.1:5600 --port 8000

Every client request gets a transfer id minted here (never derived from client input: a retry
that reuses its ``X-Request-Id`` must not share a transfer with the first attempt). Failures are
always answered: an error status before a response started, an OpenAI-style error event on a
started stream.

Needs ``aiohttp`` (``pip install 'pushactors[router]'``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import ClientError, ClientResponse, ClientSession, ClientTimeout, web

from ..logs import configure_logging, get_logger

_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
_SSE = "text/event-stream"
_DONE_EVENT = b"data: [DONE]\n\n"
# aiohttp cancels a handler on client disconnect only when asked; the router relies on it to
# close both upstream legs (so vLLM aborts them) as soon as the client goes away.
HANDLER_CANCELLATION = True


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


def new_transfer_id() -> str:
    """Unguessable and unique: P and D key a transfer by it, so it must name one request."""
    return f"tx-{secrets.token_hex(16)}"


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


def _is_single_prompt(body: dict[str, Any]) -> bool:
    prompt = body.get("prompt")
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int))


@dataclass
class _Call:
    """One client request: its ids, its client stream once started, and how it ended."""

    request_id: str
    transfer_id: str | None
    out: web.StreamResponse | None = None
    outcome: str = "failed"  # served | failed | failed_prefill | failed_decode | client_disconnect
    status: int = 0
    reason: str = ""

    def error(self, message: str, kind: str, code: int, **extra: Any) -> dict[str, Any]:
        return {
            "error": {
                "message": message,
                "type": kind,
                "param": None,
                "code": code,
                "request_id": self.request_id,
                "transfer_id": self.transfer_id,
                **extra,
            }
        }


@dataclass(frozen=True)
class _LegResult:
    status: int | None  # None: no HTTP response (connection error, timeout, unreadable body)
    payload: Any
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


def _upstream_error(payload: Any) -> dict[str, Any] | None:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return dict(payload["error"])
    return None


def _upstream_message(payload: Any) -> str:
    err = _upstream_error(payload)
    if err is not None and "message" in err:
        return str(err["message"])
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return text[:500]


def _next_event(buf: bytearray) -> bytes | None:
    """Pop one complete SSE event (through its blank line) from ``buf``; None if none yet."""
    ends = [(i, n) for i, n in ((buf.find(b"\n\n"), 2), (buf.find(b"\r\n\r\n"), 4)) if i >= 0]
    if not ends:
        return None
    i, n = min(ends)
    event = bytes(buf[: i + n])
    del buf[: i + n]
    return event


def _event_data(event: bytes) -> bytes:
    lines = [line[5:].lstrip() for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines)


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
        self.counters = {
            "served": 0,
            "failed": 0,
            "failed_prefill": 0,
            "failed_decode": 0,
            "client_disconnects": 0,
        }

    @property
    def served(self) -> int:
        return self.counters["served"]

    @property
    def failed(self) -> int:
        return self.counters["failed"]

    async def start(self, app: web.Application) -> None:
        self._session = ClientSession(timeout=ClientTimeout(total=self.config.timeout))

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        """The aiohttp app. Serve it with ``handler_cancellation=True`` (see HANDLER_CANCELLATION)."""
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    def runner(self) -> web.AppRunner:
        return web.AppRunner(self.app(), handler_cancellation=HANDLER_CANCELLATION)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "mode": self.config.mode, **self.counters})

    # ------------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self.counters["failed"] += 1
            call = _Call(rid, None)
            return web.json_response(
                call.error("request body must be a JSON object", "BadRequestError", 400), status=400
            )
        # One transfer id names exactly one prompt; multi-prompt requests match by base id.
        call = _Call(rid, new_transfer_id() if _is_single_prompt(body) else None)
        started = time.monotonic()
        try:
            if self.config.mode == "concurrent":
                return await self._concurrent(request, body, call)
            return await self._sequential(request, body, call)
        except asyncio.CancelledError:
            call.outcome, call.reason = "client_disconnect", "client went away; both legs cancelled"
            raise
        except ConnectionError:
            # Writing to a client that has gone (without handler cancellation).
            call.outcome, call.reason = "client_disconnect", "client went away; both legs cancelled"
            return call.out if call.out is not None else web.Response(status=499)
        finally:
            self._count(call)
            log = self.log.info if call.outcome == "served" else self.log.warning
            log(
                "router.request",
                request_id=rid,
                transfer_id=call.transfer_id,
                outcome=call.outcome,
                status=call.status,
                reason=call.reason or None,
                ms=round((time.monotonic() - started) * 1e3, 2),
            )

    def _count(self, call: _Call) -> None:
        if call.outcome == "served":
            self.counters["served"] += 1
        elif call.outcome == "client_disconnect":
            self.counters["client_disconnects"] += 1
        else:
            self.counters["failed"] += 1
            if call.outcome in ("failed_prefill", "failed_decode"):
                self.counters[call.outcome] += 1

    async def _concurrent(self, request: web.Request, body: dict[str, Any], call: _Call) -> web.StreamResponse:
        assert self.config.prefill is not None
        d_body = dict(body)
        d_body["kv_transfer_params"] = decode_params_for(self.config.prefill, call.transfer_id)
        prefill = asyncio.create_task(self._prefill(body, call))
        decode = asyncio.create_task(self._decode(request, d_body, call))
        try:
            done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done and not decode.done() and not prefill.result().ok:
                # D would wait for a push that never comes (until its watchdog): abort D's leg,
                # which closes its connection so vLLM aborts the request, and say why.
                decode.cancel()
                await asyncio.wait({decode})
                if decode.cancelled() or decode.exception() is not None:
                    return await self._prefill_failed(request, call, prefill.result())
            return await decode
        finally:
            # D finished first (or the client left): P's answer no longer matters.
            for task in (prefill, decode):
                task.cancel()
            await asyncio.gather(prefill, decode, return_exceptions=True)

    async def _sequential(self, request: web.Request, body: dict[str, Any], call: _Call) -> web.StreamResponse:
        result = await self._prefill(body, call)
        if not result.ok:
            return await self._prefill_failed(request, call, result)
        params = result.payload.get("kv_transfer_params") if isinstance(result.payload, dict) else None
        d_body = dict(body)
        if params:
            d_body["kv_transfer_params"] = params
        return await self._decode(request, d_body, call)

    # ------------------------------------------------------------------------------------------
    async def _prefill(self, body: dict[str, Any], call: _Call) -> _LegResult:
        assert self._session is not None
        try:
            async with self._session.post(
                f"{self.config.prefill_url}/v1/completions",
                json=prefill_body(body, call.transfer_id),
                headers={"X-Request-Id": call.request_id},
            ) as resp:
                text = await resp.text()
                try:
                    payload: Any = json.loads(text)
                except ValueError:
                    payload = text
                if resp.status == 200 and not isinstance(payload, dict):
                    return _LegResult(None, payload, f"unreadable prefill response: {text[:200]!r}")
                return _LegResult(resp.status, payload)
        except (ClientError, asyncio.TimeoutError, ValueError) as exc:
            return _LegResult(None, None, f"{type(exc).__name__}: {exc}")

    async def _prefill_failed(self, request: web.Request, call: _Call, result: _LegResult) -> web.StreamResponse:
        call.outcome = "failed_prefill"
        if result.status is not None and 400 <= result.status < 500:
            # The client's request was refused by P (validation): the client's error, not ours.
            status = result.status
            err = _upstream_error(result.payload) or {"message": _upstream_message(result.payload)}
            err.setdefault("type", "BadRequestError")
            err.setdefault("code", status)
            payload: dict[str, Any] = {
                "error": {**err, "request_id": call.request_id, "transfer_id": call.transfer_id, "leg": "prefill"}
            }
            call.reason = f"prefill refused the request ({status}): {err.get('message')}"
        else:
            status = 502
            why = (
                f"HTTP {result.status}: {_upstream_message(result.payload)}"
                if result.status is not None
                else result.reason
            )
            call.reason = f"prefill failed ({why}); decode leg cancelled"
            payload = call.error(call.reason, "prefill_error", 502, leg="prefill")
        self.log.warning(
            "router.prefill_failed",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            status=result.status,
            reason=call.reason,
        )
        return await self._answer_error(request, call, payload, status)

    async def _answer_error(
        self, request: web.Request, call: _Call, payload: dict[str, Any], status: int
    ) -> web.StreamResponse:
        """An error status, or an error event and ``[DONE]`` on a stream that already started."""
        call.status = status
        if call.out is not None and call.out.prepared:
            try:
                await call.out.write(b"data: " + json.dumps(payload).encode() + b"\n\n" + _DONE_EVENT)
                await call.out.write_eof()
            except ConnectionError:
                pass
            return call.out
        return web.json_response(payload, status=status, headers={"X-Request-Id": call.request_id})

    # ------------------------------------------------------------------------------------------
    async def _decode(self, request: web.Request, body: dict[str, Any], call: _Call) -> web.StreamResponse:
        assert self._session is not None
        resp: ClientResponse | None = None
        complete = False
        try:
            # Only upstream errors here: writing to a client that left raises a ClientError too.
            try:
                resp = await self._session.post(
                    f"{self.config.decode_url}/v1/completions", json=body, headers={"X-Request-Id": call.request_id}
                )
                ctype = resp.headers.get("Content-Type", "application/json")
                stream = resp.status == 200 and ctype.startswith(_SSE)
                data = b"" if stream else await resp.read()
            except (ClientError, asyncio.TimeoutError) as exc:
                return await self._decode_failed(request, call, f"{type(exc).__name__}: {exc}")
            if stream:
                out = await self._relay_stream(request, resp, call)
                complete = call.outcome == "served"
                return out
            complete = True
        finally:
            if resp is not None:
                # close, not release, unless finished: an unfinished upstream must see the
                # disconnect (vLLM aborts the request then).
                if complete:
                    resp.release()
                else:
                    resp.close()
        if resp.status == 200:
            call.outcome, call.status = "served", 200
            return web.Response(status=200, body=data, headers={"Content-Type": ctype, "X-Request-Id": call.request_id})
        return self._decode_error_response(call, resp.status, data)

    def _decode_error_response(self, call: _Call, status: int, data: bytes) -> web.Response:
        try:
            payload: Any = json.loads(data)
        except ValueError:
            payload = data.decode(errors="replace")
        call.outcome, call.status = "failed_decode", status
        message = _upstream_message(payload)
        err = _upstream_error(payload) or {"message": message, "type": "decode_error", "code": status}
        if status >= 500:
            # vLLM says only "Internal server error" when the KV load failed; name the transfer
            # so its reason can be found in the engines' logs.
            err["message"] = f"decode failed on D ({message}); the KV transfer {call.transfer_id} may have failed"
            err["upstream_message"] = message
        call.reason = str(err["message"])
        err.update(request_id=call.request_id, transfer_id=call.transfer_id, leg="decode")
        self.log.warning(
            "router.decode_failed",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            status=status,
            reason=call.reason,
        )
        return web.json_response({"error": err}, status=status, headers={"X-Request-Id": call.request_id})

    async def _decode_failed(self, request: web.Request, call: _Call, why: str) -> web.StreamResponse:
        call.outcome = "failed_decode"
        call.reason = f"decode failed ({why})"
        self.log.warning(
            "router.decode_failed",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            status=None,
            reason=call.reason,
        )
        return await self._answer_error(request, call, call.error(call.reason, "decode_error", 502, leg="decode"), 502)

    async def _relay_stream(self, request: web.Request, resp: ClientResponse, call: _Call) -> web.StreamResponse:
        """Forward D's SSE stream event by event (an injected error event never splits one)."""
        buf = bytearray()
        done = False
        while not done:
            try:
                chunk = await resp.content.readany()
            except (ClientError, asyncio.TimeoutError) as exc:
                return await self._decode_failed(request, call, f"D's stream broke: {type(exc).__name__}: {exc}")
            if not chunk:
                break
            buf += chunk
            while (event := _next_event(buf)) is not None:
                data = _event_data(event)
                if data == b"[DONE]":
                    done = True
                elif data.startswith(b"{") and b'"error"' in data and (err := self._decode_error_event(call, data)):
                    if call.out is None:
                        # Nothing sent yet: a real error status says it better than a stream.
                        return web.json_response(err, status=call.status, headers={"X-Request-Id": call.request_id})
                    event = b"data: " + json.dumps(err).encode() + b"\n\n"
                if call.out is None:
                    # Opened at D's first event, not its headers: a failure before that still
                    # gets a real error status.
                    call.out = web.StreamResponse(
                        status=200,
                        headers={
                            "Content-Type": resp.headers.get("Content-Type", _SSE),
                            "Cache-Control": "no-cache",
                            "X-Request-Id": call.request_id,
                        },
                    )
                    await call.out.prepare(request)
                await call.out.write(event)
                if done:
                    break
        if not done:
            return await self._decode_failed(request, call, "D's stream ended before [DONE]")
        if call.outcome != "failed_decode":
            call.outcome, call.status = "served", 200
        assert call.out is not None
        await call.out.write_eof()
        return call.out

    def _decode_error_event(self, call: _Call, data: bytes) -> dict[str, Any] | None:
        """D's own error event (vLLM: "Internal server error" when the KV load failed), with
        the transfer named so its reason can be found in the engines' logs."""
        try:
            payload = json.loads(data)
        except ValueError:
            return None
        err = _upstream_error(payload)
        if err is None:
            return None
        message = str(err.get("message", ""))
        err["message"] = f"decode failed on D ({message}); the KV transfer {call.transfer_id} may have failed"
        err.update(upstream_message=message, request_id=call.request_id, transfer_id=call.transfer_id, leg="decode")
        code = err.get("code")
        call.outcome, call.reason = "failed_decode", err["message"]
        call.status = code if isinstance(code, int) and 400 <= code < 600 else 500
        self.log.warning(
            "router.decode_failed",
            request_id=call.request_id,
            transfer_id=call.transfer_id,
            status=call.status,
            reason=call.reason,
        )
        return {"error": err}


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
    web.run_app(router.app(), host=args.host, port=args.port, print=None, handler_cancellation=HANDLER_CANCELLATION)
    return 0
