"""Thread-free tests of the writer's takes of D completions (``pushactors.core.claims``).

The writer may report a completion itself only when that completion alone lands its request;
the reaper, holding the registry, counts every take before it decides anything else. These
tests drive both sides from one thread: the lock is the only thing shared."""

from __future__ import annotations

import msgspec
import pytest
from test_ledger import P0, P1, STRANGER, reports, watch

from pushactors.core.claims import CompletionClaims
from pushactors.core.ledger import DRegistry
from pushactors.protocol import WatchRecv


def registry() -> tuple[DRegistry, CompletionClaims]:
    d = DRegistry(quarantine=5.0, reuse_wait=5.0)
    claims = CompletionClaims()
    claims.attach(d)
    return d, claims


def test_the_completion_that_alone_lands_a_request_is_taken_once_and_absorbed_as_landed() -> None:
    d, claims = registry()
    d.watch(watch(), now=0.0)
    assert claims.try_take("d-1", peer=P0, generation=0)
    assert not claims.try_take("d-1", peer=P0, generation=0)  # a duplicate speaks for nobody
    assert claims.pending() == 1
    assert "d-1" in d.ledgers  # the registry is the reaper's: nothing changed until it absorbs
    with claims.owned(now=1.0) as absorbed:
        assert [rid for rid, _ in absorbed] == ["d-1"]
        assert reports(absorbed[0][1]) == [("d-1", None)]
    assert claims.pending() == 0
    assert d.sizes() == {"recvs": 0, "recv_tids": 0, "recv_waiting": 0}
    assert not claims.try_take("d-1", peer=P0, generation=0)  # settled: a replay is not taken


def _with_generation(w: WatchRecv, generation: int) -> WatchRecv:
    return msgspec.structs.replace(w, registration=msgspec.structs.replace(w.registration, generation=generation))


@pytest.mark.parametrize(
    "case",
    ["unknown-request", "unverified-sender", "stranger", "other-generation", "two-p-ranks", "staged", "aborted"],
)
def test_a_completion_that_does_not_alone_land_its_request_is_left_to_the_reaper(case: str) -> None:
    d, claims = registry()
    w = watch(ranks=2) if case == "two-p-ranks" else watch(slot=(0, 2)) if case == "staged" else watch()
    d.watch(_with_generation(w, 3), now=0.0)
    if case == "aborted":
        d.abort("d-1", "aborted by engine", now=0.5)
    rid, peer, generation = "d-1", P0, 3
    if case == "unknown-request":
        rid = "d-2"
    elif case == "unverified-sender":
        peer = None  # type: ignore[assignment]
    elif case == "stranger":
        peer = STRANGER
    elif case == "other-generation":
        generation = 2  # a late answer to an earlier registration of this id
    assert not claims.try_take(rid, peer=peer, generation=generation)
    assert claims.pending() == 0
    with claims.owned(now=1.0) as absorbed:
        assert absorbed == []
    assert "d-1" in d.ledgers  # still the reaper's to decide


def test_nothing_is_taken_while_the_reaper_holds_the_registry() -> None:
    """The writer never waits for the lock: while it is held the completion goes the ordinary
    way (a message), so no take is judged against a registry being changed."""
    d, claims = registry()
    d.watch(watch(), now=0.0)
    with claims.owned(now=0.0):
        assert not claims.try_take("d-1", peer=P0, generation=0)
    assert claims.try_take("d-1", peer=P0, generation=0)


def test_a_take_is_counted_before_an_abort_or_a_watchdog_that_comes_after_it() -> None:
    """The completion came first: the abort finds the request landed, the watchdog finds
    nothing to time out; the request is reported once, as landed."""
    d, claims = registry()
    d.watch(watch(deadline=10.0), now=0.0)
    assert claims.try_take("d-1", peer=P0, generation=0)
    with claims.owned(now=1.0) as absorbed:
        aborted = d.abort("d-1", "aborted by engine", now=1.0)
    assert [reports(r) for _, r in absorbed] == [[("d-1", None)]]
    assert aborted.event == "recv.abort_unknown" and reports(aborted) == []
    d.watch(watch("d-2", deadline=10.0), now=0.0)
    assert claims.try_take("d-2", peer=P0, generation=0)
    with claims.owned(now=11.0) as absorbed:
        timed = d.due(now=11.0)
    assert [reports(r) for _, r in absorbed] == [[("d-2", None)]]
    assert timed.timed_out == [] and reports(timed) == []


