"""D aborted, and the P rank that owes the answer died before giving it (fake fabric).

The abort went out while P was alive; nothing else goes between D and that P afterwards (no
heartbeat is sent for an aborted request, no other request names that P), so NIXL never gets the
chance to report the peer gone. D asks P's side channel about it instead, about once a second
while it holds an aborted request that P rank has not answered: once the side channel refuses
(or another incarnation of P answers there), D frees the blocks within a few seconds, not at
the end of the quarantine. A P that answers as itself, or that cannot be reached at all (slow,
link broken), keeps the quarantine: it may still write.
"""

from __future__ import annotations

import errno
import socket
import time
from typing import Any

import msgspec
import pytest
from scenario_kit import D_AGENT, FAST, P_AGENT, TOKENS, actor, addr, pump_all, stat, untouched

from pushactors.core.config import PushConfig
from pushactors.core.ledger import DRegistry
from pushactors.protocol import HandshakeRequest, PeerKey, Registration, WatchRecv
from pushactors.testing import PushPair, SimEngine, SimSpec
from pushactors.transport.directory import SideChannelError
from pushactors.transport.sidechannel import SideChannelClient

pytestmark = pytest.mark.timeout(90)

BOUND = 5.0  # D frees within this long of P's death being detectable
# A long lease: heartbeat_every is 5 s, so D probes at its default cadence (once a second).
DEFAULT_TIMING: dict[str, Any] = {"lease_duration": 30.0, "registration_timeout": 60.0}


def pair_with(**overrides: Any) -> PushPair:
    return PushPair(**{**FAST, **DEFAULT_TIMING, **overrides})


def registered(pair: PushPair, n: str, p: SimEngine | None = None) -> str:
    """D registers with P for request ``n``, whose prefill never finishes; D's id."""
    p = p or pair.prefill
    d_id = f"{n}-bbbbbbbb"
    matcher = actor(p, "matcher")
    before = matcher.sizes()["pending_registrations"]
    pair.decode.expect(d_id, TOKENS, p.scheduler.decode_params(f"{n}-aaaaaaaa"), key=n)
    pump_all(
        engines(pair, p),
        lambda: matcher.sizes()["pending_registrations"] == before + 1,
        what=f"{d_id} registered on P",
    )
    return d_id


def engines(pair: PushPair, *more: SimEngine) -> list[SimEngine]:
    return [pair.prefill, pair.decode, *(e for e in more if e is not pair.prefill)]


def abort_unanswered(pair: PushPair, d_id: str, p: SimEngine | None = None, p_agent: str = P_AGENT) -> None:
    """D aborts ``d_id`` while P is alive; P's answer is lost (P dies before it gets out)."""
    pair.fabric.faults.drop_notif(match=lambda c: c.src == p_agent and c.dst == D_AGENT, times=None)
    dropped = pair.fabric.stats.notifs_dropped
    assert pair.decode.scheduler.abort_recv(d_id)
    pump_all(
        engines(pair, *(p,) if p is not None else ()),
        lambda: pair.fabric.stats.notifs_dropped > dropped,
        what="P's answer to the abort (lost)",
    )


def kill_p(pair: PushPair, endpoint: Any = None, p_agent: str = P_AGENT) -> float:
    """P's process is gone: its side channel refuses, any NIXL send to it reports it disconnected."""
    endpoint = endpoint or pair.p_endpoint
    pair.directory.refused.add(addr(endpoint))
    pair.fabric.faults.disconnect_notif(match=lambda c: c.src == D_AGENT and c.dst == p_agent, times=None)
    return time.monotonic()


def pump_until_reported(pair: PushPair, d_id: str, timeout: float, *more: SimEngine) -> None:
    pump_all(engines(pair, *more), lambda: d_id in pair.received, timeout=timeout, what=f"D to report {d_id}")


def held_for(pair: PushPair, d_id: str, seconds: float, *more: SimEngine) -> bool:
    """``d_id`` is still unreported after ``seconds`` of pumping (a deadline, not a bare sleep)."""
    t0 = time.monotonic()
    pump_all(
        engines(pair, *more),
        lambda: d_id in pair.received or time.monotonic() - t0 >= seconds,
        timeout=seconds + 10,
        what=f"{seconds}s or a report",
    )
    return d_id not in pair.received


# --- P dies after D's abort ---------------------------------------------------------------------
def test_d_frees_an_aborted_request_within_seconds_of_its_p_dying_with_no_other_traffic() -> None:
    with pair_with(abort_quarantine=45.0) as pair:
        d_id = registered(pair, "dp1")
        abort_unanswered(pair, d_id)
        assert held_for(pair, d_id, 1.5), "released before P died: P may still write"
        died = kill_p(pair)
        pump_until_reported(pair, d_id, timeout=BOUND + 10)
        took = time.monotonic() - died
        assert took <= BOUND, f"D held the blocks {took:.2f}s after P died (quarantine 45 s)"
        assert pair.received[d_id] is not None
        assert untouched(pair.decode, d_id)
        assert stat(pair.decode, "peer.probe_dead") >= 1
        assert stat(pair.decode, "recv.peer_dead_released") == 1
        assert stat(pair.decode, "remote.gone") == 0  # nothing was sent: NIXL never said so


