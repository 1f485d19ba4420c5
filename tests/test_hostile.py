"""Integrity: a third, hostile process forges control messages at a real P and D during a soak.

P and D run in their own processes over real NIXL (DRAM) and real ZMQ side channels; the
hostile (:mod:`pushactors.testing.hostile`) fetches their metadata, loads both agents, serves
side channels of its own that claim D's and P's engine ids, and sends forged registrations,
completions, push failures, heartbeats and aborts while the router runs a soak whose every
request carries a transfer id the router minted (unguessable). The parent also leaks each
request's exact P and D ids to the hostile (ids are not secrets; transfer ids are).

Nothing it sends may change a request's bytes or outcome: every request lands, every byte
verifies, P's blocks are all freed, and the forgeries show up as counted drops. With
``auth_keys`` on P and D (not known to the hostile), the hostile also sends under agent names
identical to the real peers' (NIXL does not authenticate names): only HMAC stops those, so
``notif.unauthenticated`` counts them on both sides.

Two cases found by this hostile are kept as tests of their own: a hostile side channel that
replays a real peer's handshake payload must bind nothing (an address binds an agent only on
that agent's own word), and a forged registration naming a live D id before D's own must not
hold D's slot on P (slots are keyed by sender too).

Sizes: 300 requests in CI (``PUSHACTORS_SOAK_N`` overrides); ``PUSHACTORS_LONG=1`` runs the
``slow`` variants (5,000).
"""

from __future__ import annotations

import os
import random
import secrets
import time
from typing import Any

import pytest

from pushactors.core.config import PushConfig
from pushactors.core.registry import Post, PRegistry, Refuse
from pushactors.protocol import HandshakeRequest, PeerKey, Registration
from pushactors.testing.engine import SimSpec
from pushactors.testing.hostile import EngineAddr, Hostile, HostileSpec
from pushactors.testing.node import Dispatcher, Node, NodeSpec
from pushactors.testing.pair import wait_until
from pushactors.transport.auth import Keyring
from pushactors.transport.sidechannel import CTX_REPLY, SideChannelClient

pytestmark = pytest.mark.real_nixl

SEED = int(os.environ.get("PUSHACTORS_SOAK_SEED", "20240611"))
SPEC = SimSpec(num_layers=2, num_blocks=256, block_bytes=1024)
# Generous against a loaded 2-core box (every request must succeed), short enough that the
# hostile's orphaned registrations are refused during the run.
CONFIG: dict[str, Any] = {
    "lease_duration": 6.0,
    "registration_timeout": 20.0,
    "abort_quarantine": 9.0,
    "write_timeout": 4.0,
    "reaper_tick": 0.02,
    "heartbeat_interval": 0.5,
    "handshake_timeout": 5.0,
    "orphan_registration_ttl": 3.0,
}
KEY_ID = "k1"  # the hostile guesses this id too (its MACs then fail as bad_mac)


def _metrics(stats: dict[str, Any]) -> dict[str, int]:
    return stats["metrics"]  # type: ignore[no-any-return]


def _await_counter(node: Node, counter: str, timeout: float) -> int:
    """Poll a node's counter until it is non-zero (or fail after ``timeout``); its value."""
    seen = [0]

    def nonzero() -> bool:
        seen[0] = _metrics(node.stats()).get(counter, 0)
        return seen[0] > 0

    wait_until(nonzero, timeout=timeout, interval=0.1, what=f"{node.spec.role} counter {counter}")
    return seen[0]


def _capture(node: Node, keyring: Keyring) -> dict[int, bytes]:
    """A keyed node's handshake reply as it crosses the wire: sealed (signed), not encrypted."""
    info = node.info
    client = SideChannelClient(keyring=keyring)
    out = {}
    for rank in range(info["tp_size"]):
        peer = PeerKey(info["engine_id"], info["host"], info["port"], 0, rank)
        payload = client.fetch(peer, HandshakeRequest(pp_rank=0, tp_rank=rank), timeout=10.0)
        out[rank] = keyring.seal(CTX_REPLY, payload)
    return out


