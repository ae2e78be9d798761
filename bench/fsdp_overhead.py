"""FSDP2 through lockstep against a hand-written ``fully_shard`` loop, and FSDP's memory per rank.

Two CPU processes under torchrun train the same 4.7M-parameter model (4 residual MLP layers, each its own
FSDP unit, AdamW) alternately with hand-written ``fully_shard`` steps and lockstep steps, in interleaved
blocks, and print the median step-time ratio (target <= 1.03). Then each rank counts the bytes it holds in
parameters, gradients and optimizer state (unique tensor storages, local shards for DTensors) for DDP and
for FSDP (target: FSDP <= DDP / N + 5%).

    .venv/bin/python bench/fsdp_overhead.py [--blocks 10 --steps 10]
"""

from __future__ import annotations

import argparse

from _torchrun import run_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    result = run_worker("_fsdp_worker.py", "--blocks", str(args.blocks), "--steps", str(args.steps))
    world = result["world"]
    print(
        f"step time, {world} CPU processes, {result['parameters'] / 1e6:.1f}M parameters: hand-written "
        f"fully_shard {result['torch_ms']:.1f} ms, lockstep {result['lockstep_ms']:.1f} ms, "
        f"ratio {result['ratio']:.3f} (target <= 1.03)"
    )
    share = result["fsdp"] / (result["ddp"] / world)
    print(
        f"memory per rank (parameters + gradients + AdamW state): DDP {result['ddp'] / 2**20:.2f} MiB, "
        f"FSDP {result['fsdp'] / 2**20:.2f} MiB = {share:.3f} x DDP/{world} (target <= 1.05)"
    )


if __name__ == "__main__":
    main()
