"""A stateful model of D's side: the engine, the reaper's registry behind its mailbox, the
writer's own takes of completions (core/claims.py), P's WRITEs and D's blocks.

Hypothesis interleaves stagings, re-stages, aborts, P's WRITEs landing, completions (current,
old generation, duplicated, replayed, forged), P's failures and "may still land" answers,
heartbeats, P's death, the reaper's turns (any number of messages may wait in its mailbox:
a slow or busy reaper) and time. After every step it checks:

* a request is never reported landed unless the blocks it staged last hold its KV, written
  for its live registration;
* every request ends exactly once (checked again after everything drained);
* a block is freed exactly once, and only blocks the engine allocated.

The model's P honours P's side of the protocol: it writes a registration's blocks only while
D still holds that request (the writer's deadline checks and D's quarantine are what make that
true in the code; the P-side model covers them). Everything else is adversarial.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pushactors.core.claims import CompletionClaims
from pushactors.core.ledger import DRegistry, DResult, Report, SendAbort, SendRegistration
from pushactors.protocol import AbortRecv, PeerKey, Registration, WatchRecv

P0 = PeerKey("prefill", "h", 1, 0, 0)
STRANGER = PeerKey("mallory", "m", 9, 0, 0)
IDS = ("r0", "r1", "r2")
BLOCKS = 12
QUARANTINE = 5.0
PINNED_LIMIT = 20.0  # as pinned_write_limit bounds a WRITE P says may still land
LONG = os.environ.get("PUSHACTORS_LONG") == "1"


@dataclass
class Incarnation:
    """One request on the engine, from its first staging until it is reported."""

    stagings: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (generation, blocks)

    @property
    def blocks(self) -> set[int]:
        return {b for _, blocks in self.stagings for b in blocks}


@dataclass(frozen=True)
class Notified:
    """A completion or push failure in the reaper's mailbox (RecvNotified, as plain data)."""

    request_id: str
    ok: bool
    peer: PeerKey
    generation: int
    final: bool = True
    taken: bool = False


