"""Draw pushactors beside its baseline as an SVG: the picture of docs/performance.md's figures.

    python bench/figures.py --doc docs/performance.md --out docs/performance-figures.svg
    python bench/figures.py runs/bench/small.json runs/bench/layerwise.json --out figures.svg

``--doc`` reads the "Current figures" table of a page (the columns case, pushactors, bare NIXL,
device, date); positional arguments are the JSON files that ``pushactors bench small``,
``layerwise``, ``big`` and ``dram`` write. Every figure with a time on both sides (p50; a range
``a–b`` over runs is drawn as a bar with a lighter tail) becomes a pair of bars on one log scale.
Rows without a time on both sides (CPU shares, counts, a "—" baseline) are left out. The SVG is
written by hand (no plotting library) and depends only on its input, so a page's picture can be
checked against its table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

UNITS = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}
# The first time in a cell: "276 / 676 µs" (p50 / p99), "0.98–1.12 ms" (a range over runs),
# "one-descriptor WRITE 0.38–0.41 ms" (the baseline named first). p99s after a slash are skipped.
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_TIME = re.compile(rf"({_NUMBER})(?:\s*–\s*({_NUMBER}))?(?:\s*/\s*[\d,.–]+)*\s*(µs|ms|s)(?![\w/])")
_SEPARATOR = re.compile(r"^\|?\s*:?-{3,}")


class FiguresError(ValueError):
    """Input that holds no figures, or a table without the columns the picture needs."""


@dataclass(frozen=True)
class Figure:
    case: str
    pushactors: tuple[float, float]  # seconds, lowest and highest p50 over runs
    baseline: tuple[float, float]
    baseline_name: str
    device: str
    date: str


def parse_time(cell: str) -> tuple[tuple[float, float], str] | None:
    """The first time in a table cell, in seconds (low, high), and the words before it."""
    m = _TIME.search(cell)
    if m is None:
        return None
    scale = UNITS[m.group(3)]
    low = float(m.group(1).replace(",", "")) * scale
    high = float(m.group(2).replace(",", "")) * scale if m.group(2) else low
    return (low, high), cell[: m.start()].strip(" :(")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def figures_from_doc(text: str, heading: str = "## Current figures") -> list[Figure]:
    """The figures of the first table after ``heading`` in a Markdown page."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip().startswith(heading))
    except StopIteration:
        raise FiguresError(f"no {heading!r} section") from None
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    if len(rows) < 2 or not _SEPARATOR.match(rows[1]):
        raise FiguresError(f"no table under {heading!r}")
    header = [c.lower() for c in _cells(rows[0])]
    want = ("case", "pushactors", "bare nixl", "device", "date")
    missing = [w for w in want if w not in header]
    if missing:
        raise FiguresError(f"the table under {heading!r} lacks the columns {missing}")
    col = {w: header.index(w) for w in want}
    figures = []
    for row in rows[2:]:
        cells = _cells(row)
        if len(cells) != len(header):
            raise FiguresError(f"a row with {len(cells)} cells in a table of {len(header)} columns: {row}")
        ours, base = parse_time(cells[col["pushactors"]]), parse_time(cells[col["bare nixl"]])
        if ours is None or base is None:
            continue
        figures.append(
            Figure(
                case=cells[col["case"]].replace("`", ""),
                pushactors=ours[0],
                baseline=base[0],
                baseline_name=base[1] or "bare NIXL",
                device=cells[col["device"]],
                date=cells[col["date"]],
            )
        )
    return figures


def _device(data: dict[str, Any]) -> str:
    machine = data.get("machine") or {}
    return str(machine.get("gpu") or data.get("device") or machine.get("device") or "?")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def figures_from_json(data: dict[str, Any]) -> list[Figure]:
    """The figures of one bench JSON file (suites small, layerwise, big, dram)."""
    suite, device, date = data.get("suite"), _device(data), str(data.get("date", "?"))[:10]
    out: list[Figure] = []
    if suite == "small":
        for c in data["cases"]:
            ours = c.get("armed_us_p50", c.get("pushactors_us_p50"))
            base = c["bare"]["notif_us_p50"]
            if ours is None or base is None:
                continue
            t, b = ours * 1e-6, base * 1e-6
            case = f"{_size(int(c['bytes']))} push p50"
            out.append(Figure(case, (t, t), (b, b), "bare NIXL", device, date))
    elif suite == "layerwise":
        names = {
            "whole": ("one_descriptor_ms_p50", "one-descriptor WRITE"),
            "layerwise": ("one_layer_ms_p50", "one layer's WRITE"),
        }
        for mode, by_tokens in sorted(data["modes"].items()):
            key, name = names[mode]
            for tokens, m in sorted(by_tokens.items(), key=lambda kv: int(kv[0])):
                base = data["baselines"][str(tokens)][key]
                if m.get("after_ms_p50") is None or base is None:
                    continue
                t, b = m["after_ms_p50"] * 1e-3, base * 1e-3
                out.append(
                    Figure(f"{tokens} tokens {mode} push, after the last layer", (t, t), (b, b), name, device, date)
                )
    elif suite in ("big", "dram"):
        base = data["baselines"]["one_descriptor"]["ms_p50"] * 1e-3
        for c in data["cases"]:
            t = c["pushactors"]["push_ms_p50"] * 1e-3
            case = f"{_size(int(c['bytes']))} {c['layout']} {c['pattern']} push"
            out.append(Figure(case, (t, t), (base, base), "one-descriptor WRITE", device, date))
    else:
        raise FiguresError(f"no figures to draw from suite {suite!r} (small, layerwise, big, dram)")
    return out


