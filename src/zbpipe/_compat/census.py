"""The census: every private (underscore) torch name zbpipe touches, with what zbpipe relies on.

tests/test_compat_names.py checks each against the installed torch, and scans zbpipe's other
modules for private torch names this package does not list."""

from __future__ import annotations

from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    _PipelineScheduleRuntime as _TorchPipelineScheduleRuntime,
)
from torch.distributed.pipelining.stage import PipelineStage, _PipelineStageBase

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
    (PipelineScheduleMulti, "_check_inputs", ("arg_mbs", "kwarg_mbs", "target_mbs", "losses")),
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
    (
        None,
        "_Action",
        ("stage_index", "computation_type", "microbatch_index", "sub_actions"),
    ),
    (None, "_PipelineContext", ("schedule_ref", "arg_mbs", "kwarg_mbs", "target_mbs", "losses")),
    (None, "_format_pipeline_order", ("pipeline_order", "error_step_number")),
    # torch's lowering steps, for a part of a step (lower_part)
    (None, "_add_unshard_reshard", ("compute_actions",)),
    (None, "_add_reduce_grad", ("actions", "n_microbatches")),
    (None, "_add_send_recv", ("compute_actions", "stage_to_rank", "num_stages")),
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
    ("schedules", "unshard_ops"),
    ("schedules", "unsharded_stages"),
    ("schedules", "n_local_stages"),
    ("schedules", "number_of_rounds"),
    ("schedules", "microbatches_per_round"),
)
#: torch's private autograd and profiler entry points the helpers call (module, name):
#: :func:`autograd_function_apply`'s, the deferred Linear's per-call checks, the action loop's
#: profiler check and range; and the class :func:`selective_checkpoint_cached` watches
PRIVATE_AUTOGRAD_NAMES: tuple[tuple[str, str], ...] = (
    ("torch._C._FunctionBase", "apply"),
    ("torch._C", "_are_functorch_transforms_active"),
    ("torch._C._functorch", "unwrap_if_dead"),
    ("torch.autograd.function._SingleLevelFunction", "setup_context"),
    ("torch._C", "_is_any_autocast_enabled"),
    ("torch._C._autograd", "_top_saved_tensors_default_hooks"),
    ("torch._C._autograd", "_profiler_enabled"),
    ("torch._C._profiler", "_RecordFunctionFast"),
    # the class of selective checkpointing's cache entries (selective_checkpoint_cached)
    ("torch.utils.checkpoint", "_VersionWrapper"),
    # the region whose recompute the graph engine's W replays (autograd.checkpoint_frame)
    ("torch.utils.checkpoint", "_CheckpointFrame"),
    # the set dynamo hands to function modes (compiler.route_through_function_modes)
    ("torch._dynamo.variables.torch", "get_overridable_functions"),
    # a size that varies from call to call, symbolic in the first compile (compiler.mark_dynamic)
    ("torch._dynamo", "mark_dynamic"),
    # a stage's output shapes without data, for microbatches of different shapes (.fake)
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
    ("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
    ("torch.utils._pytree", "tree_flatten"),
    # output shapes as expressions of symbolic input sizes (.fake.shape_rule)
    ("torch.fx.experimental.symbolic_shapes", "ShapeEnv"),
    ("torch.fx.experimental.symbolic_shapes", "DimDynamic"),
    ("torch.fx.experimental.symbolic_shapes", "StatelessSymbolicContext"),
)
#: torch's private names the overlapped pairs use (:mod:`.overlap`; module, name)
PRIVATE_OVERLAP_NAMES: tuple[tuple[str, str], ...] = (
    ("torch._C", "_len_torch_function_stack"),
    ("torch._C", "_pop_torch_function_stack"),
    ("torch._C", "_push_on_torch_function_stack"),
    ("torch.utils._python_dispatch", "_disable_current_modes"),
    ("torch.distributed._functional_collectives", "all_to_all_single"),
    ("torch.distributed._functional_collectives", "wait_tensor"),
)
#: private attributes of autograd nodes, tensors and modules the helpers above read (checked by
#: behaviour in tests/test_compat_names.py: they are C++ or set lazily, without a signature)
PRIVATE_OBJECT_ATTRIBUTES = (
    ("autograd Node", "_input_metadata"),
    ("Tensor", "_is_view"),
    ("Tensor", "_backward_hooks"),
    ("Tensor", "_version"),
    ("autograd Node", "_register_hook_dict"),
    ("Tensor", "_post_accumulate_grad_hooks"),
    ("nn.Module", "_parameters"),
    ("schedule runtime", "_comp_type_to_function_map"),
    ("nn.Module", "_compiled_call_impl"),
    ("DTensor", "_local_tensor"),
)
#: private torch operators the helpers in :mod:`.ops` call: (module, name, keyword arguments
#: zbpipe passes). Checked by calling them (tests/test_compat_names.py): a builtin has no
#: signature to read
PRIVATE_OPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (("torch", "_grouped_mm", ("offs",)),)
#: torch's C++ internals the native weight capture (engines/native/capture.cpp) calls, outside
#: torch's documented C++ API: (C++ name, what zbpipe relies on, the test that checks it by
#: behaviour). Python cannot read a C++ signature: a rename fails the build (logged; the Python
#: capture runs, bitwise the same), a changed meaning fails the named test. tests/
#: test_compat_names.py scans the C++ sources for ``impl``/``detail``/``internal`` names not
#: listed here.
NATIVE_INTERNAL_NAMES: tuple[tuple[str, str, str], ...] = (
    (
        "torch::autograd::impl::post_acc_grad_hooks",
        "non-null exactly when the tensor has a post-accumulate-grad hook (then W leaves the sum "
        "to the hook path instead of adding inside the GEMM)",
        "tests/engines/test_native_capture.py::test_post_accumulate_hooks_fire_once_in_w_after_the_sum",
    ),
)
