"""Which microbatches of a step had a NaN/Inf loss, found without stalling the host.

Asking "is this loss finite?" in a Python ``if`` copies a flag from the device to the host and
waits for every kernel queued before it: on a GPU the host then spins inside ``step()`` instead of
queuing the next microbatch's work. So the check is split in two:

- :meth:`NonfiniteLosses.record` (inside ``step()``) stacks one flag per microbatch with device ops
  only: no host-device synchronisation.
- :meth:`NonfiniteLosses.resolve` (when someone reads the result) copies the flags to the host,
  logs the warning that names the microbatches, and caches the answer.

On the CPU the flags are already on the host, so ``record`` resolves at once: the warning appears
during ``step()`` as it always has.
"""

from __future__ import annotations

import logging

import torch

from .. import _compat as C

# The logger docs/reference/errors.md names: the runtime's (the warning moved here from runtime.py).
logger = logging.getLogger("zbpipe.schedules.runtime")


class NonfiniteLosses:
    """The non-finite loss check of one schedule, resolved when read.

    ``defer`` forces the lazy path on any device (tests use it on the CPU); by default only
    losses on an accelerator are resolved lazily.
    """

    def __init__(self, rank: int, *, defer: bool | None = None) -> None:
        self.rank = rank
        self._defer = defer
        self._pending: tuple[list[int], torch.Tensor] | None = None
        self._resolved: list[int] = []

    def record(self, losses: list) -> None:
        """Queue the check of this step's ``losses`` (one per microbatch; non-tensors ignored)."""
        indexed = [(i, x) for i, x in enumerate(losses) if isinstance(x, torch.Tensor)]
        self._pending, self._resolved = None, []
        if not indexed:
            return
        flags = _nonfinite_flags([x for _, x in indexed])
        self._pending = ([i for i, _ in indexed], flags)
        defer = self._defer if self._defer is not None else flags.device.type != "cpu"
        if not defer:
            self.resolve()

    def resolve(self) -> list[int]:
        """The microbatch indices whose loss was NaN/Inf (synchronises once, on first read)."""
        if self._pending is not None:
            indices, flags = self._pending
            self._pending = None
            self._resolved = [i for i, bad in zip(indices, flags.tolist()) if bad]
            if self._resolved:
                logger.warning(
                    "zbpipe: non-finite loss in microbatch(es) %s on rank %d",
                    self._resolved,
                    self.rank,
                )
        return list(self._resolved)


def _nonfinite_flags(losses: list[torch.Tensor]) -> torch.Tensor:
    """One bool per loss, True where it holds a NaN/Inf: device ops only, nothing read.

    Scalar losses of one dtype and device (what a ``loss_fn`` returns) are stacked and checked
    at once: three ops per step, not three per microbatch (on a GPU, launches the host pays
    for). Any other mix is checked loss by loss (a loss with several elements is non-finite
    when any of them is).
    """
    first = losses[0]
    with torch.no_grad():
        if all(
            x.dim() == 0 and x.dtype == first.dtype and x.device == first.device for x in losses
        ):
            flags = torch.isfinite(torch.stack(losses)).logical_not_()
        else:
            flags = torch.stack([~torch.isfinite(x).all() for x in losses])
        # A DTensor loss (tensor parallelism's loss_parallel) gives DTensor flags, which
        # .tolist() refuses: every rank of its mesh reaches this point, so gather them here.
        return flags.full_tensor() if C.is_dtensor(flags) else flags
