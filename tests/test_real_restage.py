"""REAL: a re-stage seen through a stale registry (P a node process, D this test's own process;
real NIXL over UCX on DRAM, the real ZMQ side channel).

D's engine stages request X on blocks A, and P's WRITE into A runs; its completion has not
reached D's writer yet (held at D's agent: for D the WRITE is still in flight). The engine then
stages X again on blocks B while D's reaper is busy (its turn held), so the re-stage waits in the
reaper's mailbox. Now the completion reaches D's writer. Judged on the reaper's registry, which
still says A, it would land X; but B holds nothing of X's KV. X must never be reported landed
unless B holds exactly P's KV for it (else it fails), it is reported once, and nothing else in
D's memory changes.

D runs here, not in a node process: holding one of its actors' turns needs its
``ActorFaults``, which a node process does not offer to its parent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from nodes_kit import Cluster, Recorder, ids, kv_bytes, ready, settled_blocks

from pushactors.core.config import PushConfig
from pushactors.protocol import WatchRecv
from pushactors.testing import FaultPlan, SimEngine, SimSpec, completion_of, wait_until
from pushactors.testing.faults import FaultyAgent
from pushactors.transport.nixl import agent_factory_from_config
from pushactors.transport.sidechannel import SideChannelClient, SideChannelServer

pytestmark = pytest.mark.real_nixl

SPEC = SimSpec(num_layers=2, num_blocks=16, shuffle_blocks=False)
FIRST = [3, 4, 5]  # where X is staged first, and where P writes
SECOND = [9, 10, 11]  # where the engine stages X again
TOKENS = len(FIRST) * SPEC.block_size
# Long leases and watchdogs: nothing here may end X but its completion and the re-stage.
CONFIG: dict[str, Any] = {"lease_duration": 30.0, "registration_timeout": 30.0, "reaper_tick": 0.02}
# The completion is due this far ahead at D's agent: only the test's move of the agent's clock
# delivers it (no race with the re-stage, however loaded the machine).
HELD = 3600.0
# After D's writer read the completion: long enough for its own take and report to show.
GRACE = 0.5


class AgentClock:
    """The clock of D's agents, which the test moves ahead to deliver a held notification."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead

    def deliver_held(self) -> None:
        self.ahead += HELD


