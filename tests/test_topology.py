"""Rank mapping (docs/protocol.md, 'Topologies'): who writes to whom, who registers with whom,
completion counts, head ownership."""

from __future__ import annotations

from collections import Counter

import pytest

from pushactors.core.topology import (
    TopologyError,
    check_heads,
    check_tp_pair,
    default_heads,
    expected_completions,
    rank_heads,
    registration_sources,
    write_heads,
    write_targets,
)

TP_PAIRS = [(1, 1), (2, 1), (4, 2), (1, 2), (2, 4), (2, 2), (4, 1), (1, 4)]
PP_SIZES = [1, 2]


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
@pytest.mark.parametrize("p_pp", PP_SIZES)
def test_write_targets_and_registration_sources_agree(p_tp: int, d_tp: int, p_pp: int) -> None:
    for d in range(d_tp):
        sources = registration_sources(d, d_tp, p_tp, p_pp)
        assert len(set(sources)) == len(sources), "a D rank registers twice with one P rank"
        for pp in range(p_pp):
            for p in range(p_tp):
                targets = write_targets(p, p_tp, d_tp)
                assert (d in targets) == ((pp, p) in sources), (d, pp, p)
        # every source is a real P rank
        assert all(0 <= pp < p_pp and 0 <= tp < p_tp for pp, tp in sources)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
