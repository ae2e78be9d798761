#!/usr/bin/env bash
# The GPU check of issue 17: on a CUDA machine (one GPU is enough), under 8 minutes,
#   - DDP and FSDP2 step time through lockstep against hand-written loops, NCCL, bf16 autocast
#     (ratios of interleaved ABBA blocks; targets DDP <= 1.01, FSDP2 <= 1.02);
#   - MFU from lockstep's throughput accounting (Accelerator(step_timing=True)), beside MFU computed by hand
#     from the model's FLOPs and the hand-written loop's step time;
#   - the CUDA timing paths (CUDA events of the step timer, the communication timer) on a real device.
#   - checkpoint save/load against torch.save/torch.load, activation memory per policy (issue 29);
#   - with >= 2 GPUs, expert parallelism ep=1 vs ep=2 (issue 45): bench/gpu_expert_parallel.sh, up to 5 more
#     minutes, its own bench/results/gpu-expert-parallel-<date>.json;
# Prints the figures and writes them to bench/results/gpu-<date>.json. Without a CUDA device it says so
# and exits 0 (nothing measured), so CI and CPU machines can call it.
#     bash bench/gpu_check.sh            # uses .venv/bin/python, or $PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import torch, lockstep" 2>/dev/null; then
  echo "bench/gpu_check.sh: $PY cannot import torch and lockstep; run 'make setup' or set PYTHON=/path/to/python." >&2
  exit 2
fi
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$GPUS" = "0" ]; then
  echo "bench/gpu_check.sh: skipped, no CUDA device here (torch $("$PY" -c 'import torch; print(torch.__version__)')); run it on a GPU machine."
  exit 0
fi
NPROC=$(( GPUS < 2 ? GPUS : 2 ))  # NCCL allows one rank per GPU
mkdir -p bench/results
unset PYTHONDONTWRITEBYTECODE
export OMP_NUM_THREADS=1 PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
timeout 450 "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" bench/_gpu_worker.py \
  --out "bench/results/gpu-$(date +%F).json" "$@"
PYTHON="$PY" bash bench/gpu_expert_parallel.sh  # says so and exits 0 with one GPU
