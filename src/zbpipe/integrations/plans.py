"""``zbpipe.plan``: one call for every plan name, zbpipe's generators and torch's schedules.

zbpipe's names (``"ZBV"``, ``"ZB1P"``...) go to the plan layer, :func:`zbpipe.planning.plan`.
``"torch:<Name>"`` names are torch's built-in schedules, whose order torch's own code generates
(:mod:`zbpipe.integrations.torch_plans`, imported only for them). The plan layer cannot build those
itself: it never imports torch nor anything above it. Importing this module imports no torch either.
"""

from __future__ import annotations

from ..planning import Costs, Plan
from ..planning import plan as plan_zbpipe
from ..planning.registry import torch_schedule_name

#: options of :func:`zbpipe.planning.plan` that torch's fixed orders have no use for
_REFINE_OPTIONS = ("refine", "refine_time_limit", "refine_objective")


def plan(
    name: str,
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    **options: object,
) -> Plan:
    """Build the plan called ``name`` (case-insensitive): ``plan("ZBV", 8, 24, costs=costs)``,
    ``plan("torch:ZBVZeroBubble", 8, 24)``; :func:`zbpipe.planning.known_names` lists the names.

    zbpipe's names take the options of :func:`zbpipe.planning.plan`. ``torch:`` names take
    ``stages_per_rank`` (default 2, torch's interleaved schedules) and need torch; their order
    does not depend on ``costs``, ``memory_limit`` or the ``refine`` options, which are ignored.
    """
    torch_name = torch_schedule_name(name)
    if torch_name is None:
        return plan_zbpipe(
            name, num_ranks, n_microbatches, costs=costs, memory_limit=memory_limit, **options
        )
    from .torch_plans import torch_plan

    for option in _REFINE_OPTIONS:
        options.pop(option, None)
    return torch_plan(torch_name, num_ranks, n_microbatches, **options)  # type: ignore[arg-type]
