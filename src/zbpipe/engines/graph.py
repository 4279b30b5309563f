"""The graph engine: every weight gradient in W, through ``autograd.grad`` on the stage graph.

B asks autograd for the input edges only and records the gradients arriving at the weight
regions' boundaries; W re-enters the graph there (:mod:`zbpipe.engines.graph_backward`, with
the graph analysis in :mod:`zbpipe.engines.graph_regions`). General (any graph, no patching),
and dearer than a fused backward: it walks the graph in Python every microbatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

from torch import Tensor

from .._compat import (
    DONATED_BUFFER_ERROR,
    checkpoint_recompute_replayable,
    compiled_submodule,
    selective_checkpoint_submodule,
)
from ..memory.saved import Observer, SavedTensors
from .graph_backward import WeightGrad, backward_input

if TYPE_CHECKING:
    from .protocol import Key
    from .segmented import SegmentRecord

__all__ = ["GraphEngine"]


class GraphEngine:
    """The graph engine on one rank's stages (the :class:`~zbpipe.engines.SplitEngine` the seam
    calls): B keeps each key's :class:`~zbpipe.engines.graph_backward.WeightGrad` until W."""

    def __init__(self) -> None:
        self.name: Literal["graph"] = "graph"
        #: B collects the unsharded parameters (the leaves of the forward's graph) and W may read
        #: a weight (a weight-norm's gradient does): both need FSDP2 blocks unsharded
        self.unshards_for_backward = True
        #: B tags what the forward saved and frees the activation-only tensors at its end
        self.uses_saved_holders = True
        #: a fused BW stays torch's fused backward: B then W here would only cost more
        self.bw_through_store = False
        #: B is one walk of the graph it records: it does not run in segments (an overlapped
        #: pair's backward half then runs whole, before its forward half)
        self.segments_backward = False
        self._pending: dict[Key, WeightGrad] = {}

    def attach(self, stages: Sequence[Any]) -> None:
        """Nothing to prepare: the engine works on whatever graph the forward builds."""

    def claim_linears(self) -> None:
        """Nothing to claim: no module is patched."""

    def check_stages(self, owner: type, stages: Sequence[Any]) -> None:
        """Refuse compiled submodules (a compiled region is one opaque node B cannot split) and,
        on a torch whose recompute W cannot replay (2.11), selective activation checkpointing
        (W would backward through its regions a second time)."""
        check_not_compiled(owner, stages)
        if not checkpoint_recompute_replayable():
            check_no_selective_checkpoint(owner, stages)

    def forward_scope(
        self, key: Key, meter: Observer | None, *, fused: bool
    ) -> AbstractContextManager[None]:
        """Nothing around F: the seam's saved-tensor holders are all B needs from it."""
        return contextlib.nullcontext()

    def backward_input(
        self,
        key: Key,
        outputs: Sequence[Any],
        output_grads: Sequence[Tensor | None] | None,
        inputs: Sequence[Any],
        params: Callable[[], list[Tensor]],
        saved: SavedTensors | None,
    ) -> tuple[Tensor | None, ...]:
        """B: the input gradients; W's graph calls wait, with ``params()`` as the weights."""
        try:
            grads, self._pending[key] = backward_input(
                outputs, output_grads, inputs, params(), saved=saved
            )
        except RuntimeError as e:
            if DONATED_BUFFER_ERROR not in str(e):
                raise
            raise RuntimeError(
                f"zbpipe: stage {key[0]}'s graph holds a torch.compile'd function whose backward "
                "donates its buffers, which refuses retain_graph=True; the graph engine's B keeps "
                "the graph for W. Compile it (its first call) within "
                "zbpipe._compat.donated_buffers(False) (torch._functorch.config.donated_buffer), "
                "or use split='deferred' (docs/use/varlen.md, 'Compiled code')"
            ) from e
        return grads

    def backward_input_steps(
        self,
        key: Key,
        record: SegmentRecord,
        outputs: Sequence[Any],
        output_grads: Sequence[Tensor | None] | None,
        inputs: Sequence[Any],
        saved: SavedTensors | None,
    ) -> Generator[None, None, tuple[Tensor | None, ...]]:
        """Not this engine's (``segments_backward`` is False): the seam never cuts its keys."""
        raise NotImplementedError("the graph engine's B does not run in segments")
        yield  # a generator, as the protocol says

    def backward_weight(self, key: Key) -> None:
        """W: re-enter the graph where B recorded the boundary gradients."""
        try:
            self._pending.pop(key).run()
        except RuntimeError as e:
            if _SAC_SECOND_BACKWARD not in str(e):
                raise
            raise RuntimeError(
                f"zbpipe: stage {key[0]}'s graph holds a region under selective activation "
                "checkpointing (torch.utils.checkpoint with a context_fn), which torch lets "
                "backward run through once; the graph engine's W is a second backward call "
                "through it. Use split='deferred' (its B is the one backward; the checkpointed "
                "Linears' weight GEMMs still wait for W), full checkpointing, or a "
                "fused-backward schedule"
            ) from e

    def pending_keys(self) -> list[Key]:
        return list(self._pending)

    def clear(self) -> None:
        """Drop every pending W (and with it the graph it kept)."""
        self._pending.clear()


