"""What torch's own schedule tests expect, on zbpipe's classes (issue 21).

* eval() between training steps, for at least three cycles, on every class at 2 and 4 ranks:
  each eval returns the unpipelined model's outputs and losses and leaves gradients alone, each
  training step gives its gradients; ``step(x, target=y)`` is called on every rank, the torch way.
* a schedule without loss_fn steps forward-only again and again;
* stages built with torch's ``dw_builder`` get their weight gradients under every class;
* ScheduleContinuous trains dw_builder stages (sync mode) and refuses eval() (it would train);
* a stage output that requires grad but receives no gradient is an error, not a silent None.

Real processes, gloo, one thread each; the cases of one world size share one process group.
"""

import pytest

from tests.integrations import _torch_parity_cases as cases
from zbpipe.testing import RankFailure, run_ranks

pytestmark = pytest.mark.dist


def test_eval_train_cycles_and_dw_builder_on_2_ranks():
    case_list = [
        *cases.every_class(m=4),
        ("dw_builder_grads", "ScheduleZBH1", 4, {"split": "graph"}),
        ("dw_builder_grads", "ScheduleZBV", 3, {"memory": "min"}),
        ("continuous_dw_builder", 4),
        ("continuous_eval_refused",),
    ]
    per_rank = run_ranks(cases.parity_cases, 2, case_list, timeout=240)
    for results in per_rank:
        assert all(r for r in results[:-1]), results  # every case compared something
        assert "only trains" in results[-1]


def test_an_output_without_its_gradient_is_an_error_not_a_silent_none():
    # ZBAuto's plan runs stage 0's first backward as a split B: zbpipe's engine, where a missing
    # gradient used to be skipped. The peer then fails on the closed connection.
    with pytest.raises(RankFailure) as info:
        run_ranks(cases.output_gradient_missing, 2, "ScheduleZBAuto", 4, timeout=90, pg_timeout=60)
    text = str(info.value)
    assert "stage 0 microbatch 0: output 0 requires grad but no gradient was received" in text
    assert "output_args" in text
