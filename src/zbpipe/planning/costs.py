"""Per-stage costs: the cost model every plan generator and the simulator share.

Times are in any one unit (the paper's unit: one F of one stage = 1). Memory is in any one
unit too and is *signed*: ``mem_f`` is what a forward allocates, ``mem_b`` and ``mem_w`` are
the changes at the input-gradient and weight-gradient passes (usually <= 0). A fused backward
(BW) changes memory by ``mem_b + mem_w``. Everything a microbatch allocates is freed once its
backward is complete: ``mem_f + mem_b + mem_w == 0``.

``Costs`` describe one pipeline *stage* (one model chunk). A model split into 2p chunks for a
V schedule has half the per-chunk cost of the same model split into p stages: comparisons keep
the model fixed, not the chunk.

``a2a`` is the time one F, and one B, of a stage spends in its own collectives (an MoE layer's
expert all-to-all: dispatch and combine): the rank waits for them, so an F takes ``f + a2a``, a
B ``b + a2a`` and a fused BW ``b + w + a2a``, except inside an overlapped pair, where each
half's collectives hide behind the other half's compute (:func:`pair_time`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from .core import EPS

Number = int | float
PerStage = Number | Sequence[Number]


@dataclass(frozen=True)
class StageCosts:
    """The costs of one stage, all scalars."""

    f: float
    b: float
    w: float
    comm: float
    mem_f: float
    mem_b: float
    mem_w: float
    a2a: float = 0.0

    # ``time`` and ``mem`` run once per action in every simulation: plain comparisons, no dict.
    def time(self, kind: str) -> float:
        """Duration of one action of ``kind`` (F, B, W or BW) on this stage, its own
        collectives (``a2a``) waited for."""
        if kind == "F":
            return self.f + self.a2a
        if kind == "B":
            return self.b + self.a2a
        if kind == "W":
            return self.w
        if kind == "BW":
            return self.b + self.w + self.a2a
        raise KeyError(kind)

    def compute(self, kind: str) -> float:
        """The compute part of :meth:`time`: without the collectives' wait."""
        if kind == "BW":
            return self.b + self.w
        return {"F": self.f, "B": self.b, "W": self.w}[kind]

    def mem(self, kind: str) -> float:
        """Change in activation memory when an action of ``kind`` ends (F allocates at start)."""
        if kind == "F":
            return self.mem_f
        if kind == "B":
            return self.mem_b
        if kind == "W":
            return self.mem_w
        if kind == "BW":
            return self.mem_b + self.mem_w
        raise KeyError(kind)


