"""xPyD over real NIXL (UCX, DRAM here): two prefill and two decode engines, each its own OS process.

Issue 13 acceptance: "Real NIXL two-process nodes: 2P2D byte-exact with mixed TP, and a P killed
mid-run". Every D pairs with every P through the real ZMQ side channel and real NIXL agents;
D verifies every byte of every request in its own process.

Timing bounds are structural (configured bound + slack for a loaded 2-core machine); the measured
numbers are printed (run with ``-s`` to see the ``XPYD`` lines).
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
from nodes_kit import Cluster, Recorder, metric, ready, settled_blocks

from pushactors.core.config import PushConfig
from pushactors.core.topology import rank_heads, write_targets
from pushactors.testing.engine import SimSpec
from pushactors.testing.node import Node, Outcome

pytestmark = pytest.mark.real_nixl

# Generous: a loaded 2-core box running four Python node processes plus the parent.
SLACK = 5.0

LEASE = 2.0
HANDSHAKE_TIMEOUT = 2.0  # the warm-up's handshakes run on a loaded box; a refusal is seen at once
QUARANTINE = 1.0
# Long on purpose: a request failing fast after P's death cannot be the registration watchdog's doing.
REG_TIMEOUT = 30.0
FAST = dict(
    lease_duration=LEASE,
    write_timeout=3.0,
    registration_timeout=REG_TIMEOUT,
    abort_quarantine=QUARANTINE,
    handshake_timeout=HANDSHAKE_TIMEOUT,
    reaper_tick=0.02,
    allow_unsafe_quarantine=True,  # short quarantines keep these runs fast
)
# No faults in the 2P2D test: default timings (nothing there should hinge on a short timeout).
RELAXED = dict(reaper_tick=0.02)
# D heartbeats every awaited request this often (lease_duration / 6 unless set).
HEARTBEAT = PushConfig(engine_id="x", **FAST).heartbeat_every  # type: ignore[arg-type]

# Same model everywhere (layers, KV heads) so every P pairs with every D; described layout,
# so mixed TP splits heads (4 KV heads: TP 1 and 2 both divide them) and D checks by meaning.
SPEC = SimSpec(layout="nhd", num_layers=4, num_blocks=128, kv_heads=4)
MAX_BLOCKS = 8  # per request: 8 in flight x 8 blocks < 128 blocks on any node


def say(*parts: Any) -> None:
    print("XPYD", *parts, flush=True)


def expected_bytes(o: Outcome, d_tp: int) -> int:
    """Bytes D verifies for a request: every token past its prefix hit, every layer, K and V,
    every KV head over all of D's TP ranks."""
    heads = sum(len(rank_heads(r, d_tp, SPEC.model_heads)) for r in range(d_tp))
    positions = o.tokens - o.cached * SPEC.block_size
    return positions * SPEC.num_layers * 2 * heads * SPEC.head_dim * SPEC.elem_size


def links(p_tp: int, d_tp: int) -> int:
    """(P rank, D rank) pairs that exchange KV between a P and a D: one handshake at each end."""
    return sum(len(write_targets(r, p_tp, d_tp)) for r in range(p_tp))


def dispatch(
    rec: Recorder, p: Node, d: Node, index: int, rng: random.Random, window: int, among: list[Outcome] | None = None
) -> Outcome:
    """One request of random length, arrival order, transfer id and prefix hit, once fewer than
    ``window`` requests (of ``among``; default: all) are in flight."""
    if among is None:
        assert rec.router.wait_below(window, timeout=60), "requests stopped finishing"
    else:
        assert rec.router.wait(lambda: sum(not o.done for o in among) < window, 60), "requests stopped finishing"
    return rec.router.dispatch_mixed(p, d, index, rng, max_blocks=MAX_BLOCKS, block_size=SPEC.block_size)


def assert_landed(o: Outcome, d: Node) -> None:
    assert o.sent is None, f"{o.p_id}: P failed: {o.sent}"
    assert o.received is None, f"{o.d_id}: D failed: {o.received}"
    assert o.wrong == 0, f"{o.d_id}: {o.wrong} wrong bytes"
    assert o.checked == expected_bytes(o, d.spec.tp_size), f"{o.d_id}: checked {o.checked} bytes"


