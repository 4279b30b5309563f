"""torch 2.14's whole step() contract on zbpipe's schedules, on whichever torch is installed.

``step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., loss_kwargs=..., return_outputs=False)`` (how
torchtitan 0.3's Trainer calls it) must train exactly like ``step(x, target=y)``: the reference
is the same schedule on the same model and data through the whole-batch form.
"""

import pytest

from tests.schedules import _step_contract_cases as cases
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

SCHEDULES = [
    ("ScheduleZBH1", {}),
    ("ScheduleZBV", {}),
    ("ScheduleZBAuto", {"memory_limit": "1p"}),
]


@pytest.mark.parametrize("world", [2, 4])
def test_microbatch_form_gives_the_whole_batch_gradients(world):
    m = 2 * world
    case_list = [(name, m, opts) for name, opts in SCHEDULES]
    worst = run_ranks(cases.split_equals_whole, world, case_list, timeout=300)
    assert len(worst) == world and all(len(w) == len(case_list) for w in worst)


def test_microbatch_form_returns_merged_outputs():
    assert run_ranks(cases.outputs_are_returned, 2, timeout=120) == [True, True]


def test_continuous_accepts_the_microbatch_form():
    assert run_ranks(cases.continuous_split_equals_whole, 2, timeout=180) == [True, True]
