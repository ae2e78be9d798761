"""``train_sampling_strategy="group_by_length"``: megabatches sorted by length, the same order on every process,
and an exact resume."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from lockstep import Trainer, TrainingArguments
from lockstep.trainer._length_grouping import LengthGroupedSampler, dataset_lengths, length_grouped_indices
from tests.helpers.multiprocess import run_distributed

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}


def test_each_megabatch_is_sorted_by_length_and_the_longest_comes_first():
    lengths = [(7 * i) % 23 + 1 for i in range(64)]
    order = length_grouped_indices(lengths, batch_size=2, generator=torch.Generator().manual_seed(0))
    assert sorted(order) == list(range(64))
    megabatch = 8 * 2  # min(64 // (2 * 4), 50) batches of 2
    assert lengths[order[0]] == max(lengths)
    for start in range(0, 64, megabatch):
        group = [lengths[i] for i in order[start : start + megabatch]]
        tail = group[1:] if start == 0 else group  # the first slot holds the swapped longest example
        assert tail == sorted(tail, reverse=True)
    sampler = LengthGroupedSampler(lengths, batch_size=2, seed=5)
    first = list(sampler)
    assert list(sampler) == first  # the same epoch draws the same order
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sampler) == sorted(first)


def test_lengths_come_from_the_column_or_the_main_input():
    class Table(list):
        column_names = ["input_ids", "length"]

        def __getitem__(self, key):
            return [3, 1] if key == "length" else list.__getitem__(self, key)

    assert dataset_lengths(Table([{}, {}]), "length", "input_ids") == [3, 1]
    examples = [{"input_ids": [1, 2]}, {"input_ids": [1]}]
    assert dataset_lengths(examples, "length", "input_ids") == [2, 1]
    with pytest.raises(ValueError, match=r"example 0 is tuple\. Add a 'length' column"):
        dataset_lengths([(1, 2)], "length", "input_ids")


class Sequences(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.lengths = [(5 * i) % 11 + 1 for i in range(48)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.full((12,), index, dtype=torch.long)
        ids[self.lengths[index] :] = 0
        return {"input_ids": ids[: self.lengths[index]], "labels": torch.tensor(float(index % 3))}


def pad(examples: list[dict]) -> dict[str, torch.Tensor]:
    ids = nn.utils.rnn.pad_sequence([e["input_ids"] for e in examples], batch_first=True)
    return {"input_ids": ids, "labels": torch.stack([e["labels"] for e in examples])}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.EmbeddingBag(48, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, input_ids, labels):
        loss = nn.functional.mse_loss(self.head(self.embed(input_ids)).squeeze(1), labels)
        return {"loss": loss}


class SeenLengths:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, examples):
        self.batches.append([len(e["input_ids"]) for e in examples])
        return pad(examples)


def _run(output_dir: str, *, max_steps: int = 6, resume=None, stop_at: int | None = None) -> dict:
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=stop_at or max_steps,
        per_device_train_batch_size=2,
        train_sampling_strategy="group_by_length",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        save_steps=3,
        report_to=[],
        disable_tqdm=True,
        seed=7,
    )
    seen = SeenLengths()
    trainer = Trainer(Model(), args, train_dataset=Sequences(), data_collator=seen)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(resume_from_checkpoint=resume)
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    return {"params": params, "batches": seen.batches}


def test_batches_group_similar_lengths_and_a_resume_is_exact(tmp_path):
    full = _run(str(tmp_path / "full"), max_steps=6)
    spread = sum(max(b) - min(b) for b in full["batches"]) / len(full["batches"])
    assert spread <= 1.0  # sorted megabatches: neighbours have (nearly) the same length (random: ~3.7)
    _run(str(tmp_path / "run"), stop_at=3)
    resumed = _run(str(tmp_path / "run"), max_steps=6, resume=True)
    assert resumed["batches"] == full["batches"][3:]
    assert torch.equal(resumed["params"], full["params"])


def _two(output_dir: str) -> list[list[int]]:
    return _run(output_dir, max_steps=4)["batches"]


@pytest.mark.distributed
def test_processes_share_one_grouped_order(tmp_path):
    rank0, rank1 = run_distributed(_two, 2, str(tmp_path), env=QUIET)
    one = _run(str(tmp_path / "one"), max_steps=8)["batches"]
    # The global order, dealt batch by batch (the loaders collate one batch ahead: compare the 4 trained on).
    assert rank0[:4] == one[0:8:2] and rank1[:4] == one[1:8:2]
    assert rank0[:4] != rank1[:4]
