"""The fake NIXL fabric: real bytes, real NIXL errors, and every injectable fault."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pushactors.testing import FakeFabric, FakeNixlAgent, FakeNixlError, FaultPlan, FaultyAgent, notif_contains
from pushactors.transport.agent import LOCAL_AGENT

NBLOCKS = 8
BLOCK = 64  # bytes per block


def block_descs(t: torch.Tensor, block: int = BLOCK) -> np.ndarray:
    """One (addr, len, dev) row per block of a contiguous uint8 tensor."""
    base = t.data_ptr()
    n = t.numel() // block
    return np.array([[base + i * block, block, 0] for i in range(n)], dtype=np.uint64)


def whole(t: torch.Tensor) -> np.ndarray:
    return np.array([[t.data_ptr(), t.numel() * t.element_size(), 0]], dtype=np.uint64)


def idx(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    """P writes into D: both agents registered, metadata exchanged, dlists prepped on P."""

    fabric: FakeFabric
    p: FakeNixlAgent
    d: FakeNixlAgent
    src: torch.Tensor
    dst: torch.Tensor
    local: object
    remote: object

    def src_block(self, i: int) -> torch.Tensor:
        return self.src.view(NBLOCKS, BLOCK)[i]

    def dst_block(self, i: int) -> torch.Tensor:
        return self.dst.view(NBLOCKS, BLOCK)[i]

    def xfer(self, li: list[int], ri: list[int], notif: bytes = b"req-1:1") -> object:
        return self.p.make_prepped_xfer("WRITE", self.local, idx(*li), self.remote, idx(*ri), notif)

    def untouched_zero(self, written: list[int]) -> bool:
        return all(not self.dst_block(i).any() for i in range(NBLOCKS) if i not in written)

    def landed(self, pairs: list[tuple[int, int]]) -> bool:
        return all(torch.equal(self.dst_block(r), self.src_block(s)) for s, r in pairs)


def make_rig(fabric: FakeFabric) -> Rig:
    p = fabric.agent("P")
    d = fabric.agent("D")
    # Every byte of src is non-zero and each block differs, so a misplaced block is visible.
    src = (torch.arange(NBLOCKS * BLOCK, dtype=torch.int64) % 251 + 1).to(torch.uint8)
    dst = torch.zeros(NBLOCKS * BLOCK, dtype=torch.uint8)
    p.register_memory(whole(src), "DRAM")
    d.register_memory(whole(dst), "DRAM")
    assert p.add_remote_agent(d.get_agent_metadata()) == "D"
    assert d.add_remote_agent(p.get_agent_metadata()) == "P"
    local = p.prep_xfer_dlist(LOCAL_AGENT, block_descs(src), "DRAM")
    remote = p.prep_xfer_dlist("D", block_descs(dst), "DRAM")
    return Rig(fabric, p, d, src, dst, local, remote)


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield make_rig(FakeFabric())


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def crig(clock: ManualClock) -> Rig:
    """A rig whose fabric runs on a manual clock."""
    return make_rig(FakeFabric(clock=clock))


def poll_state(agent: FakeNixlAgent, handle: object, want: str, timeout: float = 5.0) -> float:
    """Poll until ``handle`` reaches ``want``; return when (monotonic) it was first seen."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        state = agent.check_xfer_state(handle)
        if state == want:
            return time.monotonic()
        assert state == "PROC", f"unexpected state {state}"
        assert time.monotonic() < deadline, f"transfer never reached {want}"
        pause.wait(0.001)


# ---------------------------------------------------------------------------------------------
# The happy path
# ---------------------------------------------------------------------------------------------
def test_write_lands_bytes_in_the_right_blocks_and_notifies(rig: Rig) -> None:
    assert not rig.dst.any()
    h = rig.xfer([0, 2, 5], [7, 1, 3], b"req-1:1")
    rig.p.transfer(h)
    assert rig.p.check_xfer_state(h) == "DONE"
    assert rig.landed([(0, 7), (2, 1), (5, 3)])
    assert rig.untouched_zero([7, 1, 3])
    # The source is untouched.
    assert rig.src.view(NBLOCKS, BLOCK)[0][0].item() == 1
    assert rig.d.get_new_notifs() == {"P": [b"req-1:1"]}
    assert rig.d.get_new_notifs() == {}  # drained
    assert rig.p.get_new_notifs() == {}  # the writer gets nothing back
    assert rig.fabric.stats.transfers_done == 1
    assert rig.fabric.stats.bytes_moved == 3 * BLOCK
    assert rig.fabric.in_flight() == 0


