"""Train a tiny T5 to reverse sequences with lockstep's and transformers' ``Seq2SeqTrainer``, evaluating and
predicting by generation (beam search); print each run's metrics, generated ids and final weights.

``python -m tests.trainer.seq2seq_parity_run OUTPUT_DIR [lockstep-only SETTINGS-JSON]`` runs lockstep's, then
transformers' trainer in the same process (lockstep first, so it sets up the process group under torchrun as it
would alone) and prints one JSON object per run, rank 0 only. With a second argument only lockstep runs, with
those extra ``Seq2SeqTrainingArguments`` (e.g. ``{"fsdp": "full_shard"}``). Run by
``tests/trainer/test_seq2seq.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import Any

import numpy as np
import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Dataset

VOCAB, PAD, EOS, LENGTH = 24, 0, 1, 5  # content tokens 2..23
UNEVEN = 11  # predicted on 2 processes in batches of 4: the last global batch holds 3 examples and filler
GENERATION_MAX_LENGTH = 6
"""Shorter than an answer (the decoder start, LENGTH tokens, EOS: 7 columns), so an evaluation that honours it
generates this many columns (``token_accuracy``'s ``generated_length``) and one that ignores it more."""

SETTINGS = {
    "max_steps": 16,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 4,
    "learning_rate": 0.01,
    "eval_strategy": "steps",
    "eval_steps": 8,
    "logging_steps": 8,
    "save_strategy": "no",
    "predict_with_generate": True,
    "generation_max_length": GENERATION_MAX_LENGTH,
    "generation_num_beams": 2,
    "seed": 0,
    "report_to": "none",
    "use_cpu": True,
    "disable_tqdm": True,
}


class Reverse(Dataset):
    """Sequences of LENGTH content tokens and EOS; the target is the content reversed, then EOS."""

    def __init__(self, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.content = torch.randint(2, VOCAB, (length, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.content)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row, eos = self.content[index], torch.tensor([EOS])
        return {
            "input_ids": torch.cat([row, eos]),
            "attention_mask": torch.ones(LENGTH + 1, dtype=torch.long),
            "labels": torch.cat([row.flip(0), eos]),
        }


def tiny_t5() -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
    )
    return T5ForConditionalGeneration(config)


def token_accuracy(prediction: Any) -> dict[str, float]:
    """Generated tokens equal to the target's, and whole sequences right (the decoder start token dropped);
    ``generated_length``: the columns generated, up to the last one any row holds a token in (the predictions
    are padded with PAD to 20 columns)."""
    predictions = np.asarray(prediction.predictions)
    generated = predictions[:, 1 : LENGTH + 2]
    target = np.asarray(prediction.label_ids)[:, : LENGTH + 1]
    right = generated == target
    written = np.flatnonzero((predictions != PAD).any(axis=0))
    return {
        "token_accuracy": float(right.mean()),
        "sequence_accuracy": float(right.all(axis=1).mean()),
        "generated_length": float(written[-1] + 1 if len(written) else 0),
    }


def train(which: str, output_dir: str, extra: dict[str, Any]) -> dict[str, Any]:
    import transformers

    if which == "lockstep":
        from lockstep import Seq2SeqTrainer, Seq2SeqTrainingArguments
    else:
        Seq2SeqTrainer = transformers.Seq2SeqTrainer
        Seq2SeqTrainingArguments = transformers.Seq2SeqTrainingArguments
    args = Seq2SeqTrainingArguments(output_dir=output_dir, **{**SETTINGS, **extra})
    trainer = Seq2SeqTrainer(
        model=tiny_t5(),
        args=args,
        train_dataset=Reverse(256, seed=1),
        eval_dataset=Reverse(24, seed=2),
        compute_metrics=token_accuracy,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
        predicted = trainer.predict(Reverse(16, seed=3), max_length=8, num_beams=1)
        uneven = trainer.predict(Reverse(UNEVEN, seed=4), max_length=8, num_beams=1)  # a last batch of filler
    evaluations = [
        {
            k: v
            for k, v in entry.items()
            if k.startswith("eval_") and "per_second" not in k and "runtime" not in k
        }
        for entry in trainer.state.log_history
        if "eval_loss" in entry
    ]
    state = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trainer.model.state_dict().items()
    }
    return {
        "which": which,
        "evaluations": evaluations,
        "predict_metrics": _scores(predicted.metrics),
        "predictions": np.asarray(predicted.predictions).tolist(),
        "uneven": {
            "metrics": _scores(uneven.metrics),
            "predictions": np.asarray(uneven.predictions).tolist(),
        },
        "by_hand": by_hand(trainer.model),
        "weights": torch.cat([value.detach().reshape(-1).float() for value in state.values()]).tolist(),
    }


def _scores(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.endswith(("accuracy", "loss"))}


def by_hand(model: Any) -> dict[str, Any]:
    """The uneven prediction set's metrics and generated ids, computed in one batch in this process alone."""
    batch = {
        key: torch.stack([row[key] for row in Reverse(UNEVEN, seed=4)]) for key in ("input_ids", "labels")
    }
    model.eval()  # lockstep's Trainer leaves the model in training mode after evaluating; transformers' does not
    fsdp = isinstance(model, FSDPModule)
    zero3 = any(hasattr(parameter, "ds_id") for parameter in model.parameters())  # DeepSpeed partitions them
    with torch.no_grad():
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        if fsdp:  # generate() calls the encoder directly: gather what the root holds, as the trainer does
            model.unshard()
        synced = fsdp or zero3  # every process steps until all are done: each forward gathers parameters
        generated = model.generate(
            input_ids=batch["input_ids"], max_length=8, num_beams=1, synced_gpus=synced
        )
        if fsdp:
            model.reshard()
    width = model.generation_config.max_length or 20  # transformers 5 leaves it unset: generate uses 20
    padded = torch.full((UNEVEN, width), PAD, dtype=generated.dtype)
    padded[:, : generated.shape[1]] = generated
    labels = torch.full((UNEVEN, width), PAD, dtype=generated.dtype)
    labels[:, : LENGTH + 1] = batch["labels"]

    class Prediction:
        predictions, label_ids = padded.numpy(), labels.numpy()

    scores = {f"test_{k}": v for k, v in token_accuracy(Prediction()).items()}
    return {"metrics": {**scores, "test_loss": float(loss)}, "predictions": padded.tolist()}


def main(output_dir: str, extra: str | None = None) -> None:
    sys.modules["datasets"] = None  # type: ignore[assignment]  # not needed; the overlays' hub cannot import it
    runs = [("lockstep", json.loads(extra))] if extra else [("lockstep", {}), ("transformers", {})]
    for which, settings in runs:
        result = train(which, os.path.join(output_dir, which), settings)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
