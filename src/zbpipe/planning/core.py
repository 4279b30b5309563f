"""Plans: which compute action every rank runs, in which order, and where each stage lives.

A plan uses the paper's letters:

* ``F``  forward of one microbatch through one stage,
* ``B``  the input-gradient half of its backward (torch calls this ``I``),
* ``W``  the weight-gradient half of its backward,
* ``BW`` the fused full backward (torch calls this ``B``).

A plan may also mark **overlapped pairs** (``Plan.pairs``): an F directly followed, on its rank,
by a backward (B or BW) of another stage; the two run as one unit whose halves interleave, so
each half's communication hides behind the other half's compute (DualPipe's F-and-B pairs;
torch lowers them as ``OVERLAP_F_B``).

This module is pure Python and must never import torch: plan generators and the
simulator are tested by hypothesis over thousands of cases without a process group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

#: Tolerance for comparing times and memory (absolute; the cost model's units are O(1)).
EPS = 1e-9

#: The compute actions a plan is made of (the module docstring says what each one is).
KINDS: tuple[str, ...] = ("F", "B", "W", "BW")
#: The letter torch's pipelining uses for each kind (``_ComputationType`` values, CSV cells).
TORCH_LETTERS: dict[str, str] = {"F": "F", "B": "I", "W": "W", "BW": "B"}
#: How stages are laid out on ranks: ``"loop"`` (stage s on rank s % p) or ``"v"``
#: (rank r holds stages r and 2p - 1 - r). ``Plan.placement`` is the stage-to-rank map itself.
Layout = Literal["loop", "v"]


@dataclass(frozen=True, order=True)
class Action:
    """One compute action: ``kind`` of ``microbatch`` on ``stage``."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action kind must be one of {KINDS}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action stage and microbatch must be >= 0, got {self!r}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


class PlanError(ValueError):
    """A plan is malformed: incomplete, out of dependency order, or deadlocking.

    The message names the rank and the step (index in that rank's order) that broke.
    """


def loop_placement(num_ranks: int, num_stages: int) -> dict[int, int]:
    """Stage ``s`` on rank ``s % num_ranks`` (torch's default, 1 or more stages per rank)."""
    return {s: s % num_ranks for s in range(num_stages)}


def v_placement(num_ranks: int) -> dict[int, int]:
    """``2 * num_ranks`` stages in a V: rank ``r`` holds stages ``r`` and ``2p - 1 - r``."""
    placement = {}
    for r in range(num_ranks):
        placement[r] = r
        placement[2 * num_ranks - 1 - r] = r
    return placement


