"""W's share of B in torchtitan 0.3's own Trainer, read off zbpipe's profile (``ZBV:profile``).

    PYTHONPATH=src:. python benchmarks/torchtitan_w_share.py LABEL [RUN ...]

Runs torchtitan's Trainer as tests/integrations/test_torchtitan_trainer.py does (the llama3 debug
model on 2 CPU ranks, one seed checkpoint, 4 steps; RUN names from that file's ``RUNS``, default
the eager and the compiled ``"zbpipe ZBV:profile"``) and stores, under ``LABEL`` in
benchmarks/results/torchtitan_w_share.json (other labels kept), each run's measured per-stage B
and W times, W / B (their sums) and its losses. W / B is a functional reading, not a speed: the
split moves the Linears' weight GEMMs from B to W, so a run whose W got none of them measures
W / B near zero. Run with the zbpipe under test first on PYTHONPATH (a LABEL per version).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

from results_io import RESULTS, write_result
from tests.integrations import _torchtitan_assets as assets
from tests.integrations import test_torchtitan_trainer as T
from tests.integrations._torchtitan_trainer import losses, torchrun, torchrun_runs

DEFAULT_RUNS = ("zbpipe ZBV:profile", "zbpipe ZBV:profile, compiled")


def main() -> None:
    label, *names = sys.argv[1:]
    names = names or list(DEFAULT_RUNS)
    tmp = Path(tempfile.mkdtemp(prefix="zbpipe-w-share-"))
    common = [
        *("--module", "llama3_debug_cpu", "--config", "llama3_debugmodel_cpu"),
        *("--hf_assets_path", str(assets.write_tokenizer(tmp / "tokenizer"))),
        *("--dataloader.dataset_path", str(assets.write_dataset(tmp / "c4_test"))),
        *("--training.seq_len=32", "--training.local_batch_size=4"),
        *("--training.disable_cuda_graphs", "--parallelism.pipeline_parallel_microbatch_size=1"),
        *("--debug.seed=0", "--checkpoint.enable"),
    ]
    seed_dir = tmp / "seed"
    torchrun(
        1,
        [*common, "--dump_folder", str(seed_dir), "--parallelism.pipeline_parallel_degree=1"]
        + [f"--training.steps={T.STEPS}", "--checkpoint.create_seed_checkpoint"],
    )
    runs = {}
    for i, name in enumerate(names):
        schedule, ac, compiled = T.RUNS[name]
        steps = T.PROFILED.get(name, T.STEPS)
        args = [
            *(common + ["--dump_folder", str(tmp / f"run-{i}")]),
            f"--training.steps={steps}",
            "--parallelism.pipeline_parallel_degree=2",
            f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--checkpoint.initial_load_path={seed_dir / 'checkpoint' / 'step-0'}",
            "--checkpoint.interval=1000",
            *(T.COMPILE if compiled else ()),
            f"activation-checkpoint:{ac}",
        ]
        log = torchrun_runs(2, {name: args}, tmp / f"logs-{i}")[name]
        found = re.search(r"B=\[([^\]]*)\] W=\[([^\]]*)\]", log)
        assert found, log[-4000:]
        b, w = ([float(v) for v in group.split(",")] for group in found.groups())
        runs[name] = {
            "b_ms": b,
            "w_ms": w,
            "w_over_b": sum(w) / sum(b),
            "losses": losses(log, steps),
        }
        print(name, json.dumps(runs[name]), flush=True)
    path = RESULTS / "torchtitan_w_share.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    labels = stored.get("labels", {})
    labels[label] = runs
    print(f"wrote {write_result('torchtitan_w_share', {'labels': labels})}")


if __name__ == "__main__":
    main()
