"""``pushactors bench``: the suites at tiny sizes and their JSON, and the engine model of the benches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pushactors.apps.cli import main
from pushactors.core.config import ConfigError
from pushactors.testing import PushPair, SimSpec
from pushactors.testing.fabric import FakeFabric


def _positive(*values: float) -> None:
    for v in values:
        assert isinstance(v, (int, float)) and v > 0, values


def test_fake_fabric_without_copies_keeps_notifications_but_moves_no_bytes() -> None:
    spec = SimSpec(num_layers=2, num_blocks=8, shuffle_blocks=False)
    with PushPair(fabric=FakeFabric(copy=False), p_spec=spec) as pair:
        pair.prefill.prefill("req-1-0-aaaaaaaa", 16, key="k")
        params = pair.prefill.scheduler.decode_params("req-1-0", None)
        pair.decode.expect("req-1-0-bbbbbbbb", 16, params, key="k")
        pair.pump(lambda: "req-1-0-bbbbbbbb" in pair.received and "req-1-0-aaaaaaaa" in pair.sent)
        assert pair.received["req-1-0-bbbbbbbb"] is None and pair.sent["req-1-0-aaaaaaaa"] is None
        checked, wrong = pair.decode.verify("req-1-0-bbbbbbbb")
        assert checked > 0 and wrong > 0  # D's blocks were never written
        stats = pair.fabric.stats
        assert stats.transfers_done == 1 and stats.notifs_delivered >= 1 and stats.bytes_moved == checked


def test_control_suite_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    argv = ["bench", "control", "--json", str(out), "--pushes", "64", "--in-flight", "16"]
    argv += ["--registrations", "100,2000", "--matches", "200"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "control"
    push = result["pushes"]
    assert push["pushes"] == 64 and push["in_flight"] == 16 and push["p_failures"] == 0
    _positive(push["pushes_per_s"], push["cpu_us_per_push"], push["seconds"])
    assert push["fabric_transfers"] >= 64  # WRITEs posted and completed, no bytes copied
    assert [c["outstanding"] for c in result["registry"]] == [100, 2000]
    for c in result["registry"]:
        _positive(c["add_us"], c["match_cycle_us"])
        assert c["rounds"] == 5 and c["match_cycle_us_median"] >= c["match_cycle_us"]  # best round first
    _positive(result["registry_ratio"]["match_cycle"], result["registry_ratio"]["add"])


def test_unknown_config_key_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from pushactors.apps.bench import load_suites

    with pytest.raises(ConfigError, match="no_such_setting"):
        load_suites().parse_config(["no_such_setting=1"])
    out = tmp_path / "dram.json"
    assert main(["bench", "dram", "--json", str(out), "--config", "no_such_setting=1"]) == 2
    assert not out.exists()


@pytest.mark.real_nixl
def test_dram_suite_beside_bare_nixl(tmp_path: Path) -> None:
    out = tmp_path / "dram.json"
    argv = ["bench", "dram", "--json", str(out), "--tokens", "64", "--layers", "2", "--reps", "2"]
    argv += ["--config", "poll_interval_idle=0.001"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "dram" and result["memory"] == "DRAM"
    assert result["config"] == {"poll_interval_idle": 0.001}
    shape = result["shape"]
    assert shape["blocks"] == 4 and shape["request_bytes"] == 4 * 2 * 64 * 1024
    one = result["baselines"]["one_descriptor"]
    _positive(one["GBps"], one["ms_p50"], result["baselines"]["device_copy"]["GBps"])
    assert one["notifications_seen"] == 2 * 3  # before and after: warm-up + 2, each seen by the target
    assert len(one["GBps_per_phase"]) == 2
    assert [c["pattern"] for c in result["cases"]] == ["contiguous", "scattered"]
    for c in result["cases"]:
        pa, bare = c["pushactors"], c["bare_same_descs"]
        assert pa["requests"] == 2 and c["descs_match_bare"]
        assert pa["descs"] == bare["descs"] == 2 * 4  # one per layer and block
        _positive(c["pushactors_ms"], c["pushactors_write_ms"], c["bare_ms"], c["ratio_pushactors_to_bare"])
        _positive(pa["d_GBps"], pa["p_GBps"], bare["GBps"], c["ratio_d_to_one_desc"])
        # The push alone (registration already at P, times from both processes' monotonic
        # clock): positive, and of the order of registration → landed (a start taken from the
        # wrong event or clock would be zero or far off).
        _positive(c["push_ms"], pa["push_GBps"], c["ratio_push_to_bare"], c["ratio_push_to_one_desc"])
        assert c["push_ms"] < 5 * c["pushactors_ms"]
    contiguous, scattered = result["cases"]
    assert contiguous["pushactors"]["merged_descs"] == 2  # one run per layer
    # Bare NIXL with the runs pushactors posts (2 descriptors), beside the per-block list.
    merged = contiguous["bare_merged_descs"]
    assert merged["descs"] == 2 and merged["notifications_seen"] == 2 * 3
    _positive(merged["GBps"], contiguous["ratio_p_to_bare_merged"], contiguous["ratio_bare_merged_to_one_desc"])
    assert set(contiguous["pushactors"]["p_nixl_ms_p50"]) == {"prep_ms", "make_ms", "transfer_ms"}
    assert scattered["pushactors"]["merged_descs"] == scattered["bare_same_descs"]["merged_descs"]


@pytest.mark.real_nixl
def test_small_suite_says_where_a_push_spends_its_time(tmp_path: Path) -> None:
    from pushactors.apps.bench import load_suites

    out = tmp_path / "small.json"
    assert main(["bench", "small", "--json", str(out), "--sizes", "65536", "--count", "6"]) == 0
    result = json.loads(out.read_text())
    (case,) = result["cases"]
    assert case["bytes"] == 65536 and case["pushes"] == 6
    _positive(case["bare"]["notif_us_p50"], case["bare"]["paced_notif_us_p50"], case["critical_us_p50"])
    assert case["bare"]["paced_poll_s"] == 5e-05  # D's writer's cadence while it awaits a push
    # Every stage found in the nodes' logs for these pushes, in the order a push crosses them.
    stages = case["stages_us_p50"]
    assert list(stages) == [key for key, _ in load_suites().SMALL_STAGES]
    assert all(isinstance(v, float) for v in stages.values())
    # One thread's durations; D's pick-up spans two processes and may be below 0 under load.
    _positive(stages["matcher"], stages["nixl_post"])
    assert stages["d_reaper"] == 0.0  # the writer reported every one of these (core/claims.py)
    # The engine's default path: armed while P's forward ran, its WRITE made ahead (make 0),
    # posted at the forward's end; D's engine has it no sooner than its transport knew.
    _positive(case["armed_us_p50"], case["armed_us_p99"])
    assert case["armed_engine_us_p50"] >= case["armed_us_p50"]
    armed = case["stages_armed_us_p50"]
    assert list(armed) == [key for key, _ in load_suites().ARMED_STAGES]
    assert armed["make"] == 0.0 and armed["transfer"] > 0
    calls = case["nixl_calls_us_p50"]
    assert calls["armed"]["make_us_p50"] == 0.0 and calls["next_step"]["make_us_p50"] > 0
    _positive(
        calls["bare"]["make_us_p50"], calls["bare"]["transfer_us_p50"], calls["bare_made_ahead"]["transfer_us_p50"]
    )
    idle = result["idle"]  # two idle ranks' CPU, measured over real seconds
    assert idle["ranks"] == 2 and idle["seconds"] >= 3.0 and 0 < idle["core_share"] < 2


@pytest.mark.real_nixl
def test_small_suites_idle_pair_lives_in_dram_whatever_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle phase's P and D share one process: its KV is host memory even for ``--device
    cuda`` (one process's agents moving VRAM failed there with the UCX thread pool)."""
    import pushactors.testing as testing
    from pushactors.apps.bench import load_suites

    built: list[str] = []

    def recording_spec(*args: object, **kwargs: object) -> SimSpec:
        spec = SimSpec(*args, **kwargs)  # type: ignore[arg-type]
        built.append(spec.device)
        return spec

    monkeypatch.setattr(testing, "SimSpec", recording_spec)
    idle = load_suites().idle_cost(0.2, {}, 60.0)
    assert built == ["cpu"] and idle["memory"] == "DRAM"
    assert idle["ranks"] == 2 and idle["seconds"] >= 0.2


