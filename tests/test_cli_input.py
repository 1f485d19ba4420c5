"""Bad input to the command line and to PushConfig: a clear refusal (exit 2, ConfigError) or a
counted skip, never a traceback, a hang or a setting that silently means something else."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pushactors.apps.cli import main
from pushactors.core.config import ConfigError, PushConfig


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse refuses with exit 2
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize(
    "argv",
    [
        ["logs", "{log}", "--follow", "--poll-interval", "nan"],
        ["logs", "{log}", "--follow", "--poll-interval", "inf"],
        ["logs", "{log}", "--follow", "--for", "nan"],
        ["top", "{log}", "--once", "--interval", "nan"],
        ["top", "{log}", "--interval", "1e-300", "--for", "1"],
        ["top", "{log}", "--for", "nan"],
        ["demo", "--fabric", "fake", "--concurrency", "0"],
        ["demo", "--fabric", "fake", "--max-tokens", "0"],
        ["demo", "--fabric", "fake", "--layers", "0"],
        ["demo", "--fabric", "fake", "--block-bytes", "-1"],
        ["demo", "--fabric", "fake", "--requests", "-1"],
        ["demo", "--fabric", "fake", "--block-bytes", "1000000000000"],
        ["demo", "--fabric", "fake", "--log-dir", "{log}/under-a-file"],
        ["bench", "control", "--pushes", "0"],
        ["bench", "control", "--matches", "0"],
        ["bench", "control", "--registrations", "x"],
        ["bench", "control", "--registrations", ","],
        ["bench", "control", "--config", "foo"],
        ["bench", "xpyd", "--prefills", "0"],
    ],
)
def test_bad_numbers_and_paths_are_refused_with_exit_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "a.jsonl"
    log.write_text(json.dumps({"event": "a.b", "ts": time.time(), "pid": 1}) + "\n")
    t0 = time.monotonic()
    rc, out = run([a.replace("{log}", str(log)) for a in argv], capsys)
    assert rc == 2, out
    assert "Traceback" not in out and out.strip(), out
    assert time.monotonic() - t0 < 30  # refused before anything starts


def test_a_timestamp_no_calendar_holds_is_shown_not_fatal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "big.jsonl"
    lines = [{"event": "a.b", "ts": 1e20, "pid": 1}, {"event": "a.c", "ts": -1e15, "pid": 1}]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, out = run(["logs", str(log), "--no-color"], capsys)
    assert rc == 0, out
    assert "a.b" in out and "a.c" in out and "?" in out


def test_a_plot_that_cannot_be_written_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    log = tmp_path / "a.jsonl"
    log.write_text(json.dumps({"event": "write.posted", "ts": time.time(), "pid": 1, "bytes": 1}) + "\n")
    rc, out = run(["logs", str(log), "--summary", "--plot", str(tmp_path / "missing" / "x.html")], capsys)
    assert rc == 2 and "cannot write" in out, out


@pytest.mark.parametrize("unanswered", [5, [{"a": 1}], "abc", None, ["d-1", 3]])
def test_top_reads_a_malformed_stats_line_without_dying(
    unanswered: object, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "top.jsonl"
    stats = {"event": "rank.stats", "ts": time.time(), "pid": 7, "rank": "p/tp0", "unanswered": unanswered}
    log.write_text(json.dumps(stats) + "\n")
    rc, out = run(["top", str(log), "--once", "--json"], capsys)
    assert rc == 0, out
    assert json.loads(out.strip().splitlines()[-1])["ranks"], out


@pytest.mark.parametrize(
    "settings",
    [
        {"handshake_workers": 0},
        {"poll_await": -1},
        {"poll_await": float("inf")},
        {"stats_interval": float("nan")},
        {"poll_spin": 1.0},
        {"side_channel_port": 70000},
        {"max_remote_agents": 0},
        {"trusted_peers": ("10.0.0.0/33",)},
    ],
)
def test_pushconfig_refuses_out_of_bounds_settings_built_directly_or_decoded(settings: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PushConfig(engine_id="e", **settings)  # type: ignore[arg-type]
    decoded = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    with pytest.raises(ConfigError):
        PushConfig.from_dict({"engine_id": "e", **decoded})


def test_a_network_and_an_engine_id_are_both_trusted() -> None:
    config = PushConfig(engine_id="e", trusted_peers=("10.0.0.0/8", "prefill-0"))
    assert config.trusts("x", "10.1.2.3") and config.trusts("prefill-0", "192.168.0.1")
    assert not config.trusts("x", "192.168.0.1")


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    import pushactors
    from pushactors.apps.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    assert capsys.readouterr().out.strip() == f"pushactors {pushactors.__version__}"
