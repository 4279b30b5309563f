"""What zbpipe reads and writes of a torch ``PipelineStage``: message sizes, the receive buffers
and caches the stage seam uses, and what a V placement's local hand-off leaves behind."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining.stage import _PipelineStageBase

from .shims import stage_metas


def stage_message_bytes(stage: _PipelineStageBase, which: str) -> int:
    """Bytes of a microbatch's activations a stage receives (``"inputs"``) or sends (``"outputs"``).

    Read from the tensor metadata torch infers on the first step (private: see
    :func:`stage_metas`); 0 before that. Used by :mod:`zbpipe.observe.profile` to time messages of
    the real size.
    """
    metas = stage_metas(stage, which)
    total = 0
    for meta in metas:
        shape, dtype = getattr(meta, "shape", None), getattr(meta, "dtype", None)
        if shape is not None and dtype is not None:
            total += shape.numel() * dtype.itemsize
    return total


# --- what the stage seam reads from a torch PipelineStage ---------------------------------------


def received_grads(stage: _PipelineStageBase, mb: int) -> tuple[Any, ...]:
    """The output gradients a stage received for microbatch ``mb`` (torch's receive buffers)."""
    grads: tuple[Any, ...] = stage._retrieve_recv_grads(mb)
    return grads


def received_grad_buffers(stage: _PipelineStageBase, mb: int) -> tuple[Any, ...]:
    """The receive buffers of a stage's output gradients for ``mb``, None where none is expected.

    What :func:`received_grads` would return, before torch rebuilds DTensors from them: enough
    to tell a missing gradient, for no per-microbatch work.
    """
    return tuple(info.buffer for info in stage.grad_recv_info[mb])


def received_activation_buffers(stage: _PipelineStageBase, mb: int) -> tuple[Any, ...]:
    """The buffers a stage's inputs for ``mb`` are received into (or a local previous stage
    handed over), before torch rebuilds DTensors from them; empty on the first stage."""
    return tuple(info.buffer for info in stage.args_recv_info.get(mb, ()) if _is_receive(info))


def received_activations(stage: _PipelineStageBase, mb: int) -> tuple[Any, ...]:
    """The activations a stage received for microbatch ``mb`` (torch's receive buffers)."""
    activations: tuple[Any, ...] = stage._retrieve_recv_activations(mb)
    return activations


def forward_cache(stage: _PipelineStageBase) -> dict[int, tuple[Any, list[Any]]]:
    """microbatch -> ``(stage outputs, stage inputs)`` a forward left for its backward
    (torch's ``fwd_cache``; torch's forward fills it, zbpipe's B pops it)."""
    return stage.fwd_cache


def input_grad_cache(stage: _PipelineStageBase) -> dict[int, tuple[Any, ...]]:
    """microbatch -> the input gradients torch sends to the previous stage (torch's
    ``bwd_cache``; zbpipe's B fills it)."""
    return stage.bwd_cache


def has_own_weight_pass(stage: _PipelineStageBase) -> bool:
    """Whether the stage was built with torch's ``dw_builder`` (it runs its own weight pass)."""
    return getattr(stage, "dw_builder", None) is not None


def weight_runners(stage: _PipelineStageBase) -> dict[int, Any]:
    """A ``dw_builder`` stage's pending weight passes, by microbatch (torch's ``dw_runner``)."""
    return stage.dw_runner


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
                if _is_receive(info) and isinstance(info.buffer, torch.Tensor):
                    # An empty tensor, not None: torch 2.11 resets ``buffer.grad`` on every
                    # receive info when a step starts.
                    info.buffer = info.buffer.new_empty(0)


def _is_receive(info: Any) -> bool:
    """A receive info with a buffer, not stage 0's root-argument placeholder: torch >= 2.13 marks
    those ``is_root_arg``; torch 2.11 gives them their own class, without a buffer."""
    return hasattr(info, "buffer") and not getattr(info, "is_root_arg", False)


def _is_dropped(buffer: Any) -> bool:
    return buffer is None or (isinstance(buffer, torch.Tensor) and buffer.numel() == 0)


def set_local_bwd_input(stage: _PipelineStageBase, grads: tuple[Any, ...], mb: int) -> None:
    """``stage.set_local_bwd_input(grads, mb)`` after :func:`drop_local_inputs` emptied its buffers.

    torch answers a None gradient by zeroing the buffer the last hand-off left (and reads it as
    the zero output gradient); once dropped there is none, so a zero one is made from the metadata.
    """
    for info, g in zip(stage.grad_recv_info[mb], grads, strict=True):
        if g is None and _is_receive(info) and _is_dropped(info.buffer):
            meta = getattr(info, "tensor_meta", None)  # torch 2.11 has none: it refuses None
            if meta is not None:
                info.buffer = torch.zeros(meta.shape, dtype=meta.dtype, device=stage.device)
    stage.set_local_bwd_input(grads, mb)


# --- microbatches of different shapes: receive buffers sized per microbatch ---------------------


def receive_infos(stage: _PipelineStageBase, mb: int, forward: bool) -> list[Any]:
    """The receive infos of ``mb`` whose buffers a point-to-point receive fills, in the order of
    the stage's inputs (``forward``) or outputs (gradients); None where no gradient is expected."""
    if forward:
        return [i for i in stage.args_recv_info.get(mb, ()) if _is_receive(i)]
    return [
        i if isinstance(getattr(i, "buffer", None), torch.Tensor) else None
        for i in stage.grad_recv_info.get(mb, ())
    ]


def set_receive_buffer(info: Any, buffer: torch.Tensor) -> None:
    """Receive into ``buffer`` from now on (torch reads ``info.buffer`` when it posts a receive)."""
    info.buffer = buffer
