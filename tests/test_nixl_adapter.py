"""The real NIXL adapter: same interface as the fake, and only the writer ever calls it."""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np
import pytest
import torch

from pushactors.testing import PushPair, SimSpec
from pushactors.transport.nixl import NixlAgent

pytestmark = pytest.mark.real_nixl


class RecordingAgent:
    """Wraps a real agent and records which thread made each call."""

    calls: defaultdict[str, set[str]] = defaultdict(set)

    def __init__(self, name: str) -> None:
        self._agent = NixlAgent(name)
        self.calls_here = RecordingAgent.calls
        self._record("__init__")

    def _record(self, method: str) -> None:
        self.calls_here[threading.current_thread().name].add(method)

    @property
    def name(self) -> str:
        return self._agent.name

    def __getattr__(self, item: str):
        target = getattr(self._agent, item)
        if not callable(target):
            return target

        def call(*args, **kwargs):
            self._record(item)
            return target(*args, **kwargs)

        return call


def test_real_nixl_in_process_pair_moves_bytes_and_only_writers_call_agents() -> None:
    RecordingAgent.calls.clear()
    spec = SimSpec(num_layers=2, num_blocks=64, block_bytes=1024)
    with PushPair(agent_factory=RecordingAgent, p_spec=spec) as pair:
        ids = []
        for i in range(8):
            params = pair.prefill.prefill(f"n{i}-aaaaaaaa", 30 + 9 * i, key=f"k{i}")
            pair.decode.expect(f"n{i}-bbbbbbbb", 30 + 9 * i, params, key=f"k{i}")
            ids.append(f"n{i}-bbbbbbbb")
        pair.pump(lambda: all(i in pair.received for i in ids) and len(pair.sent) == 8, timeout=60)
        for d_id in ids:
            assert pair.received[d_id] is None
            checked, wrong = pair.decode.verify(d_id)
            assert checked > 0 and wrong == 0
    threads = set(RecordingAgent.calls)
    assert threads, "no agent calls recorded"
    # Pykka names actor threads after the actor class: every call came from a writer.
    assert all(t.startswith("Writer") for t in threads), threads
    methods = set().union(*RecordingAgent.calls.values())
    assert {
        "register_memory",
        "add_remote_agent",
        "make_prepped_xfer",
        "transfer",
        "send_notif",
        "get_new_notifs",
    } <= methods


class CountingAgent(RecordingAgent):
    """Counts descriptor lists prepared and released, per call."""

    counts: defaultdict[str, int] = defaultdict(int)

    def __getattr__(self, item: str):
        call = super().__getattr__(item)
        if item in ("prep_xfer_dlist", "release_dlist_handle", "make_prepped_xfer"):
            CountingAgent.counts[item] += 1
        return call


def test_real_nixl_pushes_in_order_blocks_as_runs_and_releases_their_lists() -> None:
    """Blocks in order on both sides: each WRITE goes to NIXL as a few runs in lists made for
    it, the bytes land, and every list prepared is released by the time the pair stops."""
    CountingAgent.counts.clear()
    spec = SimSpec(num_layers=2, num_blocks=64, block_bytes=1024, shuffle_blocks=False)
    with PushPair(agent_factory=CountingAgent, p_spec=spec, post_runs_min_pieces=0) as pair:
        ids = []
        for i in range(4):
            params = pair.prefill.prefill(f"r{i}-aaaaaaaa", 6 * spec.block_size, key=f"k{i}")
            pair.decode.expect(f"r{i}-bbbbbbbb", 6 * spec.block_size, params, key=f"k{i}")
            ids.append(f"r{i}-bbbbbbbb")
            pair.pump(lambda i=i: ids[i] in pair.received, timeout=60)  # one at a time: in order
        for d_id in ids:
            assert pair.received[d_id] is None
            checked, wrong = pair.decode.verify(d_id)
            assert checked > 0 and wrong == 0
        assert pair.prefill.workers[0].stats().get("write.runs", 0) == 4
    # 2 cached lists for the pairing + 2 per push; all released at stop.
    assert CountingAgent.counts["make_prepped_xfer"] == 4
    assert CountingAgent.counts["prep_xfer_dlist"] == 2 + 2 * 4
    assert CountingAgent.counts["release_dlist_handle"] == CountingAgent.counts["prep_xfer_dlist"]


