"""Import paths the docs gave before the plan families got folders still import the moved module."""

from __future__ import annotations

import importlib

import pytest

import zbpipe.planning as planning

NEW_HOME = {
    "improve": "zbpipe.planning.search.improve",
    "milp": "zbpipe.planning.search.milp",
    "continuous_plan": "zbpipe.planning.continuous.periods",
    "continuous_stream": "zbpipe.planning.continuous.stale_orders",
    "continuous_tradeoff": "zbpipe.planning.continuous.tradeoff",
}


@pytest.mark.parametrize("old", sorted(NEW_HOME))
def test_an_old_path_is_the_moved_module(old: str):
    assert set(planning.MOVED_MODULES) == set(NEW_HOME)
    moved = importlib.import_module(f"zbpipe.planning.{old}")
    assert moved is importlib.import_module(NEW_HOME[old])


def test_documented_from_imports_work():
    from zbpipe.planning.continuous_plan import plan_continuous
    from zbpipe.planning.improve import improve
    from zbpipe.planning.milp import refine

    from zbpipe.planning.search.improve import improve as improve_new

    assert improve is improve_new
    assert callable(refine) and callable(plan_continuous)
