"""Use zbpipe's schedules from torchtitan: importing this module on every rank is the integration.

torchtitan picks a schedule by name through torch's ``get_schedule_class`` and then makes three
decisions zbpipe's classes must answer for themselves:

* **stage placement**: torchtitan chooses V placement by an identity check against torch's
  ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV``; zbpipe asks the class
  (``cls.layout``, ``cls.stage_index_to_rank``);
* **stages per rank**: torchtitan gives every ``PipelineScheduleMulti`` subclass two stages per
  rank; zbpipe uses ``cls.stages_per_rank`` (ZB-H1: one);
* **which rank logs the loss**: torchtitan names the rank of the last stage by comparing the
  schedule name with ``"ZBVZeroBubble"``; zbpipe asks where the class puts the last stage;
* **which layers each stage holds** (0.3.x): torchtitan's default split is made for 1F1B;
  ``pipeline_llm`` gets a split made for the schedule
  (:mod:`zbpipe.integrations.torchtitan_split`) unless the config gives one.

:func:`install` (run at import) registers zbpipe's names with torch
(:func:`zbpipe.integrations.names.register`) and wraps the few torchtitan functions behind those
decisions. Every wrapper passes non-zbpipe schedules to torchtitan's original untouched. Each
wrapped function is rebound in every loaded module that imported it by name. If the functions
this module targets are missing, it raises ``ImportError`` naming the torchtitan version found.

Config (torchtitan 0.2.x TOML): ``[experimental] custom_import = "zbpipe.torchtitan"``.
torchtitan 0.3.x: ``--module zbpipe.torchtitan --config llama3_debugmodel_zbh1`` (the config
functions below), or import this module from your own config registry.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ..patching import rebind
from ..schedules.entry import named
from .names import lookup_zbpipe, register

logger = logging.getLogger(__name__)

_PP = "torchtitan.distributed.pipeline_parallel"
_METRICS = "torchtitan.components.metrics"
_MARK = "__zbpipe_wrapped__"


# ---------------------------------------------------------------- decisions, asked of the class
def takes_stage_count(cls: type, pp_degree: int, num_stages: int) -> bool:
    """Whether ``cls`` runs ``num_stages`` stages on ``pp_degree`` ranks: its own stages per
    rank, or any number from there up for a class that takes several (ZB-Interleaved)."""
    if getattr(cls, "any_stages_per_rank", False):
        return num_stages % pp_degree == 0 and num_stages // pp_degree >= cls.stages_per_rank
    return num_stages == pp_degree * cls.stages_per_rank


def stage_indices(cls: type, pp_rank: int, pp_degree: int, num_stages: int) -> tuple[int, ...]:
    """The stages ``pp_rank`` holds under ``cls``'s own placement, in increasing order."""
    expected = pp_degree * cls.stages_per_rank
    if not takes_stage_count(cls, pp_degree, num_stages):
        raise ValueError(
            f"{cls.__name__} runs {cls.stages_per_rank} stage(s) per rank, "
            f"so {pp_degree} pipeline ranks need {expected} model parts, got {num_stages}: "
            "leave pipeline_parallel_layers_per_stage unset "
            f"or give module_fqns_per_model_part with {expected} entries"
        )
    if getattr(cls, "any_stages_per_rank", False):
        placement = cls.stage_index_to_rank(pp_degree, num_stages // pp_degree)
    else:
        placement = cls.stage_index_to_rank(pp_degree)
    return tuple(sorted(s for s, r in placement.items() if r == pp_rank))


def last_stage_pp_rank(cls: type, pp_degree: int) -> int:
    """The pipeline rank holding the last stage (the one that sees the loss): 0 in V placement."""
    placement = cls.stage_index_to_rank(pp_degree)
    return placement[max(placement)]


def _torch_proxy_name(cls: type) -> str:
    # A torch schedule with the same stages per rank, so torchtitan's own stage-count code and
    # its checks run unchanged: single-stage for 1 per rank, a looped Multi for 2 or more.
    return "1F1B" if cls.stages_per_rank == 1 else "Interleaved1F1B"


# ---------------------------------------------------------------- wrappers, one per target
def _wrap_pipeline_metadata(original: Callable) -> Callable:
    """torchtitan 0.3.x ``pipeline_parallel._get_pipeline_metadata(parallel_dims, parallelism,
    model_config) -> (num_virtual_stages, num_layers, input_weight, output_weight)``."""

    @functools.wraps(original)
    def _get_pipeline_metadata(parallel_dims: Any, parallelism: Any, model_config: Any) -> tuple:
        cls = lookup_zbpipe(parallelism.pipeline_parallel_schedule)
        if cls is None:
            return original(parallel_dims, parallelism, model_config)
        proxy = dataclasses.replace(parallelism, pipeline_parallel_schedule=_torch_proxy_name(cls))
        num_stages, *rest = original(parallel_dims, proxy, model_config)
        expected = parallel_dims.pp * cls.stages_per_rank
        if parallelism.pipeline_parallel_layers_per_stage is None:
            num_stages = expected  # torchtitan's default is 2 for any Multi; the class knows better
        elif not takes_stage_count(cls, parallel_dims.pp, num_stages):
            raise ValueError(
                f"{cls.__name__} runs {cls.stages_per_rank} stage(s) per rank but "
                "pipeline_parallel_layers_per_stage="
                f"{parallelism.pipeline_parallel_layers_per_stage} gives "
                f"{num_stages} stages on {parallel_dims.pp} ranks: "
                f"unset it or choose one giving {expected}"
            )
        return (num_stages, *rest)

    return _get_pipeline_metadata


def _wrap_stage_mapping(original: Callable) -> Callable:
    """torchtitan 0.3.x ``pipeline_parallel._get_pp_rank_to_stage_indices_mapping(pp_rank,
    pp_degree, pp_schedule, num_stages) -> tuple[int, ...]`` (V by identity check)."""

    @functools.wraps(original)
    def _get_pp_rank_to_stage_indices_mapping(
        pp_rank: int, pp_degree: int, pp_schedule: str, num_stages: int
    ) -> tuple[int, ...]:
        cls = lookup_zbpipe(pp_schedule)
        if cls is None:
            return original(pp_rank, pp_degree, pp_schedule, num_stages)
        return stage_indices(cls, pp_rank, pp_degree, num_stages)

    return _get_pp_rank_to_stage_indices_mapping


def _wrap_module_split_v02(original: Callable) -> Callable:
    """torchtitan 0.2.x ``pipeline_parallel.pipeline_module_split(whole_model, pp_mesh,
    pp_schedule, device, module_names_per_stage)``: placement is decided inside it (a closure),
    and the stage count was fixed earlier inside ``pipeline_llm`` (2 per rank for any Multi).

    For a zbpipe class this passes the name of a torch schedule with the same placement (V:
    ``ZBVZeroBubble``, whose V pairs are zbpipe's ``v_placement``; loop: any other) and, for a
    one-stage-per-rank class handed the default 2 parts per rank, merges consecutive pairs.
    """

    @functools.wraps(original)
    def pipeline_module_split(
        whole_model: Any,
        pp_mesh: Any,
        pp_schedule: str,
        device: Any,
        module_names_per_stage: list,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        cls = lookup_zbpipe(pp_schedule)
        if cls is None:
            return original(
                whole_model, pp_mesh, pp_schedule, device, module_names_per_stage, *args, **kwargs
            )
        pp_degree = pp_mesh.size()
        names = list(module_names_per_stage)
        if cls.stages_per_rank == 1 and len(names) == 2 * pp_degree:
            names = [names[i] + names[i + 1] for i in range(0, len(names), 2)]
            logger.info(
                "zbpipe: %s runs one stage per rank; merged torchtitan's %d parts into %d",
                cls.__name__,
                2 * pp_degree,
                pp_degree,
            )
        mine = stage_indices(cls, pp_mesh.get_local_rank(), pp_degree, len(names))
        proxy = "ZBVZeroBubble" if cls.layout == "v" else "1F1B"
        stages, models = original(whole_model, pp_mesh, proxy, device, names, *args, **kwargs)
        got = tuple(s.stage_index for s in stages)
        if tuple(sorted(got)) != mine:
            raise RuntimeError(
                f"zbpipe: torchtitan built stages {got} on this rank, {cls.__name__} needs {mine}"
            )
        return stages, models

    return pipeline_module_split


def _wrap_pipeline_llm(original: Callable) -> Callable:
    """torchtitan 0.3.x ``pipeline_parallel.pipeline_llm(model, *, parallel_dims, training,
    parallelism, model_config, ...)``: for a zbpipe schedule and no split of the user's, passes
    the split made for the schedule as ``module_fqns_per_model_part``
    (:mod:`zbpipe.integrations.torchtitan_split`)."""

    @functools.wraps(original)
    def pipeline_llm(model: Any, **kwargs: Any) -> Any:
        parallelism = kwargs["parallelism"]
        cls = lookup_zbpipe(parallelism.pipeline_parallel_schedule)
        if cls is not None:
            parts = _split_for(cls, model, **kwargs)
            if parts is not None:
                kwargs["parallelism"] = dataclasses.replace(
                    parallelism, module_fqns_per_model_part=parts
                )
            # the schedule built inside knows its config name: its advice names an option
            # of that name, which a config can carry (zbpipe.schedules.entry)
            with named(parallelism.pipeline_parallel_schedule):
                return original(model, **kwargs)
        return original(model, **kwargs)

    return pipeline_llm


def _split_for(cls: type, model: Any, **kwargs: Any) -> list[list[str]] | None:
    from . import torchtitan_split as ts

    pp = importlib.import_module(_PP)
    parallelism, dims = kwargs["parallelism"], kwargs["parallel_dims"]
    if ts.split_mode() == "default" or ts.user_split(parallelism):
        return None  # checked before any cost is counted: a user's split is theirs
    num_stages, num_layers, first, last = pp._get_pipeline_metadata(
        dims, parallelism, kwargs["model_config"]
    )
    default = pp._generate_llm_fqn_per_model_part(num_stages, num_layers, first, last)
    split = ts.schedule_split(
        cls,
        model=model,
        model_config=kwargs["model_config"],
        parallelism=parallelism,
        training=kwargs["training"],
        num_ranks=dims.pp,
        num_stages=num_stages,
        default_parts=default,
        loss_fn=kwargs.get("loss_fn"),
    )
    if split is None:
        return None
    if _is_logging_rank():
        m = max(
            kwargs["training"].local_batch_size // parallelism.pipeline_parallel_microbatch_size, 1
        )
        logger.info(ts.describe(cls, split, m))
    if not ts.worth_moving(split):
        return None
    return [list(part) for part in split.parts]


def _is_logging_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _metrics_rank(cls: type, parallel_dims: Any) -> int:
    # torchtitan's layout: pp is the outermost mesh dimension, so the first global rank of pipeline
    # rank r is r * (world_size // pp) (same formula torchtitan uses for the last rank).
    return (parallel_dims.world_size // parallel_dims.pp) * last_stage_pp_rank(
        cls, parallel_dims.pp
    )


def _schedule_name(kwargs: dict, args: tuple, v02: bool) -> str:
    if v02:  # (parallel_dims, job_config[, color])
        job_config = kwargs.get("job_config", args[1] if len(args) > 1 else None)
        return job_config.parallelism.pipeline_parallel_schedule
    return kwargs["pp_schedule"]  # 0.3.x: keyword-only


def _wrap_get_metrics_rank(original: Callable, v02: bool) -> Callable:
    """``metrics._get_metrics_rank``: 0.3.x ``(*, parallel_dims, pp_schedule)``, 0.2.x
    ``(parallel_dims, job_config)``; returns the global rank that writes TensorBoard/W&B."""

    @functools.wraps(original)
    def _get_metrics_rank(*args: Any, **kwargs: Any) -> int:
        parallel_dims = kwargs.get("parallel_dims", args[0] if args else None)
        cls = lookup_zbpipe(_schedule_name(kwargs, args, v02))
        if cls is None or not parallel_dims.pp_enabled:
            return original(*args, **kwargs)
        return _metrics_rank(cls, parallel_dims)

    return _get_metrics_rank


def _wrap_ensure_loss_visible(original: Callable, v02: bool) -> Callable:
    """``metrics.ensure_pp_loss_visible``: 0.3.x ``(*, parallel_dims, pp_schedule, color)``,
    0.2.x ``(parallel_dims, job_config, color)``; warns when LOG_RANK hides the loss."""

    @functools.wraps(original)
    def ensure_pp_loss_visible(*args: Any, **kwargs: Any) -> None:
        parallel_dims = kwargs.get("parallel_dims", args[0] if args else None)
        cls = lookup_zbpipe(_schedule_name(kwargs, args, v02))
        if cls is None:
            return original(*args, **kwargs)
        rank = _metrics_rank(cls, parallel_dims)
        if str(rank) not in os.environ.get("LOG_RANK", "").split(","):
            logger.warning(
                "zbpipe: the %s loss is printed by rank %d only; add %d to LOG_RANK to see it",
                cls.__name__,
                rank,
                rank,
            )
        return None

    return ensure_pp_loss_visible


# ---------------------------------------------------------------- which functions, per version
#: torchtitan line -> [(module, function, wrapper factory)]. The first line whose functions all
#: exist is patched. 0.3.x was tested (0.3.0, CPU); 0.2.x was written against 0.2.2's source.
TARGETS: dict[str, list[tuple[str, str, Callable[[Callable], Callable]]]] = {
    "0.3.x": [
        (_PP, "_get_pipeline_metadata", _wrap_pipeline_metadata),
        (_PP, "_get_pp_rank_to_stage_indices_mapping", _wrap_stage_mapping),
        (_PP, "pipeline_llm", _wrap_pipeline_llm),
        (_METRICS, "_get_metrics_rank", lambda f: _wrap_get_metrics_rank(f, v02=False)),
        (_METRICS, "ensure_pp_loss_visible", lambda f: _wrap_ensure_loss_visible(f, v02=False)),
    ],
    "0.2.x": [
        (_PP, "pipeline_module_split", _wrap_module_split_v02),
        (_METRICS, "_get_metrics_rank", lambda f: _wrap_get_metrics_rank(f, v02=True)),
        (_METRICS, "ensure_pp_loss_visible", lambda f: _wrap_ensure_loss_visible(f, v02=True)),
    ],
}


def _torchtitan_version() -> str:
    try:
        from importlib.metadata import version

        return version("torchtitan")
    except Exception:  # a source checkout without metadata
        return "unknown"


def _rebind(original: Callable, wrapper: Callable, name: str) -> None:
    rebind(name, original, wrapper)  # zbpipe.patching: undone by rebinding the other way


def install() -> str:
    """Register zbpipe's names with torch and patch torchtitan; idempotent.

    Returns the line patched.
    """
    register()
    modules = {name: importlib.import_module(name) for name in (_PP, _METRICS)}
    for line, targets in TARGETS.items():
        if all(callable(getattr(modules[m], f, None)) for m, f, _ in targets):
            for m, f, make in targets:
                current = getattr(modules[m], f)
                if getattr(current, _MARK, False):
                    _rebind(current.__wrapped__, current, f)  # modules loaded since the last call
                    continue
                wrapper = make(current)
                setattr(wrapper, _MARK, True)
                _rebind(current, wrapper, f)
            register()  # rebind get_schedule_class in torchtitan modules loaded just now
            logger.info(
                "zbpipe: torchtitan %s integration installed (%s targets)",
                _torchtitan_version(),
                line,
            )
            return line
    raise ImportError(
        "zbpipe.torchtitan supports torchtitan 0.2.x and 0.3.x, "
        f"found torchtitan {_torchtitan_version()} "
        f"without the functions it patches: "
        + "; ".join(
            f"{line}: {', '.join(f'{m}.{f}' for m, f, _ in t)}" for line, t in TARGETS.items()
        )
    )


def uninstall() -> None:
    """Undo :func:`install` (for tests): each wrapped torchtitan function gets its original back."""
    from .names import unregister

    for targets in TARGETS.values():
        for m, f, _ in targets:
            module = sys.modules.get(m)
            current = getattr(module, f, None) if module else None
            if getattr(current, _MARK, False):
                _rebind(current, current.__wrapped__, f)
    unregister()


INSTALLED_LINE = install()


# ---------------------------------------------------------------- torchtitan 0.3.x configs
def _llama3_debugmodel(schedule: str) -> Any:
    # torchtitan 0.3.x builds a run from a config function: ``--module zbpipe.torchtitan
    # --config llama3_debugmodel_zbv``. The import of this module is what installs zbpipe.
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.parallelism.pipeline_parallel_schedule = schedule
    return config


def llama3_debugmodel_zbh1() -> Any:
    """torchtitan 0.3.x: llama3 debug model, zbpipe's ZB-H1 (one stage per rank)."""
    return _llama3_debugmodel("ZBH1")


def llama3_debugmodel_zbv() -> Any:
    """torchtitan 0.3.x: llama3 debug model, zbpipe's ZB-V (two stages per rank, V placement)."""
    return _llama3_debugmodel("ZBV")
