#!/usr/bin/env bash
# Expert parallelism on CUDA (issue 45's device row): on a machine with >= 2 GPUs, one rank per GPU, NCCL,
# bf16 autocast, a Qwen3-MoE built from its config (4 layers x 16 experts of width 1408, top-2, hidden 1024,
# vocabulary 32,768, 8 x 1024 tokens per rank; 0.36B parameters, 78% in the experts): hand-written DDP
# with every expert on every rank against lockstep with ep=1 and ep=N (every N > 1 dividing the GPUs used, up
# to 4), in interleaved blocks; prints each layout's step time, its ratio to hand-written DDP, the bytes of
# parameters + gradients + AdamW state per rank (experts apart from the dense part) and each layout's peak
# allocated memory per rank (torch.cuda.max_memory_allocated, the layout built and run alone). The same
# worker runs on CPU with gloo (bench/expert_parallel.py). Writes bench/results/gpu-expert-parallel-<date>.json.
# Without CUDA, or with one GPU, it says so and exits 0 (nothing measured). gpu_check.sh calls it.
#     bash bench/gpu_expert_parallel.sh     # uses .venv/bin/python, or $PYTHON; extra flags go to the script
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import torch, lockstep, transformers" 2>/dev/null; then
  echo "bench/gpu_expert_parallel.sh: $PY cannot import torch, lockstep and transformers; run 'make setup' or set PYTHON=/path/to/python." >&2
  exit 2
fi
GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$GPUS" -lt 2 ]; then
  echo "bench/gpu_expert_parallel.sh: skipped, expert parallelism needs >= 2 CUDA devices and this machine has $GPUS (torch $("$PY" -c 'import torch; print(torch.__version__)'))."
  exit 0
fi
NPROC=$(( GPUS >= 4 ? 4 : 2 ))  # NCCL allows one rank per GPU; 4 adds ep=4 and ep=2 with 2 replicas
mkdir -p bench/results
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
timeout 300 "$PY" bench/expert_parallel.py --device cuda --bf16 --processes "$NPROC" \
  --hidden 1024 --layers 4 --experts 16 --expert-width 1408 --vocab 32768 --batch 8 --sequence 1024 \
  --blocks 6 --steps 5 --warmup 3 --out "bench/results/gpu-expert-parallel-$(date +%F).json" "$@"
