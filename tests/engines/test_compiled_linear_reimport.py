"""The compiled Linears' op survives a second import of its module (a reload, or the torchtitan
tests forgetting every zbpipe module between runs): registered once per process, it reaches
the module imported last.

It runs in a rank of zbpipe.testing.launch: a process of its own (this one's zbpipe modules stay
as they are), forked from a server that has imported torch already (a fresh interpreter would
spend seconds importing it).
"""

from __future__ import annotations

import gc
import sys

import torch

from zbpipe.testing import run_ranks


def _import_twice(rank: int, world: int) -> str:
    import zbpipe.engines.compiled_linear as first

    for name in [n for n in sys.modules if n.split(".")[0] == "zbpipe"]:
        del sys.modules[name]
    import zbpipe.engines.compiled_linear as second  # would register the op a second time

    assert second is not first
    del first
    gc.collect()  # the first module's Library, if anything let it go, would take the op along
    x, g, w = torch.randn(4, 3), torch.randn(4, 5), torch.randn(5, 3)
    torch.testing.assert_close(torch.ops.zbpipe.linear_weight_grad(x, g, w), g.t() @ x)
    second.linear_weight_grad = lambda *args: torch.full((5, 3), 7.0)  # what the kernel reaches
    assert torch.equal(torch.ops.zbpipe.linear_weight_grad(x, g, w), torch.full((5, 3), 7.0))
    return "ok"


def test_the_op_survives_a_second_import_and_calls_the_newest_module():
    assert run_ranks(_import_twice, 1, timeout=120) == ["ok"]
