"""Verified pushes (``verify``): P sends a digest of exactly the bytes it wrote, D checks it
against the blocks it will read once they landed, and a mismatch fails the request visibly.

The digest's properties are proven on plain buffers; the rest runs real actors over the fake
fabric (which moves real bytes) with corruption injected after the bytes landed and before D
hears the completion, and once over real NIXL on DRAM.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import structlog
import torch
from scenario_kit import assert_clean, legs, make_pair, stat

import pushactors.actors.writer.verify as verify_module
from pushactors.actors.base import RankContext
from pushactors.actors.writer.verify import Verdict, Verifier
from pushactors.core.blocks import KVLayout, KVRegion
from pushactors.core.config import ConfigError, PushConfig
from pushactors.protocol import (
    PUSH_DIGEST_PREFIX,
    Completion,
    MalformedMessage,
    PeerKey,
    PushDigest,
    Registration,
    decode_notification,
    encode_completion,
)
from pushactors.testing import PushPair, SimSpec
from pushactors.testing.engine import SimEngine
from pushactors.testing.faults import FaultContext, completion_of, notif_contains
from pushactors.transport.copies import ByteViews
from pushactors.transport.digest import MASK64, KVDigest, reference_digest

MISMATCH = "KV digest mismatch"


# --- the digest ------------------------------------------------------------------------------
def _digest(kv: KVDigest, src: list[int], dst: list[int], lengths: list[int], region: int = 0) -> int:
    """The digest of pieces of ``kv``'s memory landing at offsets ``dst`` of D's ``region``."""
    u64 = np.uint64
    out = kv.sums(
        np.array(src, dtype=u64),
        np.full(len(src), region, dtype=np.int64),
        np.array(dst, dtype=u64),
        np.array(lengths, dtype=u64),
        np.zeros(len(src), np.int64),
        1,
    )
    return out[0][0]


@pytest.fixture
def buffer() -> tuple[torch.Tensor, KVDigest]:
    t = torch.randint(0, 256, (1 << 15,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    return t, KVDigest(ByteViews([t]))


def test_digest_matches_its_definition_aligned_or_not(buffer: tuple[torch.Tensor, KVDigest]) -> None:
    t, kv = buffer
    base, raw = t.data_ptr(), bytes(t.numpy())
    # Aligned pieces landing elsewhere, and ragged ones (any offset and length).
    cases = (
        (0, 64, 0x1000),
        (512, 1024, 0x7F0000),
        (3, 13, 0x2005),
        (17, 200, 0x3003),
        (8, 3000, 0x12FF8),  # ragged, across a page of D's
        (0, 16384, 0x20000),  # four whole pages, one run of P's memory (read in place)
        (64, 8192, 0x3F00),  # aligned, across pages at another place in them
    )
    for off, length, at in cases:
        for region in (0, 5):
            want = reference_digest(raw[off : off + length], region, at)
            assert _digest(kv, [base + off], [at], [length], region) == want


def test_digest_adds_up_over_any_split_of_the_same_bytes(buffer: tuple[torch.Tensor, KVDigest]) -> None:
    """P's ranks each digest their part; D digests the whole: the sums agree however the bytes
    are cut (head slices, unaligned pieces)."""
    t, kv = buffer
    base = t.data_ptr()
    whole = _digest(kv, [base], [base], [2048])
    rng = random.Random(1)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, 2048), 5))
        edges = [0, *cuts, 2048]
        pieces = [(base + a, b - a) for a, b in itertools.pairwise(edges)]
        rng.shuffle(pieces)
        assert _digest(kv, [s for s, _ in pieces], [s for s, _ in pieces], [n for _, n in pieces]) == whole


def test_every_single_flipped_bit_changes_the_digest(buffer: tuple[torch.Tensor, KVDigest]) -> None:
    t, kv = buffer
    base = t.data_ptr()
    clean = _digest(kv, [base], [base], [256])
    for byte in range(256):
        for bit in (0, 3, 7):
            t[byte] ^= 1 << bit
            assert _digest(kv, [base], [base], [256]) != clean, (byte, bit)
            t[byte] ^= 1 << bit
    assert _digest(kv, [base], [base], [256]) == clean


def test_swapped_blocks_and_head_slices_change_the_digest(buffer: tuple[torch.Tensor, KVDigest]) -> None:
    t, kv = buffer
    base = t.data_ptr()
    clean = _digest(kv, [base], [base], [4096])
    for a, b, n in ((0, 1024, 1024), (0, 256, 256), (512, 3584, 512), (8, 16, 8)):
        saved = t.clone()
        t[a : a + n], t[b : b + n] = saved[b : b + n], saved[a : a + n]
        assert _digest(kv, [base], [base], [4096]) != clean, (a, b, n)
        t.copy_(saved)


def test_bytes_landing_in_another_place_digest_differently(buffer: tuple[torch.Tensor, KVDigest]) -> None:
    """Right bytes in the wrong block, or the wrong layer's region: the weights are places in D."""
    t, kv = buffer
    base = t.data_ptr()
    assert _digest(kv, [base], [0x10000], [512]) != _digest(kv, [base], [0x10200], [512])
    assert _digest(kv, [base], [0x10000], [512], region=1) != _digest(kv, [base], [0x10000], [512], region=2)


