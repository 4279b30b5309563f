"""benchmarks/README.md names every script and every current result; the archive says why each
file in it was replaced, and holds only what a report still quotes.

The README is where a reader starts ("which script answers my question, which file is its
current result"): a script or a result file it does not name is one the reader cannot find.
A file in results/archive/ is kept only because a dated report in docs/ quotes it (a
``<!-- results: archive/NAME.json -->`` marker); one no report quotes should be deleted, not kept.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
ARCHIVE = RESULTS / "archive"
MARKER = re.compile(r"<!--\s*results:(?P<files>[^>]*?)-->")


def _named(readme: Path) -> set[str]:
    return set(re.findall(r"`([\w.-]+\.(?:py|sh|json))`", readme.read_text()))


def test_every_script_is_described():
    scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    missing = scripts - _named(BENCH / "README.md")
    assert not missing, f"benchmarks/README.md does not describe {sorted(missing)}"


def test_every_current_result_is_named():
    current = {p.name for p in RESULTS.glob("*.json")}
    missing = current - _named(BENCH / "README.md")
    assert not missing, f"benchmarks/README.md does not name {sorted(missing)}"


def test_every_archived_result_says_why_and_is_still_quoted():
    archived = {p.name for p in ARCHIVE.glob("*.json")}
    unexplained = archived - _named(ARCHIVE / "README.md")
    assert not unexplained, f"results/archive/README.md does not explain {sorted(unexplained)}"
    docs = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    quoted = {
        name.removeprefix("archive/")
        for page in docs
        for m in MARKER.finditer(page.read_text())
        for name in m.group("files").split()
        if name.startswith("archive/")
    }
    unquoted = archived - quoted
    assert not unquoted, f"no report quotes {sorted(unquoted)}: delete them or quote them"
