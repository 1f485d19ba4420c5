"""End to end over the fake fabric: P and D engines with their schedulers, in one process."""

from __future__ import annotations

import json
import random

import pytest

from pushactors.logs import JsonLinesSink, add_sink, remove_sink
from pushactors.protocol import encode_heartbeat
from pushactors.testing import PushPair, SimSpec, wait_until


def _drive_batch(pair: PushPair, rng: random.Random, requests: list[dict]) -> None:
    """Start each request's legs in its arrival order, stepping engines in between."""
    for req in requests:
        order = req["order"]
        if order == "finished_first":
            req["params"] = pair.prefill.prefill(req["p_id"], req["tokens"], key=req["key"], transfer_id=req["tid"])
            pair.prefill.step()
            pair.decode.expect(req["d_id"], req["tokens"], req["d_params"], key=req["key"], cached_blocks=req["cached"])
        elif order == "registration_first":
            pair.decode.expect(req["d_id"], req["tokens"], req["d_params"], key=req["key"], cached_blocks=req["cached"])
            pair.decode.step()
            req["params"] = pair.prefill.prefill(req["p_id"], req["tokens"], key=req["key"], transfer_id=req["tid"])
        else:  # both legs in one step, as a concurrent router sends them
            req["params"] = pair.prefill.prefill(req["p_id"], req["tokens"], key=req["key"], transfer_id=req["tid"])
            pair.decode.expect(req["d_id"], req["tokens"], req["d_params"], key=req["key"], cached_blocks=req["cached"])
        if rng.random() < 0.3:
            pair.step()


def _make_requests(pair: PushPair, rng: random.Random, start: int, count: int) -> list[dict]:
    out = []
    p_engine = pair.prefill.scheduler
    for i in range(start, start + count):
        base = f"cmpl-{i:05d}-{rng.randrange(3)}"
        p_id = f"{base}-{rng.getrandbits(32):08x}"
        d_id = f"{base}-{rng.getrandbits(32):08x}"
        tokens = rng.randint(1, 12 * pair.prefill.spec.block_size)
        nblocks = pair.prefill.blocks_for(tokens)
        tid = f"tx-{i}" if rng.random() < 0.3 else None
        # D knows P's identity only (push lets both legs go at once), never P's final id.
        d_params = p_engine.decode_params(base, tid)
        out.append(
            {
                "p_id": p_id,
                "d_id": d_id,
                "tokens": tokens,
                "key": f"key-{i}",
                "tid": tid,
                "cached": rng.randrange(nblocks) if rng.random() < 0.25 else 0,
                "order": rng.choice(["finished_first", "registration_first", "together"]),
                "d_params": d_params,
            }
        )
    return out


@pytest.mark.parametrize(
    ("layout", "num_layers", "block_bytes"),
    [("split", 4, 2048), ("fused", 3, 4096)],
)
def test_many_requests_every_byte_lands(layout: str, num_layers: int, block_bytes: int) -> None:
    rng = random.Random(1234 + num_layers)
    spec = SimSpec(num_layers=num_layers, num_blocks=512, block_bytes=block_bytes, layout=layout)
    with PushPair(p_spec=spec, seed=7, reaper_tick=0.02) as pair:
        total_p_blocks = pair.prefill.free_blocks
        total_d_blocks = pair.decode.free_blocks
        requests: list[dict] = []
        for wave in range(8):  # 8 waves × 30 = 240 requests, bounded by the block pools
            batch = _make_requests(pair, rng, wave * 30, 30)
            requests += batch
            _drive_batch(pair, rng, batch)
            want = {r["d_id"] for r in batch}
            pair.pump(lambda want=want: want <= set(pair.received), timeout=60, what="a wave of pushes")
            for r in batch:
                checked, wrong = pair.decode.verify(r["d_id"])
                nblocks = pair.decode.blocks_for(r["tokens"]) - r["cached"]
                assert checked == nblocks * spec.block_bytes * 2 * num_layers
                assert wrong == 0, f"{r['d_id']}: {wrong} wrong bytes"
                pair.decode.finish_recv(r["d_id"])
        pair.pump(pair.settled, timeout=30, what="all leases and watchdogs to clear")

        assert len(requests) >= 200
        assert {r["order"] for r in requests} == {"finished_first", "registration_first", "together"}
        assert all(pair.received[r["d_id"]] is None for r in requests), "a receive failed"
        assert all(pair.sent[r["p_id"]] is None for r in requests), "a push failed"
        assert not pair.prefill.held, "P still holds blocks"
        assert pair.prefill.free_blocks == total_p_blocks
        assert pair.decode.free_blocks == total_d_blocks
        assert not pair.prefill.has_pending_push_work()
        assert not pair.decode.has_pending_push_work()
        p_rank = pair.prefill.workers[0].runtime
        tables = p_rank.snapshot()
        assert tables["reaper"]["leases"] == 0
        assert tables["matcher"]["finished"] == 0
        assert tables["writer"]["pushes"] == 0
        assert pair.decode.workers[0].runtime.snapshot("reaper")["reaper"]["recvs"] == 0
        stats = pair.prefill.workers[0].stats()
        assert stats["push.pushed"] == len(requests)
        assert stats.get("push.failed", 0) == 0