# --- the picture ------------------------------------------------------------------------------
WIDTH, LEFT, RIGHT, TOP = 960, 20, 130, 64
CHAR = 6.6  # px per character of a 12 px label, to keep labels inside the picture
BAR, GAP, ROW = 14, 4, 66  # bar height, gap between the pair, one figure's height
OURS, BASE = ("#2a6fdb", "#9cbcf0"), ("#6b6b6b", "#c4c4c4")  # solid to the lowest run, tail to the highest


def _label(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            v = seconds / scale
            return f"{v:,.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"
    raise AssertionError("unreachable")


def _ratio(q: float) -> str:
    """As the page writes ratios: whole numbers from 5, two digits below."""
    return f"{q:.0f}" if q >= 5 else f"{q:.2g}"


def _range(r: tuple[float, float]) -> str:
    return _label(r[0]) if r[0] == r[1] else f"{_label(r[0])}–{_label(r[1])}"


def render_svg(figures: list[Figure], title: str) -> str:
    if not figures:
        raise FiguresError("no figure has a time on both sides")
    values = [v for f in figures for v in (*f.pushactors, *f.baseline)]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))
    if hi <= lo:
        hi = lo * 10
    span = WIDTH - LEFT - RIGHT

    def x(v: float) -> float:
        return LEFT + span * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    height = TOP + ROW * len(figures) + 36
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<rect x="{LEFT}" y="34" width="12" height="10" fill="{OURS[0]}"/>'
        f'<text x="{LEFT + 16}" y="43">pushactors</text>'
        f'<rect x="{LEFT + 100}" y="34" width="12" height="10" fill="{BASE[0]}"/>'
        f'<text x="{LEFT + 116}" y="43">baseline (bare NIXL unless named), same run</text>'
        f'<text x="{WIDTH - RIGHT}" y="43" text-anchor="end" fill="#555">'
        "p50, log scale; lighter: the spread over runs</text>",
    ]
    decade = lo
    while decade <= hi * 1.0001:
        gx = x(decade)
        out.append(f'<line x1="{gx:.1f}" y1="{TOP - 6}" x2="{gx:.1f}" y2="{height - 30}" stroke="#e2e2e2"/>')
        out.append(
            f'<text x="{gx:.1f}" y="{height - 14}" text-anchor="middle" fill="#555">{escape(_label(decade))}</text>'
        )
        decade *= 10
    for i, f in enumerate(figures):
        y = TOP + i * ROW
        ratio_lo, ratio_hi = _ratio(f.pushactors[0] / f.baseline[1]), _ratio(f.pushactors[1] / f.baseline[0])
        ratio = f"{ratio_lo}×" if ratio_lo == ratio_hi else f"{ratio_lo}–{ratio_hi}×"
        head = f"{f.case} ({f.device}, {f.date}): {ratio}"
        out.append(f'<text x="{LEFT}" y="{y + 10}" font-weight="bold">{escape(head)}</text>')
        for j, (r, colours, name) in enumerate(
            ((f.pushactors, OURS, "pushactors"), (f.baseline, BASE, f.baseline_name))
        ):
            by = y + 16 + j * (BAR + GAP)
            x0, x1, x2 = x(lo), x(r[0]), x(r[1])
            out.append(
                f'<rect x="{x0:.1f}" y="{by}" width="{x1 - x0:.1f}" height="{BAR}" fill="{colours[0]}">'
                f"<title>{escape(name)}: {escape(_range(r))}</title></rect>"
            )
            if x2 > x1:
                out.append(f'<rect x="{x1:.1f}" y="{by}" width="{x2 - x1:.1f}" height="{BAR}" fill="{colours[1]}"/>')
            label = _range(r) if name == "pushactors" else f"{name}: {_range(r)}"
            if x2 + 4 + CHAR * len(label) <= WIDTH:
                out.append(f'<text x="{x2 + 4:.1f}" y="{by + BAR - 3}">{escape(label)}</text>')
            else:  # no room on the right: inside the bar's end
                out.append(
                    f'<text x="{x1 - 4:.1f}" y="{by + BAR - 3}" text-anchor="end" fill="white">{escape(label)}</text>'
                )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="*", type=Path, help="bench JSON files (small, layerwise, big, dram)")
    parser.add_argument("--doc", type=Path, help='a Markdown page whose "Current figures" table to draw')
    parser.add_argument("--out", type=Path, required=True, help="the SVG to write")
    parser.add_argument("--title", default="pushactors beside bare NIXL")
    args = parser.parse_args(argv)
    if not args.json and args.doc is None:
        parser.error("give --doc PAGE or bench JSON files")
    try:
        figures = figures_from_doc(args.doc.read_text()) if args.doc else []
        for path in args.json:
            figures += figures_from_json(json.loads(path.read_text()))
        svg = render_svg(figures, args.title)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"figures: {exc}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg)
    print(f"{len(figures)} figures -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
