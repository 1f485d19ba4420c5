"""REAL fault tests (issue 5: scenarios 21, 22, side channel down, garbage metadata).

Two or three OS processes (:class:`~pushactors.testing.node.Node`), real NIXL over UCX on DRAM, the
real ZMQ side channel (the rig: tests/nodes_kit.py). A peer dies by SIGKILL; the survivor must end
every affected request visibly within its configured bound, give every block back, stay healthy
and serve a peer started afterwards, byte for byte.

Durations are short so the file runs in well under two minutes; timing bounds are structural
(configured bound + generous slack for a loaded 2-core machine) and the measured numbers are
printed (run with ``-s`` to see the ``REAL-FAULTS`` lines).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import msgspec
import pytest
import zmq
from nodes_kit import (
    SMALL,
    Cluster,
    Recorder,
    ids,
    injected,
    kv_bytes,
    metric,
    poll,
    push_caught_in_flight,
    ready,
    registered_on_p,
    serve,
    settled_blocks,
    thaw,
    write_in_flight,
)
from ucx_env import tcp_only

from pushactors.testing.engine import SimSpec
from pushactors.testing.ports import free_port

pytestmark = pytest.mark.real_nixl

# Generous: a loaded 2-core box, three Python processes, pattern checks in Python.
SLACK = 5.0

LEASE = 2.0
WRITE_TIMEOUT = 3.0
PIN_LIMIT = 5.0  # P releases a WRITE still running this long after its post (never before)
REG_TIMEOUT = 2.0
QUARANTINE = 1.0
HANDSHAKE_TIMEOUT = 1.0

# Both roles get the same timings (D's heartbeat interval derives from its lease_duration).
FAST = dict(
    lease_duration=LEASE,
    write_timeout=WRITE_TIMEOUT,
    pinned_write_limit=PIN_LIMIT,
    registration_timeout=REG_TIMEOUT,
    abort_quarantine=QUARANTINE,
    handshake_timeout=HANDSHAKE_TIMEOUT,
    reaper_tick=0.02,
    allow_unsafe_quarantine=True,  # short quarantines keep these runs fast
)
# For "fails fast" tests: a long watchdog, so failing fast cannot be the watchdog's doing.
SLOW_WATCHDOG = {**FAST, "registration_timeout": 30.0}
# D frozen (SIGSTOP) with a push registered, then P's prefill: P posts no WRITE past D's promise
# for the registration, 2/3 lease past D's last heartbeat. A longer lease keeps that promise
# ahead of P's prefill however long a loaded machine takes from the freeze to it (with 2 s,
# 1.3 s: often missed on a busy 2-core box, and then there is no WRITE to catch in flight).
FROZEN_LEASE = 6.0
FROZEN = {**SLOW_WATCHDOG, "lease_duration": FROZEN_LEASE}
FROZEN_FAST = {**FAST, "lease_duration": FROZEN_LEASE}  # D's own watchdog as short as ever

# Many small descriptors make one WRITE long: a 1024-block request is 64 layers x K/V x 1024
# blocks = 131,072 descriptors of 256 B (block ids are shuffled, so few merge). ~0.3 s over
# UCX cma, ~0.8 s over UCX tcp on the 2-core machine; 64 MiB of KV per node.
MANY_DESCS = SimSpec(num_layers=64, num_blocks=2048, block_bytes=256)
BIG_BLOCKS = 1024


def say(*parts: Any) -> None:
    print("REAL-FAULTS", *parts, flush=True)


def dead_port() -> int:
    """A local TCP port where nothing listens (free now, outside the ephemeral range)."""
    return free_port()


def p_params(engine_id: str, host: str, port: int, base: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_tp_size": 1,
        "remote_request_id": base,
    }


def write_path(why: str | None) -> str:
    """Which way P's WRITE ended, from P's report of its push."""
    if why is None:
        return "DONE (ok)"
    if "pinned_write_limit" in why:
        return "hung until pinned_write_limit released it"
    if "not done after" in why:
        return "stuck past write_timeout, then ended in ERR"
    if "submission failed" in why:
        return "refused at post (peer already known dead)"
    if "check_xfer_state raised" in why or "ERR" in why:
        return "ended in ERR while in flight"
    return f"other: {why}"


def durations(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}s" for k, v in values.items())


# --- 21: D killed during a WRITE ------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["ucx-default", "tcp"])
def test_21_decode_killed_during_write_p_frees_within_the_lease(
    transport: str, rec: Recorder, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D is SIGKILLed while P has a 32 MiB / 131,072-descriptor WRITE in flight into it, two
    leases armed for prefills D never registered, and two registrations from D whose prefills
    finish only after D died.

    P must report every one of them finished sending (failed; ok only for a WRITE that completed
    before the kill) within lease_duration + pinned_write_limit (a WRITE NIXL keeps in flight is
    released only then), free every block, stay healthy and push byte-exact KV to a D node
    started afterwards.

    On one host a DRAM WRITE normally completes inside its post (UCX cma), so D is frozen
    (SIGSTOP) just before P posts: the WRITE then waits for D, P's own stats show it in flight,
    and D is killed in that state. ``ucx-default`` is what UCX picks on one host (cma + sm);
    ``tcp`` (UCX_TLS=tcp) is what a cross-host pair without RDMA uses (on a GPU host
    ``tcp,cuda_copy``, which NIXL needs there: tests/ucx_env.py).
    """
    if transport == "tcp":
        monkeypatch.setenv("UCX_TLS", tcp_only())
    spec = MANY_DESCS
    p = cluster.start("prefill", "prefill-0", spec, FROZEN)
    d = cluster.start("decode", "decode-0", spec, FROZEN)
    ready(p, d)
    serve(rec, p, d, 0, 8, spec)  # both handshakes done; P's agent knows D's

    # Registrations from D whose prefills finish only after D is dead.
    late = [ids("t21-late", i) for i in range(2)]
    before = metric(p.stats(), "notif.received")
    for base, _, d_id in late:
        d.expect(d_id, 16 * spec.block_size, p.decode_params(base), key=base, wait=True)
    registered_on_p(p, before, len(late))

    # Leases armed on P for prefills D will never register (D dies first).
    leased = [ids("t21-lease", i) for i in range(2)]
    for base, p_id, _ in leased:
        p.prefill(p_id, 8 * spec.block_size, key=base, wait=True)

    p0 = p.stats()
    big = push_caught_in_flight(rec, p, d, "t21-big", BIG_BLOCKS, spec)  # D left frozen
    big_p = big.p_id
    say(f"[21/{transport}] the WRITE caught in flight on attempt {big.attempts}")
    t_kill = time.monotonic()  # SIGKILL goes out first thing; kill() then reaps the process
    d.kill()
    d2 = cluster.start("decode", "decode-1", spec, FROZEN)  # boots while P copes

    t_late = time.monotonic()
    for base, p_id, _ in late:
        p.prefill(p_id, 16 * spec.block_size, key=base, wait=True)

    affected = [big_p] + [p_id for _, p_id, _ in leased + late]
    bound = FROZEN_LEASE + PIN_LIMIT
    assert rec.wait_sent(affected, bound + SLACK), (
        f"P did not report {[r for r in affected if r not in rec.sent]} within {bound + SLACK}s of D's death"
    )
    after = {r: rec.sent[r].at - t_kill for r in affected}
    say(f"[21/{transport}] P finished each affected request this long after D died:", durations(after))
    for r in affected:
        say(f"[21/{transport}]   {r}: {rec.sent[r].why or 'ok'}")
    for r, s in after.items():
        assert s <= bound + SLACK, f"{r}: P took {s:.2f}s > lease {FROZEN_LEASE} + pin limit {PIN_LIMIT} (+{SLACK})"

    # The WRITE in flight at the kill: which path NIXL took.
    why = rec.sent[big_p].why
    stats = p.stats()
    say(
        f"[21/{transport}] WRITE in flight at the kill ({kv_bytes(BIG_BLOCKS, spec) >> 20} MiB, 131072 descs): "
        f"{write_path(why)} {after[big_p] * 1e3:.1f} ms after the kill; "
        f"write.* = { {k: v for k, v in stats['metrics'].items() if k.startswith('write.')} }"
    )
    assert why is not None, "P reported a push into a killed D as successful"
    assert metric(stats, "write.failed") > metric(p0, "write.failed"), "the in-flight WRITE was not settled as failed"
    # Leases of never-registered prefills: freed by expiry, as failures, not successes.
    for _, p_id, _ in leased:
        assert rec.sent[p_id].why is not None, f"{p_id}: P reported success for a push D never asked for"
        assert rec.sent[p_id].at - t_kill <= FROZEN_LEASE + SLACK
    assert metric(stats, "lease.expired") >= len(leased)
    # Prefills finished after D died: nothing can be written, they fail (never succeed).
    for _, p_id, _ in late:
        assert rec.sent[p_id].why is not None, f"{p_id}: reported pushed into a dead D"
    say(f"[21/{transport}] late prefills failed", durations({r: rec.sent[r].at - t_late for _, r, _ in late}), "after")

    # Every block back, nothing pending, healthy.
    final = settled_blocks(p, SLACK)
    assert final["free_blocks"] == spec.num_blocks, f"P leaked {spec.num_blocks - final['free_blocks']} blocks"
    assert final["held"] == 0 and not final["pending_push_work"]
    assert final["healthy"], "P reports itself unhealthy after D died"
    assert p.process.is_alive() and p.error is None

    # P serves a D started afterwards, byte for byte.
    d2.wait_ready()
    took = serve(rec, p, d2, 1, 16, spec)
    say(f"[21/{transport}] new D (decode-1) served in {took:.3f}s")
    end = settled_blocks(p, SLACK)
    assert end["free_blocks"] == spec.num_blocks and end["healthy"]


