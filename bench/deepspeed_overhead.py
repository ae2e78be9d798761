"""DeepSpeed through lockstep against a hand-written ``deepspeed.initialize`` loop, and ZeRO's memory per rank.

Two CPU processes under torchrun train the same 4.7M-parameter model (4 residual MLP layers, AdamW) with
hand-written engine steps (``engine.backward(loss); engine.step()``) and lockstep steps
(``accelerator.backward(loss); optimizer.step(); optimizer.zero_grad()``) in interleaved blocks, under
ZeRO-2 and ZeRO-3, and print the median step-time ratio (target <= 1.02). Then each rank counts the bytes
of every tensor a ZeRO-1/2/3 engine holds after a step, against ``lockstep estimate-memory``'s figure
(the ZeRO paper's accounting, fp32 + AdamW).

    .venv/bin/python bench/deepspeed_overhead.py [--blocks 10 --steps 5]
"""

from __future__ import annotations

import argparse

from _torchrun import run_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    result = run_worker("_deepspeed_worker.py", "--blocks", str(args.blocks), "--steps", str(args.steps))
    world, parameters = result["world"], result["parameters"]
    for stage in ("zero2", "zero3"):
        timing = result[stage]
        print(
            f"{stage} step time, {world} CPU processes, {parameters / 1e6:.1f}M parameters: hand-written "
            f"{timing['torch_ms']:.1f} ms, lockstep {timing['lockstep_ms']:.1f} ms, ratio {timing['ratio']:.3f} "
            "(target <= 1.02)"
        )
    for stage, memory in result["memory"].items():
        print(
            f"{stage} bytes per rank after a step: held {memory['held'] / 2**20:.2f} MiB, estimate-memory "
            f"{memory['estimate'] / 2**20:.2f} MiB, held/estimate {memory['held'] / memory['estimate']:.3f}"
        )


if __name__ == "__main__":
    main()