def test_a_post_names_the_notification_of_a_write_made_without_one(rig: Rig) -> None:
    """As NIXL's ``transfer(handle, notif_msg)``: the post's notification replaces the handle's;
    an empty one leaves the handle's own."""
    h = rig.xfer([0], [7], b"")
    assert rig.p.transfer(h, b"late:1") == "DONE" or poll_state(rig.p, h, "DONE")
    assert rig.landed([(0, 7)])
    assert rig.d.get_new_notifs() == {"P": [b"late:1"]}
    h2 = rig.xfer([1], [6], b"own:1")
    assert rig.p.transfer(h2, b"") == "DONE" or poll_state(rig.p, h2, "DONE")
    assert rig.d.get_new_notifs() == {"P": [b"own:1"]}


def test_notification_only_after_bytes_landed(rig: Rig) -> None:
    gate = rig.fabric.faults.hold_transfer()
    h = rig.xfer([1, 2], [4, 6], b"req-held:1")
    assert rig.p.transfer(h) == "PROC"
    for _ in range(3):
        assert rig.p.check_xfer_state(h) == "PROC"
        assert not rig.dst.any()
        assert rig.d.get_new_notifs() == {}
    assert rig.fabric.in_flight() == 1
    gate.open()
    # D polls first: the notif it sees must already have its bytes behind it.
    notifs = rig.d.get_new_notifs()
    assert notifs == {"P": [b"req-held:1"]}
    assert rig.landed([(1, 4), (2, 6)])
    assert rig.untouched_zero([4, 6])
    assert rig.p.check_xfer_state(h) == "DONE"


def test_send_notif_between_loaded_agents(rig: Rig) -> None:
    rig.d.send_notif("P", b"PUSH_REG:x")
    rig.d.send_notif("P", b"HB:a,b")
    assert rig.p.get_new_notifs() == {"D": [b"PUSH_REG:x", b"HB:a,b"]}
    assert rig.fabric.stats.notifs_sent == 2
    assert rig.fabric.stats.notifs_delivered == 2


def test_inject_notif_delivers_raw_bytes(rig: Rig) -> None:
    rig.d.inject_notif("ghost", b"\xff\x00not msgpack")
    rig.d.inject_notif("ghost", b"")
    assert rig.d.get_new_notifs() == {"ghost": [b"\xff\x00not msgpack", b""]}
    assert rig.d.get_new_notifs() == {}
    assert rig.p.get_new_notifs() == {}


# ---------------------------------------------------------------------------------------------
# Errors real NIXL raises
# ---------------------------------------------------------------------------------------------
def test_send_notif_and_prep_to_unloaded_remote_raise(rig: Rig) -> None:
    with pytest.raises(FakeNixlError) as err:
        rig.p.send_notif("nobody", b"x")
    assert err.value.status == "NIXL_ERR_NOT_FOUND"
    with pytest.raises(FakeNixlError):
        rig.p.prep_xfer_dlist("nobody", block_descs(rig.dst), "DRAM")
    # An agent that exists on the fabric but whose metadata was never loaded is unknown too.
    e = rig.fabric.agent("E")
    with pytest.raises(FakeNixlError):
        e.send_notif("D", b"x")
    with pytest.raises(FakeNixlError):
        e.prep_xfer_dlist("D", block_descs(rig.dst), "DRAM")
    assert rig.d.get_new_notifs() == {}


def test_removed_remote_is_unknown_again(rig: Rig) -> None:
    rig.p.remove_remote_agent("D")
    assert "D" not in rig.p.remote_agents
    with pytest.raises(FakeNixlError):
        rig.p.send_notif("D", b"x")
    with pytest.raises(FakeNixlError):
        rig.p.remove_remote_agent("D")


