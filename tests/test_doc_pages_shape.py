"""The shape of the documentation pages: a reader can scan them (headings, so the site shows a table
of contents), and the benchmarks page starts with today's figures (the newest results, not a dated
history)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.current import current_rows, markdown_table

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# of prose between two headings (code blocks and tables are left out: they scan by themselves)
MOST_WORDS = 600


def prose_runs(text: str) -> list[tuple[str, int]]:
    """``(heading, words of prose under it before the next heading)`` for each part of a Markdown
    page."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    runs, heading, words = [], "(the top of the page)", 0
    for line in text.splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            runs.append((heading, words))
            heading, words = m.group(1), 0
        elif not line.lstrip().startswith("|"):
            words += len(line.split())
    return [*runs, (heading, words)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_no_long_stretch_of_a_page_goes_without_a_heading(page):
    long = [(h, n) for h, n in prose_runs(page.read_text()) if n > MOST_WORDS]
    assert not long, (
        f"{page.relative_to(ROOT)}: {long} ((heading, words) with more than {MOST_WORDS} words of "
        "prose before the next heading): split the part under ## / ### headings a reader can scan "
        "(the site's table of contents)"
    )


def test_a_wall_of_text_is_caught():
    page = ("# Title\n\n" + "word " * 700 + "\n\n```python\n" + "code " * 900
            + "\n```\n## Next\nshort\n")
    assert prose_runs(page) == [("(the top of the page)", 0), ("Title", 700), ("Next", 1)]


def test_the_benchmarks_page_starts_with_the_newest_figures():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    first_image = re.search(r"!\[[^\]]*\]\(([^)]+)\)", page).group(1)
    # docs/figures/benchmarks.py draws it from the results
    assert first_image == "assets/benchmark-ratios.png"
    first_table = re.search(r"^\|.*?(?=\n[^|])", page, flags=re.S | re.M).group(0)
    want = markdown_table(current_rows())
    assert first_table == want, (
        "docs/benchmarks.md's first table is not the newest results' (benchmarks/results): replace "
        f"it with what `python -m benchmarks.current` prints:\n{want}"
    )
    assert page.index("## Today's figures") < page.index("## How to rerun them")


def test_today_s_figures_take_each_row_from_the_newest_run_that_measured_it(tmp_path):
    import json

    def run(name, date, ratio, key="P1"):
        row = {"key": key, "model": "mlp-small", "candidate_label": "c", "baseline_label": "b",
               "target": None,
               "status": "info", "ratio": {"median": ratio, "ci_low": ratio - 0.01,
                                           "ci_high": ratio + 0.01}}
        (tmp_path / name).write_text(json.dumps({"machine": {"date": date}, "rows": [row]}))

    run("2026-01-02-new.json", "2026-01-02T00:00:00+00:00", 1.0)
    run("2026-01-01-old.json", "2026-01-01T00:00:00+00:00", 0.5)
    # an older commit, kept for comparison
    run("2026-01-03-x-before1.json", "2026-01-03T00:00:00+00:00", 0.7)
    run("2026-01-01-other.json", "2026-01-01T00:00:00+00:00", 0.9, key="fsdp")
    rows = {r["key"]: (r["ratio"]["median"], r["date"]) for r in current_rows(tmp_path)}
    assert rows == {"P1": (1.0, "2026-01-02"), "fsdp": (0.9, "2026-01-01")}
