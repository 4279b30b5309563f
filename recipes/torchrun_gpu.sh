#!/usr/bin/env bash
# Launch recipes/train_gpu.py on NNODES nodes x NPROC_PER_NODE GPUs (one pipeline rank per GPU, NCCL).
# Run this same command on every node; torchrun's c10d rendezvous assigns node ranks.
#
#   MASTER_ADDR=node0.example NNODES=2 NPROC_PER_NODE=8 recipes/torchrun_gpu.sh --schedule ZBV
#   NNODES=1 NPROC_PER_NODE=4 recipes/torchrun_gpu.sh --schedule ZBH1 --steps 20   # one node
#
# Everything after the script name goes to train_gpu.py (python recipes/train_gpu.py --help).
set -euo pipefail

NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"   # a host every node can reach (node 0)
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-zbpipe-${USER:-job}}"     # the same on every node of one job, different across jobs

if [[ "${NPROC_PER_NODE}" -lt 1 ]]; then
  echo "torchrun_gpu.sh: no GPU found; set NPROC_PER_NODE (CPU runs: recipes/train_cpu.py)" >&2
  exit 2
fi

# One thread per rank for CPU-side work; NCCL picks its own network interfaces (set NCCL_SOCKET_IFNAME
# if the nodes have several and the default is wrong).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec torchrun \
  --nnodes "${NNODES}" \
  --nproc-per-node "${NPROC_PER_NODE}" \
  --rdzv-backend c10d \
  --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}" \
  --rdzv-id "${RDZV_ID}" \
  "$(dirname "$0")/train_gpu.py" "$@"
