"""Ranks agreeing on one value: a digest of the configuration, gathered once, compared.

The schedules' one deliberate communication at construction (:func:`check_peers_agree`) and the
profile-guided re-plan's check that every rank chose the same plan both use these.
"""

from __future__ import annotations

from typing import Any

from ..planning import Plan


def config_fingerprint(cls: type, n_microbatches: int, num_stages: int, plan: Plan) -> str:
    """A short digest of what every rank must agree on (schedule, sizes, the plan itself)."""
    import hashlib

    text = f"{cls.__name__}|{n_microbatches}|{num_stages}|{plan.name}|" + ";".join(
        f"{r}:" + ",".join(map(str, plan.order[r])) for r in sorted(plan.order)
    )
    if plan.pairs:  # the same order with other pairs runs other actions (OVERLAP_F_B)
        text += "|pairs:" + ",".join(f"{f}+{b}" for f, b in sorted(plan.pairs))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_peers_agree(cls: type, group: Any, rank: int, fingerprint: str, summary: str) -> None:
    """Exchange the configuration fingerprint with every pipeline rank; raise if any differs.

    This is the one deliberate communication at construction: without it, ranks that disagree
    (different n_microbatches, schedule or plan) would block forever at their first mismatched
    send. A peer that never constructs its schedule ends this call at the process group's timeout.
    """
    lines = disagreement(group, rank, fingerprint, summary)
    if lines:
        raise ValueError(
            f"{cls.__name__}: pipeline ranks disagree on the schedule configuration:\n{lines}\n"
            "construct the same schedule with the same n_microbatches, options and costs "
            "on every rank"
        )


def disagreement(group: Any, rank: int, value: str, shown: str) -> str | None:
    """All-gather ``value`` over ``group``: None if the ranks agree, else one line per rank
    showing its ``shown``.
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (rank, value, shown), group=group)
    if len({v for _, v, _ in gathered}) == 1:
        return None
    return "\n".join(f"  rank {r}: {s}" for r, _, s in sorted(gathered))
