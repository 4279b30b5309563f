"""DualPipeV with a split backward: V placement, the steady state as overlapped F-and-B pairs whose
backward is B only, and the weight passes W in the bubbles that remain (pure Python).

DualPipe (DeepSeek-V3, arXiv 2412.19437) runs, in its steady state, the forward of one model
chunk and the backward of the other as one *pair*, so each half's expert all-to-all hides
behind the other half's compute; DualPipeV is its cut-in-half V form (rank ``r`` holds chunks
``r`` and ``2p - 1 - r``). Here its order is a skeleton of F's, B's and pairs per rank:

1. ``2(p - r - 1)`` forwards of chunk 0 (they fill the time the first microbatch takes to go
   down the V and come back), then ``r + 1`` rounds of F chunk 0, F chunk 1;
2. ``p - r - 1`` rounds of B chunk 1, F chunk 1;
3. the steady state, ``m - 2p + r + 1`` rounds of two pairs: (F chunk 0, B chunk 1) and
   (F chunk 1, B chunk 0); the last rank runs its first round's first pair as two actions, so
   the backward that every other rank waits for starts without waiting for a forward;
4. ``p - r - 1`` rounds of B chunk 1, pair (F chunk 1, B chunk 0); then ``r + 1`` rounds of
   B chunk 1, B chunk 0; then ``p - r - 1`` B's of chunk 0.

Every backward is a B; :mod:`.weight_fill` then places the W's by simulated time (in idle time,
or before an F the memory limit would refuse) with the real costs. The skeleton holds 2p
chunks' forwards on every rank (1F1B's peak) and, in its steady state, one more: a pair's F
allocates before its B and W free anything. So ``memory="zb"`` budgets 1F1B's peak plus one
chunk microbatch (:func:`dualpipev_budget`); the skeleton needs ``m >= 2p``.

Where the skeleton does not apply (``m < 2p``, or a budget below its peak: ``memory="half"``
or ``"min"``, a small ``memory_limit``), the plan is the ZB-V plan of the same memory mode
(:mod:`.zbv`: ZB-V, V-Half, V-Min) with its neighbouring F and B paired where that makes it no
longer (:mod:`.pairing`). With nothing for the pairs to hide (``a2a = 0``) the skeleton can be
longer than ZB-V's plan: DualPipeV is for models whose collectives need hiding. It has never been
seen longer than 1F1B's on the same model (tests/planning/test_plan_dualpipev.py checks random
sizes and costs).
"""

from __future__ import annotations

import logging

from ..core import Action, Plan, PlanError, make_plan, v_placement
from ..costs import Costs, StageCosts
from ..rules import check_sizes
from ..simulator import simulate_timing
from .pairing import pair_neighbours
from .weight_fill import Unit, fill_weight_passes
from .zbv import MemoryMode, plan_zbv

log = logging.getLogger(__name__)

NAME = "ZBDualPipeV"


def dualpipev_units(
    num_ranks: int, n_microbatches: int, *, turn_backward_first: bool = False
) -> dict[int, list[Unit]]:
    """The DualPipeV skeleton (module docstring), per rank; needs ``n_microbatches >= 2p``.

    ``turn_backward_first``: the last rank's first steady round runs its B before its F (so a
    W can free memory in between: within 1F1B's peak when B frees nothing), not F then B."""
    p, m = num_ranks, n_microbatches
    if m < 2 * p:
        raise ValueError(f"the DualPipeV order needs n_microbatches >= 2 * num_ranks ({2 * p})")
    return {r: _rank_units(r, p, m, turn_backward_first) for r in range(p)}


