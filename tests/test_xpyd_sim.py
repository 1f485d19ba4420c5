"""Simulated xPyD (issue 13, part 4): 8 P and 8 D engines over one fake fabric, in one process.

:class:`~pushactors.testing.xpyd.XpydSim` routes with the router's own :class:`EnginePool` s
(least outstanding), keeps thousands of requests in flight, verifies every landed request's bytes
on D and releases both legs' leases. Checked here: every request lands byte-exact and the load is
even across engines (20,000 requests, 2,000 in flight; 4,000 with 500 in flight); a P killed mid-run
fails only its own requests, within a bounded time, and the router stops choosing it; engines of
different TP sizes serve each other.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from pushactors.testing.engine import SimEngine
from pushactors.testing.xpyd import XpydResult, XpydSim, sim_spec

pytestmark = pytest.mark.timeout(600)

TOKENS = (17, 48)  # 2-3 blocks of 16 tokens per request


def stat(engines: list[SimEngine], name: str) -> int:
    return sum(w.stats().get(name, 0) for e in engines for w in e.workers)


def assert_all_landed(result: XpydResult, requests: int) -> None:
    assert result.requests == requests
    assert not result.failed, f"{len(result.failed)} failed, e.g. {list(result.failed.items())[:3]}"
    assert result.landed == requests
    assert result.bytes_wrong == 0, f"wrong bytes in {result.wrong_requests[:5]}"
    assert result.bytes_checked > 0


def assert_clean(sim: XpydSim) -> None:
    sim.settle(timeout=60)
    assert sim.leaks() == []


def assert_even(counts: dict[str, int], total: int, tolerance: float = 0.10) -> None:
    assert sum(counts.values()) == total
    assert XpydResult.spread(counts) <= tolerance, f"uneven load: {counts}"


def run_8p8d(requests: int, in_flight: int, tolerance: float = 0.10) -> XpydResult:
    with XpydSim(8, 8, spec=sim_spec(in_flight, 8, tokens=TOKENS[1])) as sim:
        assert sim.warm_up() > 0  # every P-D handshake done: the counts below measure the policy
        result = sim.run(requests, in_flight=in_flight, tokens=TOKENS, timeout=540)
        print(f"8P8D {requests} requests, {in_flight} in flight: {result.summary()}")
        assert_all_landed(result, requests)
        assert result.max_in_flight == min(in_flight, requests)
        assert_even(result.per_prefill, requests, tolerance)
        assert_even(result.per_decode, requests, tolerance)
        assert stat(list(sim.decodes.values()), "remote.dead") == 0
        assert_clean(sim)
        return result


def test_8p8d_ci_sized_every_request_lands_byte_exact_and_load_is_even() -> None:
    # Several in-flight generations: per-engine spread 1.6-3.8% on a loaded 2-core machine
    # (with 2,000 requests it is 2-9%), but 11.4% once in a full CI run: least outstanding
    # sends less to an engine that the scheduler runs less, as it should. 20% still fails a
    # policy that ignores load (everything to one engine is a spread of 700%). 5-9 s.
    run_8p8d(4_000, 500, tolerance=0.20)


def test_8p8d_20k_requests_thousands_in_flight() -> None:
    # 20-48 s on 2 cores (420-970 requests/s, by load); per-engine spread 1-2% (5% on a loaded machine).
    run_8p8d(20_000, 2_000)


def test_a_killed_prefill_fails_only_its_own_requests_within_a_bounded_time() -> None:
    requests, in_flight, victim = 3_000, 1_000, "prefill-3"
    with XpydSim(8, 8, spec=sim_spec(in_flight, 8, tokens=TOKENS[1])) as sim:
        sim.warm_up()
        agents = sim.agents_of(victim)
        open_at_kill: list[str] = []
        stalled: list[str] = []

        def stall() -> None:
            # The P stalls before it dies (as a dying process does): its WRITEs from here on stay
            # in flight and never land, so the kill surely catches requests mid-push; the others
            # it had are pushed or not, as the race goes.
            sim.fabric.faults.hold_transfer(match=lambda c: c.op == "WRITE" and c.src in agents)
            stalled.extend(k for k, r in sim.requests.items() if r.p.name == victim)

        def kill() -> None:
            open_at_kill.extend(k for k, r in sim.requests.items() if r.p.name == victim and r.d_open)
            sim.kill_prefill(victim)

        at = {requests * 2 // 5: stall, requests // 2: kill}
        result = sim.run(requests, in_flight=in_flight, tokens=TOKENS, timeout=300, at=at)
        print(f"kill {victim}: {result.summary()} failed={len(result.failed)} open_at_kill={len(open_at_kill)}")
        killed_at = sim.killed_at[victim]
        # The kill hit requests in flight there, and only those (and any sent before it was out).
        sent_while_stalled = {k for k, r in sim.requests.items() if r.p.name == victim and k not in stalled}
        # Requests sent to it while it stalled (least outstanding may send none: its held WRITEs
        # keep it loaded) must all fail; the kill must have caught requests in flight there.
        assert open_at_kill, "the kill caught no request in flight on the P"
        assert sent_while_stalled <= set(result.failed), "a WRITE held in flight at P's death landed"
        assert set(open_at_kill) >= sent_while_stalled
        assert set(result.failed_on.values()) == {victim}, Counter(result.failed_on.values())
        assert set(result.failed) <= set(open_at_kill) | {
            k for k, r in sim.requests.items() if r.p.name == victim and r.started >= killed_at
        }
        assert result.landed == requests - len(result.failed)
        assert result.bytes_wrong == 0, f"wrong bytes in {result.wrong_requests[:5]}"
        # Every request on the dead P ended within a bounded time: D noticed the death.
        ends = [r.ended for r in sim.requests.values() if r.p.name == victim and r.ended is not None]
        assert len(ends) == result.per_prefill[victim]
        settle_s = max(ends) - killed_at
        print(f"requests on {victim} all ended {settle_s:.2f}s after the kill")
        assert settle_s < 15.0, f"D took {settle_s:.1f}s to fail the dead P's requests"
        decodes = list(sim.decodes.values())
        assert stat(decodes, "remote.dead") >= 1, "no D declared the P dead"
        # The router took it out and stopped choosing it; the others carried the rest evenly.
        down = sim.p_pool.get(victim)
        assert down is not None and not down.up
        assert sim.chosen_after_down(victim) == 0
        others = {k: v for k, v in result.per_prefill.items() if k != victim}
        # Fewer requests per engine than the 8P8D runs (~375): one full CI run saw prefill-4 at
        # 474 beside 388-418, least outstanding answering what the scheduler ran; a policy
        # that ignored load would be far past 25%.
        assert XpydResult.spread(others) <= 0.25, others
        # Every other request after the kill still landed byte-exact.
        late = [r for r in sim.requests.values() if r.started > killed_at + 0.5]
        assert late and all(r.landed and r.wrong == 0 for r in late)
        assert_clean(sim)


def test_mixed_tp_engines_serve_each_other_byte_exact() -> None:
    requests, in_flight = 1_200, 300
    p_tp, d_tp = [1, 2, 2, 1], [1, 2, 1, 2]
    with XpydSim(4, 4, p_tp=p_tp, d_tp=d_tp, spec=sim_spec(in_flight, 4, tokens=TOKENS[1])) as sim:
        sim.warm_up()
        result = sim.run(requests, in_flight=in_flight, tokens=TOKENS, timeout=300)
        print(f"mixed TP: {result.summary()}")
        assert_all_landed(result, requests)
        pairs = Counter(
            (sim.prefills[r.p.name].tp_size, sim.decodes[r.d.name].tp_size) for r in sim.requests.values() if r.d
        )
        assert set(pairs) == {(1, 1), (1, 2), (2, 1), (2, 2)}, pairs
        assert_clean(sim)


def test_the_sim_catches_wrong_bytes() -> None:
    # Negative control: KV that P never wrote (its pool rows corrupted before the push) must be
    # counted wrong on D, so a clean run above means the bytes really were checked.
    with XpydSim(2, 2, spec=sim_spec(20, 2)) as sim:
        victim = sim.prefills["prefill-1"]
        real = victim.write_kv

        def corrupt(blocks: list[int], key: str, first_position: int) -> None:
            real(blocks, key, first_position)
            for kv in victim.kv:
                for t in kv.values():
                    t[0, blocks[0], 0] ^= 0x5A

        victim.write_kv = corrupt  # type: ignore[method-assign]
        start = time.monotonic()
        result = sim.run(40, in_flight=20, tokens=32, timeout=60)
        assert time.monotonic() - start < 60
        bad = set(result.wrong_requests)
        assert bad and bad == {k for k, r in sim.requests.items() if r.p.name == "prefill-1"}
        # One corrupted byte per layer (K half, first block) of every request prefill-1 served.
        assert result.bytes_wrong == len(bad) * victim.spec.num_layers * victim.tp_size


def test_bench_xpyd_suite_writes_its_json(tmp_path: Path) -> None:
    from pushactors.apps.cli import main

    out = tmp_path / "xpyd.json"
    argv = ["bench", "xpyd", "--json", str(out), "--prefills", "2", "--decodes", "3", "--p-tp", "1,2"]
    argv += ["--requests", "150", "--in-flight", "60", "--no-progress"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "xpyd" and result["prefills"] == [1, 2] and result["decodes"] == [1, 1, 1]
    assert result["requests"] == result["landed"] == 150 and result["failed"] == 0 and result["bytes_wrong"] == 0
    assert result["bytes_checked"] > 0 and result["requests_per_s"] > 0 and result["leaks"] == []
    assert sum(result["per_prefill"].values()) == sum(result["per_decode"].values()) == 150
