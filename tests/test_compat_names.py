"""Every private torch name zbpipe relies on exists, with the parameters zbpipe passes.

``zbpipe._compat.PRIVATE_API`` lists them; a torch upgrade that renames one fails here, naming
it, instead of deep inside a pipeline step. CI runs this file on torch 2.11, 2.13 and 2.14.
"""

import inspect
import pathlib
import re

import pytest
import torch.distributed.pipelining.schedules as torch_schedules

from zbpipe import _compat as C

SRC = pathlib.Path(C.__file__).parent


@pytest.mark.parametrize(
    "owner, name, params",
    C.PRIVATE_API,
    ids=[f"{o.__name__ if o else 'schedules'}.{n}" for o, n, _ in C.PRIVATE_API],
)
def test_private_name_exists_with_the_parameters_zbpipe_passes(owner, name, params):
    obj = getattr(owner if owner is not None else torch_schedules, name, None)
    assert obj is not None, f"torch no longer has {name}: update zbpipe._compat"
    accepted = inspect.signature(obj).parameters
    missing = [p for p in params if p not in accepted]
    assert not missing, f"{name} no longer takes {missing}: update zbpipe._compat"


def test_private_schedule_attributes_are_set_by_torch():
    source = inspect.getsource(torch_schedules)
    for attr in C.PRIVATE_SCHEDULE_ATTRIBUTES:
        assert re.search(rf"self\.{attr}\b\s*[:=]", source), f"torch no longer sets {attr}"


def test_no_private_torch_import_outside_compat():
    """Modules import torch's private names through zbpipe._compat only."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for line in path.read_text().splitlines():
            if re.match(r"\s*from torch[\w.]* import .*\b_[a-zA-Z]", line) or re.search(
                r"torch\.[\w.]*\._[a-z]\w*\.", line
            ):
                offenders.append(f"{path.name}: {line.strip()}")
    assert not offenders, offenders


def test_tensor_hook_attributes_zbpipe_reads_see_the_hooks():
    """The deferred engine reads two private tensor attributes to decide what W may do."""
    import torch

    w = torch.nn.Parameter(torch.randn(2, 2))
    assert not C.has_grad_hooks(w) and not C.has_post_accumulate_grad_hooks(w)
    w.register_hook(lambda g: g)
    w.register_post_accumulate_grad_hook(lambda p: None)
    assert C.has_grad_hooks(w), "torch no longer keeps register_hook hooks in _backward_hooks"
    assert C.has_post_accumulate_grad_hooks(w), "torch renamed _post_accumulate_grad_hooks"


def test_local_hand_off_buffers_are_dropped_and_a_later_none_gradient_reads_as_zero():
    """V placement: zbpipe drops torch's references to local hand-offs (``drop_local_inputs``);
    a None gradient handed over afterwards must still read as a zero output gradient, as torch's
    own ``set_local_bwd_input`` makes it by zeroing the buffer the last hand-off left."""
    import types

    import torch
    from torch.distributed.pipelining.stage import _PipelineStageBase, _RecvInfo

    meta = types.SimpleNamespace(shape=torch.Size([2, 3]), dtype=torch.float32)
    act = _RecvInfo("x", 0, torch.ones(2, 3), meta)
    grad = _RecvInfo("g", 2, torch.ones(2, 3), meta)
    stage = types.SimpleNamespace(
        args_recv_info={0: (act,)},
        grad_recv_info={0: (grad,)},
        device=torch.device("cpu"),
        has_backward=True,
        is_last=False,
    )
    stage.set_local_bwd_input = types.MethodType(_PipelineStageBase.set_local_bwd_input, stage)
    C.drop_local_inputs(stage, 0, fwd=True, bwd=True)
    assert act.buffer is None and grad.buffer is None
    C.set_local_bwd_input(stage, (None,), 0)
    assert torch.equal(grad.buffer, torch.zeros(2, 3))
    handed = torch.full((2, 3), 5.0)
    C.set_local_bwd_input(stage, (handed,), 0)
    assert grad.buffer is handed
