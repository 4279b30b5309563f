"""torchtitan's own Trainer, tokens/s per pipeline schedule (issue 47): torch's 1F1B,
Interleaved1F1B and zero-bubble schedules beside zbpipe's default names, on the debug models.

Every run is what ``python -m torchtitan.train`` runs (torchtitan 0.3.x, torch >= 2.14) on 2 CPU
ranks (gloo, one thread each), PP = 2, forked from one server that imported torch and
torchtitan once (:mod:`zbpipe.testing.torchtitan_runs`), offline: a local dataset and tokenizer
(:mod:`zbpipe.testing.torchtitan_assets`), the recipes in ``recipes/torchtitan/`` (SDPA
attention on CPU). Settings: ``--seq`` tokens a sequence, ``--microbatches`` sequences a step
(one a microbatch), fp32 parameters, torchtitan's default selective activation checkpointing
(``--ac``), eager (``--compile``: torchtitan's per-block ``torch.compile``), every run from one
seed checkpoint per model. The native weight capture is built before the first run
(``ZBPIPE_NATIVE=wait``), so no run pays for it.

Repetitions are interleaved: each runs every schedule once, in an order rotated by one each
repetition. A run's tokens/s is the tokens of steps ``--warmup + 1`` .. ``--steps`` over the
time between the step lines of the rank that logs the loss (torchtitan's log timestamps, ms);
its ratio to torch's ``1F1B`` is paired per repetition; per schedule the median, min and max.
A run that crashes (torch's ``InterleavedZeroBubble`` / ``ZBVZeroBubble`` under selective AC)
is recorded with its error, its later repetitions are skipped (a crash repeats), and the
benchmark goes on; the results are written after each model. A schedule may carry environment
variables for its ranks: ``ZBV@ZBPIPE_SPLIT=default`` is zbpipe's ZBV on torchtitan's split.

Cost on the 2-core box here (Intel Xeon, loaded, 2026-12-03): one (model, schedule,
repetition) run of llama3 debug at seq 128, 6 steps, is about 15 s of wall time (most of it
torchtitan's set-up, the checkpoint load and its last-step save; a step under a second);
DeepSeek-V3 debug's steps take about 2 s (a 3-step run about 15 s); a Qwen3 MoE run over a
minute on the quiet machine (docs/results/trainer.md). A seed checkpoint per model adds one
run, the server's start about 15 s. So ``--reps 3`` of 6 schedules on llama3 is about 5
minutes; with Qwen3 the three models take about an hour.

Run:  PYTHONPATH=src python benchmarks/trainer.py --models llama3 --reps 3 \\
          [--schedules 1F1B ZBV ZBV@ZBPIPE_SPLIT=default] [--out benchmarks/results/trainer.json]
(with the Python of a torch 2.14 + torchtitan 0.3 environment). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "torchtitan"
#: name: (config module in recipes/torchtitan, config function)
MODELS = {
    "llama3": ("llama3_debug_cpu", "llama3_debugmodel_cpu"),
    "qwen3": ("moe_debug_cpu", "qwen3_moe_debug_cpu"),
    "deepseek_v3": ("moe_debug_cpu", "deepseek_v3_debugmodel_cpu"),
}
BASELINE = "1F1B"
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "ZBH1", "ZBV")
MARKER = "zbpipe-test-run: "  # zbpipe.testing.torchtitan_runs.MARKER (not imported: no torch here)
_COLOR = re.compile(r"\x1b\[[0-9;]*m")
#: torchtitan's step line: ``[titan] 2026-01-02 03:04:05,678 - root - INFO - step:  3  loss: ...``
_STEP = re.compile(
    r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?step:\s+(\d+)\s+loss:\s+(-?[0-9.]+)"
)


# ---- pure parts (tests/test_trainer_benchmark.py) ----


def step_times(log: str) -> dict[int, float]:
    """{step: seconds since the epoch of its step line} from the lines of the rank that logs
    the loss: the other ranks print a negative whole number (-1 per data-parallel replica)."""
    found: dict[int, float] = {}
    for stamp, step, loss in _STEP.findall(_COLOR.sub("", log)):
        value = float(loss)
        if value < 0 and value.is_integer():
            continue
        when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        found.setdefault(int(step), when)
    return found


def tokens_per_second(times: dict[int, float], warmup: int, steps: int, tokens: int) -> float:
    """Tokens of steps ``warmup + 1 .. steps`` (``tokens`` a step) over the time between step
    ``warmup``'s line and step ``steps``'s; ``ValueError`` if a step line is missing."""
    if not 1 <= warmup < steps:
        raise ValueError(f"need 1 <= warmup < steps, got warmup={warmup}, steps={steps}")
    missing = [s for s in (warmup, steps) if s not in times]
    if missing:
        raise ValueError(f"no step line for step(s) {missing} (steps seen: {sorted(times)})")
    span = times[steps] - times[warmup]
    if span <= 0:
        raise ValueError(f"steps {warmup}..{steps} took {span} s by the log's clock")
    return tokens * (steps - warmup) / span


def rotated(names: list[str], rep: int) -> list[str]:
    """``names`` rotated left by ``rep``: each repetition starts with another schedule."""
    k = rep % len(names) if names else 0
    return names[k:] + names[:k]


def ratios(by_rep: list[dict[str, float | None]], baseline: str) -> dict[str, dict[str, Any]]:
    """Per schedule, its tokens/s over ``baseline``'s in the same repetition: median, min, max
    and how many repetitions paired (a repetition where either crashed pairs none)."""
    names = sorted({n for rep in by_rep for n in rep})
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        r = [
            rep[name] / rep[baseline]  # type: ignore[operator]
            for rep in by_rep
            if rep.get(name) is not None and rep.get(baseline)
        ]
        out[name] = (
            {"median": statistics.median(r), "min": min(r), "max": max(r), "pairs": len(r)}
            if r
            else {"median": None, "min": None, "max": None, "pairs": 0}
        )
    return out


def parse_schedule(spec: str) -> tuple[str, dict[str, str]]:
    """``"ZBV@ZBPIPE_SPLIT=default,ZBPIPE_NATIVE=off"`` -> ``("ZBV", {...})``."""
    name, _, rest = spec.partition("@")
    env = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--schedules {spec!r}: write NAME or NAME@VAR=VALUE[,VAR=VALUE]")
        env[key] = value
    return name, env


_ZBPIPE_LINE = re.compile(r"(zbpipe[\w.]*) - (DEBUG|INFO|WARNING|ERROR) - (.*)")


def zbpipe_lines(log: str) -> list[str]:
    """zbpipe's own log lines of a run (its decisions: split, plan, plain order), once each,
    as ``LEVEL message``."""
    seen: dict[str, None] = {}
    for line in _COLOR.sub("", log).splitlines():
        m = _ZBPIPE_LINE.search(line)
        if m:
            seen.setdefault(f"{m.group(2)} {m.group(3).strip()}", None)
    return list(seen)


_COSTS = re.compile(r"measured costs \(ms\) F=\[([^]]*)\] B=\[([^]]*)\] W=\[([^]]*)\]")


def profile_costs(lines: list[str]) -> dict[str, Any] | None:
    """The per-stage F, B and W times (ms) a ``:profile`` run measured (its ``zbpipe profile:``
    line), with W's share of the backward, sum W / sum (B + W); None without that line."""
    for line in lines:
        m = _COSTS.search(line)
        if m:
            f, b, w = ([float(x) for x in g.split(",")] for g in m.groups())
            return {"F": f, "B": b, "W": w, "w_share_of_backward": sum(w) / (sum(b) + sum(w))}
    return None