@pytest.mark.parametrize("p_pp", PP_SIZES)
def test_expected_completions_match_the_sources(p_tp: int, d_tp: int, p_pp: int) -> None:
    for d in range(d_tp):
        n = expected_completions(d_tp, p_tp, p_pp)
        assert n == len(registration_sources(d, d_tp, p_tp, p_pp))
        assert n == p_pp * max(1, p_tp // d_tp)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_every_d_rank_is_written_and_targets_are_in_range(p_tp: int, d_tp: int) -> None:
    hits: Counter[int] = Counter()
    for p in range(p_tp):
        targets = write_targets(p, p_tp, d_tp)
        assert targets, "a P rank with no D rank to write"
        assert len(targets) == max(1, d_tp // p_tp)
        assert all(0 <= d < d_tp for d in targets)
        hits.update(targets)
    assert set(hits) == set(range(d_tp))
    # each D rank receives exactly one WRITE per P rank that maps to it (per PP stage)
    assert all(c == max(1, p_tp // d_tp) for c in hits.values())


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "expected"),
    [
        (1, 1, {0: (0,)}),
        (2, 1, {0: (0,), 1: (0,)}),
        (4, 2, {0: (0,), 1: (0,), 2: (1,), 3: (1,)}),
        (1, 2, {0: (0, 1)}),
        (2, 4, {0: (0, 1), 1: (2, 3)}),
        (2, 2, {0: (0,), 1: (1,)}),
    ],
)
def test_write_targets_exact(p_tp: int, d_tp: int, expected: dict[int, tuple[int, ...]]) -> None:
    assert {p: write_targets(p, p_tp, d_tp) for p in range(p_tp)} == expected


def test_registration_sources_exact() -> None:
    assert registration_sources(1, 2, 4, 1) == ((0, 2), (0, 3))
    assert registration_sources(1, 2, 4, 2) == ((0, 2), (0, 3), (1, 2), (1, 3))
    assert registration_sources(3, 4, 2, 1) == ((0, 1),)
    assert registration_sources(3, 4, 2, 2) == ((0, 1), (1, 1))
    assert registration_sources(0, 1, 1, 2) == ((0, 0), (1, 0))


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_opaque_head_slices_cover_each_d_block_exactly_once(p_tp: int, d_tp: int) -> None:
    """An opaque block is heads outermost; with no head count stated it holds this rank's share
    of ``lcm(P_tp, D_tp)`` heads. The byte ranges the P sources write tile each D block."""
    kv_heads = default_heads(p_tp, d_tp)
    per_head = 4 * 3 * 16  # bytes of one head's slice of a block in this toy model
    for d in range(d_tp):
        d_heads = rank_heads(d, d_tp, kv_heads)
        d_block = per_head * len(d_heads)
        covered: list[tuple[int, int]] = []
        for p in range(p_tp):
            if d not in write_targets(p, p_tp, d_tp):
                continue
            p_heads = rank_heads(p, p_tp, kv_heads)
            p_block = per_head * len(p_heads)
            heads = write_heads(p, p_tp, d, d_tp, kv_heads)
            assert heads, "without replication every source writes some heads"
            l_off, l_len = (heads.start - p_heads.start) * per_head, len(heads) * per_head
            r_off, r_len = (heads.start - d_heads.start) * per_head, len(heads) * per_head
            assert 0 <= l_off and l_off + l_len <= p_block
            covered.append((r_off, r_len))
        covered.sort()
        # the slices written into D's block tile it without gaps or overlaps
        pos = 0
        for off, length in covered:
            assert off == pos
            pos += length
        assert pos == d_block


def test_write_heads_exact() -> None:
    """The old byte-range slices, as heads: ``default_heads`` = lcm(P_tp, D_tp)."""
    assert write_heads(0, 1, 0, 1, default_heads(1, 1)) == range(0, 1)
    assert write_heads(1, 2, 1, 2, default_heads(2, 2)) == range(1, 2)
    # P_tp > D_tp: P writes its whole block (all its heads) into its head slice of D's block
    assert rank_heads(0, 1, 2) == range(0, 2)
    assert write_heads(0, 2, 0, 1, 2) == range(0, 1) == rank_heads(0, 2, 2)  # slice 0 of 2
    assert write_heads(1, 2, 0, 1, 2) == range(1, 2) == rank_heads(1, 2, 2)  # slice 1 of 2
    assert rank_heads(1, 2, 4) == range(2, 4)
    assert write_heads(3, 4, 1, 2, 4) == range(3, 4)  # slice 1 of D rank 1's heads 2..3
    assert write_heads(2, 4, 1, 2, 4) == range(2, 3)  # slice 0
    # P_tp < D_tp: P sends slice i of its block (its i-th share of heads) to the i-th D rank
    assert write_heads(0, 1, 0, 2, 2) == range(0, 1)
    assert write_heads(0, 1, 1, 2, 2) == range(1, 2)
    assert write_heads(1, 2, 2, 4, 4) == range(2, 3)  # slice 0 of P rank 1's heads 2..3
    assert write_heads(1, 2, 3, 4, 4) == range(3, 4)  # slice 1
    # more heads than the lcm: each slice is several heads
    assert write_heads(1, 2, 0, 1, 8) == range(4, 8)
    assert write_heads(0, 1, 3, 4, 8) == range(6, 8)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_replicated_kv_is_written_once_whole(p_tp: int, d_tp: int) -> None:
    """MLA (one latent head on every rank): each D rank gets the whole head from exactly one
    P source, the lowest-ranked; the others only send their completion."""
    assert default_heads(p_tp, d_tp, replicated=True) == 1
    for d in range(d_tp):
        writes = {p: write_heads(p, p_tp, d, d_tp, 1) for p in range(p_tp) if d in write_targets(p, p_tp, d_tp)}
        writers = [p for p, h in writes.items() if h]
        assert writers == [min(writes)]
        assert writes[writers[0]] == range(0, 1)
        assert all(h == range(0, 0) for p, h in writes.items() if p != writers[0])


@pytest.mark.parametrize(("p_tp", "d_tp"), [(3, 2), (2, 3), (4, 6), (6, 4), (0, 1), (1, 0), (-2, 2)])
def test_non_dividing_or_non_positive_tp_is_refused(p_tp: int, d_tp: int) -> None:
    with pytest.raises(TopologyError):
        check_tp_pair(p_tp, d_tp)
    with pytest.raises(TopologyError):
        write_targets(0, p_tp, d_tp)
    with pytest.raises(TopologyError):
        registration_sources(0, d_tp, p_tp, 1)
    with pytest.raises(TopologyError):
        expected_completions(d_tp, p_tp, 1)
    with pytest.raises(TopologyError):
        write_heads(0, p_tp, 0, d_tp, 12)
    with pytest.raises(TopologyError):
        write_heads(0, p_tp, 0, d_tp, 1)  # replicated


def test_topology_error_is_a_value_error() -> None:
    assert issubclass(TopologyError, ValueError)


# ============================================================================================
# Head ownership (rank_heads / write_heads)
# ============================================================================================
def test_rank_heads_exact() -> None:
    assert rank_heads(0, 1, 8) == range(0, 8)
    assert rank_heads(1, 2, 8) == range(4, 8)
    assert rank_heads(3, 4, 8) == range(6, 8)
    assert rank_heads(5, 8, 8) == range(5, 6)
    # GQA, fewer heads than ranks: a head is shared by tp // kv_heads consecutive ranks
    assert [rank_heads(r, 8, 2) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    assert [rank_heads(r, 4, 2) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    # MLA: one latent head on every rank
    assert all(rank_heads(r, 4, 1) == range(0, 1) for r in range(4))


@pytest.mark.parametrize(("kv_heads", "tp"), [(0, 1), (-2, 2), (3, 2), (2, 3), (6, 4), (4, 6)])
def test_unspreadable_head_counts_are_refused(kv_heads: int, tp: int) -> None:
    with pytest.raises(TopologyError):
        check_heads(kv_heads, tp)
    with pytest.raises(TopologyError):
        rank_heads(0, tp, kv_heads)


def test_write_heads_refuses_a_d_rank_it_does_not_write_and_bad_head_counts() -> None:
    with pytest.raises(TopologyError):
        write_heads(0, 2, 1, 2, 2)  # P rank 0 of 2 writes D rank 0 of 2 only
    with pytest.raises(TopologyError):
        write_heads(2, 4, 0, 2, 4)
    with pytest.raises(TopologyError):
        write_heads(0, 2, 0, 1, 3)  # 3 heads do not spread over P's TP 2
    with pytest.raises(TopologyError):
        write_heads(0, 1, 0, 2, 3)  # ... nor over D's TP 2
    with pytest.raises(TopologyError):
        write_heads(0, 1, 0, 1, 0)


def test_default_heads() -> None:
    assert [default_heads(p, d) for p, d in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 8)]] == [1, 2, 2, 4, 4, 8]
    assert default_heads(4, 2, replicated=True) == default_heads(1, 8, replicated=True) == 1


def test_write_heads_gqa_and_mla_exact() -> None:
    # GQA, 2 heads, P_tp=4 → D_tp=2: P ranks 0,1 hold head 0 and 2,3 hold head 1; D ranks 0/1
    # hold heads 0/1. Only the first source of each D rank writes.
    assert [write_heads(p, 4, p // 2, 2, 2) for p in range(4)] == [range(0, 1), range(1, 1), range(1, 2), range(2, 2)]
    # GQA, 2 heads, P_tp=2 → D_tp=4: each P rank writes its one head into both its D ranks
    assert [write_heads(p, 2, d, 4, 2) for p in range(2) for d in write_targets(p, 2, 4)] == [
        range(0, 1),
        range(0, 1),
        range(1, 2),
        range(1, 2),
    ]
    # GQA, 4 heads, P_tp=8 → D_tp=1: D holds all four; P ranks 0, 2, 4, 6 write one each
    writes = [write_heads(p, 8, 0, 1, 4) for p in range(8)]
    assert [len(h) for h in writes] == [1, 0, 1, 0, 1, 0, 1, 0]
    assert [h.start for h in writes if h] == [0, 1, 2, 3]
    # MLA, P_tp=4 → D_tp=1: only P rank 0 writes
    assert [len(write_heads(p, 4, 0, 1, 1)) for p in range(4)] == [1, 0, 0, 0]


DIVIDING_TP_PAIRS = [(p, d) for p in range(1, 9) for d in range(1, 9) if p % d == 0 or d % p == 0]


@pytest.mark.parametrize(("p_tp", "d_tp"), DIVIDING_TP_PAIRS)
def test_every_head_of_a_d_rank_is_written_exactly_once(p_tp: int, d_tp: int) -> None:
    """Over every TP pair up to 8 and every valid head count up to 16 (GQA with fewer heads
    than ranks, MLA's single head): each head a D rank holds is written by exactly one of its
    P sources — the lowest-ranked that holds it — and no source writes a head either side lacks."""
    valid = [h for h in range(1, 17) if (h % p_tp == 0 or p_tp % h == 0) and (h % d_tp == 0 or d_tp % h == 0)]
    assert 1 in valid
    for kv_heads in range(1, 17):
        if kv_heads not in valid:
            with pytest.raises(TopologyError):
                write_heads(0, p_tp, write_targets(0, p_tp, d_tp)[0], d_tp, kv_heads)
            continue
        for d in range(d_tp):
            want = rank_heads(d, d_tp, kv_heads)
            sources = [tp for _, tp in registration_sources(d, d_tp, p_tp, 1)]
            writers: Counter[int] = Counter()
            for p in sources:
                heads = write_heads(p, p_tp, d, d_tp, kv_heads)
                mine = rank_heads(p, p_tp, kv_heads)
                assert heads.step == 1
                assert all(h in mine and h in want for h in heads), (kv_heads, p, d, heads)
                writers.update(heads)
                for h in heads:
                    # the writer is the lowest-ranked source holding that head
                    assert p == min(q for q in sources if h in rank_heads(q, p_tp, kv_heads))
            assert sorted(writers) == list(want), (kv_heads, d, writers)
            assert set(writers.values()) == {1}, (kv_heads, d, writers)
        if kv_heads == 1:  # MLA: exactly one source per D rank writes, the rest only complete
            for d in range(d_tp):
                n = sum(bool(write_heads(p, p_tp, d, d_tp, 1)) for _, p in registration_sources(d, d_tp, p_tp, 1))
                assert n == 1