# --- D's verifier, thread-free ---------------------------------------------------------------
def _two_p_ranks(
    seed: int, blocks: tuple[int, ...], generation: int
) -> tuple[torch.Tensor, KVLayout, RankContext, Verifier, Registration]:
    """D's one-layer pool of random bytes and a verifier awaiting a registration of ``blocks``
    that two P ranks answer (each writing half of every block)."""
    pool = torch.randint(0, 256, (8, 1024), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    region = KVRegion(pool.data_ptr(), 1024, 1024, 8, members=("layer.0",))
    layout = KVLayout(regions=(region,), mem_type="DRAM", block_size=16)
    ctx = RankContext(config=PushConfig(engine_id="d", verify="all"), engine_id="d")
    ctx.kv_digest = KVDigest(ByteViews([pool]))
    reg = Registration(
        request_id="r",
        decode_engine_id="d",
        decode_host="h",
        decode_port=1,
        decode_tp_size=1,
        local_block_ids=blocks,
        remote_engine_id="p",
        remote_host="ph",
        remote_port=2,
        remote_tp_size=2,
        generation=generation,
        verify=True,
    )
    return pool, layout, ctx, Verifier(ctx, structlog.get_logger()), reg


def _half_digest(pool: torch.Tensor, ctx: RankContext, blocks: tuple[int, ...], h: int) -> tuple[tuple[int, int], ...]:
    """What P rank ``h`` of two wrote into D's one-layer pool: half of each of ``blocks``."""
    offsets = np.array(blocks, dtype=np.uint64) * np.uint64(1024) + np.uint64(512 * h)
    kv = ctx.kv_digest
    assert kv is not None
    n = len(blocks)
    return kv.sums(
        pool.data_ptr() + offsets, np.zeros(n, np.int64), offsets, np.full(n, 512, np.uint64), np.zeros(n, np.int64), 1
    )


def test_verifier_checks_once_every_expected_rank_answered_and_only_then() -> None:
    """Two P ranks each wrote half of every block: D checks the sum of their digests once both
    answered; a stranger, a duplicate or a stale generation neither counts nor triggers it."""
    pool, layout, ctx, verifier, reg = _two_p_ranks(3, (2, 5), 7)

    def half(h: int) -> tuple[tuple[int, int], ...]:  # what P rank h wrote: half of each block
        return _half_digest(pool, ctx, (2, 5), h)

    def peer(tp: int) -> PeerKey:
        return PeerKey("p", "ph", 2, 0, tp)

    def done(tp: int, digest: tuple[tuple[int, int], ...], generation: int = 7) -> str | None:
        return verifier.check(Completion("r", 2, generation, digest), peer(tp), layout).reason

    for corrupt in (False, True):
        verifier.expect(reg)
        assert done(0, half(0)) is None
        assert done(0, half(0)) is None and done(9, half(1)) is None and done(1, half(1), generation=6) is None
        assert ctx.metrics.get("recv.verified") == int(corrupt)  # nothing checked yet
        if corrupt:
            pool[5, 700] ^= 4  # in P rank 1's half, after it landed
        reason = done(1, half(1) if not corrupt else _clean_half(pool, half))
        assert (reason is not None) == corrupt, reason
    assert ctx.metrics.get("recv.verified") == 1 and ctx.metrics.get("recv.verify_failed") == 1


def test_blocks_located_ahead_are_bounded_and_let_go_at_the_check_or_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    """D locates a verified registration's blocks as it goes out, within a byte bound: past it
    a request is located at its check instead, with the same verdict; a check or an abort lets
    its located blocks go."""
    pool, layout, ctx, verifier, reg = _two_p_ranks(3, (2, 5), 7)

    def whole(tp: int) -> tuple[tuple[int, int], ...]:
        return _half_digest(pool, ctx, (2, 5), tp)

    written = (whole(0), whole(1))  # what the two P ranks wrote, digested before any corruption

    def land(r: Registration) -> str | None:
        verifier.check(Completion(r.request_id, 2, 7, written[0]), PeerKey("p", "ph", 2, 0, 0), layout)
        return verifier.check(Completion(r.request_id, 2, 7, written[1]), PeerKey("p", "ph", 2, 0, 1), layout).reason

    verifier.expect(reg, layout)
    size = verifier.located_bytes
    assert size > 0 and verifier.sizes() == {"verify_awaited": 1, "verify_located_bytes": size}
    assert land(reg) is None and verifier.located_bytes == 0
    monkeypatch.setattr(verify_module, "LOCATED_BYTES", size)  # room for one request's blocks
    other = msgspec.structs.replace(reg, request_id="r2")
    verifier.expect(reg, layout)
    verifier.expect(other, layout)  # over the bound: located at its check
    assert verifier.located_bytes == size and verifier.sizes()["verify_awaited"] == 2
    pool[2, 3] ^= 1  # after both landed: each check must see it, located ahead or not
    assert land(other) is not None and land(reg) is not None
    assert verifier.located_bytes == 0 and ctx.metrics.get("recv.verify_failed") == 2
    verifier.expect(reg, layout)
    verifier.forget(reg.request_id, reg.generation)  # D's abort
    assert verifier.sizes() == {"verify_awaited": 0, "verify_located_bytes": 0}


def test_ds_own_pass_runs_once_the_bytes_landed_while_ps_digest_is_still_on_its_way() -> None:
    """D's digest of its blocks needs only the landed bytes: it is made when the last completion
    arrives (held for a digest that follows), not after the digest, and not made again then;
    the verdict is the same either way."""
    for corrupt in (False, True):
        pool, layout, ctx, verifier, reg = _two_p_ranks(9, (3, 4), 5)
        kv = ctx.kv_digest
        assert kv is not None
        passes: list[int] = []
        run = kv.run

        def counted(prepared: Any, passes: list[int] = passes, run: Any = run) -> Any:
            passes.append(len(prepared.nbytes))
            return run(prepared)

        theirs = [_half_digest(pool, ctx, (3, 4), tp) for tp in (0, 1)]  # before any corruption
        if corrupt:
            pool[4, 9] ^= 2  # a wrong byte landed
        kv.run = counted  # type: ignore[method-assign]
        verifier.expect(reg, layout)
        for tp in (0, 1):
            verifier.check(Completion("r", 2, 5, digest_follows=True), PeerKey("p", "ph", 2, 0, tp), layout)
        assert passes == [1]  # D's pass ran at the last completion (one chunk: one region)
        released = None
        for tp in (0, 1):
            digest = PushDigest(request_id="r", generation=5, tp_rank=tp, digest=theirs[tp])
            released = verifier.digest(digest, PeerKey("p", "ph", 2, 0, tp), layout) or released
        assert released is not None and passes == [1]  # compared, not digested again
        assert (released.reason is not None) == corrupt, released.reason


def test_digests_that_follow_their_writes_hold_the_landing_until_all_are_in() -> None:
    """Whole pushes send the digest after the WRITE (``:vf``): D holds the last completion
    until every expected rank's digest came, in either order, then checks; a digest from a
    stranger, of a stale generation, naming another rank, or a second one is dropped and
    counted, and frees nothing."""
    pool, layout, ctx, verifier, reg = _two_p_ranks(5, (1, 6), 3)

    def half(h: int) -> tuple[tuple[int, int], ...]:
        return _half_digest(pool, ctx, (1, 6), h)

    def peer(tp: int) -> PeerKey:
        return PeerKey("p", "ph", 2, 0, tp)

    def completion(tp: int) -> Verdict:
        return verifier.check(Completion("r", 2, 3, digest_follows=True), peer(tp), layout, sender=f"agent-{tp}")

    def digest(tp: int, value: Any, *, generation: int = 3, named: int | None = None, sender: int | None = None) -> Any:
        msg = PushDigest(request_id="r", generation=generation, tp_rank=tp if named is None else named, digest=value)
        return verifier.digest(msg, peer(tp if sender is None else sender), layout)

    # Completions first: the last is held, each rank owes its digest until it comes.
    verifier.expect(reg)
    assert completion(0) == Verdict(owed=True)
    assert completion(1) == Verdict(held=True, owed=True)
    assert verifier.owes("r", peer(0)) and verifier.owes("r", peer(1))
    # A second copy of a completion (a duplicated notification) lands nothing while it is held.
    assert completion(1) == Verdict(held=True, owed=True) and completion(0) == Verdict(held=True, owed=True)
    assert ctx.metrics.get("recv.verify_duplicate") == 2
    dropped = ctx.metrics.get("recv.digest_dropped")
    assert digest(0, half(0), generation=2) is None  # stale
    assert digest(0, half(0), named=1) is None  # names another rank than its sender
    assert verifier.digest(PushDigest(request_id="r", generation=3, digest=half(0)), None, layout) is None  # stranger
    assert ctx.metrics.get("recv.digest_dropped") == dropped + 3
    assert digest(0, half(0)) is None and not verifier.owes("r", peer(0))  # one still owed
    assert digest(0, half(0)) is None  # a second one: dropped
    assert ctx.metrics.get("recv.digest_dropped") == dropped + 4
    released = digest(1, half(1))
    assert released is not None and released.reason is None and released.peer == peer(1)
    assert released.completion.request_id == "r" and released.sender == "agent-1"
    assert ctx.metrics.get("recv.verified") == 1

    # A digest ahead of its completion waits for it; a corrupted block fails on release.
    verifier.expect(reg)
    assert digest(1, half(1)) is None and not verifier.owes("r", peer(1))
    assert completion(0) == Verdict(owed=True)
    pool[6, 100] ^= 8  # in rank 0's half, after it landed
    assert completion(1) == Verdict(held=True)  # its digest came early: only rank 0's is owed
    released = digest(0, _clean(pool, 6, 100, lambda: half(0)))
    assert released is not None and released.reason is not None and "digest mismatch" in released.reason
    assert ctx.metrics.get("recv.verify_failed") == 1

    # A rank that could not digest sends none: landed unverified, and said.
    verifier.expect(reg)
    completion(0)
    completion(1)
    assert digest(0, half(0)) is None
    released = digest(1, ())
    assert released is not None and released.reason is None
    assert ctx.metrics.get("recv.verify_unavailable") == 1


def _clean(pool: torch.Tensor, block: int, byte: int, digest: Callable[[], Any]) -> Any:
    """A digest of the bytes as P sent them (before D's copy was corrupted)."""
    pool[block, byte] ^= 8
    try:
        return digest()
    finally:
        pool[block, byte] ^= 8


def _clean_half(pool: torch.Tensor, half: Callable[[int], Any]) -> Any:
    """P rank 1's digest of the bytes it sent (before D's copy was corrupted)."""
    pool[5, 700] ^= 4
    try:
        return half(1)
    finally:
        pool[5, 700] ^= 4


# --- settings and wire -----------------------------------------------------------------------
def test_verify_setting_is_validated_and_sampling_is_deterministic() -> None:
    for bad in ("on", "sample:", "sample:0", "sample:-1", "sample:2x", "ALL"):
        with pytest.raises(ConfigError, match="verify"):
            PushConfig(engine_id="d", verify=bad)
    with pytest.raises(ConfigError, match="verify"):
        PushConfig.from_dict({"engine_id": "d", "verify": "sometimes"})
    ids = [f"req-{i}" for i in range(4000)]
    assert not any(PushConfig(engine_id="d").verifies(i) for i in ids)
    assert all(PushConfig(engine_id="d", verify="all").verifies(i) for i in ids)
    sample = PushConfig(engine_id="d", verify="sample:8")
    picked = [i for i in ids if sample.verifies(i)]
    assert 350 <= len(picked) <= 650  # 1 in 8 of 4,000: 500 expected
    assert picked == [i for i in ids if PushConfig(engine_id="other", verify="sample:8").verifies(i)]


def test_completion_carries_the_digest_only_when_there_is_one() -> None:
    assert encode_completion("r-1", 2, 5) == b"r-1:2:g5"  # the established format, unchanged
    raw = encode_completion("a:b", 2, 5, ((MASK64, 1 << 40), (0, 0)))
    msg = decode_notification(raw)
    assert (msg.request_id, msg.tp_size, msg.generation, msg.digest) == ("a:b", 2, 5, ((MASK64, 1 << 40), (0, 0)))
    assert decode_notification(encode_completion("r", 1, 0, ((7, 8),))).digest == ((7, 8),)
    for bad in (
        b"r:1:v",
        b"r:1:v1-",
        b"r:1:vz-1",
        b"r:1:v1-1.",
        b"r:1:v" + b"1" * 17 + b"-1",
        b"r:1:v" + b".".join([b"1-1"] * 65),
    ):
        with pytest.raises(MalformedMessage):
            decode_notification(bad)


def test_a_peer_that_predates_verify_ignores_the_registration_field() -> None:
    """An older P decodes a registration with ``verify`` (msgspec ignores unknown fields)."""

    class OldRegistration(msgspec.Struct, frozen=True, kw_only=True, tag="push_reg"):
        request_id: str
        local_block_ids: tuple[Any, ...]

    reg = Registration(
        request_id="r",
        decode_engine_id="d",
        decode_host="h",
        decode_port=1,
        decode_tp_size=1,
        local_block_ids=(1, 2),
        remote_engine_id="p",
        remote_host="h",
        remote_port=2,
        remote_tp_size=1,
        verify=True,
    )
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(reg), type=OldRegistration)
    assert old.request_id == "r"


