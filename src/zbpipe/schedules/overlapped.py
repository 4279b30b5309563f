"""ScheduleDualPipeV: DeepSeek's DualPipeV with zbpipe's split backward and pairs that overlap.

The plan is :func:`zbpipe.planning.v.dualpipev.plan_dualpipev`; the pairs run through
:mod:`zbpipe.schedules.pairs` at the model's communication points
(:mod:`zbpipe.schedules.comm_points`). This module says which plan to build, and says so in
the log when a plan keeps fewer pairs than the DualPipeV order has, or when the pairs cannot
overlap: a user who chose this schedule for its overlap learns why not and what to change.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

from ..planning import Costs, Plan
from ..planning.budget import budget_option, format_bytes, is_budget_string
from ..planning.v.dualpipev import PairsMode, skeleton_budget
from .classes import resolve_budget
from .comm_points import CommPoint, find_points
from .runtime import PlannedSchedule

logger = logging.getLogger(__name__)


class ScheduleDualPipeV(PlannedSchedule):
    """DualPipeV (DeepSeek) with overlapped F-and-B pairs that really overlap, a B-only
    backward in each pair and the weight passes W in the remaining bubbles.

    V placement, two stages per rank like :class:`~zbpipe.ScheduleZBV`; the plan is
    :func:`zbpipe.planning.v.dualpipev.plan_dualpipev` (``memory`` as ZB-V's modes; ``"zb"``
    holds 1F1B's peak and one chunk microbatch). In each pair the forward of one chunk and the
    input-gradient pass of the other interleave at the model's communication points, so each
    half's collective (an MoE layer's expert all-to-all) is in flight while the other half
    computes (:mod:`zbpipe.schedules.pairs`).

    ``comm_points``: ``"auto"`` finds torchtitan's MoE token dispatchers in the stages; or a
    list of :class:`~zbpipe.schedules.comm_points.CommPoint` (docs/use/dualpipev.md).
    ``overlap=False`` runs each pair's halves in turn (the same plan, what torch's
    ``ScheduleDualPipeV`` does). Where points are found or declared, ``split="auto"`` takes
    the deferred engine: only it runs a B in segments between them.

    ``pairs`` (:mod:`zbpipe.planning.v.pair_choice`): ``"auto"`` keeps the pairs that pay once
    ``costs="profile"`` has measured what the collectives cost (``Costs.a2a``; or ``costs``
    give it); before, not knowing, the plan nearest the best both with free collectives and
    with collectives as long as the compute. ``"most"`` keeps as many as the memory budget
    allows, ``"paying"`` only those that pay. A plan with fewer pairs than the DualPipeV order
    says why in the log (and, where memory took them, the ``memory_limit`` that keeps them).
    Its name in the schedule tables is ``"ZBDualPipeV"``, so torch's ``"DualPipeV"`` stays
    torch's.
    """

    plan_name = "ZBDualPipeV"
    layout = "v"
    stages_per_rank = 2

    def __init__(
        self,
        *args: Any,
        memory: Literal["zb", "half", "min"] = "zb",
        overlap: bool = True,
        comm_points: str | Sequence[CommPoint] = "auto",
        pairs: PairsMode = "auto",
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        if memory not in ("zb", "half", "min"):
            raise ValueError(f"{name}: memory must be 'zb', 'half' or 'min', got {memory!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"{name}: overlap must be True or False, got {overlap!r}")
        if isinstance(comm_points, str) and comm_points != "auto":
            raise ValueError(f"{name}: comm_points must be 'auto' or a list of CommPoint")
        if not isinstance(comm_points, str) and not all(
            isinstance(p, CommPoint) for p in comm_points
        ):
            raise ValueError(f"{name}: comm_points must be 'auto' or a list of CommPoint")
        if pairs not in ("auto", "most", "paying"):
            raise ValueError(f"{name}: pairs must be 'auto', 'most' or 'paying', got {pairs!r}")
        self.memory = memory
        self.pairs = pairs
        #: a byte ``memory_limit`` ("40GiB": what the name "ZBDualPipeV:40GiB" fixes), planned in
        #: the units the first step measures; None: the mode's budget or a number of units
        self.byte_budget: float | None = None
        limit = kwargs.get("memory_limit")
        if isinstance(limit, str):
            if not is_budget_string(limit):
                raise ValueError(
                    f"{name}: memory_limit must be bytes like '40GiB', a share of the CUDA "
                    f"device like '80%', or a number of memory units, got {limit!r}"
                )
            if kwargs.get("measure_memory", True) is False:
                raise ValueError(
                    f"{name}: memory_limit={limit!r} is a byte budget, which needs the first "
                    "step's measurement: drop measure_memory=False"
                )
            self.byte_budget = resolve_budget(type(self), kwargs.pop("memory_limit"), args, kwargs)
        found = comm_points == "auto"
        stages = args[0] if args else kwargs.get("stages", ())
        mods = [st.submod for st in (stages if isinstance(stages, (list, tuple)) else [stages])]
        points = find_points(mods) if found else list(comm_points)
        if overlap and points and kwargs.get("split", "auto") == "auto":
            # Only the deferred engine runs a B in segments between the points; the graph
            # engine (which split="auto" picks where most weights are outside nn.Linear, as an
            # MoE's grouped experts are) would run every pair's halves in turn.
            kwargs["split"] = "deferred"
        super().__init__(*args, **kwargs)
        self.overlap = overlap
        self._pairs.enable(points, overlap=overlap)  # type: ignore[arg-type]
        if overlap and self.rank == 0:
            self._report_no_overlap(points, found)
        self._report_pairs(self.plan)

    def _report_no_overlap(self, points: Sequence[CommPoint], found: bool) -> None:
        """Say (rank 0) where pairs were asked to overlap and cannot: no points (INFO: a model
        without collectives in its stages, a PP-only one, has nothing to hide, so nothing is
        wrong), or an engine that runs B whole (WARNING: points the user has go unused)."""
        name = type(self).__name__
        if not points:
            where = "comm_points='auto' found no communication point (torchtitan's MoE token "
            where += "dispatchers) in the stages" if found else "comm_points is empty"
            logger.info(
                "zbpipe: %s: %s, so each pair runs its halves in turn (as torch's "
                "ScheduleDualPipeV does): nothing to hide in a model without collectives in its "
                "stages; a model with some declares them with comm_points=[CommPoint(...)] "
                "(docs/use/dualpipev.md)",
                name,
                where,
            )
        elif not self.overlaps:
            logger.warning(
                "zbpipe: %s: the %s engine runs each B whole, so each pair runs its halves in "
                "turn and no collective is hidden; split='deferred' (the default here) "
                "interleaves them",
                name,
                self.split,
            )

    @property
    def overlaps(self) -> bool:
        """Whether the pairs interleave their halves (points found or declared, ``overlap=True``
        and an engine whose B runs in segments)."""
        return self._pairs.overlaps

    def restore_points(self) -> None:
        """Give the communication points' methods back to the model (the next step puts them
        in again)."""
        self._pairs.restore()

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        # Once costs="profile" has measured the collectives (Costs.a2a), pairs are kept only
        # where they pay; before, as many as memory allows (pairs="auto").
        profiler = getattr(self, "_profiler", None)
        pairs = "paying" if self.pairs == "auto" and profiler and profiler.done else self.pairs
        unit = getattr(self, "memory_unit_bytes", None)
        if self.byte_budget is not None and unit:  # before the bytes are known: the mode's
            options = {**options, "memory_limit": self.byte_budget / unit}
        return super().build_plan(
            num_ranks, n_microbatches, costs, memory=self.memory, pairs=pairs, **options
        )

    def replan(self, new_plan: Plan) -> None:
        super().replan(new_plan)
        self._report_pairs(new_plan)

    def _report_pairs(self, plan: Plan) -> None:
        """Log (rank 0) a plan that keeps fewer pairs than the DualPipeV order has: why, and
        what would keep them."""
        if self.rank != 0:
            return
        costs = self.measured_costs or self.memory_costs or self.costs
        level, text = pairs_report(plan, costs, self.memory_unit_bytes, self.entry_name)
        if text:
            logger.log(level, "zbpipe: %s %s", type(self).__name__, text)


def pairs_report(
    plan: Plan, costs: Costs, unit_bytes: float | None, entry: str | None = None
) -> tuple[int, str]:
    """``(log level, text)`` for a DualPipeV plan with fewer pairs than its order has (text
    empty where it keeps them all): a WARNING where ``n_microbatches`` or the ``"zb"`` budget
    took them (with the budget that keeps them: ``costs`` are those the plan was made for,
    ``unit_bytes`` the bytes of their memory unit, if measured); an INFO where a smaller memory
    mode was asked for, or where the others would make the step longer. ``entry``: the schedule
    name it was built from (torchtitan's config), if any: the budget that keeps every pair is
    then advised as that name with a byte budget (``"ZBDualPipeV:6.83MiB"``), which a config
    can carry, not as a constructor argument it cannot."""
    meta, p, m = plan.meta, plan.num_ranks, plan.n_microbatches
    have, whole = len(plan.pairs), int(meta.get("skeleton_pairs", 0))  # type: ignore[call-overload]
    if m < 2 * p:
        return logging.WARNING, (
            f"runs ZB-V's order with {have} overlapped pairs per step: the DualPipeV order "
            f"needs n_microbatches >= 2 * {p} (got {m}); use at least {2 * p} microbatches "
            "for its pairs"
        )
    if have >= whole:
        return logging.DEBUG, ""
    if meta.get("skeleton_fits"):
        why = {
            "paying": "with the collectives' measured or given cost (Costs.a2a)",
            "hedged": "whether the collectives are free or as long as the compute",
        }.get(str(meta.get("pairs_mode")), "")
        return logging.INFO, (
            f"keeps {have} of the DualPipeV order's {whole} pairs per step: the others would "
            f"make the step longer {why} (pairs='most' keeps as many as memory allows)"
        )
    budget = float(meta["memory_budget"])  # type: ignore[arg-type]
    need = skeleton_budget(p, m, costs)
    mode = meta.get("memory")
    text = (
        f"runs {have} of the DualPipeV order's {whole} overlapped pairs per step: the order "
        f"does not fit its memory budget ({_amount(budget, unit_bytes)} per rank, "
        f"memory={mode!r}{', in measured bytes' if unit_bytes else ''}). All its pairs fit in "
        f"{_amount(need, unit_bytes)} per rank: " + _keep_pairs(need, unit_bytes, entry)
    )
    return (logging.WARNING if mode == "zb" else logging.INFO), text


def _keep_pairs(need: float, unit_bytes: float | None, entry: str | None) -> str:
    """What to pass for a budget of ``need`` units, in the entry point's form."""
    if entry is None:
        return f"pass memory_limit={need:.4g} (memory units" + (
            f"; one unit is {format_bytes(unit_bytes)}, an average chunk's microbatch)"
            if unit_bytes
            else ")"
        )
    if not unit_bytes:  # (a name carries bytes; until they are measured there are none)
        return (
            "the first step measures the bytes, and this line then names the schedule name "
            "that keeps them"
        )
    budget = budget_option(need * unit_bytes)
    kept = [o for o in entry.split(":") if not is_budget_string(o.strip())]
    return f"name the schedule {':'.join([*kept, budget])!r} (a byte budget per rank)"


def _amount(units: float, unit_bytes: float | None) -> str:
    return format_bytes(units * unit_bytes) if unit_bytes else f"{units:.4g} units"
