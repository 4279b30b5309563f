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

from ..planning import Costs, Plan
from .runtime import PlannedSchedule


class Schedule1F1BMulti(PlannedSchedule):
    """1F1B with fused backward, run by zbpipe's runtime (traced like every zbpipe schedule).

    The baseline that zero-bubble schedules are measured against; one stage per rank.
    """

    plan_name = "1F1B"


class ScheduleZBH1(PlannedSchedule):
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B with every backward split into B and W, the W passes
    deferred into the pipeline's bubbles. Peak activation memory equals 1F1B's.

    One stage per rank (loop placement). ``exact=True`` keeps 1F1B's weight-gradient
    accumulation order and its way of adding (no accumulation inside the deferred engine's
    GEMMs), so gradients are bitwise identical to 1F1B's.
    """

    plan_name = "ZBH1"

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        return super().build_plan(num_ranks, n_microbatches, costs, exact=self.exact, **options)


class ScheduleZBH2(PlannedSchedule):
    """ZB-H2 (Qi et al., ICLR 2024): more warm-up forwards (about twice 1F1B's activation memory)
    so the W passes fill every bubble; zero bubble with equal costs. One stage per rank."""

    plan_name = "ZBH2"


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
    layout = "v"
    stages_per_rank = 2

    def __init__(
        self, *args: Any, memory: Literal["zb", "half", "min"] = "zb", **kwargs: Any
    ) -> None:
        if memory not in ("zb", "half", "min"):
            raise ValueError(f"ScheduleZBV: memory must be 'zb', 'half' or 'min', got {memory!r}")
        self.memory = memory
        super().__init__(*args, **kwargs)

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        return super().build_plan(num_ranks, n_microbatches, costs, memory=self.memory, **options)


class ScheduleZBAuto(PlannedSchedule):
    """The paper's automatic zero-bubble schedule (ZB-1p / ZB-2p), planned from the stage costs.

    ``memory_limit``: ``"1p"`` (1F1B's peak activation memory), ``"2p"`` (twice that: the
    paper's near-zero-bubble budget) or a number in the memory units of ``costs``. One stage
    per rank. ``refine=True`` improves the plan with the exact MILP (needs scipy).
    """

    def __init__(
        self, *args: Any, memory_limit: str | float = "2p", refine: bool = False, **kwargs: Any
    ) -> None:
        if isinstance(memory_limit, str) and memory_limit not in ("1p", "2p"):
            raise ValueError(
                f"ScheduleZBAuto: memory_limit must be '1p', '2p' or a number, got {memory_limit!r}"
            )
        if not isinstance(memory_limit, str) and not (
            isinstance(memory_limit, (int, float)) and memory_limit > 0
        ):
            raise ValueError(
                f"ScheduleZBAuto: a numeric memory_limit must be > 0, got {memory_limit!r}"
            )
        self.memory_limit = memory_limit
        self.refine = refine
        super().__init__(*args, **kwargs)

    def build_plan(self, num_ranks: int, n_microbatches: int, costs: Costs, **options: Any) -> Plan:
        from ..planning import plan

        if isinstance(self.memory_limit, str):
            name, limit = ("ZB1P" if self.memory_limit == "1p" else "ZB2P"), None
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


def _fixed(base: type, plan_name: str, option: str, value: Any, doc: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = kwargs.pop(option, value)
        if given != value:
            raise ValueError(
                f"Schedule{plan_name} runs {option}={value!r}; got {option}={given!r}: "
                f"use {base.__name__}({option}={given!r}) instead"
            )
        base.__init__(self, *args, **{option: value}, **kwargs)

    return type(
        f"Schedule{plan_name}",
        (base,),
        # plan_name stays the base's: its build_plan turns the fixed option into this plan.
        {
            "__init__": __init__,
            "__doc__": doc,
            "__module__": __name__,
            "fixed_option": (option, value),
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
