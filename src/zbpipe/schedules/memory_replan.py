"""Memory promises by default: the first step measures bytes, the ranks agree, the plan is re-made.

Every plan's memory budget (1F1B's peak for ZB-H1, ZB-1p and ZB-V; the V-Half and V-Min
formulas; a ``memory_limit``) is a count of "memory units". Planned for one unit per
microbatch of any stage, a heavy stage (the LM head of a large vocabulary) holds as many
microbatches as a light one, and ZB-H1 on a 4096-token head held 1.42x torch 1F1B's peak. So,
unless ``measure_memory=False``, a planned schedule without ``costs="profile"``:

1. runs its first step with the plan for equal bytes per stage (or, for a byte budget, the
   one-microbatch-in-flight plan: the least memory any plan holds), while the memory probe
   (:mod:`zbpipe.memory.probe`) records what each of its stages' microbatches holds right after
   F and right after B;
2. exchanges the per-stage medians with one ``all_gather_object`` over the pipeline group, so
   every rank holds the same bytes (rounded to 3 significant digits);
3. re-makes the plan with the *time* costs it was given (equal by default: step times stay
   what they were) and the measured memory fields (every rank alike: :meth:`MemoryReplanner.
   _plan` says why no second exchange is needed);
4. logs one INFO line (rank 0): the predicted peak per rank and its ratio to 1F1B's.

A budget the measured bytes cannot meet (a byte ``memory_limit`` below one microbatch in flight)
raises ``ValueError`` on every rank at the end of that first step; a numeric one in units keeps
the plan of step 1 with a warning, as ``costs="profile"`` does. ``costs="profile"`` measures the
same bytes (and times) in its own profiled steps (:mod:`zbpipe.schedules.replan`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..memory.probe import MemoryProbe
from ..observe.profile import gather_stage_values, memory_costs
from ..planning import Costs, Plan, simulate
from ..planning.budget import format_bytes
from ..planning.rules import within
from ..planning.search.perturbed import equal_times
from ..planning.yardsticks import promised_peak
from .memory_promise import cost_line, fastest_keeping, promised_budget
from .plain_order import never_slower

logger = logging.getLogger(__name__)

#: significant digits the measured bytes are rounded to (so every rank plans the same)
DIGITS = 3


class MemoryReplanner:
    """Probes the first step that has a backward, then re-plans once for the measured bytes."""

    def __init__(self, probe: MemoryProbe | None = None) -> None:
        #: ``costs="profile"`` shares its probe: the bytes of this first step count there too
        self.probe = probe if probe is not None else MemoryProbe()
        self.done = False

    def before_step(self, sched: Any) -> None:
        """Call on every rank before each step: the probe watches the first one.

        Compiled stages too, in the step that compiles them: a compiled region's autograd node
        saves its tensors through the probe's saved-tensor hooks, what dynamo traces is not
        counted (the compiling step measures what later steps hold), and the hooks make dynamo
        compile nothing more (tests/observe/test_memory_replan_compiled.py).
        """
        if not self.done:
            sched.seam.probe = self.probe

    def after_step(self, sched: Any) -> None:
        """Call on every rank after a step with a backward: re-plans once (a collective)."""
        if not self.done:
            self.done = True
            sched.seam.probe = None
            self.replan(sched)
        if sched.lowered_for_probe:  # the probe's split pairs fused again (runtime._lower)
            sched.replan(sched.plan)

    def replan(self, sched: Any) -> None:
        """Re-plan for the bytes the probe measured (a collective), and run the plan chosen
        from the next step on."""
        chosen = self.choose(sched)
        if chosen.order != sched.plan.order or chosen.placement != sched.plan.placement:
            sched.replan(chosen)

    def choose(self, sched: Any) -> Plan:
        """The plan for the bytes the probe measured (one ``all_gather_object``); sets the
        schedule's ``memory_costs`` and ``memory_unit_bytes``. Logs on rank 0."""
        group = sched._stages[0].group
        mine = [st.stage_index for st in sched._stages]
        held = gather_stage_values(self.probe.medians(mine), group)
        measured = memory_costs(held, sched._num_stages, DIGITS)
        if measured is None:
            logger.debug(
                "zbpipe memory: %s: no bytes measured on some stage; the plan keeps one memory "
                "unit per microbatch",
                type(sched).__name__,
            )
            return sched.plan
        fields, unit_bytes = measured
        costs = dataclasses.replace(sched.costs, **fields)
        sched.memory_unit_bytes = unit_bytes
        if not getattr(sched, "memory_promise", True):  # the plan for equal bytes runs on
            sched.memory_costs = costs
            if sched.rank == 0 and logger.isEnabledFor(logging.INFO):
                line = predicted_memory_line(
                    sched, sched.equal_bytes_plan, costs, unit_bytes, held, kept=True
                )
                logger.info("%s", line)
            plan: Plan = sched.equal_bytes_plan
            return plan
        new = self._plan(sched, costs)
        if new is None:
            sched.memory_unit_bytes = None
            return sched.equal_bytes_plan  # (the first step's plan was for then)
        # Never slower than the plan for equal bytes (nor the first step's) where that plan
        # already keeps the promise in the measured bytes: the generators search, they do not
        # prove their result the fastest. On a tie the plan for equal bytes stays.
        others = [sched.equal_bytes_plan]
        if sched.plan.order != sched.equal_bytes_plan.order:
            others.append(sched.plan)
        others = [p for p in others if p.order != new.order]
        candidates = [new, *others]
        chosen, spans = fastest_keeping(
            candidates, costs, promised_budget(sched, new, costs), sched.equal_bytes_plan
        )
        sched.memory_costs = costs
        # INFO whatever it says: a plan that cannot beat 1F1B within the promise gave way to
        # the plain order where that is faster (zbpipe.schedules.plain_order), and the faster
        # schedules offered hold more than the one the user chose (issue 47: no warning about a
        # mode nobody chose)
        if sched.rank == 0 and logger.isEnabledFor(logging.INFO):
            at = {id(c): spans[i] for i, c in enumerate(candidates)}
            # (left out of the candidates, the plan for equal bytes has the re-made one's order)
            known = at[id(chosen)], at.get(id(sched.equal_bytes_plan), spans[0])
            cost, _ = cost_line(sched, chosen, costs, sched.equal_bytes_plan, unit_bytes, known)
            line = predicted_memory_line(sched, chosen, costs, unit_bytes, held)
            logger.info("%s%s%s", line, cost, _unkept_offer(sched, chosen, costs, unit_bytes))
        return chosen

    def _plan(self, sched: Any, costs: Costs) -> Plan | None:
        """The plan for the measured bytes; None to keep the old one.

        Every rank plans from the same gathered bytes, with the code, options and time costs
        whose plan every rank compared at construction, and planning is deterministic (no hash
        seed, dict order or clock: DESIGN.md), so every rank makes the same plan, or fails
        alike, without a second exchange (one ``all_gather_object`` of a fingerprint: 4-7 ms of
        a 70 ms first step on issue 37's 2-rank MLP). ``costs="profile"``'s re-plan, from
        measured times, still exchanges its fingerprint (:func:`~zbpipe.schedules.replan.
        agree_on_plan`).
        """
        options = dict(sched._plan_options)
        ties = getattr(sched, "replan_perturbed_ties", 0)  # (equal times tie many orders)
        if (
            ties
            and equal_times(sched.costs, sched._num_stages)
            and not _equal_bytes_kept(sched, costs)
        ):
            options.setdefault("perturbed_ties", ties)
        try:
            built = sched.build_plan(sched.pp_group_size, sched._n_microbatches, costs, **options)
            new: Plan = never_slower(sched, built, costs)
        except ValueError as e:
            if getattr(sched, "byte_budget", None) is not None:
                raise  # a byte budget the measured bytes cannot meet: on every rank
            logger.warning(
                "zbpipe memory: %s cannot be planned for the measured bytes (%s); keeping the "
                "plan for one memory unit per microbatch: its memory promise is not checked "
                "against the measured bytes",
                type(sched).__name__,
                e,
            )
            return None
        return new