def check_not_compiled(cls: type, stages: Sequence[Any]) -> None:
    """Refuse ``torch.compile``d submodules under the graph engine, which must see the real graph.

    A compiled region is one opaque autograd node: the graph engine's input pass cannot stop
    before its weight-gradient work, so B and W would each run the whole region's backward.
    The deferred engine needs no graph surgery and accepts them (the region's weight gradients
    are computed in B; ``split="auto"`` chooses it for such stages), so only ``split="graph"``
    with a plan that splits the backward calls this.
    """
    for st in stages:
        name = compiled_submodule(st.submod)
        if name is not None:
            where = name or "the stage module itself"
            raise ValueError(
                f"{cls.__name__}: stage {st.stage_index} submodule {where!r} is torch.compile'd, "
                "which hides the autograd graph the graph engine's split backward (B/W) needs; "
                "use split='deferred' (it splits compiled blocks, their Linears' GEMMs in W), "
                "remove the compile, or use a fused-backward schedule (Schedule1F1BMulti)"
            )


#: the part of torch's error for a second backward through a selective-checkpoint region
#: (``torch.utils.checkpoint``, torch 2.11 to 2.14)
_SAC_SECOND_BACKWARD = "only allowed to backward once on any region computed under selective"


def check_no_selective_checkpoint(cls: type, stages: Sequence[Any]) -> None:
    """Refuse submodules wrapped for selective activation checkpointing (torch's
    ``checkpoint_wrapper`` with a ``context_fn``, as torchtitan's ``SelectiveAC`` wraps each
    block) under the graph engine.

    Selective checkpointing caches the outputs of the ops its policy saves and hands each out to
    one backward call only; torch raises on a second ("You are only allowed to backward once on
    any region computed under selective activation checkpoint"). The graph engine's W is a
    second call through every region it re-enters; on torch 2.13 and later it replays B's
    recompute instead (:mod:`zbpipe.engines.graph_recompute`) and this is not called. On
    torch 2.11 full (non-selective) checkpointing recomputes the region in each call and works,
    at the price of that second recompute; a selective ``torch.utils.checkpoint`` call written
    in a forward is not visible here and its first W raises the same advice
    (:meth:`GraphEngine.backward_weight`).
    """
    for st in stages:
        name = selective_checkpoint_submodule(st.submod)
        if name is not None:
            where = name or "the stage module itself"
            raise ValueError(
                f"{cls.__name__}: stage {st.stage_index} submodule {where!r} runs under selective "
                "activation checkpointing (a checkpoint_wrapper with a context_fn), whose regions "
                "torch lets backward run through once; the graph engine's W is a second pass "
                "through them. Use split='deferred' (or 'auto', which picks it here), full "
                "checkpointing, or a fused-backward schedule (Schedule1F1BMulti)"
            )