def test_21_frozen_decode_write_released_at_pinned_write_limit(rec: Recorder, cluster: Cluster) -> None:
    """D hangs (SIGSTOP) with P's WRITE in flight and never dies: the WRITE neither completes nor
    fails. P judges it stuck at write_timeout (D is told it may still land) but never releases
    it then: a release would not stop a copy already started. It keeps P's blocks and polls the
    WRITE until pinned_write_limit, then releases it (counted), fails the push and frees P's
    blocks. When D wakes up, the request must end failed (or, if D counts a completion, with
    every byte right), D's blocks come back, and the pair serves the next request byte for byte."""
    spec = MANY_DESCS
    p = cluster.start("prefill", "prefill-0", spec, FROZEN)
    d = cluster.start("decode", "decode-0", spec, FROZEN)
    ready(p, d)
    serve(rec, p, d, 0, 8, spec)

    caught = push_caught_in_flight(rec, p, d, "t21-frozen", BIG_BLOCKS, spec)  # D left frozen
    p_id, d_id = caught.p_id, caught.d_id
    try:
        assert poll(lambda: metric(p.stats(), "write.timed_out") == 1, WRITE_TIMEOUT + SLACK), "never judged stuck"
        assert p_id not in rec.sent, "P gave up on the WRITE at write_timeout"
        assert rec.wait_sent([p_id], PIN_LIMIT + SLACK), f"P still holds a WRITE to a hung D after {PIN_LIMIT + SLACK}s"
        took = rec.sent[p_id].at - caught.prefilled_at
        why = rec.sent[p_id].why
        stats = settled_blocks(p, SLACK)
        say(f"[21/frozen] P gave up on the WRITE to a hung D after {took:.3f}s: {write_path(why)} ({why})")
        assert why is not None and "pinned_write_limit" in why, why
        # Measured from a moment before the post, so never short of pinned_write_limit when P
        # kept to it (P used to give up at write_timeout).
        assert took >= PIN_LIMIT, f"released {took:.2f}s after P's prefill, before pinned_write_limit"
        assert metric(stats, "write.timed_out") == 1 and metric(stats, "write.released_at_pin_limit") == 1
        assert stats["free_blocks"] == spec.num_blocks and stats["held"] == 0 and stats["healthy"]
    finally:
        thaw(d)
    assert rec.wait_received([d_id], QUARANTINE + SLACK), "D never settled the released push"
    got = rec.received[d_id]
    say(f"[21/frozen] D after waking: {got.why or 'ok'} (checked={got.checked} wrong={got.wrong})")
    if got.why is None:  # a completion for the released WRITE reached D: then every byte must be there
        assert got.wrong == 0 and got.checked == kv_bytes(BIG_BLOCKS, spec), "D took a released WRITE as complete"
    d_stats = settled_blocks(d, SLACK)
    assert d_stats["free_blocks"] == spec.num_blocks and d_stats["healthy"]
    serve(rec, p, d, 1, 16, spec)


