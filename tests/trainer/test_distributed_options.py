"""Issue 16 item 5 on 2 real gloo processes: auto_find_batch_size (every rank retries together and settles on
the same batch size) and save_on_each_node (each node keeps, and resumes from, its own checkpoints)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from lockstep import Trainer, TrainingArguments
from lockstep.checkpoint import verify
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import flat_params, make_dataset, make_model

pytestmark = pytest.mark.distributed

QUIET = {"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"}


def mse(outputs, labels, num_items_in_batch=None):
    return nn.functional.mse_loss(outputs, labels)


class RunsOutOfMemory(nn.Module):
    """The regression model, raising torch's out-of-memory error for training batches above ``limit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.inner = make_model()
        self.limit = limit
        self.tried: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.tried.append(x.shape[0])
            if x.shape[0] > self.limit:
                raise torch.OutOfMemoryError(f"CUDA out of memory (simulated: batch {x.shape[0]})")
        return self.inner(x)


def _args(output_dir: str, **options) -> TrainingArguments:
    settings = {
        "output_dir": output_dir,
        "num_train_epochs": 1,
        "optim": "sgd",
        "learning_rate": 0.05,
        "train_sampling_strategy": "sequential",
        "logging_steps": 100,
        "save_strategy": "no",
        "disable_tqdm": True,
        **options,
    }
    return TrainingArguments(**settings)


def _auto_batch_size(output_dir: str) -> dict:
    model = RunsOutOfMemory(limit=6)
    trainer = Trainer(
        model,
        _args(output_dir, per_device_train_batch_size=8, auto_find_batch_size=True),
        train_dataset=make_dataset(96),
        compute_loss_func=mse,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    direct = Trainer(
        make_model(),
        _args(output_dir + "-direct", per_device_train_batch_size=6),
        train_dataset=make_dataset(96),
        compute_loss_func=mse,
    )
    with contextlib.redirect_stdout(io.StringIO()):
        direct.train()
    return {
        "first_of_each_attempt": sorted(set(model.tried), reverse=True),
        "state_batch": trainer.state.train_batch_size,
        "steps": trainer.state.global_step,
        "same_as_direct": torch.equal(flat_params(model.inner), flat_params(direct.model)),
    }


def test_auto_find_batch_size_retries_on_every_rank_and_trains_as_the_size_found(tmp_path):
    results = run_distributed(_auto_batch_size, 2, str(tmp_path), env=QUIET, timeout=120)
    for result in results:
        # 8, then 0.9 times each time: 7, 6 (the last fits).
        assert result["first_of_each_attempt"] == [8, 7, 6]
        assert result["state_batch"] == 6
        assert result["steps"] == 8  # 96 examples / (2 processes x 6)
        assert result["same_as_direct"]


def _each_node(base: str, on_each_node: bool, resume: bool) -> dict:
    # Two "nodes" of one process each, with node-local disks.
    os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    rank = int(os.environ["RANK"])
    output_dir = str(Path(base) / f"node{rank}")
    args = _args(
        output_dir,
        per_device_train_batch_size=4,
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        save_on_each_node=on_each_node,
    )
    # A resumed run starts from other weights (seed 1): only a real load ends at the first run's weights.
    trainer = Trainer(
        make_model(seed=1 if resume else 0), args, train_dataset=make_dataset(64), compute_loss_func=mse
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.train(resume_from_checkpoint=True if resume else None)
    folders = sorted(p.name for p in Path(output_dir).glob("checkpoint-*"))
    for name in folders:
        verify(Path(output_dir) / name)
    return {"folders": folders, "weights": flat_params(trainer.model), "printed": printed.getvalue()}


def test_save_on_each_node_gives_every_node_its_checkpoints_and_resume(tmp_path):
    each = run_distributed(_each_node, 2, str(tmp_path / "b"), True, False, env=QUIET, timeout=120)
    assert each[0]["folders"] == each[1]["folders"] == ["checkpoint-3", "checkpoint-6"]
    # Resuming: each node finds its own newest valid checkpoint (checkpoint-3) and trains steps 4 to 6 again.
    for node in (0, 1):
        (tmp_path / "b" / f"node{node}" / "checkpoint-6" / "manifest.json").unlink()  # broken: skipped
    resumed = run_distributed(_each_node, 2, str(tmp_path / "b"), True, True, env=QUIET, timeout=120)
    said = [line for line in resumed[0]["printed"].splitlines() if line.startswith("[train] resumed from ")]
    assert said == [f"[train] resumed from {tmp_path / 'b' / 'node0' / 'checkpoint-3'} at step 3/6"], said
    assert torch.equal(resumed[0]["weights"], each[0]["weights"])
    assert torch.equal(resumed[1]["weights"], resumed[0]["weights"])
