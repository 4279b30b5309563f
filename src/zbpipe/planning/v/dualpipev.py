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

Where the skeleton does not fit the budget with all its pairs (a heavy chunk in measured
bytes, ``memory="half"`` or ``"min"``, a small ``memory_limit``), the pairs that do not fit are
split (their B first, then the W's memory needs, then their F: :mod:`.weight_fill`); where it
does not apply at all (``m < 2p``) only ZB-V's plan is left. Each of these *bases*, and ZB-V's
plan of the same memory mode (:mod:`.zbv`: ZB-V, V-Half, V-Min), is paired afresh on its order
(neighbouring F and B, :mod:`.pairing`), and :mod:`.pair_choice` picks: the shortest under the
collectives' measured or given cost (``Costs.a2a``), or, when nothing is known of it, the plan
nearest the best both with free collectives and with collectives as long as the compute. With
nothing for the pairs to hide (``a2a = 0``) the skeleton can be longer than ZB-V's plan:
DualPipeV is for models whose collectives need hiding. It has never been seen longer than
1F1B's on the same model (tests/planning/test_plan_dualpipev.py checks random sizes and costs).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

from ..core import Action, Plan, make_plan, v_placement
from ..costs import Costs, StageCosts
from ..loop.onef1b import plan_1f1b
from ..rules import check_sizes
from ..simulator import simulate_timing
from .pair_choice import ChoiceMode, choose, pair_candidates
from .weight_fill import Unit, fill_weight_passes
from .zbv import MemoryMode, plan_zbv

#: which pairs a plan keeps (``plan_dualpipev``; :mod:`.pair_choice`)
PairsMode = Literal["auto", "most", "paying"]

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
    pairs: PairsMode = "auto",
) -> Plan:
    """A DualPipeV plan with overlapped F-and-B pairs and W in the bubbles (module docstring).

    ``costs`` describe each of the ``2 * num_ranks`` chunks (``a2a``: the collectives a pair
    hides); ``memory`` is ZB-V's memory mode (``"zb"``: 1F1B's peak, ``"half"``, ``"min"``) and
    ``memory_limit`` (per rank, in ``Costs`` memory units) replaces its budget. ``pairs``
    (:mod:`.pair_choice`): ``"paying"`` keeps the pairs that make the plan shorter under
    ``costs``, ``"most"`` as many as the budget allows; ``"auto"``: ``"paying"`` where some
    ``a2a`` is given (> 0), else ``"hedged"``, the plan nearest the best both with free
    collectives and with collectives as long as the compute.

    ``meta``: ``skeleton_pairs``, the pairs of the DualPipeV order (0 for ``m < 2p``), and
    ``skeleton_fits``, whether it fits the budget with all of them (if not,
    :func:`skeleton_budget` says what budget would); ``pairs_mode``, the mode that chose.
    """
    check_sizes(num_ranks, n_microbatches)
    p, m = num_ranks, n_microbatches
    costs = costs if costs is not None else Costs()
    sc = costs.per_stage(2 * p)
    mode = resolve_pairs_mode(pairs, sc)
    zbv = plan_zbv(p, m, costs, memory_limit=memory_limit, memory=memory)
    budget = dualpipev_budget(sc, float(zbv.meta["memory_budget"]), memory, memory_limit)  # type: ignore[arg-type]
    meta: dict[str, object] = {
        "memory": memory, "memory_budget": budget, "pairs_mode": mode,
        "skeleton_pairs": 0, "skeleton_fits": False,
    }  # fmt: skip
    bases = _skeletons(p, m, costs, budget, meta) if m >= 2 * p else []
    bases.append(("zbv", dataclasses.replace(zbv, name=NAME)))
    joined = costs.joined(2)  # 1F1B on the same model: each rank's two chunks as one stage
    ceiling = simulate_timing(plan_1f1b(p, m, joined), joined).makespan
    candidates = pair_candidates(bases, costs, budget, mode, NAME)
    label, chosen = choose(candidates, costs, budget, mode, ceiling)
    log.debug("%s p=%d m=%d: chose %s", NAME, p, m, label)
    return _with_meta(chosen, strategy=label, **meta)


def resolve_pairs_mode(pairs: PairsMode, stage_costs: list[StageCosts]) -> ChoiceMode:
    """How the pairs are chosen: ``pairs`` itself, or for ``"auto"`` ``"paying"`` where some
    ``a2a`` is given, else ``"hedged"``."""
    if pairs not in ("auto", "most", "paying"):
        raise ValueError(f"pairs must be 'auto', 'most' or 'paying', got {pairs!r}")
    if pairs != "auto":
        return pairs
    return "paying" if any(c.a2a > 0 for c in stage_costs) else "hedged"


def _skeletons(
    p: int, m: int, costs: Costs, budget: float, meta: dict[str, object]
) -> list[tuple[str, Plan]]:
    """The DualPipeV order (both first-round turns) with its W's placed within ``budget``: whole
    where it fits, else with the pairs that do not fit split."""
    sc = costs.per_stage(2 * p)
    out: list[tuple[str, Plan]] = []
    for turn in (False, True):
        units = dualpipev_units(p, m, turn_backward_first=turn)
        meta["skeleton_pairs"] = sum(isinstance(u, tuple) for us in units.values() for u in us)
        label = f"dualpipev(turn_backward_first={turn})"
        filled = fill_weight_passes(units, sc, v_placement(p), budget)
        meta["skeleton_fits"] = meta["skeleton_fits"] or filled is not None
        if filled is None:
            filled = fill_weight_passes(units, sc, v_placement(p), budget, split_pairs=True)
            label += ", pairs split to fit"
        if filled is not None:
            order, pairs = filled
            plan = make_plan(NAME, p, m, v_placement(p), order, layout="v", pairs=pairs)
            out.append((label, plan))
    return out


def skeleton_budget(num_ranks: int, n_microbatches: int, costs: Costs) -> float:
    """The least per-rank budget (``Costs`` memory units, to 0.1%) within which the DualPipeV
    order keeps every pair (either first-round turn): what to allow a plan that lost pairs to
    its budget. Needs ``n_microbatches >= 2 * num_ranks``."""
    p, m = num_ranks, n_microbatches
    sc = costs.per_stage(2 * p)
    best = float("inf")
    for turn in (False, True):
        units = dualpipev_units(p, m, turn_backward_first=turn)
        filled = fill_weight_passes(units, sc, v_placement(p), float("inf"))
        assert filled is not None  # no limit: never short of memory; the order never deadlocks
        plan = make_plan(NAME, p, m, v_placement(p), filled[0], layout="v", pairs=filled[1])
        low, high = 0.0, max(simulate_timing(plan, costs).peak_memory.values())
        while high - low > 1e-3 * high:  # a bisection between too little and enough
            mid = (low + high) / 2
            if fill_weight_passes(units, sc, v_placement(p), mid) is None:
                low = mid
            else:
                high = mid
        best = min(best, high)
    return best


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


def _with_meta(plan: Plan, **meta: object) -> Plan:
    return make_plan(
        NAME, plan.num_ranks, plan.n_microbatches, plan.placement, plan.order, layout="v",
        pairs=plan.pairs, **meta,
    )  # fmt: skip
