"""Worker of pipeline_vs_data_parallel.py: one configuration (one process, DDP, or a pipeline) timed and
measured on this rank; rank 0 prints every rank's figures as one JSON line."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lockstep import Accelerator, ParallelismConfig
from lockstep.config.pipeline import TorchPipelineParallelConfig
from lockstep.memory.accounting import account_memory

torch.set_num_threads(1)
WIDTH, DEPTH, GLOBAL_BATCH = 256, 12, 32


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ActivationMeter:
    """The peak bytes of tensors autograd saves for backward (activations), parameters left out."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.live = self.peak = 0

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        meter = self

        class Held:
            def __init__(self, tensor: torch.Tensor) -> None:
                self.tensor = tensor
                counted = tensor.untyped_storage().data_ptr() not in meter.parameter_storages
                self.size = tensor.untyped_storage().nbytes() if counted else 0
                meter.live += self.size
                meter.peak = max(meter.peak, meter.live)

            def __del__(self) -> None:
                meter.live -= self.size

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor)


def batches(replica: int, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(replica)
    while True:
        yield torch.randn(size, WIDTH, generator=generator), torch.randn(size, 1, generator=generator)


def build(mode: str, schedule: str, microbatches: int) -> tuple[Accelerator, nn.Module, int]:
    if mode == "pp":
        handler = TorchPipelineParallelConfig(
            schedule=schedule,
            num_microbatches=microbatches,
            example_args=(torch.zeros(GLOBAL_BATCH, WIDTH),),
            loss_fn=nn.functional.mse_loss,
        )
        accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_handler=handler))
        return accelerator, Model(), GLOBAL_BATCH
    accelerator = Accelerator()  # one process, or DDP on several
    return accelerator, Model(), GLOBAL_BATCH // accelerator.num_processes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("single", "ddp", "pp"), required=True)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator, model, per_replica = build(args.mode, args.schedule, args.microbatches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = batches(0 if args.mode == "pp" else accelerator.process_index, per_replica)
    meter = ActivationMeter(list(model.parameters()))

    def step() -> None:
        x, y = next(data)
        with meter.context():
            if args.mode == "pp":
                accelerator.pipeline_step(model, x, target=y)
            else:
                accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep gradients allocated: counted as held memory

    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        accelerator.wait_for_everyone()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    account = account_memory(model, optimizer)
    mine = {
        "step_ms": statistics.median(times) * 1e3,
        "model_state_bytes": account.model_state_bytes,
        "activation_peak_bytes": meter.peak,
        "parameters": account.num_parameters,
    }
    ranks = [mine]
    if accelerator.use_distributed:
        ranks = [None] * accelerator.num_processes
        dist.all_gather_object(ranks, mine)
    if accelerator.is_main_process:
        print(json.dumps({"ranks": ranks}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