# --- pushes over the fake fabric -------------------------------------------------------------
def _landed(d: SimEngine, d_id: str) -> None:
    """Every byte of the request's KV is right on D (any layout)."""
    checked, wrong = d.verify(d_id)
    assert checked > 0 and wrong == 0, f"{d_id}: {wrong} of {checked} bytes wrong"


def _push(pair: PushPair, n: str, tokens: int = 40) -> tuple[str, str]:
    p_id, d_id = legs(pair, n, tokens=tokens)
    pair.pump(lambda: d_id in pair.received and p_id in pair.sent, what=f"{n} to end")
    return p_id, d_id


def _completions(pair: PushPair) -> list[bytes]:
    """Every WRITE notification P attaches, recorded by a rule that never fires."""
    seen: list[bytes] = []

    def record(ctx: FaultContext) -> bool:
        if ctx.notif:
            seen.append(ctx.notif)
        return False

    pair.fabric.faults.err_transfer(record, times=None)
    return seen


CLEAN_CASES: dict[str, dict[str, Any]] = {
    "same layout": {},
    "P TP2 -> D TP1": {"p_tp": 2},
    "P TP1 -> D TP2": {"d_tp": 2},
    "NHD TP2 -> HND TP1": {"p_tp": 2, "p_spec": SimSpec(layout="nhd"), "d_spec": SimSpec(layout="hnd")},
    "HND -> block-outermost TP2": {"d_tp": 2, "p_spec": SimSpec(layout="hnd"), "d_spec": SimSpec(layout="blhnc")},
    "kernel blocks": {"p_spec": SimSpec(layout="nhd", kernel_blocks=2)},
    "MLA TP2 -> TP2": {"p_tp": 2, "d_tp": 2, "p_spec": SimSpec(layout="mla")},
    "fused K/V": {"p_spec": SimSpec(layout="fused")},
}


