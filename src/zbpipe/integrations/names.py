"""One table from schedule name to zbpipe's schedule class, the one lookup that reads it, and
the registration that makes torch's own ``get_schedule_class`` read it too.

Every way of naming a zbpipe schedule resolves here: :func:`zbpipe.get_schedule_class`, torch's
own ``get_schedule_class`` once :func:`zbpipe.register` ran
(:func:`lookup_zbpipe`), and the torchtitan integration
(:mod:`zbpipe.torchtitan`, through ``lookup_zbpipe``). A name
matches a key of :data:`SCHEDULE_CLASSES` or a class's own name (``"ZBVHalf"``,
``"ScheduleZBVHalf"``), in any case. To add a schedule class, add a line to the table.

Options a config can only give in the name (torchtitan passes none to the constructor) follow
it after colons, ``"<name>[:<budget>][:<engine>][:profile]"``: ``":profile"`` fixes
``costs="profile"`` (``"ZBV:profile"``, ``"ZBVHalf:profile"``: :func:`with_profile`), a budget
fixes ``memory_limit=`` (``"Auto:40GiB"``, ``"AutoV:80%:profile"``: :func:`with_budget`), an
engine fixes ``split=`` (``"ZBV:deferred"``, ``"ZBH1:graph:profile"``: :func:`with_split`),
``":nopromise"`` fixes ``memory_promise=False`` (``"ZBV:nopromise"``: :func:`without_promise`). Each
name with options is one class, made once, whatever the options' order.

Plan names (``plan("ZBVHalf", ...)``) are a different table, :data:`zbpipe.planning.GENERATORS`:
a name there maps to a plan generator, here to a class that runs a plan. The fixed-option classes
(:mod:`zbpipe.schedules.classes`) make every zbpipe plan name a class name too.

Registration. torch resolves a schedule name (``"1F1B"``, ``"ZBVZeroBubble"``...) with
``torch.distributed.pipelining.schedules.get_schedule_class``, a closed table. Code built on
torch (torchtitan's ``pipeline_parallel`` module among others) imports that function by name
and never asks anyone else. :func:`register` replaces it, in torch's module and in every
already-imported module that holds it by name, with a wrapper that

1. looks the name up in the table here (:func:`find_schedule_class`) *at call time* (so classes
   added to it later are found), matching a short name or a class name, case-insensitively,
   among the classes torch's builders can drive (not ``ScheduleContinuous``);
2. otherwise calls torch's original function, unchanged (so torch's names and torch's
   ``ValueError`` for unknown names behave exactly as before).

zbpipe's names are looked up first: a zbpipe name equal to one of torch's would shadow it, so
zbpipe avoids torch's names. The original stays reachable as ``wrapper.__wrapped__`` and as
:func:`original_get_schedule_class`. :func:`unregister` puts it back everywhere the wrapper
was installed. Both calls are explicit and idempotent; nothing happens at import time.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType

from ..continuous.schedule import ScheduleContinuous
from ..engines.protocol import SPLITS
from ..patching import rebind
from ..planning.budget import is_budget_string
from ..schedules import chooser
from ..schedules import classes as c
from ..schedules.overlapped import ScheduleDualPipeV
from ..schedules.runtime import PlannedSchedule

#: zbpipe's schedule classes by the short name configs use (torchtitan's
#: ``pipeline_parallel_schedule``). No name here is one of torch's (``"1F1B"`` stays torch's
#: ``Schedule1F1B``): zbpipe's names are looked up first and must never shadow torch's.
SCHEDULE_CLASSES: dict[str, type] = {
    "1F1BMulti": c.Schedule1F1BMulti,
    "ZBH1": c.ScheduleZBH1,
    "ZBH2": c.ScheduleZBH2,
    "ZBAuto": c.ScheduleZBAuto,
    "ZB1P": c.ScheduleZB1P,
    "ZB2P": c.ScheduleZB2P,
    "ZBV": c.ScheduleZBV,
    "ZBVHalf": c.ScheduleZBVHalf,
    "ZBVMin": c.ScheduleZBVMin,
    "ZBDualPipeV": ScheduleDualPipeV,
    "ZBInterleaved": c.ScheduleZBInterleaved,
    "Auto": chooser.ScheduleAuto,
    "AutoV": chooser.ScheduleAutoV,
    "Continuous": ScheduleContinuous,
}

#: classes that take ``memory_limit=``: a name ``"<name>:<budget>"`` (``"Auto:40GiB"``,
#: ``"ZBAuto:512MiB"``, ``"AutoV:80%"``) gives the budget where only a name can be configured
#: (torchtitan's ``pipeline_parallel_schedule``)
BUDGETED: tuple[type, ...] = (c.ScheduleZBAuto, chooser.ScheduleAuto, ScheduleDualPipeV)

#: of those, the classes whose budget is bytes only (no ``"1p"`` / ``"2p"``):
#: ``"ZBDualPipeV:7.5MiB"``, the budget its log names to keep every overlapped pair
BYTES_ONLY: tuple[type, ...] = (ScheduleDualPipeV,)

#: the name option that fixes ``costs="profile"`` (``"ZBV:profile"``): the first steps measure
#: the stages' costs and bytes and the plan is re-made for them (:mod:`zbpipe.observe.profile`)
PROFILE = "profile"

#: the name option that fixes ``memory_promise=False`` (``"ZBV:nopromise"``): the plan for
#: equal bytes per stage runs, not re-made to keep the promise in the measured bytes
NOPROMISE = "nopromise"


def is_torch_shaped(cls: type) -> bool:
    """Whether torch's and torchtitan's builders can drive ``cls``: torch's constructor
    (``cls(stages, n_microbatches, loss_fn=...)``) and ``step()`` contract. Every
    :class:`~zbpipe.schedules.runtime.PlannedSchedule` is; ``ScheduleContinuous`` is not (it needs
    ``optimizer=`` and owns the optimizer step)."""
    return issubclass(cls, PlannedSchedule)


def find_schedule_class(name: str, *, torch_shaped_only: bool = False) -> type | None:
    """zbpipe's class for ``name`` (a :data:`SCHEDULE_CLASSES` key or a class name, any case),
    else None. ``torch_shaped_only``: None for a class :func:`is_torch_shaped` refuses.

    A name may carry options after colons, ``"<name>[:<budget>][:profile]"`` in any order, each
    at most once (:func:`with_options`): ``"ZBV:profile"``, ``"Auto:40GiB"``,
    ``"AutoV:80%:profile"``. A zbpipe name with an option it cannot take raises ``ValueError``.

    Reads the table at call time, so a line added to it later is found.
    """
    base, *options = name.split(":")
    if options:
        found = find_schedule_class(base, torch_shaped_only=torch_shaped_only)
        return None if found is None else with_options(found, name, options)
    wanted = name.strip().lower()
    for key, cls in SCHEDULE_CLASSES.items():
        if wanted in (key.lower(), cls.__name__.lower()):
            return None if torch_shaped_only and not is_torch_shaped(cls) else cls
    return None


def with_options(cls: type, name: str, options: list[str]) -> type:
    """``cls`` with the options of the name ``name`` fixed: at most one memory budget (classes in
    :data:`BUDGETED`), at most one engine (``deferred``, ``graph``, ``auto``), at most one
    ``profile`` and at most one ``nopromise``, in any order; the same class for any order.
    Anything else raises ``ValueError`` saying what a name can carry."""
    budget: str | None = None
    split: str | None = None
    profile = nopromise = False
    for raw in options:
        option = raw.strip()
        if option.lower() in ("1p", "2p", PROFILE, NOPROMISE, *SPLITS):
            option = option.lower()
        if option == PROFILE:
            if profile:
                raise ValueError(f"schedule name {name!r}: ':profile' given twice")
            profile = True
        elif option == NOPROMISE:
            if nopromise:
                raise ValueError(f"schedule name {name!r}: ':{NOPROMISE}' given twice")
            nopromise = True
        elif option in SPLITS:
            if split is not None:
                raise ValueError(
                    f"schedule name {name!r}: two engines ({split!r}, {option!r}); give one"
                )
            split = option
        elif _is_budget(option):
            if budget is not None:
                raise ValueError(
                    f"schedule name {name!r}: two memory budgets ({budget!r}, {option!r}); give one"
                )
            budget = option
        else:
            raise ValueError(
                f"schedule name {name!r}: unknown option {option!r}. A name takes "
                f"':{PROFILE}' (costs measured on the first steps, every schedule but "
                f"Continuous), an engine for the split backward ({_split_names()}) and, for "
                f"{_budgeted_names()}, a memory budget per rank: '1p', '2p', bytes like '40GiB' "
                f"or a share of the device like '80%', and ':{NOPROMISE}' (the plan for equal "
                "bytes, not re-made to keep the memory promise); e.g. 'ZBV:profile', "
                "'ZBV:deferred', 'ZBV:nopromise', 'Auto:40GiB', 'AutoV:40GiB:profile'"
            )
    if nopromise and profile:
        raise ValueError(
            f"schedule name {name!r}: ':{NOPROMISE}' and ':{PROFILE}' do not go together (the "
            "profile's re-plan keeps the memory promise in the measured bytes); give one"
        )
    if budget is not None:
        cls = with_budget(cls, budget)
    if split is not None:
        cls = with_split(cls, split)
    if nopromise:
        cls = without_promise(cls)
    return with_profile(cls) if profile else cls


def _is_budget(option: str) -> bool:
    from ..planning.budget import is_budget_string

    return option.lower() in ("1p", "2p") or is_budget_string(option)


def _budgeted_names() -> list[str]:
    return sorted(
        k
        for k, v in SCHEDULE_CLASSES.items()
        if issubclass(v, BUDGETED) and "memory_limit" not in getattr(v, "fixed_options", {})
    )


@functools.cache  # one class per (class, budget): torchtitan compares classes
def with_budget(cls: type, budget: str) -> type:
    """``cls`` with ``memory_limit=budget`` fixed: the class ``"Auto:40GiB"`` names.

    Raises ``ValueError`` for a class without a memory budget (or with one fixed already:
    ``ZB1P``) or a budget it refuses (checked when the class is built, before any stage exists:
    ``"1p"``, ``"2p"``, bytes, ``"80%"``).
    """
    if not issubclass(cls, BUDGETED) or "memory_limit" in getattr(cls, "fixed_options", {}):
        raise ValueError(
            f"schedule {cls.__name__} takes no memory budget; '<name>:<budget>' works for "
            f"{_budgeted_names()}"
        )
    if not _is_budget(budget):
        raise ValueError(
            f"schedule {cls.__name__}:{budget}: the budget must be '1p', '2p', bytes like "
            "'40GiB' or a share of the device like '80%'"
        )
    if issubclass(cls, BYTES_ONLY) and not is_budget_string(budget):
        raise ValueError(
            f"schedule {cls.__name__}:{budget}: its budget is bytes like '40GiB' or a share "
            "of the device like '80%'"
        )
    fixed = c.with_fixed_option(cls, f"{cls.__name__}:{budget}", "memory_limit", budget)
    return fixed


def _split_names() -> str:
    return ", ".join(f"':{x}'" for x in SPLITS)


@functools.cache  # one class per (class, engine): torchtitan compares classes
def with_split(cls: type, split: str) -> type:
    """``cls`` with ``split=split`` fixed: the class ``"ZBV:deferred"`` names. ``"deferred"``
    defers the weight GEMMs of ``nn.Linear`` modules, ``"graph"`` every weight gradient through
    the autograd graph, ``"auto"`` (every class's default) picks by the stage
    (:mod:`zbpipe.engines`).

    Raises ``ValueError`` for an engine zbpipe does not have, a class that takes no ``split=``
    (torch's own names take no options) or one with its engine fixed already.
    """
    if split not in SPLITS:
        raise ValueError(
            f"schedule {cls.__name__}:{split}: the engine must be one of {_split_names()}"
        )
    takes_split = issubclass(cls, (PlannedSchedule, ScheduleContinuous))
    if not takes_split or "split" in getattr(cls, "fixed_options", {}):
        works = sorted(SCHEDULE_CLASSES)
        raise ValueError(
            f"schedule {cls.__name__} takes no ':{split}': an engine goes after any of {works}"
        )
    return c.with_fixed_option(cls, f"{cls.__name__}:{split}", "split", split)


@functools.cache  # one class per class: torchtitan compares classes
def without_promise(cls: type) -> type:
    """``cls`` with ``memory_promise=False`` fixed: the class ``"ZBV:nopromise"`` names. Its
    plan for equal bytes per stage runs from the first step; the bytes are still measured in
    the first step and the plan's predicted peak logged, but the plan is not re-made to keep
    the promise in them: faster where the promise binds, for the memory the log states.

    Raises ``ValueError`` for a class that makes no memory promise (``1F1BMulti``,
    ``Continuous``), takes a memory budget instead (``Auto``, ``ZB1P``...) or has it fixed
    already.
    """

    def takes(v: type) -> bool:  # (a budgeted class's budget is what the user asked for)
        return issubclass(v, PlannedSchedule) and v.memory_planned and not issubclass(v, BUDGETED)

    if not takes(cls) or "memory_promise" in getattr(cls, "fixed_options", {}):
        works = sorted(k for k, v in SCHEDULE_CLASSES.items() if takes(v))
        raise ValueError(
            f"schedule {cls.__name__} takes no ':{NOPROMISE}': it works for the schedules "
            f"whose memory promise is fixed, {works} (a memory budget is given instead)"
        )
    return c.with_fixed_option(cls, f"{cls.__name__}:{NOPROMISE}", "memory_promise", False)


@functools.cache  # one class per class: torchtitan compares classes
def with_profile(cls: type) -> type:
    """``cls`` with ``costs="profile"`` fixed: the class ``"ZBV:profile"`` names. Its first
    steps run the equal-cost plan while measuring each stage's F, B, W times and bytes; the plan
    is then re-made for them on every rank alike (:class:`zbpipe.ProfileConfig`'s defaults: one
    warm-up step, two measured steps, the re-plan at the end of the third).

    Raises ``ValueError`` for a class that takes no ``costs="profile"`` (``Continuous``) or has
    its costs fixed already.
    """
    if not is_torch_shaped(cls) or "costs" in getattr(cls, "fixed_options", {}):
        works = sorted(k for k, v in SCHEDULE_CLASSES.items() if is_torch_shaped(v))
        raise ValueError(
            f"schedule {cls.__name__} takes no ':{PROFILE}': it works for every zbpipe schedule "
            f"torch's builders drive, {works}"
        )
    return c.with_fixed_option(cls, f"{cls.__name__}:{PROFILE}", "costs", PROFILE)


def get_schedule_class(name: str) -> type:
    """The schedule class for ``name`` (case-insensitive): zbpipe's names first, then torch's.

    >>> get_schedule_class("ZBVHalf").__name__
    'ScheduleZBVHalf'
    """
    found = find_schedule_class(name)
    if found is not None:
        return found
    try:
        return original_get_schedule_class()(name)
    except ValueError as torch_error:  # torch's message lists torch's names
        raise ValueError(
            f"unknown schedule {name!r}: zbpipe knows {sorted(SCHEDULE_CLASSES)}; "
            f"torch: {torch_error}"
        ) from None


# Registration: torch's own get_schedule_class learns zbpipe's names.

logger = logging.getLogger(__name__)

_ATTR = "get_schedule_class"
_MARK = "__zbpipe_registered__"


def _torch_schedules() -> ModuleType:
    import torch.distributed.pipelining.schedules as schedules

    return schedules


def _is_wrapper(fn: object) -> bool:
    return getattr(fn, _MARK, False) is True


def original_get_schedule_class() -> Callable[[str], type]:
    """torch's own ``get_schedule_class``, whether or not :func:`register` has run."""
    fn = getattr(_torch_schedules(), _ATTR)
    return fn.__wrapped__ if _is_wrapper(fn) else fn


def lookup_zbpipe(name: str) -> type | None:
    """zbpipe's torch-shaped class for ``name``, else ``None``: a short name (``ZBH1``,
    ``ZBVHalf``...) or a class name, any case, from :data:`SCHEDULE_CLASSES`.
    ``ScheduleContinuous`` is left out: torch's and torchtitan's builders cannot drive it."""
    return find_schedule_class(name, torch_shaped_only=True)


def _make_wrapper(original: Callable[[str], type]) -> Callable[[str], type]:
    @functools.wraps(original)
    def get_schedule_class(schedule_name: str) -> type:
        cls = lookup_zbpipe(schedule_name)
        return cls if cls is not None else original(schedule_name)

    get_schedule_class.__doc__ = (
        "torch's get_schedule_class, extended by zbpipe.register(): zbpipe's "
        "schedule names first, then torch's. The original is __wrapped__."
    )
    setattr(get_schedule_class, _MARK, True)
    return get_schedule_class


def register() -> Callable[[str], type]:
    """Make ``torch.distributed.pipelining.schedules.get_schedule_class`` resolve zbpipe's names.

    Rebinds the name in torch's module and in every loaded module that imported it by name
    (e.g. ``torchtitan.distributed.pipeline_parallel``); modules imported afterwards pick up the
    wrapper from torch. Idempotent: a second call only rebinds modules loaded since the first.
    Returns the wrapper.
    """
    torch_mod = _torch_schedules()
    current = getattr(torch_mod, _ATTR)
    original = current.__wrapped__ if _is_wrapper(current) else current
    wrapper = current if _is_wrapper(current) else _make_wrapper(original)
    patched = rebind(_ATTR, original, wrapper)
    if patched:
        logger.debug(
            "zbpipe: get_schedule_class wrapped in %s", sorted(p.target.__name__ for p in patched)
        )
    return wrapper


def unregister() -> None:
    """Undo :func:`register`: every module holding the wrapper gets torch's original back."""
    current = getattr(_torch_schedules(), _ATTR)
    if not _is_wrapper(current):
        return
    rebind(_ATTR, current, current.__wrapped__)


def is_registered() -> bool:
    """Whether torch's ``get_schedule_class`` currently resolves zbpipe's names."""
    return _is_wrapper(getattr(_torch_schedules(), _ATTR))
