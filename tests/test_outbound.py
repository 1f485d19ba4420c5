"""Thread-free unit tests of what a rank sends (``pushactors.actors.writer.outbound``)."""

from __future__ import annotations

import pytest

from pushactors.actors.writer.outbound import MAX_HEARTBEAT_BYTES, Outbound
from pushactors.core.config import PushConfig
from pushactors.protocol import Completion, Heartbeat, PushFailure, decode_notification
from pushactors.transport.auth import AuthError, Keyring


def keyring() -> Keyring:
    ring = Keyring.from_config(PushConfig(engine_id="e", auth_keys={"k": "0123456789abcdef0123"}, auth_key_id="k"))
    assert ring is not None
    return ring


def test_without_keys_payloads_are_the_plain_wire_format() -> None:
    out = Outbound(None, tp_rank=1, pp_rank=0, tp_size=2)
    assert decode_notification(out.completion("d-1")) == Completion("d-1", 2)
    failure = decode_notification(out.push_failure("d-1", "x" * 5000, final=False))
    assert isinstance(failure, PushFailure) and failure.tp_rank == 1 and not failure.final
    assert len(failure.reason) == 1000  # bounded
    assert out.open(b"anything") == b"anything"


def test_heartbeats_are_split_into_bounded_notifications() -> None:
    ids = tuple(f"tx-{i:06d}-{'a' * 40}" for i in range(3000))
    payloads = Outbound.heartbeats(ids)
    assert len(payloads) > 1 and all(len(p) <= MAX_HEARTBEAT_BYTES + 64 for p in payloads)
    got = [i for p in payloads for i in decode_notification(p).ids]  # type: ignore[union-attr]
    assert tuple(got) == ids
    assert all(isinstance(decode_notification(p), Heartbeat) for p in payloads)


def test_with_keys_every_payload_is_sealed_and_only_sealed_ones_open() -> None:
    out = Outbound(keyring(), tp_rank=0, pp_rank=0, tp_size=1)
    sealed = out.completion("d-1")
    assert sealed.startswith(b"PAMAC1:")
    assert decode_notification(out.open(sealed)) == Completion("d-1", 1)
    with pytest.raises(AuthError):
        out.open(b"d-1:1")  # unsigned
    assert out.open(out.seal(b"HB:x")) == b"HB:x"