def test_a_taken_request_ends_its_transfer_id_for_the_request_waiting_on_it() -> None:
    """A second request under the same transfer id waits for the first; the first landing
    (taken by the writer) spends the id, so the second fails when the take is absorbed, in
    the absorbed result's actions (which the reaper carries out)."""
    d, claims = registry()
    d.watch(watch("d-1", tid="tx"), now=0.0)
    assert d.watch(watch("d-2", blocks=(3, 4), tid="tx"), now=0.1).event == "recv.deferred"
    assert claims.try_take("d-1", peer=P0, generation=0)
    with claims.owned(now=0.2) as absorbed:
        pass
    ((rid, result),) = absorbed
    assert rid == "d-1"
    got = reports(result)
    assert got[0] == ("d-1", None)
    assert got[1][0] == "d-2" and "transfer id 'tx'" in (got[1][1] or "")


def test_one_p_rank_of_two_is_never_taken_even_after_the_other_answered() -> None:
    """Counting several answers is the registry's job: the writer takes only a lone one."""
    d, claims = registry()
    d.watch(watch(ranks=2), now=0.0)
    d.notified("d-1", ok=True, peer=P0, final=True, reason="", now=0.0)
    assert not claims.try_take("d-1", peer=P1, generation=0)
    assert reports(d.notified("d-1", ok=True, peer=P1, final=True, reason="", now=0.0)) == [("d-1", None)]


def test_what_was_absorbed_stays_the_owners_even_when_its_decision_raises() -> None:
    """The reaper carries out the absorbed results after its turn, also when the decision in
    it raised (an actor's handler error): a take is absorbed once, never lost."""
    d, claims = registry()
    d.watch(watch("d-1", tid="tx"), now=0.0)
    d.watch(watch("d-2", blocks=(3, 4), tid="tx"), now=0.1)  # waits for d-1's transfer id
    assert claims.try_take("d-1", peer=P0, generation=0)
    held: list[tuple[str, object]] = []
    with pytest.raises(RuntimeError), claims.owned(now=0.2) as absorbed:
        held = absorbed  # type: ignore[assignment]
        raise RuntimeError("the decision failed")
    assert [rid for rid, _ in held] == ["d-1"]
    assert claims.pending() == 0  # absorbed once: the next turn finds nothing
    with claims.owned(now=0.3) as again:
        assert again == []


def test_no_completion_is_taken_while_the_engine_has_said_more_than_the_registry_knows() -> None:
    """A re-stage (or an abort) the engine announced and the reaper has not applied: the
    writer takes nothing for that request; once applied (in the reaper's hold), the re-stage
    fails it, and a request with nothing announced is taken as before."""
    d, claims = registry()
    d.watch(watch(), now=0.0)
    d.watch(watch("d-2"), now=0.0)
    claims.announce("d-1")  # the engine re-stages d-1: still in the reaper's mailbox
    assert not claims.try_take("d-1", peer=P0, generation=0)
    assert claims.try_take("d-2", peer=P0, generation=0)  # others are not held up
    assert claims.unapplied() == 1
    restaged = msgspec.structs.replace(watch(blocks=(7, 8)), registration=msgspec.structs.replace(
        watch(blocks=(7, 8)).registration, generation=1))  # fmt: skip
    with claims.owned(now=0.5, applies="d-1") as absorbed:
        assert claims.unapplied() == 0  # counted applied first, in the same hold
        result = d.watch(restaged, now=0.5)
    assert [rid for rid, _ in absorbed] == ["d-2"]
    assert result.event == "recv.restaged" and "d-1" in d.ledgers  # failed, quarantined, not landed


def test_a_report_waits_for_the_engines_announced_messages_about_its_request() -> None:
    """The registry itself never reports a request while the engine has said more about it:
    a completion handled before the re-stage it raced lands nothing; the re-stage then fails
    the request (its current blocks never got the KV)."""
    d, claims = registry()
    d.watch(watch(), now=0.0)
    claims.announce("d-1")  # re-staged by the engine, not applied yet
    with claims.owned(now=0.1):
        landed = d.notified("d-1", ok=True, peer=P0, final=True, reason="", now=0.1)
    assert reports(landed) == [] and landed.counters == ["recv.report_deferred"]
    restaged = msgspec.structs.replace(watch(blocks=(7, 8)), registration=msgspec.structs.replace(
        watch(blocks=(7, 8)).registration, generation=1))  # fmt: skip
    with claims.owned(now=0.2, applies="d-1"):
        result = d.watch(restaged, now=0.2)
    assert [(rid, "re-staged" in (why or "")) for rid, why in reports(result)] == [("d-1", True)]
    assert d.sizes()["recvs"] == 0