def _unkept_offer(sched: Any, chosen: Plan, costs: Costs, unit_bytes: float) -> str:
    """Where keeping the promise changed the plan: what the plan for equal bytes would hold, and
    the option that runs it, in the form the schedule was named by (``"ZBV:nopromise"`` from a
    config, ``memory_promise=False`` from the constructor)."""
    takes_it = (  # what memory_promise=False is refused with (runtime.PlannedSchedule)
        getattr(sched, "_profiler", None) is None
        and getattr(sched, "memory_limit", None) is None
        and "memory_limit" not in sched._plan_options
    )
    if not takes_it or chosen.order == sched.equal_bytes_plan.order:
        return ""
    peak = max(simulate(sched.equal_bytes_plan, costs).peak_memory.values()) * unit_bytes
    option = f"'{sched.entry_name}:nopromise'" if sched.entry_name else "memory_promise=False"
    return (
        f"; {option} keeps the plan for equal bytes instead (predicted peak "
        f"{format_bytes(peak)}): more memory, no Ws run early to keep the promise"
    )


def _equal_bytes_kept(sched: Any, costs: Costs) -> bool:
    """Whether the plan for equal bytes keeps the promise in the measured bytes. It then runs
    unless a re-made plan is strictly faster (:func:`fastest_keeping`), which at the default
    equal times it rarely is, so the choice among the re-made plan's ties is not made (it would
    cost the first step about four times the planning for nothing)."""
    limit = sched._plan_options.get("memory_limit")
    if not isinstance(limit, (int, float)):
        chunks = sched._num_stages // sched.pp_group_size
        name = sched.equal_bytes_plan.name
        limit = promised_peak(name, sched.pp_group_size, sched._n_microbatches, costs, chunks)
    if limit is None:
        return False
    return within(max(simulate(sched.equal_bytes_plan, costs).peak_memory.values()), limit)


