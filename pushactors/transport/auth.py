"""Opt-in HMAC-SHA256 authentication of control messages (side channel, notifications).

Wire form of a sealed message (all ASCII up to the payload)::

    b"PAMAC1:" + key_id + b":" + ts_ms + b":" + tag + b":" + payload

- ``key_id``: the signing key's id, UTF-8, 1-64 bytes, printable, no ``:``.
- ``ts_ms``: wall-clock milliseconds since the epoch when sealed, 1-15 ASCII digits.
- ``tag``: HMAC-SHA256 as 64 lowercase hex characters (printable, so a sealed notification stays
  loggable like the plain ASCII ones).
- ``payload``: the inner message, unchanged, any bytes.

The MAC covers a 2-byte big-endian length of ``context``, ``context``, then the header bytes
exactly as sent (``PAMAC1:key_id:ts_ms:``) and the payload. ``context`` (e.g. ``b"notif"``,
``b"hs-req"``, ``b"hs-reply"``) is never sent: a message sealed for one purpose fails to open
for another. Verifying the header bytes as sent (not re-rendered) means no two spellings of one
message both verify.

Rotation: every key in ``auth_keys`` verifies, only ``auth_key_id`` signs. Add the new key to
every engine, then switch ``auth_key_id`` everywhere, then remove the old key.

Replay: a message is refused when its timestamp is more than ``auth_window`` seconds from the
receiver's wall clock (either way); within the window a captured message can be replayed, which
the protocol tolerates (registrations, heartbeats and handshakes are idempotent).

Failures raise :class:`AuthError` with ``kind``: ``missing`` (no magic prefix), ``malformed``
(prefix present, header unparseable), ``unknown_key``, ``bad_mac``, ``stale``, ``config``.
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Mapping
from typing import Any, Protocol

MAGIC = b"PAMAC1:"
MIN_SECRET_BYTES = 16
MAX_KEY_ID_BYTES = 64
_TAG_HEX = 64  # hex characters of a SHA-256 tag
_MAX_TS_DIGITS = 15
_MAGIC_LEN = len(MAGIC)

AUTH_ERROR_KINDS = ("missing", "unknown_key", "bad_mac", "stale", "malformed", "config")


class AuthError(ValueError):
    """A message that does not authenticate, or auth settings that cannot work."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class _AuthSettings(Protocol):
    @property
    def auth_keys(self) -> Mapping[str, str]: ...

    @property
    def auth_key_id(self) -> str | None: ...

    @property
    def auth_window(self) -> float: ...


def is_sealed(raw: bytes) -> bool:
    """Whether ``raw`` is in the sealed wire form (cheap; says nothing about validity)."""
    return raw.startswith(MAGIC)


def parse_secret(key_id: str, secret: str) -> bytes:
    """A configured secret as bytes: ``"hex:..."`` is hex, anything else its UTF-8 bytes."""
    if not isinstance(secret, str):
        raise AuthError("config", f"secret of key {key_id!r} must be a string")
    if secret.startswith("hex:"):
        try:
            return bytes.fromhex(secret[4:])
        except ValueError:
            # The secret itself stays out of the message: errors end up in logs.
            raise AuthError("config", f"secret of key {key_id!r} is not valid hex") from None
    return secret.encode("utf-8")


def _check_key_id(key_id: Any) -> bytes:
    if not isinstance(key_id, str) or not key_id:
        raise AuthError("config", f"key id {key_id!r} must be a non-empty string")
    # ':' delimits the header; non-printables would make ids ambiguous in logs.
    if ":" in key_id or not key_id.isprintable():
        raise AuthError("config", f"key id {key_id!r} must be printable and must not contain ':'")
    raw = key_id.encode("utf-8")
    if len(raw) > MAX_KEY_ID_BYTES:
        raise AuthError("config", f"key id {key_id[:20]!r}... is longer than {MAX_KEY_ID_BYTES} bytes")
    return raw


