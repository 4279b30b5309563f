"""Building-block candidate orders for V-Half and V-Min (pure Python, no torch).

"Pipeline Parallelism with Controllable Memory" (Qi et al., NeurIPS 2024) builds a schedule by
repeating one *building block* (where, relative to the microbatch's start, each rank runs the F, B
and W of its two chunks) every ``T`` time units, ``T`` being a rank's work for one microbatch,
then squeezing the start and the end. The block's lifespan (F start to W end, summed over a
rank's two chunks) decides the peak memory, about ``lifespan / T`` microbatches; its length on
rank 0 (from the first F to the last W) is the bubble: about ``4p`` chunk units for V-Min's
tight block, ``2p / (3m)`` of ``6m``.

Here the block is found by modulo scheduling: the microbatch's passes are placed in chain order
(F down the V, then B back up, then each W after its B), each at the earliest time its inputs
have arrived at which its rank is free *modulo T* (so the block repeated every ``T`` never
overlaps itself on a rank). Sorting the repeated blocks by time gives each rank's order;
executing that order with the real costs, as soon as dependencies allow, is the squeeze
(warm-up forwards run back to back, the cool-down drains). The block is built with a few pass
lengths (the real ones, F = B = W, a small integer ratio near the real one), each with the
shortest period whose order fits the memory budget. Memory depends on the order alone, so the
budget is exact; the simulator checks it again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from ..core import Action, PlanError, make_plan, v_placement
from ..costs import Costs, StageCosts
from ..rules import EPS, peak_memory, within
from ..simulator import simulate_timing
from .timed_order import GreedyResult

_STRETCH_STEP = 0.05
_MAX_STRETCH_STEPS = 13  # periods up to 1.6x a rank's work per microbatch


def _place(
    busy: list[tuple[float, float]], period: float, ready: float, dur: float
) -> float | None:
    """Earliest start >= ``ready`` where ``[start, start + dur)`` misses every busy interval.

    Intervals are taken modulo ``period``.
    """
    starts = [ready] + [ready + ((s + d - ready) % period) for s, d in busy]
    for t in sorted(starts):
        a = t % period
        ok = True
        for s, d in busy:
            # two intervals on a circle of length period overlap iff one starts inside the other
            if (s - a) % period < dur - EPS or (a - s) % period < d - EPS:
                ok = False
                break
        if ok:
            return t
    return None


def block_offsets(
    num_ranks: int, stage_costs: list[StageCosts], period: float, w_last: bool, b_gap: float = 0.0
) -> dict[tuple[str, int], float] | None:
    """Start time of each pass of one microbatch (``(kind, stage) -> time``); None if it can't fit.

    ``w_last``: place every W after the whole B chain (the B chain, the critical path, gets first
    pick of the slots); otherwise each W right after its B (shortest lifespan, least memory).
    ``b_gap``: idle time before the last stage's B: a longer lifespan, so more microbatches in
    flight (more memory) to cover passes that run longer than the block assumed.
    """
    p = num_ranks
    n = 2 * p
    rank_of = [s if s < p else n - 1 - s for s in range(n)]
    busy: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    start: dict[tuple[str, int], float] = {}
    end: dict[tuple[str, int], float] = {}

    def put(kind: str, s: int, ready: float) -> bool:
        dur = stage_costs[s].time(kind)
        t = _place(busy[rank_of[s]], period, ready, dur)
        if t is None:
            return False
        busy[rank_of[s]].append((t % period, dur))
        start[(kind, s)], end[(kind, s)] = t, t + dur
        return True

    def arrive(kind: str, src: int, dst: int) -> float:
        return end[(kind, src)] + (0.0 if rank_of[src] == rank_of[dst] else stage_costs[src].comm)

    for s in range(n):
        if not put("F", s, 0.0 if s == 0 else arrive("F", s - 1, s)):
            return None
    for s in reversed(range(n)):
        ready = end[("F", s)] + (b_gap if s == n - 1 else 0.0)
        if s < n - 1:
            ready = max(ready, arrive("B", s + 1, s))
        if not put("B", s, ready):
            return None
        if not w_last and not put("W", s, end[("B", s)]):
            return None
    if w_last:
        for s in reversed(range(n)):
            if not put("W", s, end[("B", s)]):
                return None
    return start


def block_order(
    num_ranks: int, n_microbatches: int, offsets: dict[tuple[str, int], float], period: float
) -> dict[int, list[Action]]:
    """Each rank's order: the block repeated every ``period``, sorted by start time."""
    p = num_ranks
    timed: dict[int, list[tuple[float, Action]]] = {r: [] for r in range(p)}
    for (kind, s), t0 in offsets.items():
        r = s if s < p else 2 * p - 1 - s
        for j in range(n_microbatches):
            timed[r].append((t0 + j * period, Action(s, kind, j)))
    # ties cannot happen inside one rank (the block never overlaps itself modulo the period);
    # sorting on the action too keeps the order deterministic anyway
    return {
        r: [a for _, a in sorted(v, key=lambda x: (round(x[0], 9), x[1]))] for r, v in timed.items()
    }