def predicted_memory_line(
    sched: Any,
    plan: Plan,
    costs: Costs,
    unit_bytes: float,
    held: dict[int, Any] | None = None,
    kept: bool = False,
) -> str:
    """``zbpipe memory: ScheduleZBH1 ...: predicted peak per rank 35.1 / 34.8 MiB (max 1.00x
    1F1B's 35.3 MiB)``: the log line of a re-plan for measured bytes, or (``kept``) of the plan
    for equal bytes kept without its promise (``memory_promise=False``)."""
    from ..planning.yardsticks import onef1b_peak

    peaks = simulate(plan, costs).peak_memory
    per_rank = " / ".join(format_bytes(peaks[r] * unit_bytes) for r in sorted(peaks))
    did = (
        f"keeps {plan.name}'s plan for equal bytes per stage (memory_promise=False: not re-made "
        "to keep its promise in the measured bytes)"
        if kept
        else f"planned {plan.name} for the measured bytes per microbatch"
    )
    text = f"zbpipe memory: {type(sched).__name__} {did}; predicted peak per rank {per_rank}"
    chunks = sched._num_stages // sched.pp_group_size
    if chunks == 1 or (chunks == 2 and plan.layout == "v"):
        base = onef1b_peak(sched.pp_group_size, sched._n_microbatches, costs.joined(chunks))
        text += (
            f" (max {max(peaks.values()) / base:.2f}x 1F1B's {format_bytes(base * unit_bytes)} "
            "on the same model)"
        )
    if held:
        after_f = ", ".join(f"{format_bytes(v.get('F', 0.0))}" for v in held.values())
        text += f"; held after F per stage: {after_f}"
    return text