class LocalDecode:
    """D: a SimEngine in this process with real NIXL agents (each behind a FaultyAgent on
    :class:`AgentClock`) and a real side channel, stepped by the test."""

    def __init__(self) -> None:
        self.config = PushConfig(engine_id="decode-0", role="consumer", **CONFIG)
        self.plan = FaultPlan()
        self.clock = AgentClock()
        self.agents: list[FaultyAgent] = []
        real = agent_factory_from_config(self.config)

        def agent(name: str) -> FaultyAgent:
            made = FaultyAgent(real(name), self.plan, clock=self.clock)
            self.agents.append(made)
            return made

        self.server = SideChannelServer("127.0.0.1", 0, engine_id=self.config.engine_id)
        try:
            self.engine = SimEngine(
                self.config,
                agent_factory=agent,
                source=SideChannelClient(),
                publisher_for_rank=lambda _r: self.server,
                spec=SPEC,
                seed=1,
            )
        except BaseException:
            self.server.close()
            raise

    def held_notifs(self) -> int:
        return sum(a.injected.get("delay_notif", 0) for a in self.agents)

    def stat(self, name: str) -> int:
        return sum(w.stats().get(name, 0) for w in self.engine.workers)

    def pump(self, until: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        """Step D (as an engine loop does, about every millisecond) until ``until()`` holds."""

        def stepped() -> bool:
            self.engine.step()
            return until()

        wait_until(stepped, timeout=timeout, interval=0.001, what=what)

    def memory(self) -> list[torch.Tensor]:
        return [t.clone() for kv in self.engine.kv for t in kv.values()]

    def close(self) -> None:
        for w in self.engine.workers:
            w.ctx.faults.clear()  # a held actor turn (a test that failed) must not stall shutdown
        try:
            self.engine.shutdown(10.0)
        finally:
            self.server.close()

    def __enter__(self) -> LocalDecode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def changed_blocks(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    """Block ids whose bytes differ in any layer, K or V ("split" layout: [2, blocks, bytes])."""
    return {
        b
        for x, y in zip(before, after, strict=True)
        for b in range(SPEC.num_blocks)
        if not torch.equal(x[:, b], y[:, b])
    }


def test_real_a_completion_landing_while_a_re_stage_waits_in_ds_reaper_never_lands_the_new_blocks(
    rec: Recorder, cluster: Cluster
) -> None:
    """X is never reported landed on the first blocks' completion once the engine re-staged it
    (the module's docstring tells the whole scenario)."""
    p = cluster.start("prefill", "prefill-0", SPEC, CONFIG)  # boots while D is built here
    with LocalDecode() as d:
        engine = d.engine
        ready(p)
        base, p_id, d_id = ids("restage", 0)
        blank = d.memory()

        d.plan.delay_notif(HELD, completion_of(d_id), times=1)
        engine.expect(d_id, TOKENS, p.decode_params(base), key=base, blocks=FIRST)
        d.pump(lambda: p.stats()["pending_registrations"] == 1, "P to hold D's registration")
        p.prefill(p_id, TOKENS, key=base, wait=True)
        d.pump(lambda: p_id in rec.sent and d.held_notifs() == 1, "P's WRITE done, its completion held at D")
        assert rec.sent[p_id].why is None, f"P failed its push: {rec.sent[p_id].why}"
        assert d_id not in engine.received
        assert engine.verify(d_id) == (kv_bytes(len(FIRST), SPEC), 0), "P's WRITE did not land in the first blocks"
        written = d.memory()
        assert changed_blocks(blank, written) == set(FIRST)

        # The re-stage: announced and handed to the reaper by this step, where it waits.
        busy = engine.workers[0].ctx.faults.hold_handler("reaper", WatchRecv, match=lambda m: m.request_id == d_id)
        engine.expect(d_id, TOKENS, p.decode_params(base), key=base, blocks=SECOND)
        engine.step()
        assert d.stat("notif.kind.completion") == 0, "the completion reached D's writer before the re-stage"
        d.clock.deliver_held()
        d.pump(lambda: d.stat("notif.kind.completion") == 1, "D's writer to read the completion")
        grace_over = time.monotonic() + GRACE
        # A report now could only be the writer's own (the reaper has not had its turn yet).
        d.pump(lambda: d_id in engine.received or time.monotonic() > grace_over, "a report or the end of the grace")
        early = d_id in engine.received
        busy.set()
        d.pump(lambda: d_id in engine.received, "D's report of X", timeout=10.0)

        why = engine.received[d_id]
        final = d.memory()
        if why is None:
            checked, wrong = engine.verify(d_id)
            assert (checked, wrong) == (kv_bytes(len(SECOND), SPEC), 0), (
                f"X reported landed ({'before' if early else 'after'} the reaper applied its re-stage) while its "
                f"blocks {SECOND} hold {wrong} of {checked} bytes wrong: its KV is in {FIRST}"
            )
            assert changed_blocks(written, final) == set(SECOND)
        else:
            assert "re-staged" in why, why
            assert changed_blocks(written, final) == set(), "D's memory changed after P's only WRITE"
        # One report (per rank), so the engine frees each block of X once: both stagings' now.
        assert [r.failure for r in engine.reports_of(d_id, "recv")] == [why]
        assert engine.duplicate_reports == 0
        engine.finish_recv(d_id)
        engine.release(FIRST)
        d.pump(lambda: not engine.has_pending_push_work(), "D's registry to empty")
        assert engine.free_blocks == SPEC.num_blocks and engine.duplicate_reports == 0
        assert all(w.healthy for w in engine.workers)
        p_final = settled_blocks(p, 10.0)
        assert p_final["free_blocks"] == SPEC.num_blocks and p_final["healthy"]
        print(f"REAL-RESTAGE {d_id}: {why or 'landed'}; taken by D's writer: {d.stat('recv.taken')}", flush=True)
