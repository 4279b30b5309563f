"""Communication points: torchtitan's MoE dispatcher is found and exchanges through zbpipe's
point (same result as its own method, differentiable, given back afterwards); the private torch
names the overlap uses exist."""

from __future__ import annotations

import importlib

import pytest

from tests.schedules import _comm_point_cases as cases
from zbpipe import _compat as C
from zbpipe.testing import run_ranks


def test_torchtitans_dispatcher_is_found_and_exchanges_through_the_point():
    pytest.importorskip("torchtitan")
    ((methods, seen, same, round_trip, grads),) = run_ranks(
        cases.titan_dispatcher_round_trip, 1, timeout=180
    )
    assert methods == ["_dispatch_token_exchange", "_combine_token_exchange"]
    assert seen == ["AllToAllSingle", "AllToAllSingle"]
    assert same and round_trip and grads


@pytest.mark.parametrize("module, name", C.PRIVATE_OVERLAP_NAMES)
def test_private_names_the_overlap_uses_exist(module, name):
    assert hasattr(importlib.import_module(module), name), f"torch renamed {module}.{name}"
