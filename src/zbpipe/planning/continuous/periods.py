"""Continuous (flush-free) plans: ``n_minibatches`` mini-batches of ``m`` microbatches back to back.

A flushed schedule pays its warm-up and drain at every optimizer step. A continuous plan runs
N mini-batches in one plan over ``N * m`` microbatches (global index ``k * m + j`` for
microbatch ``j`` of mini-batch ``k``), one stage per rank, and pays them once. Each rank's order
is a finite **warm-up**, ``N - 1`` copies of a **period** (one mini-batch boundary in steady
state, microbatch indices shifted by ``m`` each time) and a **drain** (:class:`ContinuousParts`).

Three semantics of the optimizer step (``mode``):

* ``"sync"``: exactly synchronous training. Stage ``s`` steps its optimizer for mini-batch ``k``
  as soon as its own W passes of ``k`` are done, and its first F of ``k + 1`` waits only for that
  step. Structural rule: in each rank's order every ``W(s, .)`` of ``k`` precedes every
  ``F(s, .)`` of ``k + 1``, so a rank's order is the concatenation of one-mini-batch orders
  ``S_r`` (the same for every mini-batch). Other ranks run ahead freely: stage ``s`` runs the
  next mini-batch's forwards while stage ``s - 1`` is still draining, and a zero-bubble ``S``
  (ZB-H2 shape: every rank busy from its first F to its last W) makes the boundary free. ``S``
  is picked among the automatic heuristic's candidates (``auto.list_schedule``, plus the ZB-H2
  warm-up caps, ZB-H1 and 1F1B with W right after B) by the simulated makespan of 4 joined
  mini-batches under the memory limit (default ZB-2p's, twice 1F1B's peak; at least 1F1B's).
  Candidates with a larger single-mini-batch makespan or rank span than "1F1B with W after B"
  are dropped, which bounds any N: ``makespan(N) <= (N - 1) * span(S) + makespan(S) <=
  N * makespan(1F1B)`` (shift mini-batch ``k`` by ``k * span(S)``: that timing is feasible, and
  the simulator's as-soon-as-possible timing of the same orders is never later).
* ``"2bw"``: PipeDream-2BW. Mini-batch ``k`` runs on weight version ``max(k - 1, 0)`` (version
  ``v`` = the weights after ``v`` updates), and update ``k`` (after ``k``'s last W on the stage)
  makes ``W(k + 1) = W(k) - step(grad at W(k - 1))``. So ``F`` of ``k + 2`` waits for the
  update of ``k`` and at most 2 versions live per stage.
* ``"stash"``: PipeDream weight stashing. A microbatch's backward on a stage uses the weights
  its forward used (the version current at its F): at most ``p - s`` versions on stage ``s``.

A stale order is a stream (:mod:`zbpipe.planning.continuous.stale_orders`: 1F1B over all ``N * m``
microbatches, ``w_r = min(m, d * (p - 1 - r))`` forwards ahead (stash: ``d = 1``), W after each B
or at the end of the mini-batch) or any sync order (valid in both modes); the makespan of 4
joined mini-batches picks, ties going to the order that loses least when messages arrive late.
Candidates that break the memory limit or their mode's version bound are dropped. The warm-up
is capped at ``m`` forwards: the parts must not depend on N, and 2BW needs it for its version
rule (with ``m < p - 1 - r`` the cap costs a bubble per microbatch on rank ``r``).

``check_continuous`` re-derives these rules from the order alone (the simulator does not know
about mini-batches) and ``plan_continuous`` calls it. ``meta["step_after"][rank][k]`` is the
index in the rank's order of the action after which mini-batch ``k``'s optimizer step runs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..core import Action, Plan, PlanError, loop_placement, make_plan
from ..costs import Costs, StageCosts
from ..loop.heuristic import STRATEGIES, AutoStrategy, list_schedule
from ..loop.zbh1 import zbh1_rank_order
from ..rules import EPS, check_sizes, fits
from ..simulator import simulate_timing
from ..yardsticks import onef1b_peak
from .stale_orders import WARMUP_FACTORS, stream_candidates, with_late_messages

log = logging.getLogger(__name__)

Mode = Literal["sync", "2bw", "stash"]
MODES: tuple[str, ...] = ("sync", "2bw", "stash")
_PROBE = 4  # mini-batches joined to compare candidate periods (warm-up and drain paid once)

Orders = dict[int, tuple[Action, ...]]


def _shift(actions: Sequence[Action], offset: int) -> list[Action]:
    return [Action(a.stage, a.kind, a.microbatch + offset) for a in actions]


@dataclass(frozen=True)
class ContinuousParts:
    """Per rank: the warm-up, the repeating period and the drain (of mini-batches 0 and 1)."""

    warmup: Orders
    """Runs once; microbatch indices of mini-batch 0 (``0..m-1``)."""
    period: Orders
    """Joined ``N - 1`` times, copy ``k`` shifted by ``k * m``; indices in ``0..2m-1``."""
    drain: Orders
    """Runs once, shifted by ``(N - 1) * m``; indices in ``0..m-1``."""
    minibatch_size: int
    mode: str
    memory_limit: float
    source: str

    def join(self, n_minibatches: int) -> dict[int, list[Action]]:
        """Each rank's order for ``n_minibatches`` mini-batches: warm-up, N - 1 periods, drain."""
        if n_minibatches < 1:
            raise ValueError(f"n_minibatches must be >= 1, got {n_minibatches}")
        m = self.minibatch_size
        orders = {}
        for r in self.warmup:
            order = list(self.warmup[r])
            for k in range(n_minibatches - 1):
                order += _shift(self.period[r], k * m)
            orders[r] = order + _shift(self.drain[r], (n_minibatches - 1) * m)
        return orders


