"""The schedule chooser at run time: the fastest plan whose peak fits a per-rank byte budget.

:class:`ScheduleAuto` (one stage per rank: 1F1B, ZB-H1, ZB-1p, ZB-2p) and
:class:`ScheduleAutoV` (two stages per rank in V placement: ZB-V, V-Half, V-Min) plan every
candidate for the costs they know, simulate each, and run the fastest whose simulated peak is
within ``memory_limit`` on every rank
(:func:`zbpipe.planning.search.within_budget.choose_plan`). Rank 0 logs the candidates'
simulated step time, bubble rate and peak. :func:`choose_schedule` builds the one the stages
allow.

With a byte budget the first step runs one microbatch in flight (the least memory any plan
holds: it fits any budget some plan fits) and measures the bytes each stage holds after F and
after B; the ranks agree on them and choose from the second step on. When nothing fits, every
rank raises the same ``ValueError`` at the end of that step. With ``costs=`` measured earlier
in bytes (``Costs(mem_f=[...])`` in bytes and ``unit_bytes=1``, e.g. from a previous run's
``sched.memory_costs`` and ``sched.memory_unit_bytes``), the choice is made at construction,
before any communication, and so is the error. ``costs="profile"`` also measures times.
"""

from __future__ import annotations

import logging
from typing import Any

from ..planning import Costs, Plan
from ..planning.budget import format_bytes, is_budget_string
from ..planning.one_in_flight import plan_one_in_flight
from ..planning.search.within_budget import choose_plan
from ..planning.yardsticks import onef1b_peak
from .runtime import PlannedSchedule

logger = logging.getLogger(__name__)


class ScheduleAuto(PlannedSchedule):
    """The fastest of 1F1B, ZB-H1, ZB-1p and ZB-2p within ``memory_limit`` (one stage per rank).

    ``memory_limit`` per rank: ``"1p"`` (1F1B's peak on the same model, the default), ``"2p"``,
    a byte budget (``"40GiB"``, ``"512MiB"``; ``"80%"``: that share of the CUDA device's free
    memory at construction) or a number in the memory units of ``costs``. ``unit_bytes``: the
    bytes one memory unit of a given ``costs`` stands for (``1`` when its memory fields are
    bytes); with it and a byte budget the choice is made at construction.
    """

    plan_name = "Auto"

    def __init__(
        self,
        *args: Any,
        memory_limit: str | float = "1p",
        unit_bytes: float | None = None,
        **kwargs: Any,
    ) -> None:
        from .classes import check_memory_limit, resolve_budget

        check_memory_limit(type(self), memory_limit)
        self.byte_budget: float | None = None
        self.memory_limit = memory_limit
        if is_budget_string(memory_limit):
            assert isinstance(memory_limit, str)
            self.byte_budget = resolve_budget(type(self), memory_limit, args, kwargs)
        if unit_bytes is not None and not isinstance(kwargs.get("costs"), Costs):
            raise ValueError(
                f"{type(self).__name__}: unit_bytes says what one memory unit of costs= is; "
                "give costs=Costs(...) with it, or leave it out"
            )
        if self.byte_budget is not None and kwargs.get("measure_memory", True) is False:
            if unit_bytes is None:
                raise ValueError(
                    f"{type(self).__name__}: memory_limit={memory_limit!r} is a byte budget: "
                    "it needs the first step's measurement (drop measure_memory=False) or "
                    "costs=Costs(...) with unit_bytes="
                )
        self._given_unit_bytes = unit_bytes
        if unit_bytes is not None:
            # measured bytes were given: no measurement step, the choice is made now
            kwargs["measure_memory"] = False
        self.safe_first_step = memory_limit in ("1p", "2p")
        self.choice: Any = None
        """The last :class:`~zbpipe.planning.search.within_budget.Choice` (every candidate,
        simulated)."""
        super().__init__(*args, **kwargs)

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        if options:
            raise ValueError(
                f"{type(self).__name__} takes no plan options (got {sorted(options)}): it "
                "plans every candidate with its defaults"
            )
        unit = self._unit_bytes()
        if self.byte_budget is not None and unit is None:
            return plan_one_in_flight(num_ranks, n_microbatches, self.layout)
        chunks = self.stages_per_rank
        if self.memory_limit in ("1p", "2p"):
            factor = 1 if self.memory_limit == "1p" else 2
            limit = factor * onef1b_peak(num_ranks, n_microbatches, costs.joined(chunks))
        elif self.byte_budget is not None:
            assert unit is not None
            limit = self.byte_budget / unit
        else:
            limit = float(self.memory_limit)  # type: ignore[arg-type]
        v = self.layout == "v"
        try:
            self.choice = choose_plan(
                num_ranks,
                n_microbatches,
                limit,
                costs=None if v else costs,
                v_costs=costs if v else None,
                layouts=(self.layout,),
                unit_bytes=unit,
            )
        except ValueError as e:
            budget = (
                format_bytes(self.byte_budget)
                if self.byte_budget is not None
                else f"{self.memory_limit}"
            )
            raise ValueError(
                f"{type(self).__name__}: no {self.layout}-placement schedule fits "
                f"memory_limit {budget} per rank"
                + (f" (one memory unit = {format_bytes(unit)})" if unit is not None else "")
                + f": {e}"
            ) from e
        if getattr(self, "rank", 0) == 0:
            logger.info(
                "zbpipe auto: %s chose %s for memory_limit %s (m=%d, %d ranks):\n%s",
                type(self).__name__,
                self.choice.best.name,
                format_bytes(self.byte_budget) if self.byte_budget is not None else limit,
                n_microbatches,
                num_ranks,
                self.choice.table(unit),
            )
        plan: Plan = self.choice.best.plan
        return plan

    def _unit_bytes(self) -> float | None:
        if self._given_unit_bytes is not None:
            return self._given_unit_bytes
        return self.memory_unit_bytes


class ScheduleAutoV(ScheduleAuto):
    """The fastest of ZB-V, V-Half and V-Min within ``memory_limit`` (two stages per rank, V
    placement: rank ``r`` holds stages ``r`` and ``2p - 1 - r``). See :class:`ScheduleAuto`."""

    plan_name = "AutoV"
    layout = "v"
    stages_per_rank = 2


def choose_schedule(
    stages: Any, n_microbatches: int, loss_fn: Any = None, **kwargs: Any
) -> ScheduleAuto:
    """The schedule chooser the stages allow: :class:`ScheduleAutoV` for two stages per rank in
    V placement, else :class:`ScheduleAuto` (one stage per rank). ``kwargs`` as theirs
    (``memory_limit="40GiB"``, ``costs=``, ``split=`` ...).

    How to build stages for each: one stage per rank, ``PipelineStage(chunk[rank], rank, p,
    device)`` on a model cut into ``p`` chunks; for V, cut it into ``2p`` chunks and give rank
    ``r`` the stages ``r`` and ``2p - 1 - r`` (``ScheduleAutoV.stage_index_to_rank(p)``).
    """
    local = list(stages) if isinstance(stages, (list, tuple)) else [stages]
    cls = ScheduleAutoV if len(local) == 2 else ScheduleAuto
    return cls(local, n_microbatches, loss_fn=loss_fn, **kwargs)
