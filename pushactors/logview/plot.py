"""Pictures of a trace (lanes of hops over the stages) and of a run's stage latencies.

``.html`` writes one self-contained page (no network, no server): the data is embedded as JSON
and a small inline script draws it as SVG, then marks ``document.body.dataset.rendered`` with
the number of marks drawn (``dataset.error`` if anything threw), so a headless browser can check
it. ``.png`` draws with matplotlib (Agg), imported only then: it is an optional dependency.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from .stages import STAGES
from .summary import END_TO_END, Summary
from .trace import Trace

LEVEL_COLOURS = {
    "debug": "#4e79a7",
    "info": "#59a14f",
    "warning": "#f28e2b",
    "error": "#e15759",
    "critical": "#b07aa1",
}
STAGE_COLOURS = ["#dfe9f5", "#e8f3e0", "#f6ecd9", "#ece4f3", "#e0f0ef"]
STALL_COLOUR = "#f8c9c9"
PLOT_HINT = "drawing PNG files needs matplotlib: pip install 'pushactors[plot]'"


def _suffix(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in (".html", ".png"):
        raise ValueError(f"cannot draw {str(path)!r}: the file name must end in .html or .png")
    return suffix


def _json_for_script(data: Any) -> str:
    """JSON safe inside <script>: no "</script>", "<!--" or "&" can close or bend the element."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, default=str)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _lane(process: str, actor: str) -> str:
    return f"{process} · {actor or '?'}"


# --- data for the pictures ---------------------------------------------------------------------------
def trace_data(trace: Trace) -> dict[str, Any]:
    """What the trace pictures draw, with times in ms from the first hop."""
    t0 = trace.first or 0.0
    lanes: list[str] = []
    bars = []
    for hop in trace.hops:
        name = _lane(hop.process, hop.actor)
        if name not in lanes:
            lanes.append(name)
        tip = [
            f"{hop.event}  ({hop.level})",
            f"{hop.process} {hop.actor}",
            *([f"msg {hop.msg}"] if hop.msg else []),
            *([f"wait {hop.wait_ms:.3f} ms"] if hop.wait_ms is not None else []),
            *([f"handler {hop.handle_ms:.3f} ms"] if hop.handle_ms is not None else []),
            f"at +{(hop.start - t0) * 1e3:.3f} ms",
            *([f"request {hop.request_id}"] if hop.request_id else []),
            *(f"{k}={v}" for k, v in hop.fields.items() if v is not None),
        ]
        bars.append(
            {
                "lane": lanes.index(name),
                "a": (hop.arrival - t0) * 1e3,
                "s": (hop.start - t0) * 1e3,
                "e": (hop.end - t0) * 1e3,
                "level": hop.level,
                "label": hop.event,
                "tip": "\n".join(tip),
            }
        )
    stages = []
    for span in trace.stages:
        if span.start is None or span.end is None:
            continue
        stall = trace.stall_of(span.name)
        stages.append(
            {
                "name": span.name,
                "s": (span.start - t0) * 1e3,
                "e": (span.end - t0) * 1e3,
                "ms": span.duration_ms,
                "stall": stall.describe() if stall is not None else None,
            }
        )
    title = f"trace {trace.query}: {trace.outcome}"
    if trace.reason:
        title += f" ({trace.reason})"
    if trace.total_ms is not None:
        title += f", {trace.total_ms:.3f} ms"
    notes = [", ".join(trace.ids)]
    if trace.waiting_on:
        waited = f" for {trace.waiting_ms:.3f} ms" if trace.waiting_ms is not None else ""
        notes.append(f"waiting on {trace.waiting_on}{waited}")
    notes += [f"STALL: {s.describe()}" for s in trace.stalls]
    return {"title": title, "notes": notes, "lanes": lanes, "bars": bars, "stages": stages}


def summary_data(summary: Summary) -> dict[str, Any]:
    rows = []
    for name in (*STAGES, END_TO_END):
        samples = summary.samples.get(name, [])
        dist = summary.stages.get(name)
        rows.append(
            {
                "name": "end to end" if name == END_TO_END else name,
                "points": [[key, ms] for key, ms in samples],
                "p50": dist.p50 if dist else None,
                "p90": dist.p90 if dist else None,
                "p99": dist.p99 if dist else None,
            }
        )
    outcomes = ", ".join(f"{k} {v}" for k, v in summary.outcomes.items())
    title = f"stage latencies: {summary.requests} requests ({outcomes}) over {summary.span_s:.3f} s"
    return {"title": title, "rows": rows}


