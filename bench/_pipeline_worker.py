"""Worker of pipeline_vs_data_parallel.py: one configuration (one process, DDP, FSDP, a pipeline, or a
pipeline of FSDP-sharded stages) timed and measured on this rank; rank 0 prints every rank's figures as one
JSON line."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lockstep import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
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


def _is_parameter(tensor: torch.Tensor, parameter_storages: set[int]) -> bool:
    """Whether a tensor autograd saves is a parameter (or a view of one, as ``Linear`` saves ``weight.t()``):
    one of the rank's own, or one FSDP all-gathered for the forward (a new ``nn.Parameter`` per unit)."""
    if tensor.untyped_storage().data_ptr() in parameter_storages:
        return True
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class ActivationMeter:
    """The peak bytes of the storages autograd keeps alive for backward (activations), parameters left out.

    Each storage counts once however many saved tensors share it (``relu`` and the next ``Linear`` save
    the same output; every micro-batch's input is a view of the one batch), and until its last saved
    tensor is released.
    """

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in parameters]  # FSDP: DTensor shards
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in local}
        self.held: dict[int, list[int]] = {}  # storage pointer -> [saved tensors holding it, its bytes]
        self.live = self.peak = 0

    def context(self) -> torch.autograd.graph.saved_tensors_hooks:
        meter = self

        class Held:
            def __init__(self, tensor: torch.Tensor) -> None:
                self.tensor = tensor
                self.pointer = None
                if _is_parameter(tensor, meter.parameter_storages):
                    return
                storage = tensor.untyped_storage()
                self.pointer = storage.data_ptr()
                entry = meter.held.setdefault(self.pointer, [0, storage.nbytes()])
                entry[0] += 1
                if entry[0] == 1:
                    meter.live += entry[1]
                    meter.peak = max(meter.peak, meter.live)

            def __del__(self) -> None:
                if self.pointer is None:
                    return
                entry = meter.held[self.pointer]
                entry[0] -= 1
                if entry[0] == 0:
                    meter.live -= entry[1]
                    del meter.held[self.pointer]

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor)


def batches(replica: int, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(replica)
    while True:
        yield torch.randn(size, WIDTH, generator=generator), torch.randn(size, 1, generator=generator)


def build(mode: str, schedule: str, microbatches: int, dp_shard: int) -> tuple[Accelerator, int, int]:
    """The accelerator of ``mode``, the samples each data-parallel replica reads per step, and the
    replica's index (which seeds its data)."""
    if mode == "pp":
        per_replica = GLOBAL_BATCH // dp_shard
        handler = TorchPipelineParallelConfig(
            schedule=schedule,
            num_microbatches=microbatches,
            example_args=(torch.zeros(per_replica, WIDTH),),
            loss_fn=nn.functional.mse_loss,
        )
        sizes = {"pp_size": 2} if dp_shard == 1 else {"pp_size": 2, "dp_shard_size": dp_shard}
        accelerator = Accelerator(parallelism_config=ParallelismConfig(**sizes, pp_handler=handler))
        return accelerator, per_replica, accelerator.data_parallel_shard_rank
    if mode == "fsdp":  # FSDP2, each residual block its own unit (as bench/fsdp_overhead.py)
        plugin = FullyShardedDataParallelPlugin(
            auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["Layer"]
        )
        accelerator = Accelerator(fsdp_plugin=plugin)
    else:
        accelerator = Accelerator()  # one process, or DDP on several
    return accelerator, GLOBAL_BATCH // accelerator.num_processes, accelerator.process_index


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("single", "ddp", "fsdp", "pp"), required=True)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument(
        "--dp-shard", type=int, default=1, help="pp mode: FSDP-shard each stage this many ways"
    )
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator, per_replica, replica = build(args.mode, args.schedule, args.microbatches, args.dp_shard)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = batches(replica, per_replica)
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