# --- 22: P killed, D fails within its bound -------------------------------------------------------
def test_22_prefill_killed_decode_fails_within_its_bound(rec: Recorder, cluster: Cluster) -> None:
    """P is SIGKILLed with three D registrations delivered (never prefilled) and a WRITE in flight
    (D frozen for an instant so the WRITE is caught mid-way); two more registrations are staged
    after its death. D must fail every one within registration_timeout + abort_quarantine of
    staging it (those that cannot even be sent, at once), free every block, stay healthy and take
    a byte-exact push from a new P."""
    spec = MANY_DESCS
    p = cluster.start("prefill", "prefill-0", spec, FROZEN_FAST)
    d = cluster.start("decode", "decode-0", spec, FROZEN_FAST)
    ready(p, d)
    serve(rec, p, d, 0, 8, spec)

    staged: dict[str, float] = {}
    waiting = [ids("t22-reg", i) for i in range(3)]
    before = metric(p.stats(), "notif.received")
    for base, _, d_id in waiting:
        staged[d_id] = time.monotonic()
        d.expect(d_id, 16 * spec.block_size, p.decode_params(base), key=base, wait=True)
    registered_on_p(p, before, len(waiting))

    caught = push_caught_in_flight(rec, p, d, "t22-big", BIG_BLOCKS, spec)  # D left frozen
    big_d = caught.d_id
    staged[big_d] = caught.staged_at
    try:
        t_kill = time.monotonic()
        p.kill()
    finally:
        thaw(d)
    p2 = cluster.start("prefill", "prefill-1", spec, FROZEN_FAST)

    after_death = [ids("t22-after", i) for i in range(2)]
    for base, _, d_id in after_death:
        staged[d_id] = time.monotonic()
        # P's coordinates, as a router that has not noticed its death would send them.
        d.expect(d_id, 16 * spec.block_size, p.decode_params(base), key=base, wait=True)

    everyone = [d_id for _, _, d_id in waiting] + [big_d] + [d_id for _, _, d_id in after_death]
    bound = REG_TIMEOUT + QUARANTINE
    assert rec.wait_received(everyone, bound + SLACK), (
        f"D did not report {[r for r in everyone if r not in rec.received]} within {bound + SLACK}s"
    )
    since_staged = {r: rec.received[r].at - staged[r] for r in everyone}
    since_kill = {r: rec.received[r].at - t_kill for r in everyone}
    say("[22] D reported each request this long after staging it:", durations(since_staged))
    say("[22] ... and this long after P died:", durations(since_kill))
    for r in everyone:
        say(f"[22]   {r}: {rec.received[r].why or 'ok'} (in-node latency {rec.received[r].latency:.3f}s)")
    for r, s in since_staged.items():
        assert s <= bound + SLACK, f"{r}: D took {s:.2f}s > registration_timeout + abort_quarantine (+{SLACK})"

    for _, _, d_id in waiting:
        assert rec.received[d_id].why is not None, f"{d_id}: D reported KV that P never wrote"
    big = rec.received[big_d]
    if big.why is None:  # a completion made it out of P before it died: every byte must be there
        assert big.wrong == 0 and big.checked == kv_bytes(BIG_BLOCKS, spec), "D took a torn WRITE as complete"
    say(f"[22] push in flight when P died: {'landed' if big.why is None else 'failed: ' + big.why}")
    for _, _, d_id in after_death:
        got = rec.received[d_id]
        assert got.why is not None
        # The PUSH_REG send fails (NIXL knows P is gone): fail now, not at the watchdog.
        assert since_staged[d_id] < REG_TIMEOUT, f"{d_id}: waited {since_staged[d_id]:.2f}s for a dead P: {got.why}"

    final = settled_blocks(d, SLACK)
    say(f"[22] D after: free_blocks={final['free_blocks']}/{spec.num_blocks} metrics={final['metrics']}")
    assert final["free_blocks"] == spec.num_blocks, f"D leaked {spec.num_blocks - final['free_blocks']} blocks"
    assert final["held"] == 0 and not final["pending_push_work"]
    assert final["healthy"], "D reports itself unhealthy after P died"
    assert metric(final, "recv.failed") >= len(everyone) - (big.why is None)
    assert d.process.is_alive() and d.error is None

    p2.wait_ready()
    took = serve(rec, p2, d, 1, 16, spec)
    say(f"[22] new P (prefill-1) served D in {took:.3f}s")
    end = settled_blocks(d, SLACK)
    assert end["free_blocks"] == spec.num_blocks and end["healthy"]


