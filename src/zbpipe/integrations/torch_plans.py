"""torch's built-in schedules as zbpipe plans, built by torch's own order generators.

No process group is needed: each multi-stage class is created with ``cls.__new__(cls)`` (its
``__init__`` wants real stages) and given only the attributes its
``_calculate_single_rank_operations(rank)`` reads; the single-stage ``GPipe`` gives its order
through ``_get_pipeline_order()``. Both are private torch methods, called through
``zbpipe._compat`` (``multi_stage_rank_orders``, ``single_stage_order``). The constructor checks
torch runs on the sizes are repeated here, so a size torch refuses raises the same
``ValueError`` here.

Schedule1F1B is the exception: its ``_get_pipeline_order()`` is wrong for the last rank (it
starts that rank's forwards at microbatch 1, so microbatch 0 is never forwarded and ``m`` is
out of range) and is not what runs. What runs is the control flow of
``Schedule1F1B._step_microbatches``, ported in ``_torch_1f1b_rank_order``: rank ``r`` runs
``min(m, p - r)`` forwards, then ``B, F`` pairs while forwards remain, then the remaining
``B``s. That is exactly the textbook 1F1B order (warm-up ``p - 1 - r`` forwards, then F/B pairs).

torch letters become the paper's: F->F, I->B, W->W, B->BW; ``None`` padding and non-compute
actions (REDUCE_GRAD) are dropped; DualPipeV's ``OVERLAP_F_B`` pairs become their two
sub-actions in order (F first, then the backward).
"""

from __future__ import annotations

import torch.distributed.pipelining as pipelining

from .. import _compat as C
from ..planning.core import Action, Plan, loop_placement, make_plan, v_placement
from ..planning.registry import TORCH_SCHEDULES

_V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def torch_plan(name: str, num_ranks: int, n_microbatches: int, stages_per_rank: int = 2) -> Plan:
    """torch's schedule ``name`` (e.g. ``"ZBVZeroBubble"``) for ``num_ranks``, ``n_microbatches``.

    ``stages_per_rank`` applies to the interleaved loop schedules (Interleaved1F1B,
    InterleavedZeroBubble); V schedules always have 2, single-stage schedules 1.
    """
    p, m = num_ranks, n_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"num_ranks and n_microbatches must be >= 1, got {p}, {m}")
    if name == "1F1B":
        if m < p:
            raise ValueError(f"torch:1F1B needs n_microbatches >= num_ranks ({p}), got {m}")
        order = {r: _torch_1f1b_rank_order(r, p, m) for r in range(p)}
        return make_plan(
            "torch:1F1B",
            p,
            m,
            loop_placement(p, p),
            order,
            source="Schedule1F1B._step_microbatches",
        )
    if name == "GPipe":
        raw = C.single_stage_order(pipelining.ScheduleGPipe, p, m)
        return make_plan("torch:GPipe", p, m, loop_placement(p, p), _convert(raw))
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        if stages_per_rank < 1:
            raise ValueError(f"stages_per_rank must be >= 1, got {stages_per_rank}")
        rounds = max(1, m // p)
        if m % rounds != 0:
            raise ValueError(
                f"torch:{name} needs n_microbatches to be a multiple of the number of rounds "
                f"max(1, m // p) = {rounds}, got {m}"
            )
        cls = getattr(pipelining, f"Schedule{name}")
        raw = C.multi_stage_rank_orders(cls, p, m, stages_per_rank, rounds=rounds)
        placement = loop_placement(p, p * stages_per_rank)
        return make_plan(
            f"torch:{name}", p, m, placement, _convert(raw), stages_per_rank=stages_per_rank
        )
    if name in _V_SCHEDULES:
        if name == "DualPipeV" and m < 2 * p:
            raise ValueError(
                f"torch:DualPipeV needs n_microbatches >= 2 * num_ranks ({2 * p}), got {m}"
            )
        cls = getattr(pipelining, f"Schedule{name}")
        raw = C.multi_stage_rank_orders(cls, p, m, stages_per_rank=2)
        return make_plan(f"torch:{name}", p, m, v_placement(p), _convert(raw), layout="v")
    raise ValueError(f"unknown torch schedule {name!r}; known: {', '.join(TORCH_SCHEDULES)}")


def _torch_1f1b_rank_order(rank: int, num_ranks: int, m: int) -> list[Action]:
    """The compute order ``Schedule1F1B._step_microbatches`` executes on ``rank`` (torch 2.13)."""
    order = []
    fwd = bwd = 0
    for _ in range(min(m, num_ranks - rank)):  # warm-up: "last stage has 1 warmup"
        order.append(Action(rank, "F", fwd))
        fwd += 1
    while True:  # 1B1F phase: backward first, then a forward while any remain
        order.append(Action(rank, "BW", bwd))
        bwd += 1
        if fwd == m:
            break
        order.append(Action(rank, "F", fwd))
        fwd += 1
    order.extend(Action(rank, "BW", i) for i in range(bwd, m))  # cool-down
    return order


def _convert(raw: dict) -> dict[int, list[Action]]:
    """torch actions (with ``None`` padding) -> our compute actions, in order."""
    order: dict[int, list[Action]] = {}
    for rank, actions in raw.items():
        out: list[Action] = []
        for a in actions:
            if a is None:
                continue
            subs = a.sub_actions if a.sub_actions is not None else (a,)
            for sub in subs:
                kind = C.TORCH_TO_KIND.get(sub.computation_type)
                if kind is not None:  # drop REDUCE_GRAD and other non-compute actions
                    out.append(Action(sub.stage_index, kind, sub.microbatch_index))
        order[rank] = out
    return order