# --- 2P2D, mixed TP ------------------------------------------------------------------------------
def test_2p2d_mixed_tp_byte_exact(rec: Recorder, cluster: Cluster) -> None:
    """P0 TP1, P1 TP2, D0 TP1, D1 TP2: 40 requests round-robin over the four (P, D) pairs, up to
    eight in flight, mixed lengths / arrival orders / transfer ids / prefix hits. Every request
    lands with every byte right; every P pushed to both Ds and every D took KV from both Ps;
    afterwards no node holds a block or has push work pending."""
    p0 = cluster.start("prefill", "prefill-0", SPEC, RELAXED)
    p1 = cluster.start("prefill", "prefill-1", SPEC, RELAXED, tp=2)
    d0 = cluster.start("decode", "decode-0", SPEC, RELAXED)
    d1 = cluster.start("decode", "decode-1", SPEC, RELAXED, tp=2)
    ready(p0, p1, d0, d1)
    pairs = [(p0, d0), (p0, d1), (p1, d0), (p1, d1)]
    rng = random.Random(13)
    count = 40
    t0 = time.monotonic()
    outcomes: list[tuple[Node, Node, Outcome]] = []
    for i in range(count):
        p, d = pairs[i % len(pairs)]
        outcomes.append((p, d, dispatch(rec, p, d, i, rng, window=8)))
    assert rec.router.wait_all(timeout=120), (
        f"not every request finished: {[o.d_id for _, _, o in outcomes if not o.done]}"
    )
    say(f"[2p2d] {count} requests over 4 pairs in {time.monotonic() - t0:.2f}s")
    for _, d, o in outcomes:
        assert_landed(o, d)
    # Each P pushed to both Ds and each D took KV from both Ps, all of it byte-exact.
    served = {(p.spec.engine_id, d.spec.engine_id) for p, d, o in outcomes if o.ok}
    assert served == {(p.spec.engine_id, d.spec.engine_id) for p, d in pairs}
    for p, d in pairs:
        n = sum(1 for pp, dd, _ in outcomes if (pp, dd) == (p, d))
        say(f"[2p2d]   {p.spec.engine_id}(tp{p.spec.tp_size}) -> {d.spec.engine_id}(tp{d.spec.tp_size}): {n} landed")
        assert n == count // len(pairs)

    per_node = count // 2  # each node served half the requests (two of the four pairs)
    for node in (p0, p1, d0, d1):
        # Every node handshook once per rank link with each of its two peers: 3 (TP1) or 4 (TP2)
        # in all; either peer alone would account for fewer.
        peers = (d0, d1) if node.spec.role == "prefill" else (p0, p1)
        want = sum(
            links(node.spec.tp_size, peer.spec.tp_size)
            if node.spec.role == "prefill"
            else links(peer.spec.tp_size, node.spec.tp_size)
            for peer in peers
        )
        quiet, stats = node.quiesce(timeout=30)
        m = stats["metrics"]
        say(
            f"[2p2d] {node.spec.engine_id}: quiet={quiet} free={stats['free_blocks']} held={stats['held']} "
            f"{ {k: v for k, v in m.items() if k.split('.')[0] in ('push', 'recv', 'handshake')} }"
        )
        assert quiet, f"{node.spec.engine_id}: push work still pending"
        assert stats["held"] == 0 and stats["free_blocks"] == SPEC.num_blocks, f"{node.spec.engine_id} holds blocks"
        assert stats["healthy"], f"{node.spec.engine_id} reports itself unhealthy"
        assert metric(stats, "handshake.completed") == want, f"{node.spec.engine_id}: expected {want} handshakes"
        if node.spec.role == "prefill":
            # Every P rank reports every request it pushed (to either D).
            assert metric(stats, "push.pushed") == per_node * node.spec.tp_size
            assert metric(stats, "push.failed") == 0
        else:
            assert metric(stats, "recv.finished") == per_node * node.spec.tp_size
            assert metric(stats, "recv.failed") == 0
    for node in (p0, p1, d0, d1):
        assert node.error is None, node.error