# --- a peer restarted under the same engine id ----------------------------------------------------
@pytest.mark.parametrize("restarted", ["decode", "prefill"])
def test_peer_restarted_with_same_engine_id_is_served(restarted: str, rec: Recorder, cluster: Cluster) -> None:
    """A killed node comes back under the same engine id (a pod restart with a configured id):
    its NIXL agent name is the same, its memory and endpoint are new. After at most one request
    lost to discovering the stale peer, requests must succeed again, byte for byte."""
    spec = SMALL
    p = cluster.start("prefill", "prefill-0", spec, FAST)
    d = cluster.start("decode", "decode-0", spec, FAST)
    ready(p, d)
    serve(rec, p, d, 0, 4, spec)
    if restarted == "decode":
        d.kill()
        d = cluster.start("decode", "decode-0", spec, FAST)
        d.wait_ready()
    else:
        p.kill()
        p = cluster.start("prefill", "prefill-0", spec, FAST)
        p.wait_ready()
    outcomes = []
    for i in (1, 2, 3):
        o = rec.router.dispatch(p, d, i, 4 * spec.block_size)
        assert rec.router.wait(lambda o=o: o.done, LEASE + REG_TIMEOUT + QUARANTINE + SLACK)
        outcomes.append(o)
        say(f"[restart/{restarted}] request {i}: P={o.sent or 'ok'} D={o.received or 'ok'} checked={o.checked}")
        if i >= 2:
            assert o.ok and o.checked == kv_bytes(4, spec), (
                f"{restarted} restarted as the same engine id is still not served on request {i}: "
                f"P: {o.sent!r}; D: {o.received!r}"
            )


# --- side channel down ----------------------------------------------------------------------------
def test_side_channel_down(rec: Recorder, cluster: Cluster) -> None:
    """D's requests name a P side channel where nothing listens: the handshake is refused and D
    fails them at once, long before its registration watchdog; D keeps serving real requests."""
    spec = SMALL
    p = cluster.start("prefill", "prefill-0", spec, SLOW_WATCHDOG)
    d = cluster.start("decode", "decode-0", spec, SLOW_WATCHDOG)
    ready(p, d)
    serve(rec, p, d, 0, 4, spec)

    port = dead_port()
    down = [ids("t-down", i) for i in range(3)]
    staged = {}
    for base, _, d_id in down:
        staged[d_id] = time.monotonic()
        d.expect(d_id, 4 * spec.block_size, p_params("prefill-gone", "127.0.0.1", port, base), key=base, wait=True)
    rids = [d_id for _, _, d_id in down]
    assert rec.wait_received(rids, HANDSHAKE_TIMEOUT + SLACK), "D did not fail requests to a dead side channel"
    took = {r: rec.received[r].at - staged[r] for r in rids}
    say("[side-channel-down] D failed each request after:", durations(took))
    for r in rids:
        why = rec.received[r].why
        assert why is not None and "refused" in why, f"{r}: {why!r}"
        assert took[r] < HANDSHAKE_TIMEOUT + SLACK < SLOW_WATCHDOG["registration_timeout"]

    stats = settled_blocks(d, SLACK)
    say(f"[side-channel-down] D metrics: {stats['metrics']}")
    assert metric(stats, "handshake.failed.refused") >= 1
    assert stats["free_blocks"] == spec.num_blocks and stats["held"] == 0
    assert stats["healthy"] and not stats["pending_push_work"]
    serve(rec, p, d, 1, 4, spec)


