"""Request state as plain, single-threaded objects (no actors, no threads, no NIXL).

* :class:`Tombstones` — exact-key memory of things that ended, pruned by age. Every actor that
  must remember an ended request uses this one implementation.
* :class:`DeadlineHeap` — deadlines that move (heartbeats extend leases), reaped in order.
* :class:`PRegistry` — P's matching state: finished blocks, D's registrations, the D ranks
  served, and the tombstones that answer late messages. The matcher actor owns it; the
  writer and reaper share it only by message.

Matching never guesses (docs/protocol.md, 'Matching'). A P entry that carries a transfer id
pairs only with a registration carrying the same id; otherwise the exact name a registration
gives P's request (its ``remote_request_id``, else D's own id), then the base id — and the base
id only when exactly one live entry has it. Ambiguity fails every request involved, with a
reason. Tombstones and aborts name exactly one request (or one D slot): never a base-id bucket.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar, Union

from ..protocol import Abort, BlockGroups, Registration
from .generations import ReplayWindows
from .ids import base_request_id

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


# Slots whose D was told "may still land", remembered by time (PRegistry.owed_slots): at most.
OWED_SLOTS_MAX = 1 << 16


class Tombstones(Generic[K, V]):
    """Values under exact keys, forgotten ``ttl`` seconds after they were put (or at
    ``max_size``, oldest first). Insertion order is age order, so pruning stops early."""

    def __init__(self, ttl: float, max_size: int = 1 << 20) -> None:
        self.ttl = ttl
        self.max_size = max_size
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def put(self, key: K, value: V, now: float) -> None:
        self._items.pop(key, None)
        self._items[key] = (now, value)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        return None if item is None else item[1]

    def pop(self, key: K) -> V | None:
        item = self._items.pop(key, None)
        return None if item is None else item[1]

    def prune(self, now: float) -> int:
        cutoff = now - self.ttl
        n = 0
        while self._items:
            key, (at, _) = next(iter(self._items.items()))
            if at >= cutoff:
                break
            del self._items[key]
            n += 1
        return n

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class TaggedTombstones(Generic[K, V]):
    """One table's share of a :class:`Tombstones` store that several tables fill together
    (keys tagged, so they never collide), so their sum is bounded by the store's size."""

    def __init__(self, store: Tombstones[tuple[str, Hashable], object], tag: str) -> None:
        self._store = store
        self._tag = tag

    def put(self, key: K, value: V, now: float) -> None:
        self._store.put((self._tag, key), value, now)

    def get(self, key: K) -> V | None:
        return self._store.get((self._tag, key))  # type: ignore[return-value]

    def pop(self, key: K) -> V | None:
        return self._store.pop((self._tag, key))  # type: ignore[return-value]

    def __contains__(self, key: object) -> bool:
        return (self._tag, key) in self._store


class DeadlineHeap(Generic[K]):
    """Deadlines per key that may move; ``due`` yields keys whose *current* deadline passed.

    Moving a deadline pushes a new heap item; stale items are skipped when popped (the item
    stored for the key is the truth), so extension is O(log n) and reaping is in deadline order
    whatever order the extensions came in. Stale items (moved or discarded keys) are dropped at
    once when they reach the top (a clear or a move pops every stale item above the first live
    one), and the heap is rebuilt from the live items once the stale ones below outnumber them
    by ``COMPACT_SLACK`` (amortised O(1) per change): it never holds more than ``2 x live +
    COMPACT_SLACK`` items, and nothing once every key is gone."""

    COMPACT_SLACK = 64

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._live: dict[K, tuple[float, int]] = {}  # key -> (deadline, seq) of its one live item
        self._seq = 0  # ties: keys need not be ordered; also names the live item of a key

    def set(self, key: K, deadline: float) -> None:
        current = self._live.get(key)
        if current is not None and current[0] == deadline:
            return  # unchanged: its live item stands
        self._seq += 1
        self._live[key] = (deadline, self._seq)
        heapq.heappush(self._heap, (deadline, self._seq, key))
        if current is not None:
            self._drop_stale()

    def get(self, key: K) -> float | None:
        current = self._live.get(key)
        return None if current is None else current[0]

    def discard(self, key: K) -> None:
        if self._live.pop(key, None) is not None:
            self._drop_stale()

    def due(self, now: float) -> Iterator[K]:
        while self._heap and self._heap[0][0] <= now:
            deadline, seq, key = heapq.heappop(self._heap)
            if self._live.get(key) != (deadline, seq):
                continue
            del self._live[key]
            yield key
        self._drop_stale()

    def next_deadline(self) -> float | None:
        self._pop_stale_top()
        return self._heap[0][0] if self._heap else None

    def _pop_stale_top(self) -> None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][2]) != heap[0][:2]:
            heapq.heappop(heap)

    def _drop_stale(self) -> None:
        """Stale items at the top go now; the heap is rebuilt once the stale items left below
        the first live one outnumber the live items by more than ``COMPACT_SLACK``."""
        self._pop_stale_top()
        live = len(self._live)
        if len(self._heap) - live > live + self.COMPACT_SLACK:
            self._heap = [(deadline, seq, key) for key, (deadline, seq) in self._live.items()]
            heapq.heapify(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def heap_size(self) -> int:
        """Items in the heap, stale ones included (at most ``2 x len(self) + COMPACT_SLACK``)."""
        return len(self._heap)


# ============================================================================================
# P's registry
# ============================================================================================
# (D request id, D tp rank, sending agent): one D rank's registration of one request. The sender
# is part of the key, so a registration from another agent naming the same D id never takes the
# slot of the real one (it waits beside it; if both could pair, neither is written).
Slot = tuple[str, int, str]


def _name(reg: Registration) -> str:
    """What a registration calls P's request: P's id when D knows it, else D's own id."""
    return reg.remote_request_id if reg.remote_request_id is not None else reg.request_id


@dataclass
class FinishedEntry:
    """P's finished blocks for one request, and the D ranks they were handed to."""

    request_id: str
    block_ids: BlockGroups
    transfer_id: str | None
    base: str
    serial: int  # this incarnation of the P id (ids may be reused once a request ended)
    served: dict[int, str] = field(default_factory=dict)  # D rank -> D request id
    senders: dict[int, str] = field(default_factory=dict)  # D rank -> agent that registered
    blocks: dict[int, BlockGroups] = field(default_factory=dict)  # D rank -> blocks written
    names: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)  # D rank -> _naming
    generations: dict[int, int] = field(default_factory=dict)  # D rank -> generation served
    failed: str = ""  # failed while live (ambiguity): nothing more is posted for it


