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
