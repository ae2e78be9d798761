"""Worker of regional_compile.py: the pipeline benchmark's 12-block model under FSDP2 (each block a unit),
eager, compiled whole or compiled per block; rank 0 prints the first step's time (the compilation), the
median step and the graphs dynamo made, as one JSON line."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _pipeline_worker import GLOBAL_BATCH, WIDTH, Model
from torch import nn
from torch._dynamo.utils import counters

from lockstep import Accelerator, FullyShardedDataParallelPlugin
from lockstep.utils import TorchDynamoPlugin

torch.set_num_threads(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("eager", "whole", "regional"), required=True)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dynamo = None
    if args.mode != "eager":
        dynamo = TorchDynamoPlugin(backend=args.backend, use_regional_compilation=args.mode == "regional")
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Layer"])
    accelerator = Accelerator(fsdp_plugin=plugin, dynamo_plugin=dynamo)
    torch.manual_seed(0)
    model = accelerator.prepare(Model())
    generator = torch.Generator().manual_seed(accelerator.process_index)
    per_rank = GLOBAL_BATCH // accelerator.num_processes
    x, y = torch.randn(per_rank, WIDTH, generator=generator), torch.randn(per_rank, 1, generator=generator)

    def step() -> float:
        accelerator.wait_for_everyone()
        started = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        return time.perf_counter() - started

    first = step()
    first_loss = nn.functional.mse_loss(model(x), y).item()  # no optimizer: the initial weights
    times = [step() for _ in range(args.steps)]
    if accelerator.is_main_process:
        print(
            json.dumps(
                {
                    "mode": args.mode,
                    "backend": args.backend if dynamo else "eager",
                    "first_step_s": first,
                    "step_ms": statistics.median(times) * 1e3,
                    "unique_graphs": counters["stats"]["unique_graphs"],
                    "loss": first_loss,
                }
            )
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
