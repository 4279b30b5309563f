"""Every private torch name zbpipe relies on, in one place: this package.

torch.distributed.pipelining keeps its action IR, its action runtime and its stages' state
private; autograd and ``nn.Module`` keep a few facts zbpipe needs (a graph node's input shapes,
whether a tensor is a view, an in-place ``compile()``) in private attributes. Everything zbpipe
uses of them is imported or read in this package, through a named helper, and listed in its
census (:mod:`.census`), which tests/test_compat_names.py checks against the installed torch.
The rest of zbpipe imports the package (``from .. import _compat as C``) and calls ``C.<helper>``;
which module a helper lives in is this package's business.

| module | what of torch it reaches |
|---|---|
| :mod:`.action_ir` | pipelining's action IR: computation types, ``_Action``, the paper's letters |
| :mod:`.stage` | a ``PipelineStage``'s receive buffers, caches and local V hand-offs |
| :mod:`.fake` | ``FakeTensorMode``: a stage's output shapes for given input shapes |
| :mod:`.schedule_runtime` | the runtime's receives, FSDP actions, counters, custom functions |
| :mod:`.torch_orders` | torch's own schedule orders, generated without a process group |
| :mod:`.autograd` | hooks, views, node metadata, Function.apply, AccumulateGrad, AC's recompute |
| :mod:`.modules` | ``nn.Module`` slots, compilation, checkpoint wrappers, DTensor's local shard |
| :mod:`.compiler` | inductor's lowering registry and dynamo's counters |
| :mod:`.ops` | private operators: ``torch._grouped_mm`` (MoE experts' grouped GEMM) |
| :mod:`.overlap` | the mode stacks, functional collectives, ``GraphExecGroup`` |
| :mod:`.profiler` | whether a profiler records; a cheap named range |
| :mod:`.shims` | the differences between torch 2.11 and 2.15, and the shared ``step()`` body |
| :mod:`.census` | the list of every private name above, with what zbpipe relies on |

One kind of private name is used outside this package, by design: zbpipe's schedules *subclass*
torch's (``PlannedSchedule``, ``ScheduleContinuous``, through the bases in :mod:`.shims`), so
they override and call some of torch's private schedule methods and attributes as their own
(``_step_microbatches``, ``self._n_microbatches``...; ``INHERITED_API`` and
``PRIVATE_SCHEDULE_ATTRIBUTES`` list them). A torch upgrade that renames one of those touches the
subclass too (schedules/runtime.py, continuous/schedule.py and continuous/actions.py, and the
schedule helpers in observe/profile.py, schedules/replan.py, schedules/validation.py and
schedules/inputs.py); the census test names which. Any other rename touches this package only.
Tested against torch 2.11, 2.13 and 2.14 (CI).
"""

from torch.distributed.pipelining.schedules import (
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
from torch.distributed.pipelining.stage import PipelineStage, _PipelineStageBase

from .action_ir import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    KIND_TO_TORCH,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    TORCH_TO_KIND,
    UNSHARD,
    sub_actions,
    torch_action,
    torch_pair_action,
)
from .autograd import (
    any_autocast_enabled,
    asked_by_checkpoint,
    autograd_function_apply,
    checkpoint_frame,
    checkpoint_recompute_replayable,
    functorch_transforms_active,
    grad_accumulator,
    grad_hook_dict,
    has_grad_hooks,
    has_post_accumulate_grad_hooks,
    is_view,
    node_input_metadata,
    on_output_grad,
    post_accumulate_grad_hooks,
    recording_recompute,
    replaying_recompute,
    saved_tensor_hooks,
    selective_checkpoint_cached,
    swap_recompute,
    tensor_version,
)
from .census import (
    HELPER_API,
    INHERITED_API,
    NATIVE_INTERNAL_NAMES,
    PRIVATE_API,
    PRIVATE_AUTOGRAD_NAMES,
    PRIVATE_OBJECT_ATTRIBUTES,
    PRIVATE_OPS,
    PRIVATE_OVERLAP_NAMES,
    PRIVATE_SCHEDULE_ATTRIBUTES,
    TORCH_INTERNAL_ATTRIBUTES,
)
from .compiler import (
    DONATED_BUFFER_ERROR,
    donated_buffers,
    dynamo_counters,
    lower_with_operands_kept,
    mark_dynamic,
    route_through_function_modes,
)
from .fake import ShapeRule, TensorSpec, data_dependent_error, output_specs, shape_rule
from .modules import (
    checkpointed_submodule,
    compiled_submodule,
    is_compiled,
    is_dtensor,
    is_plain_or_dtensor,
    local_tensor,
    own_parameter,
    own_parameters,
    selective_checkpoint_submodule,
    set_own_parameter,
)
from .ops import grouped_mm, grouped_mm_function, has_grouped_mm
from .overlap import (
    all_to_all_single,
    backward_group,
    outside_python_modes,
    wait_tensor,
)
from .profiler import profiler_range, profiler_recording
from .schedule_runtime import (
    activation_receives,
    backward_counter,
    backward_receives,
    check_unshards_used,
    custom_functions,
    format_order,
    forward_receives,
    grad_receives,
    key_by_global_microbatch,
    lower_part,
    order_with_comms,
    pipeline_context,
    post_receive,
    reshard_stage,
    unshard_stage,
    wait_batch_p2p,
    wrap_shape_inference,
)
from .shims import (
    TORCH_HAS_LOSS_KWARGS,
    TORCH_SENDS_TO_LOCAL_NEIGHBOURS,
    PipelineScheduleMultiBase,
    _PipelineScheduleRuntime,
    initialize_stages,
    run_microbatches,
    stage_metas,
    with_local_stage_init,
)
from .stage import (
    drop_local_inputs,
    forward_cache,
    has_own_weight_pass,
    input_grad_cache,
    num_stage_inputs,
    receive_infos,
    received_activation_buffers,
    received_activations,
    received_grad_buffers,
    received_grads,
    set_local_bwd_input,
    set_receive_buffer,
    stage_message_bytes,
    weight_runners,
)
from .torch_orders import (
    multi_stage_rank_orders,
    single_stage_order,
)

