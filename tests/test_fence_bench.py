"""``pushactors bench fence``: does a late WRITE land after D re-registers, and what it costs.

Only the shape of the report is asserted (every variant, a known status, a boolean ``landed``,
positive costs), never whether the fence holds: that is what the suite measures, and it depends
on the UCX transport (on one host over DRAM: cma, which needs no registration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pushactors.apps.cli import main


@pytest.mark.real_nixl
def test_fence_suite_reports_every_late_write_variant_and_the_costs(tmp_path: Path) -> None:
    from pushactors.apps.bench import load_bench_module

    fence = load_bench_module("fence")
    out = tmp_path / "fence.json"
    sizes = [1 << 20, 4 << 20]
    argv = ["bench", "fence", "--json", str(out), "--quick", "--reps", "2", "--no-progress"]
    assert main([*argv, "--sizes", ",".join(map(str, sizes))]) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "fence" and result["device"] == "cpu" and result["memory"] == "DRAM"
    assert result["process_model"] in ("two-process", "in-process")
    assert result["nixl"] and "1." in result["nixl"]
    late = result["late_write"]
    assert list(late) == list(fence.VARIANTS)
    for variant, r in late.items():
        assert r["status"] in fence.STATUSES and r["status"] != "not_run", (variant, r)
        assert isinstance(r["landed"], bool) and isinstance(r["landed_bytes"], int), (variant, r)
        assert r["error"] is None or isinstance(r["error"], str)
        assert r["sanity"]["landed"] is True, (variant, r)  # the first WRITE reached D before it acted
        assert r["landed"] == (r["landed_bytes"] == result["region_bytes"])
    control = late[fence.CONTROL]  # reloaded metadata: this WRITE must land
    assert control["status"] == "DONE" and control["landed"], control
    assert sorted(result["not_landed_variants"] + result["landed_variants"]) == sorted(set(late) - {fence.CONTROL})
    assert list(result["reregister_ms"]) == ["1MiB", "4MiB"]
    for ms in result["reregister_ms"].values():
        assert ms > 0
    reload = result["reload_ms"]
    assert reload["descs"] == 256 and reload["writes_landed"] == "3/3"
    for key in ("total_ms", "add_remote_agent_ms", "prep_256_descs_ms", "first_write_after_reload_ms"):
        assert reload[key] > 0, (key, reload)
    assert result["ucx"]["UCX_TLS"]


def test_fence_suite_refuses_vram_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "fence.json"
    argv = ["bench", "fence", "--json", str(out), "--device", "cuda", "--process-model", "in-process"]
    assert main([*argv, "--no-progress"]) == 2
    assert not out.exists()