def test_undecodable_metadata_raises(rig: Rig) -> None:
    with pytest.raises(FakeNixlError):
        rig.p.add_remote_agent(b"\x00garbage")


def test_local_descriptor_outside_registered_memory_raises(rig: Rig) -> None:
    base = rig.src.data_ptr()
    end = base + NBLOCKS * BLOCK
    for row in ([end, BLOCK, 0], [end - 8, 16, 0], [base - 1, 8, 0]):
        with pytest.raises(FakeNixlError):
            rig.p.prep_xfer_dlist(LOCAL_AGENT, np.array([row], dtype=np.uint64), "DRAM")
    # The last byte exactly is fine.
    rig.p.prep_xfer_dlist(LOCAL_AGENT, np.array([[end - 1, 1, 0]], dtype=np.uint64), "DRAM")


def test_remote_descriptor_outside_registered_memory_raises(rig: Rig) -> None:
    base = rig.dst.data_ptr()
    end = base + NBLOCKS * BLOCK
    for row in ([end, BLOCK, 0], [end - 8, 16, 0]):
        with pytest.raises(FakeNixlError):
            rig.p.prep_xfer_dlist("D", np.array([row], dtype=np.uint64), "DRAM")
    # P's own memory is not D's: a remote list cannot point into it.
    with pytest.raises(FakeNixlError):
        rig.p.prep_xfer_dlist("D", block_descs(rig.src), "DRAM")


def test_remote_dlist_is_stale_after_remote_reload(rig: Rig) -> None:
    rig.p.remove_remote_agent("D")
    rig.p.add_remote_agent(rig.d.get_agent_metadata())  # a new generation of D
    with pytest.raises(FakeNixlError):
        rig.xfer([0], [0])
    # A list prepped against the reloaded remote works.
    fresh = rig.p.prep_xfer_dlist("D", block_descs(rig.dst), "DRAM")
    h = rig.p.make_prepped_xfer("WRITE", rig.local, idx(0), fresh, idx(0), b"ok:1")
    rig.p.transfer(h)
    assert rig.p.check_xfer_state(h) == "DONE"
    assert rig.landed([(0, 0)])


def test_mismatched_or_out_of_range_indices_raise(rig: Rig) -> None:
    with pytest.raises(FakeNixlError):
        rig.xfer([0, 1], [0])
    with pytest.raises(FakeNixlError):
        rig.xfer([0], [NBLOCKS])
    with pytest.raises(FakeNixlError):
        rig.xfer([-1], [0])
    assert not rig.dst.any()


def test_vram_registration_raises(rig: Rig) -> None:
    t = torch.zeros(BLOCK, dtype=torch.uint8)
    with pytest.raises(FakeNixlError) as err:
        rig.p.register_memory(whole(t), "VRAM")
    assert err.value.status == "NIXL_ERR_NOT_SUPPORTED"


def test_only_write_is_supported_and_released_handles_are_refused(rig: Rig) -> None:
    with pytest.raises(FakeNixlError):
        rig.p.make_prepped_xfer("READ", rig.local, idx(0), rig.remote, idx(0), b"")
    h = rig.xfer([0], [0])
    rig.p.release_xfer_handle(h)
    with pytest.raises(FakeNixlError):
        rig.p.transfer(h)
    assert not rig.dst.any()


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------
def test_fail_add_remote_once_then_succeeds() -> None:
    fabric = FakeFabric()
    p, d = fabric.agent("P"), fabric.agent("D")
    fault = fabric.faults.fail_add_remote()
    md = d.get_agent_metadata()
    with pytest.raises(FakeNixlError):
        p.add_remote_agent(md)
    assert "D" not in p.remote_agents
    assert p.add_remote_agent(md) == "D"
    assert fault.hits == 1


