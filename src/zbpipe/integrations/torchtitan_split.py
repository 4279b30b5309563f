"""The stages' layers for a zbpipe schedule in torchtitan: chosen for the schedule, not 1F1B.

torchtitan's ``pipeline_llm`` splits the model by its default rule (the same number of layers
per stage, the embedding and the head counted as one layer each) unless the config gives
``module_fqns_per_model_part``. For a zbpipe schedule with no split of the user's,
:func:`schedule_split` returns the split :func:`zbpipe.planning.split.choose_split` makes for
that schedule's plan from the model's analytic per-layer costs (parameters counted on the model,
MoE experts at ``top_k / num_experts``), which the torchtitan integration passes on as
``module_fqns_per_model_part`` where it gains at least :data:`MIN_SPLIT_GAIN` in simulation
(:func:`worth_moving`): a smaller predicted gain is within the simulator's error.

A user's split is never replaced: ``module_fqns_per_model_part``,
``pipeline_parallel_layers_per_stage`` or a ``pipeline_parallel_first_stage_less_layers`` /
``pipeline_parallel_last_stage_less_layers`` other than 1 keep torchtitan's path. The
environment variable ``ZBPIPE_SPLIT=default`` (on every rank) keeps torchtitan's default split.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..planning.layer_costs import layer_cost_from_params
from ..planning.registry import GENERATORS
from ..planning.split import LayerCost, Split, choose_split

logger = logging.getLogger(__name__)

#: the environment variable that switches the split off: ``default`` keeps torchtitan's
ENV = "ZBPIPE_SPLIT"
_CHOICES = ("schedule", "default")


def split_mode() -> str:
    """``"schedule"`` (the default: a split made for the schedule) or ``"default"``
    (torchtitan's), from ``ZBPIPE_SPLIT``; anything else is a ``ValueError``."""
    mode = os.environ.get(ENV, "schedule").strip().lower() or "schedule"
    if mode not in _CHOICES:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r}: use 'schedule' (a split made for the zbpipe schedule, "
            "the default) or 'default' (torchtitan's split)"
        )
    return mode


def plan_name_of(cls: type) -> str | None:
    """The plan name (:data:`zbpipe.planning.GENERATORS`) ``cls`` runs, or None when it chooses
    its plan at run time (``Auto``, ``AutoV``, a byte budget)."""
    fixed = getattr(cls, "fixed_options", {})
    name = getattr(cls, "plan_name", None)
    if name == "ZBV":
        name = {"zb": "ZBV", "half": "ZBVHalf", "min": "ZBVMin"}[fixed.get("memory", "zb")]
    elif "memory_limit" in fixed:  # ZB1P, ZB2P; a byte budget is resolved at run time
        name = {"1p": "ZB1P", "2p": "ZB2P"}.get(str(fixed["memory_limit"]))
    return name if name in GENERATORS else None


def user_split(parallelism: Any) -> str | None:
    """The option by which the config chose the split itself, or None."""
    if parallelism.module_fqns_per_model_part is not None:
        return "module_fqns_per_model_part"
    if parallelism.pipeline_parallel_layers_per_stage is not None:
        return "pipeline_parallel_layers_per_stage"
    for option in (
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
    ):
        if getattr(parallelism, option, 1) != 1:
            return option
    return None


#: The most the head (final norm, vocabulary projection, loss) may cost, as a multiple of its
#: analytic cost: the split judges every scale from 1 to this one and keeps a split no slower
#: than torchtitan's at any of them. Why 2.3: in torchtitan 0.3's Trainer on llama3 debug (dim
#: 256, vocab 2048, seq 128; docs/results/trainer.md) the chunked head and loss cost about 1.3
#: layers where the FLOP count says 0.57: per-chunk overheads and the softmax over the
#: vocabulary, memory-bound work no FLOP count sees.
HEAD_COST_MAX = 2.3

#: The least simulated gain, at worst over the head's cost range, for which a split replaces
#: torchtitan's. The simulator's step times are not exact (the split backward's overheads, the
#: memory re-plan, host time): in torchtitan 0.3's Trainer on llama3 debug (docs/results/
#: trainer.md, quiet machine) ZB-V on a split predicted 1.3% faster at worst ran 18% slower
#: than on torchtitan's. A move has to promise more than that kind of error to be worth making.
MIN_SPLIT_GAIN = 1.05