def test_pushes_complete_without_further_p_engine_steps() -> None:
    """Liveness: P's actors push on their own once the finished blocks reached them."""
    with PushPair() as pair:
        ids = []
        for i in range(20):
            p_id, d_id = f"req-{i}-aaaaaaaa", f"req-{i}-bbbbbbbb"
            params = pair.prefill.prefill(p_id, 40 + i, key=f"k{i}")
            ids.append((p_id, d_id, params))
        pair.prefill.step()  # P's last engine step: the finished blocks reach its actors
        for i, (_, d_id, params) in enumerate(ids):
            pair.decode.expect(d_id, 40 + i, params, key=f"k{i}")

        def decode_done() -> bool:
            pair.decode.step()  # only D's engine keeps stepping
            return all(pair.decode.recvs[d].done for _, d, _ in ids)

        wait_until(decode_done, timeout=30, what="pushes with P's engine idle")
        for _, d_id, _ in ids:
            assert pair.decode.verify(d_id)[1] == 0
        # P's results waited in its outbox for the engine's next step.
        report = pair.prefill.step()
        assert report.finished_sending == {p for p, _, _ in ids}
        assert not report.failed_sending


def test_a_heartbeat_storm_costs_ps_matcher_one_message_and_a_request_beside_it_none_more() -> None:
    """D's agent floods P with one-id heartbeats, each its own notification, all read in one
    poll, while an unrelated request is pushed. P's matcher handles one message for the whole
    storm and the reaper none (no id names a leased request): the request's lease is armed and
    cleared behind at most one heartbeat message, never behind 2,000."""
    storm = 2000
    # D sends no heartbeat of its own during the test: every heartbeat P sees is the storm's.
    with PushPair(lease_duration=30.0, heartbeat_interval=15.0) as pair:
        p_rank = pair.prefill.workers[0].runtime

        def push(n: str) -> None:
            params = pair.prefill.prefill(f"{n}-aaaaaaaa", 40, key=n)
            pair.decode.expect(f"{n}-bbbbbbbb", 40, params, key=n)

        def pushed(n: str) -> bool:
            return f"{n}-bbbbbbbb" in pair.received and f"{n}-aaaaaaaa" in pair.sent

        def handled() -> tuple[int, int]:
            tables = p_rank.snapshot()
            return tables["matcher"]["handled"], tables["reaper"]["handled"]

        push("warm")  # the handshakes, out of the way
        pair.pump(lambda: pushed("warm") and pair.settled(), what="the warm-up push")
        m0, r0 = handled()
        push("base")  # what one request costs P's matcher and reaper
        pair.pump(lambda: pushed("base") and pair.settled(), what="the base push")
        m1, r1 = handled()
        ghosts = [encode_heartbeat([f"ghost-{i % 100}"]) for i in range(storm)]
        pair.fabric.get("prefill-pp0-tp0").inject_notifs("decode-pp0-tp0", ghosts)
        push("beside")
        stats = pair.prefill.workers[0].stats
        pair.pump(
            lambda: pushed("beside") and pair.settled() and stats().get("notif.kind.heartbeat") == storm,
            what="the storm read and the push beside it done",
        )
        m2, r2 = handled()
        assert m2 - m1 == (m1 - m0) + 1  # the storm: one message
        assert r2 - r1 == r1 - r0  # no ExtendLeases: no ghost is leased
        assert pair.sent["beside-aaaaaaaa"] is None and pair.received["beside-bbbbbbbb"] is None
        assert pair.decode.verify("beside-bbbbbbbb")[1] == 0
        reaper = p_rank.snapshot("reaper")["reaper"]
        assert reaper["leases"] == 0 and reaper["lease_heap"] == 0
        assert stats().get("lease.expired", 0) == 0
        assert stats()["heartbeat.coalesced"] == storm - 1
        assert stats()["matcher.heartbeat_unknown"] == 100


