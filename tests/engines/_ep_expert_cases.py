"""Per-rank body of the DTensor expert test (module level: ranks import it).

Two ranks, one mesh: torchtitan 0.3's ``GroupedExperts`` with its three weights sharded over
the experts (``Shard(0)``: each rank holds 2 of the 4 experts, as expert parallelism places
them), its forward calling ``to_local()`` on each, as torchtitan's does under EP. Each rank runs
its own rows (the tokens routed to its experts) through a patched twin under a deferred engine
and through the unpatched module with ``loss.backward()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.engines import _moe_cases as cases

#: tokens per local expert, per rank and microbatch (an expert without a token in each)
LOCAL_COUNTS = {0: ([3, 0], [0, 6], [4, 2]), 1: ([0, 5], [2, 0], [1, 1])}


def _sharded_experts(mesh: Any) -> nn.Module:
    from torch.distributed.tensor import Shard, distribute_tensor

    m = cases.grouped_experts()
    for name, p in list(m.named_parameters()):
        setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    return m


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of a DTensor gradient's shard (``to_local()`` aliases it: W adds in place)."""
    return None if t is None else t.to_local().clone()  # type: ignore[attr-defined]


def _changed(now: torch.Tensor | None, was: torch.Tensor | None) -> bool:
    if now is None or was is None:
        return now is not was
    return not torch.equal(now, was)


def run(rank: int, world: int, compiled: bool) -> dict[str, Any]:
    """For each microbatch: whether the outputs and input gradients equal the fused ones, the
    names of the weights whose ``.grad`` B changed, whether each ``.grad`` equals the fused one
    after W (local shards and placements); and the census's kind for each weight."""
    from torch.distributed.device_mesh import init_device_mesh

    from zbpipe.engines.weight_share import _expert_classes

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    fused, split = cases.twins(_sharded_experts(mesh))
    if compiled:
        fused.compile(fullgraph=True, backend="aot_eager")
        split.compile(fullgraph=True, backend="aot_eager")
    engine = cases.engine_on(split)
    out: dict[str, Any] = {"steps": []}
    for mb, counts in enumerate(LOCAL_COUNTS[rank]):
        args = cases.routed_rows(counts, 10 * rank + mb)
        gx_ref, out_ref = cases.fused_step(fused, *args)
        before = {n: _local(p.grad) for n, p in split.named_parameters()}
        gx, o = cases.split_step(engine, split, (0, mb), *args)
        in_b = [n for n, p in split.named_parameters() if _changed(_local(p.grad), before[n])]
        engine.backward_weight((0, mb))
        equal = {
            n: q.grad is not None
            and q.grad.placements == p.grad.placements  # type: ignore[attr-defined]
            and torch.equal(_local(q.grad), _local(p.grad))  # type: ignore[arg-type]
            for (n, p), q in zip(fused.named_parameters(), split.parameters(), strict=True)
        }
        same = torch.equal(o, out_ref) and torch.equal(gx, gx_ref)
        out["steps"].append({"same": same, "in_b": in_b, "equal": equal})
    kinds, _, _ = _expert_classes(split)
    out["census"] = {n: kinds[id(p)][0] for n, p in split.named_parameters()}
    return out


def compiled_census(rank: int, world: int) -> dict[str, str]:
    """The census's kind for each weight of a compiled (never run: ``compile()`` is lazy)
    sharded ``GroupedExperts``."""
    from torch.distributed.device_mesh import init_device_mesh

    from zbpipe.engines.weight_share import _expert_classes

    m = _sharded_experts(init_device_mesh("cpu", (world,)))
    m.compile(fullgraph=True, backend="aot_eager")
    kinds, _, _ = _expert_classes(m)
    return {n: kinds[id(p)][0] for n, p in m.named_parameters()}


def both(rank: int, world: int) -> dict[str, Any]:
    """The eager run; the census of the compiled module (running it compiled costs two
    compiles per rank; ``python tests/engines/_ep_expert_cases.py`` runs it: its weight
    gradients come in B, equal to the fused ones)."""
    return {"eager": run(rank, world, False), "census": compiled_census(rank, world)}


if __name__ == "__main__":  # the compiled run, by hand
    from zbpipe.testing import run_ranks

    for got in run_ranks(run, 2, True, timeout=300):
        print([(s["same"], s["in_b"], all(s["equal"].values())) for s in got["steps"]])