class DSide(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.registry = DRegistry(quarantine=QUARANTINE, pinned_limit=PINNED_LIMIT, reuse_wait=5.0)
        self.claims = CompletionClaims()
        self.claims.attach(self.registry)
        self.mailbox: deque[Any] = deque()  # the reaper's, in order
        self.free: set[int] = set(range(BLOCKS))
        self.memory: dict[int, tuple[str, int] | None] = dict.fromkeys(range(BLOCKS))  # block -> (id, generation)
        self.live: dict[str, Incarnation] = {}
        self.generation = 0
        self.reports: list[tuple[str, str | None]] = []
        self.p_regs: dict[tuple[str, int], Registration] = {}  # registrations P holds, by (id, generation)
        self.p_aborted: set[tuple[str, int]] = set()
        self.delivered: list[Notified] = []  # every completion D's agent has seen
        self.overruled: set[str] = set()  # re-staged after the registry ended them
        self.outbox: list[tuple[str, str | None, str]] = []  # (id, failure or None, by whom)

    # --- the engine ------------------------------------------------------------------------------
    @rule(rid=st.sampled_from(IDS), n=st.integers(1, 3), deadline=st.sampled_from([3.0, 30.0]))
    def stage(self, rid: str, n: int, deadline: float) -> None:
        """A staging, or a re-stage of a live request with new blocks."""
        if len(self.free) < n:
            return
        blocks = tuple(sorted(self.free)[:n])
        self.free -= set(blocks)
        self.generation += 1
        self.live.setdefault(rid, Incarnation()).stagings.append((self.generation, blocks))
        reg = Registration(
            request_id=rid,
            decode_engine_id="decode",
            decode_host="d",
            decode_port=2,
            decode_tp_size=1,
            local_block_ids=(blocks,),
            remote_engine_id=P0.engine_id,
            remote_host=P0.host,
            remote_port=P0.port,
            remote_tp_size=1,
            generation=self.generation,
        )
        msg = WatchRecv(
            request_id=rid,
            expected=1,
            deadline=self.now + deadline,
            registration=reg,
            peers=(P0,),
            heartbeat_id=rid,
            nbytes=n,
        )
        # As the worker does: announced before the reaper is told; a re-stage of a request the
        # registry has ended already is not sent, and its report is taken as a failure.
        if self.claims.announce(rid, live=len(self.live[rid].stagings) > 1):
            self.mailbox.append(msg)
        else:
            self.overruled.add(rid)

    @rule(rid=st.sampled_from(IDS))
    def abort(self, rid: str) -> None:
        if rid not in self.live:
            return
        self.claims.announce(rid)
        self.mailbox.append(AbortRecv(request_id=rid))

    def _report(self, rid: str, reason: str | None, *, by: str) -> None:
        """The transport ends ``rid``: into the outbox the engine drains on its next step. P
        holds D's blocks no longer for it (P's side of the protocol)."""
        assert not any(r == rid for r, _, _ in self.outbox), f"{rid} reported twice (by the {by})"
        self.outbox.append((rid, reason, by))
        for key in [k for k in self.p_regs if k[0] == rid]:
            del self.p_regs[key]

    @precondition(lambda self: bool(self.outbox))
    @rule()
    def engine_drains(self) -> None:
        """The engine's get_finished: it learns what ended and frees those blocks."""
        outbox, self.outbox = self.outbox, []
        for rid, reason, by in outbox:
            inc = self.live.pop(rid, None)
            assert inc is not None, f"{rid} reported by the {by} but not live (reported twice?)"
            if rid in self.overruled:
                self.overruled.discard(rid)
                reason = reason or "re-staged after its push had ended"
            if reason is None:
                generation, blocks = inc.stagings[-1]
                assert len(inc.stagings) == 1, f"{rid} landed though it was re-staged"
                for b in blocks:
                    assert self.memory[b] == (rid, generation), f"{rid} landed; block {b} holds {self.memory[b]}"
            self.reports.append((rid, reason))
            for b in inc.blocks:
                assert b not in self.free, f"block {b} freed twice"
                self.free.add(b)
                self.memory[b] = None  # the engine's next request overwrites it

    # --- the reaper ------------------------------------------------------------------------------
    def _apply(self, result: DResult, reported: str | None = None) -> None:
        for action in result.actions:
            if isinstance(action, SendRegistration):
                reg = action.registration
                self.p_regs[(reg.request_id, reg.generation)] = reg
            elif isinstance(action, SendAbort):
                reg = action.ledger.watch.registration
                self.p_aborted.add((reg.request_id, reg.generation))
            elif isinstance(action, Report):
                if action.request_id == reported:
                    assert action.reason is None, "a taken request failed afterwards"
                    continue
                self._report(action.request_id, action.reason, by="reaper")

    def _decide(self, decide: Any, applies: str | None = None) -> None:
        with self.claims.owned(self.now, applies=applies) as absorbed:
            result = decide(self.registry)
        for rid, taken in absorbed:
            self._apply(taken, reported=rid)
        if result is not None:
            self._apply(result)

    @precondition(lambda self: bool(self.mailbox))
    @rule(n=st.integers(1, 4))
    def reaper_turns(self, n: int) -> None:
        """The reaper handles the next ``n`` messages of its mailbox."""
        for _ in range(min(n, len(self.mailbox))):
            msg = self.mailbox.popleft()
            if isinstance(msg, WatchRecv):
                self._decide(lambda r, m=msg: r.watch(m, self.now), applies=msg.request_id)
            elif isinstance(msg, AbortRecv):
                rid = msg.request_id
                self._decide(lambda r, rid=rid: r.abort(rid, "aborted by engine", self.now), applies=rid)
            elif isinstance(msg, Notified) and msg.taken:
                self._decide(lambda r: None)
            elif isinstance(msg, Notified):
                self._decide(
                    lambda r, m=msg: r.notified(
                        m.request_id,
                        ok=m.ok,
                        peer=m.peer,
                        final=m.final,
                        reason="p said",
                        now=self.now,
                        generation=m.generation,
                    )
                )
            elif msg == "peer_dead":
                self._decide(lambda r: r.peer_dead(P0, "prefill-pp0-tp0", "side channel refused"))

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._decide(lambda r: r.due(self.now))

    @rule()
    def heartbeat(self) -> None:
        self._decide(lambda r: (r.heartbeat_groups(), None)[1])  # reads only: nothing to carry out

    # --- P and the wire --------------------------------------------------------------------------
    def _deliver(self, notif: Notified) -> None:
        """D's writer reads a notification: takes a completion that alone lands its request,
        else hands it to the reaper."""
        self.delivered.append(notif)
        take = self.claims.try_take
        if notif.ok and notif.final and take(notif.request_id, peer=notif.peer, generation=notif.generation):
            self._report(notif.request_id, None, by="writer")
            notif = Notified(notif.request_id, True, notif.peer, notif.generation, taken=True)
        self.mailbox.append(notif)

    @precondition(lambda self: bool(self.p_regs))
    @rule(data=st.data())
    def p_writes(self, data: st.DataObject) -> None:
        """One of P's WRITEs lands (in the blocks its registration names) and its completion
        reaches D."""
        key = data.draw(st.sampled_from(sorted(self.p_regs)))
        reg = self.p_regs.pop(key)
        for b in reg.local_block_ids[0]:
            self.memory[b] = (reg.request_id, reg.generation)
        self._deliver(Notified(reg.request_id, True, P0, reg.generation))

    @precondition(lambda self: bool(self.p_regs))
    @rule(data=st.data(), final=st.booleans())
    def p_refuses(self, data: st.DataObject, final: bool) -> None:
        """P answers with a push failure (final), or says its WRITE may still land."""
        key = data.draw(st.sampled_from(sorted(self.p_regs)))
        if final:
            del self.p_regs[key]
        self._deliver(Notified(key[0], False, P0, key[1], final=final))

    @precondition(lambda self: bool(self.delivered))
    @rule(data=st.data())
    def replayed(self, data: st.DataObject) -> None:
        """A completion seen before comes again (duplicated, late, or replayed by an attacker)."""
        old = data.draw(st.sampled_from(self.delivered))
        self._deliver(Notified(old.request_id, old.ok, old.peer, old.generation, final=old.final))

    @rule(rid=st.sampled_from(IDS), generation=st.integers(0, 8), ok=st.booleans())
    def forged(self, rid: str, generation: int, ok: bool) -> None:
        """A completion or failure no WRITE came with, from an agent that is not the request's
        P rank (the writer names the verified rank of every sender; P's own word is trusted)."""
        self._deliver(Notified(rid, ok, STRANGER, generation))

    @rule()
    def p_dies(self) -> None:
        """P's process dies (its WRITEs never land); D learns it for sure, later, as a message."""
        self.p_regs.clear()
        self.mailbox.append("peer_dead")

    # --- the checks ------------------------------------------------------------------------------
    @invariant()
    def blocks_are_owned_or_free(self) -> None:
        held = [b for inc in self.live.values() for b in inc.blocks]
        assert len(held) == len(set(held)), "a block held by two requests"
        assert not (set(held) & self.free), "a block both free and held"
        assert set(held) | self.free == set(range(BLOCKS)), "a block lost"

    def teardown(self) -> None:
        """Drain: P answers everything it holds, the reaper empties its mailbox, time passes
        every deadline. Every request has then ended, exactly once."""
        for key in sorted(self.p_regs):
            self._deliver(Notified(key[0], False, P0, key[1]))
        self.p_regs.clear()
        for _ in range(50):
            while self.mailbox:
                self.reaper_turns(len(self.mailbox))
            self.tick(QUARANTINE + 1.0)
            if self.outbox:
                self.engine_drains()
            if not self.live and not self.mailbox:
                break
        assert not self.live, f"never ended: {sorted(self.live)}"
        assert self.claims.pending() == 0 and self.claims.unapplied() == 0
        assert self.registry.sizes() == {"recvs": 0, "recv_tids": 0, "recv_waiting": 0}
        assert self.free == set(range(BLOCKS))


DSide.TestCase.settings = settings(
    max_examples=1500 if LONG else 120,
    stateful_step_count=60 if LONG else 35,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDSide = DSide.TestCase
