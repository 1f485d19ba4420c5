"""``bench/figures.py``: the picture of docs/performance.md's figures, from its table or from the
JSON the benches write, and the page's picture kept the table's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pushactors.apps.cli import main as cli

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "figures.py"
PAGE = ROOT / "docs" / "performance.md"
PICTURE = ROOT / "docs" / "performance-figures.svg"
SVG = "{http://www.w3.org/2000/svg}"


def _figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_figures", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


fig = _figures()

TABLE = """# Page

## Current figures

| case | pushactors | bare NIXL | ratio | device | commit | date |
|---|---|---|---|---|---|---|
| small push p50 / p99 | 276 / 676 µs | 20–33 µs | 8–14× | H100 | abc1234 | 2026-12-07 |
| big push | 0.98–1.12 ms | one-descriptor WRITE 0.38–0.41 ms | 2.4–2.9× | H100 | abc1234 | 2026-12-07 |
| steps made late | 2–5 of ~300 | — | — | H100 | abc1234 | 2026-12-07 |
| idle CPU | 2.9% of a core | — | — | H100 | abc1234 | 2026-12-07 |

Text after the table.

## Next
"""


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def _bars(svg: str) -> dict[str, float]:
    """Each solid bar's tooltip (``name: value``) → its width."""
    root = ET.fromstring(svg)
    bars = {}
    for rect in root.iter(f"{SVG}rect"):
        title = rect.find(f"{SVG}title")
        if title is not None and title.text:
            bars[title.text] = float(rect.get("width", "nan"))
    return bars


@pytest.mark.parametrize(
    ("cell", "want", "name"),
    [
        ("276 / 676 µs", (276e-6, 276e-6), ""),
        ("539–640 / 5,391–5,580 µs", (539e-6, 640e-6), ""),
        ("one-descriptor WRITE 0.38–0.41 ms", (0.38e-3, 0.41e-3), "one-descriptor WRITE"),
        ("vLLM's connectors (re-pin off) 440 / 408 ms", (0.44, 0.44), "vLLM's connectors (re-pin off)"),
        ("8–17 µs (made ahead: the same)", (8e-6, 17e-6), ""),
    ],
)
def test_a_cell_gives_its_first_time_in_seconds(cell: str, want: tuple[float, float], name: str) -> None:
    got = fig.parse_time(cell)
    assert got is not None
    assert got[0] == pytest.approx(want) and got[1] == name


@pytest.mark.parametrize("cell", ["—", "2–5 of ~300", "2.9% of a core", "~1,500 pushes/s"])
def test_a_cell_without_a_time_gives_none(cell: str) -> None:
    assert fig.parse_time(cell) is None


def test_the_table_rows_with_a_time_on_both_sides_are_drawn_to_scale() -> None:
    figures = fig.figures_from_doc(TABLE)
    assert [f.case for f in figures] == ["small push p50 / p99", "big push"]
    small, big = figures
    assert small.pushactors == pytest.approx((276e-6, 276e-6)) and small.baseline_name == "bare NIXL"
    assert big.baseline == pytest.approx((0.38e-3, 0.41e-3)) and big.baseline_name == "one-descriptor WRITE"
    assert (big.device, big.date) == ("H100", "2026-12-07")
    bars = _bars(fig.render_svg(figures, "t"))
    assert set(bars) == {
        "pushactors: 276 µs",
        "bare NIXL: 20 µs–33 µs",
        "pushactors: 980 µs–1.12 ms",
        "one-descriptor WRITE: 380 µs–410 µs",
    }
    # Log scale from 10 µs to 10 ms: each bar ends where its lowest value sits on it.
    assert bars["bare NIXL: 20 µs–33 µs"] < bars["pushactors: 276 µs"] < bars["one-descriptor WRITE: 380 µs–410 µs"]
    assert bars["one-descriptor WRITE: 380 µs–410 µs"] < bars["pushactors: 980 µs–1.12 ms"]


def test_a_table_without_the_needed_columns_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("## Current figures\n\n| case | pushactors |\n|---|---|\n| a | 1 ms |\n")
    done = _run("--doc", page, "--out", tmp_path / "x.svg")
    assert done.returncode == 2 and "lacks the columns" in done.stderr and not (tmp_path / "x.svg").exists()


