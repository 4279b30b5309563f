"""Every private torch name zbpipe relies on, in one place.

torch.distributed.pipelining keeps its action IR, its action runtime and its stages' state
private; autograd and ``nn.Module`` keep a few facts zbpipe needs (a graph node's input shapes,
whether a tensor is a view, an in-place ``compile()``) in private attributes. Everything zbpipe
uses of them is imported or read here, through a named helper, and listed in the census at the
end of this file, which tests/test_compat_names.py checks against the installed torch.

One kind of private name is used outside this file, by design: zbpipe's schedules *subclass*
torch's (``PlannedSchedule``, ``ScheduleContinuous``, through the bases below), so they override
and call some of torch's private schedule methods and attributes as their own
(``_step_microbatches``, ``self._n_microbatches``...; ``INHERITED_API`` and
``PRIVATE_SCHEDULE_ATTRIBUTES`` list them). A torch upgrade that renames one of those touches the
subclass too (schedules/runtime.py, continuous/schedule.py and continuous/actions.py, and the
schedule helpers in observe/profile.py, observe/replan.py, schedules/validation.py and
schedules/inputs.py); the census test names which. Any other rename touches this file only.
Tested against torch 2.11, 2.13 and 2.14 (CI).

Long because every private torch name zbpipe relies on lives here by design, so one file is what a
torch upgrade has to audit.
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining.schedules import (  # noqa: F401  (re-exported)
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _Action,
    _batch_p2p,
    _ComputationType,
    _wait_batch_p2p,
)
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime as _TorchPipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import PipelineStage, _PipelineStageBase  # noqa: F401
from torch.distributed.tensor import DTensor

from .patching import Patch, wrap
from .planning.core import TORCH_LETTERS

FORWARD = _ComputationType.FORWARD
BACKWARD_INPUT = _ComputationType.BACKWARD_INPUT
BACKWARD_WEIGHT = _ComputationType.BACKWARD_WEIGHT
FULL_BACKWARD = _ComputationType.FULL_BACKWARD
REDUCE_GRAD = _ComputationType.REDUCE_GRAD
SEND_F = _ComputationType.SEND_F
SEND_B = _ComputationType.SEND_B
RECV_F = _ComputationType.RECV_F
RECV_B = _ComputationType.RECV_B

#: zbpipe's paper letters -> torch's computation types (lossless both ways).
KIND_TO_TORCH = {kind: _ComputationType.from_str(t) for kind, t in TORCH_LETTERS.items()}
TORCH_TO_KIND = {v: k for k, v in KIND_TO_TORCH.items()}


def torch_action(stage: int, kind: _ComputationType, microbatch: int | None) -> _Action:
    """torch's action-IR entry (``_Action``): ``kind`` of ``microbatch`` on ``stage``."""
    return _Action(stage, kind, microbatch)


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


def post_accumulate_grad_hooks(t: Any) -> dict[Any, Any] | None:
    """The dict of ``t``'s post-accumulate-grad hooks (autograd reads it when the hooks run)."""
    return getattr(t, "_post_accumulate_grad_hooks", None)


def has_post_accumulate_grad_hooks(t: Any) -> bool:
    """Whether ``register_post_accumulate_grad_hook`` put a hook on the leaf ``t``."""
    return bool(post_accumulate_grad_hooks(t))


def has_grad_hooks(t: Any) -> bool:
    """Whether ``t.register_hook`` put a hook on ``t``'s gradient (autograd calls it first)."""
    return bool(getattr(t, "_backward_hooks", None))


def is_view(t: Any) -> bool:
    """Whether tensor ``t`` is a view of another tensor's storage (autograd's ``_is_view()``)."""
    return bool(t._is_view())


def node_input_metadata(node: Any) -> Any:
    """The metadata (``.shape``...) of each gradient an autograd graph node receives, one per
    output of the forward op (``Node._input_metadata``). Raises AttributeError or RuntimeError
    where a node has none."""
    return node._input_metadata


def own_parameter(module: Any, name: str) -> Any:
    """The parameter registered on ``module`` itself as ``name``, else None. Unlike
    ``getattr(module, name)`` it is None under a parametrization (which moves the parameter to
    ``module.parametrizations`` and makes ``module.<name>`` a computed tensor)."""
    return module._parameters.get(name)


def own_parameters(module: Any) -> dict[str, Any]:
    """The parameters registered on ``module`` itself, by attribute name (its ``_parameters``;
    a slot may hold None)."""
    return dict(module._parameters)