# --- HTML --------------------------------------------------------------------------------------------
_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 16px; margin: 0 0 6px; }}
p.note {{ margin: 2px 0; color: #555; }}
p.stall {{ color: #b00; font-weight: bold; }}
svg text {{ font: 11px system-ui, sans-serif; }}
svg .bar:hover rect, svg .pt:hover {{ stroke: #000; stroke-width: 1; }}
</style></head>
<body>
<script>
window.onerror = function (message, source, line) {{
  document.body.dataset.error = String(message) + " (line " + line + ")";
}};
</script>
<h1 id="title"></h1><div id="notes"></div><div id="chart"></div>
<script type="application/json" id="data">{data}</script>
<script>
{script}
</script>
</body></html>
"""

_COMMON_JS = """
var NS = "http://www.w3.org/2000/svg";
function el(name, attrs, parent) {
  var node = document.createElementNS(NS, name);
  for (var k in attrs) { node.setAttribute(k, attrs[k]); }
  if (parent) { parent.appendChild(node); }
  return node;
}
function tip(node, text) { var t = el("title", {}, node); t.textContent = text; }
function label(parent, x, y, text, attrs) {
  var a = attrs || {}; a.x = x; a.y = y;
  var t = el("text", a, parent); t.textContent = text; return t;
}
var DATA = JSON.parse(document.getElementById("data").textContent);
document.getElementById("title").textContent = DATA.title;
"""

_TRACE_JS = """
(function () {
  var notes = document.getElementById("notes");
  DATA.notes.forEach(function (n) {
    var p = document.createElement("p");
    p.className = n.indexOf("STALL") === 0 ? "note stall" : "note";
    p.textContent = n; notes.appendChild(p);
  });
  var LEVELS = %(levels)s, STAGE = %(stage_colours)s, STALL = "%(stall)s";
  var left = 330, right = 30, top = 46, laneH = 26, W = 1280;
  var H = top + DATA.lanes.length * laneH + 40;
  var lo = 0, hi = 0;
  DATA.bars.forEach(function (b) { lo = Math.min(lo, b.a); hi = Math.max(hi, b.e); });
  DATA.stages.forEach(function (s) { lo = Math.min(lo, s.s); hi = Math.max(hi, s.e); });
  if (hi - lo <= 0) { hi = lo + 1; }
  var plotW = W - left - right;
  function x(t) { return left + (t - lo) / (hi - lo) * plotW; }
  var svg = el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H}, document.getElementById("chart"));
  DATA.stages.forEach(function (s, i) {
    var g = el("g", {"class": "stage"}, svg);
    var r = el("rect", {x: x(s.s), y: top - 6, width: Math.max(1, x(s.e) - x(s.s)),
      height: DATA.lanes.length * laneH + 6, fill: s.stall ? STALL : STAGE[i %% STAGE.length], opacity: 0.9}, g);
    tip(r, s.name + ": " + s.ms.toFixed(3) + " ms" + (s.stall ? "\\nSTALL: " + s.stall : ""));
    var nearEnd = x(s.s) > W - right - 160;  // keep the label inside the picture
    label(g, nearEnd ? x(s.e) - 2 : x(s.s) + 2, 14 + (i %% 2) * 14,
      s.name + " " + s.ms.toFixed(2) + " ms" + (s.stall ? " STALL" : ""),
      {fill: s.stall ? "#b00" : "#333", "text-anchor": nearEnd ? "end" : "start"});
    el("line", {x1: x(s.s), x2: x(s.s), y1: 18 + (i %% 2) * 14, y2: top + DATA.lanes.length * laneH,
      stroke: "#999", "stroke-dasharray": "3,3"}, g);
  });
  DATA.lanes.forEach(function (name, i) {
    var y = top + i * laneH;
    el("line", {x1: left, x2: W - right, y1: y + laneH, y2: y + laneH, stroke: "#eee"}, svg);
    label(svg, left - 6, y + laneH / 2 + 4, name, {"text-anchor": "end"});
  });
  var drawn = 0;
  DATA.bars.forEach(function (b) {
    var y = top + b.lane * laneH + 5, h = laneH - 10, colour = LEVELS[b.level] || "#777";
    var g = el("g", {"class": "bar"}, svg);
    if (b.s > b.a) {
      el("rect", {x: x(b.a), y: y, width: Math.max(1, x(b.s) - x(b.a)), height: h, fill: colour, opacity: 0.3}, g);
    }
    el("rect", {x: x(b.s), y: y, width: Math.max(2, x(b.e) - x(b.s)), height: h, fill: colour}, g);
    tip(g, b.tip);
    drawn += 1;
  });
  var axisY = top + DATA.lanes.length * laneH + 16;
  for (var k = 0; k <= 8; k++) {
    var t = lo + (hi - lo) * k / 8;
    el("line", {x1: x(t), x2: x(t), y1: axisY - 10, y2: axisY - 6, stroke: "#666"}, svg);
    label(svg, x(t), axisY + 6, t.toFixed(2) + " ms", {"text-anchor": "middle", fill: "#555"});
  }
  document.body.dataset.rendered = String(drawn);
})();
"""

_SUMMARY_JS = """
(function () {
  var left = 130, right = 40, top = 30, rowH = 54, W = 1100;
  var rows = DATA.rows, H = top + rows.length * rowH + 40;
  var lo = Infinity, hi = 0;
  rows.forEach(function (r) { r.points.forEach(function (p) {
    if (p[1] > 0) { lo = Math.min(lo, p[1]); hi = Math.max(hi, p[1]); } }); });
  if (!isFinite(lo)) { lo = 0.001; hi = 1; }
  lo = lo / 1.5; hi = Math.max(hi * 1.5, lo * 10);
  var plotW = W - left - right;
  function x(ms) { var v = Math.max(ms, lo); return left + (Math.log10(v) - Math.log10(lo)) /
    (Math.log10(hi) - Math.log10(lo)) * plotW; }
  var svg = el("svg", {width: W, height: H, viewBox: "0 0 " + W + " " + H}, document.getElementById("chart"));
  var drawn = 0;
  rows.forEach(function (r, i) {
    var y = top + i * rowH, mid = y + rowH / 2;
    el("line", {x1: left, x2: W - right, y1: y + rowH, y2: y + rowH, stroke: "#eee"}, svg);
    label(svg, left - 8, mid + 4, r.name + " (" + r.points.length + ")", {"text-anchor": "end"});
    if (r.p50 !== null) {
      el("line", {x1: x(r.p50), x2: x(r.p50), y1: y + 6, y2: y + rowH - 6, stroke: "#222", "stroke-width": 2}, svg);
      el("line", {x1: x(r.p90), x2: x(r.p90), y1: y + 10, y2: y + rowH - 10, stroke: "#f28e2b", "stroke-width": 2},
        svg);
      el("line", {x1: x(r.p99), x2: x(r.p99), y1: y + 14, y2: y + rowH - 14, stroke: "#e15759", "stroke-width": 2},
        svg);
    }
    r.points.forEach(function (p, j) {
      var jitter = ((j * 2654435761) %% 1000) / 1000 - 0.5;
      var c = el("circle", {"class": "pt", cx: x(p[1]), cy: mid + jitter * (rowH - 18), r: 2.5,
        fill: "#4e79a7", opacity: 0.55}, svg);
      tip(c, r.name + ": " + p[1].toFixed(3) + " ms\\n" + p[0]);
      drawn += 1;
    });
  });
  var axisY = top + rows.length * rowH + 16;
  for (var e = Math.ceil(Math.log10(lo)); e <= Math.floor(Math.log10(hi)); e++) {
    var v = Math.pow(10, e);
    el("line", {x1: x(v), x2: x(v), y1: top, y2: axisY - 6, stroke: "#ddd"}, svg);
    label(svg, x(v), axisY + 6, v + " ms", {"text-anchor": "middle", fill: "#555"});
  }
  label(svg, left, 16, "black: p50, orange: p90, red: p99 (log scale)", {fill: "#555"});
  document.body.dataset.rendered = String(drawn);
})();
"""


def _page(title: str, data: dict[str, Any], script: str) -> str:
    return _PAGE.format(title=html.escape(title), data=_json_for_script(data), script=_COMMON_JS + script)


def trace_html(trace: Trace) -> str:
    data = trace_data(trace)
    script = _TRACE_JS % {
        "levels": json.dumps(LEVEL_COLOURS),
        "stage_colours": json.dumps(STAGE_COLOURS),
        "stall": STALL_COLOUR,
    }
    return _page(data["title"], data, script)


def summary_html(summary: Summary) -> str:
    data = summary_data(summary)
    return _page(data["title"], data, _SUMMARY_JS % {})


# --- PNG ---------------------------------------------------------------------------------------------
def _figure(width: float, height: float) -> Any:
    """A matplotlib Figure on the Agg canvas (no pyplot, no global backend switch)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(PLOT_HINT) from exc
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def trace_png(trace: Trace, path: Path) -> None:
    data = trace_data(trace)
    lanes = data["lanes"]
    fig = _figure(14, 1.6 + 0.4 * max(1, len(lanes)))
    ax = fig.add_subplot(1, 1, 1)
    for i, stage in enumerate(data["stages"]):
        colour = STALL_COLOUR if stage["stall"] else STAGE_COLOURS[i % len(STAGE_COLOURS)]
        ax.axvspan(stage["s"], max(stage["e"], stage["s"]), color=colour, zorder=0)
        ax.axvline(stage["s"], color="#999", linestyle="--", linewidth=0.8, zorder=1)
        text = f"{stage['name']} {stage['ms']:.2f} ms" + (" STALL" if stage["stall"] else "")
        ax.annotate(
            text,
            (stage["s"], 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 2 + 10 * (i % 2)),
            textcoords="offset points",
            fontsize=7,
            color="#b00" if stage["stall"] else "#333",
        )
    span = max([b["e"] for b in data["bars"]] + [1e-3]) - min([b["a"] for b in data["bars"]] + [0.0])
    least = span * 0.003  # an instant event still shows as a sliver
    for bar in data["bars"]:
        colour = LEVEL_COLOURS.get(bar["level"], "#777")
        y = len(lanes) - 1 - bar["lane"]
        if bar["s"] > bar["a"]:
            ax.barh(y, bar["s"] - bar["a"], left=bar["a"], height=0.6, color=colour, alpha=0.3, zorder=2)
        ax.barh(y, max(bar["e"] - bar["s"], least), left=bar["s"], height=0.6, color=colour, zorder=3)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(lanes)), fontsize=8)
    ax.set_xlabel("ms since the first hop")
    ax.set_title(data["title"], fontsize=9, pad=24)
    fig.tight_layout()
    fig.savefig(path, format="png")


def summary_png(summary: Summary, path: Path) -> None:
    data = summary_data(summary)
    rows = [r for r in data["rows"] if r["points"]]
    fig = _figure(10, 1.5 + 0.6 * max(1, len(rows)))
    ax = fig.add_subplot(1, 1, 1)
    if rows:
        values = [[max(ms, 1e-3) for _, ms in r["points"]] for r in rows]  # log scale: no zeros
        try:
            ax.boxplot(values, orientation="horizontal", whis=(1, 99))
        except TypeError:  # matplotlib < 3.10 names it differently
            ax.boxplot(values, vert=False, whis=(1, 99))
        ax.set_yticks(range(1, len(rows) + 1))
        ax.set_yticklabels([f"{r['name']} ({len(r['points'])})" for r in rows], fontsize=8)
        ax.set_xscale("log")
        ax.invert_yaxis()
    else:
        ax.text(0.5, 0.5, "no complete stages in these logs", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("ms (log scale; whiskers p1-p99)")
    ax.set_title(data["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")


# --- entry points ----------------------------------------------------------------------------------
def plot_trace(trace: Trace, path: str | Path) -> None:
    """Draw ``trace`` to ``path``: ``.html`` (self-contained page) or ``.png`` (matplotlib)."""
    if _suffix(path) == ".html":
        Path(path).write_text(trace_html(trace), encoding="utf-8")
    else:
        trace_png(trace, Path(path))


def plot_summary(summary: Summary, path: str | Path) -> None:
    """Draw the run's per-stage latency distributions to ``path`` (``.html`` or ``.png``)."""
    if _suffix(path) == ".html":
        Path(path).write_text(summary_html(summary), encoding="utf-8")
    else:
        summary_png(summary, Path(path))
