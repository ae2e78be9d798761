"""The Trainer fed real Hugging Face ``datasets`` objects: a map-style ``Dataset`` (python values, torch and
NumPy formats, a tokenizer's ``.map`` output) trains to the same weights as the same data in a torch
dataset on 2 processes; evaluation is complete and ordered; an ``IterableDataset`` honours ``max_steps``;
wrong inputs get clear errors."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep import Trainer, TrainingArguments
from tests.helpers.multiprocess import run_distributed

datasets = pytest.importorskip("datasets")

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
SEED = 1234


class Regressor(nn.Module):
    """A transformers-style model: ``forward(x, labels=None)`` returns the logits and, with labels, the loss.
    It records the first feature of every example it sees (the examples' ids in these tests)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        if self.training:
            self.seen += x[:, 0].tolist()
        logits = self.net(x).squeeze(-1)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.mse_loss(logits, labels)
        return out


def columns(length: int) -> dict[str, list]:
    """Features ``[id, a, b]``, a float ``label`` and two columns the model's forward does not take."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(length, 3, generator=generator)
    x[:, 0] = torch.arange(float(length))
    y = x[:, 1] - 0.5 * x[:, 2] + 0.01 * x[:, 0]
    return {
        "x": x.tolist(),
        "label": y.tolist(),
        "text": [f"example {i}" for i in range(length)],
        "idx": list(range(length)),
    }


class TorchRows(Dataset):
    """The same examples as a plain torch dataset of dicts."""

    def __init__(self, length: int) -> None:
        data = columns(length)
        self.x, self.y = torch.tensor(data["x"]), torch.tensor(data["label"])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> dict:
        return {"x": self.x[index], "labels": self.y[index]}


def _args(output_dir: str, **options) -> TrainingArguments:
    settings = {
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "optim": "sgd",
        "learning_rate": 0.05,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": SEED,
    }
    return TrainingArguments(output_dir=output_dir, **{**settings, **options})


def _trained_weights(output_dir: str, dataset) -> tuple[torch.Tensor, list[str] | None]:
    trainer = Trainer(Regressor(), _args(output_dir, num_train_epochs=2), train_dataset=dataset)
    kept = getattr(trainer.get_train_dataloader().dataset, "column_names", None)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    weights = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    return weights, kept


def _parity_run(output_dir: str) -> dict:
    table = datasets.Dataset.from_dict(columns(40))
    variants = {
        "torch dataset": TorchRows(40),
        "datasets, python values": table,
        "datasets, set_format('torch')": table.with_format("torch"),
        "datasets, set_format('numpy')": table.with_format("numpy"),
    }
    return {
        name: _trained_weights(f"{output_dir}/{i}", data) for i, (name, data) in enumerate(variants.items())
    }


@pytest.mark.distributed
def test_a_datasets_dataset_trains_to_the_weights_of_the_same_torch_dataset_on_two_processes(tmp_path):
    rank0, rank1 = run_distributed(_parity_run, 2, str(tmp_path), env=QUIET)
    expected, _ = rank0.pop("torch dataset")
    untrained = torch.cat([p.detach().reshape(-1) for p in Regressor().parameters()])
    assert not torch.allclose(expected, untrained, atol=1e-3)  # 40 examples, 2 epochs: the weights moved
    for name, (weights, kept) in rank0.items():
        assert torch.equal(weights, expected), name  # same examples, same order, same float32 values
        assert torch.equal(rank1[name][0], weights), name
        assert kept == ["x", "label"], name  # text and idx were removed from the dataset before loading


class Scale(nn.Module):
    """Returns its input times one weight, so the predictions show which examples were evaluated."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def mse(outputs, labels, num_items_in_batch=None):
    return nn.functional.mse_loss(outputs, labels)


def _evaluation_run(output_dir: str) -> dict:
    rows = 21  # 6 batches of 4 over 2 processes: the last global batch is uneven
    table = datasets.Dataset.from_dict(
        {"x": [float(i) for i in range(rows)], "label": [2.0 * i for i in range(rows)], "note": ["n"] * rows}
    ).with_format("torch")
    trainer = Trainer(Scale(), _args(output_dir), eval_dataset=table, compute_loss_func=mse)
    with contextlib.redirect_stdout(io.StringIO()):
        metrics = trainer.evaluate()
        mapped = trainer.predict(table)
        streamed = trainer.predict(table.to_iterable_dataset())
    return {"metrics": metrics, "mapped": mapped, "streamed": streamed}


@pytest.mark.distributed
def test_evaluation_of_datasets_objects_is_complete_and_in_order(tmp_path):
    rank0, rank1 = run_distributed(_evaluation_run, 2, str(tmp_path), env=QUIET)
    single_process_loss = float(torch.mean(torch.arange(21.0) ** 2))  # mse(x, 2x) over every example once
    for result in (rank0, rank1):
        assert result["metrics"]["eval_loss"] == pytest.approx(single_process_loss, rel=1e-6)
        for output in (result["mapped"], result["streamed"]):
            assert output.predictions.tolist() == [float(i) for i in range(21)]
            assert output.label_ids.tolist() == [2.0 * i for i in range(21)]
            assert output.metrics["test_loss"] == pytest.approx(single_process_loss, rel=1e-6)


def _iterable_run(output_dir: str) -> dict:
    stream = datasets.Dataset.from_dict(columns(20)).to_iterable_dataset(num_shards=2)
    stream = stream.shuffle(seed=7, buffer_size=64).with_format("torch")
    trainer = Trainer(
        Regressor(), _args(output_dir, max_steps=7, per_device_train_batch_size=2), train_dataset=stream
    )
    with contextlib.redirect_stdout(io.StringIO()):
        result = trainer.train()
    return {"step": result.global_step, "seen": [int(i) for i in trainer.model.seen]}


@pytest.mark.distributed
def test_an_iterable_dataset_trains_for_max_steps_and_reshuffles_each_pass(tmp_path):
    rank0, rank1 = run_distributed(_iterable_run, 2, str(tmp_path), env=QUIET)
    assert rank0["step"] == rank1["step"] == 7
    assert len(rank0["seen"]) == len(rank1["seen"]) == 14  # 7 steps of 2 examples on each process
    # Each global batch of 4 is read once and split: rank 0 gets its first half, rank 1 the second.
    stream = [
        i for s in range(7) for i in (*rank0["seen"][2 * s : 2 * s + 2], *rank1["seen"][2 * s : 2 * s + 2])
    ]
    first_pass, second_pass = stream[:20], stream[20:]
    assert sorted(first_pass) == list(range(20))  # every example once per pass, none twice
    assert len(set(second_pass)) == 8 and second_pass != first_pass[:8]  # a new pass, in a new order


def test_a_tokenized_dataset_trains_with_a_padding_collator(tmp_path):
    transformers = pytest.importorskip("transformers")
    words = ["good", "great", "fine", "bad", "awful", "poor", "movie", "plot", "very", "the"]
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tokenizer = transformers.BertTokenizerFast(vocab=vocab)
    assert tokenizer("the movie awful")["input_ids"] == [2, 14, 11, 9, 3]  # no [UNK]: a real word vocabulary
    generator = torch.Generator().manual_seed(0)
    texts, labels = [], []
    for _ in range(64):
        label = int(torch.randint(0, 2, (), generator=generator))
        length = int(torch.randint(1, 6, (), generator=generator))
        picks = torch.randint(0, 3, (length,), generator=generator) + 3 * (1 - label)
        texts.append(" ".join(["the", "movie", *(words[int(p)] for p in picks)]))
        labels.append(label)
    raw = datasets.Dataset.from_dict({"text": texts, "label": labels})
    datasets.disable_progress_bars()
    tokenized = raw.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=12), batched=True)
    assert len({len(ids) for ids in tokenized["input_ids"]}) > 1  # ragged: padding is the collator's job
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(words) + 5,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    args = _args(str(tmp_path / "out"), optim="adamw_torch", learning_rate=5e-3, num_train_epochs=6)
    trainer = Trainer(
        transformers.BertForSequenceClassification(config),
        args,
        train_dataset=tokenized,
        eval_dataset=tokenized,
        data_collator=transformers.DataCollatorWithPadding(tokenizer),
        compute_metrics=lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())},
    )
    with contextlib.redirect_stdout(io.StringIO()):
        before = trainer.evaluate()
        trainer.train()
        after = trainer.evaluate()
    assert after["eval_loss"] < 0.5 * before["eval_loss"], (before, after)
    assert after["eval_accuracy"] == 1.0


