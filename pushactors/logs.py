"""Structured events for pushactors, built with structlog processors.

The library never configures logging on import. Events always flow to the stdlib logger
``pushactors`` (silent until the application gives it a handler or a level); applications opt
into more with :func:`configure_logging` (a JSON-lines file of every event) or capture events
in memory with :func:`capture_events`. Events are named as verbs: ``write.posted``,
``reg.matched``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import msgspec
import structlog

LOGGER_NAME = "pushactors"
EventDict = MutableMapping[str, Any]
Sink = Callable[[dict[str, Any]], None]

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50, "exception": 40}

_sinks: list[tuple[int, Sink]] = []
_sinks_lock = threading.Lock()
_NO_SINK = 1 << 30
_sink_floor = _NO_SINK  # the lowest level any sink takes: one comparison tells if a sink wants an event
_stdlib = logging.getLogger(LOGGER_NAME)
_built = 0  # events that reached the processors, for events_built()
# What the logging HOWTO asks of libraries: no output of ours unless the application wants it
# (without this, Python's last-resort handler would print our warnings to stderr).
_stdlib.addHandler(logging.NullHandler())


def add_sink(sink: Sink, level: str | int = "debug") -> Sink:
    """Send every event at ``level`` or above to ``sink`` (a callable taking the event dict)."""
    threshold = _LEVELS[level] if isinstance(level, str) else level
    with _sinks_lock:
        _sinks.append((threshold, sink))
        _set_floor()
    return sink


def remove_sink(sink: Sink) -> None:
    with _sinks_lock:
        _sinks[:] = [(lvl, s) for lvl, s in _sinks if s is not sink]
        _set_floor()


def _set_floor() -> None:
    global _sink_floor
    _sink_floor = min((lvl for lvl, _ in _sinks), default=_NO_SINK)


def wants(method: str) -> bool:
    """Whether an event at ``method``'s level reaches anyone (a sink or the stdlib logger).
    Callers that build fields only for the event skip that work when it does not."""
    level = _LEVELS.get(method, 20)
    return level >= _sink_floor or _stdlib.isEnabledFor(level)


def events_built() -> int:
    """How many events this process built an event dict for (ran the processors on). An event
    nobody wants is dropped before that, so this does not move while nothing listens; a
    diagnostic, not exact while several threads log at once."""
    return _built


def _wanted(_: Any, method: str, event: EventDict) -> EventDict:
    global _built
    _built += 1
    event["level"] = "warning" if method == "warn" else method
    if wants(method):
        return event
    raise structlog.DropEvent


def _stamp(_: Any, __: str, event: EventDict) -> EventDict:
    event["ts"] = time.time()
    event["pid"] = os.getpid()
    return event


def _dispatch(_: Any, method: str, event: EventDict) -> EventDict:
    level = _LEVELS.get(method, 20)
    exc = event.pop("exc_info", None)
    if exc:
        event["exception"] = structlog.processors.format_exc_info(None, "", {"exc_info": exc}).get("exception", "")
    record = dict(event)
    for threshold, sink in list(_sinks):
        if level >= threshold:
            try:
                sink(record)
            except Exception:  # a broken sink must never break an actor
                _stdlib.exception("pushactors log sink failed")
    if _stdlib.isEnabledFor(level):
        name = record.get("event", "?")
        rest = " ".join(f"{k}={v}" for k, v in record.items() if k not in ("event", "level", "ts", "pid"))
        _stdlib.log(level, "%s %s", name, rest, extra={"pushactors": record})
    raise structlog.DropEvent


class _NullLogger:
    def msg(self, *args: Any, **kw: Any) -> None:  # never reached: _dispatch drops every event
        pass

    debug = info = warning = warn = error = critical = exception = msg


def _at(method: str) -> Callable[..., Any]:
    def log(self: _EventLogger, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if not wants(method):
            return None
        return self._proxy_to_logger(method, event, *args, **kw)

    log.__name__ = method
    return log


class _EventLogger(structlog.BoundLogger):
    """A bound logger that drops an event nobody wants before the processors run: most
    events of a busy rank are debug-level, and copying the context into an event dict only
    to drop it cost every mailbox message a few microseconds."""

    debug = _at("debug")
    info = _at("info")
    warning = _at("warning")
    warn = _at("warn")
    error = _at("error")
    exception = _at("exception")
    critical = _at("critical")


def get_logger(**context: Any) -> Any:
    """A structlog bound logger that carries ``context`` on every event."""
    return structlog.wrap_logger(
        _NullLogger(),
        processors=[_wanted, _stamp, _dispatch],
        wrapper_class=_EventLogger,
        context_class=dict,
    ).bind(**context)


# --------------------------------------------------------------------------------------------
# Sinks applications opt into
# --------------------------------------------------------------------------------------------
def rotated_path(path: str | os.PathLike[str], index: int) -> Path:
    """Where :class:`JsonLinesSink` keeps the ``index``-th newest rotated file of ``path``
    (``events.jsonl.1`` is the newest)."""
    base = Path(path)
    return base.with_name(f"{base.name}.{index}")


class JsonLinesSink:
    """Appends each event as one JSON object per line; thread-safe.

    Lines reach the file within ``flush_interval`` seconds (a daemon thread flushes what was
    written since), so a reader sees events promptly without a syscall per event.

    With ``max_bytes``, a line that would take the file past it first rotates the file:
    ``path`` becomes ``path.1``, ``path.1`` becomes ``path.2`` and so on, ``path.<backups>``
    is deleted, and the line starts a new ``path``. Rotation happens between lines, so no line
    is split or lost (one line longer than ``max_bytes`` gets a file of its own).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        flush_interval: float = 0.2,
        *,
        max_bytes: int = 0,
        backups: int = 4,
    ) -> None:
        if max_bytes < 0 or (max_bytes and backups < 1):
            raise ValueError(f"log rotation needs max_bytes >= 0 and backups >= 1 (got {max_bytes}, {backups})")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.backups = backups
        self._fh: IO[bytes] = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._size = os.fstat(self._fh.fileno()).st_size
        self._lock = threading.Lock()
        self._enc = msgspec.json.Encoder(enc_hook=repr)
        self._dirty = False
        self._closed = threading.Event()
        self.events = 0
        self.rotations = 0
        self._flusher = threading.Thread(
            target=self._flush_loop, args=(flush_interval,), name="pushactors-log-flush", daemon=True
        )
        self._flusher.start()
        # The tail of a log is what explains how a process ended: flush it at interpreter exit
        # instead of leaving the last interval's lines in the buffer.
        atexit.register(self.flush)

    def __call__(self, event: dict[str, Any]) -> None:
        line = self._enc.encode(event) + b"\n"
        with self._lock:
            if self._fh.closed:
                return
            if self.max_bytes and self._size and self._size + len(line) > self.max_bytes:
                self._rotate()
            self._fh.write(line)
            self._size += len(line)
            self.events += 1
            self._dirty = True

    def _rotate(self) -> None:
        """Shift the rotated files up by one and start a new ``path`` (the lock is held)."""
        self._fh.close()  # flushes: every line written so far is in the file being renamed
        try:
            for index in range(self.backups - 1, 0, -1):
                older = rotated_path(self.path, index)
                if older.exists():
                    os.replace(older, rotated_path(self.path, index + 1))
            os.replace(self.path, rotated_path(self.path, 1))
            self.rotations += 1
        except OSError:
            # Not renamed: append to the same file from now on rather than lose events (or
            # retry on every line).
            _stdlib.exception("pushactors log rotation failed, rotation off: %s", self.path)
            self.max_bytes = 0
        self._fh = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._size = os.fstat(self._fh.fileno()).st_size

    def _flush_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            if self._dirty:
                self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.flush()
                self._dirty = False

    def close(self) -> None:
        self._closed.set()
        atexit.unregister(self.flush)
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