def set_own_parameter(module: Any, name: str, tensor: Any) -> None:
    """Put ``tensor`` (a Parameter, or any tensor: a weight version's leaf) in ``module``'s
    parameter slot ``name``, as ``torch.func.functional_call`` does for the duration of a call:
    ``nn.Module.__setattr__`` would refuse a tensor that is not a Parameter."""
    module._parameters[name] = tensor


def is_compiled(module: Any) -> bool:
    """``torch.compile(module)`` (an ``OptimizedModule``) or in-place ``module.compile()`` (the way
    torchtitan compiles; it sets ``_compiled_call_impl``)."""
    return (
        type(module).__name__ == "OptimizedModule"
        or getattr(module, "_compiled_call_impl", None) is not None
    )


def is_plain_or_dtensor(t: Any) -> bool:
    """``t`` is a plain tensor or a DTensor (or a Parameter holding either), not another tensor
    subclass."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or is_dtensor(t)


def is_dtensor(t: Any) -> bool:
    """``t`` is a DTensor (a Parameter holding one included)."""
    return isinstance(t, DTensor)


def local_tensor(t: Any) -> Any:
    """The local shard a DTensor wraps, the tensor object itself (``to_local()`` returns a new
    view of it): the object compiled code receives for ``t`` (AOTAutograd flattens a DTensor
    into it) and the one a gradient DTensor wraps."""
    return t._local_tensor


def autograd_function_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` for an ``autograd.Function`` subclass without ``setup_context``, entering
    torch's C++ entry point (``torch._C._FunctionBase.apply``) as torch 2.14's ``apply`` does.

    torch 2.11 and 2.13 wrap that entry point in Python: ``Function.apply`` checks for
    ``setup_context``, then, with no functorch transform active, unwraps dead functorch
    wrappers among the arguments (``torch._functorch.utils.unwrap_dead_wrappers``) and calls
    it. This does the same, minus the wrapper's own calls (about 2 us a call on this
    project's CPU, paid by every patched Linear in every F): under an active transform it calls
    ``cls.apply`` (torch's path, and its error for a Function without ``setup_context``), as it
    does for keyword arguments and while dynamo traces, else unwraps each tensor argument
    (``torch._C._functorch.unwrap_if_dead``) and enters C++. On torch 2.14, where
    ``Function.apply`` is the entry point itself, it returns that.
    """
    entry = torch._C._FunctionBase.__dict__["apply"]
    fast = entry.__get__(None, cls)
    if torch.autograd.Function.__dict__.get("apply") is entry:
        return fast  # type: ignore[no-any-return]
    if cls.setup_context is not torch.autograd.function._SingleLevelFunction.setup_context:
        return cls.apply  # torch binds its defaults
    transforms_active = torch._C._are_functorch_transforms_active
    unwrap = torch._C._functorch.unwrap_if_dead
    slow = cls.apply
    tensor = torch.Tensor
    compiling = torch.compiler.is_compiling

    def apply(*args: Any, **kwargs: Any) -> Any:
        # torch's own path for what its wrapper does beyond unwrapping: keyword arguments (it
        # binds them), functorch transforms, and dynamo, which traces cls.apply but skips the
        # C++ entry point (a graph break; an error under fullgraph=True on torch 2.11)
        if kwargs or transforms_active() or compiling():
            return slow(*args, **kwargs)  # type: ignore[no-untyped-call]  # torch's is untyped
        return fast(*[unwrap(a) if isinstance(a, tensor) else a for a in args])

    return apply


def grad_accumulator(leaf: Any) -> Any:
    """The ``AccumulateGrad`` node of the leaf tensor ``leaf`` (autograd keeps it only while a
    graph or the caller holds it, so hooks on it last as long as the caller keeps it)."""
    return leaf.view_as(leaf).grad_fn.next_functions[0][0]


def lower_with_operands_kept(op: Any, kept_op: Any) -> None:
    """Have inductor lower calls of the custom op ``op`` to calls of ``kept_op`` (same schema)
    whose first two tensor operands' buffers it never reuses nor writes in place afterwards
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

    def lower(x: Any, grad_out: Any, weight: Any) -> Any:
        from torch._inductor import config

        if config.triton.cudagraphs:
            # CUDA graphs (mode="reduce-overhead") replay their partitions into static buffers,
            # which the next replay overwrites whatever inductor's allocator was told
            return emit_copying(x, grad_out, weight)
        x, grad_out = (ir.ExternKernel.realize_input(t) for t in (x, grad_out))
        V.graph.never_reuse_buffers.update((x.get_name(), grad_out.get_name()))
        return emit(x, grad_out, weight)

    register_lowering(op, type_promotion_kind=None)(lower)


def dynamo_counters() -> Any:
    """dynamo's event counters (``torch._dynamo.utils.counters``): ``["stats"]["unique_graphs"]``
    counts compiled graphs (a recompile adds one), ``["graph_break"]`` the graph breaks."""
    from torch._dynamo.utils import counters

    return counters


# --- what the runtimes read of torch's schedule runtime and stages --------------------------------


def forward_receives(sched: Any) -> dict[tuple[int, int], list[Any]]:
    """``(stage, microbatch)`` -> the posted receive of that forward's inputs (torch's
    ``_PipelineScheduleRuntime.fwd_recv_ops``; torch's RECV_F action fills it)."""
    receives: dict[tuple[int, int], list[Any]] = sched.fwd_recv_ops
    return receives


