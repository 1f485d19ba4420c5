"""Which ranks talk to which (docs/protocol.md, 'Topologies'): TP mapping, head ownership and completion counts.

Heads are counted globally: a model has ``kv_heads`` KV heads; TP rank ``r`` of ``tp`` holds
``kv_heads // tp`` consecutive heads, or, when there are fewer heads than ranks (GQA with
``kv_heads < tp``, or MLA's single latent "head"), one head shared by ``tp // kv_heads``
consecutive ranks. A P rank writes into a D rank exactly the heads both hold that no
lower-ranked P source of that D rank holds too, so a replicated head is written once.
"""

from __future__ import annotations

import math


class TopologyError(ValueError):
    """A P/D pairing this transport cannot serve; raised at configuration or handshake."""


def check_tp_pair(p_tp: int, d_tp: int) -> None:
    if p_tp < 1 or d_tp < 1:
        raise TopologyError(f"TP sizes must be positive (P={p_tp}, D={d_tp})")
    if p_tp % d_tp and d_tp % p_tp:
        raise TopologyError(f"TP sizes must divide one another (P={p_tp}, D={d_tp})")


# P ranks one D rank may register with (P's PP size × the P TP ranks per D rank): far above any
# deployment, far below what would make building the list of sources exhaust memory.
MAX_SOURCES = 4096


def check_sources(d_tp: int, p_tp: int, p_pp: int) -> int:
    """How many P ranks one D rank registers with (``P_pp × max(1, P_tp // D_tp)``), checked
    before any list of them is built: a peer's sizes must not be able to ask for billions."""
    check_tp_pair(p_tp, d_tp)
    if p_pp < 1:
        raise TopologyError(f"P's PP size must be positive, not {p_pp}")
    n = p_pp * max(1, p_tp // d_tp)
    if n > MAX_SOURCES:
        raise TopologyError(f"D would register with {n} P ranks (P TP {p_tp}, PP {p_pp}); at most {MAX_SOURCES}")
    return n


def write_targets(p_tp_rank: int, p_tp: int, d_tp: int) -> tuple[int, ...]:
    """The D ranks that P rank ``p_tp_rank`` writes into."""
    check_tp_pair(p_tp, d_tp)
    if p_tp >= d_tp:
        return (p_tp_rank // (p_tp // d_tp),)
    k = d_tp // p_tp
    return tuple(range(p_tp_rank * k, p_tp_rank * k + k))


def registration_sources(d_tp_rank: int, d_tp: int, p_tp: int, p_pp: int) -> tuple[tuple[int, int], ...]:
    """The P ranks ``(pp_rank, tp_rank)`` that D rank ``d_tp_rank`` registers with."""
    check_sources(d_tp, p_tp, p_pp)
    if p_tp >= d_tp:
        k = p_tp // d_tp
        tps = tuple(range(d_tp_rank * k, d_tp_rank * k + k))
    else:
        tps = (d_tp_rank // (d_tp // p_tp),)
    return tuple((pp, tp) for pp in range(p_pp) for tp in tps)


def expected_completions(d_tp: int, p_tp: int, p_pp: int) -> int:
    """Completion notifications one D rank waits for: ``P_pp × max(1, P_tp // D_tp)``."""
    return check_sources(d_tp, p_tp, p_pp)


def check_heads(kv_heads: int, tp: int, side: str = "") -> None:
    if kv_heads < 1:
        raise TopologyError(f"{side}KV head count must be positive, got {kv_heads}")
    if kv_heads % tp and tp % kv_heads:
        raise TopologyError(f"{side}{kv_heads} KV heads cannot be spread over TP {tp} (neither divides the other)")


def rank_heads(tp_rank: int, tp: int, kv_heads: int) -> range:
    """The global KV heads TP rank ``tp_rank`` holds."""
    check_heads(kv_heads, tp)
    if kv_heads >= tp:
        n = kv_heads // tp
        return range(tp_rank * n, tp_rank * n + n)
    head = tp_rank // (tp // kv_heads)
    return range(head, head + 1)


def default_heads(p_tp: int, d_tp: int, replicated: bool = False) -> int:
    """Head count assumed for a layout that does not state one: enough for both TP sizes."""
    return 1 if replicated else math.lcm(p_tp, d_tp)


def write_heads(p_tp_rank: int, p_tp: int, d_rank: int, d_tp: int, kv_heads: int) -> range:
    """Global heads P rank ``p_tp_rank`` writes into D rank ``d_rank`` (empty: it only sends
    its completion, because a lower-ranked P source of that D rank writes the same heads)."""
    if d_rank not in write_targets(p_tp_rank, p_tp, d_tp):
        raise TopologyError(f"P rank {p_tp_rank} does not write D rank {d_rank}")
    check_heads(kv_heads, p_tp, "P: ")
    check_heads(kv_heads, d_tp, "D: ")
    mine = rank_heads(p_tp_rank, p_tp, kv_heads)
    want = rank_heads(d_rank, d_tp, kv_heads)
    lo, hi = max(mine.start, want.start), min(mine.stop, want.stop)
    for _, q in registration_sources(d_rank, d_tp, p_tp, 1):
        if q >= p_tp_rank or lo >= hi:
            break
        theirs = rank_heads(q, p_tp, kv_heads)
        # Ranges are nested or disjoint (every split divides): a lower source covers a prefix.
        if theirs.start <= lo < theirs.stop:
            lo = min(hi, theirs.stop)
    return range(lo, max(lo, hi))
