"""The memory yardsticks every promise is stated in, written once (pure Python).

A schedule's memory promise is a per-rank budget in the memory units of its ``Costs`` (bytes
once the first step measured them). The planners (``loop/``, ``v/``), the byte-budget
resolution and the chooser (``zbpipe.schedules``) and the log lines all take their budgets
from here, so a promise means the same thing wherever it is checked:

* :func:`onef1b_peak`: **1F1B's peak** on the same model, the max over ranks (ZB-H1, ZB-1p and
  ZB-V promise it; ZB-2p twice it). Every backward in 1F1B's order is counted as the split
  engines hold it: its B, then its W at once (what the runtime fuses into one BW). When B holds
  more than F did (``mem_b > 0``: the graph engine's recorded gradients, activation
  checkpointing's recomputed GEMM inputs), that microbatch holds ``mem_f + mem_b`` for the
  length of its backward, as a fused backward holds what it recomputes; with ``mem_b <= 0`` this
  is the classic ``min(p - r, m)`` forwards in flight on rank ``r``.
* :func:`v_budget`: the V schedules' budgets: ZB-V 1F1B's peak on the same model cut into ``p``
  stages (chunks ``2i`` and ``2i + 1`` joined); V-Half ``(p + 2) / 2`` and V-Min ``(p + 4) / 3``
  microbatches of that model's stage 0 (chunks 0 and 1), plus what one backward in flight there
  holds beyond its forward (as 1F1B's yardstick counts it).
* ZB-Interleaved (several loop stages per rank) promises interleaved 1F1B's peak
  (:func:`zbpipe.planning.loop.interleaved.interleaved_peak`), counted the same way.
* :func:`minimum_memory` and :func:`v_minimum_memory`: the least any plan holds (one microbatch
  in flight on the busiest stage; a V rank's two chunks), the floor a budget is raised to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .core import Action
from .costs import Costs, StageCosts
from .loop.onef1b import onef1b_rank_order
from .rules import peak_memory

VMemoryMode = Literal["zb", "half", "min"]

#: the V-Half and V-Min budgets as written in the docs and log lines
V_FORMULAS: dict[str, str] = {
    "zb": "1F1B's peak",
    "half": "(p + 2) / 2 microbatches of stage 0",
    "min": "(p + 4) / 3 microbatches of stage 0",
}


def v_factor(num_ranks: int, memory: VMemoryMode) -> float:
    """Microbatches of stage 0 a V-Half (``"half"``) or V-Min (``"min"``) rank may hold; for
    ``"zb"`` the ``p`` that 1F1B's rank 0 holds."""
    p = num_ranks
    if memory == "half":
        return (p + 2) / 2
    if memory == "min":
        return (p + 4) / 3
    if memory == "zb":
        return float(p)
    raise ValueError(f"memory must be 'zb', 'half' or 'min', got {memory!r}")


def onef1b_split_order(rank: int, num_ranks: int, n_microbatches: int) -> list[Action]:
    """1F1B's order of one rank with every backward as B then its W at once (the yardstick's)."""
    order: list[Action] = []
    for a in onef1b_rank_order(rank, num_ranks, n_microbatches, backward="B"):
        order.append(a)
        if a.kind == "B":
            order.append(Action(rank, "W", a.microbatch))
    return order


def onef1b_rank_peaks(num_ranks: int, n_microbatches: int, costs: Costs) -> dict[int, float]:
    """1F1B's peak on each rank (one stage per rank), backwards held as the module says."""
    sc = costs.per_stage(num_ranks)
    return {
        r: peak_memory(onef1b_split_order(r, num_ranks, n_microbatches), sc)
        for r in range(num_ranks)
    }


def onef1b_peak(num_ranks: int, n_microbatches: int, costs: Costs) -> float:
    """1F1B's peak activation memory, the max over ranks (rank 0 holds ``min(p, m)`` forwards
    with equal stages)."""
    return max(onef1b_rank_peaks(num_ranks, n_microbatches, costs).values())


def _one_in_flight(c: StageCosts) -> float:
    """The most one microbatch of a stage holds: after its F, or after its B if B adds."""
    return c.mem_f + max(0.0, c.mem_b)


def minimum_memory(costs: Costs, num_stages: int) -> float:
    """The least per-rank memory limit any one-stage-per-rank plan fits in: one microbatch in
    flight on the busiest stage."""
    return max(max(_one_in_flight(c), 0.0) for c in costs.per_stage(num_stages))


def v_minimum_memory(stage_costs: Sequence[StageCosts], num_ranks: int) -> float:
    """The least per-rank budget of a V plan: one microbatch of each of a rank's two stages in
    flight together (the heaviest rank's)."""
    p = num_ranks
    return max(
        _one_in_flight(stage_costs[r]) + _one_in_flight(stage_costs[2 * p - 1 - r])
        for r in range(p)
    )


def joined_costs(stage_costs: Sequence[StageCosts]) -> Costs:
    """The V chunks' costs as one ``Costs`` (per-stage lists), for :meth:`Costs.joined`."""
    names = ("f", "b", "w", "comm", "mem_f", "mem_b", "mem_w")
    return Costs(**{n: [getattr(c, n) for c in stage_costs] for n in names})


def v_budget(
    num_ranks: int, n_microbatches: int, stage_costs: Sequence[StageCosts], memory: VMemoryMode
) -> float:
    """The per-rank budget of ZB-V (``"zb"``), V-Half (``"half"``) or V-Min (``"min"``), in the
    memory units of ``stage_costs`` (the ``2p`` chunks)."""
    p = num_ranks
    if memory == "zb":
        return onef1b_peak(p, n_microbatches, joined_costs(stage_costs).joined(2))
    c0, c1 = stage_costs[0], stage_costs[1]
    backward_extra = max(0.0, c0.mem_b + c1.mem_b)
    return v_factor(p, memory) * (c0.mem_f + c1.mem_f) + backward_extra


def promised_peak(
    name: str, num_ranks: int, n_microbatches: int, costs: Costs, stages_per_rank: int = 1
) -> float | None:
    """The budget a plan named ``name`` promises for ``costs`` (its stages), or None for a plan
    that promises none here (1F1B itself, ZB-H2, continuous...). The log lines and the
    chooser's advice read it."""
    key = name.strip().lower()
    if stages_per_rank == 1 and key in ("zbh1", "zb1p", "zb2p"):
        return (2.0 if key == "zb2p" else 1.0) * onef1b_peak(num_ranks, n_microbatches, costs)
    if stages_per_rank >= 2 and key == "zbinterleaved":
        from .loop.interleaved import interleaved_peak

        return interleaved_peak(num_ranks, n_microbatches, stages_per_rank, costs)
    modes: dict[str, VMemoryMode] = {"zbv": "zb", "zbvhalf": "half", "zbvmin": "min"}
    if stages_per_rank == 2 and key in modes:
        sc = costs.per_stage(2 * num_ranks)
        return v_budget(num_ranks, n_microbatches, sc, modes[key])
    return None


def least_memory(costs: Costs, num_ranks: int, layout: str = "loop") -> float:
    """The least per-rank memory of any plan of ``layout`` (``"loop"``: one stage per rank;
    ``"v"``: ``2p`` chunks in V placement) for ``costs``."""
    if layout == "v":
        return v_minimum_memory(costs.per_stage(2 * num_ranks), num_ranks)
    return minimum_memory(costs, num_ranks)
