"""Regional compilation under FSDP2 against eager and whole-model compilation, on 2 CPU processes.

The pipeline benchmark's model (12 residual MLP blocks of width 256, batch 32 over 2 processes), each block an
FSDP2 unit, in three modes: eager; ``TorchDynamoPlugin(backend=...)`` (the whole model compiled); and
``TorchDynamoPlugin(backend=..., use_regional_compilation=True)`` (each block compiled in place). Reports the
first step's time (mostly compilation), the median step, the graphs dynamo made and the loss at the initial weights
(equal across modes up to float noise). Inductor's caches are off, so every mode compiles cold. On CPU
these figures are about compile counts and compile time; a GPU is where compiled steps pay.

Usage: ``python bench/regional_compile.py [--backend inductor] [--steps 20]``.
"""

from __future__ import annotations

import argparse
import json
import os

from _torchrun import run_worker


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (inductor)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the first (20)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    # cold compiles in every mode: inductor's on-disk caches would hand the later modes the earlier's kernels
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    rows = [
        run_worker(
            "_regional_compile_worker.py",
            "--mode",
            mode,
            "--backend",
            args.backend,
            "--steps",
            str(args.steps),
        )
        for mode in ("eager", "whole", "regional")
    ]
    print("| mode | backend | first step s | step ms | graphs | loss (same weights) |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['mode']} | {row['backend']} | {row['first_step_s']:.2f} | {row['step_ms']:.1f} "
            f"| {row['unique_graphs']} | {row['loss']:.6f} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