@dataclass(frozen=True)
class Plan:
    """For each rank, the ordered compute actions it runs; plus the stage-to-rank placement
    (``placement``, a dict) and its shape (``layout``, ``"loop"`` or ``"v"``).

    ``order`` has no ``None`` padding: idle time exists only in the simulator's timed output.
    """

    name: str
    num_ranks: int
    n_microbatches: int
    placement: Mapping[int, int]
    order: Mapping[int, tuple[Action, ...]]
    layout: Layout = "loop"
    meta: Mapping[str, object] = field(default_factory=dict, compare=False)
    pairs: frozenset[tuple[Action, Action]] = frozenset()
    """Overlapped pairs ``(f, b)``: the F action ``f`` and the backward ``b`` (B or BW) of another
    stage that directly follows it on their rank run as one unit, their halves interleaved (see
    the module docstring). Empty for plans without overlap."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", dict(sorted(self.placement.items())))
        object.__setattr__(
            self, "order", {r: tuple(self.order.get(r, ())) for r in range(self.num_ranks)}
        )
        object.__setattr__(self, "pairs", frozenset(self.pairs))

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """Stage indices held by ``rank``, ascending."""
        return [s for s, r in self.placement.items() if r == rank]

    def uses_split_backward(self) -> bool:
        return any(a.kind in ("B", "W") for acts in self.order.values() for a in acts)

    def paired_first(self) -> frozenset[Action]:
        """The F actions that start an overlapped pair (their backward follows them)."""
        return frozenset(f for f, _ in self.pairs)

    def without_pairs(self) -> Plan:
        """The same order with every pair run as two plain actions, one after the other."""
        return dataclasses.replace(self, pairs=frozenset()) if self.pairs else self

    def validate(self) -> None:
        """Static checks: placement, completeness, and per-stage F < B < W order.

        Cross-rank properties (deadlock freedom, memory) are checked by ``simulate``.
        """
        validate_structure(self)

    def __str__(self) -> str:
        return format_grid(self)


def validate_structure(plan: Plan) -> None:
    p, m = plan.num_ranks, plan.n_microbatches
    if p < 1 or m < 1:
        raise PlanError(
            f"plan {plan.name}: num_ranks and n_microbatches must be >= 1, got {p}, {m}"
        )
    stages = sorted(plan.placement)
    if stages != list(range(len(stages))):
        raise PlanError(f"plan {plan.name}: stages must be 0..S-1, got {stages}")
    for s, r in plan.placement.items():
        if not 0 <= r < p:
            raise PlanError(f"plan {plan.name}: stage {s} placed on rank {r}, outside 0..{p - 1}")
    seen: dict[tuple[int, str, int], int] = {}
    done_kinds: dict[tuple[int, int], set[str]] = {}
    placement = plan.placement
    for rank, actions in plan.order.items():
        for step, a in enumerate(actions):
            stage, kind, mb = a.stage, a.kind, a.microbatch
            # every check is a comparison; the message is only built for the one that fails
            if stage not in placement:
                raise _step_error(plan, rank, step, a, f"stage {stage} does not exist")
            if placement[stage] != rank:
                raise _step_error(
                    plan, rank, step, a, f"stage {stage} lives on rank {placement[stage]}"
                )
            if mb >= m:
                raise _step_error(plan, rank, step, a, f"microbatch {mb} >= n_microbatches {m}")
            key = (stage, kind, mb)
            if key in seen:
                raise _step_error(plan, rank, step, a, f"duplicate, first at step {seen[key]}")
            done = done_kinds.get((stage, mb))
            if done is None:
                done = done_kinds[(stage, mb)] = set()
            if kind in ("B", "BW") and "F" not in done:
                raise _step_error(plan, rank, step, a, "backward before its forward")
            if kind == "W" and "B" not in done:
                raise _step_error(
                    plan, rank, step, a, "weight gradient before its input gradient B"
                )
            if kind in ("B", "BW") and ("B" in done or "BW" in done):
                raise _step_error(plan, rank, step, a, "second backward for the same microbatch")
            seen[key] = step
            done.add(kind)
    for s in stages:
        for mb in range(m):
            kinds = done_kinds.get((s, mb), set())
            if kinds not in ({"F", "BW"}, {"F", "B", "W"}):
                missing = "F and BW, or F, B and W"
                raise PlanError(
                    f"plan {plan.name}: stage {s} microbatch {mb} has {sorted(kinds)}; "
                    f"needs {missing}"
                )
    validate_pairs(plan)


def validate_pairs(plan: Plan) -> None:
    """Each pair is an F directly followed on its rank by a B or BW of another stage; no action
    is in two pairs."""
    if not plan.pairs:
        return
    where = {a: (rank, step) for rank, acts in plan.order.items() for step, a in enumerate(acts)}
    used: set[Action] = set()
    for f, b in sorted(plan.pairs):
        if f not in where or b not in where:
            raise PlanError(f"plan {plan.name}: pair ({f}, {b}) names an action the plan lacks")
        rank, step = where[f]
        what = None
        if f.kind != "F" or b.kind not in ("B", "BW"):
            what = "a pair is an F and then a B or BW"
        elif where[b] != (rank, step + 1):
            what = f"{b} must directly follow {f} on rank {rank}"
        elif f.stage == b.stage:
            what = "a pair's F and backward must be of different stages"
        elif f in used or b in used:
            what = "an action can be in one pair only"
        if what is not None:
            raise _step_error(plan, rank, step, f, f"pair ({f}, {b}): {what}")
        used.update((f, b))


def _step_error(plan: Plan, rank: int, step: int, a: Action, what: str) -> PlanError:
    return PlanError(f"plan {plan.name}: rank {rank} step {step} ({a}): {what}")


def format_grid(plan: Plan, width: int | None = None) -> str:
    """Draw the plan as a rank-by-step grid (no timing: column k is each rank's k-th action).

    The backward of an overlapped pair is drawn with a ``+``: it runs together with the F
    before it."""
    seconds = {b for _, b in plan.pairs}
    cells = {
        r: [("+" if a in seconds else "") + str(a) for a in acts] for r, acts in plan.order.items()
    }
    w = width or max((len(c) for cs in cells.values() for c in cs), default=3)
    head = (
        f"{plan.name}: {plan.num_ranks} ranks, {plan.num_stages} stages, "
        f"{plan.n_microbatches} microbatches"
    )
    lines = [head]
    for r in range(plan.num_ranks):
        lines.append(f"rank {r:>2} | " + " ".join(c.rjust(w) for c in cells[r]))
    return "\n".join(lines)


def make_plan(
    name: str,
    num_ranks: int,
    n_microbatches: int,
    placement: Mapping[int, int],
    order: Mapping[int, Sequence[Action]],
    layout: Layout = "loop",
    pairs: Iterable[tuple[Action, Action]] = (),
    **meta: object,
) -> Plan:
    """Build and statically validate a plan (generators call this)."""
    p = Plan(
        name=name,
        num_ranks=num_ranks,
        n_microbatches=n_microbatches,
        placement=placement,
        order={r: tuple(acts) for r, acts in order.items()},
        layout=layout,
        meta=meta,
        pairs=frozenset(pairs),
    )
    p.validate()
    return p
