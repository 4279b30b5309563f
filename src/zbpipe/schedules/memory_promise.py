"""What a schedule's memory promise is in bytes, which plan keeps it fastest, and what it cost.

Both re-planners (:mod:`zbpipe.schedules.memory_replan` after the first step,
:mod:`zbpipe.schedules.replan` for ``costs="profile"``) and the schedule's construction ask here:

* :func:`first_step_plan`: the plan the steps before the bytes are measured run. Its bytes are
  assumed, not measured: a backward may hold far more after B than its F did (checkpointing
  recomputes a block's inputs in B; :data:`B_ASSUMED_PER_RANK`), so at most one W waits per
  rank. A one-stage-per-rank schedule whose promise is 1F1B's peak (ZB-H1, ZB-1p; ZB-2p twice
  it) runs ZB-H1's order planned for *every rank's own 1F1B count* of microbatches
  (``min(p - r, m)`` on rank ``r``, at most one W waiting): rank ``r`` then holds at most what
  1F1B's rank ``r`` holds, whatever each stage's bytes turn out to be (a heavy head stage
  included; tests/schedules/test_memory_promise.py draws them). A V schedule (ZB-V, V-Half,
  V-Min) has no such plan: its rank 0 holds the first and the last chunk together, so a heavy
  last chunk can take it over 1F1B's peak however it is ordered; its first step measures the
  forward's bytes before it holds more than one microbatch (:mod:`zbpipe.schedules.
  measured_start`).
* :func:`promised_budget`: the budget the re-made plan was made for (the generator's own, or
  :func:`zbpipe.planning.yardsticks.promised_peak`).
* :func:`fastest_keeping`: among the re-made plan, the plan for equal bytes and the first step's
  plan, the fastest whose simulated peak keeps the budget, so a re-plan never makes a schedule
  slower than the plan for equal bytes where that plan already keeps the promise; on a tie the
  plan for equal bytes stays (the promise then changes nothing).
* :func:`promise_words`: the promise in words, for the engine choice's log line
  (:func:`zbpipe.engines.choose_engine`).
* :func:`cost_line`: what keeping the promise cost in simulated step time, and, when no plan
  within the budget beats 1F1B, a line saying so and what does (the chooser's candidates).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..planning import Costs, Plan, simulate
from ..planning.budget import budget_option, format_bytes
from ..planning.core import EPS
from ..planning.yardsticks import onef1b_peak, promised_peak

#: a plan's meta key naming the zero-bubble plan the plain order replaced
#: (:mod:`zbpipe.schedules.plain_order`)
INSTEAD_OF = "instead_of"

#: what the first steps' plan assumes B may hold beyond F, per unit its F holds, times ``p``:
#: more than any plan can afford twice, so at most one W waits per rank whatever B holds
B_ASSUMED_PER_RANK = 2.0


def first_step_plan(sched: Any) -> Plan | None:
    """The plan the steps before the bytes are measured run (the module docstring), or None
    where the schedule has none (it runs its plan for equal bytes)."""
    if not getattr(sched, "safe_first_step", False) or "memory_limit" in sched._plan_options:
        return None  # (a numeric limit is in the units of the costs given: kept as given)
    from ..planning.loop.zbh1 import plan_zbh1

    if sched.layout == "v":  # no order keeps it whatever each chunk holds: the first step
        return None  # measures the forward's bytes first (zbpipe.schedules.measured_start)
    p, m = sched.pp_group_size, sched._n_microbatches
    beta = B_ASSUMED_PER_RANK * p
    # Rank r's 1F1B holds k = min(p - r, m) forwards, one of them through its backward: k + beta
    # units of u_r = 1 / (k + beta) make every rank's yardstick 1, so ZB-H1's limit (the max over
    # ranks) is each rank's own. Its 1F1B skeleton keeps at most k forwards in flight; the limit
    # then allows one W to wait (beta > k - 2), and only with at most k - 1 forwards.
    held = [1.0 / (min(p - r, m) + beta) for r in range(p)]
    costs = dataclasses.replace(
        sched.costs,
        mem_f=held,
        mem_b=[beta * h for h in held],
        mem_w=[-(1 + beta) * h for h in held],
    )
    return plan_zbh1(p, m, costs, exact=sched.exact)


#: each promise in words, by plan name (lower case); the budgets: zbpipe.planning.yardsticks
_PROMISES = {
    "zbh1": "1F1B's peak",
    "zb1p": "1F1B's peak",
    "zb2p": "twice 1F1B's peak",
    "zbv": "1F1B's peak",
    "zbvhalf": "V-Half's (p + 2) / 2 microbatches",
    "zbvmin": "V-Min's (p + 4) / 3 microbatches",
    "zbinterleaved": "interleaved 1F1B's peak",
}


def promise_words(sched: Any, plan: Plan) -> str | None:
    """The memory promise of ``plan`` in words (``"1F1B's peak"``) where it splits the backward
    and :func:`promised_budget` knows a budget for it; else None. A plain order that replaced a
    zero-bubble plan keeps that plan's promise."""
    if not plan.uses_split_backward() and INSTEAD_OF not in plan.meta:
        return None  # (a plain order's re-plans may split it again)
    name = str(plan.meta.get(INSTEAD_OF) or plan.name)
    chunks = sched._num_stages // sched.pp_group_size
    costs = Costs()
    if promised_peak(name, sched.pp_group_size, sched._n_microbatches, costs, chunks) is None:
        return None
    return _PROMISES.get(name.strip().lower(), f"{name}'s memory budget")


