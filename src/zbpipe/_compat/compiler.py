"""What zbpipe asks of torch.compile's internals: an inductor lowering that keeps a custom op's
operands, dynamo's counters and its dynamic-size marks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def lower_with_operands_kept(op: Any, kept_op: Any, kept: int = 2) -> None:
    """Have inductor lower calls of the custom op ``op`` to calls of ``kept_op`` (same schema)
    whose first ``kept`` tensor operands' buffers it never reuses nor writes in place afterwards
    (``GraphLowering.never_reuse_buffers``, as its own lowerings of ``resize_storage_bytes_``
    and ``set_`` do). Once per process; a no-op without inductor. Graphs compiled earlier, and
    graphs compiled for CUDA graphs (whose static buffers a later replay overwrites), keep
    calling ``op``."""
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import fallback_handler, lowerings, register_lowering
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - inductor ships with every torch zbpipe supports
        return
    if op in lowerings:
        return
    emit = fallback_handler(kept_op, add_to_fallback_set=False)  # type: ignore[no-untyped-call]
    emit_copying = fallback_handler(op, add_to_fallback_set=False)  # type: ignore[no-untyped-call]

    def lower(*operands: Any) -> Any:
        from torch._inductor import config

        if config.triton.cudagraphs:
            # CUDA graphs (mode="reduce-overhead") replay their partitions into static buffers,
            # which the next replay overwrites whatever inductor's allocator was told
            return emit_copying(*operands)
        held = [ir.ExternKernel.realize_input(t) for t in operands[:kept]]
        V.graph.never_reuse_buffers.update(t.get_name() for t in held)
        return emit(*held, *operands[kept:])

    register_lowering(op, type_promotion_kind=None)(lower)


def dynamo_counters() -> Any:
    """dynamo's event counters (``torch._dynamo.utils.counters``): ``["stats"]["unique_graphs"]``
    counts compiled graphs (a recompile adds one), ``["graph_break"]`` the graph breaks."""
    from torch._dynamo.utils import counters

    return counters


#: what AOTAutograd's backward says when a graph compiled with donated buffers is walked with
#: ``retain_graph=True`` (``torch._functorch.config.donated_buffer``)
DONATED_BUFFER_ERROR = "compiled with non-empty donated buffers"


@contextmanager
def donated_buffers(enabled: bool) -> Iterator[None]:
    """Within the block, graphs AOTAutograd compiles donate their backward's saved buffers or
    not (``torch._functorch.config.donated_buffer``). A donating backward refuses
    ``retain_graph=True``, which the graph engine's B needs (its W walks the graph again): a
    compiled region under ``split="graph"`` must be compiled (its first call) with ``False``."""
    from torch._functorch import config

    with config.patch(donated_buffer=enabled):
        yield


def mark_dynamic(t: Any, dims: int | list[int]) -> None:
    """Tell ``torch.compile`` that ``t``'s sizes at ``dims`` vary from call to call
    (``torch._dynamo.mark_dynamic``): the first compile of a graph taking ``t`` is symbolic in
    them, instead of specialized and then recompiled once the size changes."""
    from torch._dynamo import mark_dynamic as mark

    mark(t, dims)


def route_through_function_modes(fn: Any) -> None:
    """Have dynamo hand calls of the torch function ``fn`` to the active ``TorchFunctionMode``\\ s
    while it traces, as eager does. dynamo does so only for the functions
    ``torch.overrides.get_overridable_functions`` lists, which leaves out private ones such as
    ``torch._grouped_mm`` (eager hands them to modes all the same): its cached set
    (``torch._dynamo.variables.torch.get_overridable_functions``) gets ``fn``. Nothing changes
    where no mode is active."""
    try:
        from torch._dynamo.variables import torch as dynamo_torch
    except ImportError:  # pragma: no cover - dynamo ships with every torch zbpipe supports
        return
    dynamo_torch.get_overridable_functions().add(fn)
