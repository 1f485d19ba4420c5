"""Operators' signals after real pushes through the fake fabric: push and receive latency
samples, each rank's gauges (health, requests in flight or awaiting KV, quarantined receives),
the vLLM stats object that carries them (aggregated across ranks, reduced for the log line) and,
with vLLM's python, the Prometheus counters, histograms and per-rank gauges they feed."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_kit import import_connector

from pushactors.core.outbox import Metrics
from pushactors.engine.worker import PushWorker
from pushactors.protocol import HeartbeatArrived
from pushactors.testing import PushPair, wait_until

REPO = Path(__file__).resolve().parent.parent
VLLM_PY = os.environ.get("PUSHACTORS_VLLM_PYTHON")
conn = import_connector()


def stats_of(worker: PushWorker, last: SimpleNamespace | None = None) -> Any:
    """What the connector's get_kv_connector_stats hands vLLM for ``worker`` (its own state
    kept in ``last`` across calls, as the connector keeps it)."""
    holder = last or SimpleNamespace(_worker=worker, _last_stats={}, _last_gauges={})
    return conn.PushActorsConnector.get_kv_connector_stats(holder)


def test_a_push_records_both_latencies_and_gauges_follow_it() -> None:
    with PushPair(stats_interval=0.05) as pair:
        p, d = pair.prefill.workers[0], pair.decode.workers[0]
        params = pair.prefill.scheduler.decode_params("r-0")
        pair.decode.expect("r-0-d", 40, params, key="k")
        stepped = time.monotonic()
        pair.decode.step()  # hands the registration over
        registered = time.monotonic()
        assert d.gauges()["recvs_awaiting"] == 1  # registered, nothing pushed yet
        matcher = p.runtime.view("matcher")
        pair.pump(lambda: matcher.sizes()["pending_registrations"] == 1, timeout=10, what="P to park the registration")
        prefilled = time.monotonic()
        pair.prefill.prefill("r-0", 40, key="k")
        pair.prefill.step()
        pair.pump(lambda: "r-0-d" in pair.received and "r-0" in pair.sent, timeout=10, what="the push")
        ended = time.monotonic()
        assert pair.received["r-0-d"] is None and pair.sent["r-0"] is None
        assert pair.decode.verify("r-0-d")[1] == 0  # the KV landed intact
        (push,) = p.ctx.metrics.take_samples()["push.seconds"]
        (recv,) = d.ctx.metrics.take_samples()["recv.seconds"]
        # D's span starts at its registration, before P had the blocks; P's at its prefill.
        assert prefilled - registered <= recv <= ended - stepped
        assert 0 < push <= ended - prefilled
        assert p.ctx.metrics.take_samples() == {}  # taken once
        # Everything handed over was reported; supervision's next read shows no WRITE in flight.
        assert p.gauges()["pushes_in_flight"] == 0 and d.gauges()["recvs_awaiting"] == 0
        wait_until(
            lambda: p.gauges().get("writes_in_flight") == 0 and d.gauges().get("recv_quarantined") == 0,
            timeout=5,
            what="supervision's read of the writer's and the reaper's tables",
        )
        assert p.gauges()["healthy"] == 1 and d.gauges()["healthy"] == 1


def test_an_unanswered_abort_shows_as_quarantined_until_its_blocks_are_freed() -> None:
    with PushPair(
        # A lease long enough that a registration slowed by a loaded machine still reaches P within
        # D's promise (2/3 of it); the quarantine just covers it.
        stats_interval=0.05,
        abort_quarantine=1.3,
        write_timeout=0.1,
        lease_duration=1.5,
        reaper_tick=0.02,
    ) as pair:
        p, d = pair.prefill.workers[0], pair.decode.workers[0]
        pair.decode.expect("r-0-d", 40, pair.prefill.scheduler.decode_params("r-0"), key="k")
        pair.decode.step()
        matcher = p.runtime.view("matcher")
        pair.pump(lambda: matcher.sizes()["pending_registrations"] == 1, timeout=10, what="P to park the registration")
        # P's answer to the abort is lost: D must sit out the quarantine.
        pair.fabric.faults.drop_notif(match=lambda c: c.src == "prefill-pp0-tp0", times=None)
        assert pair.decode.scheduler.abort_recv("r-0-d")
        pair.decode.step()
        wait_until(lambda: d.gauges().get("recv_quarantined") == 1, timeout=5, what="the quarantine gauge")
        assert "r-0-d" not in pair.received  # not reported: its blocks are not the engine's yet
        pair.pump(lambda: "r-0-d" in pair.received, timeout=10, what="the quarantine to end")
        assert pair.received["r-0-d"]  # reported failed: the engine frees its blocks now
        wait_until(lambda: d.gauges().get("recv_quarantined") == 0, timeout=5, what="the gauge to drop")
        assert d.gauges()["recvs_awaiting"] == 0


def test_a_dead_actor_turns_the_health_gauge_off_and_fails_its_requests_visibly() -> None:
    with PushPair(reaper_tick=0.02) as pair:
        p = pair.prefill.workers[0]
        for i in range(3):
            pair.prefill.prefill(f"p{i}", 40, key=f"k{i}")
        pair.prefill.step()
        first = stats_of(p)
        assert first is not None and first.data["ranks"] == {p.ctx.label: p.gauges()}
        assert p.gauges()["healthy"] == 1 and p.gauges()["pushes_in_flight"] == 3
        p.ctx.faults.fail_handler("matcher", HeartbeatArrived, kill=True)
        p.runtime.matcher.tell(HeartbeatArrived(ids=("x",), sender="test"))
        wait_until(lambda: p.gauges()["healthy"] == 0, timeout=5, what="the gauge to show the dead matcher")
        pair.pump(lambda: len(pair.sent) == 3, timeout=5, what="held requests reported failed")
        assert all("matcher actor died" in (why or "") for why in pair.sent.values())
        assert not pair.prefill.held  # their blocks went back to the pool
        assert p.gauges() == {**p.gauges(), "healthy": 0, "pushes_in_flight": 0}
        # vLLM hears of it: the rank's gauges in the stats (their change), the counter too.
        last = SimpleNamespace(_worker=p, _last_stats={}, _last_gauges=first.data["ranks"][p.ctx.label])
        report = stats_of(p, last)
        assert report.data["ranks"][p.ctx.label]["healthy"] == 0
        assert report.reduce()["ranks_unhealthy"] == 1
        assert stats_of(p, last) is None or "ranks" not in stats_of(p, last).data  # sent once, not every step


def test_stats_aggregate_across_ranks_and_reduce_for_the_log_line() -> None:
    with PushPair(p_tp=2, d_tp=1) as pair:
        for i in range(4):
            params = pair.prefill.prefill(f"r{i}", 40, key=f"k{i}")
            pair.decode.expect(f"r{i}-d", 40, params, key=f"k{i}")
        pair.pump(lambda: len(pair.received) == 4 and len(pair.sent) == 4, timeout=20, what="4 pushes")
        assert set(pair.received.values()) == {None} and set(pair.sent.values()) == {None}
        p0, p1 = pair.prefill.workers
        d0 = pair.decode.workers[0]
        total = stats_of(p0)
        for worker in (p1, d0):
            total = total.aggregate(stats_of(worker))  # as vLLM joins its workers' stats
        data = total.data
        assert data["push.pushed"] == 8  # each of 2 P ranks pushed its half of 4 requests
        assert len(data["samples"]["push.seconds"]) == 8 and len(data["samples"]["recv.seconds"]) == 4
        assert set(data["ranks"]) == {p0.ctx.label, p1.ctx.label, d0.ctx.label}
        reduced = total.reduce()
        assert reduced["push_pushed"] == 8 and reduced["ranks_unhealthy"] == 0
        assert reduced["push_ms_count"] == 8 and reduced["recv_ms_count"] == 4
        assert 0 < reduced["push_ms_p50"] <= reduced["push_ms_p99"]
        assert reduced["pushes_in_flight"] == 0 and reduced["recvs_awaiting"] == 0
        assert not total.is_empty()
        # A later step with nothing new: no stats at all, so vLLM logs nothing for it.
        again = SimpleNamespace(_worker=d0, _last_stats=d0.stats(), _last_gauges=d0.gauges())
        assert stats_of(d0, again) is None


def test_unread_samples_stay_bounded() -> None:
    metrics = Metrics()
    metrics.sample_cap = 10
    for i in range(25):
        metrics.observe("push.seconds", i / 100)
    assert metrics.take_samples() == {"push.seconds": [i / 100 for i in range(10)]}
    assert metrics.get("metrics.samples_dropped") == 15


# --------------------------------------------------------------------------------------------
# With vLLM: the real stats base class and Prometheus
# --------------------------------------------------------------------------------------------
PROM_SCRIPT = r"""
import json
import msgspec
from types import SimpleNamespace
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
import pushactors.integrations.vllm as conn
from pushactors.protocol import HeartbeatArrived
from pushactors.testing import PushPair, wait_until

