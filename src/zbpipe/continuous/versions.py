"""Weight versions of one stage for the ``2bw`` and ``stash`` continuous modes.

The optimizer owns the stage module's parameters (the *master* weights, always the latest
version) and updates them in place. A forward never reads them: it runs the stage functionally
(``torch.func.functional_call``) on a version, a set of separate tensors cloned from the master
right after an update and never written afterwards. So an update between a microbatch's forward
and its backward cannot trip autograd's saved-tensor version check (the PipeDream trap), and
the backward computes the gradient at exactly the weights the forward used.

Each microbatch gets its own leaf aliases of its version's tensors (``detach()``: same storage,
new autograd leaf), so its weight gradient lands in ``leaf.grad``, apart from other microbatches
on the same version; the runtime sums them per mini-batch.

Version ``v`` is the weights after ``v`` optimizer steps of this stage. Which one a forward uses:

* ``2bw``: mini-batch ``k`` uses version ``max(k - 1, 0)`` (PipeDream-2BW);
* ``stash``: the latest version at the time of the forward (PipeDream weight stashing).

A version is kept while an in-flight microbatch uses it, while it is the latest, or (2bw) while
the stage's next forward will use it. :attr:`peak` is the most versions held at once (the latest
included), the number the plan layer bounds by 2 (2bw) and ``p - s`` (stash).
"""

from __future__ import annotations

import torch
from torch import nn


class WeightVersions:
    """The versions of one stage module's trainable parameters."""

    def __init__(self, module: nn.Module, mode: str) -> None:
        if mode not in ("2bw", "stash"):
            raise ValueError(f"WeightVersions: mode must be '2bw' or 'stash', got {mode!r}")
        self.mode = mode
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.latest = 0
        self.store: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}
        self.uses: dict[int, int] = {}  # in-flight microbatch -> version
        self.peak = 1

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def version_for(self, minibatch: int) -> int:
        """The version a forward of global mini-batch ``minibatch`` runs on."""
        v = max(minibatch - 1, 0) if self.mode == "2bw" else self.latest
        if v not in self.store:
            raise RuntimeError(
                f"zbpipe continuous {self.mode}: mini-batch {minibatch} needs weight version {v}, "
                f"which is not held (latest {self.latest}, held {sorted(self.store)}); "
                "the plan ran a forward too early"
            )
        return v

    def acquire(self, microbatch: int, version: int) -> dict[str, torch.Tensor]:
        """Leaf aliases of ``version`` for one microbatch's forward.

        Gradients land in their ``.grad``.
        """
        self.uses[microbatch] = version
        return {n: t.detach().requires_grad_() for n, t in self.store[version].items()}

    def release(self, microbatch: int, next_minibatch: int) -> None:
        """The microbatch's last backward pass is done."""
        del self.uses[microbatch]
        self._prune(next_minibatch)

    def updated(self, next_minibatch: int) -> None:
        """The optimizer stepped the master weights: they become version ``latest + 1``."""
        self.latest += 1
        self.store[self.latest] = self._snapshot()
        self._prune(next_minibatch)

    def _prune(self, next_minibatch: int) -> None:
        keep = set(self.uses.values()) | {self.latest}
        if self.mode == "2bw":
            keep.add(max(next_minibatch - 1, 0))
        for v in [v for v in self.store if v not in keep]:
            del self.store[v]
        self.peak = max(self.peak, len(self.store))

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        if self.uses:
            raise RuntimeError("WeightVersions: microbatches in flight; call flush() first")
        return {
            "latest": self.latest,
            "store": {v: {n: t.clone() for n, t in ts.items()} for v, ts in self.store.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.latest = int(state["latest"])
        self.store = {
            int(v): {n: t.detach().clone() for n, t in ts.items()}
            for v, ts in state["store"].items()
        }
        self.uses = {}
        self.peak = max(self.peak, len(self.store))


__all__ = ["WeightVersions"]