def test_wrong_inputs_get_errors_that_say_what_to_do(tmp_path):
    args = _args(str(tmp_path))
    table = datasets.Dataset.from_dict(columns(8))
    splits = datasets.DatasetDict({"train": table, "test": table})
    with pytest.raises(
        TypeError,
        match=r"train_dataset=...\) got a DatasetDict with the splits \['train', 'test'\]: pass one split, e\.g\. dataset\['train'\]",
    ):
        Trainer(Regressor(), args, train_dataset=splits)
    with pytest.raises(
        TypeError, match=r"Trainer\(eval_dataset=...\) got a pandas DataFrame.*Dataset\.from_pandas"
    ):
        Trainer(Regressor(), args, eval_dataset=table.to_pandas())
    with pytest.raises(
        TypeError, match=r"got a dict \(keys \['x', 'label', 'text', 'idx'\]\).*Dataset\.from_dict"
    ):
        Trainer(Regressor(), args, train_dataset=columns(8))
    with pytest.raises(TypeError, match=r"got a generator, which is neither map-style.*from_generator"):
        Trainer(Regressor(), args, train_dataset=(row for row in range(3)))
    with pytest.raises(ValueError, match=r"formatted as 'pandas'.*with_format\('torch'\)"):
        Trainer(Regressor(), args, train_dataset=table.with_format("pandas"))

    trainer = Trainer(Regressor(), args, train_dataset=table.select_columns(["text", "idx"]))
    with pytest.raises(
        ValueError,
        match=r"Trainer\(train_dataset=...\): none of the dataset's columns \['text', 'idx'\] is an argument "
        r"of the model's forward or a label name \(accepted: \['label', 'label_ids', 'labels', 'x'\]\)",
    ):
        trainer.train()
    trainer = Trainer(Regressor(), args, train_dataset=table.to_iterable_dataset())
    with pytest.raises(ValueError, match=r"no length \(an iterable dataset\).*TrainingArguments\(max_steps"):
        trainer.train()
    trainer = Trainer(Regressor(), args, eval_dataset=table)
    with pytest.raises(TypeError, match=r"Trainer\.predict\(test_dataset=...\) got a DatasetDict"):
        trainer.predict(splits)


def test_importing_lockstep_does_not_import_datasets():
    code = "import sys, lockstep, lockstep.trainer.trainer; print('datasets' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