def test_a_p_restarted_at_its_address_is_another_incarnation_and_frees_the_old_ones_request() -> None:
    with pair_with(abort_quarantine=45.0) as pair:
        d_id = registered(pair, "dp2")
        abort_unanswered(pair, d_id)
        assert held_for(pair, d_id, 1.5)
        # The same engine id comes back at the same address with a new agent (new memory, new
        # endpoint): the process D registered with is gone.
        served = pair.directory.published(addr(pair.p_endpoint), 0, 0)
        assert served is not None
        info, compat = served
        reborn = msgspec.structs.replace(info, agent_metadata=bytes(info.agent_metadata) + b"-reborn")
        pair.p_endpoint.publish(reborn, compat)
        died = time.monotonic()
        pump_until_reported(pair, d_id, timeout=BOUND + 10)
        assert time.monotonic() - died <= BOUND
        assert pair.received[d_id] is not None
        assert stat(pair.decode, "peer.probe_dead") >= 1


def test_only_the_dead_ps_requests_are_freed() -> None:
    with pair_with(abort_quarantine=8.0) as pair:
        endpoint = pair.directory.endpoint("prefill2-host")
        p2 = SimEngine(
            PushConfig(engine_id="prefill2", role="producer", **{**FAST, **DEFAULT_TIMING}),
            agent_factory=pair.fabric,
            source=pair.directory,
            publisher_for_rank=lambda _r: endpoint,
            spec=SimSpec(),
            seed=7,
        )
        try:
            p2_agent = "prefill2-pp0-tp0"
            d1 = registered(pair, "dp3a")
            d2 = registered(pair, "dp3b", p=p2)
            abort_unanswered(pair, d1)
            abort_unanswered(pair, d2, p=p2, p_agent=p2_agent)
            died = kill_p(pair)
            pump_until_reported(pair, d1, BOUND + 10, p2)
            assert time.monotonic() - died <= BOUND
            assert d2 not in pair.received, "the live P's request lost its quarantine"
            assert stat(pair.decode, "recv.peer_dead_released") == 1
            # The live P's request sits out its quarantine.
            pump_until_reported(pair, d2, 15, p2)
            assert pair.received[d2] is not None
            assert stat(pair.decode, "recv.peer_dead_released") == 1
        finally:
            p2.shutdown(10.0)


def test_a_p_whose_link_broke_while_it_lived_is_freed_once_it_dies_later() -> None:
    # NIXL reported P gone (a heartbeat's send failed) while P was alive: the request failed and
    # quarantines, and the writer's death check found P answering as itself. P dies later; by
    # then nothing goes to it any more, yet D frees the blocks within seconds.
    with pair_with(abort_quarantine=45.0, heartbeat_interval=0.5) as pair:
        d_id = registered(pair, "dp5")
        # P's answers are lost: otherwise the abort D sends once the death check reconnected
        # (a race with the reaper) reaches P, and P's answer frees the blocks at once, rightly.
        pair.fabric.faults.drop_notif(match=lambda c: c.src == P_AGENT and c.dst == D_AGENT, times=None)
        pair.fabric.faults.disconnect_notif(match=lambda c: c.src == D_AGENT, times=1)
        pair.pump(lambda: stat(pair.decode, "remote.gone") == 1, what="D to see P gone")
        assert held_for(pair, d_id, 3.0), "released while P lived"
        assert stat(pair.decode, "remote.dead") == 0
        died = kill_p(pair)
        pump_until_reported(pair, d_id, timeout=BOUND + 10)
        assert time.monotonic() - died <= BOUND
        assert pair.received[d_id] is not None
        assert stat(pair.decode, "peer.probe_dead") >= 1


def test_a_p_alive_behind_a_link_that_broke_hears_the_abort_and_its_answer_frees_the_blocks() -> None:
    # NIXL reported P gone while P lived: D failed the request, and its abort found no agent to
    # go to. It waits for the death check's handshake; P, alive, answers it (it drops the
    # registration), so D frees the blocks at once, not after the 45 s quarantine.
    with pair_with(abort_quarantine=45.0, heartbeat_interval=0.5) as pair:
        d_id = registered(pair, "dp6")
        matcher = actor(pair.prefill, "matcher")
        pair.fabric.faults.disconnect_notif(match=lambda c: c.src == D_AGENT, times=1)
        t0 = time.monotonic()
        pump_until_reported(pair, d_id, timeout=BOUND + 10)
        assert time.monotonic() - t0 <= BOUND
        assert "gone" in (pair.received[d_id] or ""), pair.received[d_id]
        assert stat(pair.decode, "remote.gone") == 1
        assert stat(pair.decode, "remote.dead") == 0 and stat(pair.decode, "peer.probe_dead") == 0
        assert stat(pair.decode, "recv.peer_dead_released") == 0
        assert matcher.sizes()["pending_registrations"] == 0  # P stood down
        assert stat(pair.decode, "writer.notify_undeliverable") == 0