def run_hostile_soak(
    n: int, seed: int, *, auth: bool, config_overrides: dict[str, Any] | None = None, **hostile_options: Any
) -> dict[str, Any]:
    config = {**CONFIG, **(config_overrides or {})}
    keyring = None
    if auth:
        config.update(auth_keys={KEY_ID: "hex:" + secrets.token_hex(32)}, auth_key_id=KEY_ID)
        keyring = Keyring.from_config(PushConfig(engine_id="eavesdropper", **config))
    router = Dispatcher(seed=seed, mint_transfer_ids=True)
    p = Node(
        NodeSpec(role="prefill", engine_id="prefill-h", sim=SPEC, config=config, seed=seed), on_event=router.on_event
    )
    d = Node(
        NodeSpec(role="decode", engine_id="decode-h", sim=SPEC, config=config, seed=seed + 1), on_event=router.on_event
    )
    hostile: Hostile | None = None
    report: dict[str, Any] = {}
    wall = time.monotonic()
    try:
        p_info = p.wait_ready()
        d_info = d.wait_ready()
        captured = {"p": _capture(p, keyring), "d": _capture(d, keyring)} if keyring is not None else {}
        hostile = Hostile(
            HostileSpec(
                p=EngineAddr(p_info["engine_id"], p_info["port"], p_info["tp_size"]),
                d=EngineAddr(d_info["engine_id"], d_info["port"], d_info["tp_size"]),
                guess_range=n,
                seed=seed,
                impersonate=auth,
                guess_key_id=KEY_ID,
                captured=captured,
                max_messages=40 * n,
                duration=max(60.0, n * 0.25),
                **hostile_options,
            )
        )
        ready = hostile.wait_ready()
        rng = random.Random(seed)
        max_blocks = 10
        window = SPEC.num_blocks // max_blocks - 2
        for i in range(n):
            assert router.wait_below(window, timeout=30), f"requests stopped finishing at #{i} (seed {seed})"
            o = router.dispatch_mixed(p, d, i, rng, max_blocks=max_blocks, block_size=SPEC.block_size)
            hostile.leak(o.d_id, o.p_id)
        done = router.wait_all(timeout=60)
        report = hostile.stop()
        hung = [o for o in router.outcomes if not o.done]
        assert done and not hung, f"{len(hung)} hung (seed {seed}): {hung[:5]}"
        # The registrations P admitted from the hostile's own address pair with nothing: they
        # are refused as orphans once orphan_registration_ttl passes.
        if report["sent"].get("p.reg_own_addr") and not auth and not hostile_options.get("replay_metadata"):
            _await_counter(p, "matcher.orphan_registration_dropped", timeout=config["orphan_registration_ttl"] + 10)
        p_quiet, p_stats = p.quiesce(timeout=30)
        d_quiet, d_stats = d.quiesce(timeout=30)
    finally:
        if hostile is not None:
            hostile.kill()
        p_final = p.stop()
        d_final = d.stop()
    wall = time.monotonic() - wall
    assert p.error is None and d.error is None, p.error or d.error
    assert p_final is not None and d_final is not None

    pm, dm = _metrics(p_stats), _metrics(d_stats)
    summary = {"n": n, "wall": round(wall, 1), "hostile": report, "ready": ready, "p": pm, "d": dm}
    bad = sum(not o.ok for o in router.outcomes)
    print(f"\nhostile soak (auth={auth}): seed={seed} requests={n} not ok={bad}; wall={wall:.1f}s")
    print(f"  hostile sent {report['total']}: {dict(sorted(report['sent'].items()))}")
    print(f"  hostile by agent: {report['by_agent']}")
    print(f"  hostile fetch: {report['fetch']}; received {report['received']} from {report['received_from']}")
    print(f"  hostile send errors: {report['send_errors']}; side channels asked: {report['handshakes_served']}")
    drops = ("rejected", "unknown", "wrong_sender", "unauthenticated", "orphan", "conflict", "unverified", "malformed")
    for side, m in (("P", pm), ("D", dm)):
        print(f"  {side} drops: {dict(sorted((k, v) for k, v in m.items() if any(w in k for w in drops)))}")
        print(f"  {side} notif kinds: {dict(sorted((k, v) for k, v in m.items() if k.startswith('notif.kind')))}")

    # Nothing the hostile sent changed a request's outcome or bytes.
    assert len(router.outcomes) == n
    failed = [(o.p_id, o.sent, o.received) for o in router.outcomes if not o.ok]
    assert not failed, f"{len(failed)} of {n} requests did not land cleanly (seed {seed}): {failed[:5]}"
    for o in router.outcomes:
        blocks = -(-o.tokens // SPEC.block_size) - o.cached
        assert o.checked == blocks * SPEC.block_bytes * 2 * SPEC.num_layers, o
    assert p_quiet and d_quiet, "push work still pending"
    assert p_stats["held"] == 0 and p_stats["free_blocks"] == SPEC.num_blocks, p_stats
    assert d_stats["free_blocks"] == SPEC.num_blocks, d_stats
    assert p_stats["healthy"] and d_stats["healthy"]
    assert pm["push.pushed"] == n and pm.get("push.failed", 0) == 0 and pm.get("push.expired", 0) == 0, pm
    assert dm["recv.finished"] == n and dm.get("recv.failed", 0) == 0, dm
    errors = {k: v for m in (pm, dm) for k, v in m.items() if k.endswith((".handler_error", ".died"))}
    assert not errors, f"actor handler errors: {errors}"
    # The hostile really attacked, and got nothing: no KV was ever written into its memory.
    assert report["total"] > 0 and not report["findings"], report
    assert report["own_bytes_written"] == 0, report
    return summary


def _check_unauthenticated_drops(s: dict[str, Any]) -> None:
    pm, dm, sent = s["p"], s["d"], s["hostile"]["sent"]
    # Forged registrations naming D's real address come from an agent D does not advertise.
    assert sent.get("p.reg_d_addr", 0) > 0 and pm.get("reg.rejected_sender", 0) > 0
    # Registrations naming the hostile's own side channel are admitted (it is the agent that
    # address advertises) but pair with nothing: refused as orphans.
    assert sent.get("p.reg_own_addr", 0) > 0 and pm.get("matcher.orphan_registration_dropped", 0) > 0
    # Heartbeats and aborts from an agent that registered nothing extend and end nothing.
    assert pm.get("matcher.heartbeat_unknown", 0) > 0
    assert pm.get("matcher.abort_unknown", 0) + pm.get("matcher.abort_wrong_sender", 0) > 0
    # Completions and push failures from an agent D never verified as P count for nothing.
    assert dm.get("reaper.notif_unknown_request", 0) > 0
    assert dm.get("reaper.notif_wrong_sender", 0) > 0
    # D is a consumer: it drops registrations outright, never handshaking on their word.
    assert dm.get("reg.not_producer", 0) > 0
    assert dm.get("reg.rejected_sender", 0) == 0 and dm.get("handshake.unclaimed", 0) == 0


def _check_auth_drops(s: dict[str, Any]) -> None:
    pm, dm, rep = s["p"], s["d"], s["hostile"]
    # The keyed side channels refused the hostile; it used payloads captured off the wire.
    assert all("refused (unauthorized)" in v for v in rep["fetch"].values()), rep["fetch"]
    # It sent under the real peers' own agent names, and NIXL delivered them.
    assert set(rep["agents"]) >= {"mallory", "prefill-h-pp0-tp0", "decode-h-pp0-tp0"}, rep["agents"]
    assert any(k.startswith("prefill-h-pp0-tp0->") for k in rep["by_agent"]), rep["by_agent"]
    assert any(k.startswith("decode-h-pp0-tp0->") for k in rep["by_agent"]), rep["by_agent"]
    for m in (pm, dm):
        assert m.get("notif.unauthenticated", 0) > 0
        assert m.get("notif.unauthenticated.missing", 0) > 0
        assert m.get("notif.unauthenticated.bad_mac", 0) > 0  # sealed with a guessed key id
        assert m.get("notif.unauthenticated.unknown_key", 0) > 0
        # Nothing unauthenticated got as far as being routed.
        for counter in ("reg.rejected_sender", "reaper.notif_wrong_sender", "matcher.abort_wrong_sender"):
            assert m.get(counter, 0) == 0, (counter, m.get(counter))


def test_hostile_replaying_peer_metadata_changes_nothing() -> None:
    """The hostile's side channels serve P's and D's own payloads (their agent names and memory);
    its registrations naming them come from ``mallory``, not from the agents they advertise, so
    they must bind nothing. Watchdog shortened so a request that lost its completion ends soon."""
    s = run_hostile_soak(
        int(os.environ.get("PUSHACTORS_SOAK_N") or 100),
        SEED + 4,
        auth=False,
        replay_metadata=True,
        config_overrides={"registration_timeout": 6.0},
    )
    served = s["hostile"]["handshakes_served"]
    # P fetched the replayed D payload (and bound nothing: the registration's sender is not the
    # agent it advertises); D, a consumer, never handshakes on a registration's word.
    assert served["as_decode-h"] > 0 and served["as_prefill-h"] == 0, served
    assert s["p"].get("handshake.unclaimed", 0) > 0
    assert s["p"].get("remote.moved", 0) == 0 and s["d"].get("remote.moved", 0) == 0


def test_registration_from_another_agent_cannot_hold_a_live_d_slot() -> None:
    """Registry level, deterministic: the squat seen with ``HostileSpec(squat=True)``, where a
    forged registration (from the hostile's own, self-advertised address) names a leaked live
    D id and reaches P before D's own registration."""
    registry = PRegistry(lease_duration=6.0, tombstone_ttl=60.0, orphan_ttl=3.0)
    d_id, tid = "req-7-0-1a2b3c4d", secrets.token_hex(8)

    def reg(decode_port: int, transfer_id: str | None) -> Registration:
        return Registration(
            request_id=d_id,
            decode_engine_id="decode-h",
            decode_host="127.0.0.1",
            decode_port=decode_port,
            decode_tp_size=1,
            local_block_ids=(1, 2),
            remote_engine_id="prefill-h",
            remote_host="127.0.0.1",
            remote_port=5000,
            remote_tp_size=1,
            transfer_id=transfer_id,
        )

    now = time.monotonic()
    registry.add_registration(reg(6666, "tx-7"), "mallory", now)  # the squat: a guessed transfer id
    real = registry.add_registration(reg(6000, tid), "decode-h-pp0-tp0", now)
    assert not any(isinstance(a, Refuse) for a in real.actions), real
    done = registry.add_finished("req-7-0-9f8e7d6c", ((5, 6),), tid, now)
    posts = [a for a in done.actions if isinstance(a, Post)]
    assert len(posts) == 1 and posts[0].sender == "decode-h-pp0-tp0", done


SHORT_N = 300
LONG_N = 5000


def test_hostile_process_changes_nothing() -> None:
    s = run_hostile_soak(int(os.environ.get("PUSHACTORS_SOAK_N") or SHORT_N), SEED, auth=False)
    _check_unauthenticated_drops(s)


def test_hostile_impersonating_peers_is_stopped_by_auth() -> None:
    s = run_hostile_soak(int(os.environ.get("PUSHACTORS_SOAK_N") or SHORT_N), SEED + 1, auth=True)
    _check_auth_drops(s)


@pytest.mark.slow
def test_hostile_process_changes_nothing_long() -> None:
    s = run_hostile_soak(max(LONG_N, int(os.environ.get("PUSHACTORS_SOAK_N") or LONG_N)), SEED + 2, auth=False)
    _check_unauthenticated_drops(s)


@pytest.mark.slow
def test_hostile_impersonating_peers_is_stopped_by_auth_long() -> None:
    s = run_hostile_soak(max(LONG_N, int(os.environ.get("PUSHACTORS_SOAK_N") or LONG_N)), SEED + 3, auth=True)
    _check_auth_drops(s)
