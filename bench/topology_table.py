"""Descriptors per WRITE for each KV layout pair and TP/PP pairing, from the real pairing code.

    python bench/topology_table.py [--markdown] [--layers 32 --heads 8 --head-dim 128 --block-size 16]

Each rank's KV tensors are built on CPU (``build_kv``), described (``KVLayout.from_tensors``) and
paired with the D rank's layout as learned in a handshake (``RemoteLayout``) over the heads
``write_heads`` gives that P rank, exactly as a P worker does. Nothing is moved: the numbers are
the prepared descriptor templates. The defaults are a Llama-3-8B-like shape (bf16); MLA rows use
a 576-element latent (``--mla-dim``). Columns:

- writers: which P rank writes which global heads into which D rank (``-``: completion only;
  with P PP 2, stage 0's ranks: each stage writes the same heads of its own half of the layers);
- descs/blk: descriptors per D logical block in one WRITE (before merging across blocks);
- B/desc: mean bytes per descriptor; KiB/blk: bytes per D block in one WRITE;
- WRITEs/D: WRITEs one D rank receives per request; compl/D: completions it waits for.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

from pushactors.core.blocks import KVLayout, KVRegion, PairedLayout, RemoteLayout
from pushactors.core.topology import expected_completions, write_heads, write_targets
from pushactors.testing.engine import LAYOUTS, SimSpec, build_kv

TP_PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)]
MLA_PAIRS = [(1, 1), (2, 1), (1, 2)]


@dataclass(frozen=True)
class Case:
    p: str  # P layout (a name of LAYOUTS)
    d: str
    p_tp: int
    d_tp: int
    kv_heads: int | None = None  # None: --heads (MLA: 1)
    p_pp: int = 1
    p_bs: int | None = None  # None: --block-size
    d_bs: int | None = None


def cases() -> list[Case]:
    out = []
    for layout in LAYOUTS:
        for p_tp, d_tp in MLA_PAIRS if layout.startswith("mla") else TP_PAIRS:
            out.append(Case(layout, layout, p_tp, d_tp))
    out += [Case("cpu", "hnd", 1, 1)]  # CPU pages [H, 2, N, D] into GPU pages [H, N, K|V]
    for p, d in (("nhd", "hnd"), ("nhd", "blhnc"), ("bhlnc", "nhd"), ("hnd", "bhlnc")):
        out += [Case(p, d, 1, 1), Case(p, d, 2, 1), Case(p, d, 1, 2)]
    out += [Case("mla", "mla_blhnc", 2, 1)]
    for layout in ("nhd", "hnd", "bhlnc"):  # GQA: fewer KV heads than ranks
        out += [Case(layout, layout, 4, 2, kv_heads=2), Case(layout, layout, 2, 4, kv_heads=2)]
    for p, d, p_tp, d_tp in (
        ("hnd", "hnd", 1, 1),
        ("blhnc", "blhnc", 1, 1),
        ("bhlnc", "nhd", 2, 1),
        ("mla", "mla", 1, 1),
    ):
        out.append(Case(p, d, p_tp, d_tp, p_pp=2))
    for p, d in (("hnd", "hnd"), ("nhd", "hnd")):  # block sizes 16 ↔ 32
        out += [Case(p, d, 1, 1, p_bs=16, d_bs=32), Case(p, d, 1, 1, p_bs=32, d_bs=16)]
    return out


def layout_of(
    args: argparse.Namespace, layout: str, names: list[str], rank: int, tp: int, bs: int, heads: int
) -> KVLayout:
    mla = layout.startswith("mla")
    spec = SimSpec(
        layout=layout,
        num_blocks=args.blocks,
        block_size=bs,
        kv_heads=heads,
        head_dim=args.mla_dim if mla else args.head_dim,
        elem_size=2,
    )
    kv, dims = build_kv(spec, names, rank, tp)
    return KVLayout.from_tensors(kv, block_size=bs, dims=dims, kv_heads=spec.model_heads)


def row(args: argparse.Namespace, c: Case) -> list[str]:
    mla = c.p.startswith("mla")
    heads = 1 if mla else c.kv_heads or args.heads
    p_bs, d_bs = c.p_bs or args.block_size, c.d_bs or args.block_size
    names = [f"layer.{i}" for i in range(args.layers)]
    per_stage = len(names) // c.p_pp  # each P stage holds a contiguous half (PP 2) of the layers
    d_layouts = [layout_of(args, c.d, names, r, c.d_tp, d_bs, heads) for r in range(c.d_tp)]
    remotes = [
        RemoteLayout(
            engine_id="decode",
            agent_name=f"D/{r}",
            regions=tuple(KVRegion.from_info(i) for i in d.region_infos),  # as sent in the handshake
            block_size=d.block_size,
            physical_blocks_per_logical=d.physical_blocks_per_logical,
            tp_size=c.d_tp,
            tp_rank=r,
            pp_size=1,
            pp_rank=0,
            mem_type=d.mem_type,
            replicated_kv=mla,
            kv_heads=d.kv_heads,
        )
        for r, d in enumerate(d_layouts)
    ]
    writers, descs, per_desc, kib = [], set(), set(), set()
    writes = [0] * c.d_tp
    for pp, p_rank in itertools.product(range(c.p_pp), range(c.p_tp)):
        stage = names[pp * per_stage : (pp + 1) * per_stage]
        local = layout_of(args, c.p, stage, p_rank, c.p_tp, p_bs, heads)
        for d_rank in write_targets(p_rank, c.p_tp, c.d_tp):
            hs = write_heads(p_rank, c.p_tp, d_rank, c.d_tp, heads)
            paired = PairedLayout(local, (p_rank, c.p_tp), remotes[d_rank], hs, heads)
            h = "-" if not len(hs) else "latent" if mla else f"h{hs.start}" + (f"-{hs.stop - 1}" if len(hs) > 1 else "")
            if pp == 0:  # the writers of stage 0 (every stage writes the same heads of its own layers)
                writers.append(f"P{p_rank}→D{d_rank} {h}")
            if not paired.links:
                continue
            writes[d_rank] += 1
            n = sum(len(k.template) for k in paired.links)
            nbytes = sum(k.template.nbytes for k in paired.links)
            descs.add(f"{paired.descs_per_block:g}")
            per_desc.add(f"{nbytes / n:,.0f}")
            kib.add(f"{nbytes / max(k.template.kd for k in paired.links) / 1024:g}")
    assert len(set(writes)) == 1, writes  # every D rank gets the same number of WRITEs
    bs = f"{p_bs}" if p_bs == d_bs else f"{p_bs}→{d_bs}"
    return [
        c.p if c.p == c.d else f"{c.p}→{c.d}",
        f"{c.p_tp}→{c.d_tp}",
        str(c.p_pp),
        str(heads),
        bs,
        ", ".join(writers),
        "/".join(sorted(descs)),
        "/".join(sorted(per_desc)),
        "/".join(sorted(kib)),
        str(writes[0]),
        str(expected_completions(c.d_tp, c.p_tp, c.p_pp)),
    ]


HEADER = ["layout P→D", "TP P→D", "P PP", "KV heads", "block", "writers", "descs/blk", "B/desc", "KiB/blk",
          "WRITEs/D", "compl/D"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8, help="KV heads of the model (all TP ranks)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mla-dim", type=int, default=576, help="elements of MLA's latent per token")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per rank (the counts do not depend on it)")
    args = ap.parse_args()
    rows = [row(args, c) for c in cases()]
    if args.markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER))
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(x) for x in col) for col in zip(HEADER, *rows, strict=True)]
    for r in [HEADER, *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
