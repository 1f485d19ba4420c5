"""The handshake actor: fetches and validates remote ranks' metadata off the writer.

Fetches run on a small thread pool so one slow or dead peer never delays handshakes with
others; the same peer is fetched once however many requests wait on it (the writer parks
those). A fetch's outcome comes back to this actor as a message, is validated here (hash before
body, then engine id and rank), and goes to the writer as :class:`HandshakeCompleted` or
:class:`HandshakeFailed`.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pykka

from ..directory import MetadataSource, SideChannelError
from ..protocol import (
    FetchPeer,
    FetchSettled,
    HandshakeCompleted,
    HandshakeError,
    HandshakeFailed,
    HandshakeRequest,
    PeerKey,
    decode_handshake,
)
from .base import Note, PushActor, RankContext, handles


class Handshake(PushActor):
    actor_name = "handshake"

    def __init__(self, ctx: RankContext, source: MetadataSource, compat_hash: str) -> None:
        super().__init__(ctx)
        self._source = source
        self._compat_hash = compat_hash
        self._pool = ThreadPoolExecutor(
            max_workers=ctx.config.handshake_workers, thread_name_prefix=f"pushactors-hs-{ctx.label}"
        )
        self._inflight: dict[PeerKey, bool] = {}

    @handles(FetchPeer)
    def _fetch(self, msg: FetchPeer, note: Note) -> None:
        note.fields.update(peer=_peer_label(msg.peer), full=msg.full)
        if msg.peer in self._inflight:
            # A full fetch answers a notif-only waiter too; upgrade if needed.
            self._inflight[msg.peer] = self._inflight[msg.peer] or msg.full
            note("handshake.joined")
            return
        self._inflight[msg.peer] = msg.full
        request = HandshakeRequest(
            pp_rank=msg.peer.pp_rank,
            tp_rank=msg.peer.tp_rank,
            requester_engine_id=self.ctx.engine_id,
            requester_agent=self.ctx.agent_name,
        )
        me = self.actor_ref
        timeout = self.config.handshake_timeout
        source = self._source

        def run() -> tuple[bytes, float, float]:
            sent_at = time.monotonic()
            payload = source.fetch(msg.peer, request, timeout)
            return payload, sent_at, time.monotonic()

        def done(fut: Future[tuple[bytes, float, float]]) -> None:
            try:
                payload, sent_at, received_at = fut.result()
                settled = FetchSettled(
                    peer=msg.peer, full=msg.full, payload=payload, sent_at=sent_at, received_at=received_at
                )
            except SideChannelError as exc:
                settled = FetchSettled(peer=msg.peer, full=msg.full, error_kind=exc.kind, error=exc.detail)
            except BaseException as exc:
                settled = FetchSettled(peer=msg.peer, full=msg.full, error_kind="error", error=repr(exc))
            try:
                me.tell(settled)
            except pykka.ActorDeadError:
                pass  # stopped while the fetch ran: nobody waits for it any more

        try:
            self._pool.submit(run).add_done_callback(done)
        except RuntimeError as exc:  # pool shut down
            self._inflight.pop(msg.peer, None)
            self.ctx.peers.tell("writer", HandshakeFailed(peer=msg.peer, kind="shutdown", reason=str(exc)))
            note("handshake.failed", level="warning", kind="shutdown")
            return
        self.ctx.metrics.incr("handshake.started")
        note("handshake.started")

    @handles(FetchSettled)
    def _settled(self, msg: FetchSettled, note: Note) -> None:
        full = self._inflight.pop(msg.peer, msg.full)
        note.fields.update(peer=_peer_label(msg.peer))
        if msg.payload is None:
            self._fail(msg.peer, msg.error_kind or "error", msg.error, note)
            return
        try:
            info = decode_handshake(msg.payload, expected_hash=self._compat_hash, expected_engine=msg.peer.engine_id)
        except HandshakeError as exc:
            self._fail(msg.peer, exc.kind, exc.detail, note)
            return
        if (info.pp_rank, info.tp_rank) != (msg.peer.pp_rank, msg.peer.tp_rank):
            self._fail(
                msg.peer,
                "wrong_rank",
                f"asked for pp{msg.peer.pp_rank}/tp{msg.peer.tp_rank}, got pp{info.pp_rank}/tp{info.tp_rank}",
                note,
            )
            return
        offset = info.clock.monotonic - (msg.sent_at + msg.received_at) / 2 if msg.received_at else 0.0
        self.ctx.metrics.incr("handshake.completed")
        self.ctx.peers.tell("writer", HandshakeCompleted(peer=msg.peer, info=info, full=full, clock_offset=offset))
        note(
            "handshake.completed",
            agent=info.agent_name,
            regions=len(info.regions),
            rtt_ms=round((msg.received_at - msg.sent_at) * 1e3, 3),
            clock_offset_ms=round(offset * 1e3, 3),
        )

    def _fail(self, peer: PeerKey, kind: str, reason: str, note: Note) -> None:
        self.ctx.metrics.incr(f"handshake.failed.{kind}")
        self.ctx.peers.tell("writer", HandshakeFailed(peer=peer, kind=kind, reason=reason))
        note("handshake.failed", level="warning", kind=kind, reason=reason)

    def on_stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def on_handler_error(self, message: Any, exc: Exception) -> None:
        peer = getattr(message, "peer", None)
        if isinstance(peer, PeerKey):
            self._inflight.pop(peer, None)
            self.ctx.peers.tell("writer", HandshakeFailed(peer=peer, kind="error", reason=repr(exc)))


def _peer_label(peer: PeerKey) -> str:
    return f"{peer.engine_id}/pp{peer.pp_rank}/tp{peer.tp_rank}"
