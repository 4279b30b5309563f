"""Expert-parallel expert weights (DTensors sharded over the experts) under the deferred engine.

torchtitan's ``GroupedExperts`` calls ``to_local()`` on each DTensor weight before its grouped
GEMMs; a ``TorchFunctionMode`` does not see that Python method, only the alias it makes
(:mod:`zbpipe.engines.expert_matmuls` follows it). Eager, B must leave each expert weight's
``.grad`` alone and W must set it to the fused backward's, bit for bit, placements included
(the reference: the unpatched twin through ``loss.backward()`` on the same rank). Compiled,
dynamo hides the alias from the mode: the gradients come in B (autograd's), and the weight
census (``split="auto"``'s) must count them in B, as it counts the eager ones in W. (The compiled
run costs two compiles per rank: ``python -m tests.engines._ep_expert_cases`` runs it by hand.)
"""

from __future__ import annotations

import pytest

from tests.engines import _ep_expert_cases as cases
from zbpipe.testing import run_ranks

pytest.importorskip("torchtitan.models.common.moe")

WEIGHTS = {"w1_EFD", "w2_EDF", "w3_EFD"}


def test_dtensor_expert_weights_wait_for_w_eager_and_the_census_says_where_they_go():
    for rank, got in enumerate(run_ranks(cases.both, 2, timeout=240)):
        for mb, step in enumerate(got["eager"]["steps"]):
            assert step["same"], (rank, mb)
            assert step["in_b"] == [], (rank, mb)  # B left every expert weight alone
            assert all(step["equal"].values()) and set(step["equal"]) == WEIGHTS, (rank, mb)
        assert got["eager"]["census"] == dict.fromkeys(WEIGHTS, "experts"), rank
        # compiled, they are computed in B (autograd's own backward): the census says so
        assert got["census"] == dict.fromkeys(WEIGHTS, "compiled EP experts"), rank