@pytest.mark.parametrize("case", list(CLEAN_CASES))
def test_clean_pushes_verify_across_layouts_and_tp(case: str) -> None:
    """No false alarm: P's ranks weigh each byte by where it lands on D, so their digests add
    up to D's own whatever the pairing."""
    with make_pair(verify="all", **CLEAN_CASES[case]) as pair:
        for i, tokens in enumerate((40, 16, 77)):
            _, d_id = _push(pair, f"c{i}", tokens)
            assert pair.received[d_id] is None, pair.received[d_id]
            _landed(pair.decode, d_id)
        assert stat(pair.decode, "recv.verified") == 3 * pair.decode.tp_size
        for name in ("recv.verify_failed", "recv.verify_uncovered", "recv.verify_unavailable"):
            assert stat(pair.decode, name) == 0, name
        assert_clean(pair)


def test_block_sizes_that_leave_bytes_unwritten_land_unverified_and_say_so() -> None:
    """P's blocks of 16 tokens into D's of 32: D's last block is partly P's to write, so the
    bytes P covers are not the bytes D would digest. Nothing to compare: landed, counted."""
    with make_pair(verify="all", p_spec=SimSpec(layout="nhd"), d_spec=SimSpec(layout="nhd", block_size=32)) as pair:
        _, d_id = _push(pair, "b0", 40)
        assert pair.received[d_id] is None
        _landed(pair.decode, d_id)
        assert stat(pair.decode, "recv.verify_uncovered") == 1 and stat(pair.decode, "recv.verified") == 0


