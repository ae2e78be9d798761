"""A lockstep.Trainer run that a test kills and resumes on another number of processes.

Usage: trainer_resize_train.py OUTPUT_DIR LOG_DIR --attempt K [--die-at STEP] [--strategy S]
    [--accumulation A] [--keep-global-batch]

Every rank appends one line per optimizer step to LOG_DIR/attempt<K>_rank<R>.jsonl: the step and the sample
ids of each of its micro-batches (read by the model's forward, so they are what was trained on). With
--die-at, rank 1 kills itself with SIGKILL at the end of that step. Attempt K initialises the model with
seed K, so a resume that did not load the checkpoint starts from other weights. Rank 0 prints
``PARAMS [...]`` and ``STEP n`` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep import Trainer, TrainerCallback, TrainingArguments

N = 64  # samples per epoch


def features(i: int) -> torch.Tensor:
    return torch.tensor([float(i) / N, (i % 7) / 7.0, ((i * 3) % 11) / 11.0])


class Points(Dataset):
    """Sample ``i``: its id, 3 features, a target and ``input_ids`` whose length (i % 7 + 1) groups it."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "ids": i,
            "x": features(i),
            "labels": torch.tensor([(i % 5) / 5.0]),
            "input_ids": [0] * (i % 7 + 1),
        }


def collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {
        "ids": torch.tensor([e["ids"] for e in examples]),
        "x": torch.stack([e["x"] for e in examples]),
        "labels": torch.stack([e["labels"] for e in examples]),
    }


class Logged(nn.Module):
    """A linear regression whose forward records the ids it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.micro: list[list[int]] = []

    def forward(self, ids: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.micro.append(ids.tolist())
        return {"loss": nn.functional.mse_loss(self.linear(x), labels)}


class StepLog(TrainerCallback):
    """Writes each optimizer step's micro-batches; kills rank 1 at ``die_at``."""

    def __init__(self, model: Logged, path: Path, die_at: int) -> None:
        self.model, self.path, self.die_at = model, path, die_at

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        with self.path.open("a") as log:
            log.write(json.dumps({"step": state.global_step, "micro": self.model.micro}) + "\n")
        self.model.micro = []
        if state.global_step == self.die_at and int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("log_dir")
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--strategy", default="group_by_length")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--keep-global-batch", action="store_true")
    options = parser.parse_args()
    torch.manual_seed(options.attempt)  # other starting weights on each attempt
    model = Logged()
    args = TrainingArguments(
        output_dir=options.output_dir,
        num_train_epochs=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=options.accumulation,
        elastic_keep_global_batch=options.keep_global_batch,
        train_sampling_strategy=options.strategy,
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0,
        save_steps=2,
        logging_steps=100,
        seed=0,
        report_to="none",
        disable_tqdm=True,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    path = Path(options.log_dir) / f"attempt{options.attempt}_rank{os.environ['RANK']}.jsonl"
    trainer = Trainer(
        model,
        args,
        train_dataset=Points(),
        data_collator=collate,
        optimizers=(optimizer, None),
        callbacks=[StepLog(model, path, options.die_at)],
    )
    trainer.train(resume_from_checkpoint=options.attempt > 0)
    if trainer.accelerator.is_main_process:
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        print("PARAMS " + json.dumps(params.tolist()), flush=True)
        print(f"STEP {trainer.state.global_step}", flush=True)
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