def _split_segment(
    segment: Mapping[int, Sequence[Action]], m: int
) -> tuple[Orders, Orders, Orders]:
    """Parts of the sync plan from a one-mini-batch order: head = F before the first B."""
    warmup, period, drain = {}, {}, {}
    for r, acts in segment.items():
        acts = list(acts)
        h = next((i for i, a in enumerate(acts) if a.kind != "F"), len(acts))
        warmup[r] = tuple(acts[:h])
        drain[r] = tuple(acts[h:])
        period[r] = tuple(acts[h:] + _shift(acts[:h], m))
    return warmup, period, drain


def _sync_segments(
    p: int, m: int, sc: list[StageCosts], limit: float
) -> list[tuple[str, dict[int, list[Action]]]]:
    """Candidate one-mini-batch orders: the heuristic's, ZB-H2's warm-up caps, ZB-H1, W-after-B."""
    cands: list[tuple[str, dict[int, list[Action]]]] = [
        ("w-after-b", {r: zbh1_rank_order(r, p, m, lag=0) for r in range(p)}),
        ("zbh1", {r: zbh1_rank_order(r, p, m) for r in range(p)}),
    ]
    caps = tuple(2 * (p - r) - 1 for r in range(p))
    strategies = list(STRATEGIES) + [
        AutoStrategy(max_inflight=caps),
        AutoStrategy(max_inflight=caps, keep_ahead=False),
    ]
    for i, strategy in enumerate(strategies):
        res = list_schedule(p, m, sc, limit, strategy)
        if res is not None:
            cands.append((f"heuristic{i}", res.orders))
    return [(name, o) for name, o in cands if fits(o, sc, limit)]


def _stale_order_ok(
    parts: tuple[Orders, Orders, Orders], m: int, mode: str, sc: list[StageCosts], limit: float
) -> bool:
    """Does a stale candidate fit the memory limit and keep its mode's version rules?"""
    p = len(parts[0])
    joined = ContinuousParts(*parts, m, mode, limit, "").join(3)
    try:
        check_continuous(
            make_plan("", p, 3 * m, loop_placement(p, p), joined, minibatch_size=m, mode=mode)
        )
    except PlanError:
        return False
    return fits(joined, sc, limit)


