"""Train the same small classifier with transformers.Trainer or lockstep.Trainer, leaving every argument
that differs between transformers versions (``optim`` above all) at its default; prints the final weights.

``python -m tests.trainer.weights_parity_run OUTPUT_DIR`` trains with lockstep's Trainer, then with
transformers', in the same process (one interpreter start instead of two: each costs seconds of imports), and
prints one JSON object per Trainer: ``{"which": ..., "transformers": version, "optim": the default taken,
"weights": [...]}``. lockstep goes first, so it sets up the process group under torchrun as it would alone
(Accelerate, under transformers, uses a group that exists). Each run seeds torch before building its model,
so neither depends on what ran before it. Run by ``tests/trainer/test_default_parity.py`` under each
transformers it checks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import torch

from tests.reference._trainer_run import Blobs, Classifier

SETTINGS = {
    "max_steps": 12,
    "per_device_train_batch_size": 16,
    "learning_rate": 0.01,
    "weight_decay": 0.01,
    "warmup_steps": 2,
    "logging_steps": 4,
    "save_strategy": "no",
    "seed": 0,
    "report_to": "none",
    "use_cpu": True,
    "disable_tqdm": True,
}


def main(output_dir: str) -> None:
    # The transformers 4.x overlays carry their own, older huggingface_hub, which this environment's datasets
    # cannot import; neither Trainer needs datasets for a torch dataset, so it is hidden from both.
    sys.modules["datasets"] = None  # type: ignore[assignment]
    for which in ("lockstep", "transformers"):
        train(which, os.path.join(output_dir, which))


def train(which: str, output_dir: str) -> None:
    import transformers

    if which == "lockstep":
        from lockstep import Trainer, TrainingArguments
    else:
        Trainer, TrainingArguments = transformers.Trainer, transformers.TrainingArguments
    args = TrainingArguments(output_dir=output_dir, **SETTINGS)
    torch.manual_seed(0)  # the model's initial weights, whatever ran before in this process
    trainer = Trainer(model=Classifier(), args=args, train_dataset=Blobs(480, seed=1))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    weights = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    optim = getattr(args.optim, "value", args.optim)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank holds the same weights
        print(
            json.dumps(
                {
                    "which": which,
                    "transformers": transformers.__version__,
                    "optim": optim,
                    "weights": weights.tolist(),
                }
            )
        )


if __name__ == "__main__":
    main(sys.argv[1])
