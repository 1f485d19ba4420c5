"""A stateful model of P's side of a push: the writer's parts (``p_model_kit.PRank``) over the
fake fabric, with real bytes in P's and D's registered memory, on the model's clock.

The model plays everything around P's writer: D (registrations with a deadline, offering a
staging slot or not; heartbeats, lost or not; aborts that arrive, are lost, come late or are
asked again; its reuse of blocks once P's final word came, or its quarantine, or its own
pinned_write_limit, passed), P's engine (whole prefills, and announced ones whose forward
computes a layer at a time: layer-wise, or a whole push armed for the forward's end in
``PSideArmed``), the matcher and the reaper (their mailboxes to the writer, any number of
messages waiting, leases that expire, P's own failures), P's stager (gathers, one failing),
NIXL (every WRITE held until the model lets it end DONE or ERR; a release it refuses) and time.
Hypothesis interleaves them. After every step it checks:

1. no WRITE is posted after P saw D's abort, after D's deadline passed on P's view of D's
   clock, after P's lease ended or P failed the request, after the push was stopped or told
   D it may still land; it writes only the memory D registered; and every byte in D's memory
   (blocks, staging slots) is zero or the KV of the request D holds it for;
2. no final word (completion, final failure) goes to D while a WRITE of that push still runs
   in the fabric, and at most one per (request, generation);
3. a push stopped before all its parts were posted (deadline, abort, lease, P's failure, stuck,
   a failed gather) is never reported pushed: no completion to D, a failure on P's engine;
   one reported pushed has all its KV in D's memory;
4. every push ends exactly once on P's engine, and P frees its blocks then, never while a
   WRITE of it still reads them; a push in flight ``write_timeout`` after its first WRITE has
   told D (may still land, or its final word); one at ``pinned_write_limit`` has ended;
5. P releases a WRITE still running only at ``pinned_write_limit``, fails it on both sides,
   and counts each (``write.released_at_pin_limit``).

Teardown drains: the forwards finish and every WRITE ends; then D aborts what it still waits
for, the mailboxes and the stager empty and time passes. Every push has then ended on both
sides, exactly once, and nothing is left in flight (fabric, P's book, layer-wise and staged
state, P's staging slots, NIXL handles); every block and slot is free and D's memory is zero.

No WRITE lands past its push's ``pinned_write_limit`` (the bound both sides assume). The model
found two bugs, both fixed, each with its test at the end: a push in parts stopped after its
last WRITE (which carries the completion) was posted ends as that WRITE does, with one final
word; a reused P id whose expiry handler failed is ended even while an earlier incarnation's
tombstone is held.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from p_model_kit import BLOCK, GARBAGE, LAYERS, NBLOCKS, SLOT, SLOTS, STAGING, PRank, TappedWrite, VirtualClock, stamp

from pushactors.protocol import (
    CancelPush,
    ClearLease,
    Completion,
    ExpireLease,
    Forget,
    LayersReady,
    PostPush,
    PushFailure,
    RefuseRegistration,
    Released,
)
from pushactors.testing import registration

LONG = os.environ.get("PUSHACTORS_LONG") == "1"
TICK = 0.5  # the writer's housekeeping period (reaper_tick)
WRITE_TIMEOUT = 4.0
PIN_LIMIT = 12.0  # pinned_write_limit, the same on both sides
LEASE = 6.0  # D promises its blocks for 2/3 of it past each registration or heartbeat
PROMISE = LEASE * 2 / 3
QUARANTINE = 10.0  # >= 2/3 lease + write_timeout + 2 ticks
HEARTBEAT = 1.0  # D's heartbeat_interval (lease / 6)
START = 1000.0  # the model's clock at the start
MAX_WAIT = 4.0  # a message waits at most this long in a mailbox before time goes on
CONFIG: dict[str, Any] = {
    "write_timeout": WRITE_TIMEOUT,
    "pinned_write_limit": PIN_LIMIT,
    "lease_duration": LEASE,
    "abort_quarantine": QUARANTINE,
    "reaper_tick": TICK,
    "poll_spin": 0.0,  # no busy spin on a clock that stands still
    "push_mode": "layerwise",  # an announced push is written a layer group at a time
    "staging_gather_runs": 0,  # a staged push is gathered on P's stager, then written in chunks
    "staging_chunk_bytes": 128,
}
P_IDS = ("pa", "pb", "pc")
PACES = st.sampled_from([0.0, TICK, 1.5])  # seconds per layer of an announced push's forward
GROUPS = len(LAYERS)  # layer groups of a layer-wise push (one layer each)
ARMED: dict[str, Any] = {**CONFIG, "push_mode": "whole"}  # an announced push is one WRITE of every layer


@dataclass(eq=False)
class Push:
    """One request: D's registration and P's push for it."""

    uid: int
    d_id: str
    generation: int
    d_blocks: tuple[int, ...]
    reg_deadline: float  # D's deadline as the registration carried it (and heartbeats before pairing)
    slot: int | None = None  # D's staging slot offered in the registration (a staged push)
    # --- D ---
    aborted_at: float | None = None
    pinned_at: float | None = None  # D heard "may still land"
    final: str | None = None  # D's final word from P: "landed" or the failure
    d_freed: bool = False
    # --- P ---
    p_id: str = ""
    serial: int = 0
    mode: str = ""  # whole, or announced (written as its forward computes)
    p_blocks: tuple[int, ...] = ()
    p_deadline: float = 0.0  # D's newest promise P holds
    lease_at: float = 0.0  # when the reaper fires
    lease_armed: bool = False
    paired: bool = False  # the matcher sent its PostPush
    delivered: bool = False  # the writer has it
    dropped: bool = False  # the matcher dropped the registration (D's abort came first)
    forgotten: bool = False  # the matcher is done with it
    saw_abort: bool = False  # the writer was told D aborted
    lease_over: bool = False  # the writer was told P's lease ended (or P failed it)
    layers: int = 0  # layers the forward computed
    groups: int = 0  # WRITEs of an announced push (one per layer group)
    gathers: int = 0  # chunks of a staged push P's stager was asked to gather
    pace: float = 0.0  # seconds the forward takes per layer as time passes (0: stands still)
    next_layer_at: float = 0.0
    cut: str = ""  # why it was stopped with parts not posted yet
    writes: list[TappedWrite] = field(default_factory=list)
    # When P's stuck timer and pin limit start: its first WRITE; for a staged push P gathers
    # first, when it issued the gathers (the gather's time counts; a staged push judged stuck
    # before any chunk went posts none, so D's hold still outlasts every chunk's bound).
    first_post: float | None = None
    released_at_limit: bool = False
    outcome: str | None = None  # what P's engine was told: "pushed" or the failure

    def __repr__(self) -> str:
        staged = " staged" if self.slot is not None else ""
        return f"<{self.d_id}/{self.p_id or '-'}#{self.serial} {self.mode or 'unprefilled'}{staged}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))  # hypothesis prints drawn pushes this way

    @property
    def kind(self) -> str:
        if self.slot is not None:
            return "staged"
        if self.mode == "announced":
            # one group: a whole push armed while its forward runs, posted once its last layer is in
            return "layerwise" if self.groups > 1 else "armed whole"
        return self.mode

    @property
    def registration(self) -> Any:
        reg = registration(self.d_id, (self.d_blocks,), generation=self.generation)
        slot = None if self.slot is None else (self.slot * SLOT, SLOT)
        return msgspec.structs.replace(reg, remote_request_id=self.p_id or None, staging_slot=slot)

    @property
    def prefilled(self) -> bool:
        return bool(self.p_id)

    @property
    def parts_left(self) -> bool:
        """Some WRITE of the push is still to be posted (or it is not planned yet)."""
        if self.slot is not None:
            return len(self.writes) < self.gathers if self.gathers else not self.writes
        return len(self.writes) < (self.groups if self.mode == "announced" else 1)

    @property
    def running(self) -> bool:
        return any(w.running for w in self.writes)

    @property
    def d_waits(self) -> bool:
        """D still waits for P's word on it (not aborted, no final word)."""
        return not self.d_freed and self.aborted_at is None and self.final is None


