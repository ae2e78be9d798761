"""Issue 32, item 2: transformers' public TrainingArguments and Trainer methods that scripts call, on one
process, and Trainer subclasses written as transformers' examples write them (trainer_qa.py)."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep import Trainer, TrainingArguments

VOCAB, CLASSES = 12, 4


class Tokens(Dataset):
    def __init__(self, length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, VOCAB, (length, 5), generator=generator)
        self.labels = self.ids[:, 0] % CLASSES

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, input_ids, labels=None) -> dict:
        logits = self.head(self.embed(input_ids).mean(1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


class FakeTokenizer:
    def save_pretrained(self, folder: str) -> None:
        with open(f"{folder}/tokenizer_config.json", "w") as f:
            json.dump({"kind": "fake"}, f)


def _args(tmp_path, **options) -> TrainingArguments:
    values = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=0.1)
    values.update(dict(save_strategy="no", logging_strategy="no", disable_tqdm=True, report_to="none"))
    return TrainingArguments(**{**values, **options})


def _accuracy(prediction) -> dict:
    logits = prediction.predictions
    predicted = logits.argmax(-1) if logits.ndim > 1 else logits
    return {"accuracy": float((predicted == prediction.label_ids).mean())}


# -- TrainingArguments ------------------------------------------------------------------------------
def test_arguments_process_properties_on_one_process(tmp_path):
    args = _args(tmp_path, log_level="info", log_level_replica="error", per_device_eval_batch_size=3)
    assert (args.device.type, args.n_gpu, args.world_size, args.process_index, args.local_process_index) == (
        "cpu",
        0,
        1,
        0,
        0,
    )
    assert args.parallel_mode.value == "not_parallel"
    assert (args.should_log, args.should_save) == (True, True)
    assert args.get_process_log_level() == logging.INFO
    assert (args.train_batch_size, args.eval_batch_size) == (4, 3)
    assert args.ddp_timeout_delta.total_seconds() == 1800
    with args.main_process_first(local=False, desc="tokenize"):
        ran = True
    assert ran
    assert _args(tmp_path, warmup_steps=0.25).get_warmup_steps(10) == 3
    assert _args(tmp_path, warmup_steps=4).get_warmup_steps(10) == 4


def test_arguments_serialize_as_transformers_does(tmp_path):
    args = _args(tmp_path, accelerator_config={"even_batches": False})
    as_dict = args.to_dict()
    assert as_dict["accelerator_config"]["even_batches"] is False
    assert json.loads(args.to_json_string())["learning_rate"] == 0.1
    sanitized = args.to_sanitized_dict()
    assert (sanitized["train_batch_size"], sanitized["report_to"], sanitized["output_dir"]) == (
        4,
        "[]",
        str(tmp_path),
    )
    assert all(type(value) in (bool, int, float, str) for value in sanitized.values())


def test_grouped_setters_set_their_fields_and_check_them(tmp_path):
    args = _args(tmp_path)
    assert args.set_training(learning_rate=1e-4, batch_size=32, num_epochs=2) is args
    assert (args.learning_rate, args.per_device_train_batch_size, args.num_train_epochs, args.do_train) == (
        1e-4,
        32,
        2,
        True,
    )
    args.set_evaluate(strategy="steps", steps=100).set_save(strategy="steps", steps=200, total_limit=2)
    assert (args.eval_strategy, args.eval_steps, args.do_eval, args.save_total_limit) == (
        "steps",
        100,
        True,
        2,
    )
    args.set_optimizer(name="sgd", learning_rate=0.5, args="momentum=0.9").set_lr_scheduler(name="cosine")
    assert (args.optim, args.learning_rate, args.optim_args, args.lr_scheduler_type) == (
        "sgd",
        0.5,
        "momentum=0.9",
        "cosine",
    )
    args.set_logging(strategy="epoch", level="info").set_dataloader(train_batch_size=16, eval_batch_size=64)
    assert (args.logging_strategy, args.log_level, args.per_device_eval_batch_size) == ("epoch", "info", 64)
    assert args.set_testing(batch_size=8).do_predict is True
    with pytest.raises(ValueError, match=r"set_evaluate\(strategy='steps', steps=0\) is invalid"):
        args.set_evaluate(strategy="steps", steps=0)
    with pytest.raises(ValueError, match=r"lr_scheduler_type='nope'"):
        args.set_lr_scheduler(name="nope")
    assert args.lr_scheduler_type == "cosine"  # a refused setter leaves the arguments as they were
    with pytest.raises(NotImplementedError, match=r"push_to_hub=True\) is not built in lockstep"):
        args.set_push_to_hub("me/model")


def test_a_setter_keeps_every_other_field_as_it_was():
    """A setter rebuilds the arguments to check them: every field's value survives the rebuild unchanged."""
    import dataclasses

    from lockstep.trainer._field_status import _NOT_BUILT
    from tests.trainer.hf_parser_check import NEEDS, sample

    changed = {}
    for f in dataclasses.fields(TrainingArguments):
        if f.name in _NOT_BUILT:
            continue
        args = TrainingArguments(**{**NEEDS.get(f.name, {}), f.name: sample(f)[1]})
        before = args.to_dict()
        after = args.set_testing(
            batch_size=args.per_device_eval_batch_size, loss_only=args.prediction_loss_only
        )
        after = after.to_dict()
        changed.update(
            {name: (before[name], after[name]) for name in before if repr(before[name]) != repr(after[name])}
        )
    assert changed == {"do_predict": (False, True)}


