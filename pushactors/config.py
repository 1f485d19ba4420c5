"""Settings of one engine's push transport. Every duration is in seconds."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct

Seconds = Annotated[float, Meta(gt=0)]
Role = Literal["producer", "consumer", "both"]


class ConfigError(ValueError):
    """Settings that cannot work; raised before anything starts."""


class PushConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine_id: Annotated[str, Meta(min_length=1, max_length=256)]
    role: Role = "both"
    # P: blocks of a finished prefill stay leased this long waiting for their push.
    lease_duration: Seconds = 30.0
    # D: send HB: for awaited requests this often (default lease_duration / 6).
    heartbeat_interval: Union[Seconds, None] = None
    # D: a registration that never saw its push fails after this long.
    registration_timeout: Seconds = 480.0
    # D: blocks of an aborted or timed-out request stay unused this long at most when P does
    # not answer. P posts no WRITE past its lease (which D's heartbeats extended to at most
    # 2/3 lease ahead, and D stops heartbeating on abort) and cancels any WRITE in flight past
    # write_timeout, so with P's settings this is safe when >= 2/3 lease + write_timeout.
    abort_quarantine: Seconds = 45.0
    # P: a WRITE in flight this long is cancelled and fails (a dead peer must not pin blocks).
    write_timeout: Seconds = 20.0
    # Remote engines idle this long are forgotten (never while a transfer is in flight).
    engine_ttl: Seconds = 3600.0
    # How long P remembers requests it finished, expired or failed (late registrations).
    tombstone_ttl: Seconds = 600.0
    # P: registrations that never meet their finished blocks are dropped after this long.
    orphan_registration_ttl: Seconds = 480.0
    handshake_timeout: Seconds = 10.0
    handshake_workers: Annotated[int, Meta(ge=1, le=64)] = 4
    # Writer polling of NIXL: tight while transfers are in flight, backing off when idle.
    poll_interval_busy: Seconds = 0.0002
    poll_interval_idle: Seconds = 0.002
    reaper_tick: Seconds = 0.05
    # Registrations without a matching transfer_id are refused when this is set.
    require_transfer_id: bool = False
    # Side channel (ZMQ) for handshakes.
    side_channel_host: str = "127.0.0.1"
    side_channel_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    backends: tuple[str, ...] = ("UCX",)
    # Where the JSON-lines mailbox log goes (None: not written).
    log_json: Union[str, None] = None
    # Test-only negative control: let a request's kv_transfer_params ask P to push noise.
    debug_allow_noise: bool = False

    def __post_init__(self) -> None:
        if self.poll_interval_busy > self.poll_interval_idle:
            raise ValueError("poll_interval_busy must not exceed poll_interval_idle")

    def safety_warnings(self) -> list[str]:
        """Settings that open a window for a late WRITE into reused blocks (same settings on P
        and D assumed); the worker logs them at start."""
        need = self.lease_duration * 2 / 3 + self.write_timeout
        if self.abort_quarantine < need:
            return [
                f"abort_quarantine {self.abort_quarantine}s < 2/3 lease_duration + write_timeout = {need:.1f}s: "
                "a WRITE from a P that missed D's abort could land after D reused the blocks"
            ]
        return []

    @property
    def heartbeat_every(self) -> float:
        return self.heartbeat_interval if self.heartbeat_interval is not None else self.lease_duration / 6

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PushConfig:
        """Build from a plain mapping (e.g. ``kv_connector_extra_config``) with clear errors."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid pushactors settings: {exc}") from None

    def replace(self, **changes: Any) -> PushConfig:
        return msgspec.structs.replace(self, **changes)
