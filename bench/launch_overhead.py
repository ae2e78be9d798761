"""`lockstep launch` against `torchrun` starting processes of a script that prints and exits.

Two scripts: `noop.py` (prints, imports nothing: the launcher alone) and `torch_start.py` (imports torch and
builds its first optimizer, as every training script does). The third column is lockstep with
`LOCKSTEP_PRELOAD_WORKERS=1`: with `torch_start.py` its workers are forked from a server that imported torch
once (lockstep.launcher.preloaded); `noop.py` imports no torch, so it gets fresh interpreters anyway. The launches run alternately in one session
(interleaved, so all see the same machine load); the script prints the median wall time of each and the
ratios. Target: lockstep / torchrun <= 1.10; preloaded below 1 on torch_start.py with more processes than
cores.

    .venv/bin/python bench/launch_overhead.py [--repeats 9] [--processes 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NOOP = str(Path(__file__).with_name("noop.py"))
TORCH_START = str(Path(__file__).with_name("torch_start.py"))


# Bytecode caching on, as on a user's machine: this workplace sets PYTHONDONTWRITEBYTECODE=1, which would
# make every process recompile lockstep's sources while torch's wheel ships compiled files.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"OMP_NUM_THREADS": "1"}


def timed(command: list[str], **env: str) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=ENV | env)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    for script in (NOOP, TORCH_START):
        measure(script, args.processes, args.repeats)


def measure(script: str, processes: int, repeats: int) -> None:
    n = str(processes)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        n,
        "--master_port",
        "29541",
    ]
    lockstep = [sys.executable, "-m", "lockstep.cli.main", "launch", "--num-processes", n, script]
    runs = {
        "torchrun": lambda: timed([*torchrun, script]),
        "lockstep": lambda: timed(lockstep),
        "lockstep preloaded": lambda: timed(lockstep, LOCKSTEP_PRELOAD_WORKERS="1"),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm the file cache
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run())
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["torchrun"]
    print(
        f"{processes} processes, {Path(script).name}, median of {repeats}: torchrun {base:.2f} s, "
        f"lockstep launch {medians['lockstep']:.2f} s (ratio {medians['lockstep'] / base:.3f}), "
        f"preloaded {medians['lockstep preloaded']:.2f} s (ratio {medians['lockstep preloaded'] / base:.3f})"
    )


if __name__ == "__main__":
    main()