# -- Trainer ------------------------------------------------------------------------------------------
def test_metrics_state_and_model_card_are_written_as_transformers_writes_them(tmp_path, capsys):
    trainer = Trainer(Model(), _args(tmp_path), train_dataset=Tokens(16), eval_dataset=Tokens(8))
    metrics = trainer.train().metrics
    assert (trainer.is_world_process_zero(), trainer.is_local_process_zero()) == (True, True)
    capsys.readouterr()
    trainer.log_metrics("train", {"train_runtime": 61.5, "train_loss": 0.123456, "epoch": 1.0})
    assert capsys.readouterr().out.splitlines() == [
        "***** train metrics *****",
        "  epoch         =        1.0",
        "  train_loss    =     0.1235",
        "  train_runtime = 0:01:01.50",
    ]
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_loss": 0.5})
    assert json.loads((tmp_path / "train_results.json").read_text()) == metrics
    assert json.loads((tmp_path / "all_results.json").read_text()) == {**metrics, "eval_loss": 0.5}
    trainer.save_state()
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert (state["global_step"], state["max_steps"]) == (4, 4)
    # train() and evaluate() return the epoch with the metrics, as transformers' log() adds it to them
    assert metrics["epoch"] == 1.0
    assert trainer.evaluate()["epoch"] == 1.0
    trainer.create_model_card(model_name="tiny", dataset="toy", tags="test", license="apache-2.0")
    card = (tmp_path / "README.md").read_text()
    assert card.startswith(
        "---\nlibrary_name: transformers\nlicense: apache-2.0\ntags:\n- generated_from_trainer\n"
    )
    assert "# tiny\n" in card and "| eval_loss |" in card and "- learning_rate: 0.1\n" in card
    with pytest.raises(
        NotImplementedError, match=r"push_to_hub\(commit_message='End of training'\) is refused"
    ):
        trainer.push_to_hub()


def test_processing_class_is_saved_with_the_model_and_tokenizer_is_its_old_name(tmp_path):
    args = _args(tmp_path, save_strategy="steps", save_steps=2)
    trainer = Trainer(Model(), args, train_dataset=Tokens(16), processing_class=FakeTokenizer())
    trainer.train()
    assert (
        sorted(p.name for p in tmp_path.glob("checkpoint-*/tokenizer_config.json"))
        == ["tokenizer_config.json"] * 2
    )
    trainer.save_model(str(tmp_path / "final"))
    assert json.loads((tmp_path / "final" / "tokenizer_config.json").read_text()) == {"kind": "fake"}
    tokenizer = FakeTokenizer()
    assert Trainer(Model(), _args(tmp_path), tokenizer=tokenizer).processing_class is tokenizer
    with pytest.raises(ValueError, match=r"got two different objects: tokenizer is transformers 4's name"):
        Trainer(Model(), _args(tmp_path), tokenizer=tokenizer, processing_class=FakeTokenizer())


