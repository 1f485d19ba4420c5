"""The pages a new reader opens first say what they must: README's two commands and what they
need, the headline figures at the top of README and docs/performance.md, dated runs in
docs/performance-history.md, a CHANGELOG in Keep a Changelog form whose release is the package's
version, CI running README's test command, and no link to a page that is not there."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pushactors

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "performance.md"
HISTORY = ROOT / "docs" / "performance-history.md"
CHANGELOG = ROOT / "CHANGELOG.md"
FIRST_SCREEN = 40  # lines
FIGURE_COLUMNS = ["case", "pushactors", "bare NIXL", "ratio", "device", "commit", "date"]
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_readme_is_short_and_opens_with_the_two_commands_and_what_they_need() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"
    first = "\n".join(lines[:FIRST_SCREEN])
    assert "./.ci/bootstrap && .venv/bin/pushactors demo" in first
    assert "./.ci/test" in first
    assert "What they need" in first and "No root" in first


def test_ci_runs_the_test_command_the_readme_gives() -> None:
    """.ci/run ends by running a command that README's first code block shows."""
    run = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    last = shlex.split(run[-1])
    assert last[0] == "exec", run[-1]
    command = last[1]
    shown = [shlex.split(line.split("#")[0]) for line in _code_blocks(README.read_text())[0].splitlines()]
    assert any(words and words[0] == command for words in shown), f"README's commands do not include {command}"
    assert "PUSHACTORS_REQUIRE_VLLM=1" in "\n".join(run) and "PUSHACTORS_REQUIRE_BROWSER=1" in "\n".join(run)


def test_the_core_tiers_do_not_build_what_needs_root() -> None:
    """./.ci/test builds the vLLM and browser environments only where CI requires those tiers."""
    test = (ROOT / ".ci" / "test").read_text()
    for script, flag in (
        ("bootstrap-browser", "PUSHACTORS_REQUIRE_BROWSER"),
        ("bootstrap-vllm", "PUSHACTORS_REQUIRE_VLLM"),
    ):
        at = test.index(f"./.ci/{script}")
        guard = test.rfind("if ", 0, at)
        assert guard != -1 and flag in test[guard:at], f"./.ci/{script} runs without {flag}"
    assert "-rs" in test  # each skipped tier prints its reason


def _table(lines: list[str], start: int) -> list[list[str]]:
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_performance_opens_with_the_current_figures() -> None:
    lines = PERFORMANCE.read_text().splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("## "))
    assert lines[heading] == "## Current figures" and heading < 10
    table = next(i for i in range(heading, len(lines)) if lines[i].startswith("|"))
    rows = _table(lines, table)
    assert rows[0] == FIGURE_COLUMNS and table < 20, "the figures table opens the page"
    for row in rows[2:]:
        assert len(row) == len(FIGURE_COLUMNS), row
        fields = dict(zip(FIGURE_COLUMNS, row, strict=True))
        assert DATE.fullmatch(fields["date"]), row
        assert re.match(r"[0-9a-f]{7,40}\b", fields["commit"]), row
        assert fields["device"] and fields["pushactors"], row
    after = "\n".join(lines[table + len(rows) : table + len(rows) + 3])
    assert "(performance-figures.svg)" in after, "the picture follows the table"
    sections = [line for line in lines if line.startswith("## ")]
    assert sections[1] == "## How to reproduce"
    dated = [s for s in sections if DATE.search(s)]
    assert not dated, f"dated runs belong in docs/performance-history.md: {dated}"


def test_history_holds_dated_runs_only() -> None:
    sections = [line for line in HISTORY.read_text().splitlines() if line.startswith("## ")]
    assert sections
    assert all(DATE.search(s) for s in sections), [s for s in sections if not DATE.search(s)]


def test_changelog_keeps_an_unreleased_section_over_the_release_of_this_version() -> None:
    text = CHANGELOG.read_text()
    assert text.startswith("# Changelog\n") and "keepachangelog.com" in text
    releases = re.findall(r"^## (.*)$", text, flags=re.M)
    assert releases[0] == "[Unreleased]"
    version = re.fullmatch(r"\[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})", releases[1])
    assert version, releases[1]
    assert version.group(1) == pushactors.__version__
    for heading in re.findall(r"^### (.*)$", text, flags=re.M):
        assert heading in {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, heading


def test_released_changelog_entries_are_one_or_two_lines() -> None:
    """A release sums up in short entries; the detail is in git (Unreleased is the lead's draft)."""
    text = CHANGELOG.read_text()
    released = text[text.index("\n## [", text.index("## [Unreleased]") + 1) :]
    long = []
    entry: list[str] = []
    for line in [*released.splitlines(), ""]:
        if line.startswith("- ") or not line.startswith("  "):
            if len(entry) > 2:
                long.append(entry[0])
            entry = [line] if line.startswith("- ") else []
        elif entry:
            entry.append(line)
    assert not long, "entries longer than two lines:\n" + "\n".join(long)


def _pages() -> list[Path]:
    return [README, CHANGELOG, *sorted((ROOT / "docs").glob("*.md"))]


def broken_links(page: Path) -> list[str]:
    """Relative links of a Markdown page, outside code blocks, to files that are not there."""
    text = page.read_text()
    for block in _code_blocks(text):
        text = text.replace(block, "")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(f"{page.name}: {target}")
    return broken


def test_every_relative_link_of_the_pages_leads_to_a_file() -> None:
    broken = [hit for page in _pages() for hit in broken_links(page)]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "here.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[a](here.md) [b](gone.md#part) [c](https://example.com) [d](#top)\n```\n[e](also-gone.md)\n```\n")
    assert broken_links(page) == ["page.md: gone.md#part"]
