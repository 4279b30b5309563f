"""Post-validated optimizer step: global grad-norm clipping and NaN/Inf check with no barrier.

A pipeline stage that clips by the *global* gradient norm, or skips a step when any stage saw
an inf/NaN, normally waits for an all-reduce over every stage before its optimizer step: a
barrier that turns the pipeline's staggered finish into a bubble at every mini-batch. Zero
Bubble (Qi et al., ICLR 2024, Section 4) removes it: step optimistically on what is already
known, validate later, and in the rare case the guess was wrong, roll back and redo.

Protocol (stages are the ranks of ``group`` in pipeline order; backward ends on the last first):

1. **Local state.** Each stage sums the squares of its gradients (float64) and counts
   non-finite values: ``(sq, bad)``.
2. **Partial reduction along the chain.** Group rank ``P - 1`` starts; rank ``i`` receives the
   running ``(sq, bad)`` of ranks ``i+1..P-1`` from rank ``i + 1`` (a blocking receive from its
   downstream neighbour only, which finished its backward earlier), adds its own and posts a
   non-blocking send to rank ``i - 1``. Rank 0 thus holds the full global state, rank ``P - 1``
   only its own.
3. **Optimistic step.** If the partial ``bad > 0`` the step is skipped here and now (a partial
   non-finite is final). Otherwise the stage snapshots its parameters, optimizer state and (if
   clipping) gradients, scales its gradients in place by ``min(1, max_norm / (norm + 1e-6))`` of
   the *partial* norm (``torch.nn.utils.clip_grad_norm_``'s formula) and steps.
4. **Validation.** Rank 0 then broadcasts the full ``(sq, bad)`` (asynchronously: the other
   ranks' receives were posted at their step, nobody waits). :meth:`validate` waits for it:
   a non-finite anywhere -> restore the snapshot (skip on all stages); a clip coefficient
   different from the optimistic one -> restore and redo the step with the global coefficient
   (from the snapshot's gradients); else drop the snapshot. Every stage uses the same broadcast
   sum, so all agree bitwise on the coefficient, and rank 0 never rolls back (no snapshot).

Call :meth:`validate` before the next forward reads these parameters (the runtime does it
right before the stage's first F of the next mini-batch); :meth:`step` also validates a step
still pending. The snapshot is an on-device copy of the stage's parameters, optimizer state
(AdamW: 2 tensors per parameter) and gradients when clipping: about 4x the parameter memory
for AdamW, held from the step to its validation. The restore is ``copy_`` / re-binding of the
cloned tensors, so a rolled-back state is bitwise the state before the step (no algebraic
inverse). After a redo, ``p.grad`` still holds the optimistically scaled gradients (the redo
uses the snapshot's). Hyperparameters in ``param_groups`` are not snapshotted: change them (LR
schedulers) after :meth:`validate`.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_TAG = 7021  # point-to-point tag of the chain, apart from the pipeline's activations (tag 0)


@dataclass(frozen=True)
class StepReport:
    """What validation decided for one step."""

    status: Literal["ok", "redone", "skipped"]
    """ok: the optimistic step stands; redone: rolled back and redone; skipped: non-finite grads."""
    global_norm: float
    """The gradient norm over all stages (inf or nan if any gradient was non-finite)."""
    clip_coef: float
    """The coefficient the step finally used (1.0 without clipping)."""
    optimistic_coef: float
    """The coefficient of the optimistic step (from the partial norm)."""


def _coef(sq: float, max_norm: float | None) -> float:
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(sq) + 1e-6))


class PostValidatedStep:
    """Wrap ``optimizer`` (holding this stage's parameters) with the post-validation protocol.

    ``group``: the process group of the pipeline stages (None: the default group), group rank
    ``i`` holding stage ``i``. ``max_norm``: clip by global norm (None: no clipping).
    ``check_finite``: skip the step on every stage if any gradient is inf or NaN.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup | None = None,
        max_norm: float | None = None,
        check_finite: bool = True,
    ) -> None:
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm!r}")
        self.optimizer = optimizer
        self.group = group
        self.max_norm = max_norm
        self.check_finite = check_finite
        self._pending: dict | None = None

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _peer(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def step(self) -> None:
        """Validate any pending step, then reduce along the chain, snapshot, step optimistically."""
        if self._pending is not None:
            self.validate()
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        params = self._params()
        local = torch.zeros(2, dtype=torch.float64)
        for p in params:
            g = p.grad.detach().double()
            local[0] += g.square().sum()
            if self.check_finite:
                local[1] += (~torch.isfinite(g)).sum()
        partial = local.clone()
        if rank < world - 1:
            upstream = torch.empty(2, dtype=torch.float64)
            dist.recv(upstream, self._peer(rank + 1), group=self.group, tag=_TAG)
            partial += upstream
        send = (
            dist.isend(partial.clone(), self._peer(rank - 1), group=self.group, tag=_TAG)
            if rank > 0
            else None
        )
        bad = self.check_finite and (partial[1].item() > 0 or not math.isfinite(partial[0].item()))
        coef = math.nan if bad else _coef(partial[0].item(), self.max_norm)
        snapshot = None
        if not bad:
            # Rank 0 holds the global state already: its step is final. Without a check and
            # without clipping, nothing can invalidate a step.
            if rank > 0 and (self.check_finite or self.max_norm is not None):
                snapshot = self._snapshot(params)
            self._scale_and_step(params, [p.grad for p in params], coef)
        total = partial if rank == 0 else torch.empty(2, dtype=torch.float64)
        work = dist.broadcast(total, self._peer(0), group=self.group, async_op=True)
        self._pending = dict(
            work=work, send=send, total=total, coef=coef, bad=bad, snapshot=snapshot, params=params
        )

    def validate(self) -> StepReport | None:
        """Wait for the global state of the pending step and fix it if the guess was wrong."""
        if self._pending is None:
            return None
        pend, self._pending = self._pending, None
        pend["work"].wait()
        if pend["send"] is not None:
            pend["send"].wait()
        sq, n_bad = pend["total"].tolist()
        norm = math.sqrt(sq) if sq >= 0 else math.nan
        snap, params = pend["snapshot"], pend["params"]
        if self.check_finite and (n_bad > 0 or not math.isfinite(sq)):
            if snap is not None:
                self._restore(params, snap)
            report = StepReport("skipped", math.inf if n_bad > 0 else norm, 0.0, pend["coef"])
        else:
            coef = _coef(sq, self.max_norm)
            if pend["bad"] or coef == pend["coef"]:
                report = StepReport("ok", norm, coef, pend["coef"])
            else:
                self._restore(params, snap)
                current = [p.grad for p in params]
                # redo from the snapshot's (unscaled) gradients; the user's grads stay untouched
                try:
                    for p, g in zip(params, snap["grads"]):
                        p.grad = g
                    self._scale_and_step(params, snap["grads"], coef)
                finally:
                    for p, g in zip(params, current):
                        p.grad = g
                report = StepReport("redone", norm, coef, pend["coef"])
        if report.status != "ok":
            log.info(
                "post-validation: step %s (global norm %g, coef %g, optimistic %g)",
                report.status,
                report.global_norm,
                report.clip_coef,
                report.optimistic_coef,
            )
        return report

    def _scale_and_step(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], coef: float
    ) -> None:
        if coef != 1.0:
            coef_t = torch.tensor(coef, dtype=torch.float64)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef_t.to(g.dtype))  # the same fp32 multiply as clip_grad_norm_
        self.optimizer.step()

    def _snapshot(self, params: list[torch.Tensor]) -> dict:
        state = self.optimizer.state
        return dict(
            params=[p.detach().clone() for p in params],
            state={
                p: {
                    k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                    for k, v in state[p].items()
                }
                for p in params
                if p in state
            },
            grads=[p.grad.detach().clone() for p in params] if self.max_norm is not None else None,
        )

    def _restore(self, params: list[torch.Tensor], snap: dict) -> None:
        with torch.no_grad():
            for p, saved in zip(params, snap["params"]):
                p.copy_(saved)
        for p in params:
            self.optimizer.state.pop(p, None)  # a first step creates state: drop it
            if p in snap["state"]:
                self.optimizer.state[p] = snap["state"][p]


__all__ = ["PostValidatedStep", "StepReport"]