def test_staged_pushes_are_not_asked_for_a_digest() -> None:
    """A staged push lands in D's slot and is scattered into the blocks after: D does not ask."""
    with make_pair(verify="all", staging_bytes=1 << 20, staging_min_runs=0, staging_min_bytes=0) as pair:
        seen = _completions(pair)
        _, d_id = _push(pair, "st0", 77)
        assert pair.received[d_id] is None
        _landed(pair.decode, d_id)
        assert stat(pair.decode, "recv.staged") == 1  # it did go through the slot
        assert stat(pair.decode, "recv.verified") == 0 and stat(pair.prefill, "write.digested") == 0
        assert seen and not any(b":v" in n for n in seen)


def test_layerwise_pushes_verify_over_their_layer_groups() -> None:
    with make_pair(verify="all", push_mode="layerwise", layers_per_write=2, p_tp=2) as pair:
        for i in range(3):
            p_id, d_id = f"lw{i}-aaaaaaaa", f"lw{i}-bbbbbbbb"
            _, params = pair.prefill.forward(p_id, 40, key=f"lw{i}", layerwise=True)
            pair.decode.expect(d_id, 40, params, key=f"lw{i}")
            pair.pump(lambda d_id=d_id, p_id=p_id: d_id in pair.received and p_id in pair.sent)
            assert pair.received[d_id] is None, pair.received[d_id]
            _landed(pair.decode, d_id)
        assert stat(pair.decode, "recv.verified") == 3
        assert_clean(pair)
        # D located each request's blocks when it registered, and let them go at its check.
        writer = pair.decode.workers[0].runtime.snapshot()["writer"]
        assert writer["verify_awaited"] == 0 and writer["verify_located_bytes"] == 0


