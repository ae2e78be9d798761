"""``save_state``/``load_state`` when each process passes a folder of its own (Accelerate's own test of a stateful
dataloader gives every rank a ``tempfile.TemporaryDirectory()``): the checkpoint is the main process's folder,
which every rank writes to and reads from, and a rank that named another one is told so. Before, rank 1's save
failed (``Parent directory .../.incomplete/... does not exist``): its staging folder was never created.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep import Accelerator, DataLoaderConfiguration
from tests.helpers.multiprocess import run_distributed

pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.distributed


def _own_folder_worker() -> dict[str, Any]:
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    torch.manual_seed(accelerator.process_index)  # each rank draws its own numbers after the save
    loader = accelerator.prepare(DataLoader(list(range(64)), batch_size=4, shuffle=True))
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unseen, drawn = [], None
        for step, batch in enumerate(loader):
            if step == 2:
                accelerator.save_state(folder)
                drawn = torch.rand(3)  # what the restored generator must draw again
            if step > 2:
                unseen.append(batch.tolist())
        accelerator.wait_for_everyone()  # the main process's folder is read by every rank
        accelerator.load_state(folder)
        again = torch.rand(3)
        resumed = [batch.tolist() for batch in loader]
        accelerator.wait_for_everyone()  # before the main process removes its folder
        written = sorted(os.listdir(folder))
    return {
        "folder": folder,
        "unseen": unseen,
        "resumed": resumed,
        "random_restored": torch.equal(drawn, again),
        "written": written,
        "warnings": [str(w.message) for w in caught],
    }


def test_each_process_passing_its_own_folder_saves_and_resumes_in_the_main_processes():
    main, other = run_distributed(_own_folder_worker, 2, timeout=120)
    for rank in (main, other):
        assert len(rank["unseen"]) == 5 and rank["resumed"] == rank["unseen"]  # 8 batches; saved after 3
        assert rank["random_restored"]
    assert "random_states_1.pkl" in main["written"] and other["written"] == []
    assert main["warnings"] == []
    assert other["warnings"] == [
        f"{method}({other['folder']!r}) on process 1 of 2, where the main process passed {main['folder']!r}: a "
        "checkpoint is one folder, the main process's (every process writes its files there, and load_state "
        "reads the folder the main process names), so that one is used. Pass every process the same folder."
        for method in ("save_state", "load_state")
    ]
