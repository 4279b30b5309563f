"""Compiled Linears keep their split when the trainer swaps the parameters after building the
schedule, as torchtitan does (``to_empty`` on a module FSDP2 wraps swaps every parameter, and
torch refuses to swap a tensor something holds a weak reference to)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from tests.engines._compile_cases import _count_w_gemms, compile_blocks, mse, stages_and_reference
from zbpipe import ScheduleZBV
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist


def swapped_after_construction(rank: int, world: int, m: int = 4) -> dict[str, object]:
    """One rank holding both V stages of compiled blocks; every parameter swapped
    (``torch.utils.swap_tensors``, through ``Module._apply``) between construction and step."""
    mods, x, tgt, ref = stages_and_reference(2, m)
    stages = [
        PipelineStage(compile_blocks(mods[s], "in-place", "aot_eager"), s, 2, torch.device("cpu"))
        for s in (0, 1)
    ]
    # the equal-bytes plan, kept: the test counts the W GEMMs its shape defers
    sched = ScheduleZBV(stages, m, loss_fn=mse, measure_memory=False)
    gemms = _count_w_gemms(sched)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        for mod in mods:
            mod._apply(lambda t: t.clone())  # what to_empty/to do under FSDP2: a swap per tensor
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    sched.step(x, target=tgt)
    for mod, want in zip(mods, ref):
        for (name, p), (_, q) in zip(mod.named_parameters(), want.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    return {"w_gemms": gemms}


def test_compiled_linears_defer_w_after_the_parameters_were_swapped():
    (result,) = run_ranks(swapped_after_construction, 1, timeout=180)
    # 2 stages x 2 blocks x 2 Linears: every W that is not a fused BW runs 4 GEMMs, none ran in B
    assert result["w_gemms"] and max(result["w_gemms"]) == 4, result
