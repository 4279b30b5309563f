"""Which overlapped pairs a DualPipeV plan keeps: the candidates, and the choice (pure Python).

The candidates grow from *base* plans (the DualPipeV order, whole or with the pairs that do not
fit the budget split, for each first-round turn; and ZB-V's plan): each base as built, and its
order with the pairs made afresh (:func:`.pairing.pair_neighbours`) where they make it no
longer under the costs given (``"hedged"``: with ``a2a = f``, below), and, for ``"most"``,
wherever the budget allows. Then, by the mode:

* ``"paying"``: the shortest under the costs given (their ``a2a``, what a chunk's collectives
  cost: measured by ``costs="profile"`` or given), then the most pairs;
* ``"most"``: the most pairs, then the shortest;
* ``"hedged"``: nothing is known of the collectives (every ``a2a`` is 0: the schedule was
  chosen to hide them, the costs do not say what they cost). Each candidate is simulated with
  free collectives (``a2a = 0``) and with collectives as long as the chunk's forward compute
  (``a2a = f``: two all-to-alls of half a forward each, the case benchmarks/overlap.py injects);
  the candidate chosen is the one whose worse ratio to the best candidate of each is least.
  Keeping the most pairs blindly can cost far more than the pairs can hide: on 2 ranks, 8
  microbatches, with a first chunk that holds nine times what the others do after F (so the
  DualPipeV order does not fit ZB-V's budget), ZB-V's order with every pair the budget allows
  (14) simulates 1.41x ZB-V's time with free collectives and still 1.07x with ``a2a = f``; the
  hedged choice (13 pairs) 0.96x and 0.78x.

Whatever the mode, a candidate slower than 1F1B under the costs given is chosen only if every
candidate is (the promise of every zero-bubble plan): so ``"most"`` too takes the 13 pairs
above, not the 14.

Every rank makes the same choice: the candidates come in a fixed order, ties go to the first.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ..core import Plan, PlanError
from ..costs import Costs
from ..simulator import simulate_timing
from .pairing import pair_neighbours

#: how a plan's pairs are chosen (the module docstring)
ChoiceMode = Literal["most", "paying", "hedged"]

Candidate = tuple[str, Plan]


def judging_costs(costs: Costs, mode: ChoiceMode, num_stages: int) -> list[Costs]:
    """The cost vectors a mode judges candidates by: the costs given, or (``"hedged"``) the
    costs with free collectives and with collectives as long as each chunk's forward."""
    if mode != "hedged":
        return [costs]
    forwards = [c.f for c in costs.per_stage(num_stages)]
    return [dataclasses.replace(costs, a2a=0.0), dataclasses.replace(costs, a2a=forwards)]


def pair_candidates(
    bases: list[Candidate], costs: Costs, budget: float, mode: ChoiceMode, name: str
) -> list[Candidate]:
    """Each base, and its order with pairs made afresh (module docstring); duplicates dropped."""
    # (hedged: pairs are made afresh where they pay with a2a = f only; with free collectives a
    # pair never pays, and searching for those that cost nothing took seconds at p = 8)
    judge = judging_costs(costs, mode, bases[0][1].num_stages)[-1]
    out: list[Candidate] = []
    seen: set[tuple[object, ...]] = set()

    def add(label: str, plan: Plan) -> None:
        key = (tuple(sorted(plan.order.items())), plan.pairs)
        if key not in seen:
            seen.add(key)
            out.append((label, plan))

    for label, base in bases:
        add(label, base)
        unpaired = base.without_pairs()
        where = "where they pay" + (" with a2a = f" if mode == "hedged" else "")
        add(f"{label}, paired {where}", pair_neighbours(unpaired, judge, budget, name))
        if mode == "most":
            add(f"{label}, most pairs", pair_neighbours(unpaired, costs, budget, name, most=True))
    return out


def choose(
    candidates: list[Candidate], costs: Costs, budget: float, mode: ChoiceMode, ceiling: float
) -> Candidate:
    """The candidate the mode prefers (module docstring) among those no longer than ``ceiling``
    under ``costs`` (1F1B's time: the promise of every zero-bubble plan; all of them if none
    is); each must keep ``budget``."""
    judges = judging_costs(costs, mode, candidates[0][1].num_stages)
    spans: list[list[tuple[float, float]]] = []  # per candidate, per judge: (makespan, span)
    for label, plan in candidates:
        row = []
        for judge in judges:
            try:
                r = simulate_timing(plan, judge, memory_limit=budget)
            except PlanError as exc:  # a bug in a generator, not the user's fault
                raise RuntimeError(
                    f"plan_dualpipev built an invalid plan ({label}): {exc}"
                ) from exc
            row.append((round(r.makespan, 9), round(r.longest_span, 9)))
        spans.append(row)
    best_each = [min(row[j][0] for row in spans) for j in range(len(judges))]

    def key(i: int) -> tuple[float, ...]:
        pairs = -len(candidates[i][1].pairs)
        if mode == "most":
            return (pairs, *spans[i][0], i)
        if mode == "paying":
            return (*spans[i][0], pairs, i)
        worst = max(spans[i][j][0] / best_each[j] for j in range(len(judges)))
        return (round(worst, 9), pairs, *spans[i][0], i)

    allowed = [i for i in range(len(candidates)) if spans[i][0][0] <= ceiling + 1e-9]
    return candidates[min(allowed or range(len(candidates)), key=key)]
