#!/usr/bin/env bash
# One device-machine session's whole measurement (one H100/H200 with 16 CPU cores, torch 2.11
# preinstalled), run from the repository root: `bash benchmarks/device_session.sh OUTDIR`.
#
# The 16 cores are split so that no two jobs share a core, and every gloo rank has one of its own
# (the honest setting that this 2-core development machine lacks):
#   cores 0-3   benchmarks/continuous_speed.py, twice (issue 29: 2bw against sync at m = 2 and 4)
#   cores 4-7   benchmarks/compile.py, plain and with activation checkpointing (issue 26)
#   cores 8-11  benchmarks/real_run.py on 4 ranks
#   cores 12-15 benchmarks/gpu.py on the GPU, compiled then eager blocks (issue 26's GPU case)
# Each job has its own time limit and writes its log straight into OUTDIR (a job that runs over
# still leaves the others' tables); the JSONs are packed into OUTDIR/results.tgz at the end, since
# the device tool brings back at most 8 files.
set -u
logs=${1:?usage: device_session.sh OUTDIR}
out=$(mktemp -d)
mkdir -p "$logs"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
pin() { # pin CORES CMD...: run CMD on CORES where taskset exists
    local cores=$1
    shift
    if command -v taskset >/dev/null; then taskset -c "$cores" "$@"; else "$@"; fi
}
{
    date -u
    nproc
    grep -m1 "model name" /proc/cpuinfo
    python3 -c "import torch; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
    gcc --version | head -1
} >"$logs/machine.log" 2>&1

(
    for run in a b; do
        pin 0-3 timeout 200 python3 benchmarks/continuous_speed.py --m 2 4 --reps 24 \
            --out "$out/continuous_speed_$run.json"
    done
) >"$logs/continuous.log" 2>&1 &
(
    pin 4-7 timeout 210 python3 benchmarks/compile.py --part pipeline --reps 30 \
        --out "$out/compile.json"
    pin 4-7 timeout 190 python3 benchmarks/compile.py --part pipeline --reps 30 --ac 1 \
        --out "$out/compile_ac.json"
) >"$logs/compile.log" 2>&1 &
(
    pin 8-11 timeout 400 python3 benchmarks/real_run.py --ranks 4 --reps 5 \
        --out "$out/real_run_4ranks.json"
) >"$logs/real_run.log" 2>&1 &
(
    # table (b) at its default width 4096 did not finish in 200 s on the H200: run it at 2048
    small=(--reps 4 --hidden 2048 --seq 2048 --split-hidden 1024)
    pin 12-15 timeout 140 python3 benchmarks/gpu.py --compile "${small[@]}" \
        --out "$out/gpu_cuda_compiled.json"
    pin 12-15 timeout 90 python3 benchmarks/gpu.py "${small[@]}" --out "$out/gpu_cuda.json"
) >"$logs/gpu.log" 2>&1 &
wait
date -u >>"$logs/machine.log"
tar czf "$logs/results.tgz" -C "$out" .
