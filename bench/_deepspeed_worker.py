"""Worker of deepspeed_overhead.py: hand-written deepspeed.initialize steps against lockstep DeepSpeed steps
(ZeRO-2 and ZeRO-3), and the bytes each rank holds against ``lockstep estimate-memory``."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import torch.distributed as dist
from _residual_mlp import BATCH, WIDTH, batches, make_model
from torch import nn

from lockstep import Accelerator
from lockstep.backends.deepspeed.loading import import_deepspeed
from lockstep.memory.estimate.formulas import model_state_bytes
from lockstep.utils import DeepSpeedPlugin

torch.set_num_threads(1)


def config(stage: int) -> dict:
    # The bucket sizes Accelerate's (and lockstep's) "auto" gives a model of hidden size WIDTH. DeepSpeed's own
    # defaults (5e8 elements) make ZeRO-3 allocate a 2 GiB fp32 reduce bucket per rank up front.
    buckets = {
        "reduce_bucket_size": WIDTH * WIDTH,
        "stage3_prefetch_bucket_size": int(0.9 * WIDTH * WIDTH),
        "stage3_param_persistence_threshold": 10 * WIDTH,
    }
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, **buckets},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def hand_written(deepspeed, stage: int):
    model = make_model()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config_params=config(stage)
    )

    def step(x, y) -> None:
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()

    return step


def through_lockstep(stage: int):
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config(stage)))
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(x, y) -> None:
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()

    return step


def timed(step, data, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        step(*next(data))
    return (time.perf_counter() - started) / steps


def compare(deepspeed, stage: int, blocks: int, steps: int) -> dict:
    rank = dist.get_rank()
    runs = {"torch": hand_written(deepspeed, stage), "lockstep": through_lockstep(stage)}
    data = {name: batches(rank) for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name in runs:
        timed(runs[name], data[name], 3)  # warm-up
    for block in range(blocks):  # interleaved ABBA, so both see the same machine load
        order = list(runs) if block % 2 == 0 else list(runs)[::-1]
        for name in order:
            times[name].append(timed(runs[name], data[name], steps))
    ratios = [lock / hand for lock, hand in zip(times["lockstep"], times["torch"])]
    return {
        "torch_ms": statistics.median(times["torch"]) * 1e3,
        "lockstep_ms": statistics.median(times["lockstep"]) * 1e3,
        "ratio": statistics.median(ratios),
    }


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (parameters, gradients, buffers, ...)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen and storage.nbytes():
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def held_bytes(deepspeed, stage: int) -> int:
    """What one engine holds per rank after a training step, beyond what the process held before it."""
    gc.collect()
    before = live_tensor_bytes()
    step = hand_written(deepspeed, stage)
    step(*next(batches(dist.get_rank())))
    gc.collect()
    held = live_tensor_bytes() - before
    del step
    gc.collect()
    return held


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    deepspeed = import_deepspeed(device_type="cpu", local_rank=dist.get_rank())
    result = {f"zero{stage}": compare(deepspeed, stage, args.blocks, args.steps) for stage in (2, 3)}
    parameters = sum(p.numel() for p in make_model().parameters())
    world = dist.get_world_size()
    memory = {}
    for stage in (1, 2, 3):
        estimate = sum(model_state_bytes(f"zero{stage}", "fp32", world, trainable=parameters))
        memory[f"zero{stage}"] = {"held": held_bytes(deepspeed, stage), "estimate": estimate}
    if dist.get_rank() == 0:
        print(json.dumps({**result, "memory": memory, "parameters": parameters, "world": world}))


if __name__ == "__main__":
    main()
