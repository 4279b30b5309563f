"""Weight versions of one stage for the ``2bw`` and ``stash`` continuous modes.

The optimizer owns the stage module's parameters (the *master* weights, always the latest
version) and updates them in place. A forward that an update will overtake (the update runs
between its forward and its last backward pass) never reads them: it runs the stage on a
version, a set of separate tensors copied from the master and never written while a microbatch
uses them. So an update between a microbatch's forward and its backward cannot trip autograd's
saved-tensor version check (the PipeDream trap), and the backward computes the gradient at
exactly the weights the forward used. A stash forward that no update overtakes runs on (leaf
aliases of) the master itself.

What it costs, per stage (the stale modes' price over ``sync``, kept per mini-batch, not per
microbatch):

* **2bw: one copy of the weights per optimizer step**, into the buffers of a version no longer
  used (recycled: no allocation, no page faults after the first steps), on a stage whose
  mini-batches overlap in its order (a forward of ``k + 1`` before the last pass of ``k``).
  Mini-batch ``k + 1`` reads version ``k`` after the step has made the master ``k + 1``, and
  an in-place optimizer destroys what it overwrites, so there one copy per step is the least
  any optimizer-agnostic scheme can do. **On a stage whose mini-batches do not overlap** (the
  last stage of 2bw's stream orders, every stage of a sync-derived one: ``on_master``), none:
  the runtime applies the update of ``k - 1`` where the update of ``k`` would run (after
  ``k``'s last W), so every forward of ``k`` finds version ``k - 1`` in the master itself; the
  price is one gradient held for a mini-batch (the memory the copy took), and one copy per
  :meth:`flush` (the next stream's first mini-batch still needs the version before the last
  update), let go once that mini-batch's passes are done. That copy goes into the buffers of
  the gradient stepped before (handed back for the next backward pass, which this stream will
  not run): no fresh pages to fault in at every flush.
  **stash: a copy only for a step that overtakes a forward** (the first such forward
  copies the latest version out of the master); on a stage whose forwards all finish their
  backward passes before the next step (the last stage of the plans zbpipe makes), none;
* **one set of leaf aliases per (version, mini-batch)** (``detach()``: same storage, new autograd
  leaf), shared by the mini-batch's microbatches on that version: the weight-gradient pass adds
  into their ``.grad`` as it adds into the module's in ``sync`` mode (inside the GEMM with the
  deferred engine), so the mini-batch's gradient is summed where it is computed, with no
  per-microbatch buffer and no per-microbatch Python loop over the parameters;
* the leaves are put in the module's parameter slots (:class:`ModuleSlots`) when the leaf set
  changes, not around each forward: a mini-batch's forwards in a row pay one dictionary check each.

Version ``v`` is the weights after ``v`` optimizer steps of this stage. Which one a forward uses:

* ``2bw``: mini-batch ``k`` uses version ``max(k - 1, 0)`` (PipeDream-2BW);
* ``stash``: the latest version at the time of the forward (PipeDream weight stashing).

With a ``correction`` (2bw only) a version is not the weights after ``v`` steps but an
extrapolation of the last step, ``P(v) = W(v) + h (W(v) - W(v - 1))`` (``P(0) = W(0)``), and
mini-batch ``k`` runs on ``P(k - 1)``:

* ``"predict"``, ``h = 1``: an estimate of the ``W(k)`` a synchronous run would use (weight
  prediction, as SpecTrain and PipeMare do);
* ``"nesterov"``, ``h = 2``: that estimate plus one more step, so the gradient is taken one step
  ahead of the weights it is applied to, as Nesterov's momentum takes it (see docs/use/continuous.md
  for the literature and the measurements).

It costs one more pass over the weights per step (the master is copied before the step; the
prediction is formed in the same buffer after it).

A version is kept while an in-flight microbatch uses it, while it is the latest, or (2bw) while
the stage's next forward will use it. :attr:`peak` is the most versions held at once (the latest
included), the number the plan layer bounds by 2 (2bw) and ``p - s`` (stash); a recycled buffer
waiting for the next step replaces a version dropped before it, so the buffers held never
exceed :attr:`peak` sets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import _compat as C
from ..engines.accumulate import GRAD_BUFFER
from ..engines.compiled_linear import route_leaves

CORRECTIONS = (None, "predict", "nesterov")
#: how many steps each correction extrapolates the last one
HORIZON = {"predict": 1.0, "nesterov": 2.0}
LeafKey = tuple[int, int]  # (version, global mini-batch)


class ModuleSlots:
    """Where each trainable parameter of a module is registered, to put other tensors there.

    ``torch.func.functional_call`` does the same around every call (and checks tied weights,
    strictness and buffers each time); here the slots are found once per stage and a swap is one
    dictionary write per slot, done only when the tensors to run on change.
    """

    def __init__(self, module: nn.Module, params: Sequence[torch.Tensor]) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        self.module = module
        self.masters = list(params)
        #: (owning module, attribute, index into params); a tied parameter has several
        self.slots = [
            (mod, name, index[id(t)])
            for mod in module.modules(remove_duplicate=False)
            for name, t in C.own_parameters(mod).items()
            if t is not None and id(t) in index
        ]
        self.installed: object | None = None  # key of the tensors in the slots (None: masters)

    def install(self, key: object, tensors: Sequence[torch.Tensor]) -> None:
        """Put ``tensors`` (aligned with ``params``) in the slots, unless ``key`` is there."""
        if self.installed == key:
            return
        for mod, name, i in self.slots:
            C.set_own_parameter(mod, name, tensors[i])
        self.installed = key

    def restore(self) -> None:
        """Put the module's own parameters back."""
        if self.installed is None:
            return
        for mod, name, i in self.slots:
            C.set_own_parameter(mod, name, self.masters[i])
        self.installed = None


