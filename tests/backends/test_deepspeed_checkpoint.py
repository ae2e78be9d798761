"""DeepSpeed checkpoints: save_state/load_state in a fresh process group, started from other weights,
resume mid-epoch bitwise at the saved step under ZeRO-3; lockstep merge-weights gives the same weights
without DeepSpeed or a process group; ZeRO-3's get_state_dict needs its flag. A ZeRO checkpoint resumed on
another number of processes: tests/backends/test_deepspeed_resize.py."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from tests.helpers.fsdp_models import data_loader, loss_of, make_transformer
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires

pytestmark = [requires("deepspeed"), pytest.mark.distributed, pytest.mark.usefixtures("deepspeed_preloaded")]

LENGTH, PER_PROCESS, STOP_AT = 48, 4, 4
STEPS = 2 * LENGTH // (2 * PER_PROCESS)  # two epochs on two processes


def _run(stage: int, folder: str, mode: str) -> dict:
    """mode: "straight" trains 2 epochs; "stop" saves after STOP_AT batches of epoch 0 and returns;
    "resume" starts from other weights and another seed, loads the checkpoint and finishes both epochs.
    Returns the gathered weights and the number of optimizer steps this run took."""
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, zero3_save_16bit_model=True),
        project_dir=folder,
    )
    model = make_transformer(seed=1 if mode == "resume" else 0)  # only a real load undoes other weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(
        data_loader(LENGTH, PER_PROCESS).dataset, batch_size=PER_PROCESS, shuffle=True
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    start_epoch, steps = 0, 0
    if mode == "resume":
        accelerator.load_state(f"{folder}/saved")
        start_epoch = loader.epoch if hasattr(loader, "epoch") else 0
    for epoch in range(start_epoch, 2):
        loader.set_epoch(epoch)
        for step, batch in enumerate(loader):
            accelerator.backward(loss_of(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if mode == "stop" and epoch == 0 and step + 1 == STOP_AT:
                accelerator.save_state(f"{folder}/saved")
                return {"steps": steps}
    weights = accelerator.get_state_dict(model)
    return {"steps": steps, "weights": {name: tensor.clone() for name, tensor in weights.items()}}


def test_a_mid_epoch_save_resumes_bitwise_in_a_fresh_process_group(tmp_path):
    # ZeRO-3 here (parameters partitioned too); under lockstep launch, tests/e2e/test_deepspeed_launch.py
    # resumes ZeRO-3 after a killed rank and ZeRO-2 after a preemption.
    straight = run_distributed(_run, 2, 3, str(tmp_path / "a"), "straight", timeout=180)[0]
    assert straight["steps"] == STEPS and straight["weights"]  # the main process's gathered weights
    assert run_distributed(_run, 2, 3, str(tmp_path / "b"), "stop", timeout=180)[0] == {"steps": STOP_AT}
    resumed = run_distributed(_run, 2, 3, str(tmp_path / "b"), "resume", timeout=180)[0]
    resumed_at = STEPS - resumed["steps"]
    assert resumed_at == STOP_AT, f"resumed at step {resumed_at} of {STEPS}, expected {STOP_AT}"
    assert straight["weights"].keys() == resumed["weights"].keys()
    for name in straight["weights"]:
        assert torch.equal(straight["weights"][name], resumed["weights"][name]), name


def _at_stop(stage: int, folder: str) -> dict:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage, zero3_save_16bit_model=True))
    model = make_transformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data_loader(LENGTH, PER_PROCESS))
    for step, batch in enumerate(loader):
        accelerator.backward(loss_of(model, batch))
        optimizer.step()
        if step == 2:
            break
    accelerator.save_state(folder)
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_merge_weights_equals_the_gathered_weights(tmp_path, stage):
    folder = tmp_path / "ckpt"
    expected = run_distributed(_at_stop, 2, stage, str(folder), timeout=180)[0]
    # In a process where DeepSpeed cannot be imported, with no process group.
    probe = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from lockstep.cli.main import main\n"
        f"raise SystemExit(main(['merge-weights', {str(folder)!r}, {str(tmp_path / 'out')!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    from safetensors.torch import load_file

    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert merged.keys() == expected.keys()
    for name in expected:
        assert torch.equal(merged[name], expected[name].float()), name


def test_a_zero0_checkpoint_loads_on_another_number_of_processes(tmp_path):
    folder = tmp_path / "ckpt"
    expected = run_distributed(_at_stop, 2, 0, str(folder), timeout=180)[0]
    loaded = run_distributed(_loaded_on_one, 1, 0, str(folder), timeout=120)[0]
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), name


def _loaded_on_one(stage: int, folder: str) -> dict:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
    model = make_transformer(seed=1)  # other weights: the checkpoint's must replace them
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, _ = accelerator.prepare(model, optimizer, data_loader(LENGTH, PER_PROCESS))
    with warnings.catch_warnings():  # one process now reads what two did per step: said, and expected here
        warnings.filterwarnings("ignore", message="The dataloader state was saved with 8 samples per step")
        accelerator.load_state(folder)
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
