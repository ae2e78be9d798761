"""Data parallel against pipeline parallel, side by side: the same model, the same global batch.

A 12-layer residual MLP (3.2M parameters, AdamW, global batch 32) is trained by lockstep on one process,
with DDP on 2 processes (16 samples each), and as a pipeline of 2 stages (``pp_size=2``: GPipe and 1F1B,
4/8/16 micro-batches of the whole batch). Each configuration is a fresh ``torchrun`` launch; the rounds
alternate their order (ABC... then ...CBA) so that all see the same machine load. Per configuration it
prints the median step time (the slowest rank's), and per rank the bytes of parameters + gradients +
AdamW state and the peak bytes of activations saved for backward. The bubble is measured as
``1 - (one-process step / p) / pipeline step`` (the share of the pipeline step not explained by a perfect
split of one process's work) beside the theoretical ``(p - 1) / (m + p - 1)``.

On CPUs this is a correctness and memory picture, not a speed one: 2 processes share 2 cores, and the
point-to-point sends go through gloo over loopback.

    .venv/bin/python bench/pipeline_vs_data_parallel.py [--rounds 2 --steps 20]
"""

from __future__ import annotations

import argparse
import statistics

from _torchrun import run_worker

CONFIGS: list[tuple[str, list[str], int]] = [
    ("one process", ["--mode", "single"], 1),
    ("DDP x2", ["--mode", "ddp"], 2),
    *[
        (f"pp=2 {schedule} m={m}", ["--mode", "pp", "--schedule", schedule, "--microbatches", str(m)], 2)
        for schedule in ("gpipe", "1f1b")
        for m in (4, 8, 16)
    ],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name, _, _ in CONFIGS}
    last: dict[str, list[dict]] = {}
    for round_index in range(args.rounds):
        order = CONFIGS if round_index % 2 == 0 else CONFIGS[::-1]
        for name, flags, processes in order:
            result = run_worker(
                "_pipeline_worker.py", *flags, "--steps", str(args.steps), processes=processes
            )
            times[name].append(max(rank["step_ms"] for rank in result["ranks"]))
            last[name] = result["ranks"]
    single = statistics.median(times["one process"])
    print(
        f"{'configuration':<20} {'step ms':>8} {'params+grads+AdamW MiB per rank':>32} {'activations MiB':>16} bubble"
    )
    for name, _, _ in CONFIGS:
        step = statistics.median(times[name])
        state = "/".join(f"{rank['model_state_bytes'] / 2**20:.1f}" for rank in last[name])
        activations = "/".join(f"{rank['activation_peak_bytes'] / 2**20:.2f}" for rank in last[name])
        bubble = ""
        if name.startswith("pp=2"):
            m = int(name.rsplit("m=", 1)[1])
            bubble = f"measured {1 - (single / 2) / step:.2f}, theory {(2 - 1) / (m + 2 - 1):.2f}"
        print(f"{name:<20} {step:>8.1f} {state:>32} {activations:>16} {bubble}")


if __name__ == "__main__":
    main()
