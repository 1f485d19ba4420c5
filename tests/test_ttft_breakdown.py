"""The TTFT breakdown bench's parts: stages from the router's and connectors' event logs
(pushactors.logview.ttft), engine threads' CPU affinity (pushactors.testing.vllm_servers) and
the switch that keeps vLLM's NIXL worker from re-pinning its thread (bench/vllm_norepin)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from pushactors.logview.ttft import MARKS, ClientRecord, stage_table, ttft_stages
from pushactors.testing.vllm_servers import affinity_summary, group_pids, thread_affinities

T0 = 1_700_000_000.0
NOREPIN = Path(__file__).resolve().parent.parent / "bench" / "vllm_norepin"


def ev(event: str, ts: float, pid: int, **fields: Any) -> dict[str, Any]:
    return {"event": event, "level": "debug", "ts": ts, "pid": pid, "actor": "vllm_connector", **fields}


def request_logs(xid: str, sent: float, *, reported: bool = True) -> list[dict[str, Any]]:
    """One request's events as the router (pid 1), P (pid 2) and D (pid 3) write them, with
    marks 1, 20, 5, 2, 3, 10 and 1 ms apart (client -> router ... router -> client)."""
    d_id, p_id = f"cmpl-{xid}-0-aaaa", f"cmpl-{xid}-0-bbbb"
    router_in = sent + 0.001
    out = [
        # The message announcing P's KV arrived 1 ms before this handler ended.
        ev("blocks.stored", router_in + 0.021, 2, actor="matcher", request_id=p_id, wait_ms=0.5, handle_ms=0.5),
        ev("write.posted", router_in + 0.022, 2, actor="writer", request_id=p_id),
        ev("write.layer_posted", router_in + 0.0235, 2, actor="writer", request_id=p_id),
        ev("request.prefilled", router_in + 0.026, 2, request_id=p_id),
        ev("connector.recv_scheduled", router_in + 0.030, 3, request_id=d_id),
        ev(
            "router.request",
            router_in + 0.060,  # written when the stream ended
            1,
            actor="router",
            request_id=xid,
            ms=60.0,
            first_event_ms=40.0,
            prefill_ms=28.0,
        ),
    ]
    if reported:
        out.append(ev("connector.recv_reported", router_in + 0.027, 3, request_id=d_id, waited_ms=2.0))
    return out


def write(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_stages_add_up_to_the_clients_ttft_and_name_a_request_missing_a_mark(tmp_path: Path) -> None:
    ttft = 0.043  # 1 + 20 + 5 + 2 + 3 + 10 + 1 ms, then 1 ms from the first event to the first text
    whole = ClientRecord("vc000xaa", T0, ttft, 0.2, first_chunk=0.042)
    torn = ClientRecord("vc001xbb", T0 + 1, ttft, 0.2, first_chunk=0.042)  # D's worker never reported it
    write(
        tmp_path / "all.jsonl", request_logs(whole.xid, whole.sent) + request_logs(torn.xid, torn.sent, reported=False)
    )
    result = ttft_stages([tmp_path / "all.jsonl"], [whole, torn])
    by_name = {s["from"]: s for s in result["stages"]}
    expected = {"sent": 1, "router_in": 20, "announced": 5, "landed": 2, "reported": 3, "scheduled": 10}
    expected |= {"first_event": 1, "first_chunk": 1}
    assert {k: by_name[k]["p50"] for k in expected} == pytest.approx(expected, abs=1e-3)
    # Without the report: no "landed"/"reported" marks, so the three stages around them lose
    # that request's sample; the others keep both.
    assert {k: s["n"] for k, s in by_name.items()} == {
        "sent": 2,
        "router_in": 2,
        "announced": 1,
        "landed": 1,
        "reported": 1,
        "scheduled": 2,
        "first_event": 2,
        "first_chunk": 2,
    }
    assert result["incomplete"] == 1 and result["ttft"]["p50"] == pytest.approx(43.0)
    assert sum(by_name[m]["p50"] for m in MARKS[:-1]) == pytest.approx(result["ttft"]["p50"], abs=1e-3)
    side = {s["to"]: s for s in result["side"]}
    assert side["p_answered"]["p50"] == pytest.approx(28.0) and side["p_answered"]["n"] == 2
    assert side["prefilled"]["p50"] == pytest.approx(26.0)
    # The push tail runs from the LAST WRITE posted (layer-wise: several) to the landing.
    assert side["landed"]["p50"] == pytest.approx(1.5) and side["landed"]["n"] == 1
    rows = stage_table(result)
    assert rows[10].startswith("| TTFT (client) |") and "1 of 2 requests lack a mark" in rows[-1]


def test_another_requests_events_never_count_for_this_one(tmp_path: Path) -> None:
    mine = ClientRecord("vc002xcc", T0, 0.043, 0.2, first_chunk=0.042)
    other = request_logs("vc003xdd", T0 - 5)  # an earlier request's marks would make stages negative
    write(tmp_path / "e.jsonl", other + request_logs(mine.xid, mine.sent))
    result = ttft_stages([tmp_path / "e.jsonl"], [mine])
    assert result["incomplete"] == 0
    assert all(s["n"] == 1 and s["p50"] > 0 for s in result["stages"])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning a thread apart needs two CPUs")
def test_a_thread_pinned_to_one_cpu_is_reported_with_that_cpu() -> None:
    cpu = max(os.sched_getaffinity(0))
    pinned, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        os.sched_setaffinity(0, {cpu})  # 0: this thread only
        pinned.set()
        release.wait(10)

    t = threading.Thread(target=body, name="pinned-one")
    t.start()
    try:
        assert pinned.wait(10)
        threads = {a.tid: a for a in thread_affinities([os.getpid()])}
        assert threads[tid[0]].cpus == str(cpu)
        main = threads[os.getpid()]
        assert main.cpus != str(cpu)  # the others keep their own
        summary = affinity_summary(list(threads.values()))[f"{main.process}[{os.getpid()}]"]
        assert summary[str(cpu)] == [threads[tid[0]].thread]
        assert any(label.endswith("*") for label in summary[main.cpus])
    finally:
        release.set()
        t.join()


def test_group_pids_finds_a_child_of_a_new_session() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        assert group_pids(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()


NOREPIN_PROBE = """
import os
full = os.sched_getaffinity(0)
one = {max(full)}
site = os.path.join("vllm", "distributed", "kv_transfer", "kv_connector", "v1", "nixl", "base_worker.py")
exec(compile("import os; os.sched_setaffinity(0, ONE)", site, "exec"), {"ONE": one})
after_vllm = os.sched_getaffinity(0)
os.sched_setaffinity(0, one)  # any other caller still pins
print(sorted(full) == sorted(after_vllm), sorted(os.sched_getaffinity(0)) == sorted(one))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a re-pin is visible only with two CPUs")
@pytest.mark.parametrize("switched_off", [True, False])
def test_norepin_turns_off_only_the_nixl_workers_repin(switched_off: bool) -> None:
    env = {**os.environ, "PYTHONPATH": str(NOREPIN) if switched_off else ""}
    probe = [sys.executable, "-c", NOREPIN_PROBE]
    out = subprocess.run(probe, check=False, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Off: vLLM's call leaves the mask alone (and says so); on: it re-pins, as vLLM does.
    assert out.stdout.split() == (["True", "True"] if switched_off else ["False", "True"])
    assert ("skipped vLLM NIXL re-pin" in out.stderr) is switched_off