def chunked_loss(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is torchtitan's ``ChunkedLossWrapper`` (or behaves as one: it takes
    the ``lm_head`` and runs it per sequence chunk inside the loss call)."""
    if loss_fn is None:
        return False
    try:
        from torchtitan.components.loss import ChunkedLossWrapper
    except ImportError:  # an older torchtitan: none of its losses chunk
        return False
    return isinstance(loss_fn, ChunkedLossWrapper)


def _numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def model_layer_costs(
    model: Any, model_config: Any, seq: int, microbatch_size: int, *, chunked: bool = False
) -> list[LayerCost]:
    """The pieces of torchtitan's decoder ``model`` in model order, with analytic costs: the
    embedding, ``layers.<i>``, then ``norm`` and ``lm_head`` together.

    ``chunked``: the loss is torchtitan's ``ChunkedLossWrapper``, which runs the head and the
    loss per sequence chunk inside the loss call, each chunk's forward and backward (input and
    weight gradient, fused) at once: in ``torch.distributed.pipelining`` that is the last
    stage's F. The head's whole cost is then F (three projections) and none of it B or W: its
    backward cannot wait, its W cannot fill a bubble. Nor does it keep the logits until B: only
    the gradient of its input, which the wrapper accumulates (fp32), and the norm's input."""
    hidden = int(model_config.dim)
    pieces = [
        LayerCost(
            ("tok_embeddings",),
            f=seq * microbatch_size * hidden,
            b=0.0,
            w=seq * microbatch_size * hidden,
            mem=0.0,
        )
    ]
    for i, layer_config in enumerate(model_config.layers):
        layer = model.get_submodule(f"layers.{i}")
        total = _numel(layer)
        moe = getattr(layer_config, "moe", None)
        experts = getattr(layer, "moe", None)
        active = float(total)
        if moe is not None and experts is not None:
            routed = getattr(experts, "experts", None) or getattr(experts, "routed_experts", None)
            if routed is not None:
                top_k = getattr(getattr(moe, "router", None), "top_k", 1)
                share = top_k / max(int(moe.num_experts), 1)
                active = total - _numel(routed) * (1 - share)
        pieces.append(
            layer_cost_from_params(
                f"layers.{i}", active, hidden=hidden, seq=seq, microbatch_size=microbatch_size
            )
        )
    head = model.get_submodule("lm_head")
    tokens = seq * microbatch_size
    projection = 2.0 * tokens * _numel(head)
    vocab = _numel(head) // max(hidden, 1)
    pieces.append(
        LayerCost(
            ("norm", "lm_head"),
            f=3 * projection if chunked else projection,
            b=0.0 if chunked else projection,
            w=0.0 if chunked else projection,
            # a plain loss keeps the logits and their gradient; the chunked one only the norm's
            # input and the gradient it accumulates for the stage's B (fp32)
            mem=4.0 * tokens * (2 * hidden if chunked else hidden + 2 * vocab),
        )
    )
    return pieces


def sizes_of(parts: list[list[str]], pieces: list[LayerCost]) -> list[int]:
    """torchtitan's module names per part as pieces per stage (the head's two names count once)."""
    owner = {name: i for i, piece in enumerate(pieces) for name in piece.names}
    return [len({owner[name] for name in part}) for part in parts]


def schedule_split(
    cls: type,
    *,
    model: Any,
    model_config: Any,
    parallelism: Any,
    training: Any,
    num_ranks: int,
    num_stages: int,
    default_parts: list[list[str]],
    loss_fn: Any = None,
) -> Split | None:
    """The split for ``cls`` in torchtitan, or None to keep torchtitan's (switched off, a user's
    split, a schedule choosing its plan at run time, or nothing to split). ``loss_fn``: the
    Trainer's loss (its kind decides where the head's backward runs, :func:`chunked_loss`).
    The split is judged with the head anywhere from 1 to :data:`HEAD_COST_MAX` times its
    analytic cost and is no slower than torchtitan's at any of them; the integration moves to
    it only where :func:`worth_moving` says so."""
    name = plan_name_of(cls)
    if split_mode() == "default" or user_split(parallelism) or name is None:
        return None
    microbatch_size = parallelism.pipeline_parallel_microbatch_size
    n_microbatches = max(training.local_batch_size // microbatch_size, 1)
    pieces = model_layer_costs(
        model, model_config, training.seq_len, microbatch_size, chunked=chunked_loss(loss_fn)
    )
    if len(pieces) < num_stages:
        return None
    plan_for = "costs" if getattr(cls, "fixed_options", {}).get("costs") == "profile" else "equal"
    try:
        return choose_split(
            pieces,
            num_ranks,
            name,
            n_microbatches,
            baseline=sizes_of(default_parts, pieces),
            plan_for=plan_for,
            head_scales=(1.0, HEAD_COST_MAX),
        )
    except ValueError as error:  # a split the planner cannot judge: torchtitan's stays
        logger.info("zbpipe: keeping torchtitan's split for %s: %s", cls.__name__, error)
        return None


def worth_moving(split: Split) -> bool:
    """Whether ``split`` replaces torchtitan's: it is torchtitan's, or it gains at least
    :data:`MIN_SPLIT_GAIN` at worst over the head's cost range."""
    return split.sizes == split.baseline_sizes or split.worst_gain >= MIN_SPLIT_GAIN


def describe(cls: type, split: Split, n_microbatches: int) -> str:
    """The one INFO line: what was chosen, against what, what the simulator predicts."""
    if not worth_moving(split):
        return (
            f"zbpipe: {cls.__name__} keeps torchtitan's split {list(split.baseline_sizes)} "
            f"(pieces per stage, embedding and head one each): the best other split, "
            f"{list(split.sizes)}, simulates {split.worst_gain:.3f}x the steps a second at worst "
            f"with the head up to {HEAD_COST_MAX}x its FLOPs, under the {MIN_SPLIT_GAIN}x a move "
            "needs"
        )
    if split.sizes == split.baseline_sizes:
        return (
            f"zbpipe: {cls.__name__} keeps torchtitan's split {list(split.sizes)} (pieces per "
            f"stage, embedding and head one each): no split simulates faster for "
            f"{n_microbatches} microbatches"
        )
    return (
        f"zbpipe: {cls.__name__} splits the model {list(split.sizes)} (pieces per stage, "
        f"embedding and head one each; torchtitan's default {list(split.baseline_sizes)}): "
        f"simulated step {1 / split.gain:.3f}x the default's ({split.gain:.3f}x the steps a "
        f"second) for {n_microbatches} microbatches, from analytic FLOPs ({split.worst_gain:.3f}x "
        f"at worst with the head up to {HEAD_COST_MAX}x its FLOPs); {ENV}=default keeps "
        "torchtitan's"
    )
