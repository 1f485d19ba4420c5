"""The engine thread's hand-over point (core/handoff.py), driven by real threads and events.

No timing thresholds: every wait below either ends on an event another thread sets, or is
checked to have reached its bound (which it can only do when nothing ended it)."""

from __future__ import annotations

import threading

from pushactors.core.handoff import Handoff
from pushactors.testing.pair import wait_until


class Member:
    """An actor stand-in: busy while it holds work, idle (and ringing) when it lets go."""

    def __init__(self, handoff: Handoff) -> None:
        self.work = 0
        self.looked = 0  # how often a hook asked whether it is busy
        self.handoff = handoff
        handoff.join(self.busy)

    def busy(self) -> bool:
        self.looked += 1
        return self.work > 0

    def take(self) -> None:
        """A message arrives: busy, and the mailbox stirs the hand-over point (as TimedInbox)."""
        self.work = 1
        self.handoff.stir()

    def finish(self) -> None:
        self.work = 0
        self.handoff.idle()


def test_nothing_to_wait_for_returns_at_once_without_blocking() -> None:
    handoff = Handoff()
    Member(handoff)
    lent = handoff.lend(10.0, poll=True)  # idle members, nothing outstanding
    assert not lent.lent and lent.quiet and lent.polled
    assert not handoff.lend(0.0).lent


def test_an_unstirred_hand_over_looks_at_no_member_and_a_stirred_one_until_all_are_quiet() -> None:
    # An engine hook back from a device wait finds the members cold: a quiet step reads only
    # the hand-over point. Stirred, it looks, and keeps looking while a member has work.
    handoff = Handoff()
    member = Member(handoff)
    for _ in range(3):
        assert not handoff.lend(10.0, poll=True).lent
    assert member.looked == 0
    member.take()
    assert handoff.lend(0.01).lent  # busy: waits out its bound
    assert handoff.stirred, "a member with work left it stirred"
    member.finish()
    looked = member.looked
    assert not handoff.lend(10.0).lent
    assert member.looked == looked + 1 and not handoff.stirred
    assert not handoff.lend(10.0).lent
    assert member.looked == looked + 1


def test_a_hook_waits_until_the_busy_member_is_quiet() -> None:
    handoff = Handoff()
    member = Member(handoff)
    member.take()
    started = threading.Event()

    def actor() -> None:
        started.wait(10)
        member.finish()

    t = threading.Thread(target=actor)
    t.start()
    started.set()
    lent = handoff.lend(30.0)
    t.join()
    assert lent.lent and lent.quiet and lent.waited_s < 30.0


def test_a_hook_stops_at_its_bound_when_the_actors_stay_busy() -> None:
    handoff = Handoff()
    member = Member(handoff)
    member.take()
    lent = handoff.lend(0.05)
    assert lent.lent and not lent.quiet and lent.waited_s >= 0.05


def test_a_poll_counts_only_when_it_began_after_the_hook() -> None:
    """A poll already running when the hook came may have read NIXL before the landing the
    hook waits for: only one that begins after the hook ends its wait."""
    handoff = Handoff()
    handoff.in_flight = 1
    handoff.poll_started()  # a poll in progress as the hook comes
    woken = threading.Event()
    handoff.wake_writer = woken.set
    done = threading.Event()

    def writer() -> None:
        woken.wait(10)
        handoff.poll_ended()  # the old poll ends: not enough
        handoff.poll_started()
        handoff.poll_ended()  # the poll the hook asked for
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    lent = handoff.lend(30.0, poll=True)
    t.join()
    assert done.is_set() and lent.polled and lent.waited_s < 30.0
    # Only the old poll ending: the hook waits out its bound.
    handoff.poll_started()
    handoff.wake_writer = handoff.poll_ended
    lent = handoff.lend(0.05, poll=True)
    assert not lent.polled and lent.waited_s >= 0.05


def test_without_anything_outstanding_a_poll_is_not_awaited() -> None:
    handoff = Handoff()
    woken: list[bool] = []
    handoff.wake_writer = lambda: woken.append(True)
    assert not handoff.lend(30.0, poll=True).lent and woken == []


def test_closing_releases_a_waiting_hook() -> None:
    handoff = Handoff()
    member = Member(handoff)
    member.take()
    entered = threading.Event()
    result: list[object] = []

    def hook() -> None:
        entered.set()
        result.append(handoff.lend(30.0))

    t = threading.Thread(target=hook)
    t.start()
    entered.wait(10)
    wait_until(lambda: handoff.waiting, timeout=10, what="the hook blocked in lend")
    handoff.close()
    t.join(30)
    assert result and not result[0].quiet  # type: ignore[attr-defined]
    assert not handoff.lend(30.0).lent  # closed: never waits again


def test_a_settling_hook_waits_until_no_write_is_in_progress() -> None:
    """NIXL progresses a WRITE in its initiator's polls: a hook that handed a push over lends
    the interpreter until the writer has seen it end, not only until it was posted."""
    handoff = Handoff()
    handoff.in_flight = 1
    done = threading.Event()

    def writer() -> None:
        handoff.poll_started()
        handoff.in_flight = 0  # this poll saw the WRITE end
        handoff.poll_ended()
        done.set()

    handoff.wake_writer = lambda: threading.Thread(target=writer).start()
    lent = handoff.lend(30.0, settle=True, poll=True)
    assert done.is_set() and lent.settled and lent.polled and lent.waited_s < 30.0
    handoff.in_flight = 1
    handoff.wake_writer = None
    lent = handoff.lend(0.05, settle=True)  # never ends: the bound
    assert not lent.settled and lent.waited_s >= 0.05
    assert not handoff.lend(0.05).lent  # without settle, a WRITE in progress is not waited for


def test_an_engine_step_rouses_only_a_deep_writer_and_only_once() -> None:
    handoff = Handoff()
    calls: list[int] = []
    handoff.rouse_writer = lambda: calls.append(1)
    handoff.rouse()  # the writer polls at its idle interval already: one attribute read
    assert calls == [] and not handoff.roused
    handoff.deep = True  # the writer says it sleeps deep
    handoff.rouse()
    handoff.rouse()  # the next step, before the writer polled: nothing more to do
    assert calls == [1] and handoff.roused and not handoff.deep
