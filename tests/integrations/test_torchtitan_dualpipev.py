"""torchtitan 0.3.0's Qwen3 MoE debug model through zbpipe's ScheduleDualPipeV, end to end on 2
CPU ranks (pipeline parallelism only; per-rank body in _torchtitan_dualpipev_cases.py):
``comm_points="auto"`` finds the experts' token dispatchers, the pairs overlap at their
all-to-alls, and the gradients equal the unpipelined model's."""

from __future__ import annotations

import pytest

from tests.integrations import _torchtitan_dualpipev_cases as cases
from zbpipe.testing import run_ranks


def test_qwen3_moe_debug_model_grads_equal_reference_with_overlapped_pairs():
    pytest.importorskip("torchtitan.models.qwen3")
    results = run_ranks(cases.dualpipev_grads, 2, 4, timeout=900)
    for worst, overlaps, points, pairs, waited in results:
        assert worst < 1e-4
        # one MoE layer per chunk: its dispatch and combine exchanges, two chunks per rank
        assert points == 4 and overlaps and pairs > 0
        assert waited  # the exchanges ran through zbpipe's points
