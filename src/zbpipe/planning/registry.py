"""One explicit lookup from schedule name to plan generator.

zbpipe's own generators are listed in ``GENERATORS``; add a line to register a new family.
Names starting with ``torch:`` are torch's built-in schedules, built by ``zbpipe.torch_plans``,
imported only when asked for so this layer stays torch-free.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from .auto import plan_zb1p, plan_zb2p
from .continuous_plan import plan_continuous
from .core import Plan
from .costs import Costs
from .onef1b import plan_1f1b
from .zbh1 import plan_zbh1
from .zbh2 import plan_zbh2
from .zbv import plan_zbv, plan_zbv_half, plan_zbv_min

Generator = Callable[..., Plan]

#: zbpipe's schedules, ``name -> generator``; a generator is called as
#: ``generator(num_ranks, n_microbatches, costs=, memory_limit=, **options)``.
GENERATORS: dict[str, Generator] = {
    "1F1B": plan_1f1b,
    "ZBH1": plan_zbh1,
    "ZBH2": plan_zbh2,
    "ZB1P": plan_zb1p,
    "ZB2P": plan_zb2p,
    "ZBV": plan_zbv,
    "ZBVHalf": plan_zbv_half,
    "ZBVMin": plan_zbv_min,
    "Continuous": plan_continuous,
}

#: torch's built-in schedules, by the class name ``torch.distributed.pipelining`` gives them.
TORCH_SCHEDULES: tuple[str, ...] = (
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "GPipe",
    "DualPipeV",
)


def known_names() -> list[str]:
    """Every name ``plan`` accepts (zbpipe's, then torch's as ``torch:<Name>``)."""
    return list(GENERATORS) + [f"torch:{n}" for n in TORCH_SCHEDULES]


def plan(
    name: str,
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    **options: object,
) -> Plan:
    """Build the plan called ``name`` (case-insensitive), e.g. ``plan("ZBH1", 8, 24)``.

    ``torch:`` names accept ``stages_per_rank`` (default 2) for torch's interleaved schedules.
    ``refine=True`` (zbpipe's names) improves the plan with the exact MILP
    (:func:`zbpipe.planning.milp.refine`, needs scipy); ``refine_time_limit`` bounds it in seconds,
    ``refine_objective`` is ``"makespan"`` (default) or ``"span"`` (the bubble rate's). The proven
    lower bound and the gap are in ``result.meta["refine"]``.
    """
    refine = bool(options.pop("refine", False))
    refine_time_limit = float(cast(float, options.pop("refine_time_limit", 30.0)))
    refine_objective = str(options.pop("refine_objective", "makespan"))
    if refine_objective not in ("makespan", "span"):
        raise ValueError(f"refine_objective must be 'makespan' or 'span', got {refine_objective!r}")
    key = name.strip().lower()
    if key.startswith("torch:"):
        wanted = key[len("torch:") :]
        for torch_name in TORCH_SCHEDULES:
            if torch_name.lower() == wanted:
                torch_plans = importlib.import_module("zbpipe.torch_plans")
                built: Plan = torch_plans.torch_plan(
                    torch_name, num_ranks, n_microbatches, **options
                )
                return built
    else:
        for gen_name, gen in GENERATORS.items():
            if gen_name.lower() == key:
                _check_options(gen_name, gen, options)
                result = gen(
                    num_ranks, n_microbatches, costs=costs, memory_limit=memory_limit, **options
                )
                if refine:
                    from .milp import refine as refine_plan

                    limit = memory_limit
                    if limit is None:
                        limit = cast("float | None", result.meta.get("memory_limit"))
                    result = refine_plan(
                        result,
                        costs,
                        limit,
                        time_limit=refine_time_limit,
                        objective=refine_objective,  # type: ignore[arg-type]
                    ).plan
                return result
    raise ValueError(
        f"unknown schedule {name!r}; known names (case-insensitive): {', '.join(known_names())}"
    )


def _check_options(name: str, gen: Generator, options: dict[str, object]) -> None:
    """An option the generator does not take is a ValueError naming the ones it does."""
    import inspect

    params = inspect.signature(gen).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [n for n in params if n not in ("num_ranks", "n_microbatches", "costs", "memory_limit")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"plan {name!r} does not take option(s) {unknown}; its options are {known or 'none'} "
            "(plus costs, memory_limit, refine)"
        )
