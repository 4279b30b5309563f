"""Every measured number in README.md, docs/ and benchmarks/ (*.md) appears in a stored result.

What counts as a number (the rule, so it stays simple to follow):
  * a decimal with a fractional part, with or without a unit: ``0.934``, ``1193.7``, ``20.7%``,
    ``1.07x``; and an integer directly followed by ``%`` or ``x``: ``4%``, ``27x``.
  * not counted: plain integers (counts, sizes, p, m, years, section numbers: write measured
    values with their decimals), anything in code (fenced blocks and inline backticks: commands,
    API defaults), link targets, versions (``2.13.0``, ``0.3.x``, ``torch 2.13``), and inputs
    written ``name=value`` (``b=1.2``, ``comm=0.05``: a cost model's inputs, not its outputs).

Where a number may come from: the result files named by the nearest marker above it,
``<!-- results: split_backward.json real_run_m4.json -->`` (an HTML comment, invisible on GitHub;
names are relative to benchmarks/results/). A number with no marker above it fails. Naming the
files keeps the match honest: against every stored value a two-digit ratio would nearly always
find some coincidence. A doc number matches a stored value when it equals it rounded to the
doc's decimals, read as is, as a percentage (x 100), as
milliseconds from seconds (x 1000) or as MiB from bytes (/ 2**20). A stored list also offers its
min, median and max, so a doc may quote the median and spread of raw repetitions.

To make a new number pass: have its script in benchmarks/ write it with
``benchmarks/results_io.write_result(name, data)`` (adds machine, torch version, date, command),
commit the JSON with the doc, and put a ``<!-- results: name.json -->`` marker above the text.
A number that is not a measurement (a worked example, a formula's
value, a paper's figure) goes in ``NOT_MEASURED`` below with the reason.

A file listed in ``BEING_REMEASURED`` (its timings await a re-run on a quiet machine) is checked
the same way, but its unsourced numbers are reported as a warning, not a failure.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import statistics
import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# the user-facing pages, and benchmarks/README.md (and the archive's), which quote headline numbers
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "benchmarks").rglob("*.md")),
]

# file (relative to the repository root) -> {number as written: why it is not a measurement}.
# Keep it small: each entry is a claim no script checks.
NOT_MEASURED: dict[str, dict[str, str]] = {
    "docs/use/continuous.md": {
        "1.5": "one of the warm-up factors d the planner tries, an input",
    },
    "docs/results/memory.md": {
        "1.05x": "issue 19's target for the peaks (at most 1.05x torch 1F1B's), not a result",
    },
    "docs/results/compile.md": {
        "9.8": "torchtitan #773's Interleaved1F1B over InterleavedZeroBubble tokens/s, 128 / 13",
        "0.90": "torchtitan #773's later comment: Interleaved1F1B over ZB tokens/s, 304 / 339",
    },
    "docs/results/moe.md": {
        "1.345x": "issue 39's measurement of ZBH1 on these blocks before the change (not stored)",
        "1.192x": "issue 39's measurement of ZBV on these blocks before the change (not stored)",
    },
    "docs/reference/api.md": {
        "1.0": "an API default, max_seconds=1.0",
    },
    "docs/reference/zbv-tables.md": {
        # The paper's targets p/(2m) and 2p/(3m) evaluated at m = 2p, 3p, 4p: formula values.
        "0.25": "p/(2m) at m = 2p, the paper's V-Half target (a formula's value)",
        "0.167": "p/(2m) at m = 3p and 2p/(3m) at m = 4p, the paper's targets (a formula's value)",
        "0.125": "p/(2m) at m = 4p, the paper's V-Half target (a formula's value)",
        "0.333": "2p/(3m) at m = 2p, the paper's V-Min target (a formula's value)",
        "0.222": "2p/(3m) at m = 3p, the paper's V-Min target (a formula's value)",
    },
}

# Files whose timing numbers are being re-measured (on a quiet machine; a shared 2-core box's
# timings say little). They are checked like every doc, but what lacks a source is reported as a
# warning instead of failing the test, so the rest of the docs stay guarded meanwhile. Empty this
# set as each file is done (the test notes, by a warning, a listed file whose numbers all have a
# source), then the guard covers every doc again.
BEING_REMEASURED: set[str] = set()

FENCED = re.compile(r"^\s*```.*?^\s*```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
MARKER = re.compile(r"<!--\s*results:(?P<files>[^>]*?)-->")
HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
NUMBER = re.compile(
    r"(?<![\w.=])"  # not inside a word, a dotted version or a name=value input
    r"(?P<num>\d*\.\d+(?P<unit>%|x\b)?|\d+(?P<iunit>%|x\b))"
    r"(?![\w]|\.\d|\.x)"  # not the head of a version (2.13.0, 0.3.x)
)
VERSION_BEFORE = re.compile(
    r"(torch|torchtitan|python|numpy|version|v)\s*[<>=]*\s*$", re.IGNORECASE
)


def _blank(m: re.Match) -> str:
    """The matched text replaced by its newlines, so line numbers stay right."""
    return "\n" * m.group().count("\n")


def doc_numbers(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, number as written, result files named above it) for every number ``path`` quotes."""
    text = path.read_text()
    text = FENCED.sub(_blank, text)
    sources: dict[int, tuple[str, ...]] = {}  # line -> files named by a marker on it
    for m in MARKER.finditer(text):
        sources[text.count("\n", 0, m.start()) + 1] = tuple(m.group("files").split())
    text = HTML_COMMENT.sub(_blank, text)
    text = INLINE_CODE.sub("", text)
    text = LINK_TARGET.sub("]", text)
    found = []
    current: tuple[str, ...] = ()
    for i, line in enumerate(text.splitlines(), 1):
        current = sources.get(i, current)
        for m in NUMBER.finditer(line):
            if VERSION_BEFORE.search(line[: m.start()]):
                continue
            found.append((i, m.group("num"), current))
    return found


