"""ZB-V, V-Half and V-Min: V-placement plans with controllable activation memory (pure Python).

References: "Zero Bubble Pipeline Parallelism" (Qi et al., ICLR 2024), Sec. 6 (ZB-V), and
"Pipeline Parallelism with Controllable Memory" (Qi et al., NeurIPS 2024; V-Half, V-Min).
The three share the V placement (rank ``r`` holds stages ``r`` and ``2p - 1 - r``) and differ
in the activation memory a rank may hold, in units of one microbatch of a stage of the same
model cut into ``p`` stages (two chunks), i.e. twice a chunk's ``mem_f``:

=======  =========================  ===============================
mode     per-rank budget (units)    paper's bubble rate (F = B = W)
=======  =========================  ===============================
``zb``   1F1B's peak, ``p``         0 for m >= 2p
``half`` ``(p + 2) / 2``            about ``p / (2m)``
``min``  ``(p + 4) / 3``            about ``2p / (3m)``
=======  =========================  ===============================

The plan is searched, not hard-coded: several candidate orders (the paper's ZB-V F/B order
with W placed by the real costs, the greedy scheduler of ``greedy`` under a few tie-break
strategies, and for V-Half and V-Min the controllable-memory paper's repeated building block of
``blocks``) are timed with the actual F, B, W and comm costs. The best building block and the
best of the rest (shortest longest-rank span, the bubble rate's denominator, then makespan) are
each polished by a local search (``improve.improve``) under the same memory budget, and the
shorter result wins.
Deterministic: candidates are tried in a fixed order and ties keep the first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Literal

from ..core import Plan, PlanError, make_plan, v_placement
from ..costs import Costs, StageCosts
from ..rules import EPS, check_sizes, within
from ..search.improve import improve
from ..search.perturbed import PLAN_SEED, SCORE_SEED, SCORED, least_sensitive, scenarios
from ..simulator import simulate_timing
from ..yardsticks import V_FORMULAS, v_budget, v_minimum_memory
from .blocks import block_candidates
from .greedy import VShapeStrategy, greedy_candidates
from .paper_order import execute_fb_order, zbv_fb_order
from .timed_order import GreedyResult

log = logging.getLogger(__name__)

MemoryMode = Literal["zb", "half", "min"]
_NAMES = {"zb": "ZBV", "half": "ZBVHalf", "min": "ZBVMin"}
_FORMULAS = V_FORMULAS


def default_budget(
    num_ranks: int, stage_costs: list[StageCosts], memory: MemoryMode, n_microbatches: int
) -> float:
    """The mode's per-rank activation budget, in ``Costs`` memory units
    (:func:`zbpipe.planning.yardsticks.v_budget`)."""
    return v_budget(num_ranks, n_microbatches, stage_costs, memory)


def _strategies(num_ranks: int, memory: MemoryMode) -> list[VShapeStrategy]:
    leads: list[int | None] = [None, 1, 2, 3, 4]
    if num_ranks > 4:
        leads += [num_ranks // 2, num_ranks]
    out = []
    for lead in leads:
        for f_first in (False, True):
            out.append(VShapeStrategy(chunk0_lead=lead, f_first=f_first))
    if memory == "zb":
        out.append(VShapeStrategy(chunk0_lead=1, lead_slope=2))
        out.append(VShapeStrategy(w_wait=0.5))
    return out


def _candidates(
    p: int,
    m: int,
    costs: Costs,
    sc: list[StageCosts],
    budget: float,
    memory: MemoryMode,
    bar: Callable[[], float | None],
) -> Iterator[tuple[str, GreedyResult | None]]:
    """Yield ``(label, GreedyResult)`` in a fixed order; None for a greedy candidate whose longest
    rank span is certain to exceed ``bar()``, the best of the non-block candidates so far."""
    if memory != "zb":
        # the controllable-memory paper's construction: one block repeated every period, squeezed
        yield from block_candidates(p, m, costs, budget)
    fb = zbv_fb_order(p, m)
    for eager_w in (False, True):
        res = execute_fb_order(p, m, sc, budget, fb, eager_w)
        if res is not None:
            yield f"zbv-order(eager_w={eager_w})", res
    res = execute_fb_order(p, m, sc, budget, zbv_fb_order(p, m, with_w=True), eager_w=False)
    if res is not None:
        yield "zbv-order(paper W)", res
    for st, greedy in greedy_candidates(p, m, sc, budget, _strategies(p, memory), bar):
        yield f"greedy{st}", greedy


def plan_zbv(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    memory: MemoryMode = "zb",
    perturbed_ties: int = 0,
) -> Plan:
    """A V-placement zero-bubble plan: ZB-V (``memory="zb"``), V-Half (``"half"``) or V-Min.

    ``costs`` describe each of the ``2 * num_ranks`` stages (chunks); ``memory_limit`` (per rank,
    in ``Costs`` memory units) replaces the mode's default budget. Raises ``ValueError`` if no
    plan fits the limit, naming the smallest limit that works.

    ``perturbed_ties`` (a count, 0 by default): for ``costs`` whose times are a guess (equal,
    nothing measured), also plan for that many cost sets drawn around them
    (:mod:`zbpipe.planning.search.perturbed`) and, among the plans no slower than this one under
    ``costs`` (span and makespan), return the one with the least mean makespan over other drawn
    sets. With 4, 3.6-4.6 times the planning (``benchmarks/perturbed_ties.py``).
    """
    if memory not in _NAMES:
        raise ValueError(f"memory must be one of {sorted(_NAMES)}, got {memory!r}")
    check_sizes(num_ranks, n_microbatches)
    p, m = num_ranks, n_microbatches
    costs = costs if costs is not None else Costs()
    sc = costs.per_stage(2 * p)
    budget = _budget(p, m, sc, memory, memory_limit)
    best = _best_per_family(p, m, costs, sc, budget, memory)
    # Polish by local search (improve.py): it shortens the plan where the costs leave gaps that a
    # fixed order cannot see (e.g. B > F makes the chunk-0 backward chain late). Each family's
    # best is polished (the search can reverse their ranking) and the shorter result wins.
    polished = [_polish(p, m, costs, budget, memory, fam, label, res) for fam, label, res in best]
    (span, _), plan, label = min(polished, key=lambda c: c[0])
    log.debug("%s p=%d m=%d: chose %s (span %.4g after polishing)", plan.name, p, m, label, span)
    if perturbed_ties:
        plan = _least_sensitive_tie(p, m, costs, budget, memory, plan, perturbed_ties)
    return plan


def _least_sensitive_tie(
    p: int, m: int, costs: Costs, budget: float, memory: MemoryMode, chosen: Plan, count: int
) -> Plan:
    """``chosen``, or a plan made for one of ``count`` cost sets drawn around ``costs`` that is
    as fast under ``costs`` and less slowed on average by ``SCORED`` other drawn sets (planning
    is dear, simulating cheap). The drawn plans' local search gets a quarter of the simulations
    (they are candidates, not the answer)."""
    if count < 0:
        raise ValueError(f"perturbed_ties must be a count >= 0, got {count}")
    candidates = [chosen]
    for d in scenarios(costs, 2 * p, count, seed=PLAN_SEED):
        for family, label, res in _best_per_family(p, m, d, d.per_stage(2 * p), budget, memory):
            candidates.append(_polish(p, m, d, budget, memory, family, label, res, 0.25)[1])
    best = least_sensitive(candidates, costs, scenarios(costs, 2 * p, SCORED, seed=SCORE_SEED))
    return dataclasses.replace(best, meta={**best.meta, "perturbed_ties": count})


def _budget(
    p: int, m: int, sc: list[StageCosts], memory: MemoryMode, memory_limit: float | None
) -> float:
    """The per-rank budget: ``memory_limit`` if given (checked), else the mode's default."""
    floor = v_minimum_memory(sc, p)
    if memory_limit is not None:
        if memory_limit < floor - EPS:
            raise ValueError(
                f"memory_limit={memory_limit} is too small for a V plan with these costs: a rank "
                f"must hold one microbatch of each of its two stages; use memory_limit >= {floor:g}"
            )
        return float(memory_limit)
    budget = default_budget(p, sc, memory, m)
    if budget < floor - EPS:
        # The promise cannot hold with these costs: say so, with the peak planned for instead.
        log.warning(
            "%s: its memory budget (%s) is %g units, below the %g a V plan needs with these "
            "costs (one microbatch of each of a rank's two stages, the heaviest rank's); "
            "planning for a peak of %g units instead",
            _NAMES[memory],
            _FORMULAS[memory],
            budget,
            floor,
            floor,
        )
    return max(budget, floor)