def test_fail_add_remote_matches_the_remote_name() -> None:
    fabric = FakeFabric()
    p, d, e = fabric.agent("P"), fabric.agent("D"), fabric.agent("E")
    fault = fabric.faults.fail_add_remote(match=lambda ctx: ctx.src == "P" and ctx.dst == "E", times=None)
    assert p.add_remote_agent(d.get_agent_metadata()) == "D"
    for _ in range(2):
        with pytest.raises(FakeNixlError):
            p.add_remote_agent(e.get_agent_metadata())
    assert fault.hits == 2
    assert p.remote_agents == ("D",)


def test_raise_on_transfer_moves_nothing(rig: Rig) -> None:
    fault = rig.fabric.faults.raise_on_transfer()
    h = rig.xfer([0], [0], b"req-1:1")
    with pytest.raises(FakeNixlError):
        rig.p.transfer(h)
    assert fault.hits == 1
    assert not rig.dst.any()
    assert rig.d.get_new_notifs() == {}
    assert rig.fabric.stats.transfers_posted == 0
    # times=1: the next post goes through.
    rig.p.transfer(h)
    assert rig.p.check_xfer_state(h) == "DONE"
    assert rig.landed([(0, 0)])
    assert fault.hits == 1


def test_err_transfer_no_bytes_no_notif(rig: Rig) -> None:
    fault = rig.fabric.faults.err_transfer(times=2)
    states = []
    for i in range(3):
        h = rig.xfer([i], [i], f"req-{i}:1".encode())
        rig.p.transfer(h)
        states.append(rig.p.check_xfer_state(h))
    assert states == ["ERR", "ERR", "DONE"]
    assert fault.hits == 2
    assert rig.untouched_zero([2])
    assert rig.landed([(2, 2)])
    assert rig.d.get_new_notifs() == {"P": [b"req-2:1"]}
    assert rig.fabric.stats.transfers_err == 2
    assert rig.fabric.stats.bytes_moved == BLOCK


def test_slow_transfer_stays_proc_until_time_passes(rig: Rig) -> None:
    seconds = 0.1
    fault = rig.fabric.faults.slow_transfer(seconds, times=1)
    h = rig.xfer([3], [5], b"slow:1")
    t0 = time.monotonic()
    assert rig.p.transfer(h) == "PROC"
    assert rig.p.check_xfer_state(h) == "PROC"
    assert not rig.dst.any()
    assert rig.d.get_new_notifs() == {}
    done_at = poll_state(rig.p, h, "DONE")
    assert done_at - t0 >= seconds
    assert rig.landed([(3, 5)])
    assert rig.d.get_new_notifs() == {"P": [b"slow:1"]}
    assert fault.hits == 1
    # times=1: the next transfer is immediate.
    h2 = rig.xfer([4], [6], b"fast:1")
    assert rig.p.transfer(h2) == "DONE"


def test_slow_transfer_on_manual_clock(crig: Rig, clock: ManualClock) -> None:
    crig.fabric.faults.slow_transfer(2.0)
    h = crig.xfer([0], [0])
    crig.p.transfer(h)
    clock.now += 1.9
    assert crig.p.check_xfer_state(h) == "PROC"
    assert not crig.dst.any()
    clock.now += 0.2
    assert crig.p.check_xfer_state(h) == "DONE"
    assert crig.landed([(0, 0)])


def test_hold_transfer_matches_only_its_notifs(rig: Rig) -> None:
    gate = rig.fabric.faults.hold_transfer(match=notif_contains("req-a"))
    ha = rig.xfer([0], [0], b"req-a:1")
    hb = rig.xfer([1], [1], b"req-b:1")
    rig.p.transfer(ha)
    rig.p.transfer(hb)
    assert rig.p.check_xfer_state(ha) == "PROC"
    assert rig.p.check_xfer_state(hb) == "DONE"
    assert rig.d.get_new_notifs() == {"P": [b"req-b:1"]}
    assert rig.untouched_zero([1])
    gate.open()
    assert rig.p.check_xfer_state(ha) == "DONE"
    assert rig.d.get_new_notifs() == {"P": [b"req-a:1"]}


