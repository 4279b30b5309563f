"""Per-rank body of the ``":profile"`` name test (module level: spawned processes import it)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from tests.engines._compile_cases import mlp_stages, mse


def built_like_torchtitan(rank: int, world: int, names: list[str], steps: int = 4) -> list[Any]:
    """For each schedule name: the class torch's ``get_schedule_class`` returns once zbpipe
    registered, constructed as torchtitan's ``build_pipeline_schedule`` does (``cls(stages,
    n_microbatches=m, loss_fn=..., scale_grads=False, backward_requires_autograd=True)``), run
    ``steps`` steps on one batch. Returns, per name, the class name, whether the costs were
    measured and the plan re-made, and the largest difference of the last step's gradients from
    an unpipelined reference (the microbatch losses summed: ``scale_grads=False``)."""
    from torch.distributed.pipelining import schedules

    from zbpipe.integrations.names import register, unregister

    m = 4
    register()
    try:
        out = []
        for name in names:
            cls = schedules.get_schedule_class(name)
            mods = mlp_stages(2 * world if cls.layout == "v" else world)
            ref = copy.deepcopy(torch.nn.Sequential(*mods))
            torch.manual_seed(7)
            x, tgt = torch.randn(4 * m, 3, 16), torch.randn(4 * m, 3, 16)
            torch.stack([mse(ref(a), b) for a, b in zip(x.chunk(m), tgt.chunk(m))]).sum().backward()
            n = len(mods)
            mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
            stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
            sched = cls(
                stages,
                n_microbatches=m,
                loss_fn=mse,
                scale_grads=False,
                backward_requires_autograd=True,
            )
            for _ in range(steps):
                for s in mine:
                    mods[s].zero_grad(set_to_none=True)
                sched.step(*((x,) if 0 in mine else ()), target=tgt if n - 1 in mine else None)
            worst = max(
                (p.grad - q.grad).abs().max().item()
                for s in mine
                for p, q in zip(mods[s].parameters(), ref[s].parameters())
            )
            out.append((type(sched).__name__, sched.measured_costs is not None, worst))
        return out
    finally:
        unregister()