@pytest.mark.real_nixl
def test_small_suite_runs_beside_an_engine_thread_busy_in_python(tmp_path: Path) -> None:
    """``--engine-busy`` puts a thread in each node that runs Python for that share of the time
    (as an engine's scheduling does) and ``--switch-interval`` sets the nodes' interpreter: both
    must be real in the node processes, and the pushes still land."""
    out = tmp_path / "small.json"
    argv = ["bench", "small", "--json", str(out), "--sizes", "65536", "--count", "4"]
    assert main([*argv, "--engine-busy", "0.5", "--switch-interval", "0.001"]) == 0
    result = json.loads(out.read_text())
    assert result["engine_busy"] == 0.5 and result["switch_interval_s"] == 0.001
    (case,) = result["cases"]
    assert case["pushes"] == 4
    for side in ("prefill", "decode"):
        load = case["node_load"][side]
        assert load["switch_interval_s"] == pytest.approx(0.001)
        assert 0.3 <= load["python_busy_share"] <= 0.7, load  # measured by the load thread itself


def test_engine_busy_share_is_refused_outside_zero_to_one(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "small", "--json", str(tmp_path / "x.json"), "--engine-busy", "1.5"])


def test_small_suite_refuses_a_switch_interval_the_setting_refuses(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    assert main(["bench", "small", "--json", str(out), "--switch-interval", "0.5"]) == 2  # before any node starts
    assert not out.exists()


def _ordered(p: dict[str, float]) -> None:
    assert set(p) == {"p50", "p90", "p99", "mean", "max"}, p
    _positive(*p.values())
    assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"] and p["mean"] <= p["max"], p


@pytest.mark.parametrize(("rounds", "busy"), [(200, "off"), (10, "both")])
def test_handoff_suite_reports_every_case_as_ordered_percentiles(tmp_path: Path, rounds: int, busy: str) -> None:
    """``bench handoff``: one hand-off between Python threads, no NIXL. Sane numbers only, never
    a speed target (the busy run is short: beside a spinning thread a hand-off waits for the GIL)."""
    from pushactors.apps.bench import load_bench_module

    out = tmp_path / "handoff.json"
    assert main(["bench", "handoff", "--json", str(out), "--rounds", str(rounds), "--busy", busy, "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["suite"] == "handoff" and result["rounds"] == rounds and result["chain"] == 3
    cases = load_bench_module("handoff").CASES
    flags = [False, True] if busy == "both" else [False]
    assert [(c["case"], c["busy"]) for c in result["cases"]] == [(n, b) for b in flags for n in cases]
    for c in result["cases"]:
        assert c["rounds"] == rounds and c["switch_interval_s"] > 0 and 0 <= c["share_over_1ms"] <= 1
        for key in ("one_way_us", "forward_us", "round_trip_us"):
            _ordered(c[key])
        if c["busy"]:
            assert c["busy_thread"]["loops"] > 0
        if c["case"].startswith("chain_"):
            assert c["hops"] == 3
            _ordered(c["chain_us"])
            assert c["per_hop_us"] == c["one_way_us"]
            assert c["per_hop_us"]["p50"] == pytest.approx(c["chain_us"]["p50"] / 3, abs=0.02)
        else:
            assert c["hops"] == 1
    host = result["host"]
    assert host["cpus"] >= 1 and len(host["loadavg_before"]) == 3


@pytest.mark.real_nixl
def test_layerwise_suite_times_both_modes_beside_its_baselines(tmp_path: Path) -> None:
    out = tmp_path / "layerwise.json"
    logs = tmp_path / "logs"
    args = ["--json", str(out), "--no-progress", "--logs", str(logs), "--config", "poll_spin=0.0002"]
    args += ["--p-config", "layers_per_write=2", "--timeline"]  # P's node only; steps stamped
    assert main(["bench", "layerwise", "--quick", "--reps", "1", *args]) == 0
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"whole", "layerwise"} and result["layers"] == 4
    assert result["settings"] == {"poll_spin": 0.0002, "timeline": True}
    assert result["settings_by_role"] == {"prefill": {"layers_per_write": 2}, "decode": {}}
    # Each node's events: the setting reached P (two layers per WRITE: groups 0 and 1 of 2).
    assert {f.name for f in logs.iterdir()} == {
        f"{m}-{r}.jsonl" for m in ("whole", "layerwise") for r in ("prefill", "decode")
    }
    posted = [json.loads(line) for line in (logs / "layerwise-prefill.jsonl").read_text().splitlines()]
    groups = {e["layer_group"] for e in posted if e.get("event") == "write.layer_posted"}
    assert groups == {0, 1}, groups
    for mode in result["modes"].values():
        case = mode["256"]
        assert case["reps"] == 1 and case["after_ms_p50"] > 0 and case["forward_ms_p50"] > 0
        # Every step stamped, in the order they happen; D's report is the moment `after` ends
        # (stamped just after it, so never before it).
        s = case["steps_ms_p50"]
        assert list(s) == ["p.post_start", "p.post_end", "p.done", "d.poll", "d.read", "d.received"]
        assert s["p.post_start"] <= s["p.post_end"] <= s["p.done"]
        assert s["d.poll"] <= s["d.read"] <= s["d.received"]
        assert s["d.received"] >= case["after_ms_p50"] - 0.001
    base = result["baselines"]["256"]
    assert base["bytes"] == 16 * 4 * 8 * 16 * 2 * 128 * 2  # blocks x layers x one layer's block, K and V
    assert base["one_descriptor_ms_p50"] > 0 and base["device_copy_ms_p50"] > 0
    assert base["one_layer_bytes"] == base["bytes"] // 4 and base["one_layer_ms_p50"] > 0
    # A check's median counts only the posts that did not return DONE themselves (DRAM here
    # often does): None when no post needed a check, never a 0 that reads as a free check.
    reps = result["modes"]["whole"]["256"]["reps"]  # the baselines run as many
    late_checks = reps - base["one_layer_late_done_at_post"]
    assert 0 <= late_checks <= reps
    assert (base["one_layer_late_check_ms_p50"] is None) == (late_checks == 0)
    assert base["one_layer_late_check_ms_p50"] is None or base["one_layer_late_check_ms_p50"] >= 0
    assert base["one_layer_first_check_ms_p50"] is None or base["one_layer_first_check_ms_p50"] >= 0
    assert result["ratios"]["256"]["layerwise_over_whole"] > 0


# --- the engine model (--engine model) -------------------------------------------------------------
class _SteppedClock:
    """A clock that moves only when told: the model's accounting, exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Hooks:
    """A worker whose hooks take known times on that clock."""

    def __init__(self, clock: _SteppedClock, *, load: float, finished: float) -> None:
        self.clock, self.load, self.finished = clock, load, finished

    def start_load_kv(self, meta: object) -> None:
        self.clock.now += self.load

    def get_finished(self) -> None:
        self.clock.now += self.finished

    def save_kv_layer(self, name: str, event: object = None) -> None:
        self.clock.now += 0.0001

    def wait_for_save(self, event: object = None) -> None:
        pass


def test_engine_model_counts_the_hooks_own_time_and_leaves_harness_work_off_its_clock() -> None:
    """Hook time is taken around the hook calls only: not the step's input before them, not the
    harness's off-clock work, not the wait. A step past its length is late and waits for nothing."""
    from pushactors.testing.engine_model import EngineModel, EngineModelSpec

    clock = _SteppedClock()
    model = EngineModel(EngineModelSpec(step=0.010, share=0.0), clock=clock)
    worker = _Hooks(clock, load=0.001, finished=0.002)
    model.time_hooks(worker)
    model.begin_step()
    clock.now += 0.0005  # the step's input
    worker.start_load_kv(None)
    worker.get_finished()
    with model.off_clock():
        clock.now += 0.004  # the bench checking bytes
    model.end_step()  # 0.0065 s of GIL-free wait left: the clock does not move meanwhile
    model.begin_step()
    worker.start_load_kv(None)
    worker.save_kv_layer("layer.0")
    worker.get_finished()
    clock.now += 0.009  # a long input: the step runs past its 10 ms
    model.end_step()
    phase = model.take_phase()
    assert phase.hook_s == pytest.approx([0.003, 0.0031])
    assert phase.hook_calls == {"start_load_kv": 2, "save_kv_layer": 1, "wait_for_save": 0, "get_finished": 2}
    assert phase.steps == 2 and phase.late_steps == 1
    assert phase.seconds == pytest.approx(clock.now - 0.004)  # the off-clock work left out
    assert phase.work_units == 0 and phase.work_s == 0.0  # S = 0: no Python work at all
    d = phase.as_dict()
    assert d["hook_us_p50"] == pytest.approx(3050.0) and d["work_units_per_s"] == 0.0
    nxt = model.take_phase()  # a new phase begins empty
    assert nxt.steps == 0 and nxt.hook_s == [] and sum(nxt.hook_calls.values()) == 0


def _engine_case(share: float) -> dict[str, Any]:
    """A short case on the fake fabric: P and D each stepped by an engine thread under the model
    (bytes filled on P and checked on D), an idle phase, then four pushes; the bench's report."""
    import threading

    from pushactors.testing.engine_model import EngineLoop, EngineModelSpec, compare, report

    spec = EngineModelSpec(step=0.005, share=share)
    landed: dict[str, threading.Event] = {}

    def on_d_report(rep: Any) -> None:
        assert not rep.failed_recving, rep.failed_recving
        for rid in rep.finished_recving:
            landed.setdefault(rid, threading.Event()).set()

    with PushPair(p_spec=SimSpec(num_layers=2, num_blocks=16)) as pair:
        p = EngineLoop(pair.prefill, spec, name="engine-p")
        d = EngineLoop(pair.decode, spec, on_report=on_d_report, name="engine-d")
        try:
            checked = 0
            loops = {"prefill": p, "decode": d}

            def push(i: int) -> None:
                nonlocal checked
                p_id, d_id = f"req-{i}-0-aaaaaaaa", f"req-{i}-0-bbbbbbbb"
                landed[d_id] = threading.Event()
                params = p.call(lambda e: e.scheduler.decode_params(f"req-{i}-0", None))
                d.call(lambda e: e.expect(d_id, 40, params, key=f"k{i}"))
                p.call(lambda e: e.prefill(p_id, 40, key=f"k{i}"))
                assert landed[d_id].wait(30.0), f"{d_id} did not land"
                got, wrong = d.call(lambda e: e.verify(d_id))
                d.call(lambda e: e.finish_recv(d_id))
                assert got > 0 and wrong == 0, (got, wrong)
                checked += got

            push(0)  # warm-up: the handshake
            for loop in loops.values():
                loop.take_phase()
            for _ in range(5):  # five steps of each with nothing to push
                for loop in loops.values():
                    loop.call(lambda e: None)
            idle = {side: loop.take_phase().as_dict() for side, loop in loops.items()}
            for i in range(1, 5):
                push(i)
            pushes = {side: loop.take_phase().as_dict() for side, loop in loops.items()}
        finally:
            p.close()
            d.close()
        assert p.error is None and d.error is None
        assert checked == 5 * 3 * 2 * 2 * 2048  # 5 pushes × 3 blocks × 2 layers × K and V, every byte right
    return report(spec, {side: compare(idle[side], pushes[side]) for side in loops})


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_engine_model_on_the_fake_fabric_reports_what_the_pushes_cost_the_engine(share: float) -> None:
    out = _engine_case(share)
    assert out["share"] == share and out["step_s"] == 0.005
    for side in ("prefill", "decode"):
        e = out[side]
        for phase in (e["idle"], e["pushes"]):
            # Every step ran the engine's hooks once each (a phase ends at a step's input), and
            # nothing else was counted as a hook.
            calls = phase["hook_calls"]
            assert phase["steps"] >= 5 and calls["start_load_kv"] == calls["get_finished"] == phase["steps"]
            assert calls["save_kv_layer"] == calls["wait_for_save"] == 0  # whole prefills
            assert 0 < phase["hook_us_p50"] <= phase["hook_us_p99"]
            assert phase["seconds"] > 0
            # (seconds rounded to 0.1 ms in the report)
            assert phase["work_units_per_s"] == pytest.approx(phase["work_units"] / phase["seconds"], rel=5e-3)
            if share == 0.0:
                assert phase["work_units"] == 0 and phase["work_s"] == 0.0
            else:
                assert phase["work_units"] > 0 and phase["work_s"] > 0
        if share == 0.0:
            assert e["work_lost_pct"] is None and e["work_pace_lost_pct"] is None
        else:
            idle, busy = e["idle"]["work_units_per_s"], e["pushes"]["work_units_per_s"]
            assert e["work_lost_pct"] == round((1 - busy / idle) * 100, 1)


def test_engine_model_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    assert main(["bench", "control", "--json", str(out), "--engine", "model"]) == 2  # not a node suite
    assert main(["bench", "small", "--json", str(out), "--engine", "model", "--engine-busy", "0.5"]) == 2
    assert not out.exists()
    for bad in (["--engine-step", "0"], ["--engine-step", "1.5"], ["--engine-share", "1.2"], ["--engine", "gpu"]):
        with pytest.raises(SystemExit):
            main(["bench", "small", "--json", str(out), "--engine", "model", *bad])


@pytest.mark.real_nixl
def test_small_suite_with_the_engine_model_reports_the_engine_and_checks_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "small.json"
    argv = ["bench", "small", "--json", str(out), "--sizes", "65536", "--count", "3", "--quick", "--no-progress"]
    argv += ["--engine", "model", "--engine-step", "0.005", "--engine-share", "0.5", "--engine-idle", "0.2"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["engine_model"] == {"share": 0.5, "step_s": 0.005, "idle_s": 0.2}
    (case,) = result["cases"]
    _positive(case["critical_us_p50"], case["critical_us_p99"], case["pushactors_us_p50"])
    engine = case["engine"]
    assert engine["share"] == 0.5 and engine["step_s"] == 0.005 and engine["idle_s"] == 0.2
    assert engine["bytes_checked"] == 3 * (5 + 3) * 65536  # all three orders, warm-ups too: every byte
    for side in ("prefill", "decode"):
        e = engine[side]
        assert e["idle"]["seconds"] >= 0.2
        for phase in (e["idle"], e["pushes"]):
            calls = phase["hook_calls"]
            # P's armed forwards (3, after the warm-ups) each also begin a step of their own
            forwards = 3 if side == "prefill" and phase is e["pushes"] else 0
            assert calls["get_finished"] == phase["steps"] > 0
            assert calls["start_load_kv"] == phase["steps"] + forwards
            assert 0 < phase["hook_us_p50"] <= phase["hook_us_p99"]
            assert phase["work_units"] > 0
        assert isinstance(e["work_lost_pct"], float) and isinstance(e["work_pace_lost_pct"], float)


@pytest.mark.real_nixl
def test_layerwise_suite_with_the_engine_model_times_the_layer_hooks(tmp_path: Path) -> None:
    """The hooks of the forward (save_kv_layer per layer, wait_for_save) run on the engine
    thread and are timed, in both modes (a whole push starts at wait_for_save); each layer's
    KV is stamped before it is saved, and D checks it."""
    out = tmp_path / "layerwise.json"
    argv = ["bench", "layerwise", "--quick", "--reps", "1", "--json", str(out), "--no-progress"]
    assert main([*argv, "--engine", "model", "--engine-share", "0.2", "--engine-idle", "0.2"]) == 0
    result = json.loads(out.read_text())
    assert result["engine_model"] == {"share": 0.2, "step_s": 0.01, "idle_s": 0.2}
    for mode, saves in (("whole", 4), ("layerwise", 4)):
        engine = result["modes"][mode]["256"]["engine"]
        assert engine["bytes_checked"] == 2 * result["baselines"]["256"]["bytes"]  # warm-up + 1 rep
        p_calls = engine["prefill"]["pushes"]["hook_calls"]
        assert p_calls["save_kv_layer"] == saves and p_calls["wait_for_save"] == 1
        assert engine["decode"]["pushes"]["hook_calls"]["save_kv_layer"] == 0