def test_drop_notif_lands_bytes_but_drops_notification(rig: Rig) -> None:
    fault = rig.fabric.faults.drop_notif()
    h = rig.xfer([0], [0], b"req-1:1")
    rig.p.transfer(h)
    assert rig.p.check_xfer_state(h) == "DONE"
    assert rig.landed([(0, 0)])
    assert rig.d.get_new_notifs() == {}
    assert rig.fabric.stats.notifs_dropped == 1
    assert fault.hits == 1
    rig.d.send_notif("P", b"HB:x")  # times=1: the next one passes
    assert rig.p.get_new_notifs() == {"D": [b"HB:x"]}
    assert fault.hits == 1


def test_drop_notif_with_matcher(rig: Rig) -> None:
    fault = rig.fabric.faults.drop_notif(match=notif_contains(b"HB:"), times=None)
    rig.d.send_notif("P", b"HB:1")
    rig.d.send_notif("P", b"PUSH_REG:1")
    rig.d.send_notif("P", b"HB:2")
    assert rig.p.get_new_notifs() == {"D": [b"PUSH_REG:1"]}
    assert fault.hits == 2


def test_delay_notif_on_manual_clock(crig: Rig, clock: ManualClock) -> None:
    fault = crig.fabric.faults.delay_notif(5.0)
    h = crig.xfer([2], [2], b"late:1")
    crig.p.transfer(h)
    assert crig.p.check_xfer_state(h) == "DONE"
    assert crig.landed([(2, 2)])  # bytes are there, the notif is not yet
    assert crig.d.get_new_notifs() == {}
    clock.now += 4.9
    assert crig.d.get_new_notifs() == {}
    clock.now += 0.2
    assert crig.d.get_new_notifs() == {"P": [b"late:1"]}
    assert fault.hits == 1
    # times=1: the next notif is immediate.
    crig.p.send_notif("D", b"now")
    assert crig.d.get_new_notifs() == {"P": [b"now"]}


def test_delay_notif_in_real_time(rig: Rig) -> None:
    rig.fabric.faults.delay_notif(0.03)
    t0 = time.monotonic()
    rig.d.send_notif("P", b"HB:late")
    deadline = t0 + 5.0
    pause = threading.Event()
    got: dict[str, list[bytes]] = {}
    while not got:
        got = rig.p.get_new_notifs()
        assert time.monotonic() < deadline, "delayed notif never arrived"
        if not got:
            pause.wait(0.001)
    assert time.monotonic() - t0 >= 0.03
    assert got == {"D": [b"HB:late"]}


def test_duplicate_notif_delivers_copies(rig: Rig) -> None:
    fault = rig.fabric.faults.duplicate_notif(copies=2)
    h = rig.xfer([0], [0], b"req-1:1")
    rig.p.transfer(h)
    assert rig.d.get_new_notifs() == {"P": [b"req-1:1"] * 3}
    assert rig.fabric.stats.notifs_duplicated == 2
    assert fault.hits == 1
    rig.p.send_notif("D", b"once")
    assert rig.d.get_new_notifs() == {"P": [b"once"]}


def test_fail_send_notif_with_matcher_and_times(rig: Rig) -> None:
    fault = rig.fabric.faults.fail_send_notif(match=notif_contains("PUSH_REG:"), times=1)
    rig.d.send_notif("P", b"HB:1")  # not matched
    with pytest.raises(FakeNixlError):
        rig.d.send_notif("P", b"PUSH_REG:a")
    rig.d.send_notif("P", b"PUSH_REG:b")  # times=1 spent
    assert rig.p.get_new_notifs() == {"D": [b"HB:1", b"PUSH_REG:b"]}
    assert fault.hits == 1


def test_fail_send_notif_does_not_affect_write_notifications(rig: Rig) -> None:
    fault = rig.fabric.faults.fail_send_notif(times=None)
    h = rig.xfer([0], [0], b"req-1:1")
    rig.p.transfer(h)
    assert rig.d.get_new_notifs() == {"P": [b"req-1:1"]}
    assert fault.hits == 0


