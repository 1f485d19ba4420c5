"""Soak: many requests, random orders and ~10% random faults; nothing hangs, leaks or lies.

Two soaks (issue 5, "Soak and fuzz"):

* over the fake fabric, P and D in this process (``PushPair``), with faults injected in the
  fabric, D aborts and P cancels;
* over real NIXL on DRAM, P and D in two processes (``Node``), with faults injected around the
  real agents (``FaultyAgent``).

Afterwards: every request reported (finished or failed, with a reason), no wrong byte in any
request reported as landed, every block back in its pool, no pending push work, every actor
table empty. The fake soak also *poisons* D's free blocks (0xFF never occurs in the KV pattern,
whose bytes are ``… % 251``) and checks the poison at every reuse and at the end: a WRITE that
lands in a block D already released is caught even when no later request is verified over it.

Sizes: ``PUSHACTORS_SOAK_N`` (requests), ``PUSHACTORS_SOAK_SEED`` (printed; a failure reruns
from it), ``PUSHACTORS_LONG=1`` for the long runs (10,000 fake, 1,000 real requests).
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from pushactors.config import PushConfig
from pushactors.testing import FakeFabric, PushPair, SimSpec, StepReport
from pushactors.testing.fabric import Fault
from pushactors.testing.faults import random_match

SEED = int(os.environ.get("PUSHACTORS_SOAK_SEED", "20240605"))
POISON = 0xFF  # pattern bytes are (… * 131) % 251: never 0xFF


# Durations short enough that every fault ends within seconds (SPEC §6; all configurable), and
# safe by the library's own rule (abort_quarantine >= 2/3 lease + write_timeout).
FAKE_CONFIG = {
    "lease_duration": 1.0,
    "registration_timeout": 1.5,
    "abort_quarantine": 1.6,
    "reaper_tick": 0.02,
    "write_timeout": 0.8,
    "heartbeat_interval": 0.15,
    "handshake_timeout": 2.0,
    "orphan_registration_ttl": 3.0,
}
# The longest a request may take from its later leg to both reports, faults included:
# watchdog + quarantine on D, lease + heartbeat extension + WRITE timeout on P, with slack.
HANG_BOUND = 12.0

FAULT_KINDS = (
    "raise_on_transfer",
    "err_transfer",
    "drop_notif",
    "delay_notif",
    "duplicate_notif",
    "fail_send_notif",
    "slow_transfer",
)

_REASONS = [
    ("watchdog", re.compile(r"registration timeout|watchdog")),
    ("d_abort", re.compile(r"aborted by engine|aborted by decode|aborted before")),
    ("p_cancel", re.compile(r"aborted on P|request aborted")),
    ("write_submit", re.compile(r"WRITE submission failed")),
    ("write_err", re.compile(r"WRITE ended in ERR|ERR at post")),
    ("write_timeout", re.compile(r"WRITE not done")),
    ("invalid_write", re.compile(r"invalid WRITE")),
    ("reg_send", re.compile(r"sending PUSH_REG|PUSH_REG .* failed")),
    ("handshake", re.compile(r"handshake")),
    ("lease", re.compile(r"lease_expired|lease expired|already expired")),
    ("tombstone", re.compile(r"already (pushed|failed|finished)")),
    ("served", re.compile(r"another registration was served")),
    ("no_blocks", re.compile(r"no free blocks")),
]


def test_soak_settings_are_safe() -> None:
    """The soaks run settings the library itself considers safe (no late-WRITE window)."""
    for config in (FAKE_CONFIG, REAL_CONFIG):
        assert PushConfig(engine_id="x", **config).safety_warnings() == []


def reason_category(reason: str) -> str:
    for name, pattern in _REASONS:
        if pattern.search(reason):
            return name
    return "other:" + reason[:60]


# ============================================================================================
# Fake fabric soak
# ============================================================================================
@dataclass
class Req:
    index: int
    p_id: str
    d_id: str
    tokens: int
    cached: int
    tid: str | None
    key: str
    order: str
    p_cancel: bool = False
    d_abort: bool = False
    p_started: float = 0.0  # when P's leg ran (0: not yet)
    d_started: float = 0.0
    p_report: str | None = None
    d_report: str | None = None
    p_done: bool = False
    d_done: bool = False
    abort_sent: bool = False  # abort_recv accepted it
    abort_after: float = 0.0  # seconds after D's leg
    gap: float = 0.0  # seconds between the two legs
    checked: int = 0
    wrong: int = 0
    tags: set[str] = field(default_factory=set)

    @property
    def finished(self) -> bool:
        return self.d_done and (self.p_done or self.p_cancel)

    @property
    def last_start(self) -> float:
        return max(self.p_started, self.d_started)


class FakeSoak:
    """Drives a PushPair through ``n`` requests with a bounded window of requests in flight."""

    def __init__(self, pair: PushPair, n: int, seed: int, *, fault_rate: float = 0.10, window: int = 28) -> None:
        self.pair = pair
        self.n = n
        self.seed = seed
        self.rng = random.Random(seed)
        self._oldest = 0
        self.window = window
        self.spec = pair.decode.spec
        self.max_blocks = 12
        self.reqs: list[Req] = []
        self.by_p: dict[str, Req] = {}
        self.by_d: dict[str, Req] = {}
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.violations: list[str] = []
        self.outstanding = 0
        self.faults = self._arm_faults(random.Random(seed ^ 0x5EED), fault_rate)
        self._pause = threading.Event()
        self._poison_all()

    # --- faults --------------------------------------------------------------------------------
    def _arm_faults(self, rng: random.Random, rate: float) -> dict[str, Fault]:
        plan = self.pair.fabric.faults
        per_kind = rate / len(FAULT_KINDS)
        out: dict[str, Fault] = {}
        for kind in FAULT_KINDS:
            match = random_match(per_kind, rng)
            if kind == "delay_notif":
                out[kind] = plan.delay_notif(0.15, match, times=None)
            elif kind == "slow_transfer":
                out[kind] = plan.slow_transfer(0.2, match, times=None)
            elif kind == "duplicate_notif":
                out[kind] = plan.duplicate_notif(match, times=None, copies=1)
            else:
                out[kind] = getattr(plan, kind)(match, times=None)
        return out

    def fault_hits(self) -> dict[str, int]:
        return {k: f.hits for k, f in self.faults.items()}

    # --- D's poisoned free blocks --------------------------------------------------------------
    def _halves(self) -> list[torch.Tensor]:
        out = []
        for kv in self.pair.decode.kv:
            for t in kv.values():
                out += [t[0], t[1]] if self.spec.layout == "split" else [t[:, 0], t[:, 1]]
        return out

    def _poison_all(self) -> None:
        for kv in self.pair.decode.kv:
            for t in kv.values():
                t.fill_(POISON)

    def _poison(self, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, dtype=torch.long)
        for half in self._halves():
            half[idx] = POISON

    def _written_while_free(self, blocks: list[int]) -> list[int]:
        idx = torch.tensor(blocks, dtype=torch.long)
        bad: set[int] = set()
        for half in self._halves():
            rows = half[idx]
            hit = (rows != POISON).any(dim=1)
            bad.update(blocks[i] for i in torch.nonzero(hit).flatten().tolist())
        return sorted(bad)

    # --- scheduling ----------------------------------------------------------------------------
    def later(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.timers, (time.monotonic() + delay, next(self._seq), fn))

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, _, fn = heapq.heappop(self.timers)
            fn()

    def _new(self, i: int) -> Req:
        rng = self.rng
        base = f"soak-{i:06d}-{rng.randrange(4)}"
        tokens = rng.randint(1, self.max_blocks * self.spec.block_size)
        nblocks = self.pair.decode.blocks_for(tokens)
        r = Req(
            index=i,
            p_id=f"{base}-{rng.getrandbits(32):08x}",
            d_id=f"{base}-{rng.getrandbits(32):08x}",
            tokens=tokens,
            cached=rng.randrange(nblocks) if rng.random() < 0.25 else 0,
            tid=f"tx-{i}" if rng.random() < 0.3 else None,
            key=f"key-{i}",
            order=rng.choice(["together", "prefill_first", "decode_first"]),
        )
        roll = rng.random()
        if roll < 0.03:
            r.p_cancel = True
        elif roll < 0.06:
            r.d_abort = True
        # Drawn now, not when timers fire, so the workload is a function of the seed alone.
        r.abort_after = rng.choice([0.0, 0.002, 0.01, 0.05, 0.2])
        r.gap = rng.choice([0.0, 0.0, 0.001, 0.005, 0.02, 0.08])
        late = rng.random()
        if r.order == "prefill_first" and late < 0.02:
            r.gap = FAKE_CONFIG["lease_duration"] * 1.3  # P's lease expired before D registers
            r.tags.add("late_decode")
        elif r.order == "decode_first" and late < 0.02:
            r.gap = FAKE_CONFIG["registration_timeout"] * 1.2  # D's watchdog fired before P finished
            r.tags.add("late_prefill")
        self.reqs.append(r)
        self.by_p[r.p_id] = r
        self.by_d[r.d_id] = r
        self.outstanding += 1
        return r

    def _start(self, r: Req) -> None:
        base = r.p_id[: -len("-xxxxxxxx")]
        params = self.pair.prefill.scheduler.decode_params(base, r.tid)

        def p_leg() -> None:
            r.p_started = time.monotonic()
            if r.p_cancel:
                cancel = {"do_remote_decode": True}
                if r.tid is not None:
                    cancel["transfer_id"] = r.tid
                assert self.pair.prefill.scheduler.request_cancelled(r.p_id, cancel, reason="request aborted on P")
                return
            self.pair.prefill.prefill(r.p_id, r.tokens, key=r.key, transfer_id=r.tid)

        def d_leg() -> None:
            r.d_started = time.monotonic()
            rec = self.pair.decode.expect(r.d_id, r.tokens, params, key=r.key, cached_blocks=r.cached)
            dirty = self._written_while_free(rec.blocks)
            if dirty:
                self.violations.append(f"{r.d_id}: D blocks {dirty} were written while free")
            if r.d_abort:
                self.later(r.abort_after, lambda: self._abort(r))

        # Arrival orders and gaps, including legs later than P's lease or D's watchdog.
        first, second = (p_leg, d_leg) if r.order != "decode_first" else (d_leg, p_leg)
        first()
        if r.order == "together" or r.gap == 0.0:
            second()
        else:
            self.later(r.gap, second)

    def _abort(self, r: Req) -> None:
        if r.d_done:
            return
        r.abort_sent = self.pair.decode.scheduler.abort_recv(r.d_id)

    # --- reports -------------------------------------------------------------------------------
    def _collect(self, p_rep: StepReport, d_rep: StepReport) -> None:
        for rid in p_rep.finished_sending:
            r = self.by_p.get(rid)
            if r is None:
                self.violations.append(f"P reported unknown request {rid}")
                continue
            if r.p_done:
                self.violations.append(f"{rid}: P reported twice")
                continue
            r.p_done = True
            r.p_report = p_rep.failed_sending.get(rid)
            if r.p_cancel:
                self.violations.append(f"{rid}: P reported a request that was cancelled before it finished")
            if r.finished:
                self.outstanding -= 1
        for rid in d_rep.finished_recving | set(d_rep.failed_recving):
            r = self.by_d.get(rid)
            if r is None:
                self.violations.append(f"D reported unknown request {rid}")
                continue
            if r.d_done:
                self.violations.append(f"{rid}: D reported twice")
                continue
            r.d_done = True
            r.d_report = d_rep.failed_recving.get(rid)
            if r.d_report is None:
                r.checked, r.wrong = self.pair.decode.verify(rid)
                want = (self.pair.decode.blocks_for(r.tokens) - r.cached) * self.spec.block_bytes * 2
                want *= self.spec.num_layers
                if r.checked != want:
                    self.violations.append(f"{rid}: checked {r.checked} bytes, expected {want}")
                if r.p_cancel:
                    self.violations.append(f"{rid}: landed although P cancelled it")
            blocks = self.pair.decode.recvs[rid].blocks
            self.pair.decode.finish_recv(rid)
            self._poison(blocks)
            if r.finished:
                self.outstanding -= 1

    # --- the loop ------------------------------------------------------------------------------
    def run(self) -> None:
        started = 0
        while started < self.n or self.outstanding:
            while started < self.n and self.outstanding < self.window:
                self._start(self._new(started))
                started += 1
            self._run_timers()
            p_rep, d_rep = self.pair.step()
            self._collect(p_rep, d_rep)
            self._check_hung()
            self._pause.wait(0.0005)

    def _check_hung(self) -> None:
        now = time.monotonic()
        while self._oldest < len(self.reqs) and self.reqs[self._oldest].finished:
            self._oldest += 1
        for r in self.reqs[self._oldest : self._oldest + 2 * self.window]:
            if not r.finished and r.p_started and r.d_started and now - r.last_start > HANG_BOUND:
                raise AssertionError(f"hung request after {HANG_BOUND}s: {describe(r)} (seed {self.seed})")

    def settle(self, timeout: float = 20.0) -> None:
        self.pair.pump(self.pair.settled, timeout=timeout, what="pending push work to clear on both engines")


def describe(r: Req) -> str:
    return (
        f"#{r.index} p={r.p_id} d={r.d_id} order={r.order} tid={r.tid} cached={r.cached} "
        f"cancel={r.p_cancel} abort={r.d_abort}/{r.abort_sent} tags={sorted(r.tags)} "
        f"p_done={r.p_done}:{r.p_report!r} d_done={r.d_done}:{r.d_report!r}"
    )


def _sum_stats(engine) -> Counter[str]:
    total: Counter[str] = Counter()
    for w in engine.workers:
        total.update(w.stats())
    return total


def run_fake_soak(n: int, seed: int, *, p_tp: int = 1, d_tp: int = 1) -> None:
    spec = SimSpec(num_layers=2, num_blocks=512, block_bytes=512)
    fabric = FakeFabric()
    wall = time.monotonic()
    print(f"\nfake soak: seed={seed} n={n} p_tp={p_tp} d_tp={d_tp} (rerun: PUSHACTORS_SOAK_SEED={SEED})")
    with PushPair(fabric=fabric, p_tp=p_tp, d_tp=d_tp, p_spec=spec, seed=seed, **FAKE_CONFIG) as pair:
        p_total, d_total = pair.prefill.free_blocks, pair.decode.free_blocks
        soak = FakeSoak(pair, n, seed)
        soak.run()
        # What is left: leases of requests whose D never asked, tombstones, quarantines.
        soak.settle()
        hits = soak.fault_hits()
        fabric.faults.clear()

        # Nothing hung: every request reported on both sides, once.
        unfinished = [describe(r) for r in soak.reqs if not r.finished]
        assert not unfinished, f"{len(unfinished)} hung: {unfinished[:5]}"
        assert len(soak.reqs) == n
        # Every report was about a known request, at most once; nothing landed that must not.
        assert not soak.violations, f"{len(soak.violations)} violations (seed {seed}): {soak.violations[:10]}"
        # No wrong byte in any request reported as landed.
        ok = [r for r in soak.reqs if r.d_report is None]
        wrong = [(r.d_id, r.wrong) for r in ok if r.wrong]
        assert not wrong, f"wrong bytes (seed {seed}): {wrong[:10]}"
        # Every failure says why.
        assert all(r.d_report for r in soak.reqs if r.d_report is not None)
        assert all(r.p_report for r in soak.reqs if r.p_report is not None)
        # A D request that landed was pushed by P (P never reports failure for a WRITE that landed).
        landed_but_p_failed = [describe(r) for r in ok if r.p_report is not None]
        assert not landed_but_p_failed, landed_but_p_failed[:5]
        # A request P cancelled never lands.
        assert not [r for r in ok if r.p_cancel]

        # No leaked blocks on either side; no push work left; every actor table empty.
        assert not pair.prefill.held, f"P still holds {list(pair.prefill.held)[:5]}"
        assert pair.prefill.free_blocks == p_total
        assert not pair.decode.recvs
        assert pair.decode.free_blocks == d_total
        assert not pair.prefill.has_pending_push_work()
        assert not pair.decode.has_pending_push_work()
        for engine in (pair.prefill, pair.decode):
            for w in engine.workers:
                assert w.healthy, w.unhealthy_reason
                assert w.pending() == (0, 0)
                rt = w.runtime
                writer, matcher, reaper = (rt.actor(x).sizes() for x in ("writer", "matcher", "reaper"))
                assert writer["pushes"] == 0 and writer["in_flight"] == 0 and writer["awaiting"] == 0, writer
                assert matcher["finished"] == 0 and matcher["pending_registrations"] == 0, matcher
                assert matcher["by_tid"] == 0 and matcher["by_base"] == 0 and matcher["regs_by_id"] == 0, matcher
                assert reaper["leases"] == 0 and reaper["recvs"] == 0, reaper
        # Every free D block still holds its poison: no WRITE landed in a released block.
        dirty = soak._written_while_free(list(range(spec.num_blocks)))
        assert not dirty, f"D blocks written after they were released: {dirty[:20]} (seed {seed})"
        assert fabric.in_flight() == 0

        p_stats, d_stats = _sum_stats(pair.prefill), _sum_stats(pair.decode)
        errors = {k: v for k, v in (p_stats + d_stats).items() if k.endswith((".handler_error", ".died"))}
        assert not errors, f"actor handler errors: {errors}"

        # The soak did what it claims: faults were injected and requests failed and landed.
        failed_d = Counter(reason_category(r.d_report) for r in soak.reqs if r.d_report is not None)
        failed_p = Counter(reason_category(r.p_report) for r in soak.reqs if r.p_report is not None)
        assert sum(hits.values()) > 0
        assert len(ok) >= n * 0.6, f"only {len(ok)} of {n} landed"
        if n >= 200:
            assert sum(failed_d.values()) > 0
        wall = time.monotonic() - wall
        print(
            f"fake soak summary: seed={seed} requests={n} ok={len(ok)} d_failed={sum(failed_d.values())} "
            f"p_failed={sum(failed_p.values())} cancelled={sum(r.p_cancel for r in soak.reqs)} "
            f"aborted={sum(r.abort_sent for r in soak.reqs)} late={sum(bool(r.tags) for r in soak.reqs)} "
            f"wall={wall:.1f}s"
        )
        print(f"  D failures by reason: {dict(failed_d.most_common())}")
        print(f"  P failures by reason: {dict(failed_p.most_common())}")
        print(f"  faults injected: {hits} (total {sum(hits.values())})")
        s = fabric.stats
        print(
            f"  fabric: transfers posted={s.transfers_posted} done={s.transfers_done} err={s.transfers_err} "
            f"cancelled={s.transfers_cancelled} notifs sent={s.notifs_sent} dropped={s.notifs_dropped} "
            f"duplicated={s.notifs_duplicated}; verified {sum(r.checked for r in ok)} bytes"
        )


TOPOLOGIES = [pytest.param(1, 1, id="tp1"), pytest.param(2, 1, id="p_tp2-d_tp1")]
SHORT_N = {(1, 1): 400, (2, 1): 120}
LONG_N = {(1, 1): 10_000, (2, 1): 2_000}


@pytest.mark.parametrize(("p_tp", "d_tp"), TOPOLOGIES)
def test_fake_fabric_soak(p_tp: int, d_tp: int) -> None:
    """The CI-sized soak (``PUSHACTORS_SOAK_N`` overrides its size)."""
    n = int(os.environ.get("PUSHACTORS_SOAK_N") or SHORT_N[(p_tp, d_tp)])
    run_fake_soak(n, SEED + 7 * p_tp + d_tp, p_tp=p_tp, d_tp=d_tp)


@pytest.mark.slow
@pytest.mark.parametrize(("p_tp", "d_tp"), TOPOLOGIES)
def test_fake_fabric_soak_long(p_tp: int, d_tp: int) -> None:
    """Issue 5's long soak: 10,000 requests at TP 1 (and 2,000 with two P ranks per D rank)."""
    n = int(os.environ.get("PUSHACTORS_SOAK_N") or LONG_N[(p_tp, d_tp)])
    run_fake_soak(n, SEED + 7 * p_tp + d_tp + 1, p_tp=p_tp, d_tp=d_tp)


