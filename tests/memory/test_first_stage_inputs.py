"""The first stage's inputs are views of the caller's batch: each microbatch counts its slice.

torch's pipelining splits the batch into microbatches with ``tensor_split``, so every first-stage
input shares the batch's storage. Counted by storage, each microbatch of stage 0 was charged the
whole batch: on identical blocks stage 0 then measured heavier than the others, and the default
memory re-plan (issue 27) gave ZB-V a plan with fewer warm-up forwards than its equal-bytes one
(on issue 26's MLP blocks, 1.09x torch's 1F1B step time instead of 0.9x). The last stage's
targets are cut the same way.
"""

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from tests.engines._compile_cases import MLPBlock, mse
from zbpipe import ScheduleZBV
from zbpipe.memory.probe import KeyBytes
from zbpipe.memory.saved import SavedTensors, input_storages
from zbpipe.planning import v_placement
from zbpipe.testing import run_ranks


class Recorder:
    def __init__(self) -> None:
        self.live = 0

    def on_pack(self, storage: int, nbytes: int) -> None:
        self.live += nbytes

    def on_free(self, storage: int, nbytes: int) -> None:
        self.live -= nbytes


def test_a_saved_slice_of_the_callers_batch_counts_its_own_bytes():
    batch = torch.randn(4, 8)  # 4 rows of 8 float32: 128 bytes; a microbatch row: 32
    weight = torch.randn(8, 8, requires_grad=True)
    counted = {}
    for views in (None, input_storages(((batch[1:2],), {}))):
        rec = Recorder()
        saved = SavedTensors(rec, given=views)
        with saved.hooks():
            out = batch[1:2] @ weight  # saves its input, the slice (mm's weight gradient needs it)
        counted[views is not None] = rec.live
        out.sum().backward()
    assert counted == {False: 4 * 8 * 4, True: 1 * 8 * 4}
    start = batch.data_ptr()
    assert input_storages((batch[1:2], {"mask": batch}, [3, "x"])) == {
        batch.untyped_storage().data_ptr(): [(start + 32, 32), (start, 128)]
    }


def test_every_view_of_one_slice_counts_as_that_slice():
    # Views of a slice that start where it starts but are smaller (a column, a reshape) count
    # under the slice's key with the slice's bytes: added once, taken back once, whichever
    # backward frees its holder last (counted by their own sizes, the live bytes drifted).
    batch = torch.randn(4, 8)
    mb = batch[1:2]
    weight = torch.randn(8, 8, requires_grad=True)
    rec = KeyBytes(None)  # the probe's observer: a key counts once while any holder has it
    saved = SavedTensors(rec, given=input_storages((mb,)))
    with saved.hooks():
        out = mb @ weight
        col = mb[:, 0:1] * weight[0:1, 0:1]  # saves a view of the slice: its first column
    assert rec.live == 32
    out.sum().backward()
    col.sum().backward()
    assert rec.live == 0


def _zbv_bytes(rank: int, world: int, m: int) -> list[float]:
    torch.manual_seed(0)
    mods = [nn.Sequential(MLPBlock(32, 64), MLPBlock(32, 64)) for _ in range(2 * world)]
    mine = sorted(s for s, r in v_placement(world).items() if r == rank)
    stages = [PipelineStage(mods[s], s, 2 * world, torch.device("cpu")) for s in mine]
    sched = ScheduleZBV(stages, m, loss_fn=mse)
    x = torch.randn(m * 4, 32)
    sched.step(*([x] if 0 in mine else []), target=torch.randn_like(x) if 3 in mine else None)
    return [f * sched.memory_unit_bytes for f in sched.memory_costs.mem_f]


def test_identical_stages_measure_alike_whatever_the_caller_holds():
    # 4 chunks of 2 identical blocks (LayerNorm -> Linear(32, 64) -> GELU -> Linear(64, 32),
    # plus the residual), microbatches of R = 4 rows cut from a batch of 16 rows, its targets
    # likewise. What a microbatch of any chunk allocates and keeps for its backward, by hand
    # (float32): per block the LayerNorm's mean and rstd (R each), its output (R x 32, the
    # first Linear's input), the first Linear's output (R x 64, GELU's input), GELU's output
    # (R x 64, the second Linear's input) and the block's output (R x 32: the next block's
    # LayerNorm input; the chunk's output until sent, or the loss's input on the last chunk).
    # A chunk's input is not its own: a slice of the caller's batch (counted by storage, stage 0
    # was charged the whole batch), torch's receive buffer (one per microbatch, every step) or
    # the local previous chunk's output; nor is the last chunk's target slice.
    r = 4
    block = 4 * (2 * r + r * 32 + r * 64 + r * 64 + r * 32)
    for mem_f in run_ranks(_zbv_bytes, 2, 4, timeout=300):
        # measured bytes are rounded to 3 significant digits (so every rank plans the same)
        assert all(abs(f - 2 * block) <= 0.001 * f for f in mem_f), (mem_f, 2 * block)


def _torch_1f1b_peak(rank: int, world: int, m: int) -> int:
    from torch.distributed.pipelining import Schedule1F1B

    from zbpipe.memory.meter import SavedActivationMeter
    from zbpipe.patching import undo_all

    stage_mod = nn.Linear(8, 8, bias=False)  # saves its input (a slice of the batch)
    stage = PipelineStage(stage_mod, 0, 1, torch.device("cpu"))
    meter = SavedActivationMeter()
    # the loss saves the target slice (the output's gradient needs it; the target needs none)
    sched = Schedule1F1B(stage, m, loss_fn=meter.watch_loss(lambda out, tgt: (out * tgt).sum()))
    patches = meter.attach(stage)
    x, tgt = torch.randn(m * 2, 8), torch.randn(m * 2, 8)
    sched.step(x, target=tgt)  # the first step also infers shapes
    meter.begin_step()
    sched.step(x, target=tgt)
    undo_all(patches)
    return meter.end_step().peak_bytes


def test_torch_schedules_under_the_meter_count_a_slice_per_microbatch():
    # torch's Schedule1F1B on one stage runs F0 B0 F1 B1 ...: at most one microbatch's input
    # slice (2 rows x 8 float32, 64 bytes) and target slice are held at once. Counted by
    # storage, the input and the target were each charged the whole batch (m slices: 512).
    m, slice_bytes = 4, 2 * 8 * 4
    (peak,) = run_ranks(_torch_1f1b_peak, 1, m, timeout=120)
    assert peak == 2 * slice_bytes
