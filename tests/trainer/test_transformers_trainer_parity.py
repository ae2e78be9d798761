"""Issue 16: the same model, data, seed and arguments through lockstep.Trainer and transformers.Trainer (the
reference, needing accelerate) give the same learning-rate curve at every step and final eval accuracy within
1 point, on one process."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the reference run)")

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


def accuracy(prediction) -> dict:
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


def _run(trainer_cls, args_cls, output_dir: str) -> tuple[list[float], float]:
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
    rates = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    return rates, trainer.evaluate()["eval_accuracy"]


def test_learning_rate_curve_and_accuracy_match_transformers_trainer(tmp_path):
    import lockstep

    theirs_rates, theirs_accuracy = _run(
        transformers.Trainer, transformers.TrainingArguments, str(tmp_path / "hf")
    )
    ours_rates, ours_accuracy = _run(lockstep.Trainer, lockstep.TrainingArguments, str(tmp_path / "ls"))
    print(
        f"steps {len(ours_rates)}; accuracy lockstep {ours_accuracy:.3f}, transformers {theirs_accuracy:.3f}"
    )
    assert len(ours_rates) == len(theirs_rates) == 90  # 3 epochs of 30 steps
    assert ours_rates == pytest.approx(theirs_rates, rel=1e-12, abs=1e-15)
    assert abs(ours_accuracy - theirs_accuracy) <= 0.01
