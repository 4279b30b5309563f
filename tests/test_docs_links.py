"""Every relative link in the docs points at a file that exists, and at a heading it has.

Pages move (docs/ is grouped into use, reference, design and results; results pages split by
topic), and a link left pointing at the old place renders as a 404 with nothing to say so. The
rule: a link target that is not a URL (``scheme:``) is a path relative to the page, optionally
with ``#anchor``; the file must exist, and for a Markdown file the anchor must be one of its
headings' GitHub slugs (lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``).
Links inside code (fenced blocks, inline backticks) are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "benchmarks").rglob("*.md")),
]
FENCED = re.compile(r"^\s*```.*?^\s*```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#+\s+(?P<title>.+?)\s*$", re.MULTILINE)


def slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m.group("title")) for m in HEADING.finditer(FENCED.sub("", page.read_text()))}


def broken_links(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCED.sub("", page.read_text()))
    broken = []
    for m in LINK.finditer(text):
        target = m.group("target")
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: {broken_links(page)}"


def test_the_rule_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Title: one, two\n\n## 2026-11-26: m = 2's run\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#title-one-two) [ok](b.md#2026-11-26-m--2s-run) [web](https://x.org/y.md)\n"
        "[gone](c.md) [no anchor](b.md#nothing) `[in code](d.md)`\n"
        "```\n[in a block](e.md)\n```\n"
    )
    assert broken_links(page) == [
        "c.md (no such file)",
        "b.md#nothing (no heading with that anchor)",
    ]
