"""torchtitan 0.3.0's Qwen3 MoE debug model through zbpipe's ScheduleDualPipeV, end to end on 2
CPU ranks (pipeline parallelism only; per-rank body in _torchtitan_dualpipev_cases.py):
``comm_points="auto"`` finds the experts' token dispatchers, the pairs overlap at their
all-to-alls, and the gradients equal the unpipelined model's.

Skipped only where torchtitan is not installed, or is not 0.3 (the 0.2 line has no Qwen3 MoE
debug model): where torchtitan 0.3 is (CI's main suite, recipes/torchtitan/requirements-ci.txt),
a module the ranks need that fails to import fails it, as a broken integration must. Its cost:
torchtitan's import (about 6 s a process); the model's MoE layers are built smaller than the
debug model's (8 experts, not 64: _torchtitan_dualpipev_cases.EXPERTS)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

from tests.integrations import _torchtitan_dualpipev_cases as cases
from zbpipe.testing import run_ranks


def _torchtitan_03() -> None:
    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        pytest.skip("torchtitan is not installed (recipes/torchtitan/requirements-ci.txt)")
    if not found.startswith("0.3."):
        pytest.skip(f"needs torchtitan 0.3's Qwen3 MoE debug model; found torchtitan {found}")
    # (nothing imported here: the ranks import torchtitan's modules, and a rank's ImportError
    # fails the test; importing them here too would add seconds to the suite's parent process)


def test_qwen3_moe_debug_model_grads_equal_reference_with_overlapped_pairs():
    _torchtitan_03()
    results = run_ranks(cases.dualpipev_grads, 2, 4, timeout=900)
    for worst, overlaps, points, pairs, waited in results:
        assert worst < 1e-4
        # one MoE layer per chunk: its dispatch and combine exchanges, two chunks per rank
        assert points == 4 and overlaps and pairs > 0
        assert waited  # the exchanges ran through zbpipe's points
