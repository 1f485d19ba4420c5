"""KV filled by meaning: every element encodes (layer, K/V, token position, global head, dim).

P fills the blocks of a request from its own layout; D checks each element of its blocks
against what that element *should* hold for D's own heads and positions, computed from D's
layout. A head slice written to the wrong head, token, layer or K/V half — even with every
byte count right — shows up as wrong elements, and the report names the first few.

Works on described layouts (:attr:`KVLayout.structured`) in any memory torch can index (DRAM
or VRAM): :class:`KVMemory` reads and writes elements by NIXL address.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from ..core.blocks import KVLayout, KVRegion
from ..core.topology import default_heads, rank_heads

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]


class KVMemory:
    """Byte access, by address, to the storages behind some KV tensors."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._spans: list[tuple[int, int, torch.Tensor]] = []
        seen: set[int] = set()
        for t in tensors:
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            flat = torch.empty(0, dtype=torch.uint8, device=t.device)
            flat.set_(st, 0, (st.nbytes(),), (1,))
            self._spans.append((st.data_ptr(), st.nbytes(), flat))
        self._spans.sort(key=lambda s: s[0])

    def _locate(self, addrs: U64) -> list[tuple[npt.NDArray[np.bool_], torch.Tensor, I64]]:
        out = []
        placed = np.zeros(len(addrs), dtype=bool)
        for base, size, flat in self._spans:
            m = (addrs >= base) & (addrs < base + size)
            if m.any():
                out.append((m, flat, (addrs[m] - np.uint64(base)).astype(np.int64)))
                placed |= m
        if not placed.all():
            raise ValueError(f"address {int(addrs[~placed][0]):#x} is outside every KV tensor")
        return out

    def write(self, addrs: U64, data: npt.NDArray[np.uint8]) -> None:
        """Element ``i`` (``data[i]``: its bytes) goes to ``addrs[i]``."""
        es = data.shape[1]
        for m, flat, off in self._locate(addrs):
            idx = torch.from_numpy((off[:, None] + np.arange(es)).ravel()).to(flat.device)
            flat[idx] = torch.from_numpy(np.ascontiguousarray(data[m]).ravel()).to(flat.device)

    def read(self, addrs: U64, elem_size: int) -> npt.NDArray[np.uint8]:
        out = np.empty((len(addrs), elem_size), dtype=np.uint8)
        for m, flat, off in self._locate(addrs):
            idx = torch.from_numpy((off[:, None] + np.arange(elem_size)).ravel()).to(flat.device)
            out[m] = flat[idx].cpu().numpy().reshape(-1, elem_size)
        return out


@dataclass
class Elements:
    """Some elements of some blocks: where each lives and what it means."""

    addr: U64
    layer: I64  # crc32 of the layer name: equal on P and D whatever the region order
    kv: I64  # 0 K, 1 V, 2 no K/V distinction (MLA latent, opaque)
    pos: I64  # token position in the prompt
    head: I64  # global KV head
    dim: I64
    elem_size: int
    names: dict[int, str] = field(default_factory=dict)

    def before(self, num_tokens: int | None) -> Elements:
        """Only the elements of token positions below ``num_tokens`` (None: all)."""
        if num_tokens is None:
            return self
        m = self.pos < num_tokens
        return Elements(
            self.addr[m], self.layer[m], self.kv[m], self.pos[m], self.head[m], self.dim[m], self.elem_size, self.names
        )

    def of_layers(self, layers: set[str]) -> Elements:
        """Only the elements of these layers (K/V halves of a split layer included)."""
        from ..core.layerwise import layer_name

        hashes = [h for h, n in self.names.items() if layer_name(n) in layers]
        m = np.isin(self.layer, np.asarray(hashes, dtype=np.int64))
        return Elements(
            self.addr[m], self.layer[m], self.kv[m], self.pos[m], self.head[m], self.dim[m], self.elem_size, self.names
        )

    def describe(self, i: int) -> str:
        kv = ("K", "V", "latent")[int(self.kv[i])]
        return (
            f"{self.names.get(int(self.layer[i]), '?')} {kv} token {int(self.pos[i])} "
            f"head {int(self.head[i])} dim {int(self.dim[i])}"
        )


