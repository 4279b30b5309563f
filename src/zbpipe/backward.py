"""``zbpipe.backward``, the public name of the graph split backward (docs/reference/api.md); it
lives in
:mod:`zbpipe.engines` now, this module only keeps the documented import working."""

from .engines.fused import backward_full
from .engines.graph_backward import WeightGrad, backward_input

__all__ = ["WeightGrad", "backward_full", "backward_input"]