def _rank_units(r: int, p: int, m: int, turn_backward_first: bool) -> list[Unit]:
    down, up = r, 2 * p - 1 - r  # the rank's chunk on the way down the V, and on the way up
    count = {(s, k): 0 for s in (down, up) for k in "FB"}
    units: list[Unit] = []

    def take(stage: int, kind: str) -> Action:
        mb = count[(stage, kind)]
        count[(stage, kind)] += 1
        return Action(stage, kind, mb)

    def one(stage: int, kind: str) -> None:
        units.append(take(stage, kind))

    def pair(forward: int, backward: int) -> None:
        units.append((take(forward, "F"), take(backward, "B")))

    for _ in range(2 * (p - r - 1)):
        one(down, "F")
    for _ in range(r + 1):
        one(down, "F")
        one(up, "F")
    for _ in range(p - r - 1):
        one(up, "B")
        one(up, "F")
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            first, then = (
                ((up, "B"), (down, "F")) if turn_backward_first else ((down, "F"), (up, "B"))
            )
            one(*first)
            one(*then)
        else:
            pair(down, up)
        pair(up, down)
    for _ in range(p - r - 1):
        one(up, "B")
        pair(up, down)
    for _ in range(r + 1):
        one(up, "B")
        one(down, "B")
    for _ in range(p - r - 1):
        one(down, "B")
    return units


def plan_dualpipev(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    memory: MemoryMode = "zb",
) -> Plan:
    """A DualPipeV plan with overlapped F-and-B pairs and W in the bubbles (module docstring).

    ``costs`` describe each of the ``2 * num_ranks`` chunks (``a2a``: the collectives a pair
    hides); ``memory`` is ZB-V's memory mode (``"zb"``: 1F1B's peak, ``"half"``, ``"min"``) and
    ``memory_limit`` (per rank, in ``Costs`` memory units) replaces its budget.
    """
    check_sizes(num_ranks, n_microbatches)
    p, m = num_ranks, n_microbatches
    costs = costs if costs is not None else Costs()
    sc = costs.per_stage(2 * p)
    zbv = plan_zbv(p, m, costs, memory_limit=memory_limit, memory=memory)
    budget = dualpipev_budget(sc, float(zbv.meta["memory_budget"]), memory, memory_limit)  # type: ignore[arg-type]
    candidates: list[tuple[str, Plan]] = []
    for turn in (False, True) if m >= 2 * p else ():
        units = dualpipev_units(p, m, turn_backward_first=turn)
        filled = fill_weight_passes(units, sc, v_placement(p), budget)
        if filled is not None:
            order, pairs = filled
            label = f"dualpipev(turn_backward_first={turn})"
            skeleton = make_plan(
                NAME, p, m, v_placement(p), order, layout="v", pairs=pairs,
                memory=memory, memory_budget=budget, strategy=label,
            )  # fmt: skip
            candidates.append((label, skeleton))
    if not candidates:  # m < 2p, or a budget below the skeleton's: ZB-V's plan, paired
        paired = pair_neighbours(zbv, costs, budget, NAME)
        candidates.append(("zbv-paired", _with_meta(paired, memory, budget, "zbv-paired")))
    best: tuple[tuple[float, float, int], str, Plan] | None = None
    for i, (label, plan) in enumerate(candidates):
        try:
            r = simulate_timing(plan, costs, memory_limit=budget)
        except PlanError as exc:  # a bug in a generator, not the user's fault
            raise RuntimeError(f"plan_dualpipev built an invalid plan ({label}): {exc}") from exc
        key = (round(r.makespan, 9), round(r.longest_span, 9), i)
        if best is None or key < best[0]:
            best = (key, label, plan)
    assert best is not None
    log.debug("%s p=%d m=%d: chose %s", NAME, p, m, best[1])
    return best[2]


def dualpipev_budget(
    stage_costs: list[StageCosts], zbv_budget: float, memory: MemoryMode, memory_limit: float | None
) -> float:
    """The per-rank budget: ``memory_limit`` if given; else ZB-V's for the mode, plus, for
    ``"zb"``, one chunk's forward: a pair's F allocates before its B (and W) free anything, so
    the skeleton's steady state holds 1F1B's peak and one more chunk microbatch."""
    if memory_limit is not None:
        return float(memory_limit)
    if memory == "zb":
        return zbv_budget + max(c.mem_f for c in stage_costs)
    return zbv_budget


def _with_meta(plan: Plan, memory: MemoryMode, budget: float, strategy: str) -> Plan:
    return make_plan(
        NAME, plan.num_ranks, plan.n_microbatches, plan.placement, plan.order, layout="v",
        pairs=plan.pairs, memory=memory, memory_budget=budget, strategy=strategy,
    )  # fmt: skip
