"""Which ranks talk to which (SPEC §5): TP mapping, head slices and completion counts."""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """A P/D pairing this transport cannot serve; raised at configuration or handshake."""


def check_tp_pair(p_tp: int, d_tp: int) -> None:
    if p_tp < 1 or d_tp < 1:
        raise TopologyError(f"TP sizes must be positive (P={p_tp}, D={d_tp})")
    if p_tp % d_tp and d_tp % p_tp:
        raise TopologyError(f"TP sizes must divide one another (P={p_tp}, D={d_tp})")


def write_targets(p_tp_rank: int, p_tp: int, d_tp: int) -> tuple[int, ...]:
    """The D ranks that P rank ``p_tp_rank`` writes into."""
    check_tp_pair(p_tp, d_tp)
    if p_tp >= d_tp:
        return (p_tp_rank // (p_tp // d_tp),)
    k = d_tp // p_tp
    return tuple(range(p_tp_rank * k, p_tp_rank * k + k))


def registration_sources(d_tp_rank: int, d_tp: int, p_tp: int, p_pp: int) -> tuple[tuple[int, int], ...]:
    """The P ranks ``(pp_rank, tp_rank)`` that D rank ``d_tp_rank`` registers with."""
    check_tp_pair(p_tp, d_tp)
    if p_tp >= d_tp:
        k = p_tp // d_tp
        tps = tuple(range(d_tp_rank * k, d_tp_rank * k + k))
    else:
        tps = (d_tp_rank // (d_tp // p_tp),)
    return tuple((pp, tp) for pp in range(p_pp) for tp in tps)


def expected_completions(d_tp: int, p_tp: int, p_pp: int) -> int:
    """Completion notifications one D rank waits for: ``P_pp × max(1, P_tp // D_tp)``."""
    check_tp_pair(p_tp, d_tp)
    return p_pp * max(1, p_tp // d_tp)


@dataclass(frozen=True)
class Slice:
    """A block is cut into ``parts`` equal byte ranges (head slices); this is part ``index``."""

    parts: int = 1
    index: int = 0

    def span(self, block_len: int) -> tuple[int, int]:
        if block_len % self.parts:
            raise TopologyError(f"block of {block_len} bytes does not split into {self.parts} head slices")
        part = block_len // self.parts
        return self.index * part, part


WHOLE = Slice()


def write_slices(p_tp_rank: int, p_tp: int, d_rank: int, d_tp: int, *, replicated: bool = False) -> tuple[Slice, Slice]:
    """(local slice of P's block, remote slice of D's block) for one P→D WRITE.

    P_tp > D_tp: k P ranks each fill one head slice of D's block. P_tp < D_tp: P splits its
    block and sends slice i to the i-th of its D ranks. Replicated KV (MLA) is written whole.
    """
    check_tp_pair(p_tp, d_tp)
    if replicated or p_tp == d_tp:
        return WHOLE, WHOLE
    if p_tp > d_tp:
        k = p_tp // d_tp
        return WHOLE, Slice(k, p_tp_rank % k)
    k = d_tp // p_tp
    return Slice(k, d_rank % k), WHOLE