@dataclass
class PendingRegistration:
    registration: Registration
    sender: str
    base: str | None  # None: it names P's exact id, so it is never matched by base id
    arrived_at: float
    refreshed_at: float  # arrival or D's last heartbeat naming it (D stops when it aborts)
    # D's promise on this rank's clock (error bound taken off): no WRITE into it after this.
    deadline: float = math.inf

    @property
    def slot(self) -> Slot:
        return (self.registration.request_id, self.registration.decode_tp_rank, self.sender)


@dataclass(frozen=True)
class Ended:
    """What P remembers of a request it is done with."""

    outcome: str
    request_id: str  # P's id
    serial: int = 0


@dataclass(frozen=True)
class EndedSlot:
    """What P remembers of one D slot it served, refused or saw aborted."""

    outcome: str
    sender: str
    p_request_id: str = ""
    served: bool = False  # a WRITE for exactly this registration was posted
    blocks: BlockGroups = ()  # the blocks that WRITE went to
    naming: tuple[str | None, str | None] = (None, None)  # how the served registration named P's request
    generation: int = 0  # of the registration served, refused or aborted (0: none given)


def _older(generation: int, than: int) -> bool:
    """``generation`` was minted before ``than`` by the same D incarnation (the high 32 bits)."""
    return bool(than) and generation >> 32 == than >> 32 and generation < than


def _names_other(asked: int, held: int) -> bool:
    """A message naming generation ``asked`` is about another registration than ``held``
    (0 on either side: a peer without generations, nothing to tell apart)."""
    return bool(asked and held and asked != held)


def _match_base(reg: Registration) -> str | None:
    """The base id ``reg`` may be matched by when no entry has its exact name (docs/protocol.md, 'Matching'), or
    None when it may not. A registration naming P's request by an id that carries an engine
    suffix names that one request exactly: ``job-00000001`` never falls back to its sibling
    ``job-00000000``. Named by a router id (no suffix), or only by D's own id (which carries
    D's suffix, not P's), the base id is how P's request is found."""
    name = reg.remote_request_id
    if name is None:
        return base_request_id(reg.request_id)
    base = base_request_id(name)
    return base if base == name else None


def _exact_key(reg: Registration) -> str | None:
    """The key a registration names P's request by exactly (transfer id, else P's id): what
    D's abort of it holds in ``aborted_keys``."""
    return reg.transfer_id if reg.transfer_id is not None else reg.remote_request_id


def _naming(reg: Registration) -> tuple[str | None, str | None]:
    """How a registration names P's request: its transfer id and P's id (either may be None).
    A copy of a registration names it alike; one naming it otherwise is not a copy."""
    return reg.transfer_id, reg.remote_request_id


# --- what the registry asks its actor to do --------------------------------------------------
@dataclass(frozen=True)
class Post:
    """Post the WRITE of ``p_request_id``'s blocks into ``registration``'s blocks."""

    p_request_id: str
    serial: int
    block_ids: BlockGroups
    registration: Registration
    sender: str
    fresh_at: float  # when D last showed it still waits for this registration
    deadline: float = math.inf  # D's deadline for the registration, on this rank's clock


@dataclass(frozen=True)
class Refuse:
    """Tell D (push failure) that this registration will never be written."""

    registration: Registration
    reason: str


@dataclass(frozen=True)
class FailEntry:
    """End a live P request as failed (its lease is dropped, its blocks freed when safe)."""

    p_request_id: str
    reason: str
    serial: int = 0


@dataclass(frozen=True)
class CancelServed:
    """D aborted a registration P already handed to the writer."""

    p_request_id: str
    d_request_id: str
    decode_tp_rank: int