# Corruptions of D's blocks of one request, made after its bytes landed. Each returns what it
# did and asserts it changed something (a corruption that changes nothing proves nothing).
Corruption = Callable[[SimEngine, str, random.Random], str]


def _block_view(d: SimEngine, rng: random.Random) -> tuple[torch.Tensor, int]:
    kv = d.kv[0]
    t = list(kv.values())[rng.randrange(len(kv))]
    half = rng.randrange(2)
    return (t[half] if d.spec.layout == "split" else t[:, half]), half


def flip_byte(d: SimEngine, d_id: str, rng: random.Random) -> str:
    view, _ = _block_view(d, rng)
    block = rng.choice(d.recvs[d_id].blocks)
    off, bit = rng.randrange(view.shape[1]), rng.randrange(8)
    view[block, off] ^= 1 << bit
    return f"flip block {block} byte {off} bit {bit}"


def stale_block(d: SimEngine, d_id: str, rng: random.Random) -> str:
    """One block left as it was (zeroed, or another request's), not written by this push."""
    view, _ = _block_view(d, rng)
    block = rng.choice(d.recvs[d_id].blocks)
    before = view[block].clone()
    others = [b for b in range(view.shape[0]) if b not in d.recvs[d_id].blocks]
    view[block] = view[rng.choice(others)] if rng.random() < 0.5 else 0
    assert not torch.equal(view[block], before)
    return f"stale block {block}"


def swapped_blocks(d: SimEngine, d_id: str, rng: random.Random) -> str:
    view, _ = _block_view(d, rng)
    a, b = rng.sample(d.recvs[d_id].blocks, 2)
    saved = view[a].clone()
    assert not torch.equal(saved, view[b])
    view[a] = view[b]
    view[b] = saved
    return f"blocks {a} and {b} swapped"


def wrong_head_slice(d: SimEngine, d_id: str, rng: random.Random) -> str:
    """Heads outermost in an opaque block: two heads' slices exchanged."""
    view, _ = _block_view(d, rng)
    block = rng.choice(d.recvs[d_id].blocks)
    width = view.shape[1] // d.spec.kv_heads
    h1, h2 = rng.sample(range(d.spec.kv_heads), 2)
    row = view[block]
    first = row[h1 * width : (h1 + 1) * width].clone()
    assert not torch.equal(first, row[h2 * width : (h2 + 1) * width])
    row[h1 * width : (h1 + 1) * width] = row[h2 * width : (h2 + 1) * width]
    row[h2 * width : (h2 + 1) * width] = first
    return f"heads {h1} and {h2} of block {block} swapped"


CORRUPTIONS: tuple[Corruption, ...] = (flip_byte, stale_block, swapped_blocks, wrong_head_slice)


def test_verify_all_catches_every_injected_corruption() -> None:
    """A flipped byte, a stale block, two blocks swapped, a wrong head slice — injected after
    the WRITE landed, before D hears its completion: every one fails its request, named and
    counted, and its blocks go back; P's side of the push ended normally."""
    rng = random.Random(44)
    trials = 40
    with make_pair(verify="all") as pair:
        done: list[str] = []
        for i in range(trials):
            corrupt = CORRUPTIONS[i % len(CORRUPTIONS)]
            d_id = f"v{i}-bbbbbbbb"

            def inject(_rows: Any, corrupt: Corruption = corrupt, d_id: str = d_id) -> None:
                done.append(corrupt(pair.decode, d_id, rng))

            pair.fabric.faults.corrupt_transfer(inject, completion_of(d_id))
            p_id, _ = _push(pair, f"v{i}", tokens=rng.randrange(33, 120))
            assert len(done) == i + 1, "the corruption did not run"
            reason = pair.received[d_id]
            assert reason is not None and MISMATCH in reason, (done[-1], reason)
            assert "group 0 layers layer." in reason
            assert pair.sent[p_id] is None  # P pushed what it had
        assert stat(pair.decode, "recv.verify_failed") == trials
        assert stat(pair.decode, "recv.verified") == 0
        assert_clean(pair)


