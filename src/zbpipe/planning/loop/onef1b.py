"""1F1B (PipeDream-flush): the baseline every Zero Bubble schedule is measured against.

One stage per rank, fused backward ``BW``. Rank ``r`` runs ``p - 1 - r`` warm-up forwards,
then alternates one F and one BW (steady state), then drains the remaining BWs (cool-down).
At most ``min(p - r, m)`` microbatches are in flight on rank ``r``: its peak activation memory.
"""

from __future__ import annotations

from ..core import Action, Plan, loop_placement, make_plan
from ..costs import Costs
from ..rules import check_sizes


def onef1b_rank_order(
    rank: int, num_ranks: int, n_microbatches: int, backward: str = "BW"
) -> list[Action]:
    """The 1F1B order of one rank (``backward`` is ``"BW"``, or ``"B"`` for the F/B skeleton)."""
    m = n_microbatches
    warmup = min(num_ranks - 1 - rank, m)
    # Phase 1, warm-up: p - 1 - r forwards, one per rank below this one that needs an input
    # before the first gradient can come back up.
    order = [Action(rank, "F", i) for i in range(warmup)]
    # Phase 2, steady state (one F, one backward): the forward of microbatch warmup + i, then
    # the backward of microbatch i, whose gradient has just arrived.
    for i in range(m - warmup):
        order.append(Action(rank, "F", warmup + i))
        order.append(Action(rank, backward, i))
    # Phase 3, cool-down: the backwards of the last ``warmup`` microbatches; no forward is left.
    order.extend(Action(rank, backward, i) for i in range(m - warmup, m))
    return order


def plan_1f1b(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
) -> Plan:
    """The 1F1B plan (any ``n_microbatches >= 1``; with ``m < p`` it degenerates to GPipe).

    ``costs`` and ``memory_limit`` do not change the order (1F1B is cost-oblivious); a
    ``memory_limit`` is checked by ``simulate``.
    """
    check_sizes(num_ranks, n_microbatches)
    if costs is not None:
        costs.check(num_ranks)
    order = {r: onef1b_rank_order(r, num_ranks, n_microbatches) for r in range(num_ranks)}
    return make_plan("1F1B", num_ranks, n_microbatches, loop_placement(num_ranks, num_ranks), order)
