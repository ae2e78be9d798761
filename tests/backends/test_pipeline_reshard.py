"""A pipeline-parallel (pp=2) checkpoint loads without pipelining (one process, DDP on 2), and back.

The pp=2 run trains 2 steps, saves, trains 2 more. Loading its checkpoint elsewhere must give its gathered
weights bit for bit and, since the AdamW state comes back too (keyed by parameter name), the 2 further steps
must land where the pp=2 run landed (within 1e-5: micro-batch sums reorder floats); a fresh AdamW lands far
from it, which is what shows the optimizer state was restored. The other way, a one-process checkpoint
(``model.safetensors``, ``optimizer.bin``) loads into pp=2 stages the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lockstep import Accelerator, ParallelismConfig
from tests.backends.test_pipeline_parallel import DEPTH, LENGTH, PER_REPLICA, _handler
from tests.helpers.fsdp_models import data_loader, make_data, make_transformer
from tests.helpers.multiprocess import run_distributed

TOLERANCE = 1e-5
STEPS = 2


def _pipelined(folder: str) -> dict:
    config = ParallelismConfig(pp_size=2, pp_handler=_handler("1f1b", num_microbatches=2))
    accelerator = Accelerator(parallelism_config=config)
    model = make_transformer(depth=DEPTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, data_loader(LENGTH, PER_REPLICA))
    batches = iter(train_dl)
    for step in range(2 * STEPS):
        if step == STEPS:
            accelerator.save_state(folder)
            saved = accelerator.get_state_dict(model)
        x, y = next(batches)
        accelerator.pipeline_step(model, x, target=y)
        optimizer.step()
        optimizer.zero_grad()
    return {"saved": saved, "after": accelerator.get_state_dict(model)}


def _continue(folder: str, restore: bool) -> dict:
    """Load ``folder`` without pipelining (one process or DDP), then train the pp=2 run's next steps on
    the same global batches (each process its share)."""
    accelerator = Accelerator()
    model = make_transformer(seed=1, depth=DEPTH)  # other weights: all of them must come from the checkpoint
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(folder)
    plain = accelerator.unwrap_model(model)
    loaded = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    steps = [int(s["step"]) for s in optimizer.optimizer.state_dict()["state"].values()]
    if not restore:
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    data, rank, world = make_data(LENGTH), accelerator.process_index, accelerator.num_processes
    share = PER_REPLICA // world
    for step in range(STEPS, 2 * STEPS):
        start = step * PER_REPLICA + rank * share
        x, y = data[start : start + share]
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "kind": accelerator.distributed_type.value,
        "loaded": loaded,
        "steps": steps,
        "after": {k: v.detach().clone() for k, v in plain.state_dict().items()},
    }


def _diff(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> tuple[str, dict]:
    folder = str(tmp_path_factory.mktemp("pp2") / "ckpt")
    results = run_distributed(_pipelined, 2, folder, timeout=120)
    return folder, results[0]  # the gathered state dicts are on the main process


def test_pp2_checkpoint_loads_into_one_process_and_training_continues(pipelined):
    folder, expected = pipelined
    result = _continue(folder, restore=True)
    assert result["kind"] == "NO"
    assert all(torch.equal(result["loaded"][k], v) for k, v in expected["saved"].items())
    assert list(result["loaded"]) == list(expected["saved"])
    assert result["steps"] and set(result["steps"]) == {STEPS}  # every parameter's AdamW state came back
    restored = _diff(result["after"], expected["after"])
    assert restored <= TOLERANCE
    fresh = _diff(_continue(folder, restore=False)["after"], expected["after"])
    assert fresh > 100 * TOLERANCE  # without the saved AdamW state the same steps go elsewhere
    print(f"pp=2 -> 1 process: continued {restored:.1e} from pp=2 (fresh AdamW: {fresh:.1e})")


@pytest.mark.distributed
def test_pp2_checkpoint_loads_into_ddp_on_two_processes(pipelined):
    folder, expected = pipelined
    results = run_distributed(_continue, 2, folder, True, timeout=120)
    for result in results:
        assert result["kind"] == "MULTI_CPU"
        assert all(torch.equal(result["loaded"][k], v) for k, v in expected["saved"].items())
        assert set(result["steps"]) == {STEPS}
        assert _diff(result["after"], expected["after"]) <= TOLERANCE
    assert all(torch.equal(results[0]["after"][k], results[1]["after"][k]) for k in expected["after"])


def _single(folder: str) -> dict:
    """One process, no pipeline: 2 steps, save, 2 more steps."""
    accelerator = Accelerator()
    model = make_transformer(depth=DEPTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    data = make_data(LENGTH)
    for step in range(2 * STEPS):
        if step == STEPS:
            accelerator.save_state(folder)
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        x, y = data[step * PER_REPLICA : (step + 1) * PER_REPLICA]
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return {"saved": saved, "after": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _pipelined_from(folder: str) -> dict:
    config = ParallelismConfig(pp_size=2, pp_handler=_handler("1f1b", num_microbatches=2))
    accelerator = Accelerator(parallelism_config=config)
    model = make_transformer(seed=1, depth=DEPTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(folder)
    loaded = accelerator.get_state_dict(model)
    steps = [int(s["step"]) for s in optimizer.optimizer.state_dict()["state"].values()]
    data = make_data(LENGTH)
    for step in range(STEPS, 2 * STEPS):
        x, y = data[step * PER_REPLICA : (step + 1) * PER_REPLICA]
        accelerator.pipeline_step(model, x, target=y)
        optimizer.step()
        optimizer.zero_grad()
    return {"loaded": loaded, "steps": steps, "after": accelerator.get_state_dict(model)}


@pytest.mark.distributed
def test_one_process_checkpoint_loads_into_pp2(tmp_path):
    expected = _single(str(tmp_path / "ckpt"))
    results = run_distributed(_pipelined_from, 2, str(tmp_path / "ckpt"), timeout=120)
    main = results[0]  # the gathered state dicts are on the main process
    assert list(main["loaded"]) == list(expected["saved"])
    assert all(torch.equal(main["loaded"][k], v) for k, v in expected["saved"].items())
    for result in results:  # each pipeline rank restored the AdamW state of the parameters it holds
        assert result["steps"] and set(result["steps"]) == {STEPS}
    continued = _diff(main["after"], expected["after"])
    assert continued <= TOLERANCE
    print(f"1 process -> pp=2: continued {continued:.1e} from one process")
