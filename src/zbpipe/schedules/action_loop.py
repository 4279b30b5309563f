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
* **Where receives are posted** (:func:`receives_ahead`, :data:`RECEIVE_LEAD`): where every
  stage of the rank communicates over gloo, a receive can be posted some compute actions ahead
  of where torch's lowering puts it (just before the action that waits for it), so that its
  message can be read while the rank computes. The receives keep their order (gloo matches a
  peer's messages to receives in posting order) and the sends and waits do not move, so no rank
  can disagree with its peer about what comes next. The default is the lowering's placement
  (lead 0): on this project's 2-core machine, posting a step's receives first made the
  receives' waits *longer* and 1F1B-like steps slower (in five runs of six), ZBV's within the
  noise (docs/results/host-time.md, 2026-11-27 "Two gloo ranks: where the step goes"); a machine
  with a core per rank may differ (``benchmarks/host_overhead_ranks.py`` times both). Never on NCCL
  or another backend: there a receive posted early sits on the stream a later send to the same
  peer needs, and two ranks each waiting for the other's send would hang.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist

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
    bound = []
    for pos, action in enumerate(orders[schedule.rank]):
        call = bind_action(schedule, action, binders, custom, own)
        if call is not None:
            bound.append((pos, action, call))
    if RECEIVE_LEAD != 0 and posts_receives_early(schedule):
        bound = receives_ahead(bound, custom, own, RECEIVE_LEAD)
    calls = [call for _, _, call in bound]
    names = [f"PP:{action}" for _, action, _ in bound]
    positions = [pos for pos, _, _ in bound]
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


def posts_receives_early(schedule: Any) -> bool:
    """True where every stage of ``schedule``'s rank sends and receives over gloo, where a
    receive may be posted ahead of its place (:data:`RECEIVE_LEAD`; never on NCCL: module
    docstring)."""
    seam = getattr(schedule, "seam", None)
    stages = list(seam.stages.values()) if seam is not None else []
    if not stages or not dist.is_available() or not dist.is_initialized():
        return False
    return all(dist.get_backend(getattr(st, "group", None)) == "gloo" for st in stages)


#: how many compute actions ahead of its place in torch's lowering a receive is posted on gloo
#: (:func:`receives_ahead`; None: all of a step's receives first; 0, the default: where the
#: lowering puts it, see the module docstring for why)
RECEIVE_LEAD: int | None = 0

#: the computation types a receive is moved ahead of (the rest are cheap to pass)
_COMPUTE = (C.FORWARD, C.BACKWARD_INPUT, C.BACKWARD_WEIGHT, C.FULL_BACKWARD, C.OVERLAP_F_B)


def receives_ahead(
    bound: Sequence[tuple[int, Any, Call]],
    custom: Mapping[Any, Any],
    own: Any,
    lead: int | None,
) -> list[tuple[int, Any, Call]]:
    """``bound`` (position, action, call) with each receive (RECV_F, RECV_B) moved ahead of
    the ``lead`` compute actions before it (None: to the front), never past another receive:
    the receives keep their order, the other actions theirs. A receive a custom function
    handles stays where it is (it may do more than post), and nothing moves past it."""

    def moves(action: Any) -> bool:
        kind = action.computation_type
        fn = custom.get(kind)
        return kind in (C.RECV_F, C.RECV_B) and (fn is None or fn is own)

    out: list[tuple[int, Any, Call]] = []
    floor = 0  # no receive goes before this index of ``out`` (the last receive placed, +1)
    for b in bound:
        kind = b[1].computation_type
        if not moves(b[1]):
            out.append(b)
            if kind in (C.RECV_F, C.RECV_B):
                floor = len(out)
            continue
        at, passed = len(out), 0
        while at > floor and (lead is None or passed < lead):
            at -= 1
            passed += out[at][1].computation_type in _COMPUTE
        out.insert(at, b)
        floor = at + 1
    return out
