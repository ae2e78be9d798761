"""lockstep's overhead over a hand-written torch.distributed DDP loop, and its import cost.

Runs two CPU processes under torchrun. In each process the same model and data are trained alternately
by a hand-written DDP loop and by a lockstep loop (blocks of steps, interleaved, so both see the same
machine load), then prints the median step-time ratio. Targets: step ratio <= 1.02, import <= +0.1 s.

    .venv/bin/python bench/ddp_overhead.py [--blocks 6 --steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from _torchrun import run_worker, user_env

IMPORTS = {"torch": "import torch", "lockstep": "from lockstep import Accelerator"}


def import_times(repeats: int) -> tuple[float, float]:
    """Median wall time of `import torch` and of `from lockstep import Accelerator` (which imports torch)."""
    # Bytecode caching on, as on a user's machine (this workplace sets PYTHONDONTWRITEBYTECODE=1, which
    # would make lockstep recompile its sources on every import while torch's wheel ships .pyc files).
    env = user_env()
    times: dict[str, list[float]] = {name: [] for name in IMPORTS}
    for statement in IMPORTS.values():
        subprocess.run([sys.executable, "-c", statement], check=True, env=env)  # writes the caches
    for _ in range(repeats):
        for name, statement in IMPORTS.items():
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", statement], check=True, env=env)
            times[name].append(time.perf_counter() - started)
    return statistics.median(times["torch"]), statistics.median(times["lockstep"])


def launch_workers(args: argparse.Namespace) -> dict:
    return run_worker("_ddp_overhead_worker.py", "--blocks", str(args.blocks), "--steps", str(args.steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--import-repeats", type=int, default=7)
    args = parser.parse_args()
    result = launch_workers(args)
    torch_import, lockstep_import = import_times(args.import_repeats)
    ratio = result["ratio"]  # median of the per-block ratios (blocks are interleaved ABBA)
    print(
        f"step time, 2 CPU processes: hand-written DDP {result['torch_ms']:.2f} ms, "
        f"lockstep {result['lockstep_ms']:.2f} ms, ratio {ratio:.3f} (target <= 1.02)"
    )
    print(
        f"import: torch {torch_import:.2f} s, lockstep {lockstep_import:.2f} s, "
        f"extra {lockstep_import - torch_import:+.2f} s (target <= 0.10 s)"
    )


if __name__ == "__main__":
    main()