def test_layerwise_verify_catches_corruption_in_any_layer_group() -> None:
    """A layer-wise push is digested in one pass once its last WRITE is posted (not group by
    group between the forward's layers): a corruption of any of D's blocks, made as the last
    WRITE lands, still fails the request and names its layers."""
    rng = random.Random(45)
    trials = 8
    with make_pair(verify="all", push_mode="layerwise", layers_per_write=2) as pair:
        done: list[str] = []
        for i in range(trials):
            corrupt = CORRUPTIONS[i % len(CORRUPTIONS)]
            p_id, d_id = f"lwc{i}-aaaaaaaa", f"lwc{i}-bbbbbbbb"

            def inject(_rows: Any, corrupt: Corruption = corrupt, d_id: str = d_id) -> None:
                done.append(corrupt(pair.decode, d_id, rng))

            pair.fabric.faults.corrupt_transfer(inject, completion_of(d_id))
            _, params = pair.prefill.forward(p_id, rng.randrange(33, 120), key=f"lwc{i}", layerwise=True)
            pair.decode.expect(d_id, 40, params, key=f"lwc{i}")
            pair.pump(lambda d_id=d_id, p_id=p_id: d_id in pair.received and p_id in pair.sent)
            assert len(done) == i + 1, "the corruption did not run"
            reason = pair.received[d_id]
            assert reason is not None and MISMATCH in reason, (done[-1], reason)
            assert "layers layer." in reason
            assert pair.sent[p_id] is None
        assert stat(pair.decode, "recv.verify_failed") == trials
        assert stat(pair.prefill, "write.digested") == trials  # one pass a push, not one a group
        assert_clean(pair)


def test_a_lost_digest_fails_the_request_and_an_early_one_still_lands_it() -> None:
    """The digest that follows a whole push's WRITE is its request's last word: lost, the
    request never lands (D's deadline fails it, its blocks go back); overtaking its
    completion, the request still lands verified; a duplicated completion lands nothing
    before it."""
    with make_pair(verify="all") as pair:
        lost = pair.fabric.faults.drop_notif(notif_contains(PUSH_DIGEST_PREFIX))
        p_id, d_id = _push(pair, "lost")
        assert lost.hits == 1
        assert pair.sent[p_id] is None  # P wrote and answered
        reason = pair.received[d_id]
        assert reason is not None and MISMATCH not in reason, reason  # failed, not landed
        assert stat(pair.decode, "recv.taken") == 0 and stat(pair.decode, "recv.verified") == 0

        late = pair.fabric.faults.delay_notif(0.2, completion_of("early-bbbbbbbb"))
        p_id, d_id = _push(pair, "early")
        assert late.hits == 1
        assert pair.received[d_id] is None and pair.sent[p_id] is None
        _landed(pair.decode, d_id)
        assert stat(pair.decode, "recv.verified") == 1

        # A completion delivered twice while its digest is late: the copy lands nothing; the
        # digest does, once.
        twice = pair.fabric.faults.duplicate_notif(completion_of("dup-bbbbbbbb"))
        pair.fabric.faults.delay_notif(0.3, notif_contains(PUSH_DIGEST_PREFIX))
        p_id, d_id = _push(pair, "dup")
        assert twice.hits == 1 and stat(pair.decode, "recv.verify_duplicate") == 1
        assert pair.received[d_id] is None and stat(pair.decode, "recv.verified") == 2
        _landed(pair.decode, d_id)
        assert stat(pair.prefill, "push_digest.sent") == 3
        assert_clean(pair)


def test_a_mismatch_names_the_layers_it_is_in() -> None:
    spec = SimSpec(num_layers=16)
    with make_pair(verify="all", p_spec=spec) as pair:
        d_id = "n0-bbbbbbbb"

        def last_layer(_rows: Any) -> None:
            t = pair.decode.kv[0]["layer.15"]
            t[1, pair.decode.recvs[d_id].blocks[0], 5] ^= 0x10

        pair.fabric.faults.corrupt_transfer(last_layer, completion_of(d_id))
        _push(pair, "n0")
        reason = pair.received[d_id]
        assert reason is not None and MISMATCH in reason
        assert "layers layer.14" in reason and "..layer.15" in reason and "layer.0" not in reason, reason


def test_sample_verifies_the_requests_its_hash_picks_and_no_others() -> None:
    config = PushConfig(engine_id="decode", verify="sample:3")
    with make_pair(verify="sample:3") as pair:
        seen = _completions(pair)
        ids = [_push(pair, f"s{i}")[1] for i in range(24)]
        picked = [d for d in ids if config.verifies(d)]
        assert 0 < len(picked) < len(ids)
        assert all(pair.received[d] is None for d in ids)
        assert stat(pair.decode, "recv.verified") == len(picked)
        assert stat(pair.prefill, "write.digested") == len(picked)
        with_digest = {decode_notification(n).request_id for n in seen if b":v" in n}
        assert with_digest == set(picked)


