"""torchrun entry point: several ``python -m torchtitan.train`` runs, one after another, per rank.

    torchrun --nproc_per_node N tests/integrations/_torchtitan_runs.py RUNS_JSON LOG_DIR RECIPE_DIR

RUNS_JSON holds ``[[name, [arg, ...]], ...]``. Each rank runs, for every entry in order, the
module ``torchtitan.train`` exactly as ``python -m torchtitan.train ARG...`` would (``runpy``
with ``run_name="__main__"``, which is what ``-m`` does): torchtitan's own entry parses the
arguments, builds its Trainer, trains, closes it and destroys the process group, and the next
run initializes a new one.

Each run rendezvous through a store of its own, hosted by rank 0 (``MASTER_PORT``, with
torchrun's agent store turned off). A second process group on torchrun's store would find the
first one's keys there (torch names a new default group as it named the destroyed one): seen
here as a rank stuck in its second run's first collective. Rank 0 picks the run's port once
the run's modules are imported, just before the run, and tells the others through torchrun's
store: ports picked for every run at the start were taken by other processes' connections
before the later runs bound them (seen in CI: ``EADDRINUSE``).

Before each run the process forgets every module of torchtitan, zbpipe and the recipes in
RECIPE_DIR (``_forget_imports``), so a run shares only torch and third-party libraries with the
one before.

Why one process for many runs: importing torch, torchtitan and its data stack costs each rank
about 9 s of CPU, several times what 3 steps of the debug model take, and the tests need four
to six runs. Measured (torchtitan 0.3.0, torch 2.14.1, an idle 2-core machine): five
runs in one launch took 26 s against 16 s per launch, with the same losses to the last printed
digit.

Every rank writes its stdout and stderr, in order, to ``LOG_DIR/rank{RANK}.log``, and a line
``zbpipe-test-run: NAME`` before each run, so the caller can split a rank's log by run (ranks
interleave in any shared stream; one rank's file does not).
"""

import importlib
import json
import os
import runpy
import socket
import sys
from datetime import timedelta

MARKER = "zbpipe-test-run: "


def _forget_imports(recipe_dir: str) -> None:
    """Make the next run import torchtitan, zbpipe and the recipes afresh, as a new process
    would: module-level state stays with its run (torchtitan 0.2's ``parse_args`` takes the
    ``sys.argv`` of its module's import as its default, for one). zbpipe's integration first
    gives torch and torchtitan their original functions back. Imports after the first cost
    about 0.1 s: torch and the data stack stay loaded. Compiled code is forgotten too: dynamo's
    caches hold the previous run's blocks, guarded on the previous torchtitan's globals."""
    import torch

    torch.compiler.reset()
    integration = sys.modules.get("zbpipe.torchtitan")
    if integration is not None:
        integration.uninstall()
    recipes = os.path.abspath(recipe_dir) + os.sep
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        if name.split(".")[0] in ("torchtitan", "zbpipe") or file.startswith(recipes):
            del sys.modules[name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))  # every interface, as torch's stores bind
        return s.getsockname()[1]


def main() -> None:
    import torch.distributed as dist

    runs_json, log_dir, recipe_dir = sys.argv[1:]
    with open(runs_json) as f:
        runs = json.load(f)
    rank = int(os.environ["RANK"])
    log = open(os.path.join(log_dir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=300),
    )
    for i, (name, args) in enumerate(runs):
        print(f"\n{MARKER}{name}", flush=True)  # on a line of its own, whatever came before
        _forget_imports(recipe_dir)
        sys.argv = ["torchtitan.train", *args]  # before the import: torchtitan 0.2 reads it then
        importlib.import_module("torchtitan.train")  # the run's imports, before its port
        key = f"zbpipe-test-run/{i}/port"
        if rank == 0:
            agent.set(key, str(free_port()))
        os.environ["MASTER_PORT"] = agent.get(key).decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
