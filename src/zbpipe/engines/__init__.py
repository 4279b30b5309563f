"""The split-backward engines: what B and W do to a stage's graph, behind one protocol.

The stage seam (:mod:`zbpipe.schedules.stage_seam`) owns what an action does to a torch
``PipelineStage`` (caches, hand-offs, FSDP preparation, torch's own path for ``dw_builder`` stages)
and calls one :class:`SplitEngine` for the part that differs between engines: what F must set up,
how B computes the input gradients while keeping the weight pass pending, and how W runs it.
docs/design/backward.md says when each engine is right:

* **deferred** (:mod:`zbpipe.engines.deferred`, its Linears in
  :mod:`zbpipe.engines.linear_patch`): B is one ordinary autograd pass in which patched
  ``nn.Linear`` modules queue their weight GEMMs; W runs them.
* **graph** (:mod:`zbpipe.engines.graph`, its algorithms in
  :mod:`zbpipe.engines.graph_backward` (B), :mod:`zbpipe.engines.graph_weight` (W) and
  :mod:`zbpipe.engines.graph_regions`): B asks autograd for the input edges only, W re-enters
  the graph per weight region. Every weight in W.

Both add weight gradients to ``.grad`` by one rule (:mod:`zbpipe.engines.accumulate`).
Keys are ``(stage_index, microbatch)``, the microbatch being whatever index the stage's caches
use (the step's for planned schedules, a global one for continuous).
"""

from .auto_split import choose_engine
from .protocol import SPLITS, EngineName, Key, Split, SplitEngine

__all__ = ["SPLITS", "EngineName", "Key", "Split", "SplitEngine", "choose_engine"]
