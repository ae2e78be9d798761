"""The Trainer with ``TrainingArguments(parallelism_config=ParallelismConfig(pp_size=2))`` and no other user code:
a tiny transformers ``LlamaForCausalLM`` (split automatically, the next-token loss outside the model) and a
plain model with ``compute_loss_func``, on 2 CPU processes against the same Trainer on one process (same seed
and global batch; AdamW, accumulation 2, clipping): logged losses, ``train_loss``, final weights and
``eval_loss`` within 1e-5, and the same loss reported on both ranks."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

from lockstep import ParallelismConfig, Trainer, TrainerCallback, TrainingArguments
from lockstep.config.pipeline import TorchPipelineParallelConfig
from tests.helpers.fsdp_models import make_data, make_transformer
from tests.helpers.multiprocess import run_distributed
from tests.helpers.tiny_llama import make_llama, token_ids

pytest.importorskip("transformers")

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}
TOLERANCE = 1e-5


def sequences(count: int, seed: int) -> list[dict]:
    return [
        {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()}
        for row in token_ids(count, seed)
    ]


def mse_per_item(outputs: torch.Tensor, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """A loss that divides by the labels counted (the rows here), as transformers' counted losses do."""
    return nn.functional.mse_loss(outputs, labels, reduction="sum") / num_items_in_batch


def _train(output_dir: str, kind: str, pp_size: int) -> dict:
    config = None
    if pp_size > 1:
        config = ParallelismConfig(pp_size=2, pp_handler=TorchPipelineParallelConfig(schedule="1f1b"))
    args = TrainingArguments(
        output_dir=output_dir,
        parallelism_config=config,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        max_grad_norm=0.5,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=7,
    )
    if kind == "llama":
        trainer = Trainer(make_llama(), args, train_dataset=sequences(32, 1), eval_dataset=sequences(10, 2))
    else:
        trainer = Trainer(
            make_transformer(depth=4),
            args,
            train_dataset=make_data(32),
            eval_dataset=make_data(10, seed=3),
            compute_loss_func=mse_per_item,
        )
    with contextlib.redirect_stdout(io.StringIO()):
        output = trainer.train()
        metrics = trainer.evaluate()
        if kind == "llama":
            trainer.save_model(f"{output_dir}/model")
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "train_loss": output.training_loss,
        "params": trainer.accelerator.get_state_dict(trainer.model_wrapped),
        "eval_loss": metrics["eval_loss"],
        "steps": output.global_step,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["llama", "plain"])
