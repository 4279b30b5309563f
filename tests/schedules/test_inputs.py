"""dict and TensorDict batches: split along dim 0 into microbatches, passed to stage 0 whole."""

import pytest
import torch
import torch.nn as nn

from zbpipe.schedules.inputs import FirstStageKeywords, check_batch, is_structured_batch
from zbpipe.testing import run_ranks

try:
    import tensordict
except ImportError:  # tensordict is optional: dict batches are still tested
    tensordict = None

KINDS = ["dict"] + (["tensordict"] if tensordict is not None else [])


@pytest.mark.dist
def test_structured_batches_give_reference_grads():
    from tests.schedules._inputs_cases import cases

    todo = [(sched, kind, 4) for sched in ("ScheduleZBH1", "ScheduleZBV") for kind in KINDS]
    worst = run_ranks(cases, 2, todo, timeout=180)
    assert len(worst[0]) == len(todo)


class _Stage:
    """The two attributes FirstStageKeywords reads from a PipelineStage."""

    def __init__(self, module: nn.Module, is_first: bool = True) -> None:
        self.submod, self.is_first = module, is_first


class _TakesBatch(nn.Module):
    def forward(self, batch, scale=1.0):
        return batch["x"] * scale


class _PositionalOnly(nn.Module):
    def forward(self, batch, /):
        return batch["x"]


def test_tensor_inputs_pass_unchanged():
    x = torch.ones(4, 2)
    assert FirstStageKeywords([_Stage(_TakesBatch())]).bind((x,), {}, 2) == ((x,), {})


def test_dict_batch_is_bound_by_parameter_name():
    batch = {"x": torch.ones(4, 2)}
    args, kwargs = FirstStageKeywords([_Stage(_TakesBatch())]).bind((batch, 2.0), {}, 2)
    assert args == () and kwargs == {"batch": batch, "scale": 2.0}


def test_rank_without_stage_0_binds_nothing():
    batch = {"x": torch.ones(4, 2)}
    assert FirstStageKeywords([_Stage(_TakesBatch(), is_first=False)]).bind((batch,), {}, 2) == (
        (batch,),
        {},
    )


def test_positional_only_forward_is_a_clear_error():
    with pytest.raises(ValueError, match="positional-only"):
        FirstStageKeywords([_Stage(_PositionalOnly())]).bind(({"x": torch.ones(4)},), {}, 2)


def test_name_given_twice_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple values"):
        FirstStageKeywords([_Stage(_TakesBatch())]).bind(({"x": torch.ones(4)},), {"batch": 1}, 2)


@pytest.mark.parametrize(
    "batch, fix",
    [
        ({"x": torch.ones(4, 2), "y": torch.ones(3)}, "disagree"),
        ({"x": torch.ones(1, 2)}, "n_microbatches=2"),
        ({"x": torch.ones(4), "t": torch.tensor(0.5)}, "0-dim"),
    ],
)
def test_unsplittable_batches_are_clear_errors(batch, fix):
    with pytest.raises(ValueError, match=fix):
        check_batch(batch, 2)


@pytest.mark.skipif(tensordict is None, reason="tensordict not installed")
def test_torch_splits_a_tensordict_into_tensordicts():
    """What zbpipe relies on: torch's splitter keeps the TensorDict type and fixes batch_size."""
    from tensordict import TensorDict
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    td = TensorDict(
        {"a": torch.arange(6.0), "n": {"b": torch.arange(12.0).view(6, 2)}}, batch_size=[6]
    )
    assert is_structured_batch(td)
    _, chunks = split_args_kwargs_into_chunks((), {"batch": td}, 3)
    assert [type(c["batch"]) for c in chunks] == [TensorDict] * 3
    assert [tuple(c["batch"].batch_size) for c in chunks] == [(2,)] * 3
    torch.testing.assert_close(chunks[1]["batch"]["n", "b"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
