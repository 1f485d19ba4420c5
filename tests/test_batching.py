"""SendBatches: what a thread holds inside a scope, and in which order it comes out."""

from __future__ import annotations

import threading

from pushactors.core.batching import SendBatches


def test_outside_a_scope_nothing_is_held() -> None:
    batches: SendBatches[str, int] = SendBatches()
    assert not batches.open
    assert batches.hold("writer", 1) is False
    assert batches.drain() == []


def test_targets_come_out_in_first_sent_order_with_their_messages_in_order() -> None:
    batches: SendBatches[str, str] = SendBatches()
    with batches.scope() as outermost:
        assert outermost
        for target, message in [("reaper", "lease"), ("matcher", "blocks"), ("reaper", "renew"), ("writer", "post")]:
            assert batches.hold(target, message)
        assert batches.drain() == [("reaper", ["lease", "renew"]), ("matcher", ["blocks"]), ("writer", ["post"])]
        # Drained: the scope stays open and empty.
        assert batches.open and batches.drain() == []
        assert batches.hold("writer", "again")
        assert batches.drain() == [("writer", ["again"])]
    assert not batches.open


def test_an_inner_scope_is_part_of_the_outer() -> None:
    batches: SendBatches[str, int] = SendBatches()
    with batches.scope() as outer:
        batches.hold("a", 1)
        with batches.scope() as inner:
            assert outer and not inner
            batches.hold("b", 2)
        # Leaving the inner scope delivers nothing: the outer still holds both.
        assert batches.open
        assert batches.drain() == [("a", [1]), ("b", [2])]


def test_each_thread_has_its_own_scope() -> None:
    batches: SendBatches[str, int] = SendBatches()
    seen: dict[str, object] = {}
    with batches.scope():
        batches.hold("a", 1)

        def other() -> None:
            seen["open"] = batches.open
            seen["held"] = batches.hold("a", 2)

        t = threading.Thread(target=other)
        t.start()
        t.join(timeout=10)
        assert seen == {"open": False, "held": False}
        assert batches.drain() == [("a", [1])]


def test_a_scope_that_raises_closes() -> None:
    batches: SendBatches[str, int] = SendBatches()
    try:
        with batches.scope():
            batches.hold("a", 1)
            raise ValueError("handler failed")
    except ValueError:
        pass
    assert not batches.open
    assert batches.hold("a", 2) is False