def test_adapter_round_trip_between_two_agents() -> None:
    a, b = NixlAgent("adapter-a"), NixlAgent("adapter-b")
    src = torch.arange(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    reg_a = a.register_memory(np.array([[src.data_ptr(), 4096, 0]], dtype=np.uint64), "DRAM")
    reg_b = b.register_memory(np.array([[dst.data_ptr(), 4096, 0]], dtype=np.uint64), "DRAM")
    assert a.add_remote_agent(b.get_agent_metadata()) == "adapter-b"
    local = a.prep_xfer_dlist(
        "NIXL_INIT_AGENT", np.array([[src.data_ptr() + 1024 * i, 1024, 0] for i in range(4)], dtype=np.uint64), "DRAM"
    )
    remote = a.prep_xfer_dlist(
        "adapter-b", np.array([[dst.data_ptr() + 1024 * i, 1024, 0] for i in range(4)], dtype=np.uint64), "DRAM"
    )
    handle = a.make_prepped_xfer("WRITE", local, np.array([0, 1]), remote, np.array([3, 2]), b"req:1")
    state = a.transfer(handle)
    notifs: dict[str, list[bytes]] = {}
    for _ in range(100000):
        if state == "DONE" and notifs:
            break
        if state == "PROC":
            state = a.check_xfer_state(handle)
        notifs.update(b.get_new_notifs())
    assert state == "DONE"
    assert notifs == {"adapter-a": [b"req:1"]}
    assert torch.equal(dst[3072:4096], src[0:1024]) and torch.equal(dst[2048:3072], src[1024:2048])
    assert int(dst[:2048].sum()) == 0
    a.release_xfer_handle(handle)
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)
    a.remove_remote_agent("adapter-b")
    a.deregister_memory(reg_a)
    b.deregister_memory(reg_b)


def test_a_write_made_without_a_notification_carries_the_one_its_post_names() -> None:
    """What the writer relies on to make a layer-wise push's last WRITE ahead: the post's
    notification replaces the handle's; an empty one leaves the handle's own."""
    a, b = NixlAgent("notif-a"), NixlAgent("notif-b")
    src = torch.arange(2048, dtype=torch.uint8)
    dst = torch.zeros(2048, dtype=torch.uint8)
    reg_a = a.register_memory(np.array([[src.data_ptr(), 2048, 0]], dtype=np.uint64), "DRAM")
    reg_b = b.register_memory(np.array([[dst.data_ptr(), 2048, 0]], dtype=np.uint64), "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[src.data_ptr(), 1024, 0]], dtype=np.uint64), "DRAM")
    remote = a.prep_xfer_dlist(
        "notif-b", np.array([[dst.data_ptr() + 1024 * i, 1024, 0] for i in range(2)], dtype=np.uint64), "DRAM"
    )

    def post(handle: object, notif: bytes) -> list[bytes]:
        state = a.transfer(handle, notif)
        got: list[bytes] = []
        for _ in range(100000):
            if state == "DONE" and got:
                break
            if state == "PROC":
                state = a.check_xfer_state(handle)
            got.extend(b.get_new_notifs().get("notif-a", []))
        assert state == "DONE"
        a.release_xfer_handle(handle)
        return got

    assert post(a.make_prepped_xfer("WRITE", local, np.array([0]), remote, np.array([0]), b""), b"late:1") == [
        b"late:1"
    ]
    assert post(a.make_prepped_xfer("WRITE", local, np.array([0]), remote, np.array([1]), b"own:1"), b"") == [b"own:1"]
    assert torch.equal(dst[:1024], src[:1024]) and torch.equal(dst[1024:], src[:1024])
    a.release_dlist_handle(local)
    a.release_dlist_handle(remote)
    a.remove_remote_agent("notif-b")
    a.deregister_memory(reg_a)
    b.deregister_memory(reg_b)
