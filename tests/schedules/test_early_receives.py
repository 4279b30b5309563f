"""On gloo the action loop can post receives ahead of torch's lowering
(zbpipe.schedules.action_loop.RECEIVE_LEAD; the default, 0, keeps the lowering's placement).

The orders are checked against hand-worked lists and against torch's lowering (with every
receive first: each RECV of the rank's list, in that list's order, ahead of everything else, the
rest unmoved), and the gradients of three steps against an unpipelined reference computed in
the test (the receive buffers are reused by every step, and on this model an activation and an
output gradient have the same shape: a receive matched to the wrong message would go unnoticed
by shape checks and show in the gradients).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.schedules._dist_cases import CFG, reference_grads
from zbpipe import _compat as C
from zbpipe.schedules import action_loop
from zbpipe.schedules.action_loop import posts_receives_early, receives_ahead
from zbpipe.testing import run_ranks

STEPS = 3


def _act(kind: object, mb: int) -> SimpleNamespace:
    return SimpleNamespace(computation_type=kind, microbatch_index=mb)


def _order() -> list[SimpleNamespace]:
    return [
        _act(C.FORWARD, 0),  # 0
        _act(C.SEND_F, 0),  # 1
        _act(C.RECV_B, 0),  # 2
        _act(C.FORWARD, 1),  # 3
        _act(C.SEND_F, 1),  # 4
        _act(C.RECV_F, 2),  # 5
        _act(C.FULL_BACKWARD, 0),  # 6
        _act(C.RECV_B, 1),  # 7
    ]


@pytest.mark.parametrize(
    ("lead", "want"),
    [
        (0, [0, 1, 2, 3, 4, 5, 6, 7]),
        # one compute action ahead: 2 before F0; 5 before F1 (after 2: receives keep order);
        # 7 before BW0
        (1, [2, 0, 1, 5, 3, 4, 7, 6]),
        # two: 5 would pass F1 and F0 but stops after the receive 2; 7 passes BW0 and F1
        (2, [2, 5, 0, 1, 7, 3, 4, 6]),
        (None, [2, 5, 7, 0, 1, 3, 4, 6]),
    ],
)
def test_receives_move_ahead_by_compute_actions_and_keep_their_order(lead, want):
    bound = [(i, a, f"call{i}") for i, a in enumerate(_order())]
    assert [i for i, _, _ in receives_ahead(bound, {}, None, lead)] == want


def test_a_receive_handled_by_a_custom_function_stays_and_nothing_passes_it():
    acts = [_act(C.FORWARD, 0), _act(C.RECV_F, 1), _act(C.FORWARD, 1), _act(C.RECV_B, 0)]
    bound = [(i, a, f"call{i}") for i, a in enumerate(acts)]
    own = object()
    custom = {C.RECV_F: lambda action, ctx: None, C.RECV_B: own}
    assert [i for i, _, _ in receives_ahead(bound, custom, own, None)] == [0, 1, 3, 2]


def test_not_early_without_a_process_group():
    assert not posts_receives_early(SimpleNamespace(seam=SimpleNamespace(stages={})))


def _early_receives_case(rank: int, world: int, schedule: str, m: int) -> float:
    from torch.distributed.pipelining import PipelineStage

    import zbpipe
    from zbpipe.patching import patch
    from zbpipe.testing.models import build_stages, lm_loss, synthetic_batch

    cls = getattr(zbpipe, schedule)
    num_stages = world * cls.stages_per_rank
    mods = build_stages(CFG, num_stages, seed=3)
    ids, tgt = synthetic_batch(CFG, batch=2 * m, step=3)
    ref, _ = reference_grads(mods, ids, tgt, m)
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in mine]
    sched = cls(stages, m, loss_fn=lm_loss)
    every_receive_first = patch(action_loop, "RECEIVE_LEAD", None)
    for _ in range(STEPS):
        for s in mine:
            mods[s].zero_grad(set_to_none=True)
        sched.step(*((ids,) if 0 in mine else ()), target=tgt if num_stages - 1 in mine else None)
    every_receive_first.undo()
    assert posts_receives_early(sched)
    lowered = [f"PP:{a}" for a in C.order_with_comms(sched)[rank]]
    recvs = [n for n in lowered if "RECV" in n]
    names = list(sched._program.names)
    assert recvs and names[: len(recvs)] == recvs, (schedule, rank, names)
    rest = names[len(recvs) :]
    assert rest == [n for n in lowered if n in set(rest) and "RECV" not in n], (schedule, rank)
    worst = 0.0
    for s in mine:
        for (name, p), (_, q) in zip(mods[s].named_parameters(), ref[s].named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{s} {name}")
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


def _cases(rank: int, world: int, cases: list[tuple[str, int]]) -> list[float]:
    return [_early_receives_case(rank, world, s, m) for s, m in cases]


@pytest.mark.dist
def test_every_receive_first_on_gloo_and_gradients_equal_the_reference_over_steps():
    cases = [("ScheduleZBV", 8), ("ScheduleZBV", 3), ("ScheduleZBH1", 5), ("Schedule1F1BMulti", 4)]
    worst = run_ranks(_cases, 2, cases, timeout=300)
    assert len(worst) == 2 and all(len(w) == len(cases) for w in worst)


@pytest.mark.parametrize(
    ("backends", "early"),
    [
        (["gloo"], True),
        (["gloo", "gloo"], True),
        (["gloo", "nccl"], False),  # one stage's group on NCCL: never (module docstring)
        (["nccl"], False),
        (["cpu:gloo,cuda:nccl"], False),  # a default group with a backend per device
        (["mpi"], False),
    ],
)
def test_early_only_where_every_stage_group_is_gloo(monkeypatch, backends, early):
    groups = [object() for _ in backends]
    of = dict(zip(map(id, groups), backends))
    monkeypatch.setattr(action_loop.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(action_loop.dist, "get_backend", lambda group=None: of[id(group)])
    stages = {s: SimpleNamespace(group=g) for s, g in enumerate(groups)}
    assert posts_receives_early(SimpleNamespace(seam=SimpleNamespace(stages=stages))) is early