# --- P alive: the quarantine stands -------------------------------------------------------------
@pytest.mark.parametrize("how", ["answers_as_itself", "side_channel_times_out", "connection_dropped"])
def test_a_p_that_is_alive_slow_or_unreachable_keeps_the_quarantine(how: str) -> None:
    quarantine = 4.0
    with pair_with(abort_quarantine=quarantine) as pair:
        d_id = registered(pair, f"dp4-{how}")
        address = addr(pair.p_endpoint)
        if how == "side_channel_times_out":
            pair.directory.delays[address] = 30.0  # every fetch times out (a broken link)
        elif how == "connection_dropped":
            pair.directory.disconnects[address] = 10_000  # accepted, then dropped unanswered
        abort_unanswered(pair, d_id)
        t0 = time.monotonic()
        assert held_for(pair, d_id, quarantine - 1.0), "released a live P's request before its quarantine"
        pump_until_reported(pair, d_id, timeout=20)
        assert time.monotonic() - t0 >= quarantine - 1.0
        assert pair.received[d_id] is not None
        assert stat(pair.decode, "peer.probe_dead") == 0
        assert stat(pair.decode, "recv.peer_dead_released") == 0
        kind = "peer.probe_alive" if how == "answers_as_itself" else "peer.probe_inconclusive"
        assert stat(pair.decode, kind) >= 1
        # Probed about once a second, not more (the quarantine is 4 s).
        assert stat(pair.decode, "peer.probe_sent") <= 2 * quarantine + 2


# --- the registry's part: which P ranks to ask about ------------------------------------------
P0 = PeerKey("p", "h", 1, 0, 0)
P1 = PeerKey("p", "h", 1, 0, 1)
Q0 = PeerKey("q", "h", 2, 0, 0)


def _watch(rid: str, *peers: PeerKey) -> WatchRecv:
    reg = Registration(
        request_id=rid,
        decode_engine_id="d",
        decode_host="dh",
        decode_port=3,
        decode_tp_size=1,
        local_block_ids=(1,),
        remote_engine_id=peers[0].engine_id,
        remote_host=peers[0].host,
        remote_port=peers[0].port,
        remote_tp_size=len(peers),
    )
    return WatchRecv(
        request_id=rid, expected=len(peers), deadline=1e9, registration=reg, peers=peers, heartbeat_id=rid, nbytes=1
    )


def test_the_registry_asks_only_about_p_ranks_owing_an_aborted_request_for_a_round() -> None:
    recvs = DRegistry(quarantine=45.0)
    recvs.watch(_watch("a", P0, P1), 0.0)
    recvs.watch(_watch("b", Q0), 0.0)
    assert recvs.probe_due(1.0, grace=0.5) == ()  # nothing aborted
    recvs.abort("a", "aborted", 1.0)
    assert recvs.probe_due(1.0, grace=0.5) == ()  # owing from now: asked from the next round
    assert set(recvs.probe_due(2.0, grace=0.5)) == {P0, P1}
    recvs.notified("a", ok=False, peer=P0, final=True, reason="cancelled", now=2.1)
    assert recvs.probe_due(3.0, grace=0.5) == (P1,)  # P0 answered for good
    res = recvs.peer_dead(P1, "p-pp0-tp1", "its side channel refuses connections")
    assert [getattr(a, "request_id", None) for a in res.actions] == ["a"]
    assert res.counters == ["recv.peer_dead_released"]
    assert recvs.probe_due(4.0, grace=0.5) == ()
    assert recvs.sizes()["recvs"] == 1  # b, waiting on a live Q, untouched


def test_a_p_rank_nixl_just_reported_gone_is_left_to_the_writers_death_check_for_a_while() -> None:
    recvs = DRegistry(quarantine=45.0)
    recvs.watch(_watch("a", P0), 0.0)
    recvs.peer_gone(P0, "p-pp0-tp0", "NIXL reports it disconnected", 1.0, delivered=("a",))  # fails a
    assert recvs.probe_due(1.0, grace=0.5, after_gone=2.0) == ()
    assert recvs.probe_due(2.0, grace=0.5, after_gone=2.0) == ()  # the writer asks meanwhile
    assert recvs.probe_due(3.0, grace=0.5, after_gone=2.0) == (P0,)


# --- the side channel: a broken route is not a dead process -------------------------------------
def test_a_side_channel_that_cannot_be_routed_to_is_unreachable_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_route(*_: Any, **__: Any) -> socket.socket:
        raise OSError(errno.EHOSTUNREACH, "No route to host")

    monkeypatch.setattr(socket, "create_connection", no_route)
    client = SideChannelClient()
    with pytest.raises(SideChannelError) as caught:
        client.fetch(PeerKey("p", "192.0.2.1", 9, 0, 0), HandshakeRequest(pp_rank=0, tp_rank=0), timeout=1.0)
    assert caught.value.kind == "unreachable"