class Keyring:
    """Immutable set of HMAC keys: seals with one, opens with any."""

    __slots__ = ("_macs", "_sign_id", "_sign_mac", "key_ids", "signing_key_id", "window")

    key_ids: frozenset[str]
    signing_key_id: str
    window: float
    _macs: Mapping[bytes, hmac.HMAC]
    _sign_id: bytes
    _sign_mac: hmac.HMAC

    def __init__(self, keys: Mapping[str, bytes], signing_key_id: str, window: float = 60.0) -> None:
        if not keys:
            raise AuthError("config", "no keys given")
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not math.isfinite(window) or window <= 0:
            raise AuthError("config", f"auth window must be a finite number of seconds > 0, not {window!r}")
        macs: dict[bytes, hmac.HMAC] = {}
        for key_id, secret in keys.items():
            raw_id = _check_key_id(key_id)
            if not isinstance(secret, (bytes, bytearray)):
                raise AuthError("config", f"secret of key {key_id!r} must be bytes")
            if len(secret) < MIN_SECRET_BYTES:
                raise AuthError(
                    "config", f"secret of key {key_id!r} is {len(secret)} bytes, at least {MIN_SECRET_BYTES} needed"
                )
            # Keyed once here; each seal/open copies the state instead of re-deriving the pads.
            macs[raw_id] = hmac.new(bytes(secret), digestmod="sha256")
        if not isinstance(signing_key_id, str) or signing_key_id not in keys:
            raise AuthError("config", f"signing key id {signing_key_id!r} is not among the keys {sorted(keys)}")
        sign_id = signing_key_id.encode("utf-8")
        _set = object.__setattr__
        _set(self, "key_ids", frozenset(keys))
        _set(self, "signing_key_id", signing_key_id)
        _set(self, "window", float(window))
        _set(self, "_macs", macs)
        _set(self, "_sign_id", sign_id)
        _set(self, "_sign_mac", macs[sign_id])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Keyring is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Keyring is immutable")

    def __repr__(self) -> str:
        # Never the secrets: keyrings end up in logs and tracebacks.
        ids = sorted(self.key_ids)
        return f"Keyring(signing_key_id={self.signing_key_id!r}, key_ids={ids!r}, window={self.window})"

    @classmethod
    def from_config(cls, config: _AuthSettings) -> Keyring | None:
        """The keyring ``config`` asks for, or None when auth is off (no keys, no key id)."""
        keys = config.auth_keys
        key_id = config.auth_key_id
        if not keys and key_id is None:
            return None
        if not isinstance(keys, Mapping):
            raise AuthError("config", "auth_keys must map key ids to secrets")
        if not keys:
            raise AuthError("config", f"auth_key_id {key_id!r} is set but auth_keys is empty")
        if key_id is None:
            raise AuthError("config", "auth_keys is set but auth_key_id (the key that signs) is not")
        if key_id not in keys:
            raise AuthError("config", f"auth_key_id {key_id!r} is not among auth_keys {sorted(map(str, keys))}")
        secrets: dict[str, bytes] = {}
        for kid, secret in keys.items():
            _check_key_id(kid)
            secrets[kid] = parse_secret(kid, secret)
        return cls(secrets, key_id, config.auth_window)

    def seal(self, context: bytes, payload: bytes, *, now: float | None = None) -> bytes:
        """``payload`` in the sealed wire form, signed with the signing key for ``context``."""
        ts = round((time.time() if now is None else now) * 1000)
        if ts < 0:
            raise ValueError(f"cannot seal at negative time {ts}ms")
        header = b"%s%s:%d:" % (MAGIC, self._sign_id, ts)
        mac = self._sign_mac.copy()
        mac.update(len(context).to_bytes(2, "big"))
        mac.update(context)
        mac.update(header)
        mac.update(payload)
        return b"%s%s:%s" % (header, mac.hexdigest().encode("ascii"), payload)

    def open(self, context: bytes, raw: bytes, *, now: float | None = None) -> bytes:
        """The payload of sealed ``raw`` for ``context``; raises :class:`AuthError` otherwise."""
        if not raw.startswith(MAGIC):
            raise AuthError("missing", "message is not sealed")
        # Bounded searches: a huge payload is never scanned for the header's delimiters.
        id_end = raw.find(b":", _MAGIC_LEN, _MAGIC_LEN + MAX_KEY_ID_BYTES + 1)
        if id_end <= _MAGIC_LEN:
            raise AuthError("malformed", "no key id in the header")
        ts_end = raw.find(b":", id_end + 1, id_end + _MAX_TS_DIGITS + 2)
        ts_raw = raw[id_end + 1 : ts_end]
        if ts_end < 0 or not ts_raw.isdigit():
            raise AuthError("malformed", "no timestamp in the header")
        tag_end = ts_end + 1 + _TAG_HEX
        if raw[tag_end : tag_end + 1] != b":":
            raise AuthError("malformed", "no tag in the header")
        key_id = raw[_MAGIC_LEN:id_end]
        base = self._macs.get(key_id)
        if base is None:
            raise AuthError("unknown_key", f"key id {key_id.decode('utf-8', 'replace')!r} is not known")
        view = memoryview(raw)
        mac = base.copy()
        mac.update(len(context).to_bytes(2, "big"))
        mac.update(context)
        mac.update(view[: ts_end + 1])
        mac.update(view[tag_end + 1 :])
        if not hmac.compare_digest(mac.hexdigest().encode("ascii"), raw[ts_end + 1 : tag_end]):
            raise AuthError("bad_mac", "the MAC does not match (tampered, another key, or another context)")
        # Checked after the MAC, so "stale" always names an authentic message (clock skew or replay).
        skew = int(ts_raw) / 1000.0 - (time.time() if now is None else now)
        if abs(skew) > self.window:
            raise AuthError("stale", f"timestamp is {skew:+.3f}s from now, outside ±{self.window}s")
        return raw[tag_end + 1 :]
