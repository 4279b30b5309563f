"""What differs between the supported torches (2.11 to 2.15) works on the running one.

CI runs this file on torch 2.11.0, 2.13.0 and 2.14.1 (.ci/run). torch 2.11 lacks loss_kwargs and
initialises stages by sending to every neighbour, its own rank included (zbpipe._compat).
"""

import pytest

from tests import _compat_cases as cases
from zbpipe import _compat as C
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("schedule", ["ScheduleZBV", "ScheduleZBH1"])
def test_one_rank_pipeline_with_loss_kwargs_matches_reference(schedule):
    # ZBV on one rank: two local neighbour stages, the case torch 2.11's own init cannot run.
    (worst,) = run_ranks(cases.one_rank_pipeline_grads, 1, schedule, 4, 2.0, timeout=120)
    assert worst < 1e-5


def test_shims_are_installed_only_where_torch_lacks_the_feature():
    torch_runtime = C._TorchPipelineScheduleRuntime
    shimmed = C._PipelineScheduleRuntime is not torch_runtime
    assert shimmed == (not C.TORCH_HAS_LOSS_KWARGS or C.TORCH_SENDS_TO_LOCAL_NEIGHBOURS)
    assert issubclass(C._PipelineScheduleRuntime, torch_runtime)