@dataclass(frozen=True)
class AnswerAbort:
    """P is already done with what D aborted: say so, so D stops quarantining."""

    d_request_id: str
    sender: str
    reason: str
    generation: int = 0  # of the registration P answers for


Action = Union[Post, Refuse, FailEntry, CancelServed, AnswerAbort]


@dataclass
class Result:
    """The event a registry call produced (becomes the mailbox message's log event) and the
    actions its actor must carry out."""

    event: str
    level: str = "debug"
    fields: dict[str, object] = field(default_factory=dict)
    actions: list[Action] = field(default_factory=list)
    counters: list[str] = field(default_factory=list)


class PRegistry:
    """P's matching state for one rank. Single-threaded: only the matcher calls it."""

    def __init__(
        self,
        *,
        lease_duration: float,
        tombstone_ttl: float,
        orphan_ttl: float,
        require_transfer_id: bool = False,
        tombstone_keep: int = 64,
    ) -> None:
        self.stale_after = lease_duration * 2 / 3
        self.orphan_ttl = orphan_ttl
        self.require_transfer_id = require_transfer_id
        self._serial = 0
        # Live P entries.
        self.entries: dict[str, FinishedEntry] = {}
        self._entry_by_tid: dict[str, str] = {}
        self._entries_by_base: dict[str, set[str]] = {}  # entries without a transfer id
        self._served: dict[Slot, str] = {}  # D slot -> P id it was handed to
        self._slot_senders: dict[tuple[str, int], set[str]] = {}  # (D id, rank) -> senders holding one
        # D's registrations waiting for their blocks.
        self.pending: dict[Slot, PendingRegistration] = {}  # insertion order = age
        self._pending_by_tid: dict[str, set[Slot]] = {}
        # By the name a registration gives P's request: ``remote_request_id`` when D knows it,
        # else D's own id; and by that name's base id.
        self._pending_by_name: dict[str, set[Slot]] = {}
        self._pending_by_base: dict[str, set[Slot]] = {}
        # Memory of what ended, by exact key only. None of it guards a byte: a copy of a
        # registration P took is recognised by its generation (``windows``), one past D's
        # deadline by the deadline. It answers late messages at once (a reused id, a re-asked
        # abort) instead of at a timeout, so it is bounded by count: ``tombstone_keep`` entries
        # in all, the oldest forgotten first. Only registrations without a generation (a peer
        # that mints none) still need a slot's tombstone to be dropped: those keep theirs for
        # ``tombstone_ttl`` (``legacy_slots``).
        self.memory: Tombstones[tuple[str, Hashable], object] = Tombstones(tombstone_ttl, max_size=tombstone_keep)
        self.ended: TaggedTombstones[str, Ended] = TaggedTombstones(self.memory, "p")  # P id
        self.ended_tid: TaggedTombstones[str, Ended] = TaggedTombstones(self.memory, "tid")
        self._slots: TaggedTombstones[tuple[str, int, str], EndedSlot] = TaggedTombstones(self.memory, "slot")
        self.legacy_slots: Tombstones[tuple[str, int, str], EndedSlot] = Tombstones(tombstone_ttl)
        # Except a slot whose D was told its WRITE "may still land" (Forget.pinned): that D holds
        # the blocks until P's final answer and asks again every quarantine, so if the answer was
        # lost, P must still know it however many requests ended since. Kept for
        # ``tombstone_ttl``; few (a WRITE stuck or aborted in flight), and capped all the same.
        self.owed_slots: Tombstones[tuple[str, int, str], EndedSlot] = Tombstones(
            tombstone_ttl, max_size=OWED_SLOTS_MAX
        )
        self.windows = ReplayWindows()
        # D aborted a registration before P's blocks came: the keys it named (its transfer id
        # or P's id), so those blocks are freed on arrival. Only the registering agent can.
        self.aborted_keys: Tombstones[str, str] = Tombstones(tombstone_ttl)
        # An abort that came before its registration (reordered): refuses that exact slot
        # from that exact sender, nothing else.
        self.early_aborts: Tombstones[tuple[str, int, str], float] = Tombstones(orphan_ttl, max_size=1 << 16)

    # --- indexes -----------------------------------------------------------------------------
    @staticmethod
    def _add(index: dict[str, set[Slot]], key: str | None, slot: Slot) -> None:
        if key is not None:
            index.setdefault(key, set()).add(slot)

    @staticmethod
    def _remove(index: dict[str, set[Slot]], key: str | None, slot: Slot) -> None:
        if key is None:
            return
        bucket = index.get(key)
        if bucket is not None:
            bucket.discard(slot)
            if not bucket:
                del index[key]

    def _hold(self, d_id: str, d_rank: int, sender: str) -> None:
        self._slot_senders.setdefault((d_id, d_rank), set()).add(sender)

    def _release(self, d_id: str, d_rank: int, sender: str) -> None:
        held = self._slot_senders.get((d_id, d_rank))
        if held is not None:
            held.discard(sender)
            if not held:
                del self._slot_senders[(d_id, d_rank)]

    def _store_pending(self, p: PendingRegistration) -> None:
        reg, slot = p.registration, p.slot
        self.pending[slot] = p
        self._hold(*slot)
        self._add(self._pending_by_tid, reg.transfer_id, slot)
        self._add(self._pending_by_name, _name(reg), slot)
        self._add(self._pending_by_base, p.base, slot)

    def _drop_pending(self, p: PendingRegistration) -> None:
        reg, slot = p.registration, p.slot
        if self.pending.get(slot) is not p:
            return
        del self.pending[slot]
        if slot not in self._served:
            self._release(*slot)
        self._remove(self._pending_by_tid, reg.transfer_id, slot)
        self._remove(self._pending_by_name, _name(reg), slot)
        self._remove(self._pending_by_base, p.base, slot)

    def _holds(self, slot: Slot, generation: int) -> bool:
        """That exact registration is still live here: waiting, or handed to the writer."""
        pending = self.pending.get(slot)
        if pending is not None and pending.registration.generation == generation:
            return True
        served_by = self._served.get(slot)
        return served_by is not None and self.entries[served_by].generations.get(slot[1], 0) == generation

    def _remember_slot(self, slot: Slot, memory: EndedSlot, now: float) -> None:
        (self._slots if memory.generation else self.legacy_slots).put(slot, memory, now)

    def _slot_memory(self, slot: Slot) -> EndedSlot | None:
        memory = self._slots.get(slot)
        if memory is None:
            memory = self.legacy_slots.get(slot)
        return memory if memory is not None else self.owed_slots.get(slot)

    def _refuse(self, p: PendingRegistration, reason: str, now: float) -> Refuse:
        """Drop a waiting registration P will never write, and remember its slot: a late or
        duplicated copy of it is then dropped instead of waiting again (P would write into
        blocks D freed once it heard the refusal)."""
        self._drop_pending(p)
        reg = p.registration
        self._remember_slot(
            p.slot, EndedSlot("refused", p.sender, blocks=reg.block_groups, generation=reg.generation), now
        )
        return Refuse(reg, reason)

    def _drop_entry(self, entry: FinishedEntry) -> None:
        if self.entries.get(entry.request_id) is not entry:
            return
        del self.entries[entry.request_id]
        if entry.transfer_id is not None:
            if self._entry_by_tid.get(entry.transfer_id) == entry.request_id:
                del self._entry_by_tid[entry.transfer_id]
        else:
            bucket = self._entries_by_base.get(entry.base)
            if bucket is not None:
                bucket.discard(entry.request_id)
                if not bucket:
                    del self._entries_by_base[entry.base]
        for d_rank, d_id in entry.served.items():
            slot = (d_id, d_rank, entry.senders[d_rank])
            if self._served.get(slot) == entry.request_id:
                del self._served[slot]
                if slot not in self.pending:
                    self._release(*slot)

    # --- pairing -----------------------------------------------------------------------------
    def candidates(self, reg: Registration) -> list[FinishedEntry]:
        """The live P entries ``reg`` may pair with, by the key order of docs/protocol.md, 'Matching'."""
        if reg.transfer_id is not None:
            pid = self._entry_by_tid.get(reg.transfer_id)
            if pid is not None:
                return [self.entries[pid]]
        if self.require_transfer_id:
            return []
        name = _name(reg)
        entry = self.entries.get(name)
        if entry is not None and entry.transfer_id is None:
            return [entry]
        base = _match_base(reg)
        if base is None:
            return []
        return [self.entries[p] for p in sorted(self._entries_by_base.get(base, ()))]

    def _pending_for(self, entry: FinishedEntry) -> list[PendingRegistration]:
        slots: set[Slot] = set()
        if entry.transfer_id is not None:
            slots |= self._pending_by_tid.get(entry.transfer_id, set())
        elif not self.require_transfer_id:
            slots |= self._pending_by_name.get(entry.request_id, set())
            slots |= self._pending_by_base.get(entry.base, set())
        return [self.pending[s] for s in sorted(slots)]

    # --- P: finished blocks arrive ---------------------------------------------------------------
    def add_finished(
        self, request_id: str, block_ids: BlockGroups, transfer_id: str | None, now: float, serial: int = 0
    ) -> Result:
        if request_id in self.entries:
            return Result("blocks.duplicate", "warning", counters=["matcher.duplicate_blocks"])
        if (transfer_id is not None and transfer_id in self.aborted_keys) or request_id in self.aborted_keys:
            # The agent that registered for it aborted before P finished: free P's blocks now.
            # The abort is spent: a later request reusing the id is not this one.
            self.aborted_keys.pop(request_id)
            if transfer_id is not None:
                self.aborted_keys.pop(transfer_id)
            return Result(
                "blocks.aborted_by_decode",
                "info",
                actions=[FailEntry(request_id, "aborted by decode", serial)],
            )
        self._serial = max(self._serial + 1, serial)
        entry = FinishedEntry(request_id, block_ids, transfer_id, base_request_id(request_id), serial or self._serial)
        # A new incarnation of a reused P id: the old tombstone no longer speaks for it.
        self.ended.pop(request_id)
        result = Result("blocks.stored", fields={"blocks": sum(len(g) for g in block_ids)})
        if transfer_id is not None:
            other = self._entry_by_tid.get(transfer_id)
            if other is not None:
                # Two live requests claim one transfer id: neither can be told apart from the
                # other by D's registration. Fail both rather than hand D the wrong KV.
                reason = f"transfer id {transfer_id!r} is used by two live requests ({other!r}, {request_id!r})"
                old = self.entries[other]
                result = Result(
                    "blocks.ambiguous",
                    "warning",
                    fields={"reason": reason, "other": other},
                    counters=["matcher.ambiguous"],
                )
                result.actions.append(FailEntry(request_id, reason, entry.serial))
                if not old.served:
                    old.failed = reason
                    result.actions.append(FailEntry(other, reason, old.serial))
                    for p in self._pending_for(old):
                        result.actions.append(self._refuse(p, reason, now))
                return result
            self.ended_tid.pop(transfer_id)
        self.entries[request_id] = entry
        if transfer_id is not None:
            self._entry_by_tid[transfer_id] = request_id
        else:
            self._entries_by_base.setdefault(entry.base, set()).add(request_id)
        matched: list[PendingRegistration] = []
        for p in self._pending_for(entry):
            cands = self.candidates(p.registration)
            if len(cands) > 1:
                self._ambiguous(p, cands, result, now)
            elif cands and cands[0] is entry:
                matched.append(p)
        if entry.failed:
            return result
        by_rank: dict[int, list[PendingRegistration]] = {}
        for p in matched:
            by_rank.setdefault(p.registration.decode_tp_rank, []).append(p)
        for d_rank, regs in sorted(by_rank.items()):
            if len(regs) > 1:
                reason = f"{len(regs)} registrations for D rank {d_rank} match request {request_id!r}"
                for p in regs:
                    result.actions.append(self._refuse(p, reason, now))
                if not entry.served:
                    entry.failed = reason
                    result.actions.append(FailEntry(request_id, reason, entry.serial))
                result.event, result.level = "reg.ambiguous", "warning"
                result.counters.append("matcher.ambiguous")
                continue
            p = regs[0]
            if entry.failed:
                result.actions.append(self._refuse(p, entry.failed, now))
                continue
            if now >= p.deadline:
                # D's own deadline for it passed (by our estimate of D's clock): D may have
                # given up, its abort lost, and reused the blocks. Never write into them.
                result.counters.append("matcher.expired")
                result.actions.append(self._refuse(p, "D's deadline for the registration passed", now))
                continue
            if now - p.refreshed_at > self.stale_after:
                # D stopped heartbeating it: D may have aborted (its PUSH_ABORT lost) and reused
                # the blocks after its quarantine. Never write into them.
                result.counters.append("matcher.stale_registration")
                result.actions.append(self._refuse(p, "registration went stale: no heartbeat from D", now))
                continue
            self._drop_pending(p)
            result.actions.append(self._serve(entry, p))
            result.event = "reg.matched"
            result.fields.update(order="blocks_last", d_request_id=p.registration.request_id)
            result.counters.append("matcher.matched")
        return result

    def _ambiguous(self, p: PendingRegistration, cands: list[FinishedEntry], result: Result, now: float) -> None:
        ids = [c.request_id for c in cands]
        reason = f"registration matches {len(cands)} live requests by base id {p.base!r}: {ids[:4]}"
        result.actions.append(self._refuse(p, reason, now))
        for c in cands:
            if not c.served and not c.failed:
                c.failed = reason
                result.actions.append(FailEntry(c.request_id, reason, c.serial))
        result.event, result.level = "reg.ambiguous", "warning"
        result.fields["reason"] = reason
        result.counters.append("matcher.ambiguous")

    def _serve(self, entry: FinishedEntry, p: PendingRegistration) -> Post:
        reg, sender = p.registration, p.sender
        entry.served[reg.decode_tp_rank] = reg.request_id
        entry.senders[reg.decode_tp_rank] = sender
        entry.blocks[reg.decode_tp_rank] = reg.block_groups
        entry.names[reg.decode_tp_rank] = _naming(reg)
        entry.generations[reg.decode_tp_rank] = reg.generation
        self._served[(reg.request_id, reg.decode_tp_rank, sender)] = entry.request_id
        self._hold(reg.request_id, reg.decode_tp_rank, sender)
        return Post(entry.request_id, entry.serial, entry.block_ids, reg, sender, p.refreshed_at, p.deadline)

    # --- D's registration arrives ----------------------------------------------------------------
    def add_registration(self, reg: Registration, sender: str, now: float, deadline: float = math.inf) -> Result:
        """``deadline``: D's deadline for ``reg`` on this rank's clock (inf: none known)."""
        slot: Slot = (reg.request_id, reg.decode_tp_rank, sender)
        if slot in self.early_aborts:
            return Result("reg.refused", "info", {"reason": "aborted by decode"}, [Refuse(reg, "aborted by decode")])
        if reg.generation:
            verdict = self.windows.check(sender, reg.generation)
            if verdict == "too_old":
                # Older than anything P can still tell from a copy: refuse it. The answer names
                # its generation, so D fails it if it is live and drops it if it was a copy.
                reason = "registration older than P's replay window for its D rank"
                return Result("reg.refused", "warning", {"reason": reason}, [Refuse(reg, reason)], ["matcher.too_old"])
            if verdict == "seen" and not self._holds(slot, reg.generation):
                # A late, duplicated or replayed copy of a registration P took and is done with:
                # no answer (one naming that generation would be dropped by D anyway).
                return Result(
                    "reg.duplicate",
                    "info",
                    {"after": "ended"},
                    counters=["matcher.late_registration_dropped", "matcher.stale_generation.push_reg"],
                )
            self.windows.mark(sender, reg.generation)
        # Already handed to the writer: a duplicate is idempotent, anything else is refused.
        served_by = self._served.get(slot)
        if served_by is not None:
            entry = self.entries[served_by]
            served_gen = entry.generations.get(reg.decode_tp_rank, 0)
            if entry.blocks.get(reg.decode_tp_rank) == reg.block_groups and served_gen == reg.generation:
                return Result("reg.duplicate", counters=["matcher.duplicate_registration"])
            if reg.generation and _older(reg.generation, served_gen):
                # A late copy of a registration this one replaced: it answers nothing.
                return Result("reg.stale", "info", counters=["matcher.stale_generation.push_reg"])
            return Result(
                "reg.refused",
                "warning",
                {"reason": "re-registered with other blocks after its WRITE was posted"},
                [Refuse(reg, "re-registered with other blocks after its WRITE was posted")],
                ["matcher.restage_refused"],
            )
        pending = self.pending.get(slot)
        if pending is not None:
            if pending.registration == reg:
                return Result("reg.duplicate", fields={"pending": True}, counters=["matcher.duplicate_registration"])
            if reg.generation and _older(reg.generation, pending.registration.generation):
                # A late copy of an earlier staging: the newer one D holds stays.
                return Result("reg.stale", "info", counters=["matcher.stale_generation.push_reg"])
            # D re-staged the request: the newest registration is the one D expects written.
            self._drop_pending(pending)
            replaced = PendingRegistration(reg, sender, _match_base(reg), pending.arrived_at, now, deadline)
            self._store_pending(replaced)
            result = self._match_registration(replaced, now)
            if result.event == "reg.stored":
                result.event = "reg.replaced"
            result.counters.append("matcher.restaged")
            return result
        # P may be done with it already: answer from the exact tombstone it names.
        ended = self._ended_for(reg, sender)
        if ended is not None:
            return ended
        if now >= deadline:
            # D's deadline passed on the way here: D may have given up (its abort lost) and
            # reused the blocks. Never write them; tell D, whose answer names the generation.
            reason = "registration arrived after D's deadline for it"
            return Result("reg.refused", "warning", {"reason": reason}, [Refuse(reg, reason)], ["matcher.expired"])
        key = _exact_key(reg)
        if key is not None and self.aborted_keys.get(key) == sender:
            # That D rank aborted an earlier registration naming this P request, and now names
            # it again (its client cancelled a decode leg and sent it again): the abort is spent
            # and must not free P's blocks under the registration waiting for them now.
            self.aborted_keys.pop(key)
        p = PendingRegistration(reg, sender, _match_base(reg), now, now, deadline)
        self._store_pending(p)
        return self._match_registration(p, now)

    def _match_registration(self, p: PendingRegistration, now: float) -> Result:
        reg = p.registration
        cands = self.candidates(reg)
        if not cands:
            return Result("reg.stored")
        result = Result("reg.stored")
        if len(cands) > 1:
            self._ambiguous(p, cands, result, now)
            return result
        entry = cands[0]
        if entry.failed:
            result.actions.append(self._refuse(p, entry.failed, now))
            result.event, result.level = "reg.refused", "info"
            return result
        served = entry.served.get(reg.decode_tp_rank)
        if served is not None:
            reason = "another registration was served for this request"
            result.actions.append(self._refuse(p, reason, now))
            result.event, result.level = "reg.refused", "warning"
            result.fields["reason"] = "rank already served"
            return result
        self._drop_pending(p)
        result.actions.append(self._serve(entry, p))
        result.event = "reg.matched"
        result.fields.update(order="registration_last", p_request_id=entry.request_id)
        result.counters.append("matcher.matched")
        return result

    def _ended_for(self, reg: Registration, sender: str) -> Result | None:
        slot_memory = self._slot_memory((reg.request_id, reg.decode_tp_rank, sender))
        if slot_memory is not None and reg.generation and slot_memory.generation:
            if reg.generation == slot_memory.generation or _older(reg.generation, slot_memory.generation):
                # A late or replayed copy of a registration P already ended (or of an older
                # one): drop it, answering nothing (an answer naming that generation would be
                # dropped by D anyway).
                return Result(
                    "reg.duplicate",
                    "info",
                    {"after": slot_memory.outcome},
                    counters=["matcher.late_registration_dropped", "matcher.stale_generation.push_reg"],
                )
            if not slot_memory.served:
                # A newer generation under a slot P refused or D aborted: D reused its id for
                # another request. It is new: served or refused on its own merits, at once.
                slot_memory = None
        if slot_memory is not None and slot_memory.served and _naming(reg) != slot_memory.naming:
            slot_memory = None  # not a copy: D reused its id, naming P's request otherwise
        if slot_memory is not None and slot_memory.served:
            # P wrote (or tried to write) this slot for the request it names. A registration
            # for it again is a late copy, or D reusing its id for the same P request name
            # (even with the same blocks, which its allocator may hand back). P cannot tell
            # which and will not write twice: refuse it, so a reused id fails at once instead
            # of at D's watchdog. A late copy's D request has its answer already and drops this.
            reason = f"request {reg.request_id!r} already {slot_memory.outcome} on P"
            return Result("reg.refused", "info", {"reason": reason}, [Refuse(reg, reason)], ["matcher.reused_slot"])
        if slot_memory is not None and slot_memory.blocks == reg.block_groups:
            # A late or duplicated copy of a registration P refused or D aborted: D has failed
            # it and may have given its blocks to another request. Never store it again; and
            # no answer either, which could reach a new D request reusing the id.
            return Result(
                "reg.duplicate",
                "info",
                {"after": slot_memory.outcome},
                counters=["matcher.late_registration_dropped"],
            )
        ended: Ended | None = None
        if reg.transfer_id is not None:
            ended = self.ended_tid.get(reg.transfer_id)
        if ended is None and reg.transfer_id is None:
            ended = self.ended.get(_name(reg))
        if ended is None:
            return None
        reason = f"request already {ended.outcome} on P"
        return Result(
            "reg.refused", "info", {"reason": ended.outcome, "p_request_id": ended.request_id}, [Refuse(reg, reason)]
        )

    # --- P is done with a request --------------------------------------------------------------
    def forget(
        self,
        request_id: str,
        outcome: str,
        *,
        transfer_id: str | None,
        serial: int,
        now: float,
        pinned: tuple[int, ...] = (),
    ) -> Result:
        entry = self.entries.get(request_id)
        if entry is not None and serial and entry.serial != serial:
            # A late Forget for an earlier incarnation of this id: the live one is not it.
            return Result("request.forget_stale", fields={"serial": serial, "live_serial": entry.serial})
        refused: list[Action] = []
        if entry is not None:
            self._drop_entry(entry)
            transfer_id = entry.transfer_id
            for d_rank, d_id in entry.served.items():
                slot = (d_id, d_rank, entry.senders[d_rank])
                memory = EndedSlot(
                    outcome,
                    entry.senders[d_rank],
                    request_id,
                    served=True,
                    blocks=entry.blocks[d_rank],
                    naming=entry.names[d_rank],
                    generation=entry.generations.get(d_rank, 0),
                )
                self._remember_slot(slot, memory, now)
                if d_rank in pinned:
                    self.owed_slots.put(slot, memory, now)
        else:
            # P gave up before its blocks reached the matcher: D's registrations that name it
            # exactly (transfer id or P's id) hear it now. Never by base id.
            slots: set[Slot] = set()
            if transfer_id is not None:
                slots |= self._pending_by_tid.get(transfer_id, set())
            else:
                slots |= self._pending_by_name.get(request_id, set())
            for slot in sorted(slots):
                refused.append(self._refuse(self.pending[slot], f"request {outcome} on P", now))
        # Whatever D aborted under these keys ended with this request: an abort never outlives
        # it to fail a later request that reuses the id.
        self.aborted_keys.pop(request_id)
        if transfer_id is not None:
            self.aborted_keys.pop(transfer_id)
        ended = Ended(outcome, request_id, entry.serial if entry is not None else serial)
        self.ended.put(request_id, ended, now)
        if transfer_id is not None:
            self.ended_tid.put(transfer_id, ended, now)
        return Result(
            "request.forgotten",
            fields={"outcome": outcome, "known": entry is not None, "refused": len(refused)},
            actions=refused,
        )

    # --- heartbeats and aborts from D ------------------------------------------------------------
    def served_to(self, request_id: str, sender: str) -> list[tuple[int, int]]:
        """(D rank, generation) of every registration ``sender`` made that P request serves."""
        entry = self.entries.get(request_id)
        if entry is None:
            return []
        return [(r, entry.generations.get(r, 0)) for r, s in entry.senders.items() if s == sender]

    def resolve(self, key: str) -> FinishedEntry | None:
        """The one live entry a heartbeat id names (transfer id, P id, or a unique base)."""
        pid = self._entry_by_tid.get(key)
        if pid is not None:
            return self.entries[pid]
        entry = self.entries.get(key)
        if entry is not None and entry.transfer_id is None:
            return entry
        bucket = self._entries_by_base.get(base_request_id(key))
        if bucket is not None and len(bucket) == 1:
            return self.entries[next(iter(bucket))]
        return None

    def heartbeat(
        self, ids: tuple[str, ...], sender: str, now: float, deadline: float | None = None
    ) -> tuple[list[str], int, int]:
        """(P ids whose leases to extend, pending registrations refreshed, ids unknown).

        Only the agent that registered for a request may keep it alive."""
        extend: list[str] = []
        refreshed = unknown = 0
        for key in ids:
            entry = self.resolve(key)
            if entry is not None and sender in entry.senders.values():
                extend.append(entry.request_id)
                continue
            # A waiting registration is kept fresh only by the exact key D heartbeats for it
            # (its transfer id, else the name it gives P's request): never by base id, or a
            # heartbeat for a sibling request (a client's retry) would keep fresh a registration
            # D aborted and stopped heartbeating, and P would write into blocks D freed.
            hit = False
            for index in (self._pending_by_tid, self._pending_by_name):
                for slot in index.get(key, ()):
                    p = self.pending[slot]
                    if p.sender == sender:
                        # A heartbeat resolved late (in slices) never makes it look older.
                        p.refreshed_at = max(p.refreshed_at, now)
                        if deadline is not None and p.deadline != math.inf:
                            p.deadline = max(p.deadline, deadline)  # D promised longer
                        hit = True
            if hit:
                refreshed += 1
            else:
                unknown += 1
        return extend, refreshed, unknown

    def abort(self, abort: Abort, sender: str, now: float) -> Result:
        slot: Slot = (abort.request_id, abort.decode_tp_rank, sender)
        pending = self.pending.get(slot)
        if pending is not None and _names_other(abort.generation, pending.registration.generation):
            # D gave up another generation of this slot (a late abort for an earlier staging):
            # the registration waiting now is not the one it names.
            return Result("abort.stale", "info", counters=["matcher.stale_generation.push_abort"])
        if pending is not None:
            # Not matched yet: drop it and confirm to D that nothing will be written. The keys
            # it named exactly free P's blocks when they arrive.
            self._drop_pending(pending)
            reg = pending.registration
            key = _exact_key(reg)
            if key is not None:
                self.aborted_keys.put(key, sender, now)
            self._remember_slot(
                slot, EndedSlot("aborted", sender, blocks=reg.block_groups, generation=reg.generation), now
            )
            return Result("abort.dropped_registration", actions=[Refuse(reg, "aborted by decode")])
        pid = self._served.get(slot)
        served_gen = self.entries[pid].generations.get(abort.decode_tp_rank, 0) if pid is not None else 0
        if pid is not None and _names_other(abort.generation, served_gen):
            return Result("abort.stale", "info", counters=["matcher.stale_generation.push_abort"])
        if pid is not None:
            return Result(
                "abort.cancel_push",
                fields={"p_request_id": pid},
                actions=[CancelServed(pid, abort.request_id, abort.decode_tp_rank)],
            )
        done = self._slot_memory((abort.request_id, abort.decode_tp_rank, sender))
        if done is not None and _names_other(abort.generation, done.generation):
            done = None  # about another generation of this slot than the one P remembers
        if done is not None:
            if done.outcome == "aborted":
                return Result("abort.duplicate")
            return Result(
                "abort.answered",
                fields={"outcome": done.outcome},
                actions=[
                    AnswerAbort(abort.request_id, sender, f"request already {done.outcome} on P", done.generation)
                ],
            )
        if self._slot_senders.get((abort.request_id, abort.decode_tp_rank)):
            # Another agent holds that registration: this one cannot end it.
            return Result(
                "abort.ignored",
                "warning",
                {"reason": "not from the agent that registered"},
                counters=["matcher.abort_wrong_sender"],
            )
        # Nothing from that agent under that slot (yet): remember it for exactly that slot and
        # sender, so a reordered registration is refused. It can end nothing else.
        self.early_aborts.put((abort.request_id, abort.decode_tp_rank, sender), now, now)
        return Result("abort.remembered", counters=["matcher.abort_unknown"])

    # --- time ------------------------------------------------------------------------------------
    def prune(self, now: float, on_orphan: Callable[[PendingRegistration], None]) -> None:
        while self.pending:
            p = next(iter(self.pending.values()))
            if now - p.arrived_at < self.orphan_ttl:
                break
            self._refuse(p, "", now)  # remembered like any refusal; the matcher answers it
            on_orphan(p)
        for stones in (self.memory, self.legacy_slots, self.owed_slots, self.aborted_keys, self.early_aborts):
            stones.prune(now)  # type: ignore[attr-defined]

    def index_shape(self) -> dict[str, tuple[int, int]]:
        """(keys, largest bucket) of each pending-registration index: lookups are one dict
        access into a bucket this small, never a scan."""
        return {
            name: (len(index), max((len(b) for b in index.values()), default=0))
            for name, index in (
                ("by_tid", self._pending_by_tid),
                ("by_name", self._pending_by_name),
                ("by_base", self._pending_by_base),
            )
        }

    def sizes(self) -> dict[str, int]:
        return {
            "finished": len(self.entries),
            "by_tid": len(self._entry_by_tid),
            "by_base": sum(len(v) for v in self._entries_by_base.values()),
            "served": len(self._served),
            "slot_senders": len(self._slot_senders),
            "pending_registrations": len(self.pending),
            "regs_by_tid": sum(len(v) for v in self._pending_by_tid.values()),
            "regs_by_id": sum(len(v) for v in self._pending_by_name.values()),
            "regs_by_base": sum(len(v) for v in self._pending_by_base.values()),
            "tombstones": len(self.memory) + len(self.legacy_slots),
            "owed_slots": len(self.owed_slots),
            "replay_windows": len(self.windows),
            "aborted_keys": len(self.aborted_keys),
            "early_aborts": len(self.early_aborts),
        }
