"""Issue 16, items 4 and 5 (the parts built): label smoothing, eval_accumulation_steps, prediction_loss_only,
eval_on_start, eval_delay, include_num_input_tokens_seen, logging_nan_inf_filter, log levels, NEFTune,
use_cache, torch_empty_cache_steps, tf32, ddp_static_graph."""

from __future__ import annotations

import contextlib
import io
import logging
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from lockstep import Trainer, TrainingArguments
from lockstep.trainer import _evaluation
from lockstep.trainer._label_smoothing import LabelSmoothingLoss
from lockstep.trainer._process_setup import NEFTune, process_log_level
from lockstep.trainer.accelerator_factory import ddp_kwargs

VOCAB, CLASSES = 12, 4


class Tokens(Dataset):
    def __init__(self, length: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (length, 5), generator=generator)
        self.mask = torch.ones(length, 5, dtype=torch.int64)
        self.mask[::2, 3:] = 0  # every other example has 2 padding positions
        self.labels = self.ids[:, 0] % CLASSES

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {
            "input_ids": self.ids[index],
            "attention_mask": self.mask[index],
            "labels": self.labels[index],
        }


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, CLASSES)
        self.config = SimpleNamespace(use_cache=True)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids, attention_mask=None, labels=None) -> dict:
        logits = self.head(self.embed(input_ids).mean(1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def _trainer(tmp_path, model=None, **options) -> Trainer:
    settings = {
        "output_dir": str(tmp_path),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        **options,
    }
    return Trainer(
        model or Model(),
        TrainingArguments(**settings),
        train_dataset=Tokens(32),
        eval_dataset=Tokens(20, seed=1),
    )


def _quiet(fn, *args, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)


def test_label_smoothing_matches_torch_cross_entropy_with_label_smoothing(tmp_path):
    trainer = _trainer(tmp_path, label_smoothing_factor=0.2)
    batch = {k: torch.stack([v, v]) for k, v in Tokens(1)[0].items()}
    logits = trainer.model(batch["input_ids"])["logits"]
    expected = nn.CrossEntropyLoss(label_smoothing=0.2)(logits, batch["labels"])
    assert torch.allclose(trainer.compute_loss(trainer.model, batch), expected)
    unsmoothed = nn.CrossEntropyLoss()(logits, batch["labels"])
    assert not torch.allclose(expected, unsmoothed)
    metrics = _quiet(trainer.evaluate)
    assert metrics["eval_loss"] > _quiet(_trainer(tmp_path / "b").evaluate)["eval_loss"]


def test_label_smoothing_shifts_the_labels_of_a_causal_lm():
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    labels[0, 4] = -100
    loss = LabelSmoothingLoss(0.1, shift_labels=True)({"logits": logits}, labels)
    expected = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100, label_smoothing=0.1
    )
    assert torch.allclose(loss, expected)


def test_label_smoothing_and_compute_loss_func_conflict(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0.1\) smooths the default cross-entropy"):
        Trainer(
            Model(), args, compute_loss_func=lambda out, labels, num_items_in_batch=None: out["logits"].sum()
        )


@pytest.mark.parametrize(("steps", "held"), [(None, 1), (2, 2), (10, 5)])
def test_eval_accumulation_steps_bounds_the_predictions_held_on_the_device(tmp_path, steps, held):
    seen = []
    original = _evaluation._Accumulator.flush

    def spy(self):
        seen.append(len(self.pending))
        original(self)

    trainer = _trainer(tmp_path, eval_accumulation_steps=steps)
    with mock.patch.object(_evaluation._Accumulator, "flush", spy):
        output = _quiet(trainer.predict, Tokens(20, seed=1))
    assert max(seen) == held  # 20 examples, batches of 4: 5 evaluation steps
    assert output.predictions.shape == (20, CLASSES)


def test_prediction_loss_only_keeps_no_predictions(tmp_path):
    output = _quiet(_trainer(tmp_path, prediction_loss_only=True).predict, Tokens(8))
    assert output.predictions is None and output.label_ids is None and "test_loss" in output.metrics


def test_eval_on_start_and_eval_delay(tmp_path):
    trainer = _trainer(tmp_path, eval_strategy="steps", eval_steps=2, eval_delay=4, eval_on_start=True)
    _quiet(trainer.train)
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [0, 4, 6]


def test_input_tokens_are_counted_all_or_non_padding(tmp_path):
    trainer = _trainer(tmp_path, include_num_input_tokens_seen=True)
    _quiet(trainer.train)
    assert trainer.state.num_input_tokens_seen == 6 * 4 * 5
    assert trainer.state.log_history[0]["num_input_tokens_seen"] == 20
    trainer = _trainer(tmp_path / "b", include_num_input_tokens_seen="non_padding")
    _quiet(trainer.train)
    assert trainer.state.num_input_tokens_seen == 6 * 4 * 5 - 6 * 2 * 2


def test_a_nan_step_loss_is_logged_as_the_mean_since_the_last_log(tmp_path):
    trainer = _trainer(tmp_path, logging_steps=3)
    real = trainer.compute_loss
    calls = []

    def loss(model, batch, **kwargs):
        calls.append(1)
        value = real(model, batch, **kwargs)
        return value * float("nan") if len(calls) == 2 else value

    trainer.compute_loss = loss
    _quiet(trainer.train)
    first = trainer.state.log_history[0]
    assert first["step"] == 3 and torch.isfinite(torch.tensor(first["loss"]))
    trainer = _trainer(tmp_path / "b", logging_steps=3, logging_nan_inf_filter=False)
    real_b, calls_b = trainer.compute_loss, []

    def loss_b(model, batch, **kwargs):
        calls_b.append(1)
        value = real_b(model, batch, **kwargs)
        return value * float("nan") if len(calls_b) == 2 else value

    trainer.compute_loss = loss_b
    _quiet(trainer.train)
    assert torch.isnan(torch.tensor(trainer.state.log_history[0]["loss"]))


def test_log_levels_of_main_and_replica_processes(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), log_level="info", log_level_replica="error")
    assert process_log_level(args, is_main=True, is_local_main=True) == logging.INFO
    assert process_log_level(args, is_main=False, is_local_main=True) == logging.INFO  # first of its node
    assert process_log_level(args, is_main=False, is_local_main=False) == logging.ERROR
    args = TrainingArguments(output_dir=str(tmp_path), log_level="info", log_on_each_node=False)
    assert process_log_level(args, is_main=False, is_local_main=True) == logging.WARNING
    assert (
        process_log_level(TrainingArguments(output_dir=str(tmp_path)), is_main=True, is_local_main=True)
        is None
    )
    before = logging.getLogger("lockstep").level
    try:
        _trainer(tmp_path, log_level="error")
        assert logging.getLogger("lockstep").level == logging.ERROR
    finally:
        logging.getLogger("lockstep").setLevel(before)


