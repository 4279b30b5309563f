"""The memory meter against bytes counted by hand, under both engines, on a real 2-rank ZB-V step.

Model (``_meter_cases``): 4 chunks of ``r = relu(h * scale)``, ``h = x @ W^T`` (Linear without
bias), every activation one unit of R x D float32; the last chunk's loss is
``((r - target) ** 2).mean()``. ZB-V with p = 2, m = 2 places chunks 0 and 3 on rank 0, 1 and 2
on rank 1 (1 hands its output to 2 on the same rank) and splits every backward into B and W.

What each engine holds, counted from the model (one unit per tensor, distinct storages):

* after F of a chunk: what autograd saved: its input x (the Linear's), h (the product's, since
  ``scale`` needs it), r (ReLU saves its output); the last chunk also ``r - target`` (the square).
* after B, deferred engine: the queued GEMM's operands, x and the Linear's output gradient;
  everything else was freed by B (``scale``'s gradient is computed in B).
* after B, graph engine: x and h (their nodes have weight edges: W re-runs them) and the
  gradient recorded at each of those two boundaries; r and ``r - target`` (activation-only) go.
* after W: nothing.
* hand-offs: chunk 2's input gradient, handed to chunk 1 on the same rank, from B of chunk 2
  until B of chunk 1 consumed it.
* sends: a chunk's output sent to the other rank, and a chunk's input gradient sent back, from
  the moment it is handed over until the send completed (``zbpipe.schedules.sends``): that moment
  depends on when the peer posts its receive, so each count is checked between the count with no
  send pending and the count with every send of the step pending (torch's runtime's way).

Aliases: chunk 2's input is chunk 1's output r (handed over locally); chunk 0's input is the
user's microbatch, chunks 1 and 3 receive theirs into torch's buffers (one storage each).
"""

import pytest

from tests.memory import _meter_cases as cases
from zbpipe.testing import run_ranks

pytestmark = pytest.mark.dist

N_STAGES = 4
RANK_OF = {0: 0, 1: 1, 2: 1, 3: 0}  # ZB-V placement, p = 2


def _input(s: int, mb: int) -> tuple:
    if s > 0 and RANK_OF[s - 1] == RANK_OF[s]:
        return ("r", s - 1, mb)  # handed over by the stage before, on this rank
    return ("in", s, mb)  # the user's microbatch, or torch's receive buffer


def _held(state: str, s: int, mb: int, split: str) -> set:
    if state == "F":
        held = {_input(s, mb), ("h", s, mb), ("r", s, mb)}
        return held | ({("r-target", s, mb)} if s == N_STAGES - 1 else set())
    if state == "B" and split == "deferred":
        return {_input(s, mb), ("grad h", s, mb)}
    if state == "B":
        return {_input(s, mb), ("h", s, mb), ("grad at mul", s, mb), ("grad at mm", s, mb)}
    return set()  # W done


def expected_live(samples: list, split: str) -> list[tuple[int, int]]:
    """Hand count after each action of ``samples`` (units -> bytes): ``(fewest, most)``, with no
    send pending and with every send of the step so far pending."""
    state: dict[tuple[int, int], str] = {}
    sends: set = set()
    handed: set = set()  # input gradients handed to the local previous stage, not consumed yet
    out = []
    for kind, s, mb, _ in samples:
        state[(s, mb)] = kind
        if kind == "F" and s < N_STAGES - 1 and RANK_OF[s + 1] != RANK_OF[s]:
            sends.add(("r", s, mb))  # the output goes to the other rank
        if kind == "B" and s > 0:
            local = RANK_OF[s - 1] == RANK_OF[s]
            (handed if local else sends).add(("grad x", s, mb))
        if kind == "B":
            handed.discard(("grad x", s + 1, mb))  # this B consumed it
        held = set(handed)
        for (t, m), st in state.items():
            held |= _held(st, t, m, split)
        out.append((len(held) * cases.UNIT, len(held | sends) * cases.UNIT))
    return out


@pytest.mark.timeout(300)
def test_the_meter_counts_what_each_engine_holds_after_every_action():
    per_rank = run_ranks(cases.live_after_each_action, 2, ["deferred", "graph"], timeout=240)
    for rank, results in enumerate(per_rank):
        for r in results:
            split, samples = r["split"], r["samples"]
            kinds = sorted({k for k, *_ in samples})
            assert kinds == ["B", "F", "W"], f"rank {rank} {split}: not every backward split"
            got = [live for *_, live in samples]
            want = expected_live(samples, split)
            steps = [f"{k}{s}.{m}" for k, s, m, _ in samples]
            detail = f"rank {rank} {split}: {list(zip(steps, got, want))}"
            assert all(lo <= g <= hi for g, (lo, hi) in zip(got, want)), detail
            # sends are let go of within the step, not all kept to its end (torch's way)
            assert any(g < hi for g, (_, hi) in zip(got, want)), detail
            assert max(lo for lo, _ in want) <= r["peak"] <= max(hi for _, hi in want), detail
            assert r["retained"] == 0 and r["live"] == 0, f"rank {rank} {split}: {r}"
