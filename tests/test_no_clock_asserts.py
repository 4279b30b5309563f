"""No test asserts a measured time (docs/design/testing.md): a loaded CI machine stretches any
duration, ratio or order of measured times, and one flaky assertion fails a whole landing.

The scan reads every ``assert`` statement of the suite (``ast``, so comments and docstrings do
not count) and flags one that compares (``<``, ``>``, ``<=``, ``>=``) something named like a
clock reading: ``perf_counter``, ``monotonic``, ``elapsed``, ``duration``, ``latency``,
``waited``, ``seconds``, ``step_time``, ``wall_s``, a ``..._ms`` name. A comparison with zero
(``> 0``: the measurement was recorded) is allowed. It is a net for the usual forms, not a proof:
a review still reads new tests.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CLOCK = re.compile(
    r"perf_counter|monotonic|process_time|thread_time|time\.time\(|elapsed|duration|latency"
    r"|\bwaited\b|seconds|step_time|\bwall_?s\b|\w+_ms\b|\bms\b"
)
ORDER = (ast.Lt, ast.Gt, ast.LtE, ast.GtE)


def _is_zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value in (0, 0.0)


def clock_asserts(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every assert in ``source`` that orders a clock-named value against
    anything but zero."""
    return [
        (node.lineno, ast.unparse(node.test))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assert) and _orders_a_clock(node.test)
    ]


def _orders_a_clock(test: ast.expr) -> bool:
    for cmp in (n for n in ast.walk(test) if isinstance(n, ast.Compare)):
        sides = [cmp.left, *cmp.comparators]
        for op, left, right in zip(cmp.ops, sides, sides[1:]):
            if isinstance(op, ORDER) and not (_is_zero(left) or _is_zero(right)):
                if CLOCK.search(ast.unparse(left) + " " + ast.unparse(right)):
                    return True
    return False


def test_no_test_orders_a_measured_time():
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{line}: assert {text}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, text in clock_asserts(path.read_text())
    ]
    assert not offenders, "assertions over measured times:\n" + "\n".join(offenders)


def test_the_scan_finds_the_forms_it_names_and_allows_a_recorded_measurement():
    a = "assert"  # the samples spell it through a name, so a grep of the suite does not list them
    flagged = f"""
import time
t0 = time.monotonic()
{a} time.monotonic() - t0 < 10
{a} all(f < 0.5 * waited for f in costs)
{a} step_time_ms <= 1.2 * other
{a} halves[0] < latency_ms / 1e3
"""
    allowed = f"""
{a} elapsed > 0
{a} row["step_time_s"] >= 0.0
{a} waited == 2 * latency  # an equality of injected numbers, not an order
{a} makespan <= other_makespan  # simulated, not measured
# {a} elapsed < 10  (a comment)
"""
    assert [line for line, _ in clock_asserts(flagged)] == [4, 5, 6, 7]
    assert clock_asserts(allowed) == []
