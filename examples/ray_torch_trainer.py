"""lockstep inside Ray Train: a TorchTrainer runs a lockstep loop, checkpoints go to Ray's storage path, and a
worker that dies makes Ray restart the group, which resumes from lockstep's newest checkpoint.

    pip install 'lockstep[ray]'
    python examples/ray_torch_trainer.py                     # a local Ray cluster, 2 CPU workers
    python examples/ray_torch_trainer.py --kill-worker-at 7  # worker 1 dies at step 7: Ray restarts, lockstep resumes
    python examples/ray_torch_trainer.py --address auto --num-workers 8 --use-gpu --storage-path s3://bucket/runs

Ray's TorchTrainer creates the process group (gloo on CPU, nccl on GPU) and names each worker's device;
the Accelerator made inside the training function joins that group. lockstep's checkpoints are written
to `<storage path>/<run name>/checkpoints` by `save_state` (a local folder, a shared filesystem or any
fsspec URL) and loaded by `resume_from_latest_checkpoint` when Ray restarts the workers. They are not
handed to `ray.train.report`: Ray would copy each one again and rotate its own copies, while lockstep's
own folders already are the checkpoint that the restarted group loads (the newest whose manifest
verifies).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator, ProjectConfiguration


class Progress:
    """The number of finished steps, saved and restored with every checkpoint."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"]


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    """The training function each Ray worker runs; rank 0's return value is the run's `return_value`.

    config: project_dir (the run's folder in Ray's storage), steps, save_every, seed, kill_worker_at.
    """
    torch.manual_seed(config["seed"])
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=config["project_dir"], automatic_checkpoint_naming=True, total_limit=2
        )
    )
    generator = torch.Generator().manual_seed(1)  # the same data on every worker and every attempt
    data = TensorDataset(torch.randn(64, 6, generator=generator), torch.randn(64, 1, generator=generator))
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, train_dl = accelerator.prepare(
        model, optimizer, DataLoader(data, batch_size=4, shuffle=True)
    )
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    resumed_from = accelerator.resume_from_latest_checkpoint()  # None on the first attempt
    resumed_at = progress.done
    loss = None
    accelerator.print(f"world {accelerator.num_processes}: resumed from {resumed_from} at step {resumed_at}")
    while progress.done < config["steps"]:
        for x, y in train_dl:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            progress.done += 1
            if progress.done == config["kill_worker_at"] and resumed_from is None:
                if accelerator.process_index == 1:  # a crash, not an exception: Ray restarts the group
                    os.kill(os.getpid(), signal.SIGKILL)
            if progress.done % config["save_every"] == 0:
                accelerator.save_state()
            if progress.done == config["steps"]:
                break
    weights = accelerator.get_state_dict(model)
    params = torch.cat([tensor.detach().float().reshape(-1) for tensor in weights.values()])
    summary = {
        "world": accelerator.num_processes,
        "device": str(accelerator.device),
        "resumed_from": resumed_from,
        "resumed_at": resumed_at,
        "loss": None if loss is None else loss.item(),
        "params": params.tolist(),
    }
    accelerator.end_training()
    return summary


def fit(
    *,
    storage_path: str,
    name: str,
    num_workers: int = 2,
    use_gpu: bool = False,
    steps: int = 12,
    save_every: int = 3,
    seed: int = 0,
    kill_worker_at: int = -1,
    train_function: Any = train_loop,
) -> dict[str, Any]:
    """Run ``train_function`` under a TorchTrainer (restarted once after a worker dies); rank 0's summary.

    Ray must be initialised already (``ray.init()``).
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if 0 < kill_worker_at <= save_every:
        raise ValueError(
            f"kill_worker_at={kill_worker_at} is too early: the restarted workers resume from the first "
            f"checkpoint (step {save_every}), so kill a worker after it, or pass a smaller save_every."
        )
    project_dir = f"{storage_path.rstrip('/')}/{name}"
    trainer = TorchTrainer(
        train_function,
        train_loop_config={
            "project_dir": project_dir,
            "steps": steps,
            "save_every": save_every,
            "seed": seed,
            "kill_worker_at": kill_worker_at,
        },
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=RunConfig(
            storage_path=storage_path, name=name, failure_config=FailureConfig(max_failures=1)
        ),
    )
    return trainer.fit().return_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="a running Ray cluster ('auto'); else a local one")
    parser.add_argument("--storage-path", default=os.path.abspath("ray_results"), help="folder or URL")
    parser.add_argument("--name", default="lockstep_ray_example")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-worker-at", type=int, default=-1, help="worker 1 dies at this step, once")
    args = parser.parse_args()

    import ray

    ray.init(address=args.address, include_dashboard=False)
    try:
        summary = fit(
            storage_path=args.storage_path,
            name=args.name,
            num_workers=args.num_workers,
            use_gpu=args.use_gpu,
            steps=args.steps,
            save_every=args.save_every,
            kill_worker_at=args.kill_worker_at,
        )
    finally:
        ray.shutdown()
    del summary["params"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