def trace_summary(per_rank: list[list[dict[str, Any]]], warmup: int) -> dict[str, Any]:
    """Per rank, means over the steps after ``warmup`` (:mod:`_trainer_trace`'s records): the
    ``step()`` call's wall and CPU seconds; per action kind its wall and CPU seconds and count
    (zbpipe's own action spans where the schedule has them, else torch's stage calls); idle,
    the wall time of ``step()`` no action covers; host, the CPU time of ``step()`` outside its
    actions (scheduling, sends, receives)."""
    out: dict[str, Any] = {}
    for rank, steps in enumerate(per_rank):
        measured = steps[warmup:]
        if not measured:
            continue
        n = len(measured)
        wall: dict[str, float] = {}
        cpu: dict[str, float] = {}
        counts: dict[str, int] = {}
        step_wall = step_cpu = 0.0
        for st in measured:
            step_wall += st["step"][1] - st["step"][0]
            step_cpu += st["step"][2]
            for kind, _stage, _mb, t0, t1, c in st["zbpipe_events"] or st["stage_spans"]:
                wall[kind] = wall.get(kind, 0.0) + (t1 - t0)
                cpu[kind] = cpu.get(kind, 0.0) + c
                counts[kind] = counts.get(kind, 0) + 1
        out[f"rank{rank}"] = {
            "step_wall_s": step_wall / n,
            "step_cpu_s": step_cpu / n,
            "busy_wall_s": {k: v / n for k, v in sorted(wall.items())},
            "busy_cpu_s": {k: v / n for k, v in sorted(cpu.items())},
            "actions_per_step": {k: v / n for k, v in sorted(counts.items())},
            "idle_wall_s": (step_wall - sum(wall.values())) / n,
            "host_cpu_s": (step_cpu - sum(cpu.values())) / n,
            "source": "zbpipe spans" if measured[0]["zbpipe_events"] else "torch stage calls",
        }
    return out