def test_the_trainer_with_pp2_matches_one_process(tmp_path, kind):
    expected = run_distributed(_train, 1, str(tmp_path / "one"), kind, 1, timeout=240, env=QUIET)[0]
    results = run_distributed(_train, 2, str(tmp_path / "pp"), kind, 2, timeout=240, env=QUIET)
    assert expected["steps"] == 4 and len(expected["losses"]) == 4
    for result in results:  # the last stage's loss, broadcast: both ranks log and return the same
        assert result["steps"] == 4
        assert result["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
        assert result["train_loss"] == pytest.approx(expected["train_loss"], abs=TOLERANCE)
        assert result["eval_loss"] == pytest.approx(expected["eval_loss"], abs=TOLERANCE)
    assert results[0]["losses"] == results[1]["losses"]
    full, reference = results[0]["params"], expected["params"]
    assert list(full) == list(reference) and results[1]["params"] == {}
    diff = max((full[k] - reference[k]).abs().max().item() for k in reference)
    assert diff <= TOLERANCE
    loss_diff = max(abs(a - b) for a, b in zip(results[1]["losses"], expected["losses"], strict=True))
    print(f"{kind}: max loss diff {loss_diff:.2e}, max parameter diff {diff:.2e}")
    if kind == "llama":  # save_model wrote the whole model with its config, from every stage
        from transformers import LlamaForCausalLM

        saved = LlamaForCausalLM.from_pretrained(str(tmp_path / "pp" / "model")).state_dict()
        assert max((saved[k] - full[k]).abs().max().item() for k in full) == 0.0


def _refused() -> str:
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(
        BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    )
    args = TrainingArguments(
        output_dir="unused", parallelism_config=ParallelismConfig(pp_size=2), report_to="none"
    )
    with pytest.raises(
        ValueError,
        match=r"BertForMaskedLM computes it from the labels inside forward.*"
        r"Trainer\(compute_loss_func=fn\)",
    ):
        Trainer(model, args)
    noisy = TrainingArguments(
        output_dir="unused",
        parallelism_config=ParallelismConfig(pp_size=2),
        neftune_noise_alpha=5.0,
        report_to="none",
    )
    with pytest.raises(
        NotImplementedError, match=r"neftune_noise_alpha=5\.0\) with a pipeline .* not built yet"
    ):
        Trainer(make_llama(), noisy)
    return "refused"


@pytest.mark.distributed
def test_a_model_whose_loss_needs_labels_inside_forward_is_refused():
    assert run_distributed(_refused, 2, timeout=120, env=QUIET) == ["refused", "refused"]


class StepCounter(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


def _resume(output_dir: str) -> dict:
    counter = StepCounter()

    def trainer(callbacks: list | None = None) -> Trainer:
        config = ParallelismConfig(pp_size=2, pp_handler=TorchPipelineParallelConfig(schedule="1f1b"))
        args = TrainingArguments(
            output_dir=output_dir,
            parallelism_config=config,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=1e-3,
            num_train_epochs=1,
            save_strategy="steps",
            save_steps=2,
            report_to="none",
            seed=7,
        )
        return Trainer(make_llama(), args, train_dataset=sequences(32, 1), callbacks=callbacks)

    with contextlib.redirect_stdout(io.StringIO()):
        first = trainer()
        first.train()
        resumed = trainer([counter])
        output = resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-2")
    return {
        "straight": first.accelerator.get_state_dict(first.model_wrapped),
        "resumed": resumed.accelerator.get_state_dict(resumed.model_wrapped),
        "steps": output.global_step,
        "steps_after_resume": counter.steps,
    }


@pytest.mark.distributed
def test_the_trainer_with_pp2_resumes_from_its_checkpoint_exactly(tmp_path):
    results = run_distributed(_resume, 2, str(tmp_path), timeout=240, env=QUIET)
    straight, resumed = results[0]["straight"], results[0]["resumed"]
    assert results[0]["steps"] == 4 and results[0]["steps_after_resume"] == 2  # steps 3 and 4 only
    assert list(straight) == list(resumed)
    assert max((straight[k] - resumed[k]).abs().max().item() for k in straight) == 0.0
    assert (tmp_path / "checkpoint-2").is_dir() and (tmp_path / "checkpoint-4").is_dir()


def _best_model_only(output_dir: str) -> dict:
    config = ParallelismConfig(pp_size=2, pp_handler=TorchPipelineParallelConfig(schedule="1f1b"))
    args = TrainingArguments(
        output_dir=output_dir,
        parallelism_config=config,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        num_train_epochs=1,
        eval_strategy="steps",
        eval_steps=4,
        save_steps=4,
        save_only_model=True,
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=False,  # the eval loss rises after step 4 (random tokens): the best is not the last
        report_to="none",
        seed=7,
    )
    trainer = Trainer(make_llama(), args, train_dataset=sequences(32, 1), eval_dataset=sequences(8, 2))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return {
        "best": trainer.state.best_model_checkpoint,
        "params": trainer.accelerator.get_state_dict(trainer.model_wrapped),
    }


@pytest.mark.distributed
def test_the_best_model_only_checkpoint_loads_back_into_the_stages(tmp_path):
    from safetensors.torch import load_file

    results = run_distributed(_best_model_only, 2, str(tmp_path), timeout=240, env=QUIET)
    best = results[0]["best"]
    assert best == results[1]["best"] == str(tmp_path / "checkpoint-4")  # not the last one (checkpoint-8)
    saved, params = load_file(str(tmp_path / "checkpoint-4" / "model.safetensors")), results[0]["params"]
    final = load_file(str(tmp_path / "checkpoint-8" / "model.safetensors"))
    assert max((saved[k] - params[k]).abs().max().item() for k in params) == 0.0
    assert max((final[k] - params[k]).abs().max().item() for k in params) > 1e-3