def continuous_parts(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    mode: Mode = "sync",
) -> ContinuousParts:
    """The warm-up, period and drain of the continuous plan (``n_microbatches`` per mini-batch).

    Deterministic and independent of the number of mini-batches: ``plan_continuous`` only joins.

    Long because warm-up, period and drain are built and checked together, from one simulated
    order.
    """
    p, m = num_ranks, n_microbatches
    check_sizes(p, m)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    costs = costs or Costs()
    sc = costs.per_stage(p)
    base = onef1b_peak(p, m, costs)
    limit = 2 * base if memory_limit is None else float(memory_limit)
    if limit < base - EPS:
        raise ValueError(
            f"Continuous: memory_limit {limit:g} is below 1F1B's peak {base:g}; a continuous plan "
            f"needs at least that much. Raise memory_limit to {base:g} or more"
        )
    placement = loop_placement(p, p)

    def probe(parts: tuple[Orders, Orders, Orders], c: Costs = costs) -> float:
        cp = ContinuousParts(*parts, minibatch_size=m, mode=mode, memory_limit=limit, source="")
        joined = cp.join(_PROBE)
        return simulate_timing(make_plan("probe", p, _PROBE * m, placement, joined), c).makespan

    if mode == "sync":
        ref = None
        scored = []
        for i, (name, seg) in enumerate(_sync_segments(p, m, sc, limit)):
            r = simulate_timing(make_plan("segment", p, m, placement, seg), costs)
            span = r.longest_span
            if ref is None:  # w-after-b comes first: the bound every candidate must meet
                ref = (span, r.makespan)
            elif span > ref[0] + EPS or r.makespan > ref[1] + EPS:
                continue
            parts = _split_segment(seg, m)
            scored.append((round(probe(parts), 9), i, name, parts))
    else:
        factors = WARMUP_FACTORS if mode == "2bw" else (1.0,)  # stash: PipeDream's staleness
        cands = stream_candidates(p, m, factors) + [
            (f"sync-{name}", _split_segment(seg, m))
            for name, seg in _sync_segments(p, m, sc, limit)
        ]
        scored = [
            (round(probe(parts), 9), i, name, parts)
            for i, (name, parts) in enumerate(cands)
            if _stale_order_ok(parts, m, mode, sc, limit)
        ]
        if scored:  # ties (common at comm = 0) go to the order that loses least to late messages
            tied = [c for c in scored if c[0] <= min(c[0] for c in scored) + EPS]
            if mode == "stash" and any(not c[2].startswith("sync") for c in tied):
                tied = [c for c in tied if not c[2].startswith("sync")]  # on ties, a stream
            slack = with_late_messages(costs, sc)
            scored = [(round(probe(c[3], slack), 9), *c[1:]) for c in tied]
    if not scored:
        raise ValueError(
            f"Continuous ({mode}): no plan fits memory_limit {limit:g}; raise it "
            f"(1F1B's peak is {base:g})"
        )
    best = min(scored, key=lambda c: (c[0], c[1]))
    log.debug(
        "Continuous %s p=%d m=%d limit=%g: %s, probe makespan %g (stale: with late messages)",
        mode,
        p,
        m,
        limit,
        best[2],
        best[0],
    )
    return ContinuousParts(
        *best[3], minibatch_size=m, mode=mode, memory_limit=limit, source=best[2]
    )


def plan_continuous(
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    n_minibatches: int = 2,
    mode: Mode = "sync",
) -> Plan:
    """The continuous plan: ``n_minibatches`` mini-batches of ``n_microbatches`` each, no flush.

    The plan's ``n_microbatches`` is ``n_minibatches * n_microbatches`` (global index
    ``k * m + j``). Raises ``ValueError`` for a bad argument or a ``memory_limit`` below 1F1B's.
    """
    if n_minibatches < 1:
        raise ValueError(f"n_minibatches must be >= 1, got {n_minibatches}")
    parts = continuous_parts(num_ranks, n_microbatches, costs, memory_limit, mode)
    orders = parts.join(n_minibatches)
    m, n = n_microbatches, n_minibatches
    plan = make_plan(
        "Continuous",
        num_ranks,
        n * m,
        loop_placement(num_ranks, num_ranks),
        orders,
        minibatch_size=m,
        n_minibatches=n,
        mode=mode,
        memory_limit=parts.memory_limit,
        source=parts.source,
        step_after=step_positions(orders, m, n),
    )
    simulate_timing(plan, costs, parts.memory_limit)  # deadlock and memory: raises PlanError
    check_continuous(plan)
    return plan


def step_positions(
    orders: Mapping[int, Sequence[Action]], m: int, n: int
) -> dict[int, tuple[int, ...]]:
    """Per rank, the index of the action after which mini-batch ``k``'s optimizer step runs.

    That is the last W (or BW) of ``k``, never before the step of ``k - 1`` (steps are in order).
    """
    out = {}
    for r, acts in orders.items():
        last = [-1] * n
        for i, a in enumerate(acts):
            if a.kind in ("W", "BW"):
                k = a.microbatch // m
                last[k] = max(last[k], i)
        for k in range(1, n):
            last[k] = max(last[k], last[k - 1])
        out[r] = tuple(last)
    return out


