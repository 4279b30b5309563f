"""Post-validated optimizer step on 2 real gloo ranks, against an unpipelined torch reference."""

import math

import pytest
import torch

from tests.continuous import _optim_cases as oc
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

MAX_NORM = 1.0
# step 0: global norm ~ 6 (clipped; stage 1's own norm ~ 0.2 is not), step 1: below max_norm
# on every rank (no clipping, nothing to redo), step 2: clipped again.
SCALES = (2.0, 0.05, 3.0)
CASES = [
    ("sgd", MAX_NORM, SCALES, None),
    ("adamw", MAX_NORM, SCALES, None),
    ("adamw", MAX_NORM, SCALES, (1, 0)),  # inf on rank 0 at step 1: rank 1 stepped and rolls back
    ("sgd", MAX_NORM, SCALES, (2, 1)),  # inf on rank 1 (the chain's start) at step 2
]


def _to_torch(x):
    if isinstance(x, dict):
        return {k: _to_torch(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_torch(v) for v in x)
    return torch.from_numpy(x) if hasattr(x, "dtype") and hasattr(x, "shape") else x


@pytest.fixture(scope="module")
def results():
    return _to_torch(run_ranks(oc.run_cases, 2, CASES, timeout=120))


def reference(opt_name, max_norm, scales, inject_inf):
    """The whole model, torch.nn.utils.clip_grad_norm_ and one optimizer, step by step."""
    model = oc.build_model()
    opt = oc.make_optimizer(opt_name, model.parameters())
    out = []
    for step, scale in enumerate(scales):
        for p, g in zip(model.parameters(), oc.step_grads(model, step, scale)):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
        skipped = inject_inf is not None and inject_inf[0] == step
        if not skipped:
            opt.step()
        out.append((norm, [p.detach().clone() for p in model.parameters()]))
    return out


def local_params(ref_params, rank):
    return ref_params[:2] if rank == 0 else ref_params[2:]


@pytest.mark.parametrize("case", [0, 1], ids=["sgd-momentum", "adamw"])
def test_clipped_steps_equal_unpipelined_reference(results, case):
    ref = reference(*CASES[case])
    for rank in (0, 1):
        for step, ((_status, norm, coef, _), params, _) in enumerate(results[rank][case]):
            ref_norm, ref_params = ref[step]
            assert norm == pytest.approx(ref_norm, rel=1e-6)  # float64 sum vs torch's fp32 norms
            assert coef == pytest.approx(min(1.0, MAX_NORM / (ref_norm + 1e-6)), rel=1e-6)
            for got, want in zip(params, local_params(ref_params, rank)):
                # Same update formulas; the clip coefficient differs in the last fp32 bits at most.
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_wrong_optimistic_clip_is_rolled_back_and_redone(results):
    for case in (0, 1):
        statuses = [[r[0][0] for r in results[rank][case]] for rank in (0, 1)]
        # Rank 0 ends the chain with the global sum: never wrong. Rank 1 guesses from its own
        # small norm: wrong exactly when the global norm clips (steps 0 and 2).
        assert statuses[0] == ["ok", "ok", "ok"]
        assert statuses[1] == ["redone", "ok", "redone"]
        opt_coefs = [r[0][3] for r in results[1][case]]
        assert opt_coefs[0] == 1.0 and opt_coefs[2] == 1.0  # the wrong guesses


@pytest.mark.parametrize("case", [2, 3])
def test_inf_on_one_rank_skips_the_step_on_all_ranks_bitwise(results, case):
    bad_step = CASES[case][3][0]
    ref = reference(*CASES[case])
    for rank in (0, 1):
        steps = results[rank][case]
        status, norm, _, _ = steps[bad_step][0]
        assert status == "skipped" and math.isinf(norm)
        before_params, before_state = steps[bad_step - 1][1], steps[bad_step - 1][2]
        after_params, after_state = steps[bad_step][1], steps[bad_step][2]
        assert all(torch.equal(a, b) for a, b in zip(before_params, after_params))
        assert before_state.keys() == after_state.keys()
        for k in before_state:
            assert all(torch.equal(a, b) for a, b in zip(before_state[k], after_state[k]))
        for step, (_, params, _) in enumerate(steps):  # the other steps are the reference's
            for got, want in zip(params, local_params(ref[step][1], rank)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
