"""Logging: silent and unconfigured by default, opt-in sinks, capture, and the stdlib bridge."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from env_kit import repo_env

from pushactors.logs import (
    LOGGER_NAME,
    add_sink,
    capture_events,
    configure_logging,
    get_logger,
    remove_sink,
)

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHONWARNINGS"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
        check=False,
    )


@pytest.fixture
def tag(request: pytest.FixtureRequest) -> str:
    """A context value unique to the test, to pick its own events out of shared sinks."""
    return request.node.name


# ---------------------------------------------------------------------------------------------
# Importing configures nothing; nothing is printed unless asked
# ---------------------------------------------------------------------------------------------
def test_import_configures_no_logging() -> None:
    proc = run_python(
        """
        import json, logging, structlog

        root, lib = logging.getLogger(), logging.getLogger("pushactors")

        def state():
            return {
                "root_handlers": [repr(h) for h in root.handlers],
                "root_level": root.level,
                # A NullHandler is what the logging HOWTO asks of libraries; anything else
                # on the library logger would be configuring the application's logging.
                "lib_handlers": [repr(h) for h in lib.handlers if not isinstance(h, logging.NullHandler)],
                "lib_level": lib.level,
                "lib_propagate": lib.propagate,
                "lib_disabled": lib.disabled,
                "configured": structlog.is_configured(),
                "disable": logging.root.manager.disable,
            }

        calls = []
        real_configure = structlog.configure
        structlog.configure = lambda *a, **k: (calls.append((a, k)), real_configure(*a, **k))
        before = state()

        import pushactors, pushactors.testing, pushactors.testing.fixtures, pushactors.actors, pushactors.logs

        after = state()
        sub = {
            name: [repr(h) for h in lg.handlers if not isinstance(h, logging.NullHandler)]
            for name, lg in logging.root.manager.loggerDict.items()
            if name.startswith("pushactors") and isinstance(lg, logging.Logger)
        }
        sub = {name: hs for name, hs in sub.items() if hs}
        print(json.dumps({"before": before, "after": after, "configure_calls": len(calls), "sub": sub}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["after"] == out["before"]
    assert out["after"]["root_handlers"] == []
    assert out["after"]["lib_handlers"] == []
    assert out["after"]["configured"] is False
    assert out["configure_calls"] == 0
    assert out["sub"] == {}
    assert proc.stderr == ""


def test_events_print_nothing_without_sink_or_handler() -> None:
    proc = run_python(
        """
        import pushactors
        from pushactors.logs import get_logger

        log = get_logger(actor="writer", rank="e/pp0/tp0")
        log.debug("lib.debug", n=1)
        log.info("lib.info", n=2)
        log.warning("lib.warning", n=3)
        log.error("lib.error", n=4)
        log.critical("lib.critical", n=5)
        try:
            raise ValueError("inside")
        except ValueError:
            import sys
            log.error("lib.crashed", exc_info=sys.exc_info())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == ""


def test_event_pid_is_the_emitting_process_after_fork() -> None:
    proc = run_python(
        """
        import os, sys
        from pushactors.logs import capture_events, get_logger

        child = os.fork()
        if child == 0:
            with capture_events() as ev:
                get_logger().info("in.child")
            sys.stdout.write(f"{os.getpid()} {ev.named('in.child')[0]['pid']}\\n")
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(child, 0)
        """
    )
    assert proc.returncode == 0, proc.stderr
    real, stamped = proc.stdout.split()
    assert stamped == real


# ---------------------------------------------------------------------------------------------
# JSON lines
# ---------------------------------------------------------------------------------------------
def test_configure_logging_writes_one_json_object_per_line(tmp_path: Path, tag: str) -> None:
    lib = logging.getLogger(LOGGER_NAME)
    handlers_before, level_before = list(lib.handlers), lib.level
    path = tmp_path / "logs" / "events.jsonl"
    sink = configure_logging(json_path=path)
    assert sink is not None
    try:
        log = get_logger(actor="writer", rank="e/pp0/tp1", test=tag)
        log.debug("write.posted", request_id="r1", blocks=[1, 2, 3])
        log.info("write.done", request_id="r1", nbytes=4096)
        log.bind(peer="D").warning("peer.slow", weird=object())
        try:
            raise ValueError("bad write")
        except ValueError:
            log.error("write.crashed", exc_info=sys.exc_info())
        sink.flush()
    finally:
        remove_sink(sink)
        sink.close()
    # configure_logging(json_path=...) alone touches no stdlib handler or level.
    assert lib.handlers == handlers_before
    assert lib.level == level_before

    lines = path.read_text().splitlines()
    objs = [json.loads(line) for line in lines]
    assert all(isinstance(o, dict) for o in objs)
    mine = [o for o in objs if o.get("test") == tag]
    assert [o["event"] for o in mine] == ["write.posted", "write.done", "peer.slow", "write.crashed"]
    assert [o["level"] for o in mine] == ["debug", "info", "warning", "error"]
    for o in mine:
        assert o["actor"] == "writer"
        assert o["rank"] == "e/pp0/tp1"
        assert isinstance(o["ts"], float)
        assert o["pid"] == os.getpid()
    assert mine[0]["blocks"] == [1, 2, 3]
    assert mine[1]["nbytes"] == 4096
    assert mine[2]["peer"] == "D"
    assert "object" in mine[2]["weird"]  # unencodable values are written as their repr
    assert "ValueError: bad write" in mine[3]["exception"]
    assert "exc_info" not in mine[3]

    # Closed and removed: nothing more is written.
    get_logger(test=tag).info("after.close")
    assert len(path.read_text().splitlines()) == len(lines)


# ---------------------------------------------------------------------------------------------
# Sinks
# ---------------------------------------------------------------------------------------------
def test_capture_events_sees_other_threads(tag: str) -> None:
    log = get_logger(test=tag)
    with capture_events() as ev:
        t = threading.Thread(target=lambda: log.info("from.thread", who="thread"), name="emitter")
        t.start()
        t.join(timeout=5)
        assert not t.is_alive()
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda i: log.debug("from.pool", i=i), range(8)))
        log.info("from.main")
    assert [e["who"] for e in ev.named("from.thread")] == ["thread"]
    assert sorted(e["i"] for e in ev.named("from.pool")) == list(range(8))
    assert len(ev.named("from.main")) == 1
    assert all(e["test"] == tag for e in ev.where(test=tag))
    # Outside the block nothing more is captured.
    log.info("after.block")
    assert ev.named("after.block") == []


def test_capture_events_level_filter(tag: str) -> None:
    log = get_logger(test=tag)
    with capture_events("warning") as ev:
        log.debug("a.debug")
        log.info("a.info")
        log.warning("a.warning")
        log.error("a.error")
    assert [e["event"] for e in ev.where(test=tag)] == ["a.warning", "a.error"]


def test_raising_sink_does_not_break_the_emitter(tag: str) -> None:
    calls: list[str] = []

    def broken(event: dict[str, Any]) -> None:
        calls.append(event["event"])
        raise RuntimeError("sink is broken")

    add_sink(broken)
    try:
        with capture_events() as ev:
            get_logger(test=tag).info("still.fine", n=1)  # must not raise
    finally:
        remove_sink(broken)
    assert "still.fine" in calls
    assert [e["n"] for e in ev.named("still.fine")] == [1]  # other sinks still got it


def test_remove_sink_stops_delivery(tag: str) -> None:
    got: list[dict[str, Any]] = []
    sink = add_sink(got.append)
    log = get_logger(test=tag)
    try:
        log.info("one")
    finally:
        remove_sink(sink)
    log.info("two")
    assert [e["event"] for e in got if e.get("test") == tag] == ["one"]


def test_sink_level_threshold(tag: str) -> None:
    got: list[dict[str, Any]] = []
    sink = add_sink(got.append, "error")
    try:
        log = get_logger(test=tag)
        log.info("x.info")
        log.error("x.error")
        log.critical("x.critical")
    finally:
        remove_sink(sink)
    assert [e["event"] for e in got if e.get("test") == tag] == ["x.error", "x.critical"]


def test_an_event_nobody_wants_never_reaches_the_processors(tag: str) -> None:
    """Most of a busy rank's events are debug-level: with no sink or handler taking them, no
    event dict may be built (the processors never run), and a sink added later gets them."""
    from pushactors.logs import events_built

    lib = logging.getLogger(LOGGER_NAME)
    level = lib.level
    lib.setLevel(logging.WARNING)  # whatever the test run's logging set up, INFO is not taken
    got: list[dict[str, Any]] = []
    try:
        log = get_logger(test=tag)
        before = events_built()
        log.debug("quiet.debug")
        log.info("quiet.info")
        assert events_built() == before
        sink = add_sink(got.append, "info")
        try:
            log.debug("still.quiet")
            log.info("heard.info")
        finally:
            remove_sink(sink)
        log.info("quiet.again")
        assert events_built() == before + 1
    finally:
        lib.setLevel(level)
    assert [e["event"] for e in got if e.get("test") == tag] == ["heard.info"]


# ---------------------------------------------------------------------------------------------
# stdlib bridge
# ---------------------------------------------------------------------------------------------
class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def lib_handler() -> Iterator[ListHandler]:
    lib = logging.getLogger(LOGGER_NAME)
    level = lib.level
    handler = ListHandler()
    lib.addHandler(handler)
    lib.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        lib.removeHandler(handler)
        lib.setLevel(level)


def test_stdlib_bridge_emits_records(lib_handler: ListHandler, tag: str) -> None:
    log = get_logger(actor="matcher", rank="e/pp0/tp0", test=tag)
    log.debug("bridge.debug")  # below INFO: not emitted
    log.info("reg.matched", request_id="r7", blocks=3)
    log.warning("reg.dropped", reason="malformed")
    mine = [r for r in lib_handler.records if getattr(r, "pushactors", {}).get("test") == tag]
    assert [r.levelno for r in mine] == [logging.INFO, logging.WARNING]
    info = mine[0]
    assert info.name == LOGGER_NAME
    assert info.getMessage().startswith("reg.matched")
    assert "request_id=r7" in info.getMessage()
    assert isinstance(info.pushactors, dict)  # type: ignore[attr-defined]
    assert info.pushactors["event"] == "reg.matched"  # type: ignore[attr-defined]
    assert info.pushactors["request_id"] == "r7"  # type: ignore[attr-defined]
    assert info.pushactors["actor"] == "matcher"  # type: ignore[attr-defined]
    assert info.pushactors["level"] == "info"  # type: ignore[attr-defined]
    assert mine[1].getMessage().startswith("reg.dropped")
    assert not [r for r in lib_handler.records if r.getMessage().startswith("bridge.debug")]


def test_the_json_log_keeps_its_last_lines_when_the_process_exits(tmp_path: Path) -> None:
    # The flusher runs every 0.2 s; a process that logs and exits at once must not lose the
    # tail (it is what explains how the process ended).
    path = tmp_path / "tail.jsonl"
    script = textwrap.dedent(
        f"""
        from pushactors.logs import configure_logging, get_logger
        configure_logging(json_path={str(path)!r})
        log = get_logger(actor="t")
        for i in range(500):
            log.info("tail.line", i=i)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, env=repo_env())
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [e["i"] for e in lines] == list(range(500))
