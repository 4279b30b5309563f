"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 2 / Figure 3).

Every backward is split into B (input gradient, on the critical path) and W (weight gradient,
free to move). The F and B order is 1F1B's (``p - 1 - r`` warm-up forwards on rank ``r``); only
the W passes move, to fill the cool-down bubble.

**Paper shape**: on rank ``r`` the W of a microbatch runs ``r`` backward steps
after its B (rank 0 right after, the last rank ``p - 1`` steps later); the ``r`` last Ws drain
at the end. With unit costs and comm 0 the makespan is the paper's
``m (T_F + T_B + T_W) + (p - 1)(T_F + T_B - T_W)``. At most ``p`` microbatches (F done, W not)
are in flight on any rank: the maximum over ranks equals 1F1B's (rank 0 holds ``p`` there),
which is the paper's memory claim. Per rank it is *not* 1F1B's: 1F1B's last rank holds 1, and
no plan with that per-rank limit reaches the formula (the last rank's Ws would have to follow
its last B, so the B chain to rank 0 starts ``p - 1`` units later).

**Cost-aware form** (``exact=False``, the default): F and B keep 1F1B's order; each W is placed
by a greedy pass over the cost model, running a pending W when it fits in the idle time before
the next F/B is ready, or when the next F would exceed the memory limit. The result is compared
in the simulator with the paper shape and with "W right after B" (which is never slower than
1F1B), and the fastest is returned. Ties go to the paper shape.

**W order.** In every form each stage runs its Ws in increasing microbatch order (one stage
per rank, so any pending W costs the same and FIFO is free): weight gradients accumulate in
1F1B's order. ``exact=True`` makes that a checked promise: only candidates whose W order is the
microbatch order are considered, so gradients are bitwise identical to 1F1B's (the runtime test
asserts it) whatever forms are added later. Both settings pick among the same cost-aware
candidates, so neither is ever slower than 1F1B.
"""

from __future__ import annotations

from collections import defaultdict, deque

from ..core import Action, Plan, loop_placement, make_plan
from ..costs import Costs
from ..rules import EPS, check_sizes, first_overflow, makes, needs, within
from ..simulator import simulate_timing
from ..yardsticks import onef1b_rank_peaks
from .onef1b import onef1b_rank_order


def zbh1_rank_order(
    rank: int, num_ranks: int, n_microbatches: int, lag: int | None = None
) -> list[Action]:
    """The paper-shape order of one rank: 1F1B's F/B order, W of each B ``lag`` B-steps later."""
    lag = rank if lag is None else lag
    order: list[Action] = []
    w_next = 0
    # Phases 1-3, warm-up, steady state and cool-down: 1F1B's F/B order (onef1b_rank_order:
    # p - 1 - r forwards, then F-B pairs, then the last Bs). From the lag-th B on, each B is
    # followed by one W, the oldest whose B has run: on rank r a W trails its B by r B-steps
    # (the paper's Figure 3), which leaves r Ws for the drain.
    for a in onef1b_rank_order(rank, num_ranks, n_microbatches, backward="B"):
        order.append(a)
        if a.kind == "B" and a.microbatch >= lag:
            order.append(Action(rank, "W", w_next))
            w_next += 1
    # Phase 4, drain: the last ``lag`` Ws, after the last B, where 1F1B's cool-down would idle.
    order.extend(Action(rank, "W", i) for i in range(w_next, n_microbatches))
    return order


