"""A training loop that survives restarts and preemption with lockstep's one-line patterns.

Usage: resumable_train.py PROJECT_DIR [--steps N] [--save-every K] [--die-at STEP] [--step-delay S] [--seed S]
    [--optimizer sgd|adamw]
Rank 0 writes PROJECT_DIR/progress (the number of finished steps) after every step, appends the step's
sample ids (every process's, without the even_batches padding) to PROJECT_DIR/ids.jsonl as
`{"step": N, "ids": [...]}` (read by tests.helpers.resume.trained_ids) and, at the end, prints `PARAMS [...]`.
With --die-at, rank 1 kills itself with SIGKILL at that step on the first attempt.
Attempt k of an elastic job seeds torch with S + k (S defaults to 0): a restarted attempt starts from other
weights, dropout masks and data order, so only a real resume reaches the weights of an uninterrupted run.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lockstep import Accelerator, ProjectConfiguration


class Progress:
    def __init__(self) -> None:
        self.done = 0

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.done = state["done"]


parser = argparse.ArgumentParser()
parser.add_argument("project_dir")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save-every", type=int, default=3)
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--step-delay", type=float, default=0.0)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
args = parser.parse_args()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
seed = args.seed + attempt
torch.manual_seed(seed)
accelerator = Accelerator(
    project_config=ProjectConfiguration(
        project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=2
    )
)
generator = torch.Generator().manual_seed(1)
samples = torch.arange(64)  # each sample's id, logged per step
data = TensorDataset(
    samples, torch.randn(64, 6, generator=generator), torch.randn(64, 1, generator=generator)
)
model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.1), nn.Tanh(), nn.Linear(16, 1))
if args.optimizer == "adamw":
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer, train_dl = accelerator.prepare(
    model, optimizer, DataLoader(data, batch_size=4, shuffle=True)
)
progress = Progress()
accelerator.register_for_checkpointing(progress)
resumed = accelerator.resume_from_latest_checkpoint()  # the one line that survives restarts
accelerator.print(f"attempt {attempt} (seed {seed}) resumed from {resumed} at step {progress.done}")
accelerator.print(f"attempt {attempt} world {accelerator.num_processes}")
plugin = accelerator.state.deepspeed_plugin
zero = f" zero {plugin.zero_stage}" if plugin is not None else ""
accelerator.print(f"attempt {attempt} distributed {accelerator.distributed_type.value}{zero}")

while progress.done < args.steps:
    for ids, x, y in train_dl:
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        progress.done += 1
        trained = accelerator.gather_for_metrics(ids).tolist()  # every rank: a collective
        time.sleep(args.step_delay)
        if accelerator.is_main_process:
            (Path(args.project_dir) / "progress").write_text(str(progress.done))
            with open(Path(args.project_dir) / "ids.jsonl", "a") as log:  # one write(): whole lines
                log.write(json.dumps({"step": progress.done, "ids": trained}) + "\n")
        if progress.done == args.die_at and accelerator.process_index == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if accelerator.should_stop:  # preemption: every rank stops at the same step
            accelerator.checkpoint_and_exit()
        if progress.done % args.save_every == 0:
            accelerator.save_state()
        if progress.done == args.steps:
            break

weights = accelerator.get_state_dict(model)  # every rank: a sharded model (ZeRO-3) gathers its weights
if accelerator.is_main_process:
    params = torch.cat([tensor.detach().float().reshape(-1) for tensor in weights.values()])
    print("PARAMS " + json.dumps(params.tolist()), flush=True)
accelerator.end_training()
