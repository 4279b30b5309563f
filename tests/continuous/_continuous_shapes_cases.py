"""Per-rank body for tests/continuous/test_continuous_shapes.py: ScheduleContinuous takes no
``variable_shapes``; a mini-batch whose microbatches differ in shape gets a ValueError on stage
0's rank before anything of it is kept or sent, so a retry with good microbatches continues the
stream (its parameters are then those of the plain loop)."""

from __future__ import annotations

from tests.continuous._continuous_cases import _params, _schedule, batch


def bad_minibatch_then_retry(rank: int, world: int, m: int, n: int) -> dict:
    sched = _schedule(rank, world, m, "sync", "sgd")
    errors = []
    for k in range(n):
        ids, tgt = batch(k, m)
        if rank == 0 and k in (0, 2):  # the first mini-batch, and one in mid-stream
            bad = list(ids.tensor_split(m))
            bad[1] = bad[1][:, :-3]
            try:
                sched.step(arg_mbs=[(x,) for x in bad])
            except ValueError as e:
                errors.append(str(e))
        sched.step(*((ids,) if rank == 0 else ()), target=tgt if rank == world - 1 else None)
    sched.flush()
    return {"params": _params(sched), "errors": errors}
