"""An independent count of the tensors autograd saves, and the per-rank body that uses it.

:class:`SavedCensus` takes a storage-level weak reference to every tensor autograd saves while
it is active, whoever packs it: its own outermost ``saved_tensors_hooks`` sees the saves nobody
else hooks, and every pack hook pushed meanwhile (zbpipe's ``SavedTensors``, a checkpoint's) is
wrapped so it reports the tensor first. It shares no code with ``zbpipe.memory.saved`` or the memory
meter, and a storage weak reference does not care which Python object (a tensor, a detached
alias, a holder) keeps the bytes alive.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.pipelining import PipelineStage
from torch.multiprocessing.reductions import StorageWeakRef

import zbpipe
from zbpipe.testing.models import TinyGPTConfig, build_stages, lm_loss, synthetic_batch

_autograd = torch._C._autograd  # where saved_tensors_hooks.__enter__ looks up the push


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass with no storage
        return None


class SavedCensus:
    """Weak references to the storage of every tensor autograd saves inside ``with census:``.

    ``alive(exclude)`` after the block (and ``gc.collect()``): the saved storages still alive,
    once each, except those whose data pointer is in ``exclude``.
    """

    def __init__(self) -> None:
        self.saved: list[tuple[StorageWeakRef, int, int, str]] = []  # (ref, ptr, bytes, what)
        self._push: Callable | None = None

    def _record(self, t: torch.Tensor) -> None:
        s = _storage(t)
        if s is not None:
            self.saved.append((StorageWeakRef(s), s.data_ptr(), s.nbytes(), f"{tuple(t.shape)}"))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._record(t)
        return t.detach()  # not t itself: a packed output holding t would be a reference cycle

    def __enter__(self) -> SavedCensus:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        push = self._push = _autograd._push_saved_tensors_default_hooks

        def counting_push(pack: Callable, unpack: Callable) -> None:
            def counted(t: torch.Tensor) -> Any:
                self._record(t)
                return pack(t)

            push(counted, unpack)

        self._outer = saved_tensors_hooks(self._pack, lambda t: t)
        self._outer.__enter__()
        _autograd._push_saved_tensors_default_hooks = counting_push
        return self

    def __exit__(self, *exc: object) -> None:
        _autograd._push_saved_tensors_default_hooks = self._push
        self._outer.__exit__(*exc)

    def alive(self, exclude: set[int] = frozenset()) -> list[tuple[int, str]]:
        """(bytes, shape) of each saved storage still alive, once per storage."""
        seen: dict[int, tuple[int, str]] = {}
        for ref, ptr, nbytes, what in self.saved:
            if not ref.expired() and ptr not in exclude:
                seen.setdefault(ref.cdata, (nbytes, what))
        return list(seen.values())


def module_state_storages(modules: Iterable[nn.Module]) -> set[int]:
    """Parameters and buffers: module state that lives on by design, not a saved activation."""
    return {
        s.data_ptr()
        for mod in modules
        for t in (*mod.parameters(), *mod.buffers())
        if (s := _storage(t)) is not None
    }


def stage_input_buffers(stages: Iterable[PipelineStage]) -> set[int]:
    """The buffers torch's ``PipelineStage`` receives each microbatch's input into: allocated
    once and reused by every step's receive, so the last step's inputs stay in them (bounded by
    m per stage, the stage's, not a saved tensor left behind).

    Not among them: the inputs a local stage hands over in V placement (torch kept those until
    the next step; zbpipe drops them once the receiving stage's backward is done)."""
    local = {st.stage_index for st in stages}
    return {
        s.data_ptr()
        for st in stages
        if st.stage_index - 1 not in local
        for infos in st.args_recv_info.values()
        for info in infos
        # torch 2.11's first stage holds placeholders for the model's inputs, with no buffer
        if isinstance(b := getattr(info, "buffer", None), torch.Tensor)
        and (s := _storage(b)) is not None
    }


# ---------------------------------------------------------------------------------------------
# rank side

CFG = TinyGPTConfig(tricky=True)
M = 4
STEPS = 2  # a second step: nothing from the first may survive it either


def _planned(rank: int, world: int, name: str, options: dict) -> tuple[Any, list, Callable]:
    cls = getattr(zbpipe, name)
    n_stages = world * cls.stages_per_rank
    mods = build_stages(CFG, n_stages, seed=0)
    mine = sorted(s for s, r in cls.stage_index_to_rank(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, n_stages, torch.device("cpu")) for s in mine]
    sched = cls(stages, M, loss_fn=lm_loss, **options)

    def step(k: int) -> None:
        ids, tgt = synthetic_batch(CFG, batch=2 * M, step=k)
        args = (ids,) if 0 in mine else ()
        sched.step(*args, target=tgt if n_stages - 1 in mine else None)

    return sched, stages, step


def _continuous(rank: int, world: int, options: dict) -> tuple[Any, list, Callable]:
    mod = build_stages(CFG, world, seed=0)[rank]
    stages = [PipelineStage(mod, rank, world, torch.device("cpu"))]
    sched = zbpipe.ScheduleContinuous(
        stages,
        M,
        loss_fn=lm_loss,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
        **options,
    )

    def step(k: int) -> None:  # two mini-batches in flight, then the drain
        for j in (2 * k, 2 * k + 1):
            ids, tgt = synthetic_batch(CFG, batch=2 * M, step=j)
            sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
        sched.flush()

    return sched, stages, step


def alive_after_each_step(rank: int, world: int, cases: list[tuple[str, dict]]) -> list[dict]:
    """Per case: tensors saved and saved storages alive after each step (and ``gc.collect()``)."""
    out = []
    for name, options in cases:
        if name == "ScheduleContinuous":
            _, stages, step = _continuous(rank, world, options)
        else:
            _, stages, step = _planned(rank, world, name, options)
        state = module_state_storages(st.submod for st in stages)
        per_step = []
        for k in range(STEPS):
            with SavedCensus() as census:
                step(k)
            gc.collect()
            alive = census.alive(state | stage_input_buffers(stages))
            per_step.append({"saved": len(census.saved), "alive": alive})
        out.append({"case": f"{name} {options}", "steps": per_step})
    return out
