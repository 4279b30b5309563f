"""The differences between the torches zbpipe supports (2.11 - 2.15), one shim per difference,
detected by feature, and the ``step()`` body shared by every torch."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _batch_p2p,
    _wait_batch_p2p,
)
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime as _TorchPipelineScheduleRuntime,
)

# =====================================================================================
# torch 2.11 - 2.15 differences (issue 14). One shim per difference, detected by feature.
# Call sites: schedules/runtime.py and continuous/schedule.py inherit the base classes below;
# observe/profile.py (message sizes) and schedules/stage_seam.py (the number of stage inputs)
# read the tensor metadata through stage_message_bytes and num_stage_inputs, which use stage_metas.
# =====================================================================================

#: torch >= 2.13 threads ``loss_kwargs`` from ``step()`` to the loss function; 2.11 has none
#: (``step(**kwargs)`` would hand it to the model as a keyword).
TORCH_HAS_LOSS_KWARGS = (
    "loss_kwargs" in inspect.signature(_TorchPipelineScheduleRuntime._step_microbatches).parameters
)
#: torch >= 2.13 warms up point-to-point links with a vote that skips stages on the same rank;
#: 2.11 sends a dummy tensor to every neighbour stage, its own rank included, which gloo (and
#: a one-rank pipeline) cannot do: V placement, where stages p-1 and p share a rank, fails.
TORCH_SENDS_TO_LOCAL_NEIGHBOURS = not hasattr(PipelineScheduleMulti, "_initialize_pp_stages")


def stage_metas(stage: Any, which: str) -> tuple[Any, ...]:
    """A stage's inferred tensor metadata, ``which`` = ``"inputs"`` or ``"outputs"``.

    torch >= 2.13 keeps it in ``stage._stage_meta.inputs/.outputs``; 2.11 in
    ``stage.inputs_meta`` and ``stage._outputs_meta``. Empty before the first step.
    """
    meta = getattr(stage, "_stage_meta", None)
    if meta is not None:
        return tuple(getattr(meta, which, None) or ())
    legacy = {"inputs": "inputs_meta", "outputs": "_outputs_meta"}[which]
    return tuple(getattr(stage, legacy, None) or ())


class _LocalNeighbourInit:
    """torch 2.11's ``PipelineScheduleMulti._initialize_stages`` without sends to its own rank.

    The only change from torch's body: the first, link-warming batch of point-to-point ops
    leaves out neighbours on this rank (they exchange shapes through return values, as
    torch's shape inference already does for them).
    """

    # Set by the torch schedule this mixin is combined with (declared for the type checker).
    _stages: list[Any]
    _n_microbatches: int
    _has_backward: bool
    _stages_forward_initialized: bool
    _stages_backward_initialized: bool

    def _initialize_stages(self, args: Any, kwargs: Any, target: Any = None) -> None:
        if not self._stages_forward_initialized:
            ops = [
                op
                for stage in self._stages
                for op in stage._get_init_p2p_neighbors_ops()
                if op.group_peer != stage.group_rank
            ]
            if ops:
                _wait_batch_p2p(_batch_p2p(ops))
            next_stage_args: tuple[Any, ...] = ()
            for stage in self._stages:
                stage_args = args if stage.is_first else next_stage_args
                next_stage_args = stage._prepare_forward_infra(
                    self._n_microbatches, stage_args, kwargs
                )
            self._stages_forward_initialized = True
        if self._has_backward and not self._stages_backward_initialized:
            for stage in self._stages:
                stage._prepare_backward_infra(self._n_microbatches)
            self._stages_backward_initialized = True


class _LossKwargs:
    """``loss_kwargs`` on a torch whose schedules have none (2.11).

    zbpipe's runtime passes them to ``_maybe_compute_loss`` itself (``step()`` keeps them; see
    ``run_microbatches``); torch's own methods are called with the arguments they take.
    """

    # Set by the torch schedule this mixin is combined with (declared for the type checker).
    _loss_fn: Callable[..., Any] | None
    _internal_losses: list[Any]

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return super()._step_microbatches(  # type: ignore[misc]
            arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs
        )

    def _maybe_compute_loss(
        self, stage: Any, output: Any, target_mbs: Any, mb_index: int, loss_kwargs: Any = None
    ) -> None:
        if not loss_kwargs:
            return super()._maybe_compute_loss(stage, output, target_mbs, mb_index)  # type: ignore[misc,no-any-return]
        if stage.is_last and self._loss_fn is not None:  # torch 2.11's body, with the keywords
            loss = self._loss_fn(output, target_mbs[mb_index], **loss_kwargs)
            self._internal_losses.append(loss)
        return None


def initialize_stages(
    sched: Any, args: Any, kwargs: Any, target: Any, loss_kwargs: dict[str, Any] | None
) -> None:
    """What torch's action loop does first: shape inference and link warm-up on the first step
    (``_initialize_stages``; torch 2.11's takes the first microbatch's inputs only)."""
    if TORCH_HAS_LOSS_KWARGS:
        sched._initialize_stages(args, kwargs, target, loss_kwargs)
    else:
        sched._initialize_stages(args, kwargs)


def _shimmed(base: type) -> type:
    """``base`` with the mixins this torch needs (``base`` itself on torch >= 2.13)."""
    mixins: list[type] = []
    if not TORCH_HAS_LOSS_KWARGS:
        mixins.append(_LossKwargs)
    if TORCH_SENDS_TO_LOCAL_NEIGHBOURS:
        mixins.append(_LocalNeighbourInit)
    if not mixins:
        return base
    return type(base.__name__, (*mixins, base), {"__module__": __name__})


def with_local_stage_init(cls: type) -> type:
    """torch's multi-stage schedule ``cls``, able to initialise stages that share a rank.

    ``cls`` itself where torch can (>= 2.13); on torch 2.11 a subclass whose stage
    initialisation skips the sends to its own rank, so torch's own schedules can run as a
    one-rank pipeline too (benchmarks/gpu.py compares them with zbpipe's there). Their compute
    is untouched.
    """
    if not TORCH_SENDS_TO_LOCAL_NEIGHBOURS:
        return cls
    return type(cls.__name__, (_LocalNeighbourInit, cls), {"__module__": cls.__module__})


#: The bases zbpipe's schedules inherit: torch's classes, plus the shims above where needed.
_PipelineScheduleRuntime = _shimmed(_TorchPipelineScheduleRuntime)
PipelineScheduleMultiBase = _shimmed(PipelineScheduleMulti)


# ---------------------------------------------------------------- step() contract (issue 12)
# torch 2.14's PipelineScheduleMulti.step() also takes microbatches already split (arg_mbs,
# kwarg_mbs, target_mbs); torch 2.13's takes only a whole batch. zbpipe's schedules split (or
# take) the microbatches themselves (zbpipe.schedules.inputs) and run them here, the body both
# torch versions' step() share after splitting, so the accepted arguments never depend on the
# installed torch.
def run_microbatches(
    sched: PipelineScheduleMulti,
    arg_mbs: list[Any],
    kwarg_mbs: list[Any],
    target_mbs: list[Any] | None,
    losses: list[Any] | None,
    return_outputs: bool,
    loss_kwargs: dict[str, Any] | None,
) -> object:
    """What torch's ``PipelineScheduleMulti.step`` does once its inputs are microbatches."""
    import torch

    if sched._has_backward and sched._backward_requires_autograd and not torch.is_grad_enabled():
        raise RuntimeError(
            f"{type(sched).__name__}.step() runs a backward and needs autograd; "
            "do not call it under torch.no_grad() (call eval() for a forward-only step)"
        )
    for stage in sched._stages:
        stage.has_backward = sched._has_backward
        stage.clear_runtime_states()
    sched._step_microbatches(
        arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
    )
    for stage in sched._stages:
        if stage.is_last and return_outputs:
            if _differ_past_dim0(stage.output_chunks):
                # microbatches of different lengths (zbpipe.schedules.varlen): no one batch
                # holds them, so the outputs come back as a list, one per microbatch
                return list(stage.output_chunks)
            return sched._merge_outputs(stage.output_chunks)
    return None


def _differ_past_dim0(chunks: list[Any]) -> bool:
    """Whether the microbatches' outputs differ in a dimension other than the first (so
    torch's concatenation along dim 0 cannot merge them)."""
    import torch
    from torch.utils._pytree import tree_flatten

    shapes = set()
    for chunk in chunks:
        leaves, _ = tree_flatten(chunk)
        shapes.add(tuple(tuple(t.shape[1:]) for t in leaves if isinstance(t, torch.Tensor)))
    return len(shapes) > 1


# ---------------------------------------------------------------- end of step() contract