# --- garbage metadata -----------------------------------------------------------------------------
class FakeSideChannels:
    """ZMQ ROUTERs that answer handshakes wrongly, one per mode, on one thread."""

    def __init__(self, replies: dict[str, list[bytes] | None]) -> None:
        self._replies = replies
        self.ports: dict[str, int] = {}
        self.served: dict[str, int] = dict.fromkeys(replies, 0)
        self._stop = threading.Event()
        started: queue.Queue[BaseException | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(started,), name="fake-side-channels", daemon=True)
        self._thread.start()
        err = started.get(timeout=10)
        if err is not None:
            raise err

    def _run(self, started: queue.Queue[BaseException | None]) -> None:
        ctx = zmq.Context.instance()
        socks: dict[zmq.Socket[bytes], str] = {}
        try:
            poller = zmq.Poller()
            for mode in self._replies:
                sock = ctx.socket(zmq.ROUTER)
                sock.setsockopt(zmq.LINGER, 0)
                self.ports[mode] = sock.bind_to_random_port("tcp://127.0.0.1")
                socks[sock] = mode
                poller.register(sock, zmq.POLLIN)
            started.put(None)
            while not self._stop.is_set():
                for sock, _ in poller.poll(50):
                    frames = sock.recv_multipart()
                    mode = socks[sock]
                    self.served[mode] += 1
                    reply = self._replies[mode]
                    if reply is not None:  # None: stay silent
                        sock.send_multipart([frames[0], b"", *reply])
        except BaseException as exc:  # surfaced to the constructor when it happens at start
            started.put(exc)
        finally:
            for sock in socks:
                sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_garbage_metadata(rec: Recorder, cluster: Cluster) -> None:
    """Fake side channels answer D's handshake with garbage, or with a well-formed payload that
    is wrong: protocol version, compatibility hash, engine id, rank, NIXL agent metadata; one
    never answers. D fails each request fast with that failure kind (stats: handshake.failed.<kind>),
    frees its blocks and keeps serving real requests."""
    from pushactors.protocol import AgentInfo, HandshakeEnvelope, HandshakeRequest, PeerKey
    from pushactors.transport.sidechannel import SideChannelClient

    spec = SMALL
    p = cluster.start("prefill", "prefill-0", spec, SLOW_WATCHDOG)
    d = cluster.start("decode", "decode-0", spec, SLOW_WATCHDOG)
    ready(p, d)
    serve(rec, p, d, 0, 4, spec)

    # A genuine payload, fetched from the real P's side channel, to tamper with.
    host, port = p.info["host"], p.info["port"]
    raw = SideChannelClient().fetch(
        PeerKey("prefill-0", host, port, 0, 0),
        HandshakeRequest(pp_rank=0, tp_rank=0, requester_engine_id="test", requester_agent="test"),
        5.0,
    )
    env = msgspec.msgpack.decode(raw, type=HandshakeEnvelope)
    info = msgspec.msgpack.decode(env.body, type=AgentInfo)

    def payload(*, version: int | None = None, compat: str | None = None, **changes: Any) -> list[bytes]:
        body = msgspec.msgpack.encode(msgspec.structs.replace(info, **changes)) if changes else env.body
        envelope = HandshakeEnvelope(env.version if version is None else version, compat or env.compat_hash, body)
        return [b"ok", msgspec.msgpack.encode(envelope)]

    def fake_id(mode: str) -> str:
        return f"fake-{mode}"

    # mode -> (reply frames, None for silence; expected failure kind)
    cases: dict[str, tuple[list[bytes] | None, str]] = {
        "frames": ([b"\x00not the side-channel protocol"], "garbage"),
        "not_msgpack": ([b"ok", b"\xc1\xc1\xc1 definitely not msgpack"], "garbage"),
        "bad_body": (
            [b"ok", msgspec.msgpack.encode(HandshakeEnvelope(env.version, env.compat_hash, b"\x93"))],
            "garbage",
        ),
        "version": (payload(version=env.version + 41, engine_id=fake_id("version")), "version"),
        "hash": (payload(compat="0" * 32, engine_id=fake_id("hash")), "incompatible"),
        "engine": (payload(), "wrong_engine"),  # P's genuine payload, served under another identity
        "rank": (payload(engine_id=fake_id("rank"), tp_size=2, tp_rank=1), "wrong_rank"),
        "err_reply": ([b"err", b"not_ready", b"rank not registered"], "not_ready"),
        "silent": (None, "timeout"),
        # Everything valid except the NIXL agent metadata: loading it must fail cleanly.
        "agent_md": (payload(engine_id=fake_id("agent_md"), agent_metadata=b"\x00junk"), "add_remote_agent"),
    }
    fakes = FakeSideChannels({mode: reply for mode, (reply, _) in cases.items()})
    try:
        staged = {}
        rid = {}
        for i, mode in enumerate(cases):
            base, _, d_id = ids(f"t-garbage-{mode}", i)
            rid[mode] = d_id
            staged[d_id] = time.monotonic()
            params = p_params(fake_id(mode), "127.0.0.1", fakes.ports[mode], base)
            d.expect(d_id, 4 * spec.block_size, params, key=base, wait=True)
        everyone = list(rid.values())
        assert rec.wait_received(everyone, HANDSHAKE_TIMEOUT + SLACK), (
            f"D did not fail {[m for m, r in rid.items() if r not in rec.received]} fast"
        )
        stats = settled_blocks(d, SLACK)
    finally:
        fakes.close()
    took = {mode: rec.received[r].at - staged[r] for mode, r in rid.items()}
    say("[garbage] D failed each request after:", durations(took))
    say(f"[garbage] fake side channels served: {fakes.served}")
    say(f"[garbage] D metrics: { {k: v for k, v in stats['metrics'].items() if k.startswith('handshake')} }")
    for mode, (_, kind) in cases.items():
        why = rec.received[rid[mode]].why
        say(f"[garbage]   {mode}: {why}")
        assert why is not None, f"{mode}: D accepted a push from a fake side channel"
        assert f"({kind})" in why, f"{mode}: expected a {kind!r} handshake failure, got {why!r}"
        assert took[mode] < HANDSHAKE_TIMEOUT + SLACK < SLOW_WATCHDOG["registration_timeout"]
        if kind != "add_remote_agent":  # the writer's failure, counted as plain handshake.failed
            assert metric(stats, f"handshake.failed.{kind}") >= 1, f"no handshake.failed.{kind} in {stats['metrics']}"
    assert metric(stats, "handshake.failed") >= len(cases)
    assert stats["free_blocks"] == spec.num_blocks and stats["held"] == 0
    assert stats["healthy"] and not stats["pending_push_work"]
    assert d.process.is_alive() and d.error is None
    serve(rec, p, d, 1, 4, spec)
    p_stats = p.stats()
    assert p_stats["healthy"] and p_stats["free_blocks"] == spec.num_blocks


