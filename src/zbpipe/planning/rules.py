"""The plan layer's rules, written once: every generator and the simulator use these.

* **Dependencies.** An action *needs* values and *makes* values. A value is
  ``(stage, what, microbatch)`` with ``what`` one of ``F`` (the activation an F sends on),
  ``G`` (the input gradient a B or BW sends back) and ``B`` (the input-gradient pass a W needs).
  ``F(s, m)`` needs ``F(s-1, m)``; ``B(s, m)`` and ``BW(s, m)`` need ``F(s, m)`` and the input
  gradient of ``s+1`` (the last stage needs only its F); ``W(s, m)`` needs ``B(s, m)``.
* **Memory.** What one action changes is the cost model's (:meth:`StageCosts.mem`); a rank runs
  its actions in sequence, so its memory is a prefix sum over its order whatever the timing,
  and its peak is that prefix sum's maximum.
* **Tolerance.** Times and memory are floats summed in different orders by different code;
  two values within ``EPS`` are equal, and a limit holds if it is exceeded by at most ``EPS``.

Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from .core import EPS as EPS  # re-exported: the one tolerance every rule and generator uses
from .core import Action

if TYPE_CHECKING:
    from .costs import StageCosts


#: A produced value: ``(stage, what, microbatch)``, ``what`` in ``F``, ``G``, ``B``.
Value = tuple[int, str, int]

#: Within one stage and microbatch, the order split-backward passes must run in.
_PASS_RANK = {"F": 0, "B": 1, "W": 2}


def needs(a: Action, last_stage: int) -> list[Value]:
    """The values action ``a`` waits for (``last_stage``: the plan's highest stage index)."""
    if a.kind == "F":
        return [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    if a.kind in ("B", "BW"):
        out: list[Value] = [(a.stage, "F", a.microbatch)]
        if a.stage < last_stage:
            out.append((a.stage + 1, "G", a.microbatch))
        return out
    return [(a.stage, "B", a.microbatch)]  # W


def makes(a: Action) -> list[Value]:
    """The values action ``a`` produces when it ends."""
    if a.kind == "F":
        return [(a.stage, "F", a.microbatch)]
    if a.kind == "B":
        return [(a.stage, "G", a.microbatch), (a.stage, "B", a.microbatch)]
    if a.kind == "BW":
        return [(a.stage, "G", a.microbatch)]
    return []  # W feeds nothing


def producers(actions: Iterable[Action]) -> dict[Value, Action]:
    """Which action makes each value, over a plan's ``actions``."""
    return {value: a for a in actions for value in makes(a)}


def describe(value: Value) -> str:
    """A value in words, for error messages."""
    stage, what, mb = value
    return {
        "F": f"the activation of F{mb} from stage {stage}",
        "G": f"the input gradient of microbatch {mb} from stage {stage} (its B or BW)",
        "B": f"B{mb} of stage {stage}",
    }[what]


def forced_before(a: Action, b: Action) -> bool:
    """Must ``a`` run before ``b`` on their shared stage, whatever the schedule?

    F before B before W of one microbatch; and, by the convention every generator and the
    runtime keep (it removes symmetric solutions), one kind's microbatches in increasing order.
    """
    if a.microbatch == b.microbatch:
        return _PASS_RANK[a.kind] < _PASS_RANK[b.kind]
    if a.kind == b.kind:
        return a.microbatch < b.microbatch
    return False


def memory_after_each(actions: Iterable[Action], stage_costs: Sequence[StageCosts]) -> list[float]:
    """A rank's activation memory after each of its ``actions`` (a prefix sum from 0)."""
    mem, out = 0.0, []
    for a in actions:
        mem += stage_costs[a.stage].mem(a.kind)
        out.append(mem)
    return out


def peak_memory(actions: Iterable[Action], stage_costs: Sequence[StageCosts]) -> float:
    """The highest activation memory a rank reaches running ``actions`` in order (at least 0)."""
    return max([0.0, *memory_after_each(actions, stage_costs)])


def within(value: float, limit: float) -> bool:
    """``value <= limit`` up to the tolerance ``EPS``."""
    return value <= limit + EPS


def fits(
    orders: Mapping[int, Sequence[Action]], stage_costs: Sequence[StageCosts], limit: float
) -> bool:
    """Does every rank's order stay within the memory ``limit``?"""
    return all(within(peak_memory(acts, stage_costs), limit) for acts in orders.values())


def first_overflow(
    actions: Sequence[Action], stage_costs: Sequence[StageCosts], limit: float
) -> tuple[int, float] | None:
    """``(step, memory)`` of the first action that takes the rank above ``limit``, or None."""
    for step, mem in enumerate(memory_after_each(actions, stage_costs)):
        if not within(mem, limit):
            return step, mem
    return None


def check_sizes(num_ranks: int, n_microbatches: int) -> None:
    """Every generator's first check: a ``ValueError`` naming the size that is not >= 1."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