__all__ = [
    "PipelineScheduleMulti",
    "PipelineScheduleSingle",
    "ScheduleDualPipeV",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "_Action",
    "_batch_p2p",
    "_ComputationType",
    "_wait_batch_p2p",
    "_TorchPipelineScheduleRuntime",
    "PipelineStage",
    "_PipelineStageBase",
    "FORWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "FULL_BACKWARD",
    "REDUCE_GRAD",
    "SEND_F",
    "SEND_B",
    "RECV_F",
    "RECV_B",
    "UNSHARD",
    "RESHARD",
    "KIND_TO_TORCH",
    "TORCH_TO_KIND",
    "torch_action",
    "OVERLAP_F_B",
    "torch_pair_action",
    "sub_actions",
    "stage_message_bytes",
    "received_grads",
    "received_grad_buffers",
    "received_activation_buffers",
    "received_activations",
    "forward_cache",
    "input_grad_cache",
    "has_own_weight_pass",
    "weight_runners",
    "num_stage_inputs",
    "drop_local_inputs",
    "set_local_bwd_input",
    "receive_infos",
    "set_receive_buffer",
    "TensorSpec",
    "output_specs",
    "data_dependent_error",
    "ShapeRule",
    "shape_rule",
    "forward_receives",
    "backward_receives",
    "wait_batch_p2p",
    "lower_part",
    "order_with_comms",
    "custom_functions",
    "pipeline_context",
    "post_receive",
    "unshard_stage",
    "reshard_stage",
    "check_unshards_used",
    "format_order",
    "profiler_recording",
    "profiler_range",
    "initialize_stages",
    "any_autocast_enabled",
    "saved_tensor_hooks",
    "grad_hook_dict",
    "functorch_transforms_active",
    "tensor_version",
    "on_output_grad",
    "backward_counter",
    "activation_receives",
    "grad_receives",
    "key_by_global_microbatch",
    "wrap_shape_inference",
    "single_stage_order",
    "multi_stage_rank_orders",
    "post_accumulate_grad_hooks",
    "has_post_accumulate_grad_hooks",
    "has_grad_hooks",
    "is_view",
    "node_input_metadata",
    "autograd_function_apply",
    "grad_accumulator",
    "selective_checkpoint_cached",
    "own_parameter",
    "own_parameters",
    "set_own_parameter",
    "is_compiled",
    "is_plain_or_dtensor",
    "is_dtensor",
    "local_tensor",
    "compiled_submodule",
    "checkpointed_submodule",
    "selective_checkpoint_submodule",
    "asked_by_checkpoint",
    "checkpoint_frame",
    "checkpoint_recompute_replayable",
    "recording_recompute",
    "replaying_recompute",
    "swap_recompute",
    "lower_with_operands_kept",
    "route_through_function_modes",
    "all_to_all_single",
    "backward_group",
    "outside_python_modes",
    "wait_tensor",
    "DONATED_BUFFER_ERROR",
    "donated_buffers",
    "dynamo_counters",
    "mark_dynamic",
    "grouped_mm",
    "has_grouped_mm",
    "grouped_mm_function",
    "TORCH_HAS_LOSS_KWARGS",
    "TORCH_SENDS_TO_LOCAL_NEIGHBOURS",
    "stage_metas",
    "with_local_stage_init",
    "_PipelineScheduleRuntime",
    "PipelineScheduleMultiBase",
    "run_microbatches",
    "INHERITED_API",
    "NATIVE_INTERNAL_NAMES",
    "HELPER_API",
    "PRIVATE_API",
    "PRIVATE_SCHEDULE_ATTRIBUTES",
    "TORCH_INTERNAL_ATTRIBUTES",
    "PRIVATE_AUTOGRAD_NAMES",
    "PRIVATE_OBJECT_ATTRIBUTES",
    "PRIVATE_OPS",
    "PRIVATE_OVERLAP_NAMES",
]
