"""A packed batch split by document (zbpipe.schedules.packed.split_packed) through
``variable_shapes=True``: gradients equal the unpipelined model's on the same packed row, with
the row's own document mask and the loss divided by the row's token count. One launch of 2 gloo
ranks runs every case."""

import pytest

from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

#: two packed rows of 7 documents each (lengths in 1..20), 4 microbatches of whole documents
BATCHES = [[5, 17, 2, 9, 13, 1, 8], [20, 3, 3, 11, 6, 14, 2]]


def test_packed_batch_split_by_document_gives_the_unpipelined_gradients():
    """ZB-H1 (deferred engine, data order) and ZB-V (graph engine, cost-ordered by the split's
    costs): every stage builds its attention mask from its microbatch's document ids."""
    from tests.schedules._packed_cases import packed_steps

    todo = [("ScheduleZBH1", "deferred", False), ("ScheduleZBV", "graph", True)]
    worst = run_ranks(packed_steps, 2, todo, BATCHES, 4, timeout=180)
    assert len(worst) == 2
