"""The Trainer with the step-veto layer (tests/plugins/step_veto.py) asked for by its ``TrainingArguments``
field, for tests/e2e/test_layer_plugin.py: ``TrainingArguments(step_veto={"veto_step": 3, "veto_report":
REPORT})``; prints one JSON line per rank with whether each step changed the weights."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn

from lockstep import Trainer, TrainerCallback, TrainingArguments


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(4, generator=torch.Generator().manual_seed(index))}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.net(x) - x.sum(1, keepdim=True)).pow(2).mean()}


class WeightsChanged(TrainerCallback):
    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.changed: list[bool] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.before = [p.detach().clone() for p in model.parameters()]

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.changed.append(any(not torch.equal(b, p) for b, p in zip(self.before, model.parameters())))


def main() -> None:
    out, report = sys.argv[1], sys.argv[2]
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        max_steps=6,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        step_veto={"veto_step": 3, "veto_report": report},
    )
    callback = WeightsChanged()
    trainer = Trainer(model=Model(), args=args, train_dataset=Samples(), callbacks=[callback])
    trainer.train()
    rank = trainer.accelerator.process_index
    print("LAYER " + json.dumps({"rank": rank, "changed": callback.changed}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
