"""2bw's lagged stages: what they hold across streams, and the compiled split under hooks.

A stage whose mini-batches do not overlap (the last stage of 2bw's stream plans) applies each
update one mini-batch late and runs on its master weights: no weight copy per step, one per
``flush()`` for the next stream's first mini-batch. Once that mini-batch's passes are done the copy
must go (it was kept as the buffer for a next copy that this stage never makes: a weight set
held, unused, through every later stream). Its leaf sets also live a mini-batch longer, two of
them on the master's memory at once; under saved-tensor hooks a compiled Linear's weight is found
by address, and every W must still run every GEMM.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

import zbpipe
from tests.continuous import _continuous_cases as cc
from tests.engines._compile_cases import _count_w_gemms, compile_blocks, mlp_stages, mse
from tests.engines._compile_every_cases import (
    N_CONTINUOUS,
    M,
    _sgd,
    batch,
    continuous_reference,
)
from zbpipe.engines import compiled_routes
from zbpipe.testing import run_ranks

# the module fixture runs every case in one launch: more than one test's default timeout
pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _held_weight_sets(rank: int, world: int, split: str) -> dict:
    """Streams of 2 and 3 mini-batches (m = 2); after every W of the second stream's mini-batches
    after its first, the weight-sized sets the last stage's versions hold besides the master."""
    sched = cc._schedule(rank, world, 2, "2bw", "adamw", split=split)
    versions = sched._versions
    masters = {t.untyped_storage().data_ptr() for t in versions._masters}
    held: list[int] = []
    run_w = sched._backward_weight

    def counted(g: int) -> None:
        run_w(g)
        if sched._minibatches_before > 0 and sched._finished >= 1:
            sets = [*versions.store.values(), *([versions._spare] if versions._spare else [])]
            held.append(sum(ts[0].untyped_storage().data_ptr() not in masters for ts in sets))

    sched._backward_weight = counted
    k = 0
    for n in (2, 3):
        for _ in range(n):
            ids, tgt = cc.batch(k, 2)
            k += 1
            sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
        sched.flush()
    return {"lag": sched._step_lag, "held": held, "copies": sched.weight_copies}


@pytest.mark.parametrize("split", ["deferred", "graph"])
def test_a_lagged_stage_holds_no_weight_copy_after_a_streams_first_minibatch(found, split):
    last = found[-1][split]
    assert last["lag"] == 1
    assert last["copies"] == 2  # one per flush
    assert last["held"] and set(last["held"]) == {0}, last["held"]


def _compiled_under_hooks(rank: int, world: int) -> dict:
    mods = mlp_stages(world)
    stage = PipelineStage(
        compile_blocks(mods[rank], "in-place", "aot_eager"), rank, world, torch.device("cpu")
    )
    sched = zbpipe.ScheduleContinuous([stage], M, loss_fn=mse, mode="2bw", optimizer=_sgd)
    gemms = _count_w_gemms(sched)
    n = N_CONTINUOUS
    with torch.autograd.graph.save_on_cpu():  # saved weights reach the op as aliases
        for k in range(n):
            x, tgt = batch(k)
            sched.step(*((x,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
        sched.flush()
    gc.collect()
    want = continuous_reference(world, "2bw", "eager", "")[rank]
    return {
        # after the flush no leaf set lives: the routes left are the parameters' (a weight
        # version's leaf routed as an FSDP2-style stand-in was kept alive, and more each step)
        "routes": len(compiled_routes._ROUTES),
        "gemms": gemms,
        "linears": sum(isinstance(m, torch.nn.Linear) for m in mods[rank].modules()),
        "worst": max(float((p - q).abs().max()) for p, q in zip(mods[rank].parameters(), want)),
        "n": n,
    }


def _every_case(rank: int, world: int) -> dict:
    """Every test's case in one process group (starting ranks costs more than a case); the
    compiled one last, after which no other case looks at the routes it leaves."""
    out = {split: _held_weight_sets(rank, world, split) for split in ("deferred", "graph")}
    out["compiled"] = _compiled_under_hooks(rank, world)
    return out


@pytest.fixture(scope="module")
def found() -> list[dict]:
    """Per rank, {case: what it found}."""
    return run_ranks(_every_case, 2, timeout=300)


def test_compiled_2bw_under_saved_tensor_hooks_defers_every_gemm(found):
    for rank, got in enumerate(case["compiled"] for case in found):
        assert got["gemms"] == [got["linears"]] * (M * got["n"]), rank
        assert got["worst"] < 1e-5, rank
        assert got["routes"] == got["linears"], rank
