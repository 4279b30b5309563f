"""What the weight-capture tests share (the Function or output hook, and the native capture):
a store held by a Linears' slot, and a module that applies one Linear twice."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from zbpipe.engines.deferred import WeightGradStore
from zbpipe.engines.linear_patch import StoreSlot, patch_linears


def patched(module: nn.Module) -> StoreSlot:
    """``module``'s Linears made deferred, reading the returned (empty) slot."""
    slot = StoreSlot()
    patch_linears(module, slot)
    return slot


@contextlib.contextmanager
def holding(slot: StoreSlot, store: WeightGradStore, deferring: bool = False) -> Iterator[None]:
    """``store`` in ``slot`` (deferring or not) for the block, taken out after it."""
    slot.store, store.deferring = store, deferring
    try:
        yield
    finally:
        slot.store, store.deferring = None, False


class Twice(nn.Module):
    """A Linear applied twice (its two GEMMs summed), another one once, with a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.a(x)))))
