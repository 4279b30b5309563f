"""zbpipe's action loop: a rank's action list, resolved once into bound calls, run every step.

torch's ``_PipelineScheduleRuntime`` runs its action list by interpreting it anew each step: per
action a ``record_function`` profiler range (opened whether or not a profiler records, pytorch
#160753), a debug log line, a context object, a dictionary lookup and a chain of tests in a
closure. Where a step's host time is the step (a GPU waiting for Python: small and medium layers,
short sequences, MoE experts with few tokens), that machinery is paid on every action
(docs/results/host-time.md measures it). zbpipe's planned schedules keep torch's lowering, which
inserts SEND/RECV, FSDP UNSHARD/RESHARD and REDUCE_GRAD actions around the plan's compute
actions, and run its result here instead:

* :func:`bind_program` turns each action of this rank into one call, once per lowering (the
  first step, and again after a re-plan or a change of the custom functions): which stage, which
  microbatch, whether a receive precedes it, whether the stage is FSDP-sharded are settled there.
  An action with nothing to do on this rank (UNSHARD of a stage without FSDP) gets no call.
* :meth:`ActionProgram.run` calls them in order with the step's context: no profiler range
  unless a profiler is recording (asked once per step; then one cheap C++ range per action,
  under the name torch's runtime gives it, ``PP:<action>``), no logging, no per-action
  allocation of its own. A failing action is logged with the whole schedule, the failing step
  marked, as torch's runtime does.
* **One table** says how each computation type becomes a call: the schedule class's
  ``action_binders`` (computation type -> :data:`Binder`). A schedule with an action kind of its
  own (DualPipeV's overlapped F-and-B pair, ``OVERLAP_F_B``) adds one entry, in a module of its
  own; nothing here changes.
* A function registered with torch's ``register_custom_function`` for a computation type runs
  in place of the table's call, as in torch's loop (called ``fn(action, ctx)``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import _compat as C

logger = logging.getLogger(__name__)

#: one bound action: called with the step's context (torch's ``_PipelineContext``)
Call = Callable[[Any], None]
#: how an action becomes a call: ``binder(schedule, action)``; None when the action has nothing
#: to do on this rank
Binder = Callable[[Any, Any], Call | None]


class ActionProgram:
    """This rank's actions as bound calls (:func:`bind_program`); :meth:`run` runs one step."""

    __slots__ = ("calls", "names", "positions", "_orders", "_rank")

    def __init__(
        self,
        calls: Sequence[Call],
        names: Sequence[str],
        positions: Sequence[int],
        orders: dict[int, list[Any]],
        rank: int,
    ) -> None:
        #: the calls, in order
        self.calls = tuple(calls)
        #: each call's profiler range name (torch's: ``PP:<action>``)
        self.names = tuple(names)
        #: each call's index in this rank's full action list (for the failure report)
        self.positions = tuple(positions)
        self._orders, self._rank = orders, rank

    def __len__(self) -> int:
        return len(self.calls)

    def run(self, ctx: Any) -> None:
        """Run every call once, in order, with ``ctx``."""
        i = 0
        calls = self.calls
        try:
            if not C.profiler_recording():
                for i, call in enumerate(calls):  # noqa: B007 (i names the failing call)
                    call(ctx)
            else:
                names = self.names
                for i, call in enumerate(calls):  # noqa: B007
                    with C.profiler_range(names[i]):
                        call(ctx)
        except Exception:
            self._report(i)
            raise

    def _report(self, i: int) -> None:
        step = self.positions[i]
        logger.error(
            "zbpipe: rank %d failed at step %d of its action list, running %s. Full schedule:",
            self._rank,
            step,
            self._orders[self._rank][step],
        )
        logger.error("%s", C.format_order(self._orders, step))


def bind_program(
    schedule: Any,
    orders: dict[int, list[Any]],
    binders: Mapping[Any, Binder],
    custom: Mapping[Any, Any],
    own: Any,
) -> ActionProgram:
    """Bind ``schedule``'s rank's action list (``orders[schedule.rank]``) into calls.

    ``binders``: the table (computation type -> :data:`Binder`); ``custom``: torch's
    custom-function table, whose entries other than ``own`` (the schedule's own generic handler)
    run in place of the table's call. Raises ValueError for an action type neither knows.
    """
    calls, names, positions = [], [], []
    for pos, action in enumerate(orders[schedule.rank]):
        call = bind_action(schedule, action, binders, custom, own)
        if call is not None:
            calls.append(call)
            names.append(f"PP:{action}")
            positions.append(pos)
    logger.debug(
        "zbpipe: rank %d runs %d calls for %d actions",
        schedule.rank,
        len(calls),
        len(orders[schedule.rank]),
    )
    return ActionProgram(calls, names, positions, orders, schedule.rank)


def bind_action(
    schedule: Any, action: Any, binders: Mapping[Any, Binder], custom: Mapping[Any, Any], own: Any
) -> Call | None:
    """One action's call (see :func:`bind_program`)."""
    kind = action.computation_type
    fn = custom.get(kind)
    if fn is not None and fn is not own:
        return functools.partial(fn, action)
    binder = binders.get(kind)
    if binder is None:
        raise ValueError(
            f"{type(schedule).__name__}: no handler for {action} ({kind.name}) on rank "
            f"{schedule.rank}: add one to the class's action_binders table "
            "(zbpipe.schedules.action_loop)"
        )
    return binder(schedule, action)
