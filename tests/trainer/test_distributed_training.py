"""The Trainer on 2 real gloo processes: parity with a hand-written loop, log lines and trackers, callbacks,
evaluation order, exact resume after a preemption."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lockstep import Trainer, TrainerCallback, TrainingArguments
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import flat_params, make_dataset, make_model, reference_training

pytestmark = pytest.mark.distributed

SEED = 1234
QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}


def mse(outputs, labels, num_items_in_batch=None):
    # Normalised by the labels of the whole step (average_tokens_across_devices), as transformers expects.
    return nn.functional.mse_loss(outputs, labels, reduction="sum") / num_items_in_batch


class Recorder(TrainerCallback):
    """Records every event with the global step at which it happened."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def __getattribute__(self, name: str):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")
            return lambda args, state, control, **kwargs: events.append((name, state.global_step))
        return object.__getattribute__(self, name)


def _parity_run(output_dir: str) -> dict:
    recorder = Recorder()
    args = TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        max_grad_norm=0,
        logging_steps=2,
        save_strategy="no",
        seed=SEED,
        report_to="jsonl",
    )
    trainer = Trainer(
        make_model(), args, train_dataset=make_dataset(32), compute_loss_func=mse, callbacks=[recorder]
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = trainer.train()
    trainer.accelerator.end_training()
    return {
        "params": flat_params(trainer.model),
        "stdout": out.getvalue(),
        "events": recorder.events,
        "global_step": result.global_step,
        "history": trainer.state.log_history,
    }


def test_two_process_trainer_matches_a_hand_written_loop_and_logs_once(tmp_path):
    rank0, rank1 = run_distributed(_parity_run, 2, str(tmp_path), env=QUIET)
    expected = reference_training(32, 8, 2, lr=0.1, shuffle_seed=SEED, accumulation=2)
    assert rank0["global_step"] == 8  # 32 samples / (2 per process * 2 processes * 2 micro-steps) * 2 epochs
    assert torch.allclose(rank0["params"], expected, atol=1e-6), (rank0["params"] - expected).abs().max()
    assert torch.equal(rank0["params"], rank1["params"])

    lines = rank0["stdout"].strip().splitlines()
    train_lines = [line for line in lines if line.startswith("[train] epoch")]
    assert [line.split(" loss")[0] for line in train_lines] == [
        "[train] epoch 1/2 step 2/8",
        "[train] epoch 1/2 step 4/8",
        "[train] epoch 2/2 step 6/8",
        "[train] epoch 2/2 step 8/8",
    ]
    assert all(
        re.fullmatch(r"\[train\] epoch \d/2 step \d/8 loss \d+\.\d{6} lr 1\.00e-01", x) for x in train_lines
    )
    assert re.fullmatch(
        r"\[train\] done: 8 steps in [\d.]+ s \([\d.]+ samples/s\), mean loss \d+\.\d{6}", lines[-1]
    )
    assert rank1["stdout"] == ""

    records = [json.loads(line) for line in (tmp_path / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8, 8]  # written once, by the main process only
    logged = [r["loss"] for r in records if "loss" in r]
    assert logged == [h["loss"] for h in rank0["history"] if "loss" in h]
    assert records[-1]["train_loss"] > 0

    names = [name for name, _ in rank0["events"]]
    assert names[:3] == ["on_init_end", "on_train_begin", "on_epoch_begin"] and names[-1] == "on_train_end"
    assert names.count("on_step_begin") == names.count("on_step_end") == names.count("on_optimizer_step") == 8
    assert names.count("on_substep_end") == 8 and names.count("on_epoch_end") == 2
    assert [step for name, step in rank0["events"] if name == "on_log"] == [2, 4, 6, 8, 8]
    assert ("on_step_end", 8) in rank0["events"] and ("on_save", 8) not in rank0["events"]
    assert rank1["events"] == rank0["events"]


class Scale(nn.Module):
    """Returns its input times one weight (so the predictions show which examples were evaluated)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _evaluation_run(output_dir: str) -> dict:
    values = torch.arange(21.0).unsqueeze(1)
    dataset = TensorDataset(values, 2 * values)
    seen = {}

    def metrics(prediction):
        seen["rows"] = len(prediction.predictions)
        return {"max_error": float(abs(prediction.predictions - prediction.label_ids).max())}

    args = TrainingArguments(output_dir=output_dir, per_device_eval_batch_size=4, report_to="none")
    trainer = Trainer(Scale(), args, eval_dataset=dataset, compute_loss_func=mse, compute_metrics=metrics)
    evaluated = trainer.evaluate()
    predicted = trainer.predict(dataset)
    return {"metrics": evaluated, "rows": seen["rows"], "predicted": predicted}


def test_evaluation_is_complete_ordered_and_equals_one_process(tmp_path):
    rank0, rank1 = run_distributed(_evaluation_run, 2, str(tmp_path), env=QUIET)
    predicted = rank0["predicted"]
    assert predicted.predictions[:, 0].tolist() == list(range(21))  # 21 examples: 6 batches of 4, uneven tail
    assert predicted.label_ids[:, 0].tolist() == [2.0 * i for i in range(21)]
    assert rank0["rows"] == 21 and rank1["rows"] == 21
    single_process_loss = float(torch.mean(torch.arange(21.0) ** 2))  # mse(x, 2x) over every example once
    assert abs(rank0["metrics"]["eval_loss"] - single_process_loss) < 1e-4
    assert rank0["metrics"]["eval_max_error"] == 20.0
    assert predicted.metrics["test_loss"] == rank0["metrics"]["eval_loss"]


class DropoutModel(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PreemptAt(TrainerCallback):
    """Sends SIGTERM to rank 1 only, as a cluster scheduler would, after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def _resumable_run(output_dir: str, resume, preempt_at: int | None, model_seed: int = 0) -> dict:
    args = TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=2,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        learning_rate=0.01,
        weight_decay=0.1,
        warmup_steps=2,
        logging_steps=2,
        save_steps=3,
        seed=SEED,
    )
    callbacks = [PreemptAt(preempt_at)] if preempt_at else []
    trainer = Trainer(
        DropoutModel(model_seed),
        args,
        train_dataset=make_dataset(40),
        compute_loss_func=mse,
        callbacks=callbacks,
    )
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            trainer.train(resume_from_checkpoint=resume)
    except SystemExit as exited:
        return {"exit_code": exited.code, "step": trainer.state.global_step}
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return {
        "params": flat_params(trainer.model),
        "losses": losses,
        "step": trainer.state.global_step,
        "printed": printed.getvalue(),
    }


def test_preempted_run_resumes_exactly_from_its_newest_valid_checkpoint(tmp_path):
    full, _ = run_distributed(_resumable_run, 2, str(tmp_path / "full"), None, None, env=QUIET)
    assert full["step"] == 8  # 40 samples: 7 batches of 3 per process, 4 optimizer steps per epoch
    assert sorted(os.listdir(tmp_path / "full")) == ["checkpoint-3", "checkpoint-6", "checkpoint-8"]

    stopped = run_distributed(_resumable_run, 2, str(tmp_path / "run"), None, 5, env=QUIET)
    assert [r["exit_code"] for r in stopped] == [143, 143]  # both ranks stopped at the same step
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-3", "checkpoint-5"]
    broken = tmp_path / "run" / "checkpoint-7"  # a newer checkpoint whose save was torn: must be skipped
    shutil.copytree(tmp_path / "run" / "checkpoint-5", broken)
    (broken / "model.safetensors").write_bytes(b"torn")

    # Other initial weights (model seed 1): starting over, or a load that restores nothing, cannot end there.
    resumed, _ = run_distributed(_resumable_run, 2, str(tmp_path / "run"), True, None, 1, env=QUIET)
    said = [line for line in resumed["printed"].splitlines() if line.startswith("[train] resumed from ")]
    assert said == [f"[train] resumed from {tmp_path / 'run' / 'checkpoint-5'} at step 5/8"], resumed[
        "printed"
    ]
    assert resumed["step"] == 8
    assert torch.equal(resumed["params"], full["params"])  # bitwise: data order, dropout, Adam, schedule
    # The logged losses sum the processes' step losses in another order after a resume (the checkpoint holds
    # their mean since the last log), so they agree to rounding, not bitwise.
    assert resumed["losses"][6] == pytest.approx(full["losses"][6], rel=1e-6)
    assert resumed["losses"][8] == pytest.approx(full["losses"][8], rel=1e-6)
    assert Path(tmp_path / "run" / "checkpoint-8").is_dir()