def test_neftune_adds_bounded_noise_to_embeddings_in_training_only(tmp_path):
    model = Model()
    hook = NEFTune(model, alpha=5.0)
    ids = torch.randint(0, VOCAB, (3, 5))
    clean = model.embed.weight[ids]
    noisy = model.embed(ids)
    bound = 5.0 / (5 * 8) ** 0.5
    assert 0 < (noisy - clean).abs().max() <= bound
    model.eval()
    assert torch.equal(model.embed(ids), clean)
    hook.remove()
    with pytest.raises(ValueError, match=r"neftune_noise_alpha=5.0\) needs the model's input embeddings"):
        _trainer(tmp_path, model=nn.Linear(2, 2), neftune_noise_alpha=5.0)


def test_use_cache_is_set_on_the_model_config(tmp_path):
    trainer = _trainer(tmp_path)
    assert trainer.model.config.use_cache is False


def test_torch_empty_cache_steps_empties_the_cache_every_n_steps(tmp_path):
    trainer = _trainer(tmp_path, torch_empty_cache_steps=2)
    with mock.patch("lockstep.trainer.trainer.clear_device_cache") as cleared:
        _quiet(trainer.train)
    assert cleared.call_count == 3


def test_tf32_needs_an_ampere_gpu_and_ddp_static_graph_reaches_ddp(tmp_path):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"tf32=True\) needs an NVIDIA GPU of the Ampere generation"):
            TrainingArguments(tf32=True)
    args = TrainingArguments(output_dir=str(tmp_path), ddp_static_graph=True)
    assert ddp_kwargs(args, None).static_graph is True


def test_sequential_sampling_keeps_the_dataset_order(tmp_path):
    trainer = _trainer(tmp_path, train_sampling_strategy="sequential")
    first = next(iter(trainer.get_train_dataloader()))
    assert torch.equal(first["input_ids"], Tokens(32).ids[:4])
    shuffled = next(iter(_trainer(tmp_path / "b").get_train_dataloader()))
    assert not torch.equal(shuffled["input_ids"], Tokens(32).ids[:4])


def test_full_determinism_turns_on_deterministic_algorithms(tmp_path):
    try:
        _trainer(tmp_path, full_determinism=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


class CausalTokens(Dataset):
    """Sequences of 8 tokens labelled with themselves; the last 3 positions of every other one are -100."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (6, 8), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        labels = self.ids[index].clone()
        if index % 2:
            labels[5:] = -100
        return {"input_ids": self.ids[index], "labels": labels}


def test_eval_counts_a_causal_lms_shifted_labels_for_compute_loss_func(tmp_path):
    """``compute_loss_func`` gets ``num_items_in_batch`` over ``labels[..., 1:]`` in evaluation, as in training
    (position 0 is never a target of a causal LM): a loss that divides its sum by it gives the model's own
    eval_loss. Counting every label (before) gave a loss smaller by the rows' position-0 labels."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    from tests.helpers.llama import tiny_llama_config

    def summed_over_items(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"][..., :-1, :].reshape(-1, 64).float()
        return (
            nn.functional.cross_entropy(
                logits, labels[..., 1:].reshape(-1), ignore_index=-100, reduction="sum"
            )
            / num_items_in_batch
        )

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to=[])
    own = Trainer(model, args, eval_dataset=CausalTokens()).evaluate()["eval_loss"]
    counted = Trainer(
        model, args, eval_dataset=CausalTokens(), compute_loss_func=summed_over_items
    ).evaluate()["eval_loss"]
    assert counted == pytest.approx(own, rel=1e-6)
