"""`lockstep launch` against `torchrun` starting two processes of a script that prints and exits.

Both launchers run alternately in one session (interleaved, so both see the same machine load); the
script prints the median wall time of each and their ratio. Target: lockstep / torchrun <= 1.10.

    .venv/bin/python bench/launch_overhead.py [--repeats 9]
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


# Bytecode caching on, as on a user's machine: this workplace sets PYTHONDONTWRITEBYTECODE=1, which would
# make every process recompile lockstep's sources while torch's wheel ships compiled files.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"OMP_NUM_THREADS": "1"}


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, env=ENV)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29541",
        NOOP,
    ]
    lockstep = [sys.executable, "-m", "lockstep.cli.main", "launch", "--num-processes", "2", NOOP]
    times: dict[str, list[float]] = {"torchrun": [], "lockstep": []}
    timed(torchrun), timed(lockstep)  # warm the file cache
    for _ in range(args.repeats):
        times["torchrun"].append(timed(torchrun))
        times["lockstep"].append(timed(lockstep))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"2 processes, print-and-exit, median of {args.repeats}: torchrun {medians['torchrun']:.2f} s, "
        f"lockstep launch {medians['lockstep']:.2f} s, ratio {medians['lockstep'] / medians['torchrun']:.3f} "
        "(target <= 1.10)"
    )


if __name__ == "__main__":
    main()