def cpu_balance(summary: dict[str, Any]) -> float | None:
    """Rank 0's ``step()`` CPU seconds over rank 1's: how the split shares the work, read off
    CPU clocks (a loaded machine stretches wall times, not these, by much)."""
    r0, r1 = summary.get("rank0"), summary.get("rank1")
    if not r0 or not r1 or not r1["step_cpu_s"]:
        return None
    return float(r0["step_cpu_s"] / r1["step_cpu_s"])


# ---- running torchtitan ----


class Server:
    """The run server (:mod:`zbpipe.testing.torchtitan_runs`): one request per run."""

    def __init__(self) -> None:
        src = ROOT / "src"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(RECIPE), str(src), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]
            ),
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "LOG_RANK": "0,1",
            "ZBPIPE_NATIVE": os.environ.get("ZBPIPE_NATIVE", "wait"),
        }
        preload = ("torch.distributed", "datasets", "torchtitan.trainer")
        cmd = [sys.executable, "-m", "zbpipe.testing.torchtitan_runs", *preload]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(cmd, env=env, stdin=pipe, stdout=pipe, text=True)
        if self._reply(300) != "ready":
            raise RuntimeError("the run server did not start")

    def _reply(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            raise RuntimeError(f"the run server gave no answer in {timeout} s")
        return line.strip()

    def run(
        self,
        ranks: int,
        args: list[str],
        env: dict[str, str],
        log_dir: Path,
        timeout: float,
        hooks: str | None = None,
    ) -> tuple[str | None, list[str]]:
        """(error or None, each rank's log) of one run in fresh ranks."""
        log_dir.mkdir(parents=True, exist_ok=True)
        request = {
            "ranks": ranks,
            "runs": [["run", args, env]],
            "log_dir": str(log_dir),
            "hooks": hooks,
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**request, "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self._reply(timeout + 60))
        logs = [
            p.read_text(errors="replace") if (p := log_dir / f"rank{r}.log").exists() else ""
            for r in range(ranks)
        ]
        return (None if answer["ok"] else answer["error"]), logs

    def close(self) -> None:
        self.proc.kill()


def last_error(logs: list[str]) -> str:
    """The last exception line of any rank (what a crash was)."""
    for log in logs:
        lines = [ln for ln in log.splitlines() if re.match(r"^\w*(Error|Exception)\b", ln)]
        if lines:
            return lines[-1][:500]
    return "(no exception line; see the ranks' logs)"


def common_args(cfg: argparse.Namespace, tmp: Path, model: str) -> list[str]:
    from zbpipe.testing import torchtitan_assets as assets

    module, config = MODELS[model]
    args = [
        "--module",
        module,
        "--config",
        config,
        "--hf_assets_path",
        str(assets.write_tokenizer(tmp / "tokenizer")),
        "--dataloader.dataset_path",
        str(assets.write_dataset(tmp / "c4_test", n_docs=2000)),
        f"--training.seq_len={cfg.seq}",
        f"--training.local_batch_size={cfg.microbatches}",
        "--training.mixed_precision_param=float32",
        "--training.disable_cuda_graphs",
        "--parallelism.pipeline_parallel_microbatch_size=1",
        "--debug.seed=0",
        "--metrics.log_freq=1",
        "--checkpoint.enable",
    ]
    if cfg.compile:
        args += ["--compile.enable", "--compile.backend", cfg.compile_backend]
    return args


def run_model(server: Server, cfg: argparse.Namespace, tmp: Path, model: str) -> dict[str, Any]:
    """Every repetition of every schedule on ``model``: the runs, their ratios, zbpipe's lines."""
    common = common_args(cfg, tmp, model)
    seed_dir = tmp / f"{model}-seed"
    err, logs = server.run(
        1,
        [
            *common,
            "--dump_folder",
            str(seed_dir),
            "--parallelism.pipeline_parallel_degree=1",
            "--training.steps=1",
            "--checkpoint.create_seed_checkpoint",
        ],
        {},
        tmp / f"logs-{model}-seed",
        cfg.run_timeout,
    )
    if err:
        raise RuntimeError(f"{model}: seed checkpoint failed: {err}\n{logs[0][-3000:]}")
    tokens = cfg.seq * cfg.microbatches
    runs, by_rep, said = [], [], {}
    crashed: set[str] = set()
    for rep in range(cfg.reps):
        tps: dict[str, float | None] = {}
        for spec in rotated(list(cfg.schedules), rep):
            if spec in crashed:  # a crash repeats (torch's zero-bubble schedules under SAC)
                runs.append({"schedule": spec, "rep": rep, "status": "skipped: crashed before"})
                tps[spec] = None
                continue
            name, env = parse_schedule(spec)
            tag = re.sub(r"[^A-Za-z0-9_.-]", "_", spec)
            args = [
                *common,
                "--dump_folder",
                str(tmp / f"{model}-{tag}-{rep}"),
                f"--training.steps={cfg.steps}",
                "--parallelism.pipeline_parallel_degree=2",
                f"--parallelism.pipeline_parallel_schedule={name}",
                f"--checkpoint.initial_load_path={seed_dir / 'checkpoint' / 'step-0'}",
                "--checkpoint.interval=100000",
                f"activation-checkpoint:{cfg.ac}",
            ]
            trace_dir = tmp / f"trace-{model}-{tag}-{rep}"
            if cfg.trace:
                trace_dir.mkdir(parents=True, exist_ok=True)
                env = {**env, "TRAINER_TRACE_OUT": str(trace_dir)}
            err, logs = server.run(
                2,
                args,
                env,
                tmp / f"logs-{model}-{tag}-{rep}",
                cfg.run_timeout,
                hooks="_trainer_trace" if cfg.trace else None,
            )
            # its checkpoints and dumps: 24 MoE runs filled the disk (the logs stay)
            shutil.rmtree(tmp / f"{model}-{tag}-{rep}", ignore_errors=True)
            row: dict[str, Any] = {"schedule": spec, "rep": rep}
            if err:
                row.update(status="crash", error=f"{err}: {last_error(logs)}")
                tps[spec] = None
                crashed.add(spec)
            else:
                times = {k: v for log in logs for k, v in step_times(log).items()}
                row.update(
                    status="ok",
                    tokens_per_s=tokens_per_second(times, cfg.warmup, cfg.steps, tokens),
                )
                tps[spec] = row["tokens_per_s"]
                row["step_s"] = tokens / row["tokens_per_s"]
                if cfg.trace:
                    per_rank = [
                        json.loads((trace_dir / f"rank{r}.json").read_text()) for r in range(2)
                    ]
                    row["trace"] = trace_summary(per_rank, cfg.warmup)
                    row["cpu_rank0_over_rank1"] = cpu_balance(row["trace"])
            if spec not in said:
                said[spec] = zbpipe_lines(logs[0] + "\n" + logs[-1])
            costs = profile_costs(zbpipe_lines(logs[0]))  # (rank 0 logs it)
            if costs is not None:
                row["measured_costs_ms"] = costs
            print(
                f"  {model} rep {rep} {spec:32s} {row.get('tokens_per_s') or row['error']}",
                flush=True,
            )
            runs.append(row)
        by_rep.append(tps)
    return {"runs": runs, "ratios_to_1F1B": ratios(by_rep, BASELINE), "zbpipe_log": said}


#: a run's line as ``run_model`` prints it: ``  MODEL rep N SCHEDULE TOKENS_PER_S_OR_ERROR``
_RUN_LINE = re.compile(r"^  (\S+) rep (\d+) (\S+)\s+(.+)$")


def results_from_log(text: str) -> dict[str, Any]:
    """The per-model results of a run's printed lines (``--from-log``: a run cut short before
    it wrote its JSON keeps what it printed; zbpipe's logged lines are not in it)."""
    found: dict[str, dict[int, dict[str, float | None]]] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    for line in text.splitlines():
        m = _RUN_LINE.match(line)
        if not m:
            continue
        model, rep, spec, value = m[1], int(m[2]), m[3], m[4].strip()
        try:
            tps: float | None = float(value)
            row = {"schedule": spec, "rep": rep, "status": "ok", "tokens_per_s": tps}
        except ValueError:
            tps, row = None, {"schedule": spec, "rep": rep, "status": "crash", "error": value}
        found.setdefault(model, {}).setdefault(rep, {})[spec] = tps
        runs.setdefault(model, []).append(row)
    return {
        model: {
            "runs": runs[model],
            "ratios_to_1F1B": ratios([reps[r] for r in sorted(reps)], BASELINE),
            "zbpipe_log": {},
        }
        for model, reps in found.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        help="torchtitan schedule names, each NAME or NAME@VAR=VALUE[,VAR=VALUE]",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--ac", choices=["selective", "full", "none"], default="selective")
    ap.add_argument("--compile", action="store_true", help="torchtitan's per-block torch.compile")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="time step() and every compute action per rank (benchmarks/_trainer_trace.py)",
    )
    ap.add_argument("--run-timeout", type=float, default=900)
    ap.add_argument("--note", default="", help="recorded with the result (e.g. 'loaded machine')")
    ap.add_argument("--out", default=None, help="default benchmarks/results/trainer.json")
    ap.add_argument(
        "--from-log",
        default=None,
        help="store the results a cut-short run printed (its stdout) instead of running; "
        "give the run's other flags as they were",
    )
    cfg = ap.parse_args()
    if BASELINE not in cfg.schedules:
        ap.error(f"--schedules must include {BASELINE}: every ratio is paired with it")
    if not 1 <= cfg.warmup < cfg.steps:
        ap.error("need 1 <= --warmup < --steps")
    for spec in cfg.schedules:
        parse_schedule(spec)

    from importlib.metadata import version

    from results_io import cpu_model, write_result

    setup = {k: v for k, v in vars(cfg).items() if k not in ("out",)}

    def save(results: dict[str, Any]) -> Path:
        """Every model measured so far (written after each: a long run cut short keeps them)."""
        return write_result(
            "trainer",
            {
                "cpu_model": cpu_model(),
                "torchtitan": version("torchtitan"),
                "setup": setup,
                "tokens_per_s": "global tokens of the measured steps over their time (log clock)",
                "results": results,
            },
            cfg.out,
        )

    if cfg.from_log:
        print(f"wrote {save(results_from_log(Path(cfg.from_log).read_text()))}")
        return
    results: dict[str, Any] = {}
    server = Server()
    try:
        with tempfile.TemporaryDirectory(prefix="zbpipe-trainer-") as tmp:
            for model in cfg.models:
                results[model] = run_model(server, cfg, Path(tmp), model)
                out = save(results)
    finally:
        server.close()
    for model, res in results.items():
        print(f"\n{model}: tokens/s / torch 1F1B's, paired per repetition (median [min-max])")
        for name, r in res["ratios_to_1F1B"].items():
            text = (
                "crashed"
                if r["median"] is None
                else f"{r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]"
            )
            print(f"  {name:32s} {text} ({r['pairs']} pairs)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