# --- generations: stale answers never land, over real NIXL ---------------------------------------
# The three ways a stale message used to land wrong KV, each between two processes over UCX:
# the same steps as tests/test_generations.py on the fake fabric, with real bytes in real DRAM.
GEN_SPEC = SimSpec(num_layers=2, num_blocks=16, shuffle_blocks=False)
GEN_BLOCKS = [3, 4, 5]  # D uses (and re-uses) exactly these blocks
GEN_TOKENS = len(GEN_BLOCKS) * GEN_SPEC.block_size


def test_real_a_replayed_completion_never_lands_the_id_used_again(rec: Recorder, cluster: Cluster) -> None:
    """Class 1: D re-uses a request id on the same blocks; the first use's completion, kept as it
    arrived over NIXL, is delivered again from P's agent before P has prefilled the second use.
    D drops it (its generation is not the live one) and lands the second use on P's real WRITE."""
    d_id = "gen-7-dddddddd"
    config = {"lease_duration": 30.0, "registration_timeout": 10.0}
    p = cluster.start("prefill", "prefill-0", GEN_SPEC, config)
    d = cluster.start("decode", "decode-0", GEN_SPEC, config, faults={"record": {"completion_of": d_id}})
    ready(p, d)
    p.prefill("gen-7-aaaaaaaa", GEN_TOKENS, "first", wait=True)
    d.expect(d_id, GEN_TOKENS, p.decode_params("gen-7-aaaaaaaa"), "first", blocks=GEN_BLOCKS, wait=True)
    assert rec.wait_received([d_id], 30), "the first use never landed"
    first = rec.received[d_id]
    assert first.why is None and first.wrong == 0 and first.checked == kv_bytes(3, GEN_SPEC)
    rec.forget(d_id)  # D finished it: the blocks are free, the id may be used again

    d.expect(d_id, GEN_TOKENS, p.decode_params("gen-7-bbbbbbbb"), "second", blocks=GEN_BLOCKS, hold=True, wait=True)
    assert poll(lambda: p.stats()["pending_registrations"] == 1, 10), "P never held the second registration"
    assert d.replay() == 1  # the first use's completion, from P's agent, once more
    stale = "reaper.notif_stale_generation.completion"
    assert poll(lambda: metric(d.stats(), stale) == 1, 10), "the replayed completion was not dropped as stale"
    assert d_id not in rec.received, "D reported the second use landed on the first use's completion"

    p.prefill("gen-7-bbbbbbbb", GEN_TOKENS, "second", wait=True)
    assert rec.wait_received([d_id], 30), "the second use never landed"
    second = rec.received[d_id]
    assert second.why is None and second.wrong == 0 and second.checked == kv_bytes(3, GEN_SPEC)
    assert d.verify(d_id) == (kv_bytes(3, GEN_SPEC), 0)
    d.finish(d_id)
    say(f"[gen/replay] stale completions dropped: {metric(d.stats(), stale)}")


