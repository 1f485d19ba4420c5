"""One log line as an :class:`Event`, and the ids one request has across processes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..core.ids import base_request_id

_decoder = msgspec.json.Decoder(dict[str, Any])


@dataclass(slots=True)
class Event:
    """One structured event. ``ts`` is on the merged time line (after clock correction);
    ``raw_ts`` is what its process wrote."""

    ts: float
    raw_ts: float
    event: str
    level: str
    actor: str
    rank: str
    pid: int
    source: str
    line: int
    record: dict[str, Any]

    @property
    def request_id(self) -> str | None:
        value = self.record.get("request_id")
        return value if isinstance(value, str) else None

    @property
    def d_request_id(self) -> str | None:
        value = self.record.get("d_request_id")
        return value if isinstance(value, str) else None

    @property
    def transfer_id(self) -> str | None:
        value = self.record.get("transfer_id")
        return value if isinstance(value, str) else None

    @property
    def msg(self) -> str | None:
        """The mailbox message this event answers (absent for events not tied to one)."""
        value = self.record.get("msg")
        return value if isinstance(value, str) else None

    @property
    def wait_ms(self) -> float | None:
        return _number(self.record.get("wait_ms"))

    @property
    def handle_ms(self) -> float | None:
        return _number(self.record.get("handle_ms"))

    @property
    def process(self) -> str:
        """Who wrote it: the rank label when it has one, else the actor; with the pid."""
        return f"{self.rank or self.actor or '?'} [{self.pid}]"

    def get(self, key: str, default: Any = None) -> Any:
        return self.record.get(key, default)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_line(text: bytes | str, source: str = "", line: int = 0) -> Event | None:
    """The event on one line, or None for a blank line or one that is not an event object
    (a torn last line, another program's output)."""
    if isinstance(text, str):
        text = text.encode()
    text = text.strip()
    if not text:
        return None
    try:
        record = _decoder.decode(text)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    name = record.get("event")
    ts = _number(record.get("ts"))
    if not isinstance(name, str) or ts is None:
        return None
    pid = record.get("pid")
    return Event(
        ts=ts,
        raw_ts=ts,
        event=name,
        level=str(record.get("level", "info")),
        actor=str(record.get("actor", "")),
        rank=str(record.get("rank", "")),
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else 0,
        source=source,
        line=line,
        record=record,
    )


@dataclass
class RequestIndex:
    """Every id a request goes by, linked the way the transfer links them.

    * P's events name D's id in ``d_request_id`` (match, WRITE, settle), or log D's id and
      name P's in ``p_request_id`` (a match on the registration's arrival);
    * the registration's ``transfer_id`` is on D's ``recv.watching`` and P's ``reg.stored``
      and ``blocks.stored``; the router logs it beside the client's ``X-Request-Id``;
    * engines append ``-`` and 8 hex digits to the router's id, so the base id names both legs.
    """

    by_id: dict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))
    d_of_p: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    p_of_d: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    by_transfer: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    transfer_of: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    by_base: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    @classmethod
    def build(cls, events: Iterable[Event]) -> RequestIndex:
        index = cls()
        for ev in events:
            index.add(ev)
        return index

    def add(self, ev: Event) -> None:
        rid, d_id, tid = ev.request_id, ev.d_request_id, ev.transfer_id
        if rid is not None:
            self.by_id[rid].append(ev)
            self.by_base[base_request_id(rid)].add(rid)
        if d_id is not None:
            self.by_id.setdefault(d_id, [])  # known, even if D's own log is not given
            self.by_base[base_request_id(d_id)].add(d_id)
            if rid is not None and rid != d_id:
                self.d_of_p[rid].add(d_id)
                self.p_of_d[d_id].add(rid)
        # The matcher logs a registration-last match (and some refusals) under D's id and
        # names P's request as ``p_request_id``: the same link, seen from the other side.
        p_id = ev.record.get("p_request_id")
        if isinstance(p_id, str) and rid is not None and p_id != rid:
            self.by_id.setdefault(p_id, [])
            self.by_base[base_request_id(p_id)].add(p_id)
            self.d_of_p[p_id].add(rid)
            self.p_of_d[rid].add(p_id)
        if tid is not None and rid is not None:
            self.by_transfer[tid].add(rid)
            self.transfer_of[rid].add(tid)

    def resolve(self, query: str) -> set[str]:
        """Every request id (P's and D's) of the request ``query`` names: an exact id, a
        transfer id, a base id or a client's ``X-Request-Id`` (through the router's event)."""
        seeds: set[str] = set()
        if query in self.by_id:
            seeds.add(query)
        seeds |= self.by_transfer.get(query, set())
        seeds |= self.by_base.get(query, set())
        if not seeds:
            return set()
        found: set[str] = set()
        todo = list(seeds)
        while todo:
            rid = todo.pop()
            if rid in found:
                continue
            found.add(rid)
            linked = self.d_of_p.get(rid, set()) | self.p_of_d.get(rid, set())
            for tid in self.transfer_of.get(rid, ()):
                linked |= self.by_transfer.get(tid, set())
            todo.extend(linked - found)
        return found

    def events_of(self, ids: Iterable[str]) -> list[Event]:
        """The events of those ids (by ``request_id`` or ``d_request_id``), in time order."""
        wanted = set(ids)
        seen: dict[int, Event] = {}
        for rid in wanted:
            for ev in self.by_id.get(rid, ()):
                seen[id(ev)] = ev
        return sorted(seen.values(), key=lambda e: (e.ts, e.source, e.line))

    def transfers_of(self, ids: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for rid in ids:
            out |= self.transfer_of.get(rid, set())
        return out
