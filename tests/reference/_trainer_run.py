"""One small classification run for lockstep.Trainer and transformers.Trainer alike (imports torch and
numpy only, so the reference environment can run it without pytest or lockstep)."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

FEATURES, CLASSES = 8, 3


class Blobs(Dataset):
    """Three well separated Gaussian clusters."""

    def __init__(self, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (length,), generator=generator)
        centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(99)) * 0.7
        self.x = centers[self.labels] + torch.randn(length, FEATURES, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"x": self.x[index], "labels": self.labels[index]}


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def accuracy(prediction: Any) -> dict:
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}


SETTINGS = {
    "num_train_epochs": 3,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 50,
    "learning_rate": 0.01,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 0.1,
    "weight_decay": 0.01,
    "logging_steps": 1,
    "eval_strategy": "epoch",
    "save_strategy": "no",
    "seed": 0,
    "report_to": "none",
    "use_cpu": True,
    "disable_tqdm": True,
}


def run(trainer_cls: Any, args_cls: Any, output_dir: str) -> dict[str, Any]:
    """Train 3 epochs; the learning rate logged at each step, the losses and the final evaluation."""
    args = args_cls(output_dir=output_dir, **SETTINGS)
    trainer = trainer_cls(
        model=Classifier(),
        args=args,
        train_dataset=Blobs(480, seed=1),
        eval_dataset=Blobs(200, seed=2),
        compute_metrics=accuracy,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    history = trainer.state.log_history
    return {
        "rates": [e["learning_rate"] for e in history if "learning_rate" in e],
        "losses": [e["loss"] for e in history if "loss" in e],
        "eval": trainer.evaluate(),
    }
