"""The plain order of the V placement: ZB-V's F/B skeleton with every backward fused (pure Python).

1F1B is the plain order of the loop placement: each backward whole (``BW``), nothing deferred.
The V placement (rank ``r`` holds stages ``r`` and ``2p - 1 - r``) has no 1F1B of its own;
its 1F1B-style order is the ZB-V paper's F/B order (:func:`~.paper_order.zbv_fb_order`: warm-up
forwards, then one forward and one backward in turn, then the cool-down backwards) with each B a
whole backward, as interleaved 1F1B runs a looped placement. A schedule runs it instead of its
zero-bubble plan where the split backward does not pay: a W that costs nothing, say, or sends so
long that the deferred W's gaps never open (:mod:`zbpipe.schedules.plain_order`). A fused
backward holds nothing after it, so this order holds at most what the F/B skeleton with its W
run at once would hold.
"""

from __future__ import annotations

from ..core import Action, Plan, make_plan, v_placement
from ..costs import Costs
from ..rules import check_sizes
from .paper_order import zbv_fb_order

#: the plan's name (not a generator's: schedules fall back to it, nobody plans it by name)
NAME = "V1F1B"


def plan_v_1f1b(num_ranks: int, n_microbatches: int, costs: Costs | None = None) -> Plan:
    """The 1F1B-style order of the V placement (the module docstring); ``costs`` do not change
    it (it is cost-oblivious, as 1F1B is) and are only checked."""
    check_sizes(num_ranks, n_microbatches)
    p = num_ranks
    if costs is not None:
        costs.check(2 * p)
    fb = zbv_fb_order(p, n_microbatches)
    order = {
        r: [Action(a.stage, "BW", a.microbatch) if a.kind == "B" else a for a in acts]
        for r, acts in fb.items()
    }
    return make_plan(NAME, p, n_microbatches, v_placement(p), order, layout="v")
