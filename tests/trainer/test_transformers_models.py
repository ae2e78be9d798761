"""The Trainer with a tiny BERT built from BertConfig (no download) on 2 CPU processes: DDP, gradient
checkpointing and FSDP; evaluation equals a one-process evaluation of the same weights."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep import Trainer, TrainingArguments
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
SEQ, VOCAB = 8, 64


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


def examples(count: int, seed: int) -> list[dict]:
    """Positive reviews use the upper half of the vocabulary, negative ones the lower half. The key is
    "label", as in Hugging Face datasets: the default collator renames it "labels"."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (count,), generator=generator)
    ids = torch.randint(4, VOCAB // 2, (count, SEQ), generator=generator) + labels[:, None] * (VOCAB // 2 - 2)
    return [{"input_ids": row.tolist(), "label": int(label)} for row, label in zip(ids, labels)]


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def _train(output_dir: str, options: dict, resume: bool | None = None, model_seed: int = 0) -> dict:
    """Train, evaluate and predict; a resumed run passes another ``model_seed`` so that only a real load
    of the checkpoint reaches the weights of the run that wrote it. ``printed``: the main process's output."""
    settings = {
        "num_train_epochs": 6,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 8,
        "learning_rate": 1e-2,
        "logging_steps": 6,
        "save_strategy": "no",
    }
    args = TrainingArguments(output_dir=output_dir, **{**settings, **options})
    trainer = Trainer(
        tiny_bert(model_seed),
        args,
        train_dataset=examples(96, seed=1),
        eval_dataset=examples(37, seed=2),
        compute_metrics=accuracy,
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train(resume_from_checkpoint=resume)
        metrics = trainer.evaluate()
        predicted = trainer.predict(examples(37, seed=2))
    weights = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "metrics": metrics,
        "predictions": predicted.predictions,
        "losses": losses,
        "weights": weights,
        "printed": printed.getvalue(),
    }


def check_resumed_at(printed: str, folder: Path, step: int, max_steps: int) -> None:
    """The resumed run says it continued from ``folder`` at ``step``: not from scratch, not at step 0."""
    said = [line for line in printed.splitlines() if line.startswith("[train] resumed from ")]
    assert said == [f"[train] resumed from {folder} at step {step}/{max_steps}"], printed[-2000:]


def single_process_evaluation(weights: dict) -> tuple[float, float, np.ndarray]:
    model = tiny_bert()
    model.load_state_dict(weights)
    model.eval()
    data = examples(37, seed=2)
    ids = torch.tensor([e["input_ids"] for e in data])
    labels = torch.tensor([e["label"] for e in data])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    return loss, (logits.argmax(-1) == labels).float().mean().item(), logits.numpy()


def _check_against_one_process(result: dict) -> None:
    assert result["losses"][-1] < 0.8 * result["losses"][0], result["losses"]
    loss, acc, logits = single_process_evaluation(result["weights"])
    assert result["metrics"]["eval_accuracy"] == pytest.approx(acc, abs=1e-6) and acc > 0.9
    assert result["metrics"]["eval_loss"] == pytest.approx(loss, abs=1e-5)
    assert result["predictions"].shape == (37, 2)  # one row per example, in dataset order
    np.testing.assert_allclose(result["predictions"], logits, atol=1e-5)


@pytest.mark.slow
def test_tiny_bert_ddp_and_gradient_checkpointing(tmp_path):
    plain, _ = run_distributed(_train, 2, str(tmp_path / "ddp"), {}, timeout=240, env=QUIET)
    _check_against_one_process(plain)
    checkpointed, _ = run_distributed(
        _train, 2, str(tmp_path / "gc"), {"gradient_checkpointing": True}, timeout=240, env=QUIET
    )
    _check_against_one_process(checkpointed)
    for name, value in plain["weights"].items():  # recomputing activations changes no number
        torch.testing.assert_close(checkpointed["weights"][name], value, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_tiny_bert_fsdp_trains_evaluates_and_resumes_exactly(tmp_path):
    options = {"fsdp": "full_shard auto_wrap", "save_strategy": "steps", "save_steps": 16}
    result, _ = run_distributed(_train, 2, str(tmp_path / "full"), options, timeout=240, env=QUIET)
    _check_against_one_process(result)
    shutil.copytree(
        tmp_path / "full" / "checkpoint-16", tmp_path / "resumed" / "checkpoint-16"
    )  # mid-epoch 3
    resumed, _ = run_distributed(
        _train, 2, str(tmp_path / "resumed"), options, True, 1, timeout=240, env=QUIET
    )  # other initial weights (model seed 1): only a real load reaches the uninterrupted run's weights
    check_resumed_at(resumed["printed"], tmp_path / "resumed" / "checkpoint-16", 16, 36)
    for name, value in result["weights"].items():  # sharded checkpoint, every rank's data position and RNGs
        assert torch.equal(resumed["weights"][name], value), name
    assert resumed["metrics"]["eval_loss"] == result["metrics"]["eval_loss"]