def promised_budget(sched: Any, plan: Plan, costs: Costs) -> float | None:
    """The per-rank budget (memory units of ``costs``) ``plan`` was made for, if known."""
    for key in ("memory_limit", "memory_budget"):
        value = plan.meta.get(key)
        if isinstance(value, (int, float)):
            return float(value)
    choice = getattr(sched, "choice", None)
    if choice is not None and choice.best.plan is plan:
        return float(choice.memory_limit)
    chunks = sched._num_stages // sched.pp_group_size
    return promised_peak(plan.name, sched.pp_group_size, sched._n_microbatches, costs, chunks)


def fastest_keeping(
    candidates: list[Plan], costs: Costs, budget: float | None, prefer: Plan | None = None
) -> tuple[Plan, dict[int, float]]:
    """The first candidate is the re-made plan; a later one replaces it only if it is strictly
    faster under ``costs`` and its simulated peak is within ``budget`` on every rank, or if it is
    ``prefer`` (the plan for equal bytes: what ``measure_memory=False`` runs), keeps the budget
    and is no slower: a re-made order the simulator finds only as fast is no reason to leave
    the plan the promise did not need changed (issue 37). Returns the chosen plan and each
    candidate's simulated makespan (by position)."""
    sims = [simulate(c, costs) for c in candidates]  # (once each: the first step waits on it)
    spans = {i: sim.makespan for i, sim in enumerate(sims)}
    best = 0
    if budget is None:
        return candidates[0], spans
    keeps = {
        i: max(sim.peak_memory.values()) <= budget * (1 + 1e-9) + EPS for i, sim in enumerate(sims)
    }
    for i in range(1, len(candidates)):
        if keeps[i] and spans[i] < spans[best] * (1 - 1e-9):
            best = i
    for i, c in enumerate(candidates):
        if c is prefer and i != best and keeps[i] and spans[i] <= spans[best] * (1 + 1e-9):
            best = i
    return candidates[best], spans


def onef1b_makespan(sched: Any, costs: Costs) -> float:
    """1F1B's simulated step time on the same model (a V schedule's chunks joined in pairs)."""
    from ..planning import plan as build

    chunks = sched._num_stages // sched.pp_group_size
    joined = costs.joined(chunks) if chunks > 1 else costs
    return simulate(
        build("1F1B", sched.pp_group_size, sched._n_microbatches, joined), joined
    ).makespan


