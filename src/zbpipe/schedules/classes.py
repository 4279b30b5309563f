"""zbpipe's torch schedule classes: each says which plan it runs, nothing more.

They take torch's constructor shape (``stages, n_microbatches, loss_fn=None, ...,
scale_grads=True, backward_requires_autograd=True``) plus keyword-only zbpipe options, and
torch's ``step(*args, target=None, losses=None, **kwargs)``. See :mod:`zbpipe.schedules.runtime`.
Their names (``"ZBH1"``...) are in :mod:`zbpipe.integrations.names`, the one table every lookup
reads.

The fixed-option classes at the end (``ScheduleZB1P``, ``ScheduleZBVHalf``...) give every zbpipe
plan name a class, so a memory mode is a config line: torchtitan (and torch's
``get_schedule_class``) turn a schedule name into a class and construct it as ``cls(stages,
n_microbatches=..., loss_fn=..., scale_grads=...)``, with no way to pass ``memory="half"`` or
``memory_limit="1p"``. Each is a zbpipe schedule with that option fixed, named like the plan it
runs (``plan("ZBVHalf", ...)``), so ``pipeline_parallel_schedule = "ZBVHalf"`` selects V-Half.
Constructing one with the option given again is allowed only with the same value.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..planning import Costs, Plan
from ..planning.budget import is_budget_string
from ..planning.search.perturbed import SCENARIOS
from .runtime import PlannedSchedule


class Schedule1F1BMulti(PlannedSchedule):
    """1F1B with fused backward, run by zbpipe's runtime (traced like every zbpipe schedule).

    The baseline that zero-bubble schedules are measured against; one stage per rank.
    """

    plan_name = "1F1B"
    memory_planned = False


class ScheduleZBH1(PlannedSchedule):
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B with every backward split into B and W, the W passes
    deferred into the pipeline's bubbles. Peak activation memory equals 1F1B's.

    One stage per rank (loop placement). ``exact=True`` keeps 1F1B's weight-gradient
    accumulation order and its way of adding (no accumulation inside the deferred engine's
    GEMMs), so gradients are bitwise identical to 1F1B's.
    """

    plan_name = "ZBH1"
    safe_first_step = True

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        return super().build_plan(num_ranks, n_microbatches, costs, exact=self.exact, **options)


class ScheduleZBH2(PlannedSchedule):
    """ZB-H2 (Qi et al., ICLR 2024): more warm-up forwards (about twice 1F1B's activation memory)
    so the W passes fill every bubble; zero bubble with equal costs. One stage per rank."""

    plan_name = "ZBH2"