def version_bound(mode: str, num_stages: int, stage: int) -> int:
    """Documented maximum number of live weight versions on ``stage``."""
    return {"sync": 1, "2bw": 2, "stash": num_stages - stage}[mode]


def live_versions(plan: Plan) -> dict[int, int]:
    """Per stage, the maximum number of weight versions alive at once, replaying each rank's order.

    Live = the latest version (what the optimizer updates) plus the version each in-flight
    microbatch (F done, last backward pass not done) runs on. Raises ``PlanError`` if a forward
    needs a version the stage has not produced yet.
    """
    mode, m = str(plan.meta["mode"]), _meta_int(plan, "minibatch_size")
    n = plan.n_microbatches // m
    result = {}
    for rank, acts in plan.order.items():
        for s in plan.stages_of(rank):
            todo = [
                sum(
                    1
                    for a in acts
                    if a.stage == s and a.kind in ("W", "BW") and a.microbatch // m == k
                )
                for k in range(n)
            ]
            latest = 0  # updates applied so far on this stage
            uses: dict[int, int] = {}  # in-flight microbatch -> version
            worst = 1
            for step, a in enumerate(acts):
                if a.stage != s:
                    continue
                k = a.microbatch // m
                if a.kind == "F":
                    need = {"sync": k, "2bw": max(k - 1, 0), "stash": latest}[mode]
                    if need > latest:
                        raise PlanError(
                            f"plan {plan.name}: rank {rank} step {step} ({a}) runs mini-batch "
                            f"{k} on weight version {need} ({mode}), but only {latest} "
                            "optimizer steps of stage "
                            f"{s} are done; move the W passes of mini-batch {need - 1} before it"
                        )
                    uses[a.microbatch] = need
                elif a.kind in ("W", "BW"):
                    del uses[a.microbatch]
                    todo[k] -= 1
                    while latest < n and todo[latest] == 0:  # steps run in mini-batch order
                        latest += 1
                worst = max(worst, len(set(uses.values()) | {latest}))
            result[s] = worst
    return result


def _meta_int(plan: Plan, key: str) -> int:
    value = plan.meta[key]
    if not isinstance(value, int):
        raise PlanError(f"plan {plan.name}: meta[{key!r}] must be an int, got {value!r}")
    return value


def check_continuous(plan: Plan) -> None:
    """Validate the mini-batch rules the simulator does not know (raises ``PlanError``).

    sync: on each stage every W of mini-batch k precedes every F of k + 1. 2bw / stash: a
    forward never needs a version not yet produced, and live versions per stage stay within
    :func:`version_bound`.
    """
    for key in ("mode", "minibatch_size"):
        if key not in plan.meta:
            raise PlanError(f"plan {plan.name}: meta lacks {key!r}; build it with plan_continuous")
    mode, m = str(plan.meta["mode"]), _meta_int(plan, "minibatch_size")
    if mode not in MODES or plan.n_microbatches % m:
        raise PlanError(f"plan {plan.name}: mode {mode!r} / minibatch_size {m} do not fit the plan")
    if mode == "sync":
        for rank, acts in plan.order.items():
            last_w: dict[tuple[int, int], int] = {}
            for step, a in enumerate(acts):
                if a.kind in ("W", "BW"):
                    last_w[a.stage, a.microbatch // m] = step
            for step, a in enumerate(acts):
                k = a.microbatch // m
                if a.kind == "F" and k > 0 and last_w.get((a.stage, k - 1), -1) > step:
                    raise PlanError(
                        f"plan {plan.name}: rank {rank} step {step} ({a}) is an F of "
                        f"mini-batch {k} "
                        f"before the last W of mini-batch {k - 1} (step {last_w[a.stage, k - 1]}); "
                        "sync mode steps the optimizer in between"
                    )
    for s, count in live_versions(plan).items():
        bound = version_bound(mode, plan.num_stages, s)
        if count > bound:
            raise PlanError(
                f"plan {plan.name}: stage {s} keeps {count} weight versions alive, above the "
                f"{mode} bound {bound}; fewer microbatches in flight on rank "
                f"{plan.placement[s]} would fix it"
            )


__all__ = [
    "ContinuousParts",
    "MODES",
    "check_continuous",
    "continuous_parts",
    "live_versions",
    "plan_continuous",
    "step_positions",
    "version_bound",
]
