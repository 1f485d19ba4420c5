"""The timing rules of ``PushConfig`` (docs/reliability.md, "Timing rules"): settings under which a
late WRITE could land in reused blocks, a stale message could be acted on, or a lost final answer
could leave D holding blocks forever are refused at construction, naming both settings and the
rule, unless ``allow_unsafe_timing`` (or its old name ``allow_unsafe_quarantine``) is set."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from test_soak import FAKE_CONFIG

from pushactors.core.config import ConfigError, PushConfig

KEYS: dict[str, Any] = {"auth_keys": {"k1": "0123456789abcdef0123"}, "auth_key_id": "k1"}

# (id, settings that break exactly one rule with every other setting at its default, a regex
# the refusal must match: both settings and the rule).
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "write_timeout_not_below_quarantine",
        {"write_timeout": 50.0},
        r"write_timeout 50.0s >= abort_quarantine 45.0s \(rule: write_timeout < abort_quarantine\)",
    ),
    (
        "quarantine_below_its_safe_bound",
        {"abort_quarantine": 30.0, "tombstone_ttl": 600.0},
        r"abort_quarantine 30.0s < 40.10s \(rule: abort_quarantine >= 2/3 lease_duration \+ write_timeout "
        r"\+ 2 reaper_tick\)",
    ),
    (
        "tombstone_ttl_below_quarantine",
        {"tombstone_ttl": 45.05},
        r"tombstone_ttl 45.05s < abort_quarantine \+ 2 reaper_tick = 45.10s "
        r"\(rule: tombstone_ttl >= abort_quarantine \+ 2 reaper_tick\).*holding the blocks forever",
    ),
    (
        "engine_ttl_below_quarantine",
        {"engine_ttl": 30.0},
        r"engine_ttl 30.0s < abort_quarantine \+ 2 reaper_tick = 45.10s "
        r"\(rule: engine_ttl >= abort_quarantine \+ 2 reaper_tick\).*holding the blocks forever",
    ),
    (
        "tombstone_ttl_below_the_replay_window",
        {**KEYS, "tombstone_ttl": 70.0},
        r"tombstone_ttl 70.0s < auth_window \+ 2 handshake_timeout = 80.00s "
        r"\(rule, with auth_keys: tombstone_ttl >= auth_window \+ 2 handshake_timeout\)",
    ),
    (
        "pinned_write_limit_below_a_writes_life",
        {"pinned_write_limit": 20.05},
        r"pinned_write_limit 20.05s < write_timeout \+ 2 reaper_tick = 20.10s "
        r"\(rule: pinned_write_limit >= write_timeout \+ 2 reaper_tick\)",
    ),
    (
        "busy_polling_slower_than_the_tick",
        {"poll_interval_busy": 0.1, "poll_interval_idle": 0.2},
        r"poll_interval_busy 0.1s > reaper_tick 0.05s \(rule: poll_interval_busy <= reaper_tick\)",
    ),
]
IDS = [case[0] for case in REFUSED]


def test_the_defaults_break_no_timing_rule() -> None:
    config = PushConfig(engine_id="e")
    assert config.timing_violations() == []
    assert config.safety_warnings() == []
    assert not config.unsafe_timing_allowed
    assert PushConfig(engine_id="e", **KEYS).timing_violations() == []  # the replay rule, at defaults


@pytest.mark.parametrize(("name", "settings", "message"), REFUSED, ids=IDS)
def test_each_unsafe_combination_is_refused_naming_both_settings_and_the_rule(
    name: str, settings: dict[str, Any], message: str
) -> None:
    fields = {"engine_id": "e", **settings}
    with pytest.raises(ConfigError, match=message) as refused:
        PushConfig(**fields)
    assert "allow_unsafe_timing" in str(refused.value)
    with pytest.raises(ConfigError, match=message):
        PushConfig.from_dict(fields)
    # Exactly this rule is broken: the refusal is about it alone.
    violations = PushConfig(engine_id="e", allow_unsafe_timing=True, **settings).timing_violations()
    assert len(violations) == 1, violations


@pytest.mark.parametrize("flag", ["allow_unsafe_timing", "allow_unsafe_quarantine"])
@pytest.mark.parametrize(("name", "settings", "message"), REFUSED, ids=IDS)
def test_the_unsafe_flag_or_its_old_name_lets_each_combination_through(
    flag: str, name: str, settings: dict[str, Any], message: str
) -> None:
    for config in (
        PushConfig(engine_id="e", **settings, **{flag: True}),
        PushConfig.from_dict({"engine_id": "e", **settings, flag: True}),
    ):
        assert config.unsafe_timing_allowed
        # Still said, so a worker started with them logs it (config.unsafe).
        warnings = config.safety_warnings()
        assert len(warnings) == 1 and re.search(message, warnings[0]), warnings


def test_the_flag_must_be_a_boolean() -> None:
    with pytest.raises(ConfigError, match="allow_unsafe_timing must be true or false"):
        PushConfig(engine_id="e", allow_unsafe_timing="yes")  # type: ignore[arg-type]


def test_the_scenario_timings_need_the_flag_and_the_soak_timings_do_not() -> None:
    """The pair scenarios run quarantines far below the safe bound (tests/scenario_kit.FAST
    sets the flag); the soak's timings are safe by every rule."""
    short = {"lease_duration": 1.0, "registration_timeout": 2.0, "abort_quarantine": 0.4, "reaper_tick": 0.01}
    with pytest.raises(ConfigError, match="abort_quarantine"):
        PushConfig(engine_id="e", **short)
    soak = FAKE_CONFIG
    assert PushConfig(engine_id="e", **soak).timing_violations() == []
    assert PushConfig(engine_id="e", **soak, **KEYS).timing_violations() == []


