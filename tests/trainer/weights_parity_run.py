"""Train the same small classifier with transformers.Trainer or lockstep.Trainer, leaving every argument
that differs between transformers versions (``optim`` above all) at its default; prints the final weights.

``python -m tests.trainer.weights_parity_run {lockstep|transformers} OUTPUT_DIR`` prints one JSON object:
``{"transformers": version, "optim": the default taken, "weights": [...]}`` on its last line. Run by
``tests/trainer/test_default_parity.py`` under each transformers it checks.
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


def main(which: str, output_dir: str) -> None:
    # The transformers 4.x overlays carry their own, older huggingface_hub, which this environment's datasets
    # cannot import; neither Trainer needs datasets for a torch dataset, so it is hidden from both.
    sys.modules["datasets"] = None  # type: ignore[assignment]
    import transformers

    if which == "lockstep":
        from lockstep import Trainer, TrainingArguments
    else:
        Trainer, TrainingArguments = transformers.Trainer, transformers.TrainingArguments
    args = TrainingArguments(output_dir=output_dir, **SETTINGS)
    trainer = Trainer(model=Classifier(), args=args, train_dataset=Blobs(480, seed=1))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    weights = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    optim = getattr(args.optim, "value", args.optim)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank holds the same weights
        print(
            json.dumps(
                {"transformers": transformers.__version__, "optim": optim, "weights": weights.tolist()}
            )
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