class PSide(RuleBasedStateMachine):
    config = CONFIG  # the writer's settings; they fix the layers of an announced push's groups

    def __init__(self) -> None:
        super().__init__()
        self.clock = VirtualClock(START)
        self.p = PRank(self.clock, **self.config)
        self.per_group = min(self.p.config.layers_per_group, len(LAYERS))  # layers per WRITE of an announced push
        self.groups = len(LAYERS) // self.per_group
        tap = self.p.tap
        tap.on_post, tap.on_posted, tap.on_release = self._on_post, self._on_posted, self._released
        tap.on_send = self._sent
        for t in self.p.p_kv.values():
            t.fill_(GARBAGE)  # nothing computed yet
        self.pushes: list[Push] = []
        self.d_free: set[int] = set(range(NBLOCKS))
        self.p_free: set[int] = set(range(NBLOCKS))
        self.from_matcher: deque[tuple[float, Any]] = deque()
        self.from_reaper: deque[tuple[float, Any]] = deque()
        self.late_aborts: list[Push] = []
        self.slots_free: set[int] = set(range(SLOTS))
        self.gathers: deque[Any] = deque()  # the stager's mailbox
        self.acting: Push | None = None
        self.told_seen = {"reaper": 0, "matcher": 0, "stager": 0}
        self.finals: Counter[tuple[str, int]] = Counter()
        self.violations: list[str] = []
        self.refusals = 0  # a release NIXL was told to refuse, not taken yet
        self.refused_before = 0
        self.generation = 0
        self.serial = 0

    @property
    def now(self) -> float:
        return self.clock.now

    def _bad(self, what: str) -> None:
        self.violations.append(f"t={self.now - START:g}: {what}")

    def by_d(self, d_id: str, generation: int) -> Push | None:
        return next((p for p in self.pushes if p.d_id == d_id and p.generation == generation), None)

    def incarnation(self, p_id: str, serial: int) -> Push:
        return next(p for p in self.pushes if p.p_id == p_id and p.serial == serial)

    def p_live(self, p_id: str) -> Push | None:
        """The incarnation of ``p_id`` P's engine still holds."""
        return next((p for p in self.pushes if p.p_id == p_id and p.outcome is None), None)

    # --- the tap: what the writer does, as it does it --------------------------------------------
    def _on_post(self, handle: Any) -> Any:
        """A WRITE is about to be posted: it must be one P may still post (rule 1)."""
        src = self.p.tap.src(handle)
        if src and all(layer == STAGING for layer, _ in src):
            owners = {self.acting}  # P's slot, gathered for the push whose chunk came back
        else:
            owners = {self.p_holder(b) for _, b in src}
        if len(owners) != 1 or None in owners:
            self._bad(f"a WRITE reads P memory {sorted(src)} no single live request holds")
            return None
        push = owners.pop()
        assert push is not None
        why = []
        if self.now >= push.p_deadline:
            why.append("D's deadline had passed on P's view")
        if push.saw_abort:
            why.append("P had seen D's abort")
        if push.lease_over:
            why.append("P's lease had ended (or P failed it)")
        if push.cut:
            why.append(f"the push was stopped ({push.cut})")
        if push.pinned_at is not None:
            why.append("P had told D its WRITE may still land")
        if push.d_freed:
            why.append("D had reused its blocks")
        dst = self.p.tap.dst(handle)
        if not dst or any((layer, b) not in self._d_granules(push) for layer, b in dst):
            why.append(f"it writes D memory {sorted(dst)}, not the registration's")
        if why:
            self._bad(f"WRITE of {push.d_id} posted though " + " and ".join(why))
        return push

    def _on_posted(self, write: TappedWrite) -> None:
        push = write.owner
        if push is None:
            return
        push.writes.append(write)
        if push.first_post is None:
            push.first_post = write.at

    def _released(self, handle: Any) -> None:
        """P releases a WRITE still running: only at the pin limit (rule 5)."""
        push = next((p for p in self.pushes if any(w.handle is handle for w in p.writes)), None)
        if push is None or push.first_post is None:
            self._bad("P released a running WRITE the model never saw posted")
            return
        if self.now - push.first_post < PIN_LIMIT:
            self._bad(f"P released a running WRITE of {push.d_id} before pinned_write_limit")
        if not push.running:  # the last of them (NIXL may refuse some, released on a later pass)
            push.released_at_limit = True

    def _sent(self, message: Any) -> None:
        """P sends D a notification: a final word only once nothing of the push runs (rule 2)."""
        final = isinstance(message, Completion) or (isinstance(message, PushFailure) and message.final)
        push = self.by_d(message.request_id, message.generation)
        if final and push is not None and push.running:
            self._bad(f"final word for {push.d_id} sent while a WRITE of it runs")

    # --- blocks ----------------------------------------------------------------------------------
    def p_holder(self, block: int) -> Push | None:
        return next((p for p in self.pushes if p.outcome is None and block in p.p_blocks), None)

    def d_holder(self, block: int) -> Push | None:
        return next((p for p in self.pushes if not p.d_freed and block in p.d_blocks), None)

    def _d_granules(self, push: Push) -> set[tuple[int, int]]:
        """What of D's memory the registration names: its blocks, or its staging slot."""
        if push.slot is not None:
            per = SLOT // BLOCK
            return {(STAGING, g) for g in range(push.slot * per, (push.slot + 1) * per)}
        return {(layer, b) for layer in range(len(LAYERS)) for b in push.d_blocks}

    def _compute(self, push: Push, layer: int) -> None:
        """P's forward writes ``layer`` of the request into its blocks."""
        t = list(self.p.p_kv.values())[layer]
        for pos, b in enumerate(push.p_blocks):
            t[b] = stamp(push.uid, layer, pos)

    # --- D ---------------------------------------------------------------------------------------
    @rule(
        data=st.data(),
        n=st.integers(1, 2),
        life=st.sampled_from([1.0, 2.5, PROMISE]),
        prefill=st.sampled_from(["later", "whole", "announced"]),
        computed=st.integers(0, len(LAYERS)),
        pace=PACES,
        staged=st.booleans(),
    )
    def d_registers(
        self, data: st.DataObject, n: int, life: float, prefill: str, computed: int, pace: float, staged: bool
    ) -> None:
        """D stages a request and registers its blocks (offering a staging slot when
        ``staged``), promising them for ``life``; P's prefill for it may finish (or be
        announced) at once, as in push mode."""
        if len(self.d_free) < n or sum(p.d_waits for p in self.pushes) >= 3:
            return
        if staged and not self.slots_free:
            return
        blocks = tuple(sorted(self.d_free)[:n])
        self.d_free -= set(blocks)
        self.generation += 1
        uid = len(self.pushes) + 1
        deadline = self.now + life
        push = Push(uid, f"d{uid}", self.generation, blocks, deadline, p_deadline=deadline)
        if staged:
            push.slot = min(self.slots_free)
            self.slots_free.discard(push.slot)
        self.pushes.append(push)
        if prefill != "later":
            self._prefill(data, push, prefill, computed, pace)
        self._settle()

    @precondition(lambda self: any(p.d_waits for p in self.pushes))
    @rule(data=st.data(), lost=st.booleans())
    def d_heartbeat(self, data: st.DataObject, lost: bool) -> None:
        """D promises a waiting registration's blocks for another 2/3 lease (the beat may be lost)."""
        push = data.draw(st.sampled_from([p for p in self.pushes if p.d_waits]))
        if not lost:
            self._beat(push)
        self._settle()

    def _beat(self, push: Push) -> None:
        """D's heartbeat for ``push`` reaches P: its matcher holds D's newer promise, and the
        reaper extends P's lease."""
        if push.forgotten:
            return
        until = self.now + PROMISE
        if push.paired:
            self.p.ctx.promises.renew((push.p_id, 0, push.generation), until)
            if push.lease_armed:
                push.lease_at = max(push.lease_at, until)
        else:
            push.reg_deadline = max(push.reg_deadline, until)
        push.p_deadline = max(push.p_deadline, until)

    @precondition(lambda self: any(p.d_waits for p in self.pushes))
    @rule(data=st.data(), fate=st.sampled_from(["arrives", "lost", "late"]))
    def d_aborts(self, data: st.DataObject, fate: str) -> None:
        """D gives up on a request (its watchdog, its engine); the abort reaches P's matcher, is
        lost, or comes late."""
        push = data.draw(st.sampled_from([p for p in self.pushes if p.d_waits]))
        push.aborted_at = self.now
        if fate == "arrives":
            self._abort_reaches_p(push)
        elif fate == "late":
            self.late_aborts.append(push)
        self._settle()

    def _abortable_again(self) -> list[Push]:
        return self.late_aborts + [p for p in self.pushes if p.aborted_at is not None and not p.d_freed]

    @precondition(lambda self: bool(self._abortable_again()))
    @rule(data=st.data())
    def abort_reaches_p_later(self, data: st.DataObject) -> None:
        """An abort that was late arrives, or D asks again about one whose blocks it still
        holds (a duplicate, when the first arrived)."""
        push = data.draw(st.sampled_from(self._abortable_again()))
        if push in self.late_aborts:
            self.late_aborts.remove(push)
        self._abort_reaches_p(push)
        self._settle()

    def _abort_reaches_p(self, push: Push) -> None:
        """P's matcher handles D's abort."""
        if push.forgotten:
            return  # answered from its tombstone by the matcher: nothing reaches the writer
        if push.paired:
            self._matcher_says(CancelPush(request_id=push.p_id, d_request_id=push.d_id, decode_tp_rank=0))
            return
        if not push.dropped:
            # Not matched yet: the registration is dropped, D hears nothing will be written,
            # and P's blocks (now or when they come) are freed as failed.
            push.dropped = True
            self._matcher_says(RefuseRegistration(registration=push.registration, reason="aborted by decode"))
            if push.prefilled:
                self._matcher_fails(push, "aborted by decode")

    # --- P's engine ------------------------------------------------------------------------------
    @precondition(lambda self: any(not p.prefilled for p in self.pushes))
    @rule(data=st.data(), announced=st.booleans(), computed=st.integers(0, len(LAYERS)), pace=PACES)
    def p_prefills(self, data: st.DataObject, announced: bool, computed: int, pace: float) -> None:
        """P's prefill for a registered request finishes, or is announced before its forward."""
        push = data.draw(st.sampled_from([p for p in self.pushes if not p.prefilled]))
        self._prefill(data, push, "announced" if announced else "whole", computed, pace)
        self._settle()

    def _prefill(self, data: st.DataObject, push: Push, mode: str, computed: int, pace: float) -> None:
        """P's prefill finishes (whole), or is announced with its first ``computed`` layers done,
        its forward computing the next every ``pace`` seconds as time passes (0: only as
        ``p_computes_layers`` says): its lease is armed, and its blocks go to the matcher, which
        pairs them with D's registration."""
        n = len(push.d_blocks)
        free_ids = [i for i in P_IDS if self.p_live(i) is None]
        if len(self.p_free) < n or not free_ids:
            return
        push.p_id = data.draw(st.sampled_from(free_ids))
        self.serial += 1
        push.serial = self.serial
        push.p_blocks = tuple(sorted(self.p_free)[:n])
        self.p_free -= set(push.p_blocks)
        push.mode = mode
        push.lease_armed, push.lease_at = True, self.now + LEASE
        push.layers = computed if mode == "announced" else len(LAYERS)
        push.pace, push.next_layer_at = pace, self.now + pace
        for layer in range(push.layers):
            self._compute(push, layer)
        if mode == "announced":
            push.groups = self.groups
            ready = push.layers // self.per_group
            self.p.layers_ready(LayersReady(requests=((push.p_id, push.serial),), ready=ready, total=self.groups))
        if push.dropped:
            self._matcher_fails(push, "aborted by decode")
        else:
            self._pair(push)

    def _computing(self) -> list[Push]:
        return [p for p in self.pushes if p.mode == "announced" and p.outcome is None]

    @precondition(lambda self: bool(self._computing()))
    @rule(
        data=st.data(),
        upto=st.integers(0, len(LAYERS)),
        gap=st.sampled_from([0.0, TICK, 1.5]),
        fates=st.lists(st.booleans(), max_size=2),
    )
    def p_computes_layers(self, data: st.DataObject, upto: int, gap: float, fates: list[bool]) -> None:
        """The forward of an announced request goes on to layer ``upto``, each layer taking
        ``gap`` seconds, and the writer hears of each layer group done (of none new, when the
        forward is there already: a duplicate mark)."""
        push = data.draw(st.sampled_from(self._computing()))
        self.p.tap.fates.extend(fates)
        for layer in range(push.layers, max(upto, push.layers + 1)):
            self.time_passes(gap)
            if push.outcome is not None:
                break
            self._compute_upto(push, min(layer + 1, upto) if upto > push.layers else push.layers)
        self.p.tap.fates.clear()
        self._settle()

    def _compute_upto(self, push: Push, upto: int) -> None:
        for layer in range(push.layers, upto):
            self._compute(push, layer)
        before = push.layers // self.per_group
        push.layers = max(upto, push.layers)
        ready = push.layers // self.per_group
        posts = ready > before and (push.slot is None or ready == self.groups)  # a staged push waits for all
        if posts and self._open_on_p(push) and push.parts_left and self.now >= push.p_deadline:
            self._cut(push, "D's deadline passed before a layer's WRITE")
        self.p.layers_ready(LayersReady(requests=((push.p_id, push.serial),), ready=ready))
        self._see_gathers()

    def _pair(self, push: Push) -> None:
        """P's blocks meet D's registration: the matcher sends the writer the push."""
        push.paired = True
        msg = PostPush(
            request_id=push.p_id,
            block_ids=(push.p_blocks,),
            registration=push.registration,
            expected_targets=1,
            serial=push.serial,
            fresh_at=self.now,
            deadline=push.reg_deadline,
        )
        self._matcher_says(msg)

    def _matcher_says(self, msg: Any) -> None:
        self.from_matcher.append((self.now, msg))

    def _matcher_fails(self, push: Push, why: str) -> None:
        self._matcher_says(ExpireLease(request_id=push.p_id, reason=why, failed=True, serial=push.serial))

    # --- the matcher and the reaper --------------------------------------------------------------
    @precondition(lambda self: any(p.lease_armed for p in self.pushes))
    @rule(data=st.data())
    def lease_expires(self, data: st.DataObject) -> None:
        """P's reaper ends a lease early (as a shorter lease would)."""
        push = data.draw(st.sampled_from([p for p in self.pushes if p.lease_armed]))
        self._lease_fires(push)
        self._settle()

    def _lease_fires(self, push: Push) -> None:
        push.lease_armed = False
        self.from_reaper.append((self.now, ExpireLease(request_id=push.p_id, serial=push.serial)))

    @precondition(lambda self: bool(self.from_matcher or self.from_reaper))
    @rule(reaper=st.booleans(), n=st.integers(1, 4), fates=st.lists(st.booleans(), max_size=2))
    def writer_reads(self, reaper: bool, n: int, fates: list[bool]) -> None:
        """The writer handles the next ``n`` messages from the matcher (or the reaper)."""
        box = self.from_reaper if reaper else self.from_matcher
        self.p.tap.fates.extend(fates)
        for _ in range(min(n, len(box))):
            self._deliver(box.popleft()[1])
        self.p.tap.fates.clear()
        self._settle()

    def _deliver(self, msg: Any) -> None:
        if isinstance(msg, PostPush):
            push = self.incarnation(msg.request_id, msg.serial)
            push.delivered = True
            if self.now >= push.p_deadline:
                self._cut(push, "D's deadline passed before its first WRITE")
            self.p.post_push(msg)
        elif isinstance(msg, CancelPush):
            live = self.p_live(msg.request_id)
            if live is not None and live.d_id == msg.d_request_id:
                live.saw_abort = True
                self._cut(live, "D aborted")
            self.p.cancel(msg)
        elif isinstance(msg, ExpireLease):
            push = self.incarnation(msg.request_id, msg.serial)
            push.lease_over = True
            self._cut(push, msg.reason)
            self.p.expire(msg)
        elif isinstance(msg, RefuseRegistration):
            self.p.refuse(msg)
        elif isinstance(msg, Released):
            self.p.released(msg)
        else:  # pragma: no cover
            raise AssertionError(msg)
        self._see_gathers()

    @precondition(lambda self: any(p.prefilled and p.outcome is None for p in self.pushes))
    @rule(data=st.data(), how=st.sampled_from(["matcher", "expiry handler", "abort handler"]))
    def p_gives_up(self, data: st.DataObject, how: str) -> None:
        """P fails a request: the matcher fails its entry (P's engine aborted it, an ambiguity),
        told to the writer as a failed expiry; or a writer handler raised on an expiry (or an
        abort) about it, and it fails through its ordinary failure path."""
        push = data.draw(st.sampled_from([p for p in self.pushes if p.prefilled and p.outcome is None]))
        if how == "matcher":
            if not push.forgotten:
                self._matcher_fails(push, "failed on P")
        else:
            expiry = how == "expiry handler"
            if expiry or self._open_on_p(push):
                push.lease_over = True
                self._cut(push, "writer error")
            self.p.handler_failed(push.p_id, push.serial, expiry=expiry)
        self._settle()

    @precondition(lambda self: bool(self.gathers))
    @rule(n=st.integers(1, 3), fail=st.booleans(), fates=st.lists(st.booleans(), max_size=2))
    def stager_gathers(self, n: int, fail: bool, fates: list[bool]) -> None:
        """P's stager gathers the next ``n`` chunks of staged pushes into P's slot (the first
        fails when ``fail``) and the writer hears each."""
        self.p.tap.fates.extend(fates)
        for i in range(min(n, len(self.gathers))):
            gather = self.gathers.popleft()
            push = self.incarnation(gather.request_id, gather.serial)
            error = "gather failed: injected" if fail and i == 0 else ""
            reply = self.p.gather(gather, error=error)
            if self._open_on_p(push) and push.parts_left:
                if error:
                    self._cut(push, "gather failed")
                elif self.now >= push.p_deadline:
                    self._cut(push, "D's deadline passed before a chunk's WRITE")
            self.acting = push
            self.p.gathered(reply)
            self.acting = None
        self.p.tap.fates.clear()
        self._settle()

    @rule()
    def peers_turn(self) -> None:
        """The reaper and the matcher handle what the writer told them (a lease cleared, a
        request forgotten), and each tells the writer it released those requests."""
        for name, box in (("reaper", self.from_reaper), ("matcher", self.from_matcher)):
            told = self.p.desk.peers[name].told
            for msg in told[self.told_seen[name] :]:
                if not isinstance(msg, ClearLease | Forget):
                    continue
                push = next((p for p in self.pushes if p.p_id == msg.request_id and p.serial == msg.serial), None)
                if push is not None and name == "reaper":
                    push.lease_armed = False
                if push is not None and name == "matcher":
                    push.forgotten = True
                if msg.serial:
                    box.append((self.now, Released(requests=((msg.request_id, msg.serial),), by=name)))  # type: ignore[arg-type]
            self.told_seen[name] = len(told)
        self._settle()

    # --- NIXL ------------------------------------------------------------------------------------
    def _held(self) -> list[TappedWrite]:
        """WRITEs that may still end. None runs past its push's pinned_write_limit: the bound
        both sides assume (one NIXL would not release then may land later, the risk that bound
        leaves open); P releases such a WRITE."""
        return [w for p in self.pushes if not self._past_limit(p) for w in p.writes if w.running and not w.gate.is_open]

    def _past_limit(self, push: Push) -> bool:
        return push.first_post is not None and self.now - push.first_post >= PIN_LIMIT

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data(), whole_push=st.booleans(), poll=st.booleans())
    def writes_end(self, data: st.DataObject, whole_push: bool, poll: bool) -> None:
        """A held WRITE (or every held WRITE of its push) ends, DONE or ERR as drawn when it
        was posted: its bytes land when the fabric is next progressed. P may poll at once."""
        write = data.draw(st.sampled_from(self._held()))
        for w in write.owner.writes if whole_push else [write]:
            w.gate.open()
        if poll:
            self.p.poll()
        self._settle()

    @precondition(lambda self: self.refusals == 0)
    @rule()
    def nixl_refuses_a_release(self) -> None:
        """The next release of a running WRITE is refused by NIXL (it may still land)."""
        self.refusals = 1
        self.refused_before = self.p.ctx.metrics.get("write.release_refused")
        self.p.fabric.faults.refuse_cancel(times=1)

    # --- time ------------------------------------------------------------------------------------
    @rule(dt=st.sampled_from([TICK, 1.5, WRITE_TIMEOUT + TICK, PIN_LIMIT]), beats=st.booleans())
    def time_passes(self, dt: float, beats: bool = True) -> None:
        """Time goes on in ticks: the writer polls and keeps house each, the reaper fires leases
        due, mailboxes do not hold a message longer than MAX_WAIT, announced forwards go on at
        their pace, and D beats for what it waits for every HEARTBEAT seconds (``beats``; else
        those beats are lost)."""
        for _ in range(round(dt / TICK)):
            if beats and round((self.now - START) / TICK) % round(HEARTBEAT / TICK) == 0:
                for push in self.pushes:
                    if push.d_waits:
                        self._beat(push)
            for box in (self.from_matcher, self.from_reaper):
                while box and self.now - box[0][0] >= MAX_WAIT:
                    self._deliver(box.popleft()[1])
            self.clock.now += TICK
            for push in self.pushes:
                if push.lease_armed and self.now >= push.lease_at:
                    self._lease_fires(push)
            for push in self._computing():
                if push.pace and push.layers < len(LAYERS) and self.now >= push.next_layer_at:
                    push.next_layer_at += push.pace
                    self._compute_upto(push, push.layers + 1)
            for push in self.pushes:
                if push.first_post is not None and self.now - push.first_post > WRITE_TIMEOUT and self._open_on_p(push):
                    self._cut(push, "stuck")
            self.p.tick()
            self._settle()
            self._check_timers()

    # --- after every step ------------------------------------------------------------------------
    def _open_on_p(self, push: Push) -> bool:
        state = self.p.book.pushes.get(push.p_id)
        return push.delivered and state is not None and state.serial == push.serial

    def _cut(self, push: Push, why: str) -> None:
        """``push`` is stopped: if some part of it was not posted yet, it must never be reported
        pushed (rule 3)."""
        if push.outcome is None and push.parts_left and not push.cut:
            push.cut = why

    def _see_gathers(self) -> None:
        """The gathers the writer just asked of the stager (a staged push opened)."""
        told = self.p.desk.peers["stager"].told
        for gather in told[self.told_seen["stager"] :]:
            push = self.incarnation(gather.request_id, gather.serial)
            push.gathers += 1
            if push.first_post is None:
                push.first_post = self.now  # its gathers issued: P's timers run from here
            self.gathers.append(gather)
        self.told_seen["stager"] = len(told)

    def _settle(self) -> None:
        """D reads what P sent and reuses what it may; P's engine learns what ended."""
        self._see_gathers()
        for msg in self.p.d_notifs():
            self._d_reads(msg)
        for push in self.pushes:
            if push.d_freed:
                continue
            quarantined = push.aborted_at is not None and self.now >= push.aborted_at + QUARANTINE
            pin_over = push.pinned_at is None or self.now >= push.pinned_at + PIN_LIMIT
            if push.final is not None or (quarantined and pin_over):
                self._d_reuses(push)
        report = self.p.ctx.outbox.drain()
        for rid in sorted(report.finished_sending):
            self._p_engine_ends(rid, report.failed_sending.get(rid))

    def _d_reads(self, msg: Any) -> None:
        push = self.by_d(msg.request_id, msg.generation)
        assert push is not None, f"P answered a registration D never made: {msg}"
        final = isinstance(msg, Completion) or msg.final
        if not final:
            if push.pinned_at is None:
                push.pinned_at = self.now
            return
        key = (push.d_id, push.generation)
        self.finals[key] += 1
        if self.finals[key] > 1:
            self._bad(f"a second final word for {push.d_id}: {msg}")
        if push.running:
            self._bad(f"final word for {push.d_id} reached D while a WRITE of it runs")
        if isinstance(msg, Completion):
            if push.cut:
                self._bad(f"{push.d_id} reported landed though it was stopped ({push.cut})")
            if not push.d_freed:
                self._check_landed(push)
        if push.final is None:
            push.final = "landed" if isinstance(msg, Completion) else msg.reason

    def _check_landed(self, push: Push) -> None:
        if push.slot is not None:
            bases, _ = self.p.image(len(push.d_blocks))
            for li, base in enumerate(bases):
                for pos in range(len(push.d_blocks)):
                    at = push.slot * SLOT + base + pos * BLOCK
                    if not bool((self.p.d_staging[at : at + BLOCK] == stamp(push.uid, li, pos)).all()):
                        self._bad(f"{push.d_id} completed but its image lacks layer {li} block {pos}")
            return
        for li, t in enumerate(self.p.d_kv.values()):
            for pos, b in enumerate(push.d_blocks):
                if not bool((t[b] == stamp(push.uid, li, pos)).all()):
                    self._bad(f"{push.d_id} completed but D block {b} layer {li} lacks its KV")

    def _d_reuses(self, push: Push) -> None:
        push.d_freed = True
        for t in self.p.d_kv.values():
            for b in push.d_blocks:
                t[b].zero_()  # the next request's KV goes here
        self.d_free |= set(push.d_blocks)
        if push.slot is not None:
            self.p.d_staging[push.slot * SLOT : (push.slot + 1) * SLOT].zero_()
            self.slots_free.add(push.slot)

    def _p_engine_ends(self, rid: str, failure: str | None) -> None:
        push = self.p_live(rid)
        if push is None:
            self._bad(f"P's engine told {rid} ended, but it holds no such request (told twice?)")
            return
        push.outcome = "pushed" if failure is None else failure
        if push.running:
            self._bad(f"{rid} ended on P while a WRITE still reads its blocks")
        if failure is None and push.cut:
            self._bad(f"{rid} reported pushed on P though it was stopped ({push.cut})")
        if failure is None and push.final != "landed":
            self._bad(f"{rid} reported pushed on P but D never heard it landed")
        if failure is None and push.released_at_limit:
            self._bad(f"{rid} reported pushed on P though its WRITE was released at pinned_write_limit")
        for t in self.p.p_kv.values():
            for b in push.p_blocks:
                t[b].fill_(GARBAGE)  # the next request's forward overwrites them
        self.p_free |= set(push.p_blocks)

    def _check_timers(self) -> None:
        """After a housekeeping tick: a push in flight past write_timeout since its first WRITE
        has told D (rule 4); one past pinned_write_limit has ended."""
        for push in self.pushes:
            if push.first_post is None or push.outcome is not None or not self._open_on_p(push):
                continue
            age = self.now - push.first_post
            if age > WRITE_TIMEOUT and push.pinned_at is None and push.final is None and not push.d_freed:
                self._bad(f"{push.d_id} in flight {age:g}s after its first WRITE, D never told")
            if age >= PIN_LIMIT and not self.refusals:
                self._bad(f"{push.d_id} still in flight {age:g}s after its first WRITE (pinned_write_limit)")
        if self.refusals and self.p.ctx.metrics.get("write.release_refused") > self.refused_before:
            self.refusals = 0  # taken; retried on the next pass

    @invariant()
    def no_violation(self) -> None:
        assert not self.violations, "\n".join(self.violations)

    @invariant()
    def d_memory_holds_only_its_requests_kv(self) -> None:
        """Every byte in D's blocks is zero or the KV of the request D holds them for (rule 1)."""
        for li, t in enumerate(self.p.d_kv.values()):
            for b in range(NBLOCKS):
                if not bool(t[b].any()):
                    continue
                holder = self.d_holder(b)
                assert holder is not None, f"D block {b} (free) written: layer {li}"
                expected = stamp(holder.uid, li, holder.d_blocks.index(b))
                assert bool((t[b] == expected).all()), f"D block {b} of {holder.d_id} holds other bytes (layer {li})"
        for slot in range(SLOTS):
            image = self.p.d_staging[slot * SLOT : (slot + 1) * SLOT].clone()
            holder = next((p for p in self.pushes if p.slot == slot and not p.d_freed), None)
            if holder is not None:
                bases, _ = self.p.image(len(holder.d_blocks))
                for li, base in enumerate(bases):
                    for pos in range(len(holder.d_blocks)):
                        span = image[base + pos * BLOCK : base + (pos + 1) * BLOCK]
                        expected = stamp(holder.uid, li, pos)
                        ok = not bool(span.any()) or bool((span == expected).all())
                        assert ok, f"D's slot {slot} of {holder.d_id} holds other bytes (layer {li} block {pos})"
                        span.zero_()
            assert not bool(image.any()), f"D's slot {slot} written outside its holder's image: {holder}"

    @invariant()
    def every_release_at_the_limit_is_counted(self) -> None:
        released = sum(p.released_at_limit for p in self.pushes)
        assert self.p.ctx.metrics.get("write.released_at_pin_limit") == released

    @invariant()
    def blocks_are_owned_or_free(self) -> None:
        d_held = [b for p in self.pushes if not p.d_freed for b in p.d_blocks]
        p_held = [b for p in self.pushes if p.prefilled and p.outcome is None for b in p.p_blocks]
        for held, free in ((d_held, self.d_free), (p_held, self.p_free)):
            assert len(held) == len(set(held)) and not set(held) & free and set(held) | free == set(range(NBLOCKS))

    def teardown(self) -> None:
        """Drain: the forwards finish and every WRITE ends, then D aborts what it still waits
        for, the mailboxes and the stager empty and time passes. Everything has then ended,
        once, and nothing is left in flight."""
        self.refusals = 0
        self.p.fabric.faults.clear()
        for push in self._computing():
            self._compute_upto(push, len(LAYERS))
        self._drain(rounds=4)
        for push in self.pushes:
            if push.d_waits:
                push.aborted_at = self.now
                self._abort_reaches_p(push)
        self.late_aborts.clear()
        self._drain(rounds=80)
        for push in self.pushes:
            assert not push.prefilled or push.outcome is not None, f"{push.p_id} never ended on P"
            assert push.d_freed, f"D never got its blocks of {push.d_id} back"
            if push.delivered:
                key = (push.d_id, push.generation)
                assert self.finals[key] == 1, f"{push.d_id}: {self.finals}"
        for push in self.pushes:
            if push.delivered:
                event(f"{push.kind}: {'pushed' if push.outcome == 'pushed' else 'failed'}")
            if push.cut:
                event(f"stopped: {push.cut}")
            if push.pinned_at is not None:
                event("D told a WRITE may still land")
            if push.released_at_limit:
                event("released at pinned_write_limit")
        sizes = self.p.sizes()
        assert all(v == 0 for v in sizes.values()), sizes
        assert self.p.fabric.in_flight() == 0
        assert self.p.tap.inner.live_handles == 0
        assert self.d_free == set(range(NBLOCKS)) and self.p_free == set(range(NBLOCKS))
        assert self.slots_free == set(range(SLOTS)) and not bool(self.p.d_staging.any())
        assert not any(bool(t.any()) for t in self.p.d_kv.values())

    def _drain(self, rounds: int) -> None:
        """Every held WRITE ends, every message and gather is handled, a tick passes; again,
        until all is quiet (at most ``rounds`` ticks)."""
        for _ in range(rounds):
            for w in self._held():
                w.gate.open()
            while self.from_matcher or self.from_reaper or self.gathers:
                for box in (self.from_matcher, self.from_reaper):
                    while box:
                        self._deliver(box.popleft()[1])
                if self.gathers:
                    self.stager_gathers(len(self.gathers), False, [])
                self.peers_turn()
            self.time_passes(TICK)
            self.peers_turn()
            self.no_violation()
            self.d_memory_holds_only_its_requests_kv()
            if self._quiet():
                break

    def _quiet(self) -> bool:
        return (
            not self.from_matcher
            and not self.from_reaper
            and not self.gathers
            and all(p.d_freed and (not p.prefilled or p.outcome is not None) for p in self.pushes)
            and not any(p.lease_armed for p in self.pushes)
            and self.p.fabric.in_flight() == 0
        )


