"""The non-finite loss check: device-side flags, resolved when read (zbpipe.schedules.nonfinite).

The CUDA path cannot run here; ``defer=True`` takes the same lazy path on the CPU. That no
host-device synchronisation happens inside ``step()`` on CUDA is shown by benchmarks/gpu.py,
which runs a step under ``torch.cuda.set_sync_debug_mode("error")``.
"""

import logging

import pytest
import torch

from zbpipe.schedules.nonfinite import NonfiniteLosses

LOSSES = [torch.tensor(1.0), torch.tensor(float("nan")), None, torch.tensor(float("inf"))]


def test_cpu_losses_are_resolved_and_reported_during_the_step(caplog):
    check = NonfiniteLosses(rank=1)
    with caplog.at_level(logging.WARNING, logger="zbpipe.schedules.runtime"):
        check.record(LOSSES)
        assert "microbatch(es) [1, 3] on rank 1" in caplog.text
    assert check.resolve() == [1, 3]


def test_deferred_check_logs_nothing_until_read_then_once(caplog):
    check = NonfiniteLosses(rank=0, defer=True)
    with caplog.at_level(logging.WARNING, logger="zbpipe.schedules.runtime"):
        check.record(LOSSES)
        assert caplog.text == ""
        assert check.resolve() == [1, 3]
        assert check.resolve() == [1, 3]  # cached: one warning, one synchronisation
    assert caplog.text.count("non-finite") == 1


def test_each_record_replaces_the_last_steps_answer():
    check = NonfiniteLosses(rank=0, defer=True)
    check.record(LOSSES)
    check.record([torch.tensor(2.0)])
    assert check.resolve() == []
    check.record([])
    assert check.resolve() == []


def _reference(losses):
    """Per loss, in Python: non-finite when any element is NaN/Inf (the documented rule)."""
    return [
        i
        for i, x in enumerate(losses)
        if isinstance(x, torch.Tensor) and not bool(torch.isfinite(x).all())
    ]


@pytest.mark.parametrize(
    "losses",
    [
        # scalars of one dtype: checked stacked
        [torch.tensor(v) for v in (0.5, float("inf"), -2.0, float("-inf"), float("nan"))],
        [torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(float("nan"), dtype=torch.bfloat16)],
        [torch.tensor(3.0, requires_grad=True) * 2, torch.tensor(float("nan"))],
        # any other mix: checked loss by loss
        [torch.tensor(1.0), torch.tensor([1.0, float("nan")]), torch.tensor([2.0, 3.0])],
        [torch.tensor(float("inf"), dtype=torch.float64), torch.tensor(1.0)],
        [torch.tensor(1.0), torch.tensor(float("nan"), dtype=torch.bfloat16), None],
        [torch.tensor(2), torch.tensor(float("inf"))],
    ],
    ids=["scalars", "bf16", "with-graph", "vector", "mixed-dtype", "bf16-and-none", "int"],
)
def test_flags_match_a_per_loss_reference(losses):
    check = NonfiniteLosses(rank=0)
    check.record(losses)
    assert check.resolve() == _reference(losses)


@pytest.mark.dist
def test_dtensor_losses_are_checked_as_their_full_values():
    """A DTensor loss (loss_parallel under tensor parallelism) is checked as the value it
    stands for: the flags are gathered on the mesh, where .tolist() of a DTensor raised."""
    from tests.schedules import _nonfinite_cases as cases
    from zbpipe.testing import run_ranks

    # expected, from the full values: replicated [1, nan]; partial sums [1 + 2, 1 + inf]
    expected = {"replicate": [1], "partial": [1]}
    assert run_ranks(cases.dtensor_losses, 2, timeout=120) == [expected, expected]