def test_the_pages_picture_is_its_tables(tmp_path: Path) -> None:
    out = tmp_path / "figures.svg"
    done = _run("--doc", PAGE, "--out", out)
    assert done.returncode == 0, done.stderr
    assert "![" in PAGE.read_text() and "(performance-figures.svg)" in PAGE.read_text()
    assert PICTURE.read_text() == out.read_text(), (
        "docs/performance-figures.svg is not the table's: "
        "python bench/figures.py --doc docs/performance.md --out docs/performance-figures.svg"
    )
    assert len(fig.figures_from_doc(PAGE.read_text())) >= 4  # the page's rows with bare NIXL beside them


def _small(bytes_: int, ours_us: float, bare_us: float) -> dict[str, Any]:
    return {"bytes": bytes_, "armed_us_p50": ours_us, "bare": {"notif_us_p50": bare_us}}


def test_bench_json_of_each_suite_is_drawn(tmp_path: Path) -> None:
    machine = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}
    files = {
        "small": {
            "suite": "small",
            "device": "cuda",
            "machine": machine,
            "date": "2026-12-07 10:00:00 UTC",
            "cases": [_small(1 << 20, 276.0, 25.0)],
        },
        "layerwise": {
            "suite": "layerwise",
            "machine": machine,
            "date": "2026-12-07 11:00:00 UTC",
            "baselines": {"4096": {"one_descriptor_ms_p50": 0.4, "one_layer_ms_p50": 0.03}},
            "modes": {"whole": {"4096": {"after_ms_p50": 1.0}}, "layerwise": {"4096": {"after_ms_p50": 0.4}}},
        },
        "dram": {
            "suite": "dram",
            "device": "cpu",
            "machine": {"device": "cpu"},
            "date": "2026-12-07",
            "baselines": {"one_descriptor": {"ms_p50": 12.0}},
            "cases": [
                {"bytes": 64 << 20, "layout": "hnd", "pattern": "contiguous", "pushactors": {"push_ms_p50": 15.0}}
            ],
        },
    }
    paths = []
    for name, data in files.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "figures.svg"
    done = _run(*paths, "--out", out)
    assert done.returncode == 0, done.stderr
    bars = _bars(out.read_text())
    assert bars.keys() == {
        "pushactors: 276 µs",
        "bare NIXL: 25 µs",
        "pushactors: 1 ms",
        "one-descriptor WRITE: 400 µs",
        "pushactors: 400 µs",
        "one layer's WRITE: 30 µs",
        "pushactors: 15 ms",
        "one-descriptor WRITE: 12 ms",
    }
    text = out.read_text()
    assert "1 MiB push p50 (NVIDIA H100 80GB HBM3, 2026-12-07): 11×" in text
    assert "4096 tokens layerwise push, after the last layer" in text and "64 MiB hnd contiguous push (cpu" in text


def test_a_suite_without_figures_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "control.json"
    path.write_text(json.dumps({"suite": "control"}))
    done = _run(path, "--out", tmp_path / "x.svg")
    assert done.returncode == 2 and "no figures to draw from suite 'control'" in done.stderr


@pytest.mark.real_nixl
def test_the_json_a_real_small_bench_writes_is_drawn(tmp_path: Path) -> None:
    data = tmp_path / "small.json"
    assert cli(["bench", "small", "--json", str(data), "--sizes", "65536", "--count", "4"]) == 0
    out = tmp_path / "figures.svg"
    done = _run(data, "--out", out)
    assert done.returncode == 0, done.stderr
    (case,) = json.loads(data.read_text())["cases"]
    bars = _bars(out.read_text())
    assert len(bars) == 2 and "64 KiB push p50" in out.read_text()
    ours = next(w for t, w in bars.items() if t.startswith("pushactors"))
    bare = next(w for t, w in bars.items() if t.startswith("bare NIXL"))
    assert (ours > bare) == (case["armed_us_p50"] > case["bare"]["notif_us_p50"])