class ScheduleZBInterleaved(PlannedSchedule):
    """ZB-Interleaved: interleaved 1F1B's placement with every backward split into B and W, the
    W passes placed into the bubbles by the cost model (:mod:`zbpipe.planning.loop.
    zb_interleaved`). Peak activation memory at most torch's Interleaved1F1B's busiest rank's;
    never slower than interleaved 1F1B in the simulator for the costs it plans with.

    Two or more stages per rank in loop placement: rank ``r`` holds stages ``r, r + p, ...``
    (the stages given say how many; torchtitan builds two). ``n_microbatches``: what torch's
    Interleaved1F1B takes, any multiple of the number of ranks among them. ``costs`` describe
    each stage (one value, or one per stage); ``None`` means equal F, B and W.
    """

    plan_name = "ZBInterleaved"
    stages_per_rank = 2
    any_stages_per_rank = True

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        num_stages = getattr(self, "_num_stages", None)  # (None before torch's __init__ ran)
        if num_stages is not None:
            options.setdefault("stages_per_rank", num_stages // num_ranks)
        try:
            return super().build_plan(num_ranks, n_microbatches, costs, **options)
        except ValueError as e:  # the planner's message, with the class the user constructed
            raise ValueError(f"{type(self).__name__} cannot plan for these stages: {e}") from None


class ScheduleZBV(PlannedSchedule):
    """ZB-V and its memory-controlled variants, planned from the stage costs.

    Two stages (model chunks) per rank in V placement: rank ``r`` holds stages ``r`` and
    ``2p - 1 - r``. ``memory`` chooses the activation-memory budget per rank:

    * ``"zb"``   ZB-V: 1F1B's peak; near-zero bubble;
    * ``"half"`` V-Half: about half of 1F1B's ((p + 2) / 2 units against p);
    * ``"min"``  V-Min: about a third ((p + 4) / 3 units).

    ``costs`` describe one chunk; ``None`` means equal F, B and W.
    """

    plan_name = "ZBV"
    safe_first_step = True
    layout = "v"
    stages_per_rank = 2

    def __init__(
        self, *args: Any, memory: Literal["zb", "half", "min"] = "zb", **kwargs: Any
    ) -> None:
        if memory not in ("zb", "half", "min"):
            raise ValueError(f"ScheduleZBV: memory must be 'zb', 'half' or 'min', got {memory!r}")
        self.memory = memory
        # ZB-V's re-made plan is chosen among equally fast ones by drawn costs; V-Half's and
        # V-Min's are not: under the graph engine V-Half's chosen plan held 1.104 of its formula
        # in the first step where the generator's held 0.952 (docs/results/memory-promise.md)
        self.replan_perturbed_ties = SCENARIOS if memory == "zb" else 0
        super().__init__(*args, **kwargs)

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        return super().build_plan(num_ranks, n_microbatches, costs, memory=self.memory, **options)


class ScheduleZBAuto(PlannedSchedule):
    """The paper's automatic zero-bubble schedule (ZB-1p / ZB-2p), planned from the stage costs.

    ``memory_limit`` is per rank:

    * ``"1p"``: 1F1B's peak activation memory (or, where one split backward in flight on the
      busiest stage holds more, that: a B that keeps more than its F did, such as the graph
      engine's on a large LM head); ``"2p"``: twice 1F1B's (the paper's near-zero-bubble
      budget);
    * a byte budget, ``"40GiB"``, ``"512MiB"`` (see :mod:`zbpipe.planning.budget`), or a share
      of the CUDA device's free memory at construction, ``"80%"``: the first step runs one
      microbatch in flight (the least memory any plan holds) and measures the bytes each stage
      holds; the fastest plan within the budget runs from the second step on. A budget below
      what one microbatch in flight holds raises ``ValueError`` on every rank at the end of
      that step;
    * a number, in the memory units of ``costs`` (after the first step's measurement, one
      unit is one microbatch of an average stage).

    One stage per rank. ``refine=True`` improves the plan with the exact MILP (needs scipy).
    """

    def __init__(
        self, *args: Any, memory_limit: str | float = "2p", refine: bool = False, **kwargs: Any
    ) -> None:
        check_memory_limit(type(self), memory_limit)
        self.byte_budget: float | None = None
        if is_budget_string(memory_limit):
            assert isinstance(memory_limit, str)
            self.byte_budget = resolve_budget(type(self), memory_limit, args, kwargs)
            if kwargs.get("measure_memory", True) is False:
                raise ValueError(
                    f"{type(self).__name__}: memory_limit={memory_limit!r} is a byte budget, "
                    "which needs the first step's measurement: drop measure_memory=False"
                )
        self.memory_limit = memory_limit
        self.refine = refine
        self.safe_first_step = memory_limit in ("1p", "2p")
        super().__init__(*args, **kwargs)

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        from ..planning import plan
        from ..planning.yardsticks import minimum_memory, onef1b_peak

        if self.byte_budget is not None:
            return plan_for_byte_budget(
                self, "ZB2P", num_ranks, n_microbatches, costs, refine=self.refine, **options
            )
        if isinstance(self.memory_limit, str):
            name = "ZB1P" if self.memory_limit == "1p" else "ZB2P"
            factor = 1 if self.memory_limit == "1p" else 2
            # 1F1B's peak, unless one split backward in flight needs more (measured bytes)
            limit: float | None = max(
                factor * onef1b_peak(num_ranks, n_microbatches, costs),
                minimum_memory(costs, num_ranks),
            )
        else:
            name, limit = "ZB2P", float(self.memory_limit)
        return plan(
            name,
            num_ranks,
            n_microbatches,
            costs=costs,
            memory_limit=limit,
            refine=self.refine,
            **options,
        )


def plan_for_byte_budget(
    sched: Any, name: str, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any
) -> Plan:
    """The plan ``name`` within ``sched.byte_budget``: one microbatch in flight until the bytes
    are measured (``sched.memory_unit_bytes``), then the generator's plan at that budget."""
    from ..planning import plan
    from ..planning.budget import format_bytes
    from ..planning.one_in_flight import plan_one_in_flight
    from ..planning.yardsticks import least_memory

    if sched.memory_unit_bytes is None:
        return plan_one_in_flight(num_ranks, n_microbatches, sched.layout)
    unit = sched.memory_unit_bytes
    limit = sched.byte_budget / unit
    need = least_memory(costs, num_ranks, sched.layout)
    if limit < need * (1 - 1e-9):
        raise ValueError(
            f"{type(sched).__name__}: memory_limit {format_bytes(sched.byte_budget)} per rank is "
            f"below {format_bytes(need * unit)}, what one microbatch in flight holds on the "
            "busiest stage (measured in the first step); no plan fits: raise memory_limit, "
            "use more pipeline ranks, or smaller microbatches"
        )
    try:
        return plan(name, num_ranks, n_microbatches, costs=costs, memory_limit=limit, **options)
    except ValueError as e:
        raise ValueError(
            f"{type(sched).__name__}: no {name} plan fits memory_limit "
            f"{format_bytes(sched.byte_budget)} per rank ({limit:.4g} units of "
            f"{format_bytes(unit)}): {e}"
        ) from e


def check_memory_limit(cls: type, memory_limit: object) -> None:
    """``memory_limit`` is ``"1p"``, ``"2p"``, a byte budget (``"40GiB"``, ``"80%"``) or a
    number > 0 (``ScheduleZBAuto`` and ``ScheduleAuto``); else ``ValueError``."""
    if isinstance(memory_limit, str):
        if memory_limit not in ("1p", "2p") and not is_budget_string(memory_limit):
            raise ValueError(
                f"{cls.__name__}: memory_limit must be '1p', '2p', a byte budget like "
                f"'40GiB' or '80%', or a number, got {memory_limit!r}"
            )
    elif not (isinstance(memory_limit, (int, float)) and memory_limit > 0):
        raise ValueError(
            f"{cls.__name__}: a numeric memory_limit must be > 0, got {memory_limit!r}"
        )


def resolve_budget(cls: type, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """Bytes for ``"40GiB"``; for ``"80%"`` that share of the CUDA device's free memory now."""
    from ..planning.budget import parse_budget

    value, fraction = parse_budget(text)
    if not fraction:
        return value
    stages = args[0] if args else kwargs.get("stages")
    stage = stages[0] if isinstance(stages, (list, tuple)) else stages
    device = getattr(stage, "device", None)
    if device is None or torch.device(device).type != "cuda":
        raise ValueError(
            f"{cls.__name__}: memory_limit={text!r} is a share of the CUDA device's memory, but "
            f"the stages run on {device}; give bytes instead, e.g. '40GiB'"
        )
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return value * free


def _fixed(base: type, plan_name: str, option: str, value: Any, doc: str) -> type:
    return with_fixed_option(base, f"Schedule{plan_name}", option, value, doc)


def with_fixed_option(
    base: type, class_name: str, option: str, value: Any, doc: str | None = None
) -> type:
    """A subclass of ``base`` named ``class_name`` that always runs ``option=value``.

    Its ``fixed_option`` is ``(option, value)``; ``fixed_options`` holds every option fixed
    along its bases (``"AutoV:40GiB:profile"``: the budget and the costs).
    """

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = kwargs.pop(option, value)
        if given != value:
            raise ValueError(
                f"{class_name} runs {option}={value!r}; got {option}={given!r}: "
                f"use {base.__name__}({option}={given!r}) instead"
            )
        base.__init__(self, *args, **{option: value}, **kwargs)

    doc = doc or f"{base.__name__} with {option}={value!r}."
    return type(
        class_name,
        (base,),
        # plan_name stays the base's: its build_plan turns the fixed option into this plan.
        {
            "__init__": __init__,
            "__doc__": doc,
            "__module__": __name__,
            "fixed_option": (option, value),
            "fixed_options": {**getattr(base, "fixed_options", {}), option: value},
        },
    )


ScheduleZB1P = _fixed(
    ScheduleZBAuto,
    "ZB1P",
    "memory_limit",
    "1p",
    "The automatic zero-bubble schedule within 1F1B's activation memory (ZB-1p).",
)
ScheduleZB2P = _fixed(
    ScheduleZBAuto,
    "ZB2P",
    "memory_limit",
    "2p",
    "The automatic zero-bubble schedule within twice 1F1B's activation memory (ZB-2p).",
)
ScheduleZBVHalf = _fixed(
    ScheduleZBV, "ZBVHalf", "memory", "half", "V-Half: ZB-V with about half 1F1B's activations."
)
ScheduleZBVMin = _fixed(
    ScheduleZBV, "ZBVMin", "memory", "min", "V-Min: ZB-V with about a third of 1F1B's activations."
)