def test_optimizer_accessors_and_dataloaders(tmp_path):
    trainer = Trainer(Model(), _args(tmp_path, weight_decay=0.1), train_dataset=Tokens(16))
    with pytest.raises(ValueError, match="no optimizer yet"):
        trainer.get_learning_rates()
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    assert trainer.get_learning_rates() == [0.1, 0.1]
    assert trainer.get_optimizer_group("head.bias")["weight_decay"] == 0.0
    assert trainer.get_decay_parameter_names(trainer.model) == ["embed.weight", "head.weight"]
    assert trainer.get_num_trainable_parameters() == VOCAB * 8 + 8 * CLASSES + CLASSES
    assert trainer.get_total_train_batch_size(trainer.args) == 4
    assert (trainer.get_tp_size(), trainer.get_cp_size(), trainer.get_sp_size()) == (1, 1, 1)
    loader = trainer.get_test_dataloader(Tokens(6))
    assert trainer.num_examples(loader) == 6


class CountingTrainer(Trainer):
    """Overrides the steps transformers' examples override: the loop must call them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = {"compute_loss": 0, "training_step": 0, "prediction_step": 0}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls["compute_loss"] += 1
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = nn.functional.cross_entropy(outputs["logits"], labels, reduction="sum") / labels.numel()
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.calls["training_step"] += 1
        return super().training_step(model, inputs, num_items_in_batch)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.args.learning_rate)
        return self.optimizer

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.calls["prediction_step"] += 1
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        return loss, logits.argmax(-1), labels  # predictions as class ids


def test_overridden_steps_and_optimizer_are_the_ones_used(tmp_path):
    args = _args(tmp_path, gradient_accumulation_steps=2, per_device_eval_batch_size=4)
    trainer = CountingTrainer(
        Model(), args, train_dataset=Tokens(32), eval_dataset=Tokens(10), compute_metrics=_accuracy
    )
    trainer.train()
    assert trainer.calls == {"compute_loss": 8, "training_step": 8, "prediction_step": 0}
    assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), torch.optim.SGD)
    metrics = trainer.evaluate()
    assert trainer.calls["prediction_step"] == 3  # 10 examples in batches of 4
    assert trainer.calls["compute_loss"] == 8 + 3  # the evaluation loss comes from the override too
    output = trainer.predict(Tokens(10))
    assert output.predictions.shape == (10,) and output.predictions.dtype == np.int64
    assert metrics["eval_accuracy"] == pytest.approx(_accuracy(output)["accuracy"])


class PostProcessingTrainer(Trainer):
    """transformers' examples/pytorch/question-answering/trainer_qa.py, reduced to its calls."""

    def __init__(self, *args, post_process_function=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.post_process_function = post_process_function

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        eval_dataloader = self.get_eval_dataloader(eval_dataset)
        compute_metrics = self.compute_metrics
        self.compute_metrics = None
        start_time = time.time()
        try:
            output = self.evaluation_loop(
                eval_dataloader,
                description="Evaluation",
                prediction_loss_only=True if compute_metrics is None else None,
                ignore_keys=ignore_keys,
                metric_key_prefix=metric_key_prefix,
            )
        finally:
            self.compute_metrics = compute_metrics
        output.metrics[f"{metric_key_prefix}_runtime"] = round(time.time() - start_time, 4)
        if (
            self.post_process_function is not None
            and self.compute_metrics is not None
            and self.args.should_save
        ):
            eval_preds = self.post_process_function(eval_dataset, output.predictions)
            metrics = self.compute_metrics(eval_preds)
            for key in list(metrics.keys()):
                if not key.startswith(f"{metric_key_prefix}_"):
                    metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
            metrics.update(output.metrics)
        else:
            metrics = output.metrics
        if self.args.should_log:
            self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


def test_a_subclass_evaluating_with_a_post_processing_function(tmp_path):
    from lockstep.trainer import EvalPrediction

    def post_process(dataset, predictions):
        assert predictions.shape == (len(dataset), CLASSES)
        return EvalPrediction(predictions=predictions.argmax(-1), label_ids=dataset.labels.numpy())

    trainer = PostProcessingTrainer(
        Model(),
        _args(tmp_path, per_device_eval_batch_size=4),
        train_dataset=Tokens(16),
        eval_dataset=Tokens(10),
        compute_metrics=_accuracy,
        post_process_function=post_process,
    )
    trainer.train()
    metrics = trainer.evaluate()
    plain = Trainer.evaluate(trainer)
    assert metrics["eval_accuracy"] == pytest.approx(plain["eval_accuracy"])
    assert metrics["eval_loss"] == pytest.approx(plain["eval_loss"])
    assert trainer.state.log_history[-2]["eval_accuracy"] == metrics["eval_accuracy"]
    output = trainer.evaluation_loop(trainer.get_eval_dataloader(), "Evaluation", ignore_keys=["loss"])
    assert output.num_samples == 10 and output.predictions.shape == (10, CLASSES)


def test_preprocess_logits_for_metrics_runs_on_each_batch_before_gathering(tmp_path):
    seen = []

    def argmax(logits, labels):
        seen.append(tuple(logits.shape))
        return logits.argmax(-1)

    trainer = Trainer(
        Model(),
        _args(tmp_path, per_device_eval_batch_size=4),
        eval_dataset=Tokens(10),
        compute_metrics=_accuracy,
        preprocess_logits_for_metrics=argmax,
    )
    output = trainer.predict(Tokens(10))
    assert seen == [(4, CLASSES), (4, CLASSES), (2, CLASSES)]
    assert output.predictions.shape == (10,)


def _process_facts(folder: str) -> dict:
    import os

    args = TrainingArguments(output_dir=folder, log_level="info", log_level_replica="error", report_to="none")
    marker = os.path.join(folder, "written_by_the_main_process")
    with args.main_process_first(local=False, desc="make the marker"):
        saw_marker = os.path.exists(marker)  # the main process runs first: the others find its file
        if args.process_index == 0:
            with open(marker, "w") as f:
                f.write("0")
    return {
        "world_size": args.world_size,
        "rank": (args.process_index, args.local_process_index),
        "mode": args.parallel_mode.value,
        "should": (args.should_log, args.should_save),
        "level": args.get_process_log_level(),
        "saw_marker": saw_marker,
        "metrics_printed_by": Trainer(Model(), args).is_world_process_zero(),
    }


def test_process_facts_and_main_process_first_on_two_processes(tmp_path):
    from tests.helpers.multiprocess import run_distributed

    first, second = run_distributed(
        _process_facts, 2, str(tmp_path), env={"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
    )
    assert first == {
        "world_size": 2,
        "rank": (0, 0),
        "mode": "distributed",
        "should": (True, True),
        "level": logging.INFO,
        "saw_marker": False,
        "metrics_printed_by": True,
    }
    replica = {"rank": (1, 1), "should": (False, False), "level": logging.ERROR, "saw_marker": True}
    assert second == {**first, **replica, "metrics_printed_by": False}


class DoubledLossTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        return (2 * loss, outputs) if return_outputs else 2 * loss


def test_an_overridden_compute_loss_is_the_evaluation_loss_too(tmp_path):
    args = _args(tmp_path, per_device_eval_batch_size=4)
    plain = Trainer(Model(), args, eval_dataset=Tokens(12)).evaluate()
    doubled = DoubledLossTrainer(Model(), args, eval_dataset=Tokens(12)).evaluate()
    assert doubled["eval_loss"] == pytest.approx(2 * plain["eval_loss"], rel=1e-6)
