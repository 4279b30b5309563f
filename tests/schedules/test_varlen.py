"""Microbatches of different sequence lengths (zbpipe.schedules.varlen): each step's shapes go
down the pipeline before its first send, every receive buffer is sized per microbatch, and the
gradients equal the unpipelined model's on the same tokens.

Lengths are drawn by hypothesis (no process group in the draw), then every draw runs as one
step inside ONE launch of 2 gloo ranks per call: launching is the slow part.
"""

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

M = 4
ISSUE_LENGTHS = [7, 29, 13, 50]  # the repro of issue 44


def _draws(n: int) -> list[list[int]]:
    """The issue's lengths, then ``n`` hypothesis draws of M lengths each (derandomized: the
    same draws on every run, shrinking nothing)."""
    found: list[list[int]] = []

    @settings(
        max_examples=n, derandomize=True, database=None, phases=[Phase.generate], deadline=None
    )
    @given(st.lists(st.integers(1, 48), min_size=M, max_size=M))
    def collect(lengths: list[int]) -> None:
        found.append(lengths)

    collect()
    return [ISSUE_LENGTHS, *found[:n]]


def test_varlen_gradients_equal_the_unpipelined_model():
    """ZB-H1, ZB-1p and ZB-V (each under both engines) and V-Half: every draw's gradients equal
    the whole model's, under the token-count loss contract (even steps) and the default mean of
    per-microbatch means (odd steps)."""
    from tests.schedules._varlen_cases import grads_cases

    todo = [
        ("ScheduleZBH1", "deferred"),
        ("ScheduleZBH1", "graph"),
        ("ScheduleZB1P", "auto"),
        ("ScheduleZB1P", "graph"),
        ("ScheduleZBV", "deferred"),
        ("ScheduleZBV", "graph"),
        ("ScheduleZBVHalf", "auto"),
    ]
    draws = _draws(2)
    worst = run_ranks(grads_cases, 2, todo, draws, timeout=240)
    assert all(len(w) == len(todo) for w in worst)


def test_output_shape_that_depends_on_values_raises_on_every_rank():
    """A stage that truncates its output by a value it reads: a ValueError on both ranks before
    any microbatch is sent (the run returning at all shows no rank hung)."""
    from tests.schedules._varlen_cases import data_dependent_case

    errors = run_ranks(data_dependent_case, 2, "ScheduleZBH1", timeout=120)
    assert "depends on the values of its input" in errors[0]
    assert "stage 0 (on another rank)" in errors[1]