class WeightVersions:
    """The versions of one stage module's trainable parameters."""

    def __init__(
        self, module: nn.Module, mode: str, correction: str | None = None, on_master: bool = False
    ) -> None:
        if mode not in ("2bw", "stash"):
            raise ValueError(f"WeightVersions: mode must be '2bw' or 'stash', got {mode!r}")
        if correction not in CORRECTIONS:
            raise ValueError(
                f"WeightVersions: correction must be one of {CORRECTIONS}, got {correction!r}"
            )
        if correction is not None and mode != "2bw":
            raise ValueError(
                f"WeightVersions: correction={correction!r} needs mode='2bw', got {mode!r}"
            )
        if on_master and (mode != "2bw" or correction is not None):
            raise ValueError(
                "WeightVersions: on_master is for mode='2bw' without a correction "
                f"(got mode={mode!r}, correction={correction!r})"
            )
        self.mode = mode
        self.correction = correction
        #: 2bw: the latest version is the master itself (the runtime applies each update one
        #: mini-batch late, so no forward an update would overtake reads it)
        self.on_master = on_master
        #: copies of the weight set made so far (what the stale modes pay beyond sync)
        self.copies = 0
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self._names = list(self.params)
        self._params = list(self.params.values())
        self._masters = [p.detach() for p in self._params]
        self.slots = ModuleSlots(module, self._params)
        self.latest = 0
        #: stash (and 2bw on_master): the latest version is the master itself until a forward
        #: that a step will overtake needs it (then it gets its own copy, see acquire)
        self._latest_on_master = mode == "stash" or on_master
        first = self._masters if self._latest_on_master else [t.clone() for t in self._masters]
        self.store: dict[int, list[torch.Tensor]] = {0: first}
        self.uses: dict[int, int] = {}  # in-flight microbatch -> version
        self.peak = 1
        self._spare: list[torch.Tensor] | None = None  # buffers of a dropped version, for reuse
        self._before: list[torch.Tensor] | None = None  # correction: the master before the step
        #: (version, mini-batch) -> leaf aliases, shared by the mini-batch's microbatches
        self.leaf_sets: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._grad_spare: list[torch.Tensor | None] | None = None  # last step's gradients
        self._prepared: set[tuple[int, int]] = set()  # leaf sets offered gradient buffers
        #: leaf set -> the AccumulateGrad nodes of its routed leaves (kept while the set lives)
        self._leaf_nodes: dict[tuple[int, int], list[object]] = {}

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

    def acquire(
        self, microbatch: int, minibatch: int, overtaken: bool = True
    ) -> tuple[LeafKey, list[torch.Tensor]]:
        """The leaf set microbatch ``microbatch`` of ``minibatch`` runs on, and its key.

        Its weight gradients land in the leaves' ``.grad``, shared with the mini-batch's other
        microbatches on the same version. ``overtaken``: an optimizer step of this stage runs
        before the microbatch's last backward pass (the runtime knows: its mini-batch is ahead
        of the stage's next step). stash: a microbatch that is not overtaken runs on the master
        itself (no copy: its backward passes end before the step writes the master); the first
        one that is gets the latest version copied out of the master. Were the runtime wrong, the
        step would bump the master's version counter under a saved weight and autograd would
        raise at the backward pass: never a silently wrong gradient.
        """
        version = self.version_for(minibatch)
        if overtaken and self.store[version] is self._masters:
            self.store[version] = self._copy_master()
        self.uses[microbatch] = version
        key = (version, minibatch)
        leaves = self.leaf_sets.get(key)
        if leaves is None:
            leaves = [t.detach().requires_grad_() for t in self.store[version]]
            self.leaf_sets[key] = leaves
            # compiled Linears' GEMMs on these leaves wait for W, as on the parameters
            self._leaf_nodes[key] = route_leaves(self._params, leaves)
        return key, leaves

    def forget_leaf_sets(self) -> None:
        """Drop every leaf set (a stream ended or was reset)."""
        self.leaf_sets = {}
        self._leaf_nodes = {}
        self._prepared = set()

    def prepare_grads(self, key: tuple[int, int]) -> None:
        """Before the first backward pass on leaf set ``key``: offer its leaves the gradient
        buffers of the last step (the deferred engine writes a weight's first product into its
        buffer, as sync's first product goes into a fresh allocation, then adds the next ones
        inside the GEMM; :data:`zbpipe.engines.accumulate.GRAD_BUFFER`).

        Offered at the first B, not at F: by then the previous mini-batch's gradients have been
        stepped and handed back, so no more gradient buffers are alive than in sync (on an
        ``on_master`` stage, whose steps lag by one mini-batch, one set more: the held
        gradient). A buffer nothing takes (a parameter the mini-batch did not use, a bias, the
        graph engine) leaves the leaf's gradient as it would be without the offer, and is let
        go at the mini-batch's last W (:meth:`withdraw_offers`).
        """
        if key in self._prepared:
            return
        self._prepared.add(key)
        leaves = self.leaf_sets[key]
        for other, done in self.leaf_sets.items():
            if other[1] == key[1] and other in self._prepared and other != key:
                # stash: the mini-batch's microbatches on an earlier version ran their passes
                # (in microbatch order): this set adds into the same buffers, no second sum
                for leaf, mine in zip(leaves, done):
                    if leaf.grad is None and mine.grad is not None:
                        leaf.grad = mine.grad
        spare, self._grad_spare = self._grad_spare, None
        for leaf, buf in zip(leaves, spare or ()):
            if buf is not None and leaf.grad is None:
                setattr(leaf, GRAD_BUFFER, buf)

    def withdraw_offers(self, minibatch: int) -> None:
        """``minibatch``'s last W ran: the buffers offered to its leaves and not taken are let go
        (a held step keeps the leaves a mini-batch longer, and their offers with them)."""
        for key, leaves in self.leaf_sets.items():
            if key[1] == minibatch:
                for leaf in leaves:
                    leaf.__dict__.pop(GRAD_BUFFER, None)

    def recycle_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """The gradients the optimizer just used (aligned with :attr:`params`), for reuse."""
        self._grad_spare = list(grads)

    def drop_spare_grads(self) -> None:
        """Let go of the last step's gradient buffers (a stream ended: between streams a stale
        mode holds no gradient memory, as sync holds none)."""
        self._grad_spare = None

    def release(self, microbatch: int, next_minibatch: int) -> None:
        """The microbatch's last backward pass is done."""
        del self.uses[microbatch]
        self._prune(next_minibatch)

    def take_grads(self, minibatch: int) -> list[torch.Tensor | None]:
        """The summed gradient of ``minibatch``, per parameter (aligned with :attr:`params`).

        Drops the mini-batch's leaf sets. One version (2bw, and most stash mini-batches): its
        leaves' ``.grad`` as they are; several (a stash mini-batch whose forwards straddle a
        step): summed in version order.
        """
        keys = sorted(key for key in self.leaf_sets if key[1] == minibatch)
        out: list[torch.Tensor | None] = [None] * len(self._names)
        for key in keys:
            leaves = self.leaf_sets.pop(key)
            self._leaf_nodes.pop(key, None)
            self._prepared.discard(key)
            for i, leaf in enumerate(leaves):
                g = leaf.grad
                if g is None:
                    continue
                current = out[i]
                if current is None:
                    out[i] = g
                elif current is not g:  # (a shared buffer is counted once)
                    current.add_(g)
        return out

    def before_step(self, next_minibatch: int) -> None:
        """The optimizer is about to step the master (a correction keeps what it was).

        ``on_master``: if a forward still to come needs the version the master holds (the
        first mini-batch of the next stream, when :meth:`flush` applies the last update), it
        gets its own copy first.
        """
        if self.correction is not None:
            self._before = self._copy_master()
        elif (
            self.on_master
            and self.store.get(self.latest) is self._masters
            and self.latest in {*self.uses.values(), max(next_minibatch - 1, 0)}
        ):
            # (the flush's copy: into the last step's gradient buffers, which no backward pass
            # of this stream will take and the stream's end lets go of, not into fresh pages)
            self.store[self.latest] = self._copy_master(self._take_grad_spare())

    def updated(self, next_minibatch: int) -> None:
        """The optimizer stepped the master weights: they become version ``latest + 1``."""
        with torch.no_grad():
            if self._before is not None:  # P = W + h (W - W_before), in W_before's buffer
                new, self._before = self._before, None
                weight = 1.0 + HORIZON[str(self.correction)]
                for b, t in zip(new, self._masters):
                    b.lerp_(t, weight)
            elif self._latest_on_master:  # (a copy only if a forward the next step overtakes
                new = self._masters  # needs it, see acquire)
            else:
                new = self._copy_master()
        self.latest += 1
        self.store[self.latest] = new
        self._prune(next_minibatch)

    def _copy_master(self, into: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """The master weights copied into a recycled (else new) set of buffers; ``into``: buffers
        to use first (aligned with the masters; ``None`` where none fits)."""
        if into is None:
            own = self._take_spare()
        else:  # fresh memory only where no buffer fits
            own = [torch.empty_like(t) if b is None else b for b, t in zip(into, self._masters)]
        with torch.no_grad():
            for b, t in zip(own, self._masters):
                b.copy_(t)
        self.copies += 1
        return own

    def _take_spare(self) -> list[torch.Tensor]:
        spare, self._spare = self._spare, None
        if spare is not None:
            return spare
        return [torch.empty_like(t) for t in self._masters]

    def _take_grad_spare(self) -> list[torch.Tensor | None] | None:
        """The last step's gradient buffers as weight buffers (taken: no B offers them again),
        each where it has its weight's layout (plain tensor, shape, strides, dtype, device)."""
        grads, self._grad_spare = self._grad_spare, None
        if grads is None:
            return None
        return [
            g
            if g is not None
            and type(g) is torch.Tensor
            and type(t) is torch.Tensor
            and g.shape == t.shape
            and g.stride() == t.stride()
            and g.dtype == t.dtype
            and g.device == t.device
            else None
            for g, t in zip(grads, self._masters)
        ]

    def _prune(self, next_minibatch: int) -> None:
        keep = set(self.uses.values()) | {self.latest}
        if self.mode == "2bw":
            keep.add(max(next_minibatch - 1, 0))
        for v in [v for v in self.store if v not in keep]:
            dropped = self.store.pop(v)
            # the next step's copy goes here; on_master makes no copy until the next flush:
            # kept, the flush's copy would stay alive for a whole stream, unused
            if self._spare is None and dropped is not self._masters and not self.on_master:
                self._spare = dropped
        self.peak = max(self.peak, len(self.store))

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        if self.uses:
            raise RuntimeError("WeightVersions: microbatches in flight; call flush() first")
        return {
            "latest": self.latest,
            "store": {
                v: {n: t.clone() for n, t in zip(self._names, ts)} for v, ts in self.store.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        self.latest = int(state["latest"])
        self.store = {
            int(v): [ts[n].detach().clone() for n in self._names]
            for v, ts in state["store"].items()
        }
        if self._latest_on_master:  # (the module loaded the master: it is the latest)
            self.store[self.latest] = self._masters
        self.uses = {}
        self.forget_leaf_sets()
        self._spare = self._before = self._grad_spare = None
        self.peak = max(self.peak, len(self.store))


__all__ = ["CORRECTIONS", "ModuleSlots", "WeightVersions"]
