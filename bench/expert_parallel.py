"""Expert parallelism through lockstep against hand-written DDP with every expert on every rank: step time and
the model-state bytes each rank holds, experts apart from the dense part.

CPU processes under torchrun train the same transformers Qwen3-MoE built from its config (defaults: 2 layers,
16 experts of width 256, top-2, hidden 128, vocabulary 512, router aux loss on; 3.4M parameters, 93% of them
in the experts), AdamW, 4 sequences of 64 tokens per process, in interleaved blocks (ABC CBA ...): (a)
hand-written ``DistributedDataParallel``, (b) lockstep with ep=1 (DDP through the Accelerator), (c) lockstep
with ``ParallelismConfig(ep_size=N)`` for every N > 1 dividing the processes. Prints each layout's median step
time, the median (and quartiles) of its per-block ratio to (a), and the bytes of parameters, gradients and
AdamW state per rank (``expert_memory``, gradients held).

    .venv/bin/python bench/expert_parallel.py                  # ep=1 and ep=2 on 2 processes
    .venv/bin/python bench/expert_parallel.py --processes 4    # ep=1, ep=2 (2 replicas of each shard), ep=4

On CUDA (one process per GPU, NCCL, bf16 autocast, with each layout's peak allocated memory measured alone):
``bench/gpu_expert_parallel.sh`` runs this script with ``--device cuda --bf16`` and larger sizes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _torchrun import run_worker

SIZE_FLAGS = ("hidden", "layers", "experts", "top_k", "expert_width", "vocab", "batch", "sequence", "warmup")


def load_average() -> str:
    path = Path("/proc/loadavg")
    return path.read_text().split()[0] if path.exists() else "?"


def mib(count: int) -> str:
    return f"{count / 2**20:.2f} MiB"


def report(result: dict) -> list[str]:
    """The lines printed for one run (rank 0's JSON)."""
    sizes = result["sizes"]
    lines = [
        f"Qwen3-MoE {sizes['layers']} layers x {sizes['experts']} experts (top-{sizes['top_k']}, hidden "
        f"{sizes['hidden']}, expert width {sizes['expert_width']}), {result['parameters'] / 1e6:.2f}M parameters, "
        f"{result['world']} processes on {result['device']}{' (bf16 autocast)' if result['bf16'] else ''}, {sizes['batch']} x {sizes['sequence']} tokens per process",
        f"{'layout':<10} {'step':>9} {'ratio to hand-written (q1-q3)':>31} {'experts/rank':>13} {'dense/rank':>11} "
        f"{'total/rank':>11}",
    ]
    peaks = any(figures["peak_bytes"] is not None for figures in result["layouts"].values())
    if peaks:
        lines[1] += f" {'peak/rank':>11}"
    for name, figures in result["layouts"].items():
        held = figures["bytes"]
        label = "hand DDP" if name == "torch" else name
        if name == "torch":
            ratio = "1 (baseline)"
        else:
            q1, _, q3 = figures["ratio_quartiles"]
            ratio = f"{figures['ratio']:.3f} ({q1:.3f}-{q3:.3f})"
        lines.append(
            f"{label:<10} {figures['ms']:>6.1f} ms {ratio:>31} {mib(held['experts']):>13} {mib(held['dense']):>11} "
            f"{mib(held['experts'] + held['dense']):>11}"
            + (f" {mib(figures['peak_bytes']):>11}" if peaks else "")
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2, help="2 or 4 on CPU; one per GPU on CUDA")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 autocast (lockstep: mixed_precision='bf16')"
    )
    parser.add_argument("--out", default=None, help="also write rank 0's figures here as JSON")
    for flag in SIZE_FLAGS:
        parser.add_argument(
            f"--{flag.replace('_', '-')}", type=int, default=None, help="the worker's default"
        )
    args = parser.parse_args()
    if args.processes < 2:
        parser.error(f"--processes {args.processes}: expert parallelism needs at least 2 processes")
    sizes = [
        item
        for flag in SIZE_FLAGS
        if getattr(args, flag) is not None
        for item in (f"--{flag.replace('_', '-')}", str(getattr(args, flag)))
    ]
    before = load_average()
    result = run_worker(
        "_expert_parallel_worker.py",
        "--blocks",
        str(args.blocks),
        "--steps",
        str(args.steps),
        "--device",
        args.device,
        *(["--bf16"] if args.bf16 else []),
        *(["--out", str(Path(args.out).resolve())] if args.out else []),
        *sizes,
        processes=args.processes,
    )
    print("\n".join(report(result)))
    print(f"load average (1 min) before / after: {before} / {load_average()}")


if __name__ == "__main__":
    main()
