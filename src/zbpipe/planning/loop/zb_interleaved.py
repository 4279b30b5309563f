"""ZB-Interleaved: a zero-bubble plan for the loop placement with several stages per rank.

Interleaved 1F1B (:mod:`.interleaved`) cuts the pipeline's warm-up and cool-down bubbles by the
number of stages per rank ``v``, but it still runs each backward whole, so the cool-down's
gradient chain waits for every weight gradient on its way up. Here every backward is split into
B (input gradient, on the critical path) and W (weight gradient, free to move), and the W passes
are placed by the cost model, as ZB-H1 does for one stage per rank (Qi et al., ICLR 2024):

* **F/B skeleton.** Interleaved 1F1B's F/B order, with its warm-up of ``(v - 1) g + 2 (p - 1 -
  r)`` forwards on rank ``r`` (``g``: microbatches per round), or with one forward per hop
  instead of two (what torch's InterleavedZeroBubble runs: fewer microbatches in flight, and the
  first B sooner after the warm-up).
* **W placement** by co-simulating all ranks on the cost model (the simulator's timing rules): a
  rank that would idle before its next F/B is ready runs a pending W that fits in the gap (the
  oldest, or the longest that fits); a W also runs when the next F would take the rank above the
  memory limit, and the last ones drain after the last B. A second pass lets a W into a gap
  shorter than it.
* **Candidates**: each skeleton with each W placement, and each skeleton with every W right
  after its B. The fastest in the simulator within the memory limit wins, ties to the earlier
  (W right after B on interleaved 1F1B's skeleton comes first: on equal time, the plan whose
  backwards the runtime fuses).

**Promises.** Memory: at most ``memory_limit`` per rank, by default interleaved 1F1B's peak
(the max over ranks, each backward counted as its B with the W at once, as 1F1B's yardstick
counts it): no rank holds more than torch's Interleaved1F1B's busiest rank. Time: never slower
in the simulator than interleaved 1F1B with fused backwards, for the costs given (interleaved
1F1B's order with W right after B is a candidate, and it is never slower: the same per-rank
order, each input gradient sent earlier). Microbatch counts: those torch's Interleaved1F1B
takes (:func:`~.interleaved.round_size`); any multiple of ``p``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence

from ..core import Action, Plan, PlanError, loop_placement, make_plan
from ..costs import Costs, StageCosts
from ..rules import EPS, check_sizes, fits, makes, needs, within
from ..simulator import simulate_timing
from .interleaved import (
    check_stages_per_rank,
    interleaved_orders,
    interleaved_peak,
    round_size,
    with_w_after_b,
)

NAME = "ZBInterleaved"

#: the warm-up forwards per hop of the skeletons tried (interleaved 1F1B's first)
WARMUPS_PER_HOP: tuple[int, ...] = (2, 1)


def stages_per_rank_of(num_ranks: int, costs: Costs | None, stages_per_rank: int | None) -> int:
    """``stages_per_rank`` if given, else what per-stage ``costs`` say (their length over
    ``num_ranks``), else 2 (torchtitan's default for a multi-stage schedule)."""
    if stages_per_rank is not None:
        return check_stages_per_rank(stages_per_rank)
    n = costs.num_stages if costs is not None else None
    if n is None:
        return 2
    if n % num_ranks:
        raise ValueError(
            f"{NAME}: costs describe {n} stages, not a multiple of num_ranks {num_ranks}; give "
            f"stages_per_rank x {num_ranks} values"
        )
    return check_stages_per_rank(n // num_ranks)


def plan_zb_interleaved(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    stages_per_rank: int | None = None,
) -> Plan:
    """The zero-bubble plan for ``stages_per_rank`` stages per rank in loop placement (the
    module docstring). ``stages_per_rank`` defaults to what per-stage ``costs`` describe, else
    2. ``memory_limit`` (per rank, memory units of ``costs``) defaults to interleaved 1F1B's
    peak and may not be below it.

    Raises ``ValueError`` for a microbatch count interleaved 1F1B cannot take (the rounds of
    :func:`~.interleaved.round_size`: any multiple of ``num_ranks`` works) or a limit below
    interleaved 1F1B's peak.

    Long because the checks, the candidates of every skeleton and W placement, and the choice
    among them are one pass over the same sizes.
    """
    check_sizes(num_ranks, n_microbatches)
    p, m = num_ranks, n_microbatches
    v = stages_per_rank_of(p, costs, stages_per_rank)
    costs = costs or Costs()
    costs.check(p * v)
    round_size(p, m)  # the microbatch count's ValueError, before anything is built
    base = interleaved_peak(p, m, v, costs)
    limit = base if memory_limit is None else float(memory_limit)
    if not within(base, limit):
        raise ValueError(
            f"{NAME}: memory_limit {limit:g} is below interleaved 1F1B's peak {base:g}; raise "
            "it (or leave it unset) or use more microbatches per round"
        )
    placement = loop_placement(p, p * v)
    sc = costs.per_stage(p * v)
    candidates: list[tuple[str, dict[int, list[Action]]]] = []
    for per_hop in WARMUPS_PER_HOP:
        skeleton = interleaved_orders(p, m, v, backward="B", warmup_per_hop=per_hop)
        candidates.append(
            (f"w-after-b/{per_hop}", {r: with_w_after_b(a) for r, a in skeleton.items()})
        )
        for fill_small in (False, True):
            for pick in ("oldest", "longest"):
                orders = greedy_w_orders(skeleton, placement, sc, limit, fill_small, pick)
                label = f"greedy/{per_hop}/{pick}" + ("/small-gaps" if fill_small else "")
                candidates.append((label, orders))
    best: tuple[float, str, dict[int, list[Action]]] | None = None
    for label, orders in candidates:
        if not fits(orders, sc, limit):
            continue
        try:
            span = simulate_timing(make_plan(NAME, p, m, placement, orders), costs).makespan
        except PlanError:  # a skeleton the sizes make deadlock: the others remain
            continue
        if best is None or span < best[0] - EPS:
            best = (span, label, orders)
    assert best is not None, "interleaved 1F1B with W after B always fits its own peak"
    return make_plan(
        NAME,
        p,
        m,
        placement,
        best[2],
        memory_limit=limit,
        stages_per_rank=v,
        source=best[1],
    )


def greedy_w_orders(
    skeleton: Mapping[int, Sequence[Action]],
    placement: Mapping[int, int],
    sc: Sequence[StageCosts],
    limit: float,
    fill_small: bool = False,
    pick: str = "oldest",
) -> dict[int, list[Action]]:
    """Each rank's F/B ``skeleton`` with its W passes placed by co-simulating all ranks (the
    simulator's timing rules: sends do not block, a value from another rank arrives its stage's
    ``comm`` after it is made).

    A rank decides its next action only once the inputs of its next F/B are timed, so it sees
    the exact idle gap. A pending W runs if it fits in that gap (any gap with ``fill_small``),
    or if the next F (or a B that holds more than its F did) would take the rank over ``limit``.
    ``pick``: ``"oldest"`` pending W, or the ``"longest"`` that fits (the oldest of its stage,
    so each stage's Ws keep microbatch order).

    Long because the co-simulation's state (each rank's position, free time, memory, pending Ws
    and who waits for which value) is shared by the loop and its two helpers.
    """
    last = len(sc) - 1
    ranks = sorted(skeleton)
    orders: dict[int, list[Action]] = {r: [] for r in ranks}
    pending: dict[int, deque[Action]] = {r: deque() for r in ranks}
    pos = {r: 0 for r in ranks}
    free = {r: 0.0 for r in ranks}
    mem = {r: 0.0 for r in ranks}
    ready: dict[tuple[int, str, int], float] = {}
    waiting: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    todo = list(reversed(ranks))

    def run(r: int, a: Action, start: float) -> None:
        c = sc[a.stage]
        free[r] = start + c.time(a.kind)
        mem[r] += c.mem(a.kind)
        orders[r].append(a)
        for key in makes(a):
            ready[key] = free[r]
            todo.extend(waiting.pop(key, ()))

    def choose_w(r: int, gap: float, forced: bool) -> Action | None:
        queue = pending[r]
        if pick == "longest" and not forced:
            heads: dict[int, Action] = {}
            for w in queue:
                heads.setdefault(w.stage, w)  # each stage's oldest
            fitting = [w for w in heads.values() if sc[w.stage].w <= gap + EPS]
            if fitting:
                order = {w: i for i, w in enumerate(queue)}
                return max(fitting, key=lambda w: (sc[w.stage].w, -order[w]))
        head = queue[0]
        if forced or gap >= sc[head.stage].w - EPS or (fill_small and gap > EPS):
            return head
        return None

    while todo:
        r = todo.pop()
        acts = skeleton[r]
        while pos[r] < len(acts):
            a = acts[pos[r]]
            keys = needs(a, last)
            missing = [k for k in keys if k not in ready]
            if missing:
                waiting[missing[0]].append(r)
                break
            t_ready = max(
                [free[r]]
                + [ready[k] + (sc[k[0]].comm if placement[k[0]] != r else 0.0) for k in keys]
            )
            c = sc[a.stage]
            grow = c.mem_f if a.kind == "F" else max(0.0, c.mem_b)
            if pending[r]:
                forced = not within(mem[r] + grow, limit)
                w = choose_w(r, t_ready - free[r], forced)
                if w is not None:
                    pending[r] = deque(x for x in pending[r] if x != w)
                    run(r, w, free[r])
                    continue
            run(r, a, t_ready)
            pos[r] += 1
            if a.kind == "B":
                pending[r].append(Action(a.stage, "W", a.microbatch))
        if pos[r] == len(acts):
            while pending[r]:
                run(r, pending[r].popleft(), free[r])
    return orders
