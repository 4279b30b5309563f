"""Compiled blocks under ``variable_shapes=True``: every step brings new lengths, the gradients
equal eager's, and dynamo compiles a bounded number of graphs, none after the lengths vary once
(docs/use/varlen.md). 2 gloo ranks, ZB-H1, backend aot_eager (inductor's builds are too slow
for CI here)."""

import pytest

from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

#: two steps of 4 microbatches, every length new (none of 1: dynamo specializes sizes 0 and 1)
DRAWS = [[7, 29, 13, 50], [9, 31, 12, 44]]


def test_compiled_blocks_take_every_length_with_a_bounded_number_of_graphs():
    from tests.schedules._varlen_compiled_cases import compiled_steps

    out = run_ranks(compiled_steps, 2, DRAWS, timeout=240)
    for rank, got in enumerate(out):
        assert got["breaks"] == 0, got
        # the documented bound: at most 2 graphs per rank in the first step (a block whose
        # input is a receive buffer compiles for the first length, then once with the length
        # symbolic; stage 0's blocks get a marked input: symbolic from the start), none after
        assert got["graphs"][0] <= 2, (rank, got)
        assert got["graphs"][1] == got["graphs"][0], (rank, got)
