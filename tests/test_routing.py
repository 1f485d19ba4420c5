"""EnginePool (pushactors.routing): choosing, health, draining and bookkeeping, without I/O."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from pushactors.routing import Engine, EnginePool, PrefillIdentity


def pool(n: int = 3, **kw: object) -> EnginePool:
    return EnginePool([Engine(name=f"e{i}", url=f"http://e{i}", role="decode") for i in range(n)], **kw)  # type: ignore[arg-type]


def test_least_outstanding_picks_the_lightest_and_shares_ties_round_robin() -> None:
    p = pool(3)
    picked = [p.pick() for _ in range(6)]
    assert all(picked) and [e.outstanding for e in p.engines] == [2, 2, 2]
    e0, e1 = p.engines[0], p.engines[1]
    p.release(e1, ok=True)
    p.release(e1, ok=True)
    assert p.pick() is e1  # the only one with nothing in flight
    p.release(e0, ok=True)
    p.release(e0, ok=True)
    assert p.pick() is e0  # nothing in flight against 1 and 2
    # At low load (one at a time) ties rotate: equal engines share evenly.
    q = pool(3)
    counts: Counter[str] = Counter()
    for _ in range(30):
        e = q.pick()
        assert e is not None
        counts[e.name] += 1
        q.release(e, ok=True)
    assert counts == {"e0": 10, "e1": 10, "e2": 10}


def test_prefix_affinity_is_sticky_and_falls_back_when_the_preferred_engine_is_loaded() -> None:
    p = pool(4, policy="prefix_affinity", affinity_slack=2)
    first = p.pick("shared prefix")
    assert first is not None
    assert all(p.pick("shared prefix") is first for _ in range(2))  # 1, then 2 more than the others: within slack
    # first now carries 3, the others 0: beyond the slack of 2, so the key goes elsewhere.
    other = p.pick("shared prefix")
    assert other is not None and other is not first
    # Keys spread over engines (rendezvous hashing), and a key's choice is stable across pools.
    q = pool(4, policy="prefix_affinity")
    homes = set()
    for i in range(40):
        e = q.pick(f"key-{i}")
        assert e is not None
        homes.add(e.name)
        q.release(e, ok=True)
        assert pool(4, policy="prefix_affinity").pick(f"key-{i}").name == e.name  # type: ignore[union-attr]
    assert len(homes) == 4
    # Without a key, affinity is least outstanding.
    assert q.pick(None) is not None


def test_rendezvous_moves_only_the_keys_of_a_removed_engine() -> None:
    full = pool(4, policy="prefix_affinity")

    def home(key: str, exclude: list[Engine]) -> str:
        e = full.pick(key, exclude=exclude)
        assert e is not None
        full.release(e, ok=True)
        return e.name

    before = {f"k{i}": home(f"k{i}", []) for i in range(200)}
    gone = full.engines[2]
    after = {k: home(k, [gone]) for k in before}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k, v in before.items() if v == gone.name} and moved


def test_health_threshold_takes_out_and_one_success_brings_back() -> None:
    p = pool(2, failure_threshold=2)
    e0, e1 = p.engines
    assert not p.health(e0, False, "refused")
    assert e0.up and e0.consecutive_failures == 1
    assert p.health(e0, False, "refused")  # changed state
    assert not e0.up and e0.last_error == "refused"
    assert all(p.pick() is e1 for _ in range(3))
    assert p.health(e0, True)
    assert e0.up and e0.consecutive_failures == 0
    assert not p.health(e0, True)


def test_request_failures_count_only_for_transport_reasons() -> None:
    p = pool(1, failure_threshold=2)
    (e,) = p.engines
    for _ in range(5):
        p.pick()
        p.release(e, ok=False, error="400 prompt too long")  # the request's fault
    assert e.up and e.failed == 5 and e.consecutive_failures == 0
    p.pick()
    p.release(e, ok=False, error="connection refused", transport=True)
    p.pick()
    p.release(e, ok=True)  # a success in between resets the count
    assert e.consecutive_failures == 0
    for _ in range(2):
        p.pick()
        p.release(e, ok=False, error="connection reset", transport=True)
    assert not e.up and e.outstanding == 0 and e.last_error == "connection reset"
    # Every engine down: picks go on (panic mode), and a success brings the engine back.
    assert p.pick() is e and p.panics == 1
    p.release(e, ok=True)
    assert e.up and p.pick() is e and p.panics == 1
    p.release(e, ok=True)
    p.set_draining(e.name, True)
    assert p.pick() is None  # drained on purpose: never picked


def test_cancelled_releases_say_nothing_about_the_engine() -> None:
    p = pool(1, failure_threshold=1)
    (e,) = p.engines
    p.pick()
    p.release(e, ok=False, error="ignored", transport=True, cancelled=True)
    assert e.up and e.outstanding == 0 and e.cancelled == 1 and e.failed == 0 and e.succeeded == 0
    assert e.last_error == ""


def test_draining_stops_new_requests_and_in_flight_ones_finish() -> None:
    p = pool(2)
    e0, e1 = p.engines
    assert p.pick() is e0
    p.set_draining("e0", True)
    assert all(p.pick() is e1 for _ in range(3))
    p.release(e0, ok=True)
    assert e0.outstanding == 0 and e0.succeeded == 1 and e0.draining
    p.set_draining("e1", True)
    assert p.pick() is None and p.eligible() == []
    p.set_draining("e0", False)
    assert p.pick() is e0
    with pytest.raises(KeyError):
        p.set_draining("nope", True)


def test_exclude_lease_snapshot_and_validation() -> None:
    p = pool(2)
    e0, e1 = p.engines
    assert p.pick(exclude=[e0]) is e1
    assert p.pick(exclude=[e0, e1]) is None
    with p.lease() as e:
        assert e is not None and e.outstanding == 1
    assert e.outstanding == 0 and e.succeeded == 1
    with pytest.raises(RuntimeError), p.lease() as e:
        raise RuntimeError
    assert e is not None and e.failed == 1
    e0.identity = PrefillIdentity("prefill-0", "10.0.0.1", 5600, 2)
    snap = p.snapshot()
    assert snap[0]["identity"] == {
        "engine_id": "prefill-0",
        "side_channel": "10.0.0.1:5600",
        "tp_size": 2,
        "pp_size": 1,
    }
    assert "identity" not in snap[1]
    assert {"outstanding", "chosen", "succeeded", "failed", "cancelled", "up", "draining"} <= set(snap[0])
    with pytest.raises(ValueError, match="unique"):
        EnginePool([Engine("a", "u", "decode"), Engine("a", "v", "decode")])
    with pytest.raises(ValueError, match="policy"):
        EnginePool([], policy="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="failure_threshold"):
        EnginePool([], failure_threshold=0)


def test_picks_from_many_threads_never_lose_count() -> None:
    p = pool(4)

    def work() -> None:
        for _ in range(500):
            e = p.pick()
            assert e is not None
            p.release(e, ok=True)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e.outstanding == 0 for e in p.engines)
    assert sum(e.chosen for e in p.engines) == sum(e.succeeded for e in p.engines) == 2000
