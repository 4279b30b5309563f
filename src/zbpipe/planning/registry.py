"""One explicit lookup from plan name to plan generator.

zbpipe's own generators are listed in ``GENERATORS``; add a line to register a new family.
Names starting with ``torch:`` are torch's built-in schedules: torch's own code generates their
order, so they are built above this layer (:func:`zbpipe.plan`, through
``zbpipe.integrations.torch_plans``). This layer never imports torch nor any zbpipe module outside
``zbpipe.planning``: it knows their names (``TORCH_SCHEDULES``) and :func:`plan` refuses them,
pointing to ``zbpipe.plan``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from .continuous.periods import plan_continuous
from .core import Plan
from .costs import Costs
from .loop.heuristic import plan_zb1p, plan_zb2p
from .loop.onef1b import plan_1f1b
from .loop.zb_interleaved import plan_zb_interleaved
from .loop.zbh1 import plan_zbh1
from .loop.zbh2 import plan_zbh2
from .v.dualpipev import plan_dualpipev
from .v.zbv import plan_zbv, plan_zbv_half, plan_zbv_min

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
    "ZBDualPipeV": plan_dualpipev,
    "ZBInterleaved": plan_zb_interleaved,
    "Continuous": plan_continuous,
}

#: torch's built-in schedules, by the class name ``torch.distributed.pipelining`` gives them
#: (without ``Schedule``); :func:`zbpipe.plan` builds them as ``"torch:<Name>"``.
TORCH_SCHEDULES: tuple[str, ...] = (
    "1F1B",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "GPipe",
    "DualPipeV",
)


TORCH_PREFIX = "torch:"


def known_names() -> list[str]:
    """Every name :func:`zbpipe.plan` accepts: zbpipe's (which :func:`plan` here builds), then
    torch's as ``torch:<Name>``."""
    return list(GENERATORS) + [f"{TORCH_PREFIX}{n}" for n in TORCH_SCHEDULES]


def torch_schedule_name(name: str) -> str | None:
    """torch's schedule name for ``"torch:<Name>"`` (any case), e.g. ``"ZBVZeroBubble"``; None for
    a name without the ``torch:`` prefix. An unknown ``torch:`` name is a ValueError listing the
    known names."""
    key = name.strip().lower()
    if not key.startswith(TORCH_PREFIX):
        return None
    wanted = key[len(TORCH_PREFIX) :]
    for torch_name in TORCH_SCHEDULES:
        if torch_name.lower() == wanted:
            return torch_name
    raise _unknown(name)


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"unknown schedule {name!r}; known names (case-insensitive): {', '.join(known_names())}"
    )


def plan(
    name: str,
    num_ranks: int,
    n_microbatches: int,
    costs: Costs | None = None,
    memory_limit: float | None = None,
    **options: object,
) -> Plan:
    """Build zbpipe's plan called ``name`` (case-insensitive), e.g. ``plan("ZBH1", 8, 24)``.

    torch's schedules (``"torch:ZBVZeroBubble"``) are built by :func:`zbpipe.plan`, which takes the
    same arguments: a ``torch:`` name here is a ValueError saying so. ``refine=True`` improves the
    plan with the exact MILP (:func:`zbpipe.planning.search.milp.refine`, needs scipy);
    ``refine_time_limit`` bounds it in seconds, ``refine_objective`` is ``"makespan"`` (default) or
    ``"span"`` (the bubble rate's). The proven lower bound and the gap are in
    ``result.meta["refine"]``.
    """
    refine = bool(options.pop("refine", False))
    refine_time_limit = float(cast(float, options.pop("refine_time_limit", 30.0)))
    refine_objective = str(options.pop("refine_objective", "makespan"))
    if refine_objective not in ("makespan", "span"):
        raise ValueError(f"refine_objective must be 'makespan' or 'span', got {refine_objective!r}")
    if torch_schedule_name(name) is not None:
        raise ValueError(
            f"{name!r} is torch's schedule, whose order torch's own code generates: call "
            f"zbpipe.plan({name!r}, ...) (the plan layer zbpipe.planning never imports torch)"
        )
    key = name.strip().lower()
    for gen_name, gen in GENERATORS.items():
        if gen_name.lower() == key:
            _check_options(gen_name, gen, options)
            result = gen(
                num_ranks, n_microbatches, costs=costs, memory_limit=memory_limit, **options
            )
            if refine and result.pairs:
                raise ValueError(
                    f"plan {gen_name!r}: refine=True does not model overlapped pairs; drop refine"
                )
            if refine:
                from .search.milp import refine as refine_plan

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
    raise _unknown(name)


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
