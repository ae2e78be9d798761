"""An elastic job with tensor parallelism comes back on fewer processes (real gloo groups): dp_shard 2 x tp 2
on 4 processes saves mid-epoch; the restart on 2 processes keeps tp 2, the data-parallel size follows the
world (dp_shard 1), torch.distributed.checkpoint reshards the model and optimizer, and the loader deals the
rest of the epoch. Every sample of the epoch is read once, and the weights equal a single-process replay of
the logged global batches.

Tolerance: 1e-6 (float reordering of the sharded matmuls and reductions; measured in the test's output).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lockstep import Accelerator, ParallelismConfig, _env
from lockstep.config.parallelism import TorchTensorParallelConfig
from tests.helpers.fsdp_models import full_params, make_data, make_transformer
from tests.helpers.multiprocess import run_distributed

pytestmark = pytest.mark.distributed

N, PER_REPLICA = 48, 4
PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
TOLERANCE = 1e-6


class Indexed(Dataset):
    """``make_data``'s samples with their index, so that the test can log which ones each step trained on."""

    def __init__(self) -> None:
        self.data = make_data(N)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = self.data[i]
        return torch.tensor(i), x, y


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _attempt(load: str | None, save: str | None, steps: int | None) -> dict[str, Any]:
    """One attempt of the same script, with the same ParallelismConfig, as an elastic launch starts it."""
    os.environ[_env.LOCKSTEP_LAUNCH_CONFIG] = json.dumps({"elastic": True})
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    for name in ("lockstep.accelerator.mesh_view", "lockstep.checkpoint"):
        logging.getLogger(name).addHandler(handler)
    handler_config = TorchTensorParallelConfig(parallelize_plan=PLAN)
    config = ParallelismConfig(dp_shard_size=2, tp_size=2, tp_handler=handler_config)
    accelerator = Accelerator(parallelism_config=config)
    model = make_transformer()
    optimizer = _optimizer(model)
    loader = DataLoader(Indexed(), batch_size=PER_REPLICA, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if load is not None:
        accelerator.load_state(load)
    log: list[list[int]] = []
    for ids, x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        log.append(accelerator.gather_for_metrics(ids).tolist())
        if steps is not None and len(log) == steps:
            break
    if save is not None:
        accelerator.save_state(save)
    return {
        "log": log,
        "params": full_params(model),
        "sizes": (config.dp_shard_size, config.tp_size),
        "lines": [line for line in lines if line.startswith(("elastic job", "resumed on"))],
    }


def _replay(log: list[list[int]]) -> torch.Tensor:
    """The logged global batches on one process: the mean loss over each, one SGD step each."""
    model = make_transformer()
    optimizer = _optimizer(model)
    data = make_data(N)
    for ids in log:
        x, y = data[ids]
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_params(model)


def test_dp_shard_by_tp_continues_on_two_processes_with_tp_kept(tmp_path):
    folder = str(tmp_path / "four")
    four = run_distributed(_attempt, 4, None, folder, 3, timeout=180)[0]  # 3 steps of 8 samples
    two = run_distributed(_attempt, 2, folder, None, None, timeout=180)[0]  # the other 24, 4 at a time
    assert four["sizes"] == (2, 2) and two["sizes"] == (1, 2)
    assert [len(ids) for ids in four["log"]] == [8] * 3 and [len(ids) for ids in two["log"]] == [4] * 6
    seen = [i for ids in four["log"] + two["log"] for i in ids]
    assert sorted(seen) == list(range(N))
    assert (
        two["lines"][0]
        == "elastic job on 2 processes: ParallelismConfig dp_shard_size 2 -> 1 (tp_size=2 kept)"
    )
    assert two["lines"][1] == (
        f"resumed on 1 data-parallel ranks (2 processes) from a checkpoint saved on 2 data-parallel ranks: {folder} "
        "after 3 optimizer steps, epoch 0, 24 of 48 samples of the epoch consumed; global batch follows the number of "
        "processes: 4 samples per optimizer step (4 per micro-step x 1 accumulation steps; it was 8); pass "
        "Accelerator(elastic_keep_global_batch=True) to keep 8"
    )
    replayed = _replay(four["log"] + two["log"])
    difference = (two["params"] - replayed).abs().max().item()
    print(f"largest difference from the single-process replay: {difference:.3g}")
    assert difference <= TOLERANCE
    assert (replayed - full_params(make_transformer())).abs().max() > 0.01  # the run did train
