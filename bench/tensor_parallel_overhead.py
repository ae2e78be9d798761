"""Tensor parallel through lockstep against a hand-written ``parallelize_module`` (+ ``fully_shard``) loop,
and the model-state bytes each rank holds against DDP.

CPU processes under torchrun train the same 4.7M-parameter model (4 residual MLP layers, each ``up``
column-split and ``down`` row-split over tp, AdamW) alternately with hand-written steps and lockstep steps
(``ParallelismConfig(tp_size=..., dp_shard_size=...)``), in interleaved blocks; prints the median step-time
ratio (target <= 1.03) and the bytes per rank of parameters, gradients and AdamW state.

    .venv/bin/python bench/tensor_parallel_overhead.py              # tp=2 on 2 processes
    .venv/bin/python bench/tensor_parallel_overhead.py --dp-shard 2 # dp_shard=2 x tp=2 on 4 processes
"""

from __future__ import annotations

import argparse

from _torchrun import run_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dp-shard", type=int, default=1)
    args = parser.parse_args()
    processes = 2 * args.dp_shard
    result = run_worker(
        "_tensor_parallel_worker.py",
        "--blocks",
        str(args.blocks),
        "--steps",
        str(args.steps),
        "--dp-shard",
        str(args.dp_shard),
        processes=processes,
    )
    layout = f"tp={result['tp']}" + (f" x dp_shard={result['dp_shard']}" if result["dp_shard"] > 1 else "")
    print(
        f"{layout}, {result['world']} CPU processes, {result['parameters'] / 1e6:.1f}M parameters: hand-written "
        f"{result['torch_ms']:.1f} ms, lockstep {result['lockstep_ms']:.1f} ms, ratio {result['ratio']:.3f} "
        "(target <= 1.03)"
    )
    print(
        f"model state per rank (parameters + gradients + AdamW): DDP {result['ddp_bytes'] / 2**20:.2f} MiB, "
        f"{layout} {result['lockstep_bytes'] / 2**20:.2f} MiB ({result['lockstep_bytes'] / result['ddp_bytes']:.3f} x DDP)"
    )


if __name__ == "__main__":
    main()
