"""A fault-tolerant job trained by the Trainer with the ordinary ``trainer.train()``, for
tests/e2e/test_fault_tolerance_one_history.py, run by ``lockstep launch --fault-tolerance --replica-group
all``: a plain torch model that returns ``{"loss": ...}``, 64 samples in batches of 4, EPOCHS epochs of SGD
at a constant rate.

Group 1's worker is SIGKILLed at its 6th batch in its first life (its launch restarts it: ``--max-restarts
1``); a callback appends each step's draw to ``FT_OUT/g<group>.<pid>.jsonl`` (``global_step`` after the step
and the loader's draw), and each group writes its weights to ``FT_OUT/g<group>.pt`` at the end.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import torch
from torch import nn

from lockstep import Trainer, TrainerCallback, TrainingArguments

SAMPLES, BATCH = 64, 4
EPOCHS = int(os.environ.get("FT_EPOCHS", "3"))


def inputs_of(ids: torch.Tensor) -> torch.Tensor:
    return torch.stack([torch.randn(4, generator=torch.Generator().manual_seed(int(i))) for i in ids])


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"ids": torch.tensor(index)}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.net(inputs_of(ids)).pow(2).mean()}


class DrawLog(TrainerCallback):
    """Logs each step's draw; kills group 1's first life at its 6th batch."""

    def __init__(self, out: str, group: int, kill: bool) -> None:
        self.group, self.kill, self.steps = group, kill, 0
        self.log = open(f"{out}/g{group}.{os.getpid()}.jsonl", "a")

    def on_step_end(
        self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **_: Any
    ) -> None:
        line = {"group": self.group, "pid": os.getpid(), "global_step": state.global_step}
        line.update(train_dataloader.steps.last)
        self.log.write(json.dumps(line) + "\n")
        self.log.flush()
        self.steps += 1
        if self.kill and self.steps == 6:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out = os.environ["FT_OUT"]
    group = int(os.environ["LOCKSTEP_FT_GROUP_OF_ALL"])
    kill = group == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    args = TrainingArguments(
        output_dir=f"{out}/trainer{group}",
        per_device_train_batch_size=BATCH,
        num_train_epochs=EPOCHS,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=Model(), args=args, train_dataset=Samples(), callbacks=[DrawLog(out, group, kill)]
    )
    trainer.train()
    weights = {key: value.detach().clone() for key, value in trainer.model.net.state_dict().items()}
    torch.save(weights, f"{out}/g{group}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
