"""``average_tokens_across_devices`` / ``num_items_in_batch``: a token loss normalised by the label tokens of the
whole step, so the number of processes and of accumulation micro-batches does not change the gradient."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from lockstep import Trainer, TrainingArguments
from lockstep.trainer import _num_items
from tests.helpers.multiprocess import run_distributed

VOCAB, LENGTH, EXAMPLES = 7, 6, 16
QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}


class TokenDataset(torch.utils.data.Dataset):
    """Sequences whose labels are -100 (padding) after an example-dependent length: uneven token counts."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, VOCAB, (EXAMPLES, LENGTH), generator=generator)
        self.labels = torch.randint(0, VOCAB, (EXAMPLES, LENGTH), generator=generator)
        for row in range(EXAMPLES):
            self.labels[row, 1 + (row * 5) % LENGTH :] = -100

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


class TokenModel(nn.Module):
    """A transformers-like model: its loss is the token sum over ``num_items_in_batch`` when given one."""

    accepts_loss_kwargs = True

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, labels=None, num_items_in_batch=None):
        logits = self.head(self.embed(input_ids))
        if labels is None:  # compute_loss_func takes the labels
            return {"logits": logits}
        flat = logits.reshape(-1, VOCAB), labels.reshape(-1)
        if num_items_in_batch is None:
            return {"loss": nn.functional.cross_entropy(*flat), "logits": logits}
        return {
            "loss": nn.functional.cross_entropy(*flat, reduction="sum") / num_items_in_batch,
            "logits": logits,
        }


def token_loss(outputs, labels, num_items_in_batch):
    logits = outputs["logits"]
    summed = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    return summed / num_items_in_batch


def _train(output_dir: str, *, batch: int, accumulation: int, across: bool = True, loss_func=None) -> dict:
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=2,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        average_tokens_across_devices=across,
        train_sampling_strategy="sequential",
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(TokenModel(), args, train_dataset=TokenDataset(), compute_loss_func=loss_func)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"params": params, "losses": losses}


def _global_token_means() -> list[float]:
    """The mean token loss of each step of one process on the global batch, by hand (the reference)."""
    model, data = TokenModel(), TokenDataset()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    means = []
    for step in range(2):
        rows = slice(8 * step, 8 * step + 8)
        loss = model(data.ids[rows], data.labels[rows])["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        means.append(float(loss.detach()))
    return means


def test_accumulation_does_not_change_the_gradient_of_a_token_loss(tmp_path):
    whole = _train(str(tmp_path / "a"), batch=8, accumulation=1)
    for loss_func in (None, token_loss):
        micro = _train(str(tmp_path / "b"), batch=2, accumulation=4, loss_func=loss_func)
        assert torch.allclose(micro["params"], whole["params"], atol=1e-6), (
            (micro["params"] - whole["params"]).abs().max()
        )
        assert micro["losses"] == pytest.approx(whole["losses"], abs=1e-6)
    assert whole["losses"] == pytest.approx(_global_token_means(), abs=1e-6)
    # The per-micro-batch mean (what average_tokens_across_devices replaces) differs on these uneven counts.
    data = TokenDataset()
    model = TokenModel().requires_grad_(False)
    per_batch = (
        sum(float(model(data.ids[i : i + 2], data.labels[i : i + 2])["loss"]) for i in range(0, 8, 2)) / 4
    )
    assert abs(per_batch - whole["losses"][0]) > 5e-3


def _two_processes(output_dir: str, across: bool) -> dict:
    return _train(output_dir, batch=2, accumulation=2, across=across, loss_func=token_loss)


@pytest.mark.distributed
def test_two_processes_with_accumulation_equal_one_process_on_the_global_batch(tmp_path):
    whole = _train(str(tmp_path / "whole"), batch=8, accumulation=1, loss_func=token_loss)
    rank0, rank1 = run_distributed(_two_processes, 2, str(tmp_path / "two"), True, env=QUIET)
    assert torch.allclose(rank0["params"], whole["params"], atol=1e-6), (
        (rank0["params"] - whole["params"]).abs().max()
    )
    assert torch.equal(rank0["params"], rank1["params"])
    assert rank0["losses"] == pytest.approx(whole["losses"], abs=1e-6)
    # False: each process normalises by its own tokens, as transformers does; the uneven counts make it differ.
    local0, _ = run_distributed(_two_processes, 2, str(tmp_path / "local"), False, env=QUIET)
    assert (local0["params"] - whole["params"]).abs().max() > 1e-3


def test_the_count_skips_padding_and_shifts_for_causal_lms():
    class Accelerator:
        device = torch.device("cpu")

    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    plain = _num_items.ItemCounter(
        Accelerator(), label_names=["labels"], shift=False, across_devices=False, replicas=1
    )
    shifted = _num_items.ItemCounter(
        Accelerator(), label_names=["labels"], shift=True, across_devices=False, replicas=1
    )
    assert int(plain.count([{"labels": labels}, {"labels": labels[:1]}])) == 5
    assert int(shifted.count([{"labels": labels}])) == 1
    assert plain.count([{"input_ids": labels}]) is None
    given = torch.tensor([[2, 7, -100], [-100, -100, -100]])  # a collator's shift_labels: counted as given
    assert int(shifted.count([{"labels": labels, "shift_labels": given}])) == 2
    assert int(plain.count([{"labels": labels, "shift_labels": given[:, :1]}])) == 1
    split = _num_items.ItemCounter(
        Accelerator(), label_names=["labels"], shift=True, across_devices=True, replicas=2, sequence_shards=2
    )
    assert split.loss_scale == 4  # FSDP averages the gradients of 2 replicas x 2 cp ranks

    class CausalLM(nn.Module):
        loss_type = "ForCausalLM"

        def forward(self, input_ids, **kwargs):
            return input_ids

    assert _num_items.loss_shifts_labels(CausalLM()) and _num_items.accepts_loss_kwargs(CausalLM())
    assert not _num_items.accepts_loss_kwargs(nn.Linear(1, 1))
