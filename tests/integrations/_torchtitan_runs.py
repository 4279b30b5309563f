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

On MoE models each rank also logs the load-balancing state of the MoE layers it holds
(:func:`_log_moe_state`): before every optimizer step, each layer's tokens per expert (what
torchtitan's step pre-hook turns into the expert-bias update), and after training each layer's
expert bias, as ``zbpipe-test-moe:`` lines. Nothing is logged for a model without MoE layers.
"""

import importlib
import json
import os
import runpy
import socket
import sys
from datetime import timedelta

MARKER = "zbpipe-test-run: "
MOE_MARKER = "zbpipe-test-moe: "
W_MARKER = "zbpipe-test-w: "


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


def _moe_layers(model_parts: list) -> list:
    """``(fqn, moe module)`` of every MoE layer in ``model_parts`` (torchtitan 0.3's decoders: a
    ``layers`` ModuleDict keyed by the layer's index in the whole model)."""
    found = []
    for part in model_parts:
        layers = getattr(part, "layers", None)
        for key, block in getattr(layers, "items", dict)():
            if getattr(block, "moe_enabled", False):
                found.append((f"layers.{key}", block.moe))
    return found


def _log_moe_state() -> None:
    """Make torchtitan's ``Trainer.train`` log the MoE load-balancing state (module docstring).

    The tokens per expert are read by a global optimizer step pre-hook (torch runs those before
    an optimizer's own pre-hooks, where torchtitan turns the counts into the bias update and
    zeroes them), once per training step."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    try:
        from torchtitan.trainer import Trainer
    except ModuleNotFoundError:
        # torchtitan 0.2 defines its Trainer in torchtitan.train, which runpy executes afresh
        # as __main__ (a patch here would not reach it); its runs are dense, nothing to log.
        return

    original = Trainer.train

    def train(self):  # type: ignore[no-untyped-def]
        layers = _moe_layers(self.model_parts)
        logged = set()

        def before_step(optimizer, args, kwargs):  # type: ignore[no-untyped-def]
            if self.step in logged:
                return
            logged.add(self.step)
            for fqn, moe in layers:
                tokens = [float(v) for v in moe.tokens_per_expert_E.detach().cpu().tolist()]
                print(f"{MOE_MARKER}step={self.step} {fqn} tokens={tokens}", flush=True)

        hook = register_optimizer_step_pre_hook(before_step) if layers else None
        try:
            return original(self)
        finally:
            if hook is not None:
                hook.remove()
            for fqn, moe in layers:
                bias = getattr(moe, "expert_bias_E", None)
                if bias is not None:
                    values = [float(v) for v in bias.detach().cpu().tolist()]
                    print(f"{MOE_MARKER}final {fqn} bias={values}", flush=True)

    Trainer.train = train


def _count_w_gemms() -> dict[str, object]:
    """Count, in this process, what zbpipe's W computes during the next run: every weight GEMM
    its stores ran (``gemms``, the native capture's included) and the distinct weights of the
    GEMMs queued on the Python side (``weights``: compiled Linears queue there; eager ones may go
    to the native capture). Read by the Trainer tests as a behaviour (the split reached W), not
    as a time. Installed after :func:`_forget_imports`, so the run's own zbpipe import finds the
    patched class (a no-op where zbpipe is not importable)."""
    counts: dict[str, object] = {"gemms": 0, "weights": set()}
    try:
        from zbpipe.engines.weight_store import WeightGradStore
    except ImportError:
        return counts
    original = WeightGradStore.run

    def run(self):  # type: ignore[no-untyped-def]
        counts["gemms"] += self.num_gemms  # type: ignore[operator]
        counts["weights"].update(id(e[0]) for e in self._entries or ())  # type: ignore[attr-defined]
        return original(self)

    WeightGradStore.run = run
    return counts


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
        _log_moe_state()
        w = _count_w_gemms()
        key = f"zbpipe-test-run/{i}/port"
        if rank == 0:
            agent.set(key, str(free_port()))
        os.environ["MASTER_PORT"] = agent.get(key).decode()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
        print(f"{W_MARKER}gemms={w['gemms']} weights={len(w['weights'])}", flush=True)


if __name__ == "__main__":
    main()
