"""Issue 46, item 3: ``TrainingArguments(loss_type="chunked_nll")`` trains a causal LM as the model's own loss
does (tiny Llama, vocabulary 32,000: logged losses, eval_loss and weights within 1e-6), without building the
logits; on 2 processes (DDP) as on one; and is refused by name where it is not built."""

from __future__ import annotations

import pytest
import torch

from lockstep import Trainer, TrainingArguments
from lockstep.layers.long_context._trainer_loss import trainer_loss
from tests.helpers.multiprocess import run_distributed
from tests.long_context._models import VOCAB, LargestAllocation, full_weights, make_llama, token_batch

pytest.importorskip("transformers")

SEQUENCE, EXAMPLES = 128, 8
QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids, self.labels = token_batch(seed=11, rows=EXAMPLES, sequence=SEQUENCE)

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def _train(
    output_dir: str, loss_type: str, *, batch: int = 2, measure: bool = False, tp_size: int = 1
) -> dict:
    from lockstep import ParallelismConfig

    args = TrainingArguments(
        output_dir=output_dir,
        parallelism_config=ParallelismConfig(tp_size=tp_size) if tp_size > 1 else None,
        loss_type=loss_type,
        max_steps=2,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        train_sampling_strategy="sequential",
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(make_llama(sequence=SEQUENCE), args, train_dataset=Tokens(), eval_dataset=Tokens())
    with LargestAllocation() as allocations:
        if measure:
            trainer.train()
    if not measure:
        trainer.train()
    metrics = trainer.evaluate()
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "eval_loss": metrics["eval_loss"],
        "weights": full_weights(model),
        "largest": allocations.largest,
    }


def _assert_same(ours: dict, theirs: dict) -> None:
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=0)
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-6, abs=0)
    assert (ours["weights"] - theirs["weights"]).abs().max().item() <= 1e-6


def test_chunked_nll_trains_as_the_models_own_loss(tmp_path, monkeypatch):
    for name, value in QUIET.items():
        monkeypatch.setenv(name, value)
    plain = _train(str(tmp_path / "plain"), "nll", measure=True)
    chunked = _train(str(tmp_path / "chunked"), "chunked_nll", measure=True)
    _assert_same(chunked, plain)
    assert len(plain["losses"]) == 2
    tokens_by_vocab = 2 * SEQUENCE * VOCAB
    assert plain["largest"] >= tokens_by_vocab
    assert chunked["largest"] < tokens_by_vocab


def _two_processes(output_dir: str) -> dict:
    return _train(output_dir, "chunked_nll", batch=1)


def test_two_processes_equal_one(tmp_path, monkeypatch):
    for name, value in QUIET.items():
        monkeypatch.setenv(name, value)
    results = run_distributed(_two_processes, 2, str(tmp_path / "ddp"), env=QUIET)
    one = _train(str(tmp_path / "one"), "nll")
    assert torch.equal(results[0]["weights"], results[1]["weights"])
    _assert_same(results[0], one)


def test_refused_by_name(tmp_path):
    model = make_llama(sequence=SEQUENCE)
    common = {
        "distributed_type": "NO",
        "parallel_sizes": {},
        "compute_loss_func": None,
        "label_smoothing_factor": 0,
    }
    with pytest.raises(NotImplementedError, match=r"ParallelismConfig\(cp_size=2\).*not built yet"):
        trainer_loss(model, **{**common, "parallel_sizes": {"cp_size": 2}})
    with pytest.raises(NotImplementedError, match="under FSDP: .* not built yet"):
        trainer_loss(model, **{**common, "distributed_type": "FSDP"})
    with pytest.raises(NotImplementedError, match="label smoothing in the chunked loss"):
        trainer_loss(model, **{**common, "label_smoothing_factor": 0.1})
    with pytest.raises(ValueError, match="LlamaModel is not a causal LM"):
        trainer_loss(model.model, **common)
    with pytest.raises(ValueError, match=r"loss_type='dft'\) is invalid"):
        TrainingArguments(output_dir=str(tmp_path), loss_type="dft")
    args = TrainingArguments(output_dir=str(tmp_path), loss_type="chunked_nll", report_to="none")
    with pytest.raises(ValueError, match="compute_loss_func=...\\) each give the loss"):
        Trainer(model, args, train_dataset=Tokens(), compute_loss_func=lambda *a, **k: 0)
