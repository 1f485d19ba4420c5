"""Thread-free unit tests of the writer's remote table (``pushactors.actors.writer.remotes``)."""

from __future__ import annotations

from pushactors.actors.writer.remotes import AdmitReg, DeliverPush, DeliverReg, RemoteTable, d_peer
from pushactors.protocol import PeerKey, Registration
from pushactors.testing import registration

A = PeerKey("decode", "10.0.0.1", 5000, 0, 0)
B = PeerKey("decode", "10.0.0.2", 5000, 0, 0)  # the same engine id at another address


def reg(d_id: str = "d-1") -> Registration:
    return registration(d_id, (1,), decode=("decode", "10.0.0.1", 5000))


def table(**kw: int) -> RemoteTable:
    return RemoteTable(max_remotes=kw.get("max_remotes", 4), max_parked_per_peer=kw.get("max_parked", 3))


def test_d_peer_is_the_address_a_registration_names() -> None:
    assert d_peer(reg()) == A and d_peer(reg().header()) == A


def test_parking_asks_for_one_fetch_per_peer_and_is_bounded() -> None:
    t = table(max_remotes=2, max_parked=2)
    assert t.park(A, DeliverPush("p-1", 0)) == "fetch"
    assert t.park(A, DeliverPush("p-2", 0)) == "joined"
    assert "parked" in t.park(A, DeliverPush("p-3", 0))  # refused: the caller fails it
    assert t.park(B, DeliverPush("p-4", 0)) == "fetch"
    assert "pending" in t.park(PeerKey("x", "h", 1, 0, 0), DeliverPush("p-5", 0))
    assert [w.request_id for w in t.take_parked(A)] == ["p-1", "p-2"]  # type: ignore[union-attr]
    assert t.take_parked(A) == [] and t.sizes()["awaiting"] == 1


def test_unparking_a_registration_drops_only_that_one() -> None:
    t = table()
    t.park(A, DeliverReg(reg("d-1"), A))
    t.park(A, DeliverReg(reg("d-2"), A))
    assert t.unpark_registration(A, "d-1") == 1
    assert [w.registration.request_id for w in t.take_parked(A)] == ["d-2"]  # type: ignore[union-attr]


def test_an_address_binds_an_agent_only_on_that_agents_word() -> None:
    t = table()
    t.park(A, AdmitReg(reg().header(), b"", "mallory"))
    assert t.unclaimed(A, "decode-pp0-tp0")  # only a stranger's registration asked for A
    t.park(A, AdmitReg(reg().header(), b"", "decode-pp0-tp0"))
    assert not t.unclaimed(A, "decode-pp0-tp0")
    t2 = table()
    t2.park(A, DeliverPush("p-1", 0))  # our own work asked for A: binding it is fine
    assert not t2.unclaimed(A, "decode-pp0-tp0")


def test_binding_a_name_at_a_new_address_moves_an_idle_holder_and_never_a_busy_one() -> None:
    t = table()
    assert t.binding(A, "decode-pp0-tp0", set()) == ("new", None)
    held = t.add(A, "decode-pp0-tp0", info=None, clock_offset=0.0, now=0.0)
    assert t.identify("decode-pp0-tp0") == A and t.by_agent("decode-pp0-tp0") is held
    assert t.binding(A, "decode-pp0-tp0", set()) == ("new", None)  # same address: a refresh
    assert t.binding(B, "decode-pp0-tp0", set()) == ("move", held)
    assert t.binding(B, "decode-pp0-tp0", {A}) == ("conflict", held)  # A has work waiting
    held.in_flight = 1
    assert t.binding(B, "decode-pp0-tp0", set()) == ("conflict", held)
    held.gone = True  # NIXL says it disconnected: no longer holds the name
    assert t.binding(B, "decode-pp0-tp0", set()) == ("new", None)


def test_the_table_is_bounded_and_evicts_the_least_recently_used_idle_remote() -> None:
    t = table(max_remotes=2)
    a = t.add(A, "a", None, 0.0, now=1.0)
    t.add(B, "b", None, 0.0, now=2.0)
    c = PeerKey("decode", "10.0.0.3", 5000, 0, 0)
    assert t.room_needed(c) and not t.room_needed(A)
    assert t.least_recently_used_idle(set()) == A
    a.in_flight = 1
    assert t.least_recently_used_idle(set()) == B
    assert t.least_recently_used_idle({B}) is None  # every remote is busy: the caller refuses
    assert t.idle(now=10.0, idle_for=5.0, busy=set()) == [B]
    assert t.forget(a) and not t.forget(a) and t.get(A) is None
    assert not t.loaded("a") and t.loaded("b")