def backward_receives(sched: Any) -> dict[tuple[int, int], list[Any]]:
    """``(stage, microbatch)`` -> the posted receive of that backward's output gradients
    (torch's ``bwd_recv_ops``; torch's RECV_B action fills it)."""
    receives: dict[tuple[int, int], list[Any]] = sched.bwd_recv_ops
    return receives


def wait_batch_p2p(work: list[Any]) -> None:
    """Wait for a posted receive (one of :func:`forward_receives` or :func:`backward_receives`'s
    values; torch's ``_wait_batch_p2p``)."""
    _wait_batch_p2p(work)


def order_with_comms(sched: Any) -> dict[int, list[Any]]:
    """Every rank's action list after torch inserted the sends and receives
    (``pipeline_order_with_comms``, set by ``_prepare_schedule_with_comms``)."""
    orders: dict[int, list[Any]] = sched.pipeline_order_with_comms
    return orders


def handle_sends(sched: Any, handler: Callable[[Any, Any], None]) -> None:
    """Run ``handler(action, ctx)`` for the SEND_F and SEND_B actions of ``sched``'s runtime.

    torch's ``register_custom_function`` accepts compute and FSDP actions only, but its action
    loop looks every action type up in the same map (``_comp_type_to_function_map``, in torch
    2.11 to 2.14) before its built-in handling, which would keep each send's work, and so its
    tensor, until the step ends (see :mod:`zbpipe.schedules.sends`).
    """
    table: dict[Any, Any] = sched._comp_type_to_function_map
    for kind in (SEND_F, SEND_B):
        table[kind] = handler


def backward_counter(sched: Any) -> Counter[int]:
    """stage -> backward passes with weight gradients (W or fused BW) run so far this step
    (torch's ``backward_counter``). torch's own actions count in it to tell a stage's last
    backward, and torch clears it at the end of the step; zbpipe's actions, which replace
    torch's, count in it the same way."""
    counter: Counter[int] = sched.backward_counter
    return counter


def activation_receives(stage: _PipelineStageBase) -> dict[int, tuple[Any, ...]]:
    """microbatch -> the receive buffers for that forward's inputs (torch's ``args_recv_info``)."""
    return stage.args_recv_info


def grad_receives(stage: _PipelineStageBase) -> dict[int, tuple[Any, ...]]:
    """microbatch -> the receive buffers for that backward's output gradients (torch's
    ``grad_recv_info``)."""
    return stage.grad_recv_info


def key_by_global_microbatch(
    stage: _PipelineStageBase,
) -> tuple[tuple[Any, ...], tuple[Any, ...] | None]:
    """Make a stage's receive buffers and caches take any microbatch index (the continuous
    schedule's global ones), after torch's shape inference keyed them ``0..n_microbatches-1``.

    Returns the receive-buffer templates of microbatch 0 (activations; output gradients, None on
    the last stage), empties torch's per-microbatch receive tables so each receive can get a
    fresh buffer, creates the gradient-send description torch builds lazily, and lifts torch's
    bound on the microbatch index.
    """
    act_template = stage.args_recv_info[0]
    grad_template = stage.grad_recv_info.get(0)
    if stage.grad_send_info is None:
        stage.grad_send_info = stage._create_grad_send_info(stage.args_recv_info[0])
    stage.args_recv_info.clear()
    stage.grad_recv_info.clear()
    stage.chunks = sys.maxsize  # keys are global microbatch indices, unbounded
    return act_template, grad_template


def wrap_shape_inference(stage: _PipelineStageBase, make: Callable[[Any], Any]) -> Patch:
    """Replace this stage object's shape-inference entry (``_prepare_forward_infra(n, args,
    kwargs, ...)``, which receives ``step()``'s keywords on the first step) by ``make(current)``;
    ``.undo()`` the result to restore it."""
    return wrap(stage, "_prepare_forward_infra", make)


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
            return sched._merge_outputs(stage.output_chunks)
    return None


# ---------------------------------------------------------------- end of step() contract