def test_real_a_registration_arriving_after_ds_deadline_is_never_written(rec: Recorder, cluster: Cluster) -> None:
    """Class 2: D's registration is held up on the way to P and its abort is lost; D sits out
    its quarantine and gives the blocks to another request, which lands. The old registration
    then reaches P as P's prefill for it ends: P judges it by D's deadline (on its estimate of
    D's clock from the handshake) and refuses; the other request's bytes stay as they landed."""
    timing = {"lease_duration": 3.0, "write_timeout": 0.5, "abort_quarantine": 2.7, "registration_timeout": 30.0}
    p_faults = {
        "rules": [
            {"kind": "delay_notif", "seconds": 3.6, "match": {"prefix": "PUSH_REG:"}, "times": 1},
            {"kind": "drop_notif", "match": {"prefix": "PUSH_ABORT:"}, "times": None},
        ]
    }
    p = cluster.start("prefill", "prefill-0", GEN_SPEC, timing, faults=p_faults)
    d = cluster.start("decode", "decode-0", GEN_SPEC, timing)
    ready(p, d)
    late, other = "late-1-dddddddd", "other-1-dddddddd"
    d.expect(late, GEN_TOKENS, p.decode_params("late-1-aaaaaaaa"), "late", blocks=GEN_BLOCKS, wait=True)
    assert poll(lambda: injected(p, "delay_notif") == 1, 10), "the registration never reached P's agent"
    assert d.abort(late)
    assert rec.wait_received([late], 10), "D never ended the aborted request"
    assert rec.received[late].why is not None

    d.expect(other, GEN_TOKENS, p.decode_params("other-1-aaaaaaaa"), "other", blocks=GEN_BLOCKS, hold=True, wait=True)
    p.prefill("other-1-aaaaaaaa", GEN_TOKENS, "other", wait=True)
    assert rec.wait_received([other], 30), "the other request never landed"
    assert rec.received[other].why is None and rec.received[other].wrong == 0

    p.prefill("late-1-aaaaaaaa", GEN_TOKENS, "late", wait=True)  # P's prefill for the old one ends
    assert rec.wait_sent(["late-1-aaaaaaaa"], 15), "P's late request never ended"
    checked, wrong = d.verify(other)
    assert checked == kv_bytes(3, GEN_SPEC) and wrong == 0, f"{wrong} bytes of the stale push in the other's blocks"
    assert rec.sent["late-1-aaaaaaaa"].why is not None  # refused, never pushed
    final = p.stats()
    assert metric(final, "write.posted") == 1, "P posted a WRITE for the stale registration"
    # Refused by the matcher on D's deadline (or, had it slipped past, by the writer's own check).
    assert metric(final, "matcher.expired") + metric(final, "write.past_deadline") == 1
    d.finish(other)
    say(f"[gen/late-registration] P refused it: {rec.sent['late-1-aaaaaaaa'].why}")


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_real_a_cancelled_write_that_runs_on_never_lands_in_blocks_d_reused(
    staged: bool, rec: Recorder, cluster: Cluster
) -> None:
    """Class 3: P's WRITE hangs, and releasing it would return while the same WRITE is posted a
    second later all the same, its real bytes landing in D's memory (as a cma, cuda_ipc or RDMA
    copy that already started does). P never releases it to cancel it: past write_timeout D
    hears it may still land and keeps the blocks (or staging slot), P keeps its own, nothing is
    final on either side, and no copy ever runs unowned. (Before, P released it, D reused the
    blocks on P's word, and the late copy overwrote the next request's bytes.)"""
    spec = SimSpec(num_layers=2, num_blocks=16, shuffle_blocks=False, layout="hnd" if staged else "nhd")
    timeout = 1.0
    config: dict[str, Any] = {
        "lease_duration": 30.0,
        "write_timeout": timeout,
        "abort_quarantine": 30.0,
        "registration_timeout": 60.0,
    }
    if staged:
        config.update(staging_bytes=8 << 20, staging_min_runs=1, staging_min_bytes=1, staging_gather_runs=0)
    first = "run-1-dddddddd"
    runs_on = 1.0
    p_faults = {
        "rules": [
            {"kind": "hold_transfer", "match": {"completion_of": first}, "times": None},
            {"kind": "release_continues", "match": {"completion_of": first}, "times": None, "runs_on": runs_on},
        ]
    }
    p = cluster.start("prefill", "prefill-0", spec, config, faults=p_faults)
    d = cluster.start("decode", "decode-0", spec, config)
    ready(p, d)
    p.prefill("run-1-aaaaaaaa", GEN_TOKENS, "first", wait=True)
    d.expect(first, GEN_TOKENS, p.decode_params("run-1-aaaaaaaa"), "first", blocks=GEN_BLOCKS, wait=True)
    assert poll(lambda: metric(d.stats(), "recv.write_pinned") >= 1, timeout + SLACK), "D never heard it may land"
    # Long past where P used to release it and give its final word, plus the late copy's delay.
    waited = poll(lambda: rec.received.get(first) or rec.sent.get("run-1-aaaaaaaa"), 2 * timeout + runs_on + 1.0)
    assert waited is None, f"a side let go of a WRITE still in progress: D {rec.received}, P {rec.sent}"
    assert injected(p, "release_continues") == 0, "P released a WRITE still in progress"
    assert injected(p, "landed_after_release") == 0
    stats = p.stats()
    assert metric(stats, "write.timed_out") == 1 and metric(stats, "write.released_at_pin_limit") == 0
    say(
        f"[gen/cancel-runs-on/{'staged' if staged else 'direct'}] held past {2 * timeout + runs_on + 1.0:.1f}s: "
        f"P released nothing, D pinned: {metric(d.stats(), 'recv.write_pinned')}"
    )


