"""progress_bar over a prepared dataloader: a bar with samples/s on the main process, silence elsewhere."""

from __future__ import annotations

import io

import pytest

from lockstep import Accelerator, progress_bar
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import loader

pytestmark = pytest.mark.distributed


def _iterate(world: int) -> dict:
    accelerator = Accelerator()
    train_dl = accelerator.prepare(loader(40, 4))
    out = io.StringIO()
    seen = sum(1 for _ in progress_bar(train_dl, description="epoch 1", file=out))
    return {"seen": seen, "length": len(train_dl), "output": out.getvalue()}


def test_bar_on_the_main_process_only_with_samples_per_second():
    results = run_distributed(_iterate, 2, 2)
    main, other = results
    assert main["seen"] == other["seen"] == main["length"] == 5
    assert "epoch 1" in main["output"] and "5/5" in main["output"] and "samples/s" in main["output"]
    assert other["output"] == ""


def test_environment_variable_switches_the_bar_off():
    results = run_distributed(_iterate, 2, 2, env={"LOCKSTEP_DISABLE_PROGRESS_BARS": "1"})
    assert all(r["output"] == "" and r["seen"] == 5 for r in results)