class PSideArmed(PSide):
    """The same, with a whole push started at the forward's end: announced, its one WRITE of
    every layer made ahead and posted once the last layer is computed."""

    config = ARMED


PSide.TestCase.settings = settings(
    max_examples=1500 if LONG else 60,
    stateful_step_count=60 if LONG else 40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PSideArmed.TestCase.settings = settings(PSide.TestCase.settings, max_examples=500 if LONG else 25)
TestPSide = PSide.TestCase
TestPSideArmed = PSideArmed.TestCase


def test_an_expiry_whose_handler_failed_ends_a_reused_id_despite_the_earlier_incarnations_tombstone() -> None:
    """Found by the model: incarnation 1 of ``pa`` ended (its tombstone is kept until the matcher
    and the reaper release it); incarnation 2's lease expires and the writer's handler of that
    expiry raises, so it is failed through ``on_handler_error`` before its push arrived. It must
    end on P's engine, and its push must never be posted. ``expire`` itself compares serials;
    ``fail_request`` only asks whether the id has a tombstone."""
    clock = VirtualClock()
    p = PRank(clock, **CONFIG)
    p.expire(ExpireLease(request_id="pa", serial=1))
    assert p.ctx.outbox.drain().failed_sending == {"pa": "lease_expired"}
    p.handler_failed("pa", 2, expiry=True)
    assert "pa" in p.ctx.outbox.drain().failed_sending, "incarnation 2 never ended on P"
    reg = registration("d-2", ((5,),))
    p.post_push(PostPush(request_id="pa", block_ids=((1,),), registration=reg, expected_targets=1, serial=2))
    assert p.fabric.stats.transfers_posted == 0, "a WRITE posted after the lease of its request ended"


@pytest.mark.parametrize("armed", [False, True], ids=["layerwise-stuck", "armed-whole-aborted"])
def test_a_chunked_push_stopped_after_its_last_write_was_posted_gives_d_one_final_word(armed: bool) -> None:
    """Found by the model. Layer-wise: two layer groups, group 0 lands, group 1's WRITE (which
    carries the completion, as group 0 landed) hangs past write_timeout and P judges the push
    stuck. Armed whole: the one WRITE of every layer, posted at the forward's end, is in flight
    when D's abort comes. Either way D hears it may still land, then the WRITE lands: D must hear
    one final word for the registration, and it must agree with P's engine."""
    clock = VirtualClock()
    p = PRank(clock, **(ARMED if armed else CONFIG))
    writes: list[TappedWrite] = []
    p.tap.on_posted = writes.append
    groups = 1 if armed else GROUPS
    p.layers_ready(LayersReady(requests=(("p-1", 1),), ready=groups - 1, total=groups))
    reg = registration("d-1", ((5,),))
    p.post_push(PostPush(request_id="p-1", block_ids=((1,),), registration=reg, expected_targets=1, serial=1))
    if not armed:
        writes[0].gate.open()
        p.poll()
    p.layers_ready(LayersReady(requests=(("p-1", 1),), ready=groups))  # the last WRITE goes
    assert len(writes) == groups
    if armed:
        p.cancel(CancelPush(request_id="p-1", d_request_id="d-1", decode_tp_rank=0))
    while not armed and clock.now - writes[0].at <= WRITE_TIMEOUT:
        clock.now += TICK
        p.tick()
    assert [(type(m).__name__, m.final) for m in p.d_notifs()] == [("PushFailure", False)]  # may still land
    writes[-1].gate.open()
    p.poll()
    finals = [m for m in p.d_notifs() if isinstance(m, Completion) or m.final]
    pushed = not p.ctx.outbox.drain().failed_sending
    assert len(finals) == 1, f"D heard {finals}"
    assert isinstance(finals[0], Completion) == pushed, f"D heard {finals[0]}, P's engine pushed={pushed}"
