"""tests/integrations/test_torch_parity.py's eval/train cycles, forward-only steps and dw_builder
gradients on 4 ranks (its own file: four processes starting on two cores take most of a minute)."""

import pytest

from tests.integrations import _torch_parity_cases as cases
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.timeout(300)  # about 35 s on an idle 2-core machine, twice that when it is busy
def test_eval_train_cycles_forward_only_and_dw_builder_on_4_ranks():
    per_rank = run_ranks(cases.parity_cases, 4, cases.every_class(m=4), timeout=300)
    assert all(r for results in per_rank for r in results), per_rank
