"""Rank mapping (SPEC §5): who writes to whom, who registers with whom, completion counts, slices."""

from __future__ import annotations

from collections import Counter

import pytest

from pushactors.core.topology import (
    WHOLE,
    Slice,
    TopologyError,
    check_tp_pair,
    expected_completions,
    registration_sources,
    write_slices,
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
def test_write_slices_cover_each_d_block_exactly_once(p_tp: int, d_tp: int) -> None:
    block = 4 * 3 * 16  # bytes of one D block / one P block in this toy model
    p_block = block * d_tp // p_tp if p_tp < d_tp else block  # per-rank heads scale with 1/TP
    d_block = block * p_tp // d_tp if p_tp > d_tp else block
    for d in range(d_tp):
        covered: list[tuple[int, int]] = []
        for p in range(p_tp):
            if d not in write_targets(p, p_tp, d_tp):
                continue
            local, remote = write_slices(p, p_tp, d, d_tp)
            l_off, l_len = local.span(p_block)
            r_off, r_len = remote.span(d_block)
            assert l_len == r_len, "a WRITE whose two sides differ in length"
            assert 0 <= l_off and l_off + l_len <= p_block
            covered.append((r_off, r_len))
        covered.sort()
        # the slices written into D's block tile it without gaps or overlaps
        pos = 0
        for off, length in covered:
            assert off == pos
            pos += length
        assert pos == d_block


def test_write_slices_exact() -> None:
    assert write_slices(0, 1, 0, 1) == (WHOLE, WHOLE)
    assert write_slices(1, 2, 1, 2) == (WHOLE, WHOLE)
    # P_tp > D_tp: P writes its whole block into its head slice of D's block
    assert write_slices(0, 2, 0, 1) == (WHOLE, Slice(2, 0))
    assert write_slices(1, 2, 0, 1) == (WHOLE, Slice(2, 1))
    assert write_slices(3, 4, 1, 2) == (WHOLE, Slice(2, 1))
    assert write_slices(2, 4, 1, 2) == (WHOLE, Slice(2, 0))
    # P_tp < D_tp: P sends slice i of its block to the i-th of its D ranks
    assert write_slices(0, 1, 0, 2) == (Slice(2, 0), WHOLE)
    assert write_slices(0, 1, 1, 2) == (Slice(2, 1), WHOLE)
    assert write_slices(1, 2, 2, 4) == (Slice(2, 0), WHOLE)
    assert write_slices(1, 2, 3, 4) == (Slice(2, 1), WHOLE)


@pytest.mark.parametrize(("p_tp", "d_tp"), TP_PAIRS)
def test_replicated_kv_is_written_whole(p_tp: int, d_tp: int) -> None:
    for p in range(p_tp):
        for d in write_targets(p, p_tp, d_tp):
            assert write_slices(p, p_tp, d, d_tp, replicated=True) == (WHOLE, WHOLE)


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
        write_slices(0, p_tp, 0, d_tp)
    with pytest.raises(TopologyError):
        write_slices(0, p_tp, 0, d_tp, replicated=True)


def test_topology_error_is_a_value_error() -> None:
    assert issubclass(TopologyError, ValueError)


def test_slice_span() -> None:
    assert WHOLE.span(96) == (0, 96)
    assert Slice(2, 0).span(96) == (0, 48)
    assert Slice(2, 1).span(96) == (48, 48)
    assert Slice(4, 3).span(96) == (72, 24)
    with pytest.raises(TopologyError):
        Slice(2, 1).span(97)
    with pytest.raises(TopologyError):
        Slice(3, 0).span(100)
