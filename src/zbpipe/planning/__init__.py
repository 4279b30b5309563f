"""Plans (pure Python, no torch): what each rank computes, in which order.

The folder reads as the plan layer's parts. At the top: the IR and what every family shares
(``core``: actions and plans; ``rules``: dependencies and memory; ``costs``; ``metrics``;
``simulator``; ``registry``: plan names to generators; ``csv_format``; ``fuse``; ``budget``:
byte budgets as written; ``one_in_flight``: the least-memory plan). Then one folder per family:

* ``loop/``: one stage per rank: 1F1B, ZB-H1, ZB-H2 and the paper's automatic ZB-1p/ZB-2p
  heuristic (``heuristic``);
* ``v/``: V placement: ZB-V, V-Half and V-Min (``zbv``), the greedy list scheduler behind them
  (``greedy``), the paper's hand-made order and its executor (``paper_order``), the
  building-block candidates (``blocks``) and the types they share (``timed_order``);
* ``continuous/``: flush-free plans: warm-up, period and drain (``periods``), the stale modes'
  stream orders (``stale_orders``), sync against 2bw (``tradeoff``) and which actions can run
  given the mini-batches handed in so far (``frontier``);
* ``search/``: searches over any family's plans: local search (``improve``), the exact MILP
  (``milp``) and the fastest plan within a byte budget (``within_budget``).
"""

import sys as _sys

from .core import (
    KINDS,
    TORCH_LETTERS,
    Action,
    Layout,
    Plan,
    PlanError,
    format_grid,
    loop_placement,
    make_plan,
    v_placement,
)
from .costs import Costs, StageCosts
from .csv_format import plan_from_csv, plan_to_csv
from .loop.onef1b import plan_1f1b
from .loop.zbh1 import plan_zbh1
from .registry import GENERATORS, known_names, plan
from .simulator import Interval, SimResult, simulate

__all__ = [
    "KINDS",
    "TORCH_LETTERS",
    "Action",
    "Layout",
    "Plan",
    "PlanError",
    "format_grid",
    "loop_placement",
    "make_plan",
    "v_placement",
    "Costs",
    "StageCosts",
    "plan_from_csv",
    "plan_to_csv",
    "plan_1f1b",
    "GENERATORS",
    "known_names",
    "plan",
    "Interval",
    "SimResult",
    "simulate",
    "plan_zbh1",
]

#: Import paths documented before the families got folders (0.2; CHANGELOG): each old name is
#: the moved module itself, so ``from zbpipe.planning.improve import improve`` keeps working.
from .continuous import periods as _periods
from .continuous import stale_orders as _stale_orders
from .continuous import tradeoff as _tradeoff
from .search import improve as _improve
from .search import milp as _milp

MOVED_MODULES = {
    "improve": _improve,
    "milp": _milp,
    "continuous_plan": _periods,
    "continuous_stream": _stale_orders,
    "continuous_tradeoff": _tradeoff,
}
for _old, _module in MOVED_MODULES.items():
    _sys.modules.setdefault(f"{__name__}.{_old}", _module)
