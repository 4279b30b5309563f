"""``scale_grads``: every parameter divided by n_microbatches once, after its last contribution.

A parameter shared by two stages of one rank gets the gradient of the unpipelined model.

The V schedules put the first and the last stage on rank 0, where a language model's tied
embedding and output head meet. torch's schedules divide each stage's gradients by
n_microbatches at that stage's REDUCE_GRAD action, so such a parameter was divided twice, the
first time before the other stage had added its part; zbpipe divides once, at the end of the step.

Two gloo ranks, V placement (rank 0: stages 0 and 3), the last stage's Linear holding the same
``nn.Parameter`` as the first stage's (a tied weight), m = 4. Reference: the same modules run as
one model in a plain loop, ``loss / m`` backward per microbatch (``scale_grads=True``) or
``loss`` (``scale_grads=False``).

A forward-only step (``eval()``) leaves the gradients a training step left (torch's REDUCE_GRAD
divides them even then), on a V schedule too, whose two adjacent stages on one rank hand their
fused backward over locally.
"""

import copy

import pytest
import torch
from torch import nn

from tests.schedules._losses import mse
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

M = 4
CASES = [  # (schedule, options, scale_grads)
    ("ZBV", {}, True),
    ("ZBV", {"split": "graph"}, True),
    ("ZBV", {"memory": "half"}, True),
    ("ZBV", {}, False),
]


def _stages() -> list[nn.Module]:
    """Four chunks of a small MLP; chunk 3's last Linear shares chunk 0's first weight."""
    torch.manual_seed(0)
    chunks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(4)]
    chunks[3][2].weight = chunks[0][0].weight
    return chunks


def _reference(chunks: list[nn.Module], x, y, scale: bool) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(nn.Sequential(*chunks))  # deepcopy keeps the tie
    for xs, ys in zip(x.chunk(M), y.chunk(M), strict=True):
        loss = mse(model(xs), ys)
        (loss / M if scale else loss).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _rank(rank: int, world: int) -> list[tuple[str, float]]:
    from torch.distributed.pipelining import PipelineStage

    import zbpipe
    from zbpipe.planning import v_placement

    torch.set_num_threads(1)
    torch.manual_seed(1)  # the same batch on every rank (each rank computes the reference)
    x, y = torch.randn(M * 2, 8), torch.randn(M * 2, 8)
    errors = []
    for name, options, scale in CASES:
        chunks = _stages()
        ref = _reference(chunks, x, y, scale)
        mine = sorted(s for s, r in v_placement(world).items() if r == rank)
        stages = [PipelineStage(chunks[s], s, 4, torch.device("cpu")) for s in mine]
        sched = getattr(zbpipe, f"Schedule{name}")(
            stages, M, loss_fn=mse, scale_grads=scale, **options
        )
        sched.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
        whole = nn.Sequential(*chunks)  # names as in the reference; other ranks' grads are None
        for n, p in whole.named_parameters():
            if p.grad is not None:
                err = (p.grad - ref[n]).abs().max().item() / ref[n].abs().max().item()
                errors.append((f"{name} {options} scale_grads={scale} {n}", err))
    return errors


def test_a_weight_tied_across_a_ranks_stages_gets_the_reference_gradient():
    results = run_ranks(_rank, 2, timeout=180)
    checked = [n for errs in results for n, _ in errs]
    assert any(n.endswith(" 0.0.weight") for n in checked), "the tied weight was not checked"
    bad = [(n, e) for errs in results for n, e in errs if not e <= 1e-5]  # NaN fails too
    assert not bad, f"gradients differ from the unpipelined model: {bad}"


def _eval_one_rank(rank: int, world: int) -> list[str]:
    from torch.distributed.pipelining import PipelineStage

    import zbpipe

    torch.set_num_threads(1)
    torch.manual_seed(1)
    x, y = torch.randn(M * 2, 8), torch.randn(M * 2, 8)
    problems = []
    for name, n_stages in (("ZBH1", 1), ("ZBV", 2)):
        chunks = _stages()[:n_stages]
        model = nn.Sequential(*chunks)
        for p in model.parameters():
            p.grad = torch.ones_like(p)  # left by an earlier training step
        stages = [PipelineStage(c, s, n_stages, torch.device("cpu")) for s, c in enumerate(chunks)]
        sched = getattr(zbpipe, f"Schedule{name}")(stages, M, loss_fn=mse)
        losses: list = []
        with torch.no_grad():
            sched.eval(x, target=y, losses=losses)
            ref = [mse(model(xs), ys) for xs, ys in zip(x.chunk(M), y.chunk(M), strict=True)]
        if not all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters()):
            problems.append(f"{name}: eval() changed the gradients")
        if not torch.allclose(torch.stack(losses), torch.stack(ref)):
            problems.append(f"{name}: eval() losses differ from the model's")
    return problems


def test_eval_leaves_the_gradients_alone_on_loop_and_v_schedules():
    assert run_ranks(_eval_one_rank, 1, timeout=120) == [[]]