def _best_per_family(
    p: int, m: int, costs: Costs, sc: list[StageCosts], budget: float, memory: MemoryMode
) -> list[tuple[bool, str, GreedyResult]]:
    """The best candidate of each family: building blocks (True), the rest (ZB-V order, greedy)."""
    best: dict[bool, tuple[tuple[float, float, int], str, GreedyResult]] = {}

    def bar() -> float | None:  # what a greedy candidate must beat to be chosen
        return best[False][0][0] if False in best else None

    for i, (label, res) in enumerate(_candidates(p, m, costs, sc, budget, memory, bar)):
        if res is None or not within(max(res.peak_memory.values()), budget):
            continue  # (None: certain to be longer than the best so far)
        key = (round(res.longest_span, 9), round(res.makespan, 9), i)
        family = label.startswith("block")
        if family not in best or key < best[family][0]:
            best[family] = (key, label, res)
    if not best:
        floor = v_minimum_memory(sc, p)
        raise ValueError(
            f"no {_NAMES[memory]} plan fits memory_limit={budget:g}; use memory_limit >= {floor:g}"
        )
    return [(family, label, res) for family, (_, label, res) in sorted(best.items())]


def _polish(
    p: int,
    m: int,
    costs: Costs,
    budget: float,
    memory: MemoryMode,
    family: bool,
    label: str,
    res: GreedyResult,
    share: float = 1.0,
) -> tuple[tuple[float, float], Plan, str]:
    """``res`` as a Plan, polished by ``improve`` (``share`` of the usual simulations); with its
    (span, makespan) as simulated."""
    plan = make_plan(
        _NAMES[memory], p, m, v_placement(p), res.order, layout="v",
        memory=memory, memory_budget=budget, strategy=label,
    )  # fmt: skip
    # The budget is a count of simulations, never wall time, so every rank computes the same plan.
    evals = improve_budget(p, m)
    if family:
        # a block order is periodic and tight: the local search rarely finds a move in it, and
        # its simulations are costly (moves sit early in the timeline), so a quarter is enough
        evals = max(100, evals // 4)
    evals = max(50, int(evals * share))
    plan = improve(plan, costs, memory_limit=budget, max_seconds=None, max_evals=evals)
    try:  # independent check of deadlock freedom and memory
        r = simulate_timing(plan, costs, memory_limit=budget)
    except PlanError as exc:  # a bug in the generator, not the user's fault
        raise RuntimeError(f"plan_zbv built an invalid plan ({label}): {exc}") from exc
    return (round(r.longest_span, 9), round(r.makespan, 9)), plan, label


def improve_budget(num_ranks: int, n_microbatches: int) -> int:
    """Simulations the local search may spend: many for small plans, about 1 s at p=32, m=128."""
    n_actions = 2 * num_ranks * 3 * n_microbatches
    return max(400, min(3000, 3_000_000 // n_actions))


def plan_zbv_half(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    perturbed_ties: int = 0,
) -> Plan:
    """V-Half: about half of 1F1B's activation memory."""
    return plan_zbv(
        num_ranks, n_microbatches, costs, memory_limit, memory="half", perturbed_ties=perturbed_ties
    )


def plan_zbv_min(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    perturbed_ties: int = 0,
) -> Plan:
    """V-Min: about a third of 1F1B's activation memory."""
    return plan_zbv(
        num_ranks, n_microbatches, costs, memory_limit, memory="min", perturbed_ties=perturbed_ties
    )