def test_mailbox_log_is_json_lines_one_event_per_message(tmp_path) -> None:
    path = tmp_path / "mailbox.jsonl"
    sink = JsonLinesSink(path)
    add_sink(sink)
    try:
        with PushPair() as pair:
            for i in range(5):
                params = pair.prefill.prefill(f"r{i}-aaaaaaaa", 33, key=f"k{i}")
                pair.decode.expect(f"r{i}-bbbbbbbb", 33, params, key=f"k{i}")
            pair.pump(lambda: len(pair.received) == 5 and len(pair.sent) == 5, timeout=20)
            engines = [pair.prefill, pair.decode]
            # Read through each mailbox (a proxy call: neither logged nor counted as handled).
            handled = sum(part["handled"] for e in engines for w in e.workers for part in w.runtime.snapshot().values())
    finally:
        remove_sink(sink)
        sink.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    mailbox = [e for e in events if "wait_ms" in e]
    # Shutdown drains the writers after `handled` was read: two more mailbox messages.
    assert len(mailbox) == handled + 2
    for e in mailbox:
        assert {"actor", "rank", "msg", "event", "level", "ts", "wait_ms", "handle_ms"} <= e.keys()
        assert e["actor"] in {"writer", "handshake", "matcher", "reaper"}
    names = {e["event"] for e in events}
    assert {"reg.matched", "write.posted", "lease.armed", "recv.notified", "handshake.completed"} <= names
    matched = [e for e in mailbox if e["event"] == "reg.matched"]
    assert len(matched) == 5 and all(e["request_id"] for e in matched)


@pytest.mark.parametrize(("post_runs", "posted"), [(True, 4), (False, 32)])
def test_descriptors_merge_for_contiguous_blocks(fake_fabric, post_runs: bool, posted: int) -> None:
    """Structural: contiguous blocks on both sides are posted as one run per region, or (with
    post_runs off) as one prepared descriptor per block that NIXL may merge on its own."""
    # Both pools hand out blocks in order: contiguous runs on both sides.
    spec = SimSpec(num_layers=2, num_blocks=64, block_bytes=1024, shuffle_blocks=False)
    with PushPair(fabric=fake_fabric, p_spec=spec, post_runs=post_runs, post_runs_min_pieces=0) as pair:
        params = pair.prefill.prefill("c-aaaaaaaa", 8 * spec.block_size, key="c")
        pair.decode.expect("c-bbbbbbbb", 8 * spec.block_size, params, key="c")
        pair.pump(lambda: "c-bbbbbbbb" in pair.received)
        assert pair.decode.verify("c-bbbbbbbb")[1] == 0
        assert pair.prefill.workers[0].stats().get("write.runs", 0) == (1 if post_runs else 0)
    # 2 layers × (K, V) regions, 8 contiguous blocks each: 32 pieces, 4 runs.
    assert fake_fabric.stats.per_transfer_merged == [4]
    assert fake_fabric.stats.descriptors == posted


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_tensor_parallel_pairings_land_every_head_slice(p_tp: int, d_tp: int) -> None:
    """Each D rank gets its head slice from the P ranks that hold it (docs/protocol.md, 'Topologies')."""
    spec = SimSpec(num_layers=2, num_blocks=64, block_bytes=1024)
    with PushPair(p_tp=p_tp, d_tp=d_tp, p_spec=spec) as pair:
        ids = []
        for i in range(10):
            tokens = 20 + 13 * i
            params = pair.prefill.prefill(f"r{i}-0-aaaaaaaa", tokens, key=f"k{i}")
            pair.decode.expect(f"r{i}-0-bbbbbbbb", tokens, params, key=f"k{i}", cached_blocks=i % 2)
            ids.append((f"r{i}-0-aaaaaaaa", f"r{i}-0-bbbbbbbb"))
        pair.pump(lambda: all(d in pair.received and p in pair.sent for p, d in ids), timeout=30)
        for p_id, d_id in ids:
            assert pair.received[d_id] is None and pair.sent[p_id] is None
            checked, wrong = pair.decode.verify(d_id)
            assert checked > 0 and wrong == 0
        expected = max(1, p_tp // d_tp)
        for w in pair.decode.workers:
            assert w.stats()["notif.received"] == 10 * expected  # completions per D rank
        pair.pump(pair.settled, timeout=10)


def test_a_small_write_is_posted_by_index_and_a_large_one_as_runs(fake_fabric) -> None:
    """Runs pay only for many pieces: below ``post_runs_min_pieces`` a WRITE indexes the lists
    prepared once per pairing (no lists of its own); above it, pieces in order join into runs."""
    spec = SimSpec(num_layers=2, num_blocks=64, shuffle_blocks=False)
    with PushPair(fabric=fake_fabric, p_spec=spec, post_runs_min_pieces=16) as pair:
        for i, blocks in enumerate((2, 12)):  # 4 pieces, then 24
            tokens = blocks * spec.block_size
            params = pair.prefill.prefill(f"m{i}-aaaaaaaa", tokens, key=f"m{i}")
            pair.decode.expect(f"m{i}-bbbbbbbb", tokens, params, key=f"m{i}")
            pair.pump(lambda i=i: f"m{i}-bbbbbbbb" in pair.received, what=f"push {i}")
            assert pair.received[f"m{i}-bbbbbbbb"] is None
            checked, wrong = pair.decode.verify(f"m{i}-bbbbbbbb")
            assert checked > 0 and wrong == 0
            assert pair.prefill.workers[0].stats().get("write.runs", 0) == i  # only the large one