def elements(
    layout: KVLayout,
    tp_rank: int,
    tp_size: int,
    blocks: Sequence[int],
    *,
    first_block: int = 0,
    group: int = 0,
) -> Elements:
    """Every element of logical ``blocks`` (prompt block positions ``first_block``, …) of KV
    group ``group`` on this rank."""
    if not layout.structured:
        raise ValueError("semantic KV needs a described layout (dims and kv_heads)")
    heads_total = layout.kv_heads or default_heads(tp_size, tp_size)
    my_heads = rank_heads(tp_rank, tp_size, heads_total)
    ratio = layout.physical_blocks_per_logical
    tpb = layout.tokens_per_block
    logical = np.asarray(blocks, dtype=np.int64)
    phys = (logical[:, None] * ratio + np.arange(ratio)).ravel()
    first_tok = ((first_block + np.arange(len(logical)))[:, None] * layout.block_size + np.arange(ratio) * tpb).ravel()
    parts: list[tuple[U64, I64, I64, I64, I64, I64]] = []
    names: dict[int, str] = {}
    es = 0
    for r in layout.regions:
        if r.group != group:
            continue
        shape = r.shape
        assert shape is not None
        es = shape.elem_size
        for li, layer_names in enumerate(r.layer_names):
            name = layer_names[0] if layer_names else f"#{li}"
            lh = zlib.crc32(name.encode())
            names[lh] = name
            for kv in _kv_of(r):
                base = (
                    r.base_addr
                    + li * shape.stride("layer")
                    + (kv * shape.stride("kv") if kv is not None and shape.axis("kv") else 0)
                )
                t = np.arange(shape.size("token"), dtype=np.int64)
                h = np.arange(shape.size("head"), dtype=np.int64)
                d = np.arange(shape.size("dim"), dtype=np.int64)
                grid = (len(phys), len(t), len(h), len(d))
                addr = (
                    np.uint64(base)
                    + (phys * r.stride).astype(np.uint64)[:, None, None, None]
                    + (t * shape.stride("token")).astype(np.uint64)[None, :, None, None]
                    + (h * shape.stride("head")).astype(np.uint64)[None, None, :, None]
                    + (d * shape.stride("dim")).astype(np.uint64)[None, None, None, :]
                )
                pos = first_tok[:, None, None, None] + t[None, :, None, None]
                parts.append(
                    (
                        addr.ravel(),
                        np.full(addr.size, lh, dtype=np.int64),
                        np.full(addr.size, 2 if kv is None else kv, dtype=np.int64),
                        np.broadcast_to(pos, grid).ravel(),
                        np.broadcast_to((my_heads.start + h)[None, None, :, None], grid).ravel(),
                        np.broadcast_to(d[None, None, None, :], grid).ravel(),
                    )
                )
    if not parts:
        e = np.empty(0, dtype=np.int64)
        return Elements(np.empty(0, dtype=np.uint64), e, e, e, e, e, es or 1, names)
    c_addr, c_layer, c_kv, c_pos, c_head, c_dim = (np.concatenate(c) for c in zip(*parts, strict=True))
    return Elements(c_addr.astype(np.uint64), c_layer, c_kv, c_pos, c_head, c_dim, es, names)


def _kv_of(r: KVRegion) -> tuple[int | None, ...]:
    return r.kv_indices


def values(key: str, el: Elements) -> npt.NDArray[np.uint8]:
    """The bytes each element should hold for request ``key``."""
    seed = np.uint64(zlib.crc32(key.encode()) * 0x9E3779B1)
    with np.errstate(over="ignore"):
        x = (
            seed
            + el.layer.astype(np.uint64) * np.uint64(0x100000001B3)
            + el.kv.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
            + el.pos.astype(np.uint64) * np.uint64(0x165667B19E3779F9)
            + el.head.astype(np.uint64) * np.uint64(0x27D4EB2F165667C5)
            + el.dim.astype(np.uint64) * np.uint64(0x94D049BB133111EB)
        )
        # splitmix64 finaliser: nearby coordinates give unrelated bytes
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    out: npt.NDArray[np.uint8] = x.view(np.uint8).reshape(-1, 8)[:, : el.elem_size]
    return out


@dataclass(frozen=True)
class Check:
    checked: int  # elements
    wrong: int
    examples: tuple[str, ...]  # the first wrong elements, described

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and self.checked > 0


def fill(mem: KVMemory, el: Elements, key: str) -> None:
    if len(el.addr):
        mem.write(el.addr, values(key, el))


def check(mem: KVMemory, el: Elements, key: str, *, examples: int = 5) -> Check:
    if not len(el.addr):
        return Check(0, 0, ())
    got = mem.read(el.addr, el.elem_size)
    bad = np.flatnonzero((got != values(key, el)).any(axis=1))
    return Check(len(el.addr), len(bad), tuple(el.describe(int(i)) for i in bad[:examples]))
