"""Per-rank bodies of tests/continuous/test_optim.py (module level so spawned processes can import
them)."""

from __future__ import annotations

import torch
import torch.nn as nn

from zbpipe.continuous.optim import PostValidatedStep


def build_model(seed: int = 0) -> nn.Sequential:
    """The whole unpipelined model; stage 0 = first Linear, stage 1 = second Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


STAGE_LAYERS = {0: 0, 1: 2}


def step_grads(model: nn.Sequential, step: int, scale: float) -> list[torch.Tensor]:
    """Deterministic gradients of step ``step`` for every parameter of ``model`` (in order).

    The gradients of stage 1 are small and stage 0's large, so stage 1's own norm (its
    optimistic guess on the chain's first rank) stays under max_norm while the global one does not.
    """
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for i, p in enumerate(model.parameters()):
        g = torch.randn(p.shape, generator=gen)
        out.append(g * (scale if i < 2 else 0.05))
    return out


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def run_steps(rank: int, world: int, opt_name: str, max_norm, scales, inject_inf=None):
    """Hold this rank's stage, run one post-validated step per entry of ``scales``.

    ``inject_inf = (step, rank)`` puts an inf in that rank's first gradient at that step.
    Returns per step: (report fields, params after, optimizer state tensors after), as numpy.
    """
    model = build_model()
    stage = model[STAGE_LAYERS[rank]]
    n_before = sum(1 for layer in range(STAGE_LAYERS[rank]) for _ in model[layer].parameters())
    opt = make_optimizer(opt_name, stage.parameters())
    pvs = PostValidatedStep(opt, max_norm=max_norm)
    out = []
    for step, scale in enumerate(scales):
        grads = step_grads(model, step, scale)
        for i, p in enumerate(stage.parameters()):
            p.grad = grads[n_before + i].clone()
        if inject_inf == (step, rank):
            p0 = next(stage.parameters())
            p0.grad[0, 0] = float("inf")
        pvs.step()
        report = pvs.validate()
        state = {
            k: [_np(v) for v in st.values() if torch.is_tensor(v)]
            for k, st in enumerate(opt.state_dict()["state"].values())
        }
        out.append(
            (
                (report.status, report.global_norm, report.clip_coef, report.optimistic_coef),
                [_np(p) for p in stage.parameters()],
                state,
            )
        )
    return out


def _np(t: torch.Tensor):
    """A copy that pickles by value (tensors would travel as shared memory the rank then frees)."""
    return t.detach().numpy().copy()


def run_cases(rank: int, world: int, cases):
    """Several cases in one process group (spawning is the slow part)."""
    return [run_steps(rank, world, *case) for case in cases]
