"""Every private torch name zbpipe relies on, in one place.

torch.distributed.pipelining keeps its action IR and its action runtime private. A torch
upgrade that renames them should touch this file only; the rest of zbpipe imports from here.
Tested against torch 2.13.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.pipelining.schedules import (  # noqa: F401  (re-exported)
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    _Action,
    _batch_p2p,
    _ComputationType,
    _PipelineContext,
    _wait_batch_p2p,
)
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime as _TorchPipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import PipelineStage, _PipelineStageBase  # noqa: F401

from .planning.core import TORCH_LETTERS

FORWARD = _ComputationType.FORWARD
BACKWARD_INPUT = _ComputationType.BACKWARD_INPUT
BACKWARD_WEIGHT = _ComputationType.BACKWARD_WEIGHT
FULL_BACKWARD = _ComputationType.FULL_BACKWARD
REDUCE_GRAD = _ComputationType.REDUCE_GRAD

#: zbpipe's paper letters -> torch's computation types (lossless both ways).
KIND_TO_TORCH = {kind: _ComputationType.from_str(t) for kind, t in TORCH_LETTERS.items()}
TORCH_TO_KIND = {v: k for k, v in KIND_TO_TORCH.items()}


def stage_message_bytes(stage: _PipelineStageBase, which: str) -> int:
    """Bytes of one microbatch's activations a stage receives (``"inputs"``) or sends (``"outputs"``).

    Read from the tensor metadata torch infers on the first step (private: see
    :func:`stage_metas`); 0 before that. Used by :mod:`zbpipe.profile` to time messages of the
    real size.
    """
    metas = stage_metas(stage, which)
    total = 0
    for meta in metas:
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if shape is not None and dtype is not None:
            total += shape.numel() * dtype.itemsize
    return total


# --- what the stage seam reads from a torch PipelineStage ---------------------------------------


def received_grads(stage: _PipelineStageBase, mb: int) -> tuple:
    """The output gradients a stage received for microbatch ``mb`` (torch's receive buffers)."""
    return stage._retrieve_recv_grads(mb)


def received_activations(stage: _PipelineStageBase, mb: int) -> tuple:
    """The activations a stage received for microbatch ``mb`` (torch's receive buffers)."""
    return stage._retrieve_recv_activations(mb)


def num_stage_inputs(stage: _PipelineStageBase) -> int:
    """How many positional inputs the stage's forward takes (from torch's shape inference)."""
    return len(stage_metas(stage, "inputs"))


# --- V placement: what torch's stage keeps of a local hand-off ----------------------------------
# ``set_local_fwd_input`` / ``set_local_bwd_input`` store the handed tensors in the receiving
# stage's receive infos (``args_recv_info[mb]`` / ``grad_recv_info[mb]``, ``_RecvInfo.buffer``)
# and nothing clears them: each stays until the next step hands over the same microbatch. The
# forward one is a detached alias of the sending stage's output, so m activations (and m input
# gradients) per local hand-off outlived every step. A buffer filled by a point-to-point receive
# is allocated once and reused by every step's ``irecv``: it must stay.


def drop_local_inputs(stage: _PipelineStageBase, mb: int | None, *, fwd: bool, bwd: bool) -> None:
    """Forget the tensors a stage on this rank handed ``stage`` for ``mb`` (None: every mb).

    ``fwd``: the activations (call only when the previous stage is on this rank); ``bwd``: the
    output gradients (only when the next stage is). The next hand-off sets them again.
    """
    for table, wanted in ((stage.args_recv_info, fwd), (stage.grad_recv_info, bwd)):
        if not wanted:
            continue
        for infos in table.values() if mb is None else (table.get(mb, ()),):
            for info in infos:
                if not info.is_root_arg:
                    info.buffer = None


def set_local_bwd_input(stage: _PipelineStageBase, grads: tuple, mb: int) -> None:
    """``stage.set_local_bwd_input(grads, mb)`` after :func:`drop_local_inputs` emptied its buffers.

    torch answers a None gradient by zeroing the buffer the last hand-off left (and reads it as
    the zero output gradient); once dropped there is none, so a zero one is made from the metadata.
    """
    for info, g in zip(stage.grad_recv_info[mb], grads, strict=True):
        meta = info.tensor_meta
        if g is None and info.buffer is None and meta is not None and not info.is_root_arg:
            info.buffer = torch.zeros(meta.shape, dtype=meta.dtype, device=stage.device)
    stage.set_local_bwd_input(grads, mb)


def post_accumulate_grad_hooks(t: Any) -> dict | None:
    """The dict of ``t``'s post-accumulate-grad hooks (autograd reads it when the hooks run)."""
    return getattr(t, "_post_accumulate_grad_hooks", None)


def has_post_accumulate_grad_hooks(t: Any) -> bool:
    """Whether ``register_post_accumulate_grad_hook`` put a hook on the leaf ``t``."""
    return bool(post_accumulate_grad_hooks(t))


def has_grad_hooks(t: Any) -> bool:
    """Whether ``t.register_hook`` put a hook on ``t``'s gradient (autograd calls it first)."""
    return bool(getattr(t, "_backward_hooks", None))


# =====================================================================================
# torch 2.11 - 2.15 differences (issue 14). One shim per difference, detected by feature.
# Call sites: runtime.py and continuous.py inherit the base classes below; runtime.py and
# continuous.py read input metadata through stage_metas.
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


def stage_metas(stage: Any, which: str) -> tuple:
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
            next_stage_args: tuple = ()
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

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
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
            return super()._maybe_compute_loss(stage, output, target_mbs, mb_index)  # type: ignore[misc]
        if stage.is_last and self._loss_fn is not None:  # torch 2.11's body, with the keywords
            loss = self._loss_fn(output, target_mbs[mb_index], **loss_kwargs)
            self._internal_losses.append(loss)
        return None


def _shimmed(base: type) -> type:
    """``base`` with the mixins this torch needs (``base`` itself on torch >= 2.13)."""
    mixins = []
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
# take) the microbatches themselves (zbpipe.step_inputs) and run them here, the body both
# torch versions' step() share after splitting, so the accepted arguments never depend on the
# installed torch.
def run_microbatches(
    sched: PipelineScheduleMulti,
    arg_mbs: list,
    kwarg_mbs: list,
    target_mbs: list | None,
    losses: list | None,
    return_outputs: bool,
    loss_kwargs: dict | None,
) -> object:
    """What torch's ``PipelineScheduleMulti.step`` does once its inputs are microbatches."""
    import torch

    if sched._has_backward and sched._backward_requires_autograd and not torch.is_grad_enabled():
        raise RuntimeError(
            f"{type(sched).__name__}.step() runs a backward and needs autograd; do not call it under "
            "torch.no_grad() (call eval() for a forward-only step)"
        )
    for stage in sched._stages:
        stage.has_backward = sched._has_backward
        stage.clear_runtime_states()
    sched._step_microbatches(
        arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs
    )
    for stage in sched._stages:
        if stage.is_last and return_outputs:
            return sched._merge_outputs(stage.output_chunks)
    return None


# ---------------------------------------------------------------- end of step() contract


# =====================================================================================
# Every private (underscore) torch name zbpipe touches, with what zbpipe relies on.
# tests/test_compat_names.py checks each against the installed torch: a rename or a changed
# signature fails there, naming this table, instead of deep inside a pipeline step.
# (owner, name, parameters zbpipe passes by name/position, or None for an attribute)
# =====================================================================================
PRIVATE_API: tuple[tuple[type, str, tuple[str, ...] | None], ...] = (
    # methods zbpipe's runtimes call or override on torch's schedule classes
    (
        _TorchPipelineScheduleRuntime,
        "_step_microbatches",
        ("arg_mbs", "kwarg_mbs", "target_mbs", "losses"),
    ),
    (_TorchPipelineScheduleRuntime, "_prepare_schedule_with_comms", ("actions",)),
    (_TorchPipelineScheduleRuntime, "_assert_unsharded", ("stage",)),
    (PipelineScheduleMulti, "_initialize_stages", ("args", "kwargs")),
    (PipelineScheduleMulti, "_maybe_compute_loss", ("stage", "output", "target_mbs", "mb_index")),
    (PipelineScheduleMulti, "_maybe_get_loss", ("stage", "mb_index")),
    (PipelineScheduleMulti, "_update_losses", ("stages", "losses")),
    (PipelineScheduleMulti, "_split_inputs", ("args", "kwargs")),
    (PipelineScheduleSingle, "_get_pipeline_order", ()),
    (PipelineScheduleMulti, "_merge_outputs", ("output_chunks",)),
    # methods zbpipe calls on torch's stages
    (_PipelineStageBase, "_retrieve_recv_grads", ("bwd_chunk_id",)),
    (_PipelineStageBase, "_retrieve_recv_activations", ("fwd_chunk_id",)),
    (_PipelineStageBase, "_create_grad_send_info", ("args_recv_info",)),
    (PipelineStage, "_prepare_forward_infra", ("num_microbatches", "args", "kwargs")),
    # module-level helpers
    (None, "_wait_batch_p2p", ("work",)),
    (None, "_batch_p2p", ("p2p_ops",)),
)
#: instance attributes zbpipe reads on torch's schedules (set in their __init__)
PRIVATE_SCHEDULE_ATTRIBUTES = (
    "_n_microbatches",
    "_num_stages",
    "_stages",
    "_loss_fn",
    "_has_backward",
    "_internal_losses",
    "_backward_requires_autograd",
)