def test_verify_off_sends_no_digest_and_digests_nothing() -> None:
    with make_pair() as pair:
        seen = _completions(pair)
        ids = [_push(pair, f"o{i}")[1] for i in range(4)]
        assert all(pair.received[d] is None for d in ids)
        assert len(seen) == 4 and not any(b":v" in n for n in seen)
        assert all(decode_notification(n).digest == () for n in seen)
        assert stat(pair.prefill, "write.digested") == 0 and stat(pair.decode, "recv.verified") == 0


@pytest.mark.parametrize(("p_verify", "d_verify"), [("off", "all"), ("all", "off"), ("sample:2", "all")])
def test_d_decides_whatever_p_is_set_to(p_verify: str, d_verify: str) -> None:
    """P and D set differently fail nothing: D asks per registration and P answers what is
    asked, so D's setting alone decides which pushes are verified."""
    with make_pair(p_config={"verify": p_verify}, d_config={"verify": d_verify}) as pair:
        seen = _completions(pair)
        ids = [_push(pair, f"x{i}")[1] for i in range(4)]
        assert all(pair.received[d] is None for d in ids)
        verified = 4 if d_verify == "all" else 0
        assert stat(pair.decode, "recv.verified") == verified
        assert stat(pair.prefill, "write.digested") == verified
        assert sum(b":v" in n for n in seen) == verified


def test_p_that_sends_no_digest_lands_unverified_and_says_so() -> None:
    """D asks; a P that cannot answer (an older one, or one without its tensors) sends a plain
    completion: the request lands, counted as unverifiable, never failed for it."""
    with make_pair(verify="all") as pair:
        for w in pair.prefill.workers:
            w.ctx.kv_digest = None
        _, d_id = _push(pair, "u0")
        assert pair.received[d_id] is None
        _landed(pair.decode, d_id)
        assert stat(pair.decode, "recv.verify_unavailable") == 1
        assert stat(pair.prefill, "write.digest_unavailable") == 1


def test_digest_travels_under_the_mac() -> None:
    keys = {"auth_keys": {"k1": "0123456789abcdef0123"}, "auth_key_id": "k1"}
    with make_pair(verify="all", **keys) as pair:
        seen = _completions(pair)
        _, d_id = _push(pair, "m0")
        assert pair.received[d_id] is None
        assert stat(pair.decode, "recv.verified") == 1
        assert seen and all(n.startswith(b"PAMAC1:") and b":v" in n for n in seen)


# --- real NIXL on DRAM -----------------------------------------------------------------------
class _CorruptOnCompletion:
    """A real agent whose first completion read for ``target`` is preceded by ``corrupt`` (the
    WRITE's bytes have landed by then: NIXL delivers the notification after them)."""

    target = ""
    corrupt: Callable[[], None] | None = None

    def __init__(self, name: str) -> None:
        from pushactors.transport.nixl import NixlAgent

        self._agent = NixlAgent(name)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._agent, item)

    def get_new_notifs(self) -> Any:
        notifs = self._agent.get_new_notifs()
        corrupt = _CorruptOnCompletion.corrupt
        if corrupt is not None and any(
            bytes(n).startswith(_CorruptOnCompletion.target.encode() + b":")  # its completion, on D
            for batch in notifs.values()
            for n in batch
        ):
            _CorruptOnCompletion.corrupt = None
            corrupt()
        return notifs


@pytest.fixture
def real_pair() -> Iterator[PushPair]:
    spec = SimSpec(num_layers=2, num_blocks=64, block_bytes=1024)
    with PushPair(agent_factory=_CorruptOnCompletion, p_spec=spec, verify="all") as pair:
        yield pair
    _CorruptOnCompletion.corrupt = None


@pytest.mark.real_nixl
def test_real_nixl_verifies_clean_pushes_and_fails_a_corrupted_one(real_pair: PushPair) -> None:
    pair = real_pair
    for i in range(3):
        _, d_id = _push(pair, f"r{i}", tokens=40 + 9 * i)
        assert pair.received[d_id] is None
        _landed(pair.decode, d_id)
    d_id = "bad-bbbbbbbb"
    rng = random.Random(3)
    _CorruptOnCompletion.target = d_id
    _CorruptOnCompletion.corrupt = lambda: flip_byte(pair.decode, d_id, rng) and None
    _push(pair, "bad", tokens=50)
    assert _CorruptOnCompletion.corrupt is None, "the corruption did not run"
    reason = pair.received[d_id]
    assert reason is not None and MISMATCH in reason
    assert stat(pair.decode, "recv.verified") == 3 and stat(pair.decode, "recv.verify_failed") == 1