# ============================================================================================
# Real NIXL (DRAM) soak, two processes
# ============================================================================================
REAL_CONFIG = {
    "lease_duration": 1.5,
    "registration_timeout": 2.0,
    "abort_quarantine": 2.1,
    "reaper_tick": 0.02,
    "write_timeout": 1.0,
    "heartbeat_interval": 0.2,
    "handshake_timeout": 5.0,
    "orphan_registration_ttl": 4.0,
}
REAL_FAULT_KINDS = [
    "fail_add_remote",
    "raise_on_transfer",
    "err_transfer",
    "drop_notif",
    "delay_notif",
    "duplicate_notif",
    "fail_send_notif",
]


def _nixl_or_skip() -> None:
    from pushactors.nixl import nixl_available

    if nixl_available():
        return
    if os.environ.get("PUSHACTORS_REQUIRE_NIXL"):
        raise RuntimeError("PUSHACTORS_REQUIRE_NIXL is set but NIXL cannot be imported")
    pytest.skip("NIXL is not installed")


def run_real_soak(n: int, seed: int) -> None:
    _nixl_or_skip()
    from pushactors.node import Node, NodeSpec, Router

    spec = SimSpec(num_layers=2, num_blocks=256, block_bytes=1024)
    router = Router(seed=seed)
    faults = {"rate": 0.10, "kinds": REAL_FAULT_KINDS, "delay": 0.1}
    print(f"\nreal NIXL soak: seed={seed} n={n} (rerun: PUSHACTORS_SOAK_SEED={SEED})")
    p = Node(
        NodeSpec(
            role="prefill",
            engine_id="prefill-soak",
            sim=spec,
            config=REAL_CONFIG,
            seed=seed,
            faults={**faults, "seed": seed},
        ),
        on_event=router.on_event,
    )
    d = Node(
        NodeSpec(
            role="decode",
            engine_id="decode-soak",
            sim=spec,
            config=REAL_CONFIG,
            seed=seed + 1,
            faults={**faults, "seed": seed + 1},
        ),
        on_event=router.on_event,
    )
    wall = time.monotonic()
    rng = random.Random(seed)
    max_blocks = 10
    window = spec.num_blocks // max_blocks - 2
    p_final = d_final = None
    try:
        p.wait_ready()
        d.wait_ready()
        for i in range(n):
            assert router.wait_below(window, timeout=30), f"requests stopped finishing at #{i} (seed {seed})"
            router.dispatch_mixed(p, d, i, rng, max_blocks=max_blocks, block_size=spec.block_size)
        # Nothing hung: both legs of every request reported, within the lease/watchdog bounds.
        done = router.wait_all(timeout=HANG_BOUND * 3)
        hung = [o for o in router.outcomes if not o.done]
        assert done and not hung, f"{len(hung)} hung (seed {seed}): {hung[:5]}"
        p_quiet, p_stats = p.quiesce(timeout=30)
        d_quiet, d_stats = d.quiesce(timeout=30)
    finally:
        p_final = p.stop()
        d_final = d.stop()
    wall = time.monotonic() - wall
    assert p.error is None and d.error is None, p.error or d.error

    outcomes = router.outcomes
    assert len(outcomes) == n
    ok = [o for o in outcomes if o.received is None]
    for o in ok:
        assert o.wrong == 0, f"{o.d_id}: {o.wrong} wrong bytes (seed {seed})"
        blocks = -(-o.tokens // spec.block_size) - o.cached
        assert o.checked == blocks * spec.block_bytes * 2 * spec.num_layers, o
        assert o.sent is None, f"{o.p_id}: KV landed on D but P reported failure {o.sent!r}"
    assert all(o.received for o in outcomes if o.received is not None), "a D failure without a reason"
    assert all(o.sent for o in outcomes if o.sent is not None), "a P failure without a reason"

    assert p_quiet and d_quiet, "push work still pending"
    assert p_stats["held"] == 0 and p_stats["free_blocks"] == spec.num_blocks, p_stats
    assert d_stats["free_blocks"] == spec.num_blocks, d_stats
    assert p_stats["healthy"] and d_stats["healthy"]
    errors = {
        k: v
        for stats in (p_stats, d_stats)
        for k, v in stats["metrics"].items()
        if k.endswith((".handler_error", ".died"))
    }
    assert not errors, f"actor handler errors: {errors}"
    assert p_final is not None and d_final is not None

    failed_d = Counter(reason_category(o.received) for o in outcomes if o.received is not None)
    failed_p = Counter(reason_category(o.sent) for o in outcomes if o.sent is not None)
    assert len(ok) >= n * 0.6, f"only {len(ok)} of {n} landed"
    pm, dm = p_stats["metrics"], d_stats["metrics"]
    print(
        f"real soak summary: seed={seed} requests={n} ok={len(ok)} d_failed={sum(failed_d.values())} "
        f"p_failed={sum(failed_p.values())} wall={wall:.1f}s"
    )
    print(f"  D failures by reason: {dict(failed_d.most_common())}")
    print(f"  P failures by reason: {dict(failed_p.most_common())}")
    print(
        f"  P: writes posted={pm.get('write.posted', 0)} done={pm.get('write.done', 0)} "
        f"failed={pm.get('write.failed', 0)} pushed={pm.get('push.pushed', 0)} "
        f"expired={pm.get('push.expired', 0)} failed_push={pm.get('push.failed', 0)}; "
        f"D: finished={dm.get('recv.finished', 0)} failed={dm.get('recv.failed', 0)} "
        f"timed_out={dm.get('recv.timed_out', 0)}; verified {sum(o.checked for o in ok)} bytes"
    )
    # FaultyAgent counts stay in the node processes; their effects show in the counters.
    effects = re.compile(r"fail|duplicate|timed_out|expired|malformed|undeliver|unknown|refused")
    for side, m in (("P", pm), ("D", dm)):
        print(f"  {side} fault effects: {dict(sorted((k, v) for k, v in m.items() if effects.search(k)))}")


@pytest.mark.real_nixl
def test_real_nixl_soak() -> None:
    """CI size (``PUSHACTORS_SOAK_N`` overrides it); two processes, faults at both agents."""
    run_real_soak(int(os.environ.get("PUSHACTORS_SOAK_N") or 200), SEED + 3)


@pytest.mark.slow
@pytest.mark.real_nixl
def test_real_nixl_soak_long() -> None:
    """Issue 5's long real-NIXL soak: at least 1,000 requests."""
    run_real_soak(max(1000, int(os.environ.get("PUSHACTORS_SOAK_N") or 1000)), SEED + 4)
