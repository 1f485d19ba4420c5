"""vLLM's KV cache groups as a push needs them (hybrid models: vLLM's hybrid allocator, HMA).

A model whose layers keep different KV (full attention beside sliding-window attention) has one
KV cache group per kind; each group has its own block table, so a request holds one list of
block ids per group, all from token 0. Where a group's manager frees blocks a request will not
read again (a sliding window's blocks behind the window) it puts vLLM's null block (id 0) in
their place, on P when the request finishes and on D when its blocks are allocated.

So a push moves per group only what D holds: D registers, per group, the blocks past its local
hit minus the leading null blocks (counted into that group's ``skip_blocks``), and P writes
exactly those. For a sliding window that is the blocks D's window reads; D's null blocks are
never written. P checks it still holds what D's window will read (:meth:`CacheGroups.unheld`).

A state-space group (Mamba, linear attention: vLLM's ``MambaSpec``) holds no per-token KV but
one running state (conv and SSM state in one page) per request, in the block at position
``ceil(tokens / block_size) - 1`` of its list: its only block where vLLM's mamba cache mode is
``none`` (the group's block size is the model length), the last of a list that opens with null
blocks where it is ``align`` (prefix caching). A push moves that one block. A state cannot be
rewound, so P stops one token short of the prompt (:attr:`CacheGroups.backoff`) and D computes
the last prompt token itself from P's state, as vLLM's own connectors do.

Pure: reads the KV cache config by its classes' names, so it needs no vLLM to test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# vLLM's BlockPool reserves block 0 as its null block: a placeholder never read.
NULL_BLOCK = 0

FULL = "full"
SLIDING_WINDOW = "sliding_window"
STATE = "state"  # Mamba / linear attention: one state slot per request, not per-token KV

# Specs whose managers leave holes D could not register as one run, or keep no per-token KV:
# refused (named in the error) rather than pushed wrong.
_UNSUPPORTED = (
    "ChunkedLocalAttentionSpec",
    "RSWASpec",
    "CircularBufferSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
)


def _names(spec: Any) -> set[str]:
    return {cls.__name__ for cls in type(spec).__mro__}


def spec_kind(spec: Any) -> str:
    """``full``, ``sliding_window``, ``state``, or the class name of a spec no push serves."""
    names = _names(spec)
    for bad in _UNSUPPORTED:
        if bad in names:
            return type(spec).__name__
    if any("Mamba" in n for n in names):
        return STATE
    if "SlidingWindowSpec" in names:
        return SLIDING_WINDOW
    return FULL


@dataclass(frozen=True)
class CacheGroup:
    """One KV cache group: its kind, tokens per block, window (sliding window: tokens a token
    attends to, itself included; else 0) and layers."""

    kind: str
    block_size: int
    window: int = 0
    layers: tuple[str, ...] = ()
    retained: int = 0  # sliding window: tokens kept behind the window (vLLM's extra_retained_tokens)
    transfer: bool = True  # vLLM's enable_kv_transfer: False for replicas rebuilt after a load
    mode: str = ""  # state: vLLM's mamba_cache_mode ("none", "align")
    scratch: int = 0  # state: vLLM's num_speculative_blocks (scratch slots after the state)

    def state_slot(self, tokens: int) -> int:
        """State: the position in the group's list of the block holding the state after ``tokens``."""
        return max(0, -(-tokens // self.block_size) - 1)


@dataclass(frozen=True)
class CacheGroups:
    groups: tuple[CacheGroup, ...]

    @classmethod
    def from_vllm(cls, kv_cache_config: Any, block_size: int) -> CacheGroups:
        """The groups of a vLLM ``KVCacheConfig`` (None or no groups: one full-attention group
        of ``block_size``, as before vLLM had groups)."""
        out: list[CacheGroup] = []
        for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
            spec = group.kv_cache_spec
            inner = getattr(spec, "kv_cache_specs", None)
            specs = list(inner.values()) if isinstance(inner, dict) and inner else [spec]
            kinds = {spec_kind(s) for s in specs}
            kind = kinds.pop() if len(kinds) == 1 else "mixed " + "/".join(sorted(kinds))
            out.append(
                CacheGroup(
                    kind=kind,
                    block_size=int(getattr(spec, "block_size", block_size) or block_size),
                    window=int(getattr(specs[0], "sliding_window", 0) or 0) if kind == SLIDING_WINDOW else 0,
                    layers=tuple(str(n) for n in getattr(group, "layer_names", ()) or ()),
                    retained=int(getattr(specs[0], "extra_retained_tokens", 0) or 0),
                    transfer=bool(getattr(group, "enable_kv_transfer", True)),
                    mode=str(getattr(specs[0], "mamba_cache_mode", "") or "") if kind == STATE else "",
                    scratch=int(getattr(specs[0], "num_speculative_blocks", 0) or 0) if kind == STATE else 0,
                )
            )
        if not out:
            out.append(CacheGroup(FULL, block_size))
        return cls(tuple(out))

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windowed(self) -> bool:
        """Some group is not full attention (its null blocks depend on window and block size)."""
        return any(g.kind != FULL for g in self.groups)

    @property
    def stateful(self) -> bool:
        """Some group holds Mamba/linear-attention state."""
        return any(g.kind == STATE for g in self.groups)

    @property
    def backoff(self) -> int:
        """Prompt tokens P leaves for D to compute: 1 with a state group (D computes the last
        state from P's state after all but the last prompt token), else 0."""
        return 1 if self.stateful else 0

    def describe(self) -> str:
        """``kind[:window|:mode]@block_size`` per group, e.g. ``full@16+sliding_window:128@16``
        or ``state:align@256+full@256``."""
        return "+".join(
            f"{g.kind}{f':{g.window}' if g.window else ''}{f':{g.mode}' if g.mode else ''}@{g.block_size}"
            for g in self.groups
        )

    def refusal(self) -> str | None:
        """Why a push cannot serve these groups (the connector refuses to start), or None."""
        for i, g in enumerate(self.groups):
            if g.kind == STATE and g.mode not in ("none", "align"):
                return (
                    f"KV cache group {i} holds Mamba/linear-attention state in mamba_cache_mode {g.mode!r}: "
                    "a push serves only 'none' and 'align'"
                )
            if g.kind == STATE and g.scratch:
                return (
                    f"KV cache group {i} holds Mamba/linear-attention state with {g.scratch} speculative "
                    "scratch blocks (speculative decoding): not supported"
                )
            if g.kind not in (FULL, SLIDING_WINDOW, STATE):
                return f"KV cache group {i} is {g.kind}: a push cannot tell which of its blocks D reads"
            if not g.transfer:
                return f"KV cache group {i} is not transferable (enable_kv_transfer off): not supported"
            if g.retained:
                return f"KV cache group {i} keeps {g.retained} tokens behind its window (spec decoding): not supported"
        # A state group's block is one state whatever its block size (the model length in mamba
        # cache mode "none"): only the token-holding groups must agree.
        sizes = {g.block_size for g in self.groups if g.kind != STATE}
        if len(sizes) > 1:
            return f"KV cache groups of different block sizes {sorted(sizes)}: not supported"
        return None

    def layer_groups(self) -> dict[str, int]:
        """Each layer's group index, for the regions a worker registers (empty: one group)."""
        if not self.hybrid:
            return {}
        return {name: i for i, g in enumerate(self.groups) for name in g.layers}

    def registration(
        self, block_ids: Sequence[Sequence[int]], local_tokens: int, external_tokens: int
    ) -> tuple[list[list[int]], list[int]]:
        """D: the blocks to register per group and the blocks before them (``skip_blocks``),
        from the request's whole block lists. Per group, the blocks holding tokens
        ``[local_tokens, local_tokens + external_tokens)``, less the leading null blocks (a
        window's blocks D will not read): those are counted as skipped, never registered.

        Raises ValueError for block lists that do not fit the groups (a null block after a
        real one, a group count vLLM did not configure)."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"{len(block_ids)} block lists for {len(self.groups)} KV cache groups")
        groups: list[list[int]] = []
        skips: list[int] = []
        for g, ids in zip(self.groups, block_ids, strict=True):
            if g.kind == STATE:
                # The one block whose state D starts from: where P's state after the pushed tokens goes.
                slot = g.state_slot(local_tokens + external_tokens)
                if slot >= len(ids) or ids[slot] == NULL_BLOCK:
                    raise ValueError(f"a state group holds no state block at position {slot} of {list(ids)}")
                groups.append([ids[slot]])
                skips.append(slot)
                continue
            first = local_tokens // g.block_size
            last = -(-(local_tokens + external_tokens) // g.block_size)
            blocks = list(ids)[first:last]
            nulls = 0
            while nulls < len(blocks) and blocks[nulls] == NULL_BLOCK:
                nulls += 1
            if NULL_BLOCK in blocks[nulls:] or (nulls and g.kind != SLIDING_WINDOW):
                raise ValueError(f"a {g.kind} KV cache group holds a null block where D must receive KV")
            groups.append(blocks[nulls:])
            skips.append(first + nulls)
        return groups, skips

    def unheld(self, block_ids: Sequence[Sequence[int]], prompt_tokens: int) -> str | None:
        """P: why P no longer holds what D's window reads (D's window after the prompt starts at
        token ``prompt_tokens - window + 1``), or None. P's null blocks are the ones its own
        manager freed; they must all lie before the block holding that token."""
        if len(block_ids) != len(self.groups):
            return f"{len(block_ids)} block lists for {len(self.groups)} KV cache groups"
        for i, (g, ids) in enumerate(zip(self.groups, block_ids, strict=True)):
            if g.kind == STATE:
                slot = g.state_slot(prompt_tokens)
                if slot >= len(ids) or ids[slot] == NULL_BLOCK:
                    return f"KV cache group {i} (state): no state block at position {slot} of {list(ids)}"
                continue
            nulls = 0
            while nulls < len(ids) and ids[nulls] == NULL_BLOCK:
                nulls += 1
            needed = max(0, prompt_tokens - g.window + 1) // g.block_size if g.kind == SLIDING_WINDOW else 0
            if nulls > needed:
                return (
                    f"KV cache group {i} ({g.kind}): P freed {nulls} blocks but D reads from block {needed} "
                    "(P computed past the prompt)"
                )
            if NULL_BLOCK in ids[nulls:]:
                return f"KV cache group {i} ({g.kind}): a null block among the blocks D reads"
        return None

    def pushed(self, block_ids: Sequence[Sequence[int]], prompt_tokens: int) -> list[list[int]]:
        """P: the block lists a push may read. A state group keeps only its state block, at
        its position, behind null blocks: the blocks before it (states vLLM keeps for its
        prefix cache, or already freed) and its scratch slots are never pushed."""
        out = [list(ids) for ids in block_ids]
        for g, ids in zip(self.groups, out, strict=False):
            if g.kind == STATE:
                slot = g.state_slot(prompt_tokens)
                if slot < len(ids):
                    ids[:] = [NULL_BLOCK] * slot + [ids[slot]]
        return out