def flush_sinks() -> None:
    """Write out what every sink buffered (before a process hands over or exits)."""
    with _sinks_lock:
        sinks = [s for _, s in _sinks]
    for sink in sinks:
        flush = getattr(sink, "flush", None)
        if callable(flush):
            try:
                flush()
            except Exception:
                _stdlib.exception("pushactors log sink flush failed")


def configure_logging(
    *,
    json_path: str | os.PathLike[str] | None = None,
    level: str = "info",
    stderr: bool = False,
    max_bytes: int = 0,
    backups: int = 4,
) -> JsonLinesSink | None:
    """Opt in: write every event (all levels) to ``json_path`` and/or ``level``+ to stderr.
    ``max_bytes`` (0: never) rotates ``json_path``, keeping ``backups`` rotated files."""
    sink = None
    if json_path is not None:
        sink = JsonLinesSink(json_path, max_bytes=max_bytes, backups=backups)
        add_sink(sink, "debug")
    if stderr:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        _stdlib.addHandler(handler)
        _stdlib.setLevel(_LEVELS[level])
    return sink


class EventCapture(list[dict[str, Any]]):
    """Events captured by :func:`capture_events`, with small query helpers."""

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in list(self) if e.get("event") == name]

    def where(self, **fields: Any) -> list[dict[str, Any]]:
        return [e for e in list(self) if all(e.get(k) == v for k, v in fields.items())]


@contextmanager
def capture_events(level: str = "debug") -> Iterator[EventCapture]:
    """Collect every event emitted inside the block (all threads)."""
    captured = EventCapture()
    lock = threading.Lock()

    def sink(event: dict[str, Any]) -> None:
        with lock:
            captured.append(event)

    add_sink(sink, level)
    try:
        yield captured
    finally:
        remove_sink(sink)
