"""The compiled Linears' op survives a second import of its module (a reload, or the torchtitan
tests forgetting every zbpipe module between runs): registered once per process, it reaches
the module imported last."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import gc, sys, torch
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
    print("ok")
    """
)


def test_the_op_survives_a_second_import_and_calls_the_newest_module():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