def block_candidates(
    num_ranks: int, n_microbatches: int, costs: Costs, budget: float
) -> Iterator[tuple[str, GreedyResult]]:
    """``(label, GreedyResult)`` of every block variant that fits ``budget``, in a fixed order.

    The block is built with the real pass lengths and with small integer ratios (``_structures``);
    its order is always run with the real costs.
    """
    p, m = num_ranks, n_microbatches
    real = costs.per_stage(2 * p)
    for name, sc in _structures(real):
        work = max(sum(sc[s].f + sc[s].b + sc[s].w for s in (r, 2 * p - 1 - r)) for r in range(p))
        # A longer period trades throughput for memory (a block holds about lifespan / period
        # microbatches): take the shortest one whose order fits the budget. Memory depends on the
        # order alone, so it is checked before any timing, on just enough microbatches to reach
        # the steady state (the order repeats from there on, and so does its memory). W go after
        # the whole B chain (w_last): the critical path gets first pick of the slots.
        for k in range(_MAX_STRETCH_STEPS):
            period = work * (1.0 + _STRETCH_STEP * k)
            offsets = block_offsets(p, sc, period, w_last=True)
            if offsets is None:
                continue  # passes do not fit the period's gaps: try a longer one
            steady = min(m, int(max(offsets.values()) // period) + 3)
            if within(_peak(block_order(p, steady, offsets, period), real), budget):
                break
        else:
            continue
        res = _run(p, m, block_order(p, m, offsets, period), costs, budget)
        if res is not None:
            yield f"block({name}, T={period:.4g})", res


def _structures(real: list[StageCosts]) -> list[tuple[str, list[StageCosts]]]:
    """Pass lengths to build the block with: the real costs, then small integer ratios.

    Unequal real lengths leave gaps modulo the period that no pass fits, so collisions push the
    chain later and later; integer lengths tile the period exactly. Equal lengths (the paper's
    F = B = W) always work; a ratio closer to the real one (comm folded into F and B, which it
    delays on the chain) keeps the block's timing close to the real run, e.g. 2:2:1 for
    f=1, b=1.2, w=0.6, comm=0.05.
    """
    n = len(real)
    mean = [sum(getattr(c, k) for c in real) / n for k in ("f", "b", "w", "comm")]
    lengths = (mean[0] + mean[3], mean[1] + mean[3], mean[2])
    out = [("real", real)]
    seen = {(1, 1, 1)}
    out.append(("1:1:1", _with_lengths(real, (1, 1, 1))))
    positive = [x for x in lengths if x > 0]  # (a W measured as 0: no weight GEMM to defer)
    for div in (1, 2) if positive else ():
        q = min(positive) / div
        ratio = tuple(max(1, round(x / q)) for x in lengths)
        g = math.gcd(*ratio)
        ratio = tuple(x // g for x in ratio)
        if ratio not in seen and max(ratio) <= 6:
            seen.add(ratio)
            out.append((":".join(map(str, ratio)), _with_lengths(real, ratio)))
    return [(name, sc) for i, (name, sc) in enumerate(out) if all(sc != o for _, o in out[:i])]


def _with_lengths(real: list[StageCosts], ratio: tuple[int, int, int]) -> list[StageCosts]:
    f, b, w = (float(x) for x in ratio)
    return [replace(c, f=f, b=b, w=w, comm=0.0) for c in real]


def _peak(order: dict[int, list[Action]], stage_costs: list[StageCosts]) -> float:
    """Highest activation memory of any rank running ``order``."""
    return max((peak_memory(acts, stage_costs) for acts in order.values()), default=0.0)


def _run(
    p: int, m: int, order: dict[int, list[Action]], costs: Costs, budget: float
) -> GreedyResult | None:
    """Execute a fixed order with the real costs (the squeeze); None if it exceeds ``budget``."""
    plan = make_plan("block", p, m, v_placement(p), order, layout="v")
    try:
        r = simulate_timing(plan, costs, memory_limit=budget)
    except PlanError:
        # over the memory budget (a block order never deadlocks: its timed block is a witness)
        return None
    return GreedyResult(
        order={q: tuple(v) for q, v in order.items()},
        makespan=r.makespan,
        longest_span=r.longest_span,
        peak_memory=dict(r.peak_memory),
    )
