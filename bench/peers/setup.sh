#!/usr/bin/env bash
# Create bench/peers/.venv: the peers (Accelerate 1.15, Lightning Fabric 2.6), the same CPU build of torch
# 2.13 as lockstep's .venv, matplotlib for the charts, transformers (the bench scripts that build a Llama
# import it, and tests/bench checks their names here too), and this checkout of lockstep (editable), so every
# tool runs in one interpreter. The peers are never dependencies of lockstep: they live only here.
# Idempotent: a second run installs nothing new.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VENV="$HERE/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned, and pinned again in every later install (a constraints file): an unpinned torch,
# or one a peer's dependency range lets pip upgrade, pulls a CUDA build of several GB.
CONSTRAINTS="$VENV/constraints.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"
"${PIP[@]}" "torch==2.13.0" numpy 2>&1 | grep -v "^WARNING: Location" || true
"${PIP[@]}" -c "$CONSTRAINTS" "accelerate==1.15.*" "lightning-fabric==2.6.*" "matplotlib>=3.7" \
  "transformers==5.24.*" 2>&1 \
  | grep -v "^WARNING: Location" || true
"${PIP[@]}" -c "$CONSTRAINTS" -e "$REPO" 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" - <<'PY'
import accelerate, lightning_fabric, torch, lockstep
print(f"peers venv: torch {torch.__version__}, accelerate {accelerate.__version__}, "
      f"lightning_fabric {lightning_fabric.__version__}, lockstep {lockstep.__version__}")
PY
