#!/usr/bin/env bash
# Build .venv-reference: the real Accelerate and transformers (dev/reference-requirements.txt) beside the
# same torch as lockstep's, in an environment of their own. The tests in tests/reference/ (and the opt-in
# reference tests elsewhere) run snippets there; lockstep itself never imports it.
#
# Idempotent: the checksum of the requirements file and of this script is stamped into the environment once
# everything imports, and a second run with both unchanged installs nothing. Any failed step stops the script with its output.
#
# It also fills .venv-reference/accelerate-only/ with links to the accelerate package alone: the folder
# LOCKSTEP_REFERENCE_PYTHONPATH names for tests that run lockstep's own environment with accelerate added
# (transformers refuses tp_plan and writes Trainer checkpoints only where accelerate imports), and
# .venv-reference/peft-only/ with links to the peft package alone, which the LoRA tests put on the path beside
# accelerate-only (peft imports accelerate; every other dependency of peft is one of lockstep's own).
#
# .venv-reference/bitsandbytes-only/ holds bitsandbytes alone (dev/reference-qlora.txt), which the QLoRA tests
# put on the path beside peft's folders with lockstep's own python.
#
# And two older transformers, each in a folder of its own to put first on PYTHONPATH (with either
# environment's python): .venv-reference/transformers-4.40 (the oldest lockstep supports) and
# .venv-reference/transformers-4.56 (the last 4.x; transformers' example scripts of that version need it).
# Each holds transformers with the tokenizers, huggingface_hub and requests it needs, nothing else, so the
# environment's torch and numpy serve all three versions (dev/reference-transformers-4.txt pins them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-reference
REQUIREMENTS=dev/reference-requirements.txt
STAMP="$VENV/.requirements.sha256"
want="$(cat "$REQUIREMENTS" dev/reference-transformers-4.txt dev/reference-examples.txt dev/reference-qlora.txt dev/reference_env.sh | sha256sum | cut -d' ' -f1)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "reference environment $VENV is up to date ($REQUIREMENTS and dev/reference_env.sh unchanged)"
  exit 0
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
run() {  # run a step quietly; on failure print its output and stop
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "dev/reference_env.sh: failed: $*" >&2
    exit 1
  fi
}

rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || run "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch alone first, from its pin: resolving it together with transformers could pick another build.
run "${PIP[@]}" "$(grep -m1 '^torch==' "$REQUIREMENTS")"
run "${PIP[@]}" -r "$REQUIREMENTS"
run "$VENV/bin/python" -m pip check
run "$VENV/bin/python" - <<'PY'
import os, pathlib, sysconfig
import accelerate, peft, torch, transformers
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for package in ("accelerate", "peft"):
    only = pathlib.Path(f".venv-reference/{package}-only")
    only.mkdir(exist_ok=True)
    for item in [site / package, *site.glob(f"{package}-*.dist-info")]:
        link = only / item.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(item, only))  # relative: the clone may move
print(f"accelerate {accelerate.__version__}, peft {peft.__version__}, transformers {transformers.__version__}, torch {torch.__version__}")
PY
cat "$log"
overlay() {  # overlay VERSION: the lines of dev/reference-transformers-4.txt for that transformers version
  local dir="$VENV/transformers-$1"
  rm -rf "$dir"
  # shellcheck disable=SC2046
  run "${PIP[@]}" --no-deps --target "$dir" $(grep "^$1 " dev/reference-transformers-4.txt | cut -d' ' -f2-)
  run env PYTHONPATH="$dir" "$VENV/bin/python" -c "import transformers as t; assert t.__version__ == '$1', t.__version__"
  echo "transformers $1 in $dir"
}
overlay 4.40.2
overlay 4.56.2
rm -rf "$VENV/examples"
run "${PIP[@]}" --no-deps --target "$VENV/examples" -r dev/reference-examples.txt
echo "datasets and evaluate for the example scripts in $VENV/examples"
rm -rf "$VENV/bitsandbytes-only"
run "${PIP[@]}" --no-deps --target "$VENV/bitsandbytes-only" -r dev/reference-qlora.txt
run env PYTHONPATH="$VENV/bitsandbytes-only" "$VENV/bin/python" -c "import bitsandbytes"
echo "bitsandbytes for the QLoRA tests in $VENV/bitsandbytes-only"
echo "$want" >"$STAMP"