def test_faults_cleared(rig: Rig) -> None:
    rig.fabric.faults.err_transfer(times=None)
    rig.fabric.faults.clear()
    h = rig.xfer([0], [0])
    rig.p.transfer(h)
    assert rig.p.check_xfer_state(h) == "DONE"


# ---------------------------------------------------------------------------------------------
# Stats, cancellation, threads
# ---------------------------------------------------------------------------------------------
def test_contiguous_blocks_merge_and_strided_do_not(rig: Rig) -> None:
    cases = [
        ([0, 1, 2], [3, 4, 5], 1),  # contiguous on both sides
        ([0, 2, 4], [1, 3, 5], 3),  # strided on both sides
        ([0, 1, 2], [3, 4, 6], 2),  # contiguous locally, gap remotely
        ([5, 6], [2, 1], 2),  # contiguous locally, backwards remotely
    ]
    for li, ri, _ in cases:
        h = rig.xfer(li, ri)
        rig.p.transfer(h)
        assert rig.p.check_xfer_state(h) == "DONE"
        rig.p.release_xfer_handle(h)
    stats = rig.fabric.stats
    assert stats.per_transfer_merged == [c[2] for c in cases]
    assert stats.bytes_moved == sum(len(c[0]) for c in cases) * BLOCK
    assert stats.descriptors == sum(len(c[0]) for c in cases)
    assert stats.merged_descriptors == sum(c[2] for c in cases)
    assert rig.p.live_handles == 0


def test_release_of_proc_transfer_cancels_it(rig: Rig) -> None:
    gate = rig.fabric.faults.hold_transfer()
    h = rig.xfer([0, 1], [0, 1], b"req-1:1")
    assert rig.p.transfer(h) == "PROC"
    assert rig.p.live_handles == 1
    rig.p.release_xfer_handle(h)
    assert rig.p.live_handles == 0
    gate.open()
    assert rig.d.get_new_notifs() == {}
    rig.fabric.progress()
    assert not rig.dst.any()
    assert rig.fabric.in_flight() == 0
    assert rig.fabric.stats.transfers_cancelled == 1
    assert rig.fabric.stats.bytes_moved == 0


def test_release_dlist_handle(rig: Rig) -> None:
    assert rig.p.live_dlists == 2
    rig.p.release_dlist_handle(rig.remote)
    assert rig.p.live_dlists == 1
    with pytest.raises(FakeNixlError):
        rig.xfer([0], [0])


def test_calling_threads_records_who_called(rig: Rig) -> None:
    assert "writer-x" not in rig.p.calling_threads
    errors: list[BaseException] = []

    def work() -> None:
        try:
            h = rig.xfer([0], [0])
            rig.p.transfer(h)
            rig.p.check_xfer_state(h)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    t = threading.Thread(target=work, name="writer-x")
    t.start()
    t.join(timeout=5)
    assert not t.is_alive()
    assert errors == []
    assert "writer-x" in rig.p.calling_threads
    assert threading.current_thread().name in rig.p.calling_threads  # set-up ran here
    assert "writer-x" not in rig.d.calling_threads
    assert rig.p.calls["transfer"] == 1
    assert rig.p.calls["make_prepped_xfer"] == 1


def test_duplicate_agent_name_refused() -> None:
    fabric = FakeFabric()
    fabric.agent("P")
    with pytest.raises(FakeNixlError):
        fabric.agent("P")


def test_hold_transfer_times_respected(rig: Rig) -> None:
    gate = rig.fabric.faults.hold_transfer(times=1)
    h1 = rig.xfer([0], [0], b"one:1")
    h2 = rig.xfer([1], [1], b"two:1")
    assert rig.p.transfer(h1) == "PROC"
    assert rig.p.transfer(h2) == "DONE"
    assert rig.d.get_new_notifs() == {"P": [b"two:1"]}
    assert rig.untouched_zero([1])
    gate.open()
    assert rig.p.check_xfer_state(h1) == "DONE"
    assert rig.d.get_new_notifs() == {"P": [b"one:1"]}


