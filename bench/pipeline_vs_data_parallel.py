"""Data parallel against pipeline parallel, side by side: the same model, the same global batch.

A 12-layer residual MLP (3.2M parameters, AdamW, global batch 32) is trained by lockstep on one process,
with DDP and with FSDP2 (each residual block its own unit) on 2 processes (16 samples each), as a pipeline
of 2 stages (``pp_size=2``: GPipe and 1F1B, 4/8/16 micro-batches of the whole batch), and as 2 pipelines
of 2 FSDP-sharded stages on 4 processes (``pp_size=2, dp_shard_size=2``, 1F1B, 4 micro-batches of each
replica's 16 samples). Each configuration is a fresh ``torchrun`` launch; the rounds alternate their
order (ABC... then ...CBA) so that all see the same machine load. Per configuration it prints the median
step time (the slowest rank's), and per rank the bytes of parameters + gradients + AdamW state and the
peak bytes of the storages autograd keeps for backward (activations). The bubble is measured as
``1 - (one-process step / processes) / pipeline step`` (the share of the pipeline step not explained by a
perfect split of one process's work) beside the theoretical ``(p - 1) / (m + p - 1)``.

It writes ``<out>/pipeline-vs-data-parallel-<date>.json`` (the figures) and ``.png`` (the chart) and
prints the Markdown table of BENCHMARKS.md.

On CPUs this is a correctness and memory picture, not a speed one: the processes share the cores, and
the point-to-point sends go through gloo over loopback.

    .venv/bin/python bench/pipeline_vs_data_parallel.py [--rounds 2 --steps 20 --out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
from pathlib import Path

from _pipeline_figures import configurations, format_table, make_figures, make_row, write_chart
from _torchrun import run_worker
from peers.harness import abba_order

STEM = "pipeline-vs-data-parallel"


def machine(load_at_start: tuple[float, ...]) -> dict:
    """The machine and the 1-minute load average at the start and at the end of the run."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "load_average": [round(load_at_start[0], 2), round(os.getloadavg()[0], 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per launch (after 3 warm-up)")
    parser.add_argument(
        "--four-process-steps", type=int, default=5, help="timed steps of the 4-process row (slow on 2 cores)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results"))
    parser.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    configs = configurations()
    times: dict[str, list[float]] = {config.name: [] for config in configs}
    last: dict[str, list[dict]] = {}
    for order in abba_order(configs, args.rounds):
        for config in order:
            steps = args.four_process_steps if config.processes > 2 else args.steps
            result = run_worker(
                "_pipeline_worker.py", *config.flags, "--steps", str(steps), processes=config.processes
            )
            times[config.name].append(max(rank["step_ms"] for rank in result["ranks"]))
            last[config.name] = result["ranks"]
    figures = make_figures(
        date=args.date,
        machine=machine(load_at_start),
        settings={
            "rounds": args.rounds,
            "steps": args.steps,
            "four_process_steps": args.four_process_steps,
        },
        rows=[make_row(config, times[config.name], last[config.name]) for config in configs],
    )
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{STEM}-{args.date}.json"
    json_path.write_text(json.dumps(figures, indent=1) + "\n")
    chart = write_chart(figures, args.out / f"{STEM}-{args.date}.png")
    print(format_table(figures))
    print(f"load average {figures['machine']['load_average']}; wrote {json_path} and {chart}")


if __name__ == "__main__":
    main()