def test_real_a_stuck_write_is_waited_for_until_it_ends(rec: Recorder, cluster: Cluster) -> None:
    """Class 3 with a real end: D hangs (SIGSTOP) with P's WRITE in flight, so NIXL keeps it
    running. P judges it stuck at write_timeout and tells D it may still land, but never releases
    it nor reports it: it waits for NIXL. When D wakes, the WRITE ends, and only then does either
    side decide: D's completion (if it lands) carries every byte, and P reports what NIXL said."""
    spec = MANY_DESCS
    timeout = 1.5
    config = {**FROZEN, "write_timeout": timeout, "pinned_write_limit": 60.0}
    p = cluster.start("prefill", "prefill-0", spec, config)
    d = cluster.start("decode", "decode-0", spec, config)
    ready(p, d)
    serve(rec, p, d, 0, 8, spec)

    caught = push_caught_in_flight(rec, p, d, "stuck-ends", BIG_BLOCKS, spec)  # D left frozen
    p_id, d_id = caught.p_id, caught.d_id
    try:
        assert poll(lambda: metric(p.stats(), "write.timed_out") == 1, timeout + SLACK), "never judged stuck"
        # Twice write_timeout: P used to have given its final word by now.
        assert poll(lambda: rec.sent.get(p_id), timeout) is None, f"P gave up on a live WRITE: {rec.sent[p_id]}"
        assert write_in_flight(p, 1.0), "the stuck WRITE is no longer in flight on P"
    finally:
        thaw(d)
    assert rec.wait_sent([p_id], SLACK) and rec.wait_received([d_id], SLACK), "the WRITE never ended"
    sent, got = rec.sent[p_id], rec.received[d_id]
    say(f"[stuck-ends] P: {write_path(sent.why)}; D: {got.why or 'ok'} (checked={got.checked} wrong={got.wrong})")
    if got.why is None:
        assert got.wrong == 0 and got.checked == kv_bytes(BIG_BLOCKS, spec)
    assert metric(p.stats(), "write.released_at_pin_limit") == 0
    assert settled_blocks(p, SLACK)["free_blocks"] == spec.num_blocks
    assert settled_blocks(d, SLACK)["free_blocks"] == spec.num_blocks
    serve(rec, p, d, 1, 16, spec)


def test_real_a_layerwise_push_whose_abort_was_lost_never_writes_into_the_next_requests_blocks(
    rec: Recorder, cluster: Cluster
) -> None:
    """Class 2: P0's layer-wise forward writes request A's first layers into D's blocks; D aborts
    and the abort never reaches P0 (dropped at P0's agent). P0's forward goes on, a layer at a
    time, past D's promise and quarantine; D gives the blocks to request B, pushed by another P
    (P1), and B lands. A's later layers must not land in B's blocks (every WRITE of a push is
    checked against D's deadline, and the stuck timer runs from the push's first WRITE), and P0
    never reports A pushed. Settings are safe by every timing rule."""
    spec = SimSpec(num_layers=40, num_blocks=16, shuffle_blocks=False)
    config: dict[str, Any] = {
        "lease_duration": 3.0,
        "write_timeout": 1.0,
        "abort_quarantine": 3.2,
        "reaper_tick": 0.05,
        "registration_timeout": 60.0,
        "handshake_timeout": 2.0,
    }
    lost_abort = {"rules": [{"kind": "drop_notif", "match": {"prefix": "PUSH_ABORT:"}, "times": None}]}
    p0 = cluster.start("prefill", "prefill-0", spec, {**config, "push_mode": "layerwise"}, faults=lost_abort)
    p1 = cluster.start("prefill", "prefill-1", spec, config)
    d = cluster.start("decode", "decode-0", spec, config)
    ready(p0, p1, d)
    serve(rec, p0, d, 0, 2, spec)  # both pairs handshaken: B goes as soon as D lets A go
    serve(rec, p1, d, 1, 2, spec)

    a_base, a_p, a_d = ids("lw-lost", 0)
    b_base, b_p, b_d = ids("lw-next", 0)
    tokens = len(GEN_BLOCKS) * spec.block_size
    d.expect(a_d, tokens, p0.decode_params(a_base), "a", blocks=GEN_BLOCKS, wait=True)
    p0.wait_registrations_held(1)
    unwritten = d.verify(a_d)[1]  # A's bytes not in its blocks yet (they hold an earlier request's)
    # A kernel per layer, ~0.1 s each on the 2-core machine: layers come well inside the
    # stuck timer P used to restart on each of them, for longer than D's quarantine.
    work = {"tokens": 1024, "hidden": 2048, "width": 4096}
    forward = threading.Thread(target=p0.forward, args=(a_p, tokens, "a"), kwargs={"layerwise": True, "work": work})
    forward.start()
    try:
        # P0 answers nothing while its forward runs: watch A's first layers land in D's blocks.
        assert poll(lambda: d.verify(a_d)[1] < unwritten, 10), "no layer of A landed"
        assert d.abort(a_d)
        assert rec.wait_received([a_d], config["abort_quarantine"] + SLACK), "D never let A's blocks go"
        assert rec.received[a_d].why is not None
        d.expect(b_d, tokens, p1.decode_params(b_base), "b", blocks=GEN_BLOCKS, hold=True, wait=True)
        p1.prefill(b_p, tokens, "b", wait=True)
        assert rec.wait_received([b_d], 30), "B never landed"
        assert rec.received[b_d].why is None
        still_running = forward.is_alive()
    finally:
        forward.join(120)
    assert rec.wait_sent([a_p], 30), "P0 never ended A"
    checked, wrong = d.verify(b_d)
    say(f"[lw-lost] B landed with the forward of A still running: {still_running}; B wrong bytes after it: {wrong}")
    assert still_running, "A's forward ended before B landed: nothing was tested"
    assert checked == kv_bytes(len(GEN_BLOCKS), spec) and wrong == 0, f"{wrong} bytes of A's later layers in B"
    assert rec.sent[a_p].why is not None, "P0 reported A pushed, though D gave up on it"
    d.finish(b_d)