# --- a P killed mid-run --------------------------------------------------------------------------
def test_prefill_killed_mid_run(rec: Recorder, cluster: Cluster) -> None:
    """P0 and P1 serve D0 and D1 with traffic flowing to both Ps. P0 is SIGKILLed while each D
    has requests registered with it whose prefill never ran (in flight for certain) and while
    traffic to P0 is in flight. Every P0 request not finished at the kill ends on D within
    heartbeat interval + handshake timeout (+ slack) of the kill (D's next heartbeat to P0
    fails, the death check finds P0's side channel refusing; registration_timeout is 30 s so it
    cannot be the watchdog), a request that landed anyway is byte-exact, no P1 request fails,
    P1 keeps serving both Ds byte-exact, and both Ds end with every block free."""
    p0 = cluster.start("prefill", "prefill-0", SPEC, FAST)
    p1 = cluster.start("prefill", "prefill-1", SPEC, FAST)
    d0 = cluster.start("decode", "decode-0", SPEC, FAST)
    d1 = cluster.start("decode", "decode-1", SPEC, FAST)
    ready(p0, p1, d0, d1)
    ds = (d0, d1)
    rng = random.Random(22)
    index = iter(range(10_000))  # Dispatcher ids are req-<index>-0-<hex>: one index per request everywhere

    # Warm-up: every pair handshakes and serves one request.
    warm = [(p, d, rec.router.dispatch(p, d, next(index), 3 * SPEC.block_size)) for p in (p0, p1) for d in ds]
    assert rec.router.wait_all(timeout=60), "warm-up requests did not finish"
    for _, d, o in warm:
        assert_landed(o, d)

    on_p0: list[tuple[Node, Outcome]] = []
    on_p1: list[tuple[Node, Outcome]] = []
    # Traffic to both Ps, up to eight in flight.
    for i in range(12):
        p, bucket = (p0, on_p0) if i % 2 == 0 else (p1, on_p1)
        bucket.append((ds[(i // 2) % 2], dispatch(rec, p, ds[(i // 2) % 2], next(index), rng, window=8)))
    # Registered on each D against P0, whose prefill never runs: in flight for certain at the kill.
    stuck: list[str] = []
    for d in ds:
        for _ in range(2):
            base = f"req-{next(index)}-0"
            d.expect(f"{base}-stuck", 4 * SPEC.block_size, p0.decode_params(base), key=base, wait=True)
            stuck.append(f"{base}-stuck")
    # More traffic to both Ps, the P0 part dispatched right before the kill.
    for i in range(4):
        d = ds[i % 2]
        on_p1.append((d, rec.router.dispatch(p1, d, next(index), rng.randint(1, MAX_BLOCKS * SPEC.block_size))))
        on_p0.append((d, rec.router.dispatch(p0, d, next(index), rng.randint(1, MAX_BLOCKS * SPEC.block_size))))

    unfinished = {o.d_id for _, o in on_p0 if not o.received_done} | set(stuck)  # decided before the kill
    t_kill = time.monotonic()
    p0.kill()  # SIGKILL, then reaps the process

    # Traffic keeps flowing to P1 after the kill, to both Ds (P0's requests never finish on P:
    # only P1's count towards the in-flight window).
    for i in range(12):
        d = ds[i % 2]
        on_p1.append((d, dispatch(rec, p1, d, next(index), rng, 8, among=[o for _, o in on_p1])))

    bound = HEARTBEAT + HANDSHAKE_TIMEOUT
    assert rec.wait_received(sorted(unfinished), bound + SLACK), (
        f"D did not end {sorted(unfinished - rec.received.keys())} within {bound + SLACK:.1f}s of P0's death"
    )
    after = {r: rec.received[r].at - t_kill for r in sorted(unfinished)}
    say(f"[kill] heartbeat {HEARTBEAT:.3f}s + handshake_timeout {HANDSHAKE_TIMEOUT}s = bound {bound:.3f}s (+{SLACK})")
    say(f"[kill] {len(unfinished) - len(stuck)} of {len(on_p0)} P0 requests unfinished at the kill, {len(stuck)} stuck")
    say("[kill] D ended each this long after the kill:", ", ".join(f"{r}={s:.3f}s" for r, s in after.items()))
    for r in sorted(unfinished):
        say(f"[kill]   {r}: {rec.received[r].why or 'landed'}")
    for r, s in after.items():
        assert s <= bound + SLACK, f"{r}: D took {s:.2f}s after P0's death (bound {bound:.2f}s + {SLACK}s)"
    for r in stuck:
        assert rec.received[r].why is not None, f"{r}: D reported KV that P0 never wrote"
    for d, o in on_p0:
        if o.d_id not in unfinished:
            assert_landed(o, d)  # finished before the kill
        elif o.received is None:  # pushed before P0 died: then every byte must be right
            assert o.wrong == 0 and o.checked == expected_bytes(o, d.spec.tp_size), f"{o.d_id}: torn push landed"
    failed_on_p0 = sum(1 for r in unfinished if rec.received[r].why is not None)

    assert rec.router.wait(lambda: all(o.done for _, o in on_p1), 60), (
        f"P1 requests not finished: {[o.d_id for _, o in on_p1 if not o.done]}"
    )
    for d, o in on_p1:
        assert_landed(o, d)
    say(f"[kill] all {len(on_p1)} P1 requests landed byte-exact, 12 of them dispatched after the kill")

    # Both Ds end with every block back, nothing held, healthy; P1 too.
    failed_seen = 0
    for d in ds:
        stats = settled_blocks(d, SLACK)
        say(f"[kill] {d.spec.engine_id}: free={stats['free_blocks']}/{SPEC.num_blocks} metrics={stats['metrics']}")
        assert stats["free_blocks"] == SPEC.num_blocks, f"{d.spec.engine_id} leaked blocks"
        assert stats["held"] == 0 and not stats["pending_push_work"]
        assert stats["healthy"], f"{d.spec.engine_id} unhealthy after P0 died"
        failed_seen += metric(stats, "recv.failed")
        # D learnt P0 was gone from NIXL and its death check found P0's side channel refusing.
        assert metric(stats, "recv.peer_gone") >= 1 and metric(stats, "remote.dead") >= 1, stats["metrics"]
        assert d.process.is_alive() and d.error is None
    assert failed_seen == failed_on_p0, f"the Ds failed {failed_seen} requests; {failed_on_p0} P0 requests failed"
    quiet, p1_stats = p1.quiesce(timeout=30)
    assert quiet and p1_stats["held"] == 0 and p1_stats["free_blocks"] == SPEC.num_blocks
    assert metric(p1_stats, "push.failed") == 0 and p1_stats["healthy"]
    assert p1.error is None
