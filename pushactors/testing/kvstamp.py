"""A byte check cheap enough for the benches' engine steps: one value per request, layer and
block position.

The benches' engines neither fill nor check the KV (``SimSpec.fill_and_verify=False``: the
element-wise fill costs ~90 ms per MiB on the CPU, far longer than an engine step). Instead P
sets every byte of a request's block to one value in 1..127 drawn from (key, layer, position),
D clears the blocks it stages to 0 (never a stamp) and checks every byte once the KV landed:
a block not written, written from another request's blocks or at the wrong position reads
wrong (a different request's stamp matches one by chance once in 127). Each is one indexed
fill or compare per layer. Layouts whose first dimension is the block (``hnd``, ``blhnc``, …
of :data:`pushactors.testing.engine.LAYOUTS`), one kernel block per block.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence

import torch

from .engine import SimEngine

_BYTES_SET = {1: 0x01, 2: 0x0101, 4: 0x01010101, 8: 0x0101010101010101}  # v * this: every byte v


def _layers(engine: SimEngine, layers: set[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    spec = engine.spec
    if not spec.described or spec.layout.startswith("split") or spec.kernel_blocks != 1:
        raise ValueError(f"kvstamp needs a block-first layout with one kernel block per block, not {spec.layout!r}")
    for kv in engine.kv:
        for name, t in kv.items():
            if layers is None or name in layers:
                yield name, t


def _values(key: str, name: str, first_position: int, count: int, t: torch.Tensor) -> torch.Tensor:
    seed = zlib.crc32(f"{key}|{name}".encode())
    pos = torch.arange(first_position, first_position + count, dtype=torch.int64)
    v = (seed + pos * 7) % 127 + 1
    shape = (count,) + (1,) * (t.dim() - 1)
    return (v * _BYTES_SET[t.element_size()]).to(t.dtype).view(shape).to(t.device)


def _index(blocks: Sequence[int], t: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(blocks), dtype=torch.int64, device=t.device)


def stamp(
    engine: SimEngine, blocks: Sequence[int], key: str, *, first_position: int = 0, layers: set[str] | None = None
) -> None:
    """P: every byte of ``blocks`` (positions from ``first_position``) set to its stamp, in
    every layer (only ``layers`` when given)."""
    for name, t in _layers(engine, layers):
        t[_index(blocks, t)] = _values(key, name, first_position, len(blocks), t)


def clear(engine: SimEngine, blocks: Sequence[int]) -> None:
    """D: ``blocks`` set to 0 before a push, so a byte it never wrote reads wrong."""
    for _, t in _layers(engine, None):
        t[_index(blocks, t)] = 0


def check(engine: SimEngine, blocks: Sequence[int], key: str, *, first_position: int = 0) -> tuple[int, int]:
    """D: (bytes checked, bytes in a wrong element) of ``blocks`` against ``key``'s stamps."""
    checked = wrong = 0
    for name, t in _layers(engine, None):
        got = t[_index(blocks, t)]
        want = _values(key, name, first_position, len(blocks), t)
        checked += got.numel() * t.element_size()
        wrong += int((got != want).sum()) * t.element_size()
    return checked, wrong