def test_deregistered_memory_cannot_be_prepped(rig: Rig) -> None:
    extra = torch.zeros(BLOCK, dtype=torch.uint8)
    reg = rig.p.register_memory(whole(extra), "DRAM")
    rig.p.prep_xfer_dlist(LOCAL_AGENT, whole(extra), "DRAM")
    rig.p.deregister_memory(reg)
    with pytest.raises(FakeNixlError):
        rig.p.prep_xfer_dlist(LOCAL_AGENT, whole(extra), "DRAM")
    # Other registrations are untouched.
    rig.p.prep_xfer_dlist(LOCAL_AGENT, block_descs(rig.src), "DRAM")


# ---------------------------------------------------------------------------------------------
# One reader of a plan: FaultyAgent, on the fabric and around any agent
# ---------------------------------------------------------------------------------------------
def test_each_agents_faulty_reader_counts_what_the_fabric_injected(rig: Rig) -> None:
    rig.fabric.faults.err_transfer(times=1)
    rig.fabric.faults.drop_notif(match=notif_contains("HB:"), times=1)
    h = rig.xfer([0], [0], b"req-1:1")
    rig.p.transfer(h)
    assert rig.p.check_xfer_state(h) == "ERR"
    rig.d.send_notif("P", b"HB:1")
    assert rig.p.get_new_notifs() == {}
    assert rig.p.faulty.injected == {"err_transfer": 1}  # the poster's reader
    assert rig.d.faulty.injected == {"drop_notif": 1}  # the sender's reader
    assert rig.fabric.stats.transfers_err == 1 and rig.fabric.stats.notifs_dropped == 1


def test_faulty_agent_around_an_agent_applies_the_same_rules(rig: Rig) -> None:
    """The wrapper that goes around a real NIXL agent, here around a fabric agent whose own
    plan stays empty: the wrapper alone injects, and matches a WRITE by its remote's name."""
    plan = FaultPlan()
    p, d = FaultyAgent(rig.p, plan), FaultyAgent(rig.d, plan)
    remote = p.prep_xfer_dlist("D", block_descs(rig.dst), "DRAM")
    err = plan.err_transfer(match=lambda c: (c.src, c.dst, c.op) == ("P", "D", "WRITE"))
    h = p.make_prepped_xfer("WRITE", rig.local, idx(0), remote, idx(0), b"req-1:1")
    assert p.transfer(h) == "PROC"
    assert p.check_xfer_state(h) == "ERR"
    p.release_xfer_handle(h)
    assert err.hits == 1 and not rig.dst.any() and d.get_new_notifs() == {}
    assert rig.fabric.stats.transfers_posted == 0  # never posted
    gate = plan.hold_transfer(match=notif_contains("req-2"))
    h2 = p.make_prepped_xfer("WRITE", rig.local, idx(1), remote, idx(1), b"req-2:1")
    assert p.transfer(h2) == "PROC"
    assert p.check_xfer_state(h2) == "PROC" and rig.fabric.stats.transfers_posted == 0  # held unposted
    gate.open()
    assert p.check_xfer_state(h2) == "DONE"
    assert rig.landed([(1, 1)]) and rig.untouched_zero([1])
    plan.duplicate_notif(match=notif_contains("req-2"), copies=2)  # applied as D polls
    assert d.get_new_notifs() == {"P": [b"req-2:1"] * 3}
    assert p.injected == {"err_transfer": 1, "hold_transfer": 1} and d.injected == {"duplicate_notif": 1}


def test_faulty_agent_around_an_agent_slows_a_write_on_its_clock(rig: Rig, clock: ManualClock) -> None:
    plan = FaultPlan()
    p = FaultyAgent(rig.p, plan, clock=clock)
    plan.slow_transfer(2.0, times=1)
    h = p.make_prepped_xfer("WRITE", rig.local, idx(2), rig.remote, idx(2), b"slow:1")
    assert p.transfer(h) == "PROC"
    clock.now += 1.9
    assert p.check_xfer_state(h) == "PROC" and not rig.dst.any()
    clock.now += 0.2
    assert p.check_xfer_state(h) == "DONE"
    assert rig.landed([(2, 2)]) and rig.d.get_new_notifs() == {"P": [b"slow:1"]}