def plan_zbh1(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    exact: bool = False,
) -> Plan:
    """ZB-H1 for any ``n_microbatches >= 1`` (see the module docstring for ``exact``).

    ``memory_limit`` (per rank, memory units of ``costs``) defaults to 1F1B's maximum peak
    over ranks; it must be at least 1F1B's peak on each rank.
    """
    check_sizes(num_ranks, n_microbatches)
    costs = costs or Costs()
    costs.check(num_ranks)
    p, m = num_ranks, n_microbatches
    placement = loop_placement(p, p)
    need = onef1b_rank_peaks(p, m, costs)
    limit = max(need.values()) if memory_limit is None else memory_limit
    short = {r: v for r, v in need.items() if not within(v, limit)}
    if short:
        raise ValueError(
            f"plan_zbh1: memory_limit {limit:g} is below 1F1B's peak on ranks {sorted(short)} "
            f"({max(short.values()):g}); raise memory_limit or use fewer microbatches in flight"
        )
    paper = make_plan(
        "ZBH1", p, m, placement, {r: zbh1_rank_order(r, p, m) for r in range(p)}, form="paper"
    )
    candidates = [paper] if _peak_ok(paper, costs, limit) else []
    greedy = make_plan("ZBH1", p, m, placement, _greedy_orders(p, m, costs, limit), form="greedy")
    if _peak_ok(greedy, costs, limit):
        candidates.append(greedy)
    candidates.append(
        make_plan(
            "ZBH1",
            p,
            m,
            placement,
            {r: zbh1_rank_order(r, p, m, lag=0) for r in range(p)},
            form="w-after-b",
        )
    )
    if exact:  # every form keeps W in microbatch order today; exact makes that a checked promise
        candidates = [c for c in candidates if _w_in_microbatch_order(c)]
    spans = [simulate_timing(c, costs).makespan for c in candidates]
    best = min(range(len(candidates)), key=lambda i: (spans[i] - EPS * (i == 0), i))
    return candidates[best]


def _w_in_microbatch_order(plan: Plan) -> bool:
    """Does every stage run its W in increasing microbatch order (1F1B's accumulation order)?"""
    for acts in plan.order.values():
        ws = [a.microbatch for a in acts if a.kind == "W"]
        if ws != sorted(ws):
            return False
    return True


def _peak_ok(plan: Plan, costs: Costs, limit: float) -> bool:
    sc = costs.per_stage(plan.num_stages)
    return all(first_overflow(acts, sc, limit) is None for acts in plan.order.values())


def _greedy_orders(p: int, m: int, costs: Costs, limit: float) -> dict[int, list[Action]]:
    """Place each W by co-simulating all ranks (same timing rules as ``simulate``).

    A rank decides its next action only once the dependencies of its next F/B are timed, so
    the decision sees the exact idle gap. W runs if it fits in that gap (delays nothing) or if
    the next F (or a B that holds more than its F did) would overflow ``limit``.
    """
    sc = [costs.stage(s) for s in range(p)]
    skeleton = {r: onef1b_rank_order(r, p, m, backward="B") for r in range(p)}
    orders: dict[int, list[Action]] = {r: [] for r in range(p)}
    pending: dict[int, deque[int]] = {r: deque() for r in range(p)}
    pos = {r: 0 for r in range(p)}
    free = {r: 0.0 for r in range(p)}
    mem = {r: 0.0 for r in range(p)}
    ready: dict[tuple[int, str, int], float] = {}
    waiting: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    todo = list(range(p))

    def run(r: int, a: Action, start: float) -> None:
        free[r] = start + sc[r].time(a.kind)
        mem[r] += sc[r].mem(a.kind)
        orders[r].append(a)
        for key in makes(a):
            ready[key] = free[r]
            todo.extend(waiting.pop(key, ()))

    while todo:
        r = todo.pop()
        while pos[r] < len(skeleton[r]):
            a = skeleton[r][pos[r]]
            missing = [k for k in needs(a, p - 1) if k not in ready]
            if missing:
                waiting[missing[0]].append(r)
                break
            # Neighbouring stages sit on other ranks (one stage per rank), F on the same rank.
            t_ready = max(
                [free[r]]
                + [ready[k] + (sc[k[0]].comm if k[0] != r else 0.0) for k in needs(a, p - 1)]
            )
            # what the next F or B adds (a B adds when it holds more than its F did: the graph
            # engine's recorded gradients, checkpointing's recomputed inputs) must fit
            grow = sc[r].mem_f if a.kind == "F" else max(0.0, sc[r].mem_b)
            overflow = not within(mem[r] + grow, limit)
            if pending[r] and (overflow or t_ready - free[r] >= sc[r].w - EPS):
                run(r, Action(r, "W", pending[r].popleft()), free[r])
                continue
            run(r, a, t_ready)
            pos[r] += 1
            if a.kind == "B":
                pending[r].append(a.microbatch)
        if pos[r] == len(skeleton[r]):
            while pending[r]:
                run(r, Action(r, "W", pending[r].popleft()), free[r])
    return orders