# =====================================================================================
# Every private (underscore) torch name zbpipe touches, with what zbpipe relies on.
# tests/test_compat_names.py checks each against the installed torch: a rename or a changed
# signature fails there, naming this table, instead of deep inside a pipeline step. It also
# scans zbpipe's other modules: a private torch name outside this file that INHERITED_API and
# PRIVATE_SCHEDULE_ATTRIBUTES do not list, or a TORCH_INTERNAL_ATTRIBUTES name, fails it.
# (owner, name, parameters zbpipe passes by name/position)
# =====================================================================================
#: methods zbpipe's schedules (subclasses of torch's) override or call as their own
INHERITED_API: tuple[tuple[type, str, tuple[str, ...]], ...] = (
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
)
#: methods and functions only this module's helpers call
HELPER_API: tuple[tuple[type | None, str, tuple[str, ...]], ...] = (
    (PipelineScheduleMulti, "_merge_outputs", ("output_chunks",)),
    (PipelineScheduleSingle, "_get_pipeline_order", ()),
    (ScheduleInterleaved1F1B, "_calculate_single_rank_operations", ("rank",)),
    (ScheduleInterleavedZeroBubble, "_calculate_single_rank_operations", ("rank",)),
    (ScheduleZBVZeroBubble, "_calculate_single_rank_operations", ("rank",)),
    (ScheduleDualPipeV, "_calculate_single_rank_operations", ("rank",)),
    # methods called on torch's stages
    (_PipelineStageBase, "_retrieve_recv_grads", ("bwd_chunk_id",)),
    (_PipelineStageBase, "_retrieve_recv_activations", ("fwd_chunk_id",)),
    (_PipelineStageBase, "_create_grad_send_info", ("args_recv_info",)),
    (PipelineStage, "_prepare_forward_infra", ("num_microbatches", "args", "kwargs")),
    # module-level helpers
    (None, "_wait_batch_p2p", ("work",)),
    (None, "_batch_p2p", ("p2p_ops",)),
    (None, "_Action", ("stage_index", "computation_type", "microbatch_index")),
)
PRIVATE_API = INHERITED_API + HELPER_API
#: instance attributes zbpipe's schedules read as their own (torch's schedules set them in
#: __init__); the helpers above read or set some of them on other schedule objects too
PRIVATE_SCHEDULE_ATTRIBUTES = (
    "_n_microbatches",
    "_num_stages",
    "_stages",
    "_loss_fn",
    "_has_backward",
    "_internal_losses",
    "_backward_requires_autograd",
)
#: torch's internal state with public-looking names, reached only through the helpers above:
#: (torch module that sets it on ``self``, attribute). Not documented by torch; zbpipe's other
#: modules never name them (tests/test_compat_names.py).
TORCH_INTERNAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("stage", "fwd_cache"),
    ("stage", "bwd_cache"),
    ("stage", "dw_builder"),
    ("stage", "dw_runner"),
    ("stage", "args_recv_info"),
    ("stage", "grad_recv_info"),
    ("stage", "grad_send_info"),
    ("stage", "chunks"),
    ("schedules", "fwd_recv_ops"),
    ("schedules", "bwd_recv_ops"),
    ("schedules", "backward_counter"),
    ("schedules", "n_local_stages"),
    ("schedules", "number_of_rounds"),
    ("schedules", "microbatches_per_round"),
)
#: torch's private autograd entry points :func:`autograd_function_apply` calls (module, name)
PRIVATE_AUTOGRAD_NAMES: tuple[tuple[str, str], ...] = (
    ("torch._C._FunctionBase", "apply"),
    ("torch._C", "_are_functorch_transforms_active"),
    ("torch._C._functorch", "unwrap_if_dead"),
    ("torch.autograd.function._SingleLevelFunction", "setup_context"),
)
#: private attributes of autograd nodes, tensors and modules the helpers above read (checked by
#: behaviour in tests/test_compat_names.py: they are C++ or set lazily, without a signature)
PRIVATE_OBJECT_ATTRIBUTES = (
    ("autograd Node", "_input_metadata"),
    ("Tensor", "_is_view"),
    ("Tensor", "_backward_hooks"),
    ("Tensor", "_post_accumulate_grad_hooks"),
    ("nn.Module", "_parameters"),
    ("nn.Module", "_compiled_call_impl"),
    ("DTensor", "_local_tensor"),
)


def compiled_submodule(module: Any) -> str | None:
    """The name of ``module``'s first ``torch.compile``d submodule (``""``: itself), else None.

    Both ``torch.compile(module)`` (an ``OptimizedModule``) and in-place ``module.compile()``
    (the way torchtitan compiles) count (:func:`is_compiled`).
    """
    for name, mod in module.named_modules():
        if is_compiled(mod):
            return str(name)
    return None
