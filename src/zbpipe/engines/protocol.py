"""What every split-backward engine is to the stage seam: the :class:`SplitEngine` protocol and
the names it uses (a key is ``(stage_index, microbatch)``)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

from torch import Tensor

from ..memory.saved import Observer, SavedTensors
from .segmented import SegmentRecord

EngineName = Literal["deferred", "graph"]
Split = Literal["auto", "deferred", "graph"]
SPLITS: tuple[str, ...] = ("auto", "deferred", "graph")
Key = tuple[int, int]


class SplitEngine(Protocol):
    """What the stage seam asks of a split-backward engine (one object per schedule and rank)."""

    @property
    def name(self) -> EngineName:
        """``"deferred"`` or ``"graph"``: what a schedule's ``split`` attribute reports."""

    @property
    def unshards_for_backward(self) -> bool:
        """Whether B and W need a stage's FSDP2 blocks unsharded (the seam unshards them)."""

    @property
    def uses_saved_holders(self) -> bool:
        """Whether B takes the holders of what a split key's forward saved
        (:mod:`zbpipe.memory.saved`, installed by the seam) to free tensors before W."""

    @property
    def bw_through_store(self) -> bool:
        """Whether a fused BW (every one but a stage's first of the step) may run as this
        engine's B then W at once, cheaper than torch's fused backward (``StageSeam.assign``)."""

    @property
    def segments_backward(self) -> bool:
        """Whether B can run in segments between communication points
        (:meth:`backward_input_steps`: the backward half of an overlapped pair)."""

    def attach(self, stages: Sequence[Any]) -> None:
        """Prepare this rank's stages (once, when the seam is built)."""

    def claim_linears(self) -> None:
        """Take the stages' modules back from another schedule built on them (every step)."""

    def check_stages(self, owner: type, stages: Sequence[Any]) -> None:
        """Raise ``ValueError`` for stages this engine cannot split (at construction)."""

    def forward_scope(
        self, key: Key, meter: Observer | None, *, fused: bool
    ) -> AbstractContextManager[None]:
        """Around the forward of a key whose backward runs through the engine. ``meter``
        counts what the engine keeps until W; ``fused``: the backward is a fused BW run as B
        then W at once."""

    def backward_input(
        self,
        key: Key,
        outputs: Sequence[Any],
        output_grads: Sequence[Tensor | None] | None,
        inputs: Sequence[Any],
        params: Callable[[], list[Tensor]],
        saved: SavedTensors | None,
    ) -> tuple[Tensor | None, ...]:
        """B of ``key``: the gradients of ``inputs`` (``output_grads=None``: ``outputs`` is the
        loss), the weight pass kept pending. ``params``: the weights W computes (read when B
        needs them); ``saved``: the holders of what the forward saved, if any."""

    def backward_input_steps(
        self,
        key: Key,
        record: SegmentRecord,
        outputs: Sequence[Any],
        output_grads: Sequence[Tensor | None] | None,
        inputs: Sequence[Any],
        saved: SavedTensors | None,
    ) -> Generator[None, None, tuple[Tensor | None, ...]]:
        """B of a key whose forward was cut at its communication points (``record``), one
        segment at a time, yielding while each point's collective is in flight; only called
        where :attr:`segments_backward` says so."""

    def backward_weight(self, key: Key) -> None:
        """W of ``key``: accumulate the weight gradients B left pending, once."""

    def pending_keys(self) -> list[Key]:
        """The keys whose B ran but whose W has not."""

    def clear(self) -> None:
        """Drop everything pending (a step ended, or failed midway)."""
