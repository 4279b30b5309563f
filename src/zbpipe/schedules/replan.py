"""Profile-guided re-planning, the runtime side: count a schedule's steps, keep the traced events
of the profiling window, measure, agree on the costs and re-plan once, identically on every rank
(the steps are listed in :mod:`zbpipe.observe.profile`, which measures).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..memory.probe import MemoryProbe
from ..observe.agree import config_fingerprint, disagreement
from ..observe.profile import (
    ProfileConfig,
    costs_from_medians,
    gather_stage_values,
    measure_comm,
    memory_costs,
    round_sig,
    stage_medians,
    stage_waits,
)
from ..planning import Costs, Plan, SimResult
from .memory_promise import fastest_keeping, promised_budget
from .plain_order import never_slower

logger = logging.getLogger(__name__)


def agree_on_plan(sched: Any, plan_or_error: Plan | str, group: Any) -> None:
    """Exchange the re-planned fingerprint once; on every rank, raise ``RuntimeError`` if they
    differ.

    ``plan_or_error`` is a rank's new plan, or the message of the error it hit while planning
    (so a rank that failed does not leave the others waiting).
    """
    if isinstance(plan_or_error, Plan):
        mine = config_fingerprint(
            type(sched), sched._n_microbatches, sched._num_stages, plan_or_error
        )
    else:
        mine = f"error: {plan_or_error}"
    lines = disagreement(group, sched.rank, mine, mine)
    if lines:
        raise RuntimeError(
            f"{type(sched).__name__}: pipeline ranks re-planned differently "
            f"from the profiled costs:\n{lines}\n"
            "the plan generator must be deterministic; "
            "keeping the previous plan is not safe, so the run stops"
        )


class CostProfiler:
    """Counts a schedule's steps, keeps the traced events of the profiling window, re-plans once."""

    def __init__(self, config: ProfileConfig, keep_tracing: bool) -> None:
        self.config = config
        self.keep_tracing = (
            keep_tracing  # the user's trace= choice, restored once profiling is done
        )
        self.steps_seen = 0
        self.events: list[Any] = []
        #: overlapped pairs' halves (compute only) and whether they interleaved
        #: (:attr:`zbpipe.schedules.pairs.PairRunner.halves`)
        self.halves: list[Any] = []
        self.done = False
        self.memory = MemoryProbe()
        #: bytes per memory unit of the measured costs (None: memory not measured)
        self.memory_unit_bytes: float | None = None

    def before_step(self, sched: Any) -> None:
        """Call on every rank before each step: memory is probed in one step of its own.

        The last warm-up step (the first profiled one if there is none): the probe's hooks cost
        time, which must not enter the timed steps. Compiled stages are probed too: a compiled
        region's autograd node saves its tensors through the same saved-tensor hooks, and the
        hooks do not make dynamo trace again (tests/engines/test_compiled_schedules.py).
        """
        probe_step = max(self.config.warmup_steps - 1, 0)
        probing = self.config.memory and self.steps_seen == probe_step
        sched.seam.probe = self.memory if probing else None

    def after_step(self, sched: Any) -> None:
        """Call on every rank after each successful step (re-plans after the last profiled one)."""
        if self.done:
            return
        self.steps_seen += 1
        sched.seam.probe = None
        if self.steps_seen > self.config.warmup_steps:
            self.events.extend(sched.tracer.events)
            self.halves.extend(sched._pairs.halves)
        if self.steps_seen == self.config.warmup_steps + self.config.profile_steps:
            self.done = True
            sched.tracer.enabled = self.keep_tracing
            self.replan(sched)

    def measured_costs(self, sched: Any) -> Costs:
        """The agreed per-stage costs (a collective over the pipeline group)."""
        cfg, group = self.config, sched._stages[0].group
        mine = [st.stage_index for st in sched._stages]
        local = stage_medians([*self.events, *(e for e, _ in self.halves)], mine)
        waits = [*self.events, *(e for e, interleaved in self.halves if not interleaved)]
        for s, waited in stage_waits(waits, mine).items():  # Costs.a2a
            local.setdefault(s, {})["a2a"] = waited
        medians = gather_stage_values(local, group)
        if cfg.comm == "measure":
            comm_s = measure_comm(sched._stages, sched.plan.placement, group, cfg.comm_repeats)
            comm_s = {s: round_sig(c, cfg.digits + 2) for s, c in comm_s.items()}
            comm = list(gather_stage_values(comm_s, group).values())
        else:
            comm = [float(cfg.comm) * cfg.unit] * sched._num_stages
        costs = costs_from_medians(
            medians, sched._num_stages, comm, unit=cfg.unit, digits=cfg.digits
        )
        if not cfg.memory:
            return costs
        held = gather_stage_values(self.memory.medians(mine), group)
        measured = memory_costs(held, sched._num_stages, cfg.digits)
        if measured is None:
            return costs
        fields, self.memory_unit_bytes = measured
        sched.memory_unit_bytes = self.memory_unit_bytes  # a byte budget plans in these units
        return dataclasses.replace(costs, **fields)

    def replan(self, sched: Any) -> None:
        from ..planning import simulate

        new, costs = self._plan_or_fall_back(sched, self.measured_costs(sched))
        agree_on_plan(sched, new, sched._stages[0].group)
        old = sched.plan
        # The generator optimises its cost model; it is not guaranteed to beat the plan for equal
        # costs (or the first steps' plan) under every cost vector, so a faster one of those is
        # kept where it keeps the promise in the measured bytes (without them: where it holds no
        # more than the new plan's peak). Both makespans and peaks are identical on every rank,
        # so is the choice.
        budget = (
            promised_budget(sched, new, costs)
            if self.memory_unit_bytes is not None
            else max(simulate(new, costs).peak_memory.values())
        )
        others = [p for p in (sched.equal_bytes_plan, old) if p is not new]
        others = [p for i, p in enumerate(others) if all(p is not q for q in others[:i])]
        chosen, _ = fastest_keeping([new, *others], costs, budget, sched.equal_bytes_plan)
        r_old, r_new = simulate(old, costs), simulate(chosen, costs)
        outcome = "switched" if chosen is new else "kept a faster plan within the promise"
        if chosen is sched.equal_bytes_plan and chosen is not new:
            outcome = "kept the plan for equal bytes: no slower, within the promise"
        if chosen.order == old.order:
            outcome = "unchanged"
        sched.measured_costs = costs
        sched.memory_unit_bytes = self.memory_unit_bytes
        if chosen is not old:
            sched.replan(chosen)
        fp = lambda p: config_fingerprint(type(sched), sched._n_microbatches, sched._num_stages, p)  # noqa: E731
        memory = self._predicted_memory(sched, r_new, costs)
        unit = "ms" if self.config.unit == 1e-3 else f"{self.config.unit:g} s"
        level = logging.INFO if sched.rank == 0 else logging.DEBUG
        logger.log(
            level,
            "zbpipe profile: %s measured costs (%s) F=%s B=%s W=%s comm=%s%s; plan %s %s -> %s: "
            "simulated makespan %.4g -> %.4g %s, bubble rate %.1f%% -> %.1f%% (%s)%s",
            type(sched).__name__,
            unit,
            _fmt(costs.f),
            _fmt(costs.b),
            _fmt(costs.w),
            _fmt(costs.comm),
            f" a2a={_fmt(costs.a2a)}" if any(_tuple(costs.a2a)) else "",
            new.name,
            fp(old),
            fp(chosen),
            r_old.makespan,
            r_new.makespan,
            unit,
            100 * r_old.bubble_rate,
            100 * r_new.bubble_rate,
            outcome,
            memory,
        )

    def _plan_or_fall_back(self, sched: Any, costs: Costs) -> tuple[Plan, Costs]:
        """The generator's plan for ``costs``, and the costs it was planned for. If the measured
        bytes make it fail (a numeric ``memory_limit`` below what they need), every rank fails
        alike: it warns and plans for one unit per microbatch instead, as without the
        measurement. Other failures are reported to the peers and raised."""

        def build(c: Costs) -> tuple[Plan, Costs]:
            try:
                built = sched.build_plan(
                    sched.pp_group_size, sched._n_microbatches, c, **sched._plan_options
                )
                plan: Plan = never_slower(sched, built, c)
                return plan, c
            except ValueError as e:  # PlanError included: report it to the peers, then raise
                agree_on_plan(sched, str(e), sched._stages[0].group)
                raise

        try:
            return build(costs)
        except ValueError as e:
            if self.memory_unit_bytes is None or getattr(sched, "byte_budget", None) is not None:
                raise  # (a byte budget the measured bytes cannot meet: on every rank)
            logger.warning(
                "zbpipe profile: %s cannot be planned for the measured memory (%s); planning "
                "for one memory unit per microbatch instead, as without the measurement: its "
                "memory promise is not checked against the measured bytes",
                type(sched).__name__,
                e,
            )
            self.memory_unit_bytes = sched.memory_unit_bytes = None
            return build(dataclasses.replace(costs, mem_f=1.0, mem_b=0.0, mem_w=-1.0))

    def _predicted_memory(self, sched: Any, sim: SimResult, costs: Costs) -> str:
        """The log line's memory part: the running plan's predicted peak (``sim``, its
        simulation under ``costs``), and its ratio to 1F1B's on the same model (the same stages,
        joined in pairs for a V placement)."""
        if self.memory_unit_bytes is None:
            return ""
        from ..planning.yardsticks import onef1b_peak

        peak = max(sim.peak_memory.values())
        text = f"; predicted peak memory {peak * self.memory_unit_bytes / 2**20:.3g} MiB per rank"
        chunks = sched._num_stages // sched.pp_group_size
        if chunks == 1 or (chunks == 2 and sched.layout == "v"):
            base = onef1b_peak(sched.pp_group_size, sched._n_microbatches, costs.joined(chunks))
            text += f" ({peak / base:.2f}x 1F1B's)"
        return text


def _tuple(values: Any) -> tuple[float, ...]:
    return values if isinstance(values, tuple) else (values,)


def _fmt(values: Any) -> str:
    return "[" + ",".join(f"{v:g}" for v in _tuple(values)) + "]"
