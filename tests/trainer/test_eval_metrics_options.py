"""Issue 16 item 4: batch_eval_metrics (compute_metrics per batch, the summary on the last), include_for_metrics
(inputs and per-example losses in EvalPrediction) and eval_do_concat_batches=False (one array per batch), on one
process and on 2 real gloo processes (complete, in order, without the even_batches filler)."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep import Trainer, TrainingArguments
from tests.helpers.multiprocess import run_distributed

FEATURES, CLASSES = 4, 3
QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}


class Rows(Dataset):
    def __init__(self, length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(length, FEATURES, generator=generator)
        self.labels = torch.randint(0, CLASSES, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"x": self.x[index], "labels": self.labels[index]}


class Classifier(nn.Module):
    main_input_name = "x"

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


class BatchAccuracy:
    """A batch_eval_metrics compute_metrics: counts correct answers, returns the accuracy on the last batch."""

    def __init__(self) -> None:
        self.correct = self.total = 0
        self.calls = 0

    def __call__(self, prediction, compute_result: bool) -> dict | None:
        self.calls += 1
        self.correct += int((prediction.predictions.argmax(-1) == prediction.label_ids).sum())
        self.total += len(prediction.label_ids)
        if not compute_result:
            return None
        result = {"accuracy": self.correct / self.total, "seen": self.total}
        self.correct = self.total = 0
        return result


def accuracy(prediction) -> dict:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def _trainer(tmp_path, length: int = 10, compute_metrics=accuracy, **options) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=4, disable_tqdm=True, report_to="none", **options
    )
    return Trainer(Classifier(), args, eval_dataset=Rows(length), compute_metrics=compute_metrics)


def _evaluate(trainer: Trainer) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        return trainer.evaluate()


def test_batch_eval_metrics_gives_the_accuracy_of_the_whole_set(tmp_path):
    whole = _evaluate(_trainer(tmp_path / "a"))
    batched = BatchAccuracy()
    metrics = _evaluate(_trainer(tmp_path / "b", compute_metrics=batched, batch_eval_metrics=True))
    assert batched.calls == 3  # 10 examples in batches of 4
    assert metrics["eval_seen"] == 10
    assert metrics["eval_accuracy"] == whole["eval_accuracy"]
    assert metrics["eval_loss"] == pytest.approx(whole["eval_loss"])


def test_batch_eval_metrics_needs_a_compute_result_parameter(tmp_path):
    with pytest.raises(
        ValueError, match=r"batch_eval_metrics=True\) calls compute_metrics\(prediction, compute_result"
    ):
        _trainer(tmp_path, batch_eval_metrics=True)


def test_include_for_metrics_gives_inputs_and_per_example_losses(tmp_path):
    seen = {}

    def metrics(prediction) -> dict:
        seen["parts"] = len(list(prediction))
        seen["inputs"], seen["losses"] = prediction.inputs, prediction.losses
        return {}

    trainer = _trainer(tmp_path, compute_metrics=metrics, include_for_metrics=["inputs", "loss"])
    _evaluate(trainer)
    data = Rows(10)
    assert seen["parts"] == 4  # (predictions, label_ids, inputs, losses), as transformers unpacks it
    assert np.array_equal(seen["inputs"], data.x.numpy())
    model = trainer.model
    expected = [
        float(nn.functional.cross_entropy(model.net(data.x[i : i + 4]), data.labels[i : i + 4]).detach())
        for i in range(0, 10, 4)
    ]
    assert seen["losses"].shape == (10,)
    assert seen["losses"].tolist() == pytest.approx([expected[i // 4] for i in range(10)], rel=1e-6)


def test_eval_do_concat_batches_false_gives_one_array_per_batch(tmp_path):
    seen = {}

    def metrics(prediction) -> dict:
        seen["shapes"] = [p.shape for p in prediction.predictions]
        seen["labels"] = [len(label) for label in prediction.label_ids]
        return {}

    _evaluate(_trainer(tmp_path, compute_metrics=metrics, eval_do_concat_batches=False))
    assert seen["shapes"] == [(4, CLASSES), (4, CLASSES), (2, CLASSES)]
    assert seen["labels"] == [4, 4, 2]


def _two_processes(output_dir: str) -> dict:
    batched = BatchAccuracy()
    args = {"output_dir": output_dir, "per_device_eval_batch_size": 2, "disable_tqdm": True}
    seen = {}

    def with_inputs(prediction) -> dict:
        seen["inputs"] = prediction.inputs
        return accuracy(prediction)

    with contextlib.redirect_stdout(io.StringIO()):
        batch_metrics = Trainer(
            Classifier(),
            TrainingArguments(**args, batch_eval_metrics=True),
            eval_dataset=Rows(11),
            compute_metrics=batched,
        ).evaluate()
        whole = Trainer(
            Classifier(),
            TrainingArguments(**args, include_for_metrics=["inputs"]),
            eval_dataset=Rows(11),
            compute_metrics=with_inputs,
        ).evaluate()
    return {"batch": batch_metrics, "whole": whole, "inputs": seen["inputs"]}


@pytest.mark.distributed
def test_on_two_processes_batch_metrics_and_inputs_cover_every_example_once_in_order(tmp_path):
    results = run_distributed(_two_processes, 2, str(tmp_path), env=QUIET, timeout=120)
    for result in results:
        assert result["batch"]["eval_seen"] == 11  # the even_batches filler is not counted
        assert result["batch"]["eval_accuracy"] == result["whole"]["eval_accuracy"]
        assert np.array_equal(result["inputs"], Rows(11).x.numpy())