@dataclass(frozen=True)
class Costs:
    """Costs of the pipeline's stages: each field is a scalar (every stage alike) or a list.

    Examples: ``Costs()`` (unit costs), ``Costs(f=1, b=1.2, w=0.6, comm=0.05)``,
    ``Costs(f=[1, 1, 1, 1.3])`` (a heavier last stage).
    """

    f: PerStage = 1.0
    """Forward time of one microbatch through one stage."""
    b: PerStage = 1.0
    """Input-gradient (B) time."""
    w: PerStage = 1.0
    """Weight-gradient (W) time. A fused backward takes ``b + w``."""
    comm: PerStage = 0.0
    """Point-to-point time to send one activation or gradient from this stage to its neighbour."""
    mem_f: PerStage = 1.0
    """Activation memory a forward allocates."""
    mem_b: PerStage = 0.0
    """Memory change at B (<= 0: what B frees)."""
    mem_w: PerStage = -1.0
    """Memory change at W (<= 0); ``mem_f + mem_b + mem_w`` must be 0."""
    a2a: PerStage = 0.0
    """Time one F, and one B, of this stage waits for its own collectives (an MoE layer's expert
    all-to-all); an overlapped pair hides it behind the other half's compute."""

    def __post_init__(self) -> None:
        for fld in fields(self):
            value = getattr(self, fld.name)
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, fld.name, tuple(float(v) for v in value))
                if not values:
                    raise ValueError(f"Costs.{fld.name} is an empty list; give one value per stage")
            for v in values:
                if (
                    isinstance(v, bool)
                    or not isinstance(v, (int, float))
                    or math.isnan(v)
                    or math.isinf(v)
                ):
                    raise ValueError(f"Costs.{fld.name} must be finite numbers, got {value!r}")
                if fld.name in ("f", "b", "w", "comm", "mem_f", "a2a") and v < 0:
                    raise ValueError(f"Costs.{fld.name} must be >= 0, got {value!r}")
        lengths = {
            len(getattr(self, f.name))
            for f in fields(self)
            if isinstance(getattr(self, f.name), tuple)
        }
        if len(lengths) > 1:
            raise ValueError(
                f"Costs per-stage lists have different lengths {sorted(lengths)}; "
                "give one value per stage"
            )

    @property
    def num_stages(self) -> int | None:
        """Number of stages the per-stage lists describe, or None if all fields are scalars."""
        for fld in fields(self):
            v = getattr(self, fld.name)
            if isinstance(v, tuple):
                return len(v)
        return None

    def check(self, num_stages: int) -> None:
        """Raise ``ValueError`` if these costs cannot describe ``num_stages`` stages."""
        n = self.num_stages
        if n is not None and n != num_stages:
            raise ValueError(
                f"Costs has per-stage lists of length {n} but the plan has {num_stages} stages; "
                f"give {num_stages} values or a scalar"
            )
        for s in range(num_stages):
            c = self.stage(s)
            total = c.mem_f + c.mem_b + c.mem_w
            if abs(total) > EPS * max(1.0, abs(c.mem_f)):
                raise ValueError(
                    f"Costs for stage {s}: mem_f + mem_b + mem_w = {total}, must be 0 "
                    "(everything a forward allocates is freed by its backward)"
                )

    def stage(self, s: int) -> StageCosts:
        """The scalar costs of stage ``s``."""

        def pick(v: PerStage) -> float:
            return float(v) if isinstance(v, (int, float)) else float(v[s])

        return StageCosts(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})

    def per_stage(self, num_stages: int) -> list[StageCosts]:
        self.check(num_stages)
        return [self.stage(s) for s in range(num_stages)]

    def split(self, chunks: int) -> Costs:
        """The same model cut ``chunks`` times finer: every time and memory divided by ``chunks``.

        Communication per send stays (one activation still crosses one link); a chunk's own
        collectives (``a2a``) are divided too (each chunk holds its share of the layers).
        """
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")

        def div(v: PerStage) -> PerStage:
            if isinstance(v, (int, float)):
                return v / chunks
            return tuple(x / chunks for x in v for _ in range(chunks))

        return Costs(
            f=div(self.f),
            b=div(self.b),
            w=div(self.w),
            comm=tuple(c for c in self.comm for _ in range(chunks))
            if isinstance(self.comm, tuple)
            else self.comm,
            mem_f=div(self.mem_f),
            mem_b=div(self.mem_b),
            mem_w=div(self.mem_w),
            a2a=div(self.a2a),
        )

    def joined(self, k: int) -> Costs:
        """The inverse of :meth:`split` (to rounding): every ``k`` consecutive stages become one.

        Times and memory add up; ``comm`` is the last joined stage's (the message that leaves
        the new stage). A V schedule over ``2p`` chunks compares with 1F1B over
        ``costs.joined(2)``: the same model in ``p`` stages. Scalars describe stages all alike.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"Costs.joined: k must be an integer >= 1, got {k!r}")
        n = self.num_stages
        if n is not None and n % k:
            raise ValueError(
                f"Costs.joined({k}): the costs describe {n} stages, not a multiple of {k}"
            )

        def join(name: str, v: PerStage) -> PerStage:
            if isinstance(v, (int, float)):
                return v if name == "comm" else k * v
            if name == "comm":
                return tuple(v[k - 1 :: k])
            return tuple(sum(v[i : i + k]) for i in range(0, len(v), k))

        return Costs(**{f.name: join(f.name, getattr(self, f.name)) for f in fields(self)})

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Parse ``"f=1,b=1.2,w=0.6,comm=0.05"`` (the CLI's ``--costs``)."""
        kwargs: dict[str, float] = {}
        names = {f.name for f in fields(cls)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            if not sep or key.strip() not in names:
                raise ValueError(
                    f"--costs: expected key=value with key in {sorted(names)}, got {part!r}"
                )
            try:
                kwargs[key.strip()] = float(val)
            except ValueError:
                raise ValueError(f"--costs: {key.strip()} must be a number, got {val!r}") from None
        return cls(**kwargs)


def pair_time(first: StageCosts, second: StageCosts, second_kind: str) -> float:
    """How long an overlapped pair runs: F of a stage with costs ``first`` and a backward
    (``second_kind``: B or BW) of a stage with costs ``second``.

    Their halves interleave at the collectives, so each half's collectives wait while the other
    half computes: only what the other half's compute cannot cover is still waited for,
    ``f + b + max(0, a2a_F - b) + max(0, a2a_B - f)`` (``b + w`` for a BW). With no
    collectives a pair takes what its two actions take one after the other.
    """
    f, b = first.compute("F"), second.compute(second_kind)
    return f + b + max(0.0, first.a2a - b) + max(0.0, second.a2a - f)