def stats_of(worker, last=None):
    return conn.PushActorsConnector.get_kv_connector_stats(
        last or SimpleNamespace(_worker=worker, _last_stats={}, _last_gauges={}))

prom = conn.PushActorsConnector.build_prom_metrics(
    SimpleNamespace(kv_transfer_config=None), {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
    ["model_name", "engine"], {0: ["m", "0"]})
out = {"is_stats": issubclass(conn.PushActorsStats, KVConnectorStats)}
with PushPair(p_tp=2, reaper_tick=0.02) as pair:
    for i in range(3):
        params = pair.prefill.prefill(f"r{i}", 40, key=f"k{i}")
        pair.decode.expect(f"r{i}-d", 40, params, key=f"k{i}")
    pair.pump(lambda: len(pair.received) == 3 and len(pair.sent) == 3, timeout=20)
    p0, p1 = pair.prefill.workers
    h0, h1 = (SimpleNamespace(_worker=w, _last_stats={}, _last_gauges={}) for w in (p0, p1))
    total = stats_of(p0, h0).aggregate(stats_of(p1, h1))
    # vLLM hands Prometheus the aggregated stats' to_dict(), sent between processes as msgpack.
    prom.observe(msgspec.msgpack.decode(msgspec.msgpack.encode(total.to_dict())), 0)
    p1.ctx.faults.fail_handler("matcher", HeartbeatArrived, kill=True)
    p1.runtime.matcher.tell(HeartbeatArrived(ids=("x",), sender="test"))
    wait_until(lambda: not p1.healthy, timeout=5)
    prom.observe(stats_of(p1, h1).to_dict(), 0)  # only what changed since: the gauges
    labels = {"model_name": "m", "engine": "0"}
    get = REGISTRY.get_sample_value
    out["pushed"] = get("vllm:pushactors_push_pushed_total", labels)
    out["push_count"] = get("vllm:pushactors_push_seconds_count", labels)
    out["push_le_60"] = get("vllm:pushactors_push_seconds_bucket", {**labels, "le": "60.0"})
    out["healthy"] = {
        w.ctx.label: get("vllm:pushactors_rank_healthy", {**labels, "rank": w.ctx.label}) for w in (p0, p1)
    }
    out["in_flight"] = get("vllm:pushactors_pushes_in_flight", {**labels, "rank": p0.ctx.label})
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(not VLLM_PY, reason="PUSHACTORS_VLLM_PYTHON is not set (a vLLM environment's python)")
def test_prometheus_gets_counters_histograms_and_per_rank_health() -> None:
    assert VLLM_PY is not None
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run(
        [VLLM_PY, "-c", PROM_SCRIPT], capture_output=True, text=True, env=env, timeout=300, check=False, cwd=REPO
    )
    result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and result, run.stderr[-3000:]
    out = json.loads(result[-1].removeprefix("RESULT "))
    assert out["is_stats"]
    assert out["pushed"] == 6  # 3 requests, each pushed by both P ranks
    assert out["push_count"] == 6 and out["push_le_60"] == 6
    assert out["healthy"] == {"prefill/pp0/tp0": 1.0, "prefill/pp0/tp1": 0.0}
    assert out["in_flight"] == 0.0