def _numbers_in(obj) -> list[float]:
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in _numbers_in(v)]
    if isinstance(obj, list):
        out = [x for v in obj for x in _numbers_in(v)]
        flat = [float(v) for v in obj if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(flat) > 1:  # raw repetitions: a doc may quote their median and spread
            out += [min(flat), statistics.median(flat), max(flat)]
        return out
    return []


@functools.cache
def stored_values(name: str) -> tuple[float, ...]:
    """Every number in one result file, sorted (parsed once: the docs quote each file often)."""
    values = _numbers_in(json.loads((RESULTS / name).read_text()))
    return tuple(sorted(v for v in values if v == v))  # NaN matches nothing and breaks sorting


def has_source(written: str, ordered: Sequence[float]) -> bool:
    """Whether some ``v`` in ``ordered`` (ascending) has ``abs(v * k - target) <= half`` for a
    scale ``k``.

    The same test on every value would be millions of comparisons over the stored results; on
    sorted values only those near ``target / k`` can pass, so the exact test runs on a window
    found by bisection (widened by a relative 1e-9 against the division's rounding).
    """
    digits = written.rstrip("%x")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    target = float(digits)
    half = 0.5 * 10**-decimals + 1e-9
    scales = (1.0, 100.0, 1000.0, 1.0 / 2**20)  # as is, percent, s -> ms, bytes -> MiB
    for k in scales:
        lo, hi = (target - half) / k, (target + half) / k
        slack = 1e-9 * max(abs(lo), abs(hi), 1.0)
        window = ordered[
            bisect.bisect_left(ordered, lo - slack) : bisect.bisect_right(ordered, hi + slack)
        ]
        if any(abs(v * k - target) <= half for v in window):
            return True
    return False


def unsourced_numbers(path: Path) -> list[str]:
    """Every number ``path`` quotes that no stored result (named by a marker above it) holds."""
    rel = path.relative_to(ROOT).as_posix()
    allowed = NOT_MEASURED.get(rel, {})
    missing = []
    for line, written, names in doc_numbers(path):
        if written in allowed:
            continue
        if not names:
            missing.append(f"{rel}:{line}: {written} (no <!-- results: ... --> marker above it)")
            continue
        absent = [n for n in names if not (RESULTS / n).is_file()]
        if absent:
            missing.append(f"{rel}:{line}: {written} (marker names missing files {absent})")
        elif not any(has_source(written, stored_values(n)) for n in names):
            missing.append(f"{rel}:{line}: {written} (not in {', '.join(names)})")
    return missing


def test_every_number_in_the_docs_has_a_stored_source():
    missing, remeasured, sourced_now = [], [], []
    for path in DOCS:
        rel = path.relative_to(ROOT).as_posix()
        unsourced = unsourced_numbers(path)
        if rel not in BEING_REMEASURED:
            missing += unsourced
        elif unsourced:
            remeasured += unsourced
        else:
            sourced_now.append(rel)
    if remeasured:
        warnings.warn(
            f"{len(remeasured)} number(s) in files BEING_REMEASURED have no stored source yet "
            "(reported, not failed):\n  " + "\n  ".join(remeasured),
            stacklevel=1,
        )
    if sourced_now:  # a note, not a failure: the file may still be mid-rewrite
        warnings.warn(
            f"every number in {sourced_now} has a stored source: they can leave BEING_REMEASURED",
            stacklevel=1,
        )
    assert not missing, (
        f"{len(missing)} number(s) in the docs have no stored source in benchmarks/results/ "
        "(write them from a script with benchmarks/results_io.write_result, name the file in a "
        "marker above the text, reword the claim, or add a reasoned entry to NOT_MEASURED in "
        "tests/test_docs_numbers.py):\n  " + "\n  ".join(missing)
    )


def test_files_being_remeasured_are_docs():
    docs = {path.relative_to(ROOT).as_posix() for path in DOCS}
    assert BEING_REMEASURED <= docs, f"not docs: {sorted(BEING_REMEASURED - docs)}"


@pytest.mark.parametrize(
    "path", sorted(RESULTS.rglob("*.json")), ids=lambda p: p.relative_to(RESULTS).as_posix()
)
def test_every_result_says_where_and_when_it_was_measured(path):
    meta = json.loads(path.read_text()).get("meta", {})
    missing = [k for k in ("machine", "torch", "date") if not meta.get(k)]
    assert not missing, f"{path.name}: meta lacks {missing} (write it with results_io.write_result)"


def test_the_rule_counts_measurements_and_skips_inputs_versions_and_code(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text(
        "ZBV at 0.867 (min 0.820), bubble 20.7%, 10-27x, within 4%.\n"
        "Costs f=1, b=1.2, comm=0.05; torch 2.13, torchtitan 0.3.x, 2.13.0; 4 ranks, hidden 512.\n"
        "`Costs(f=1.5)` and\n```\nzbpipe compare --costs 9.75\n```\n[link](v1.25.md)\n"
        "<!-- results: a.json b.json -->\nthen 1.5\n"
    )
    found = doc_numbers(doc)
    assert [n for _, n, _ in found] == ["0.867", "0.820", "20.7%", "27x", "4%", "1.5"]
    assert found[0][2] == () and found[-1][2] == ("a.json", "b.json")
    assert has_source("20.7%", [0.2068]) and has_source("1193.7", [1193.7 * 2**20])
    assert not has_source("0.91", [0.934])