def cost_line(
    sched: Any,
    chosen: Plan,
    costs: Costs,
    equal_bytes: Plan,
    unit_bytes: float | None,
    spans: tuple[float, float] | None = None,
) -> tuple[str, bool]:
    """``(text, beats_1f1b)``: the chosen plan's simulated step time against the plan for equal
    bytes and 1F1B's, and, when it does not beat 1F1B, the faster plans the chooser offers.
    ``spans``: the two plans' simulated step times where the caller has them."""
    if spans is None:
        spans = simulate(chosen, costs).makespan, simulate(equal_bytes, costs).makespan
    t_new, t_equal = spans
    t_1f1b = onef1b_makespan(sched, costs)
    text = (
        f"; simulated step time {t_new / t_1f1b:.3f}x 1F1B's "
        f"({t_new / t_equal - 1:+.1%} against the plan for equal bytes per stage)"
    )
    beats = t_new < t_1f1b * (1 - 1e-9)
    instead = chosen.meta.get(INSTEAD_OF)
    if instead is not None:  # (zbpipe.schedules.plain_order: it said so, once)
        text += f"; the plain order {chosen.name} runs: no {instead} plan beats it"
    if not beats:
        name = instead if instead is not None else chosen.name
        text += f". No {name} plan within the promise beats 1F1B with these bytes" + offer_faster(
            sched,
            costs,
            unit_bytes,
            t_1f1b,
            leave_out=(instead,) if instead else _made_at_own(sched, chosen, costs),
        )
    return text, beats


def _made_at_own(sched: Any, chosen: Plan, costs: Costs) -> tuple[str, ...]:
    """``(chosen.name,)`` where ``chosen`` was made for its name's own budget, the one the
    chooser's candidate of that name is planned at (that candidate would be ``chosen`` again);
    else ``()``: made within a tighter budget (a byte or numeric ``memory_limit``), the same
    schedule at its own budget may be the nearest faster offer."""
    own = promised_peak(
        chosen.name, sched.pp_group_size, sched._n_microbatches, costs,
        sched._num_stages // sched.pp_group_size,
    )  # fmt: skip
    made = promised_budget(sched, chosen, costs)
    same = own is not None and made is not None and abs(made - own) <= 1e-9 * max(1.0, own)
    return (chosen.name,) if same else ()


def offer_faster(
    sched: Any,
    costs: Costs,
    unit_bytes: float | None,
    t_1f1b: float,
    leave_out: tuple[str, ...] = (),
) -> str:
    """The chooser's candidates of this placement that beat 1F1B, with the peak each needs.

    ``leave_out``: the schedule that was just found not to (its plan is not made again: on a
    V schedule of 4 ranks and 8 microbatches the chooser's three V plans take about 0.1 s of
    Python on rank 0, in the middle of the first step)."""
    from ..planning.search.within_budget import evaluate_candidates

    p, m = sched.pp_group_size, sched._n_microbatches
    v = sched.layout == "v"
    if not v and sched._num_stages > p:  # several loop stages per rank: the chooser has no
        return "; the chooser has no other schedule of this placement"  # candidate of its own
    cands = evaluate_candidates(
        p, m, float("inf"), None if v else costs, v_costs=costs if v else None,
        layouts=(sched.layout,), leave_out=leave_out,
    )  # fmt: skip
    chunks = sched._num_stages // p
    base = onef1b_peak(p, m, costs.joined(chunks) if chunks > 1 else costs)
    faster = [c for c in cands if c.plan is not None and c.makespan < t_1f1b * (1 - 1e-9)]
    if not faster:
        return "; nor does any other schedule of this placement"
    offers = ", ".join(
        f"{c.name} {c.makespan / t_1f1b:.3f}x its time at {c.peak / base:.2f}x its peak"
        + (f" ({format_bytes(c.peak * unit_bytes)})" if unit_bytes else "")
        for c in sorted(faster, key=lambda c: c.peak)
    )
    most = max(c.peak for c in faster) * unit_bytes if unit_bytes else None
    return f"; faster with more memory: {offers} ({budget_advice(sched, most)})"


def budget_advice(sched: Any, nbytes: float | None = None) -> str:
    """How to run the fastest plan within a byte budget, in the form the user's entry point
    takes: a schedule name option where the schedule was built from a name (torchtitan's
    ``pipeline_parallel_schedule``: :mod:`zbpipe.schedules.entry`), with ``nbytes`` as the
    example where known; else the chooser's call."""
    if getattr(sched, "entry_name", None):
        auto = "AutoV" if sched.layout == "v" else "Auto"
        example = budget_option(nbytes) if nbytes else "40GiB"
        return (
            f"the schedule name '{auto}:<bytes per rank>', e.g. '{auto}:{example}', runs the "
            "fastest within that budget"
        )
    return "zbpipe.choose_schedule(..., memory_limit=...) runs the fastest within a byte budget"
