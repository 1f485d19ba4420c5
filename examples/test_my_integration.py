"""How a user tests an integration with pushactors' testing kit, at the actor level.

Run it as any pytest file (CI runs it through ``tests/test_examples.py``):

    pytest examples/test_my_integration.py

Everything here is public API: a P and a D engine over the fake fabric (``PushPair``), fault
rules on the fabric (``fabric.faults``), handler failures injected into one rank's actors
(``ctx.faults``), actor tables read through their mailboxes (``runtime.snapshot``), counters
(``worker.stats()``), and the structured events (``events`` fixture). See docs/testing.md.
"""

from __future__ import annotations

from pushactors.logs import EventCapture
from pushactors.protocol import BlocksFinished
from pushactors.testing import FaultContext, PushPair

pytest_plugins = ["pushactors.testing.fixtures"]

TOKENS = 40  # 3 blocks of 16 tokens


def both_legs(pair: PushPair, name: str) -> tuple[str, str]:
    """What a push router does: the prefill leg to P and the decode leg to D at once."""
    p_id, d_id = f"{name}-aaaaaaaa", f"{name}-bbbbbbbb"
    params = pair.prefill.prefill(p_id, TOKENS, key=name)  # fills P's blocks with known bytes
    pair.decode.expect(d_id, TOKENS, params, key=name)  # allocates D's blocks, stages them
    return p_id, d_id


def test_a_push_lands_byte_for_byte(push_pair: PushPair, events: EventCapture) -> None:
    p_id, d_id = both_legs(push_pair, "hello")
    push_pair.pump(lambda: d_id in push_pair.received and p_id in push_pair.sent)
    assert push_pair.received[d_id] is None  # None: landed; a string: why it failed
    checked, wrong = push_pair.decode.verify(d_id)
    assert checked > 0 and wrong == 0
    # One structured event per mailbox message: find the WRITE.
    (posted,) = [e for e in events.named("write.posted") if e["request_id"] == p_id]
    assert posted["d_request_id"] == d_id and posted["bytes"] == checked
    # Counters, by notification kind among others.
    assert push_pair.decode.workers[0].stats()["notif.kind.completion"] == 1


def test_a_write_that_fails_ends_both_legs_visibly(push_pair: PushPair) -> None:
    # A fault rule on the fabric: the next WRITE from P's rank 0 ends in ERR.
    push_pair.fabric.faults.err_transfer(match=lambda ctx: ctx.op == "WRITE" and ctx.src == "prefill-pp0-tp0")
    p_id, d_id = both_legs(push_pair, "broken")
    push_pair.pump(lambda: d_id in push_pair.received and p_id in push_pair.sent)
    assert push_pair.sent[p_id] and push_pair.received[d_id]  # both failed, with a reason
    # Every table is empty again: read on each actor's own thread, through its mailbox.
    tables = push_pair.prefill.workers[0].runtime.snapshot()
    assert tables["writer"]["pushes"] == 0 and tables["matcher"]["finished"] == 0
    assert tables["reaper"]["leases"] == 0


def test_a_handler_that_raises_fails_only_its_request(push_pair: PushPair) -> None:
    # Make P's matcher fail on one message, without touching any private attribute.
    p_rank = push_pair.prefill.workers[0]
    p_rank.ctx.faults.fail_handler("matcher", BlocksFinished, match=lambda m: m.request_id.startswith("victim"))
    victim_p, victim_d = both_legs(push_pair, "victim")
    ok_p, ok_d = both_legs(push_pair, "bystander")
    push_pair.pump(lambda: {victim_d, ok_d} <= set(push_pair.received) and {victim_p, ok_p} <= set(push_pair.sent))
    assert push_pair.received[victim_d] and push_pair.received[ok_d] is None
    assert p_rank.stats()["matcher.handler_error"] == 1
    assert p_rank.healthy


def test_wait_until_the_actors_handled_what_was_sent(push_pair: PushPair) -> None:
    hold = push_pair.fabric.faults.hold_transfer(match=lambda ctx: isinstance(ctx, FaultContext) and ctx.op == "WRITE")
    _, d_id = both_legs(push_pair, "held")
    push_pair.pump(lambda: push_pair.fabric.stats.transfers_posted == 1, what="the WRITE to be posted")
    # barrier(): every message sent to this rank's actors before the call has been handled.
    push_pair.decode.workers[0].runtime.barrier()
    assert d_id not in push_pair.received  # the WRITE is held: nothing is reported as landed
    hold.open()
    push_pair.pump(lambda: d_id in push_pair.received)
    assert push_pair.received[d_id] is None


def test_kv_lands_in_exactly_the_blocks_d_chose(push_pair: PushPair) -> None:
    p_id, d_id = "chosen-aaaaaaaa", "chosen-bbbbbbbb"
    params = push_pair.prefill.prefill(p_id, TOKENS, key="chosen")
    rec = push_pair.decode.expect(d_id, TOKENS, params, key="chosen", blocks=[200, 7, 31])
    push_pair.pump(lambda: d_id in push_pair.received)
    assert push_pair.received[d_id] is None and rec.blocks == [200, 7, 31]
    assert push_pair.decode.verify(d_id)[1] == 0
