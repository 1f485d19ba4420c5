"""What one rank sends over NIXL, built as bytes (plain code: no NIXL, no threads).

The writer hands these bytes to its agent; with HMAC keys set (``auth_keys``) every payload is
sealed here, so nothing leaves a rank unsigned, and every inbound one is opened here.
"""

from __future__ import annotations

from ...protocol import (
    Abort,
    PushDigest,
    PushFailure,
    Registration,
    encode_abort,
    encode_completion,
    encode_heartbeat,
    encode_push_digest,
    encode_push_failure,
    encode_registration,
)
from ...transport.auth import Keyring

MAX_HEARTBEAT_BYTES = 32 * 1024
NOTIF = b"notif"  # MAC context of NIXL notifications
MAX_REASON = 1000


class Outbound:
    """Notification bytes for one rank (P rank ``tp_rank``/``pp_rank`` when it writes)."""

    def __init__(self, keyring: Keyring | None, *, tp_rank: int, pp_rank: int, tp_size: int) -> None:
        self.keyring = keyring
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.tp_size = tp_size

    def seal(self, payload: bytes) -> bytes:
        return payload if self.keyring is None else self.keyring.seal(NOTIF, payload)

    def open(self, raw: bytes) -> bytes:
        """The payload of an inbound notification; raises AuthError when keys are set and its
        MAC is missing, unknown, wrong or stale."""
        return raw if self.keyring is None else self.keyring.open(NOTIF, raw)

    @staticmethod
    def registration(reg: Registration) -> bytes:
        return encode_registration(reg)

    def completion(
        self,
        d_request_id: str,
        generation: int = 0,
        digest: tuple[tuple[int, int], ...] = (),
        *,
        digest_follows: bool = False,
    ) -> bytes:
        """Attached to a WRITE, so it is sealed here (it never goes through a plain send): the
        MAC covers the digest too. It names the registration's generation: D lands only the
        live one. ``digest_follows``: the digest comes in a :meth:`push_digest` after it."""
        return self.seal(
            encode_completion(d_request_id, self.tp_size, generation, digest, digest_follows=digest_follows)
        )

    def push_digest(self, d_request_id: str, generation: int, digest: tuple[tuple[int, int], ...]) -> bytes:
        """The digest of a WRITE whose completion said it follows (sealed by the send)."""
        return encode_push_digest(
            PushDigest(
                request_id=d_request_id,
                generation=generation,
                tp_rank=self.tp_rank,
                pp_rank=self.pp_rank,
                digest=digest,
            )
        )

    def push_failure(self, d_request_id: str, reason: str, *, final: bool = True, generation: int = 0) -> bytes:
        return encode_push_failure(
            PushFailure(
                request_id=d_request_id,
                reason=reason[:MAX_REASON],
                tp_rank=self.tp_rank,
                pp_rank=self.pp_rank,
                final=final,
                generation=generation,
            )
        )

    @staticmethod
    def abort(abort: Abort) -> bytes:
        return encode_abort(abort)

    @staticmethod
    def heartbeats(ids: tuple[str, ...], deadline: float = 0.0) -> list[bytes]:
        """Heartbeat ids split into notifications of bounded size, each with D's promise to
        keep their blocks until ``deadline`` (D's clock; 0: none)."""
        out: list[bytes] = []
        chunk: list[str] = []
        size = 0
        for rid in ids:
            if chunk and size + len(rid) + 1 > MAX_HEARTBEAT_BYTES:
                out.append(encode_heartbeat(chunk, deadline))
                chunk, size = [], 0
            chunk.append(rid)
            size += len(rid) + 1
        if chunk:
            out.append(encode_heartbeat(chunk, deadline))
        return out
