"""torch's own schedule orders, generated without a process group."""

from __future__ import annotations

from typing import Any

# --- torch's own schedule orders, generated without a process group -------------------------------


def single_stage_order(cls: type, num_stages: int, n_microbatches: int) -> dict[int, list[Any]]:
    """rank -> torch's action list for single-stage schedule ``cls`` (``_get_pipeline_order``).

    Built on ``cls.__new__(cls)`` (its ``__init__`` wants a real stage), given only what that
    method reads.
    """
    # For a bare ``type`` mypy checks ``type.__new__``; at run time this is the class's own.
    sched = cls.__new__(cls)  # type: ignore[call-overload]
    sched._num_stages, sched._n_microbatches = num_stages, n_microbatches
    order: dict[int, list[Any]] = sched._get_pipeline_order()
    return order


def multi_stage_rank_orders(
    cls: type,
    num_ranks: int,
    n_microbatches: int,
    stages_per_rank: int,
    rounds: int | None = None,
) -> dict[int, list[Any]]:
    """rank -> torch's action list for multi-stage schedule ``cls`` on each rank
    (``_calculate_single_rank_operations``), built on ``cls.__new__(cls)`` (its ``__init__``
    wants real stages) given only what that method reads. ``rounds``: the number of rounds of
    the interleaved loop schedules (``n_microbatches`` must be a multiple of it).
    """
    sched = cls.__new__(cls)  # type: ignore[call-overload]  # as above
    sched.pp_group_size, sched.n_local_stages = num_ranks, stages_per_rank
    sched._n_microbatches = n_microbatches
    sched.num_stages = sched._num_stages = num_ranks * stages_per_rank
    if rounds is not None:
        sched.number_of_rounds, sched.microbatches_per_round = rounds, n_microbatches // rounds
    return {r: sched._calculate_single_rank_operations(r) for r in range(num_ranks)}
