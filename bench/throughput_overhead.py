"""The cost of throughput accounting: the same loop with step timing off, on, and on with jsonl logging.

Runs two CPU processes under torchrun (and then one process). In each process three prepared copies of
the same model, optimizer and loader train alternately (blocks of steps, interleaved ABC CBA, so all see
the same machine load): one with ``Accelerator()``, one with ``Accelerator(step_timing=True)``, one
with step timing and a jsonl tracker that receives every step's figures. Prints the median step times
and the median of the per-block ratios, for wall-clock time and for the CPU time of the training thread
(the accounting's own cost, which other programs competing for the cores do not blur). Target: on / off
<= 1.01.

Two models: the MLP of ``ddp_overhead.py`` (a step of about 12 ms), and a near-empty step whose extra
time on - off is the accounting's own cost per step in microseconds.

    .venv/bin/python bench/throughput_overhead.py [--blocks 20 --steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = str(Path(__file__).with_name("_throughput_overhead_worker.py"))


def run_worker(processes: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    flags = ["--blocks", str(args.blocks), "--steps", str(args.steps)]
    if processes == 1:
        command = [sys.executable, WORKER, *flags]
    else:
        launcher = [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_port",
            "29533",
        ]
        command = [sys.executable, *launcher, WORKER, *flags]
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def report(processes: int, results: dict) -> None:
    for model, figures in results.items():
        for clock in ("wall", "cpu"):
            median, ratio, extra = (figures[clock][key] for key in ("median_ms", "ratio", "extra_us"))
            print(
                f"{processes} process(es), {model}, {clock:4}: off {median['off']:.2f} ms, "
                f"on {median['on']:.2f} ms (ratio {ratio['on']:.3f}, {extra['on']:+.0f} us/step), "
                f"on+jsonl {median['on+jsonl']:.2f} ms (ratio {ratio['on+jsonl']:.3f}, "
                f"{extra['on+jsonl']:+.0f} us/step)"
            )
        first = figures["first_ms"]
        print(f"    first step (FLOPs counted when on): off {first['off']:.1f} ms, on {first['on']:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--processes", default="2,1", help="comma-separated process counts to run")
    args = parser.parse_args()
    for processes in (int(p) for p in args.processes.split(",")):
        report(processes, run_worker(processes, args))
    print("target: on / off <= 1.01 for the MLP")


if __name__ == "__main__":
    main()
