"""HMAC sealing of control messages: round trip, every failure kind, rotation, freshness, config."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushactors.core.config import ConfigError, PushConfig
from pushactors.transport.auth import MAGIC, AuthError, Keyring, is_sealed

T0 = 1_700_000_000.0
OLD = b"old-secret-0123456789"
NEW = b"new-secret-0123456789"


def ring(keys: dict[str, bytes] | None = None, signer: str = "k1", window: float = 60.0) -> Keyring:
    return Keyring(keys if keys is not None else {"k1": OLD}, signer, window)


def kind_of(fn, *args, **kwargs) -> str:
    with pytest.raises(AuthError) as err:
        fn(*args, **kwargs)
    return err.value.kind


def test_round_trip_and_layout() -> None:
    k = ring()
    sealed = k.seal(b"notif", b"HB:req-1,req-2", now=T0)
    assert is_sealed(sealed) and not is_sealed(b"HB:req-1")
    assert sealed.startswith(MAGIC + b"k1:1700000000000:")
    magic, key_id, ts, tag, payload = sealed.split(b":", 4)
    assert (magic, key_id, ts) == (b"PAMAC1", b"k1", b"1700000000000")
    assert len(tag) == 64 and int(tag, 16) >= 0 and tag == tag.lower()
    assert payload == b"HB:req-1,req-2"
    assert k.open(b"notif", sealed, now=T0) == b"HB:req-1,req-2"


@given(payload=st.binary(max_size=300), context=st.binary(min_size=1, max_size=16))
@settings(max_examples=60, deadline=None)
def test_round_trip_any_bytes(payload: bytes, context: bytes) -> None:
    k = ring()
    assert k.open(context, k.seal(context, payload, now=T0), now=T0) == payload


def test_empty_payload() -> None:
    k = ring()
    assert k.open(b"x", k.seal(b"x", b"", now=T0), now=T0) == b""


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (b"PUSH_REG:\x80", "missing"),
        (b"", "missing"),
        (b"PAMAC1", "missing"),
        (b"PAMAC1:", "malformed"),
        (b"PAMAC1::1:" + b"0" * 64 + b":", "malformed"),  # empty key id
        (b"PAMAC1:k1:" + b"0" * 64 + b":x", "malformed"),  # no timestamp
        (b"PAMAC1:k1::" + b"0" * 64 + b":x", "malformed"),  # empty timestamp
        (b"PAMAC1:k1:-5:" + b"0" * 64 + b":x", "malformed"),
        (b"PAMAC1:k1:1" + b"0" * 20 + b":" + b"0" * 64 + b":x", "malformed"),  # too many digits
        (b"PAMAC1:k1:1:" + b"0" * 63 + b":x", "malformed"),  # short tag
        (b"PAMAC1:k1:1:" + b"0" * 64, "malformed"),  # no separator after the tag
        (b"PAMAC1:" + b"k" * 80 + b":1:" + b"0" * 64 + b":x", "malformed"),  # key id too long
        (b"PAMAC1:k9:1:" + b"0" * 64 + b":x", "unknown_key"),
        (b"PAMAC1:k1:1:" + b"0" * 64 + b":x", "bad_mac"),
    ],
)
def test_every_open_failure_is_typed(raw: bytes, kind: str) -> None:
    assert kind_of(ring().open, b"notif", raw, now=T0) == kind


def test_error_is_a_value_error_with_a_message() -> None:
    with pytest.raises(ValueError, match="missing"):
        ring().open(b"notif", b"plain")


def test_stale_both_ways() -> None:
    k = ring()
    sealed = k.seal(b"notif", b"p", now=T0)
    assert kind_of(k.open, b"notif", sealed, now=T0 + 3600) == "stale"
    assert kind_of(k.open, b"notif", sealed, now=T0 - 3600) == "stale"


@pytest.mark.parametrize("window", [0.5, 60.0])
def test_freshness_window_edges(window: float) -> None:
    k = ring(window=window)
    sealed = k.seal(b"notif", b"p", now=T0)
    for now in (T0, T0 + window, T0 - window, T0 + window - 0.001, T0 - window + 0.001):
        assert k.open(b"notif", sealed, now=now) == b"p"
    for now in (T0 + window + 0.002, T0 - window - 0.002):
        assert kind_of(k.open, b"notif", sealed, now=now) == "stale"


def test_default_now_is_wall_clock() -> None:
    k = ring()
    assert k.open(b"c", k.seal(b"c", b"p")) == b"p"
    assert kind_of(k.open, b"c", k.seal(b"c", b"p", now=T0)) == "stale"


def test_tampering_any_byte_is_caught() -> None:
    k = ring()
    sealed = k.seal(b"notif", b"req-1:2", now=T0)
    for i in range(len(sealed)):
        for delta in (1, 0x20, 0x80):
            forged = bytearray(sealed)
            forged[i] = (forged[i] + delta) % 256
            with pytest.raises(AuthError):
                k.open(b"notif", bytes(forged), now=T0)
    # Dropping or adding bytes anywhere is caught too.
    for i in range(len(sealed)):
        with pytest.raises(AuthError):
            k.open(b"notif", sealed[:i] + sealed[i + 1 :], now=T0)
        with pytest.raises(AuthError):
            k.open(b"notif", sealed[:i] + b"0" + sealed[i:], now=T0)


def test_tampering_by_field() -> None:
    k = ring({"k1": OLD, "k2": NEW})
    sealed = k.seal(b"notif", b"req-1:2", now=T0)
    tag = sealed.split(b":")[3]
    # Payload, timestamp (same length and a leading-zero respelling), key id, tag.
    assert kind_of(k.open, b"notif", sealed.replace(b"req-1", b"req-2"), now=T0) == "bad_mac"
    assert kind_of(k.open, b"notif", sealed.replace(b":1700000000000:", b":1700000000001:"), now=T0) == "bad_mac"
    assert kind_of(k.open, b"notif", sealed.replace(b":1700000000000:", b":01700000000000:"), now=T0) == "bad_mac"
    assert kind_of(k.open, b"notif", sealed.replace(b"PAMAC1:k1:", b"PAMAC1:k2:"), now=T0) == "bad_mac"
    assert kind_of(k.open, b"notif", sealed.replace(tag, tag.upper()), now=T0) == "bad_mac"
    assert kind_of(k.open, b"notif", sealed.replace(tag, b"0" * 64), now=T0) == "bad_mac"
    # A payload that moves bytes into the header (or out) does not verify.
    assert kind_of(k.open, b"notif", sealed + b"x", now=T0) == "bad_mac"


@given(data=st.data())
@settings(max_examples=80, deadline=None)
def test_random_tampering_is_caught(data: st.DataObject) -> None:
    k = ring()
    payload = data.draw(st.binary(max_size=64))
    sealed = k.seal(b"notif", payload, now=T0)
    i = data.draw(st.integers(0, len(sealed) - 1))
    b = data.draw(st.integers(0, 255).filter(lambda v: v != sealed[i]))
    forged = sealed[:i] + bytes([b]) + sealed[i + 1 :]
    with pytest.raises(AuthError):
        k.open(b"notif", forged, now=T0)


def test_cross_context_replay_is_refused() -> None:
    k = ring()
    for a, b in [(b"notif", b"hs-req"), (b"hs-req", b"hs-reply"), (b"hs-reply", b"notif"), (b"ab", b"a")]:
        sealed = k.seal(a, b"same payload", now=T0)
        assert kind_of(k.open, b, sealed, now=T0) == "bad_mac"
        assert k.open(a, sealed, now=T0) == b"same payload"


def test_context_and_payload_boundary_is_unambiguous() -> None:
    # The context is length-prefixed: moving bytes between it and the header cannot collide.
    k = ring()
    assert kind_of(k.open, b"notifPAMAC1", k.seal(b"notif", b"x", now=T0), now=T0) == "bad_mac"


def test_another_key_with_the_same_id_is_refused() -> None:
    ours, theirs = ring({"k1": OLD}), ring({"k1": NEW})
    assert kind_of(ours.open, b"notif", theirs.seal(b"notif", b"p", now=T0), now=T0) == "bad_mac"


def test_rotation() -> None:
    before = ring({"old": OLD}, "old")
    during_old = ring({"old": OLD, "new": NEW}, "old")
    during_new = ring({"old": OLD, "new": NEW}, "new")
    after = ring({"new": NEW}, "new")
    from_old = before.seal(b"notif", b"p", now=T0)
    from_new = during_new.seal(b"notif", b"p", now=T0)
    assert from_new.startswith(b"PAMAC1:new:")
    # While both keys are listed everyone accepts both.
    for k in (during_old, during_new):
        assert k.open(b"notif", from_old, now=T0) == b"p"
        assert k.open(b"notif", from_new, now=T0) == b"p"
    # An engine not yet given the new key refuses its messages (that is why keys go out first).
    assert kind_of(before.open, b"notif", from_new, now=T0) == "unknown_key"
    # Once the old key is removed its messages are refused.
    assert after.open(b"notif", from_new, now=T0) == b"p"
    assert kind_of(after.open, b"notif", from_old, now=T0) == "unknown_key"


def test_keyring_is_immutable_and_hides_secrets() -> None:
    k = ring({"k1": OLD, "k2": NEW})
    with pytest.raises(AttributeError):
        k.window = 1.0
    with pytest.raises(AttributeError):
        del k.signing_key_id
    assert k.key_ids == frozenset({"k1", "k2"}) and k.signing_key_id == "k1" and k.window == 60.0
    assert OLD.decode() not in repr(k) and NEW.decode() not in repr(k) and "k2" in repr(k)


@pytest.mark.parametrize(
    ("keys", "signer", "window"),
    [
        ({}, "k1", 60.0),
        ({"k1": b"short"}, "k1", 60.0),
        ({"k1": OLD}, "k2", 60.0),
        ({"a:b": OLD}, "a:b", 60.0),
        ({"": OLD}, "", 60.0),
        ({"k1": OLD}, "k1", 0.0),
        ({"k1": OLD}, "k1", float("inf")),
        ({"k1": "a string"}, "k1", 60.0),
    ],
)
def test_keyring_constructor_validates(keys, signer, window) -> None:
    assert kind_of(Keyring, keys, signer, window) == "config"


# --- configuration ---------------------------------------------------------------------------


def cfg(**kw) -> PushConfig:
    return PushConfig(engine_id="e", **kw)


def test_auth_off_by_default() -> None:
    assert Keyring.from_config(cfg()) is None


def test_from_config() -> None:
    k = Keyring.from_config(
        cfg(auth_keys={"a": "0123456789abcdef", "b": "hex:" + "ab" * 16}, auth_key_id="b", auth_window=5.0)
    )
    assert k is not None and k.signing_key_id == "b" and k.window == 5.0
    assert k.key_ids == frozenset({"a", "b"})
    # "hex:" secrets are decoded: a keyring built from the raw bytes interoperates.
    twin = Keyring({"b": bytes.fromhex("ab" * 16)}, "b")
    assert twin.open(b"c", k.seal(b"c", b"p", now=T0), now=T0) == b"p"
    utf8 = Keyring({"a": b"0123456789abcdef"}, "a")
    k_a = Keyring.from_config(cfg(auth_keys={"a": "0123456789abcdef"}, auth_key_id="a"))
    assert k_a is not None and utf8.open(b"c", k_a.seal(b"c", b"p", now=T0), now=T0) == b"p"


def test_from_dict_builds_a_keyring() -> None:
    conf = PushConfig.from_dict({"engine_id": "e", "auth_keys": {"a": "x" * 16}, "auth_key_id": "a"})
    assert Keyring.from_config(conf) is not None


@pytest.mark.parametrize(
    ("keys", "key_id", "needle"),
    [
        ({"a": "x" * 16}, None, "auth_key_id"),  # keys without a signer
        ({}, "a", "auth_keys is empty"),  # signer without keys
        ({"a": "x" * 16}, "b", "not among"),  # signer not listed
        ({"a": "x" * 15}, "a", "at least 16"),  # too short
        ({"a": "hex:" + "ab" * 15}, "a", "at least 16"),  # hex: 15 bytes
        ({"a": "hex:zz" + "ab" * 16}, "a", "not valid hex"),
        ({"a": "hex:abc" + "ab" * 16}, "a", "not valid hex"),  # odd length
        ({"": "x" * 16}, "", "non-empty"),
        ({"a:b": "x" * 16}, "a:b", "':'"),
        ({"a\nb": "x" * 16}, "a\nb", "printable"),
        ({"a\x00": "x" * 16}, "a\x00", "printable"),
        ({"a": "x" * 16, "b:c": "y" * 16}, "a", "':'"),  # a verifying-only key is checked too
        ({"k" * 65: "x" * 16}, "k" * 65, "longer than"),
    ],
)
def test_config_validation(keys, key_id, needle) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        cfg(auth_keys=keys, auth_key_id=key_id)
    # Secrets never appear in the error.
    for secret in keys.values():
        if len(secret) >= 16:
            assert secret not in str(err.value)
