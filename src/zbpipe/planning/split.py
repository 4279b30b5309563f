"""Which layers each stage holds: a split of the model made for the schedule that runs it.

torchtitan's default split gives every stage the same number of layers, counting the embedding
and the head (norm + output projection) as one layer each. That suits 1F1B on equal layers; it
does not suit a V schedule, whose rank 0 holds both ends of the model (stage 0 and stage
``2p - 1``), nor a head whose vocabulary projection costs several transformer layers.

:func:`choose_split` takes per-layer costs (:class:`LayerCost`, e.g. from
:func:`zbpipe.planning.layer_costs.layer_costs_from_config`), the number of ranks, a plan name
(:data:`zbpipe.planning.GENERATORS`) and the number of microbatches, and returns the contiguous
split whose plan is fastest in the simulator, within the memory the default split's plan was
promised. The default split is always a candidate, so the result is never slower than it in the
simulator. The search is deterministic (no hashing, no timing): every rank gets the same split.

``plan_for`` says which plan the schedule runs on the split: ``"equal"`` (a schedule without
``costs=``: its order is planned for equal stages and runs on the real ones) or ``"costs"``
(``costs="profile"``: re-planned for the measured stage costs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .affine_pieces import affine_pieces
from .core import EPS, Plan, PlanError
from .costs import Costs
from .registry import plan
from .simulator import simulate
from .yardsticks import promised_peak

PlanFor = Literal["equal", "costs"]


@dataclass(frozen=True)
class LayerCost:
    """One indivisible piece of the model, in model order: the modules it holds and the times
    and activation memory of one microbatch through it (any one unit for times, one for bytes)."""

    names: tuple[str, ...]
    """Module names (torchtitan's fully qualified names: ``("layers.3",)``, ``("norm",
    "lm_head")``) a stage holding this piece holds."""
    f: float
    """Forward time."""
    b: float
    """Input-gradient (B) time."""
    w: float
    """Weight-gradient (W) time."""
    mem: float
    """Activation memory one microbatch's forward leaves until its backward."""

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("LayerCost.names is empty: name the module(s) the piece holds")
        for field in ("f", "b", "w", "mem"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
                raise ValueError(f"LayerCost.{field} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class Split:
    """The chosen split and what the simulator said about it and about the baseline."""

    sizes: tuple[int, ...]
    """Pieces per stage, in stage order (they sum to the number of pieces)."""
    parts: tuple[tuple[str, ...], ...]
    """Module names per stage (torchtitan's ``module_fqns_per_model_part``)."""
    makespan: float
    """Simulated step time of the schedule's plan on this split (in the costs' time unit)."""
    baseline_sizes: tuple[int, ...]
    """The split compared against (torchtitan's default unless another was given)."""
    baseline_makespan: float
    """Simulated step time on the baseline split."""
    peak_memory: float
    """The plan's simulated peak activation memory on this split, max over ranks."""
    memory_limit: float
    """The most any candidate's plan could hold: the promise made for the baseline split (or
    the baseline plan's own peak when that is higher or the schedule promises none)."""

    scenario_gains: tuple[float, ...] = ()
    """Baseline step time over this split's in each cost scenario judged (the given layers
    first, then ``scenarios``, then the head scales of ``head_scales``); empty when
    :func:`choose_split` was given none."""
    head_scales: tuple[float, ...] = ()
    """The head scales judged (the points of ``head_scales``' range between which the
    baseline's step time is affine); empty without ``head_scales``."""

    @property
    def gain(self) -> float:
        """Baseline step time over this split's (1.0: no gain; 1.2: 20% more steps a second)."""
        return self.baseline_makespan / self.makespan if self.makespan > 0 else 1.0

    @property
    def worst_gain(self) -> float:
        """The least gain over the scenarios judged (:attr:`gain` when there were none)."""
        return min(self.scenario_gains, default=self.gain)


def even_sizes(num_pieces: int, num_stages: int) -> tuple[int, ...]:
    """The same number of pieces per stage, the first ``num_pieces % num_stages`` stages one
    more: torchtitan's default rule when the embedding and the head are one piece each."""
    if num_stages < 1 or num_pieces < num_stages:
        raise ValueError(
            f"cannot split {num_pieces} pieces into {num_stages} stages: every stage needs one"
        )
    q, extra = divmod(num_pieces, num_stages)
    return tuple(q + (1 if s < extra else 0) for s in range(num_stages))


def stage_costs(layers: Sequence[LayerCost], sizes: Sequence[int], comm: float = 0.0) -> Costs:
    """The per-stage ``Costs`` of ``layers`` cut into runs of ``sizes`` pieces."""
    f, b, w, mem = [], [], [], []
    start = 0
    for n in sizes:
        run = layers[start : start + n]
        start += n
        f.append(sum(x.f for x in run))
        b.append(sum(x.b for x in run))
        w.append(sum(x.w for x in run))
        mem.append(sum(x.mem for x in run))
    return Costs(f=f, b=b, w=w, comm=comm, mem_f=mem, mem_b=0.0, mem_w=[-m for m in mem])


def scale_head(layers: Sequence[LayerCost], scale: float) -> list[LayerCost]:
    """``layers`` with the last piece's (the head's) times multiplied by ``scale``, its memory
    kept: the head's cost is the least certain (memory-bound softmax and loss, none of it in
    FLOPs)."""
    *body, head = layers
    return [*body, replace(head, f=head.f * scale, b=head.b * scale, w=head.w * scale)]


def num_stages_of(schedule: str, num_ranks: int) -> int:
    """How many stages the plan ``schedule`` runs on ``num_ranks`` ranks (its generator says)."""
    return plan(schedule, num_ranks, max(2 * num_ranks, 2)).num_stages


@dataclass(frozen=True)
class _Judge:
    """Evaluates one split: the plan the schedule runs on it, simulated on its costs."""

    layers: Sequence[LayerCost]
    schedule: str
    num_ranks: int
    n_microbatches: int
    plan_for: PlanFor
    comm: float
    equal_plan: Plan | None

    def __call__(self, sizes: tuple[int, ...]) -> tuple[float, float, float] | None:
        """(makespan, peak memory, promised peak or the peak) for ``sizes``; None if the
        schedule cannot plan it."""
        costs = stage_costs(self.layers, sizes, self.comm)
        try:
            p = self.equal_plan or plan(
                self.schedule, self.num_ranks, self.n_microbatches, costs=costs
            )
            result = simulate(p, costs)
        except (ValueError, PlanError):
            return None
        peak = max(result.peak_memory.values(), default=0.0)
        per_rank = len(sizes) // self.num_ranks
        promise = promised_peak(
            self.schedule, self.num_ranks, self.n_microbatches, costs, stages_per_rank=per_rank
        )
        return result.makespan, peak, peak if promise is None else max(promise, peak)


def _minmax_sizes(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """The contiguous split minimizing the heaviest stage's weight (exact, O(n^2 k)); among
    equal maxima the one whose earlier stages are smallest (deterministic)."""
    n = len(weights)
    prefix = [0.0]
    for x in weights:
        prefix.append(prefix[-1] + x)
    inf = float("inf")
    # best[k][i]: the least max weight of the first i pieces in k stages; cut[k][i]: last start
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(i - 1, k - 2, -1):  # the last stage holds pieces j..i-1
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - EPS:
                    best[k][i], cut[k][i] = value, j
    sizes: list[int] = []
    i = n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return tuple(reversed(sizes))


def _neighbours(sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every split one piece away: one piece moved across one boundary, in a fixed order."""
    out = []
    for s in range(len(sizes) - 1):
        for delta in (1, -1):
            a, b = sizes[s] - delta, sizes[s + 1] + delta
            if a >= 1 and b >= 1:
                out.append(sizes[:s] + (a, b) + sizes[s + 2 :])
    return out


Key = tuple[float, float, tuple[int, ...]]


def _best_move(
    key: Callable[[tuple[int, ...]], Key | None], candidates: Sequence[tuple[int, ...]], now: Key
) -> tuple[Key, tuple[int, ...]] | None:
    """The candidate with the least (time, memory), then sizes; None unless strictly faster or
    as fast in less memory than ``now``."""
    moves = [(k, s) for s in candidates if (k := key(s)) is not None]
    step = min(moves, default=None)
    return None if step is None or step[0][:2] >= now[:2] else step


def choose_split(
    layers: Sequence[LayerCost],
    num_ranks: int,
    schedule: str,
    n_microbatches: int,
    *,
    baseline: Sequence[int] | None = None,
    plan_for: PlanFor = "equal",
    comm: float = 0.0,
    memory_limit: float | None = None,
    max_evals: int = 400,
    scenarios: Sequence[Sequence[LayerCost]] = (),
    head_scales: tuple[float, float] | None = None,
) -> Split:
    """The split of ``layers`` (in model order, embedding first, head last) into the stages of
    the plan ``schedule`` on ``num_ranks`` ranks with ``n_microbatches`` microbatches.

    ``baseline`` (pieces per stage; default :func:`even_sizes`, torchtitan's rule) is the split
    to beat; the result's simulated step time is never longer than the baseline's, and its plan's
    peak memory never above the baseline's promise (its peak if higher). ``comm`` is the time one
    activation takes between ranks, in the unit of the layers' times. ``max_evals`` bounds the
    number of splits simulated (each is one plan and one simulation per scenario).
    ``memory_limit`` (in the layers' ``mem`` unit) replaces the baseline's promise as the most a
    candidate's plan may hold; ``float("inf")`` lifts it.

    Robust to uncertain costs: ``scenarios`` (other cost lists of the same pieces) and
    ``head_scales=(lo, hi)`` (the head's times anywhere from ``lo`` to ``hi`` times the given
    ones, :func:`scale_head`) are judged beside ``layers``; the split chosen minimises the worst
    ratio of its step time to the baseline's over them, and is no slower than the baseline and
    within the limit in every one. With ``plan_for="equal"`` the head's range is judged exactly
    at the scales where the baseline's step time bends (:mod:`.affine_pieces`), so "no slower"
    holds for every scale in the range; with ``"costs"`` (re-planned per scale) those scales are
    a heuristic grid.

    Raises ``ValueError`` for too few pieces, a baseline of the wrong shape, a scenario not of
    the same pieces, a bad head range or a schedule the plan layer does not know.

    Long because the checks, the baseline's limits and the local search from several starts
    share one memo of simulated splits.
    """
    if num_ranks < 1 or n_microbatches < 1:
        raise ValueError(
            f"num_ranks and n_microbatches must be >= 1, got {num_ranks}, {n_microbatches}"
        )
    if plan_for not in ("equal", "costs"):
        raise ValueError(f"plan_for must be 'equal' or 'costs', got {plan_for!r}")
    pieces = list(layers)
    for other in scenarios:
        if [x.names for x in other] != [x.names for x in pieces]:
            raise ValueError("every scenario must list the same pieces as layers, in order")
    if head_scales is not None and not 0 < head_scales[0] <= head_scales[1] < float("inf"):
        raise ValueError(f"head_scales must be (lo, hi) with 0 < lo <= hi, got {head_scales}")
    num_stages = num_stages_of(schedule, num_ranks)
    base = tuple(baseline) if baseline is not None else even_sizes(len(pieces), num_stages)
    if len(base) != num_stages or sum(base) != len(pieces) or min(base, default=0) < 1:
        raise ValueError(
            f"baseline {list(base)} must give each of the {num_stages} stages of {schedule} on "
            f"{num_ranks} ranks at least one of the {len(pieces)} pieces, all of them in all"
        )
    equal = plan(schedule, num_ranks, n_microbatches) if plan_for == "equal" else None

    def judge_of(costs: Sequence[LayerCost]) -> _Judge:
        return _Judge(costs, schedule, num_ranks, n_microbatches, plan_for, comm, equal)

    judges = [judge_of(pieces)] + [judge_of(list(x)) for x in scenarios]
    if judges[0](base) is None:
        raise ValueError(f"{schedule} cannot plan the baseline split {list(base)}")
    scales: tuple[float, ...] = ()
    if head_scales is not None:
        lo, hi = head_scales

        def base_time_at(scale: float) -> float:
            result = judge_of(scale_head(pieces, scale))(base)
            return float("inf") if result is None else result[0]

        scales = affine_pieces(base_time_at, lo, hi)
        judges += [judge_of(scale_head(pieces, x)) for x in scales if x != 1.0]
    seen: dict[tuple[int, ...], list[tuple[float, float, float] | None]] = {}

    def score(sizes: tuple[int, ...]) -> list[tuple[float, float, float] | None]:
        if sizes not in seen:
            seen[sizes] = [judge(sizes) for judge in judges]
        return seen[sizes]

    base_scores = score(base)
    if any(x is None for x in base_scores):
        raise ValueError(f"{schedule} cannot plan the baseline split {list(base)} in a scenario")
    base_times = [x[0] for x in base_scores if x is not None]
    limits = [
        memory_limit if memory_limit is not None else x[2] for x in base_scores if x is not None
    ]
    robust = len(judges) > 1

    def key(sizes: tuple[int, ...]) -> Key | None:
        scores = score(sizes)
        if any(
            s is None or s[1] > limit + EPS * max(1.0, limit)
            for s, limit in zip(scores, limits, strict=True)
        ):
            return None
        times = [s[0] for s in scores if s is not None]
        peak = max(s[1] for s in scores if s is not None)
        if not robust:
            return (times[0], peak, sizes)
        ratio = max(t / b if b > 0 else 1.0 for t, b in zip(times, base_times, strict=True))
        return (ratio, peak, sizes)

    best = base
    best_key = key(base)
    assert best_key is not None  # the baseline is within its own limits
    starts = [base]
    for judge in judges:
        start = _minmax_sizes([x.f + x.b + x.w for x in judge.layers], num_stages)
        if start not in starts:
            starts.append(start)
    for start in starts:
        current, current_key = start, key(start)
        while current_key is not None and len(seen) < max_evals:
            step = _best_move(key, _neighbours(current), current_key)
            if step is None:  # no single move gains: try two at once (a piece through a stage)
                pairs = sorted({t for n in _neighbours(current) for t in _neighbours(n)})
                step = _best_move(key, [t for t in pairs if t != current], current_key)
            if step is None:
                break
            current_key, current = step
        no_slower = all(  # in every scenario: the worst ratio says so, this says it plainly
            s is not None and s[0] <= b * (1 + EPS)
            for s, b in zip(score(current), base_times, strict=True)
        )
        if current_key is not None and no_slower and current_key[:2] < best_key[:2]:
            best, best_key = current, current_key
    final = [s for s in score(best) if s is not None]
    assert len(final) == len(judges)  # best has a key: every scenario planned it
    times = [s[0] for s in final]
    peak = final[0][1]
    parts, start_at = [], 0
    for n in best:
        parts.append(tuple(name for x in pieces[start_at : start_at + n] for name in x.names))
        start_at += n
    return Split(
        sizes=best,
        parts=tuple(parts),
        makespan=times[0],
        baseline_sizes=base,
        baseline_makespan=base_times[0],
        peak_memory=peak,
        memory_limit=limits[0],
        scenario_gains=(
            tuple(b / t if t > 0 else 1.0 for t, b in zip(times, base_times, strict=True))
            if robust
            else ()
        ),
        head_scales=scales,
    )