def test_every_broken_rule_is_named_at_once() -> None:
    with pytest.raises(ConfigError) as refused:
        PushConfig(engine_id="e", tombstone_ttl=10.0, engine_ttl=10.0)
    assert "tombstone_ttl 10.0s" in str(refused.value) and "engine_ttl 10.0s" in str(refused.value)


def test_cancel_settle_is_still_accepted_but_warned_about_and_ignored() -> None:
    """P no longer believes a cancel after a settle time: it never releases a WRITE still in
    progress to cancel it, and waits for NIXL to say it ended. A config that still names
    ``cancel_settle`` keeps loading (an unknown-field error would break a deployment over a
    setting that now does nothing), with a FutureWarning saying it is ignored."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is said about a config that does not name it
        assert PushConfig(engine_id="e").deprecations() == []
    with pytest.warns(FutureWarning, match=r"cancel_settle \(1.5s\) is deprecated and ignored"):
        config = PushConfig(engine_id="e", write_timeout=4.0, cancel_settle=1.5)
    assert config.deprecations() and config.timing_violations() == []
    # Formerly refused (not below write_timeout): ignored now, so no longer an error.
    with pytest.warns(FutureWarning, match="cancel_settle"):
        PushConfig.from_dict({"engine_id": "e", "cancel_settle": 20.0})
    assert PushConfig(engine_id="e", pinned_write_limit=None).timing_violations() == []


# A layer-wise or chunked push posts for as long as its forward (or its gathers) run. What keeps
# it out of blocks D reused is that each of its WRITEs is posted only before D's promise, and
# that one still running write_timeout after the push's first WRITE is reported to D as "may
# still land": the quarantine rule (>= 2/3 lease + write_timeout + 2 ticks), write_timeout <
# abort_quarantine and the pin-limit rule then bound every WRITE of it, however long the push.
# So the settings that would let such a push outlive D's interest are refused like any unsafe
# timing, and only warned about (config.unsafe at the worker's start) when the flag waives them.
PUSH_MODES: list[dict[str, Any]] = [
    {"push_mode": "layerwise"},
    {"push_mode": "layerwise", "layers_per_write": 4},
    {"staging_bytes": 8 << 20, "staging_chunk_bytes": 1 << 20},
]
QUICK = [case for case in REFUSED if case[0] in (
    "write_timeout_not_below_quarantine", "quarantine_below_its_safe_bound", "pinned_write_limit_below_a_writes_life"
)]  # fmt: skip


@pytest.mark.parametrize("mode", PUSH_MODES, ids=["layerwise", "layerwise-groups", "staged-chunks"])
@pytest.mark.parametrize(("name", "settings", "message"), QUICK, ids=[c[0] for c in QUICK])
def test_a_push_in_parts_is_held_to_the_same_timing_rules_refused_or_warned(
    mode: dict[str, Any], name: str, settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        PushConfig(engine_id="e", **mode, **settings)
    waived = PushConfig(engine_id="e", allow_unsafe_timing=True, **mode, **settings)
    (warning,) = waived.safety_warnings()
    assert re.search(message, warning)


def test_a_quarantine_shorter_than_a_layerwise_forward_is_safe_once_each_write_is_checked() -> None:
    """The settings the layer-wise tests run (tests/test_integrity_p.py): D's quarantine (3.2 s)
    is shorter than a forward may take, and that is safe, as no layer goes past D's promise
    (2 s past its last heartbeat) and the stuck timer runs from the push's first WRITE."""
    safe = {"lease_duration": 3.0, "write_timeout": 1.0, "abort_quarantine": 3.2, "reaper_tick": 0.05}
    config = PushConfig(engine_id="e", push_mode="layerwise", **safe)
    assert config.timing_violations() == []
    assert config.abort_quarantine >= config.registration_keep + config.write_timeout + 2 * config.reaper_tick
    with pytest.raises(ConfigError, match=r"abort_quarantine 3\.0s < 3\.10s"):
        PushConfig(engine_id="e", push_mode="layerwise", **{**safe, "abort_quarantine": 3.0})


def test_a_worker_started_with_a_deprecated_setting_says_so_in_its_log() -> None:
    """The FutureWarning reaches whoever built the config; an operator reads the worker's log,
    so each worker says it too, once, at its start."""
    from pushactors.logs import capture_events
    from pushactors.testing import PushPair

    with pytest.warns(FutureWarning), capture_events(level="warning") as events:
        pair = PushPair(write_timeout=4.0, cancel_settle=1.5)
        pair.close()
    said = events.named("config.deprecated")
    assert len(said) == 2 and all("cancel_settle" in e["reason"] for e in said), said
    with capture_events(level="warning") as quiet:
        PushPair().close()
    assert quiet.named("config.deprecated") == []


def test_the_operations_guides_longer_lease_is_accepted_and_the_lease_alone_is_refused() -> None:
    """docs/operations.md, "Lease expired": raising the lease alone breaks the quarantine rule
    (and the error says so); raising the quarantine with it, as the guide says, is accepted."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    assert "lease_duration=60, abort_quarantine=61" in text
    with pytest.raises(ConfigError, match="abort_quarantine"):
        PushConfig(engine_id="e", lease_duration=60)
    cfg = PushConfig(engine_id="e", lease_duration=60, abort_quarantine=61)
    assert cfg.lease_duration == 60 and cfg.abort_quarantine == 61
