"""Pure parts of the Trainer: collation, column removal, loss and label handling, weight-decay groups,
log lines, callbacks' flow, the progress bar."""

import pytest
import torch
from torch import nn

from lockstep import TrainingArguments
from lockstep.progress import ProgressBar
from lockstep.trainer._logging import format_log_line
from lockstep.trainer.batches import compute_loss, default_data_collator, make_collator, predictions_of
from lockstep.trainer.callbacks import DefaultFlowCallback, TrainerControl, TrainerState
from lockstep.trainer.optimizers import create_optimizer, decay_parameter_names


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(self.norm(self.embed(input_ids).mean(1)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def test_default_collator_stacks_dicts_and_renames_label():
    batch = default_data_collator([{"input_ids": [1, 2], "label": 0}, {"input_ids": [3, 4], "label": 1}])
    assert batch["input_ids"].tolist() == [[1, 2], [3, 4]] and batch["labels"].tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"Cannot stack the values of 'input_ids'.*DataCollatorWithPadding"):
        default_data_collator([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    x, y = default_data_collator([(torch.ones(2), torch.tensor(1.0))] * 3)
    assert x.shape == (3, 2) and y.shape == (3,)


def test_columns_the_model_cannot_take_are_removed_before_collation():
    collate = make_collator(Classifier(), None, remove_unused_columns=True, label_names=["labels"])
    batch = collate(
        [{"input_ids": [1, 2], "label": 1, "text": "good"}, {"input_ids": [3, 4], "label": 0, "text": "x"}]
    )
    assert sorted(batch) == ["input_ids", "labels"]
    keep_all = make_collator(Classifier(), None, remove_unused_columns=False, label_names=["labels"])
    assert "text" in keep_all([{"input_ids": [1], "text": "good"}])


def test_loss_comes_from_the_outputs_or_from_compute_loss_func():
    model, batch = Classifier(), {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([1])}
    loss, outputs, labels = compute_loss(model, batch, label_names=["labels"], compute_loss_func=None)
    assert loss is outputs["loss"] and labels.tolist() == [1]
    seen = {}

    def custom(outputs, labels, num_items_in_batch):
        seen.update(keys=sorted(outputs), items=num_items_in_batch)
        return outputs["logits"].sum()

    compute_loss(model, batch, label_names=["labels"], compute_loss_func=custom)
    assert seen == {"keys": ["logits"], "items": 1}  # labels were taken out of the model's inputs
    with pytest.raises(ValueError, match=r"The model returned no loss \(outputs: \['logits'\]\)"):
        compute_loss(
            model, {"input_ids": torch.tensor([[1]])}, label_names=["labels"], compute_loss_func=None
        )
    with pytest.raises(
        ValueError, match=r"compute_loss_func needs labels, but the batch has none of \['labels'\]"
    ):
        compute_loss(
            model, {"input_ids": torch.tensor([[1]])}, label_names=["labels"], compute_loss_func=custom
        )
    assert predictions_of({"loss": torch.tensor(1.0), "logits": torch.ones(2)}).tolist() == [1.0, 1.0]


def test_weight_decay_skips_biases_and_normalization_layers():
    model = Classifier()
    assert decay_parameter_names(model) == ["embed.weight", "head.weight"]
    optimizer = create_optimizer(model, TrainingArguments(weight_decay=0.1, learning_rate=1e-3))
    assert isinstance(optimizer, torch.optim.AdamW)
    assert [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups] == [(2, 0.1), (3, 0.0)]
    assert optimizer.param_groups[0]["lr"] == 1e-3


def test_log_lines():
    where = {"epoch": 1, "num_epochs": 1, "step": 1, "max_steps": 144}
    line = format_log_line({"loss": 1.7951694, "learning_rate": 2.99e-05, "grad_norm": 3.0}, **where)
    assert line == "[train] epoch 1/1 step 1/144 loss 1.795169 lr 2.99e-05"
    metrics = {"eval_loss": 0.41, "eval_accuracy": 0.8125, "eval_runtime": 3.2, "epoch": 1.0}
    assert format_log_line(metrics, **where) == "[eval] epoch 1/1 step 1/144 loss 0.41 accuracy 0.8125"


def test_default_flow_follows_the_strategies():
    args = TrainingArguments(logging_steps=2, save_steps=3, eval_strategy="steps", eval_steps=0.5)
    state, flow = TrainerState(max_steps=6), DefaultFlowCallback()
    seen = []
    for step in range(1, 7):
        state.global_step, control = step, TrainerControl()
        flow.on_step_end(args, state, control)
        seen.append((control.should_log, control.should_evaluate, control.should_save))
    assert seen == [
        (False, False, False),
        (True, False, False),
        (False, True, True),
        (True, False, False),
        (False, False, False),
        (True, True, True),
    ]
    assert control.should_training_stop is True


def test_progress_bar_shows_samples_per_second_and_can_be_switched_off(capsys, monkeypatch):
    bar = ProgressBar(3, enabled=True, description="train")
    bar.update(1, samples=64)
    bar.write("[train] a line")
    bar.close()
    captured = capsys.readouterr()
    assert "train:" in captured.err and "samples/s=" in captured.err
    assert captured.out == "[train] a line\n"
    monkeypatch.setenv("LOCKSTEP_DISABLE_PROGRESS_BARS", "1")
    quiet = ProgressBar(3, enabled=True)
    quiet.update(1, samples=64)
    quiet.close()
    assert capsys.readouterr().err == ""
    silent = ProgressBar(3, enabled=False)  # e.g. ranks other than the main process, or disable_tqdm
    silent.update(1, samples=64)
    assert capsys.readouterr().err == ""


class Counting(torch.utils.data.IterableDataset):
    def __iter__(self):
        for i in range(1000):
            yield torch.tensor([float(i % 7)]), torch.tensor([1.0])


def test_iterable_datasets_need_max_steps_and_train_for_exactly_that_many(tmp_path):
    from lockstep import Trainer

    def mse(outputs, labels, num_items_in_batch=None):
        return nn.functional.mse_loss(outputs, labels)

    args = TrainingArguments(output_dir=str(tmp_path), save_strategy="no", disable_tqdm=True)
    trainer = Trainer(nn.Linear(1, 1), args, train_dataset=Counting(), compute_loss_func=mse)
    with pytest.raises(
        ValueError, match=r"no length \(an iterable dataset\).*set TrainingArguments\(max_steps"
    ):
        trainer.train()
    args = TrainingArguments(output_dir=str(tmp_path), save_strategy="no", disable_tqdm=True, max_steps=5)
    result = Trainer(nn.Linear(1, 1), args, train_dataset=Counting(), compute_loss_func=mse).train()
    assert result.global_step == 5 and result.metrics["train_loss"] > 0


def test_rotation_keeps_the_newest_checkpoints_and_the_one_just_saved(tmp_path):
    from lockstep.trainer._checkpoint_folders import rotate_checkpoints, sorted_checkpoints

    for step in (10, 2, 30, 20):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-final").mkdir()  # not a checkpoint-<step> folder: never touched
    assert [p.name for p in sorted_checkpoints(str(tmp_path))] == [f"checkpoint-{s}" for s in (2, 10, 20, 30)]
    removed = rotate_checkpoints(str(tmp_path), 2, keep=tmp_path / "checkpoint-30")
    assert [p.name for p in removed] == ["checkpoint-2", "checkpoint-10"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-20",
        "checkpoint-30",
        "checkpoint-final",
    ]
    assert rotate_checkpoints(str(tmp_path), None, keep=tmp_path / "checkpoint-30") == []
