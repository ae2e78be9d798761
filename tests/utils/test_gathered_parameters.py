"""``lockstep.utils.GatheredParameters``: under a real ZeRO-3 engine on 2 processes the parameters are whole
inside the block and equal the unsharded model, a change made on ``modifier_rank`` reaches every process and
one made without it is discarded; with parameters nothing partitioned (one process, DDP) it does nothing."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.fsdp_models import data_loader, make_transformer
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires


def _zero3_gathered() -> dict:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin, GatheredParameters

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    model = make_transformer()
    engine, _, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), data_loader(16, 4))
    module = accelerator.unwrap_model(engine)
    params = dict(module.named_parameters())
    first = params["embed.weight"]
    result: dict = {"outside": {name: p.numel() for name, p in params.items()}}
    with GatheredParameters(module.parameters()):
        result["inside"] = {name: p.detach().clone() for name, p in params.items()}
    result["outside_again"] = {name: p.numel() for name, p in params.items()}
    with GatheredParameters(first, modifier_rank=0), torch.no_grad():
        first.fill_(7.0 if accelerator.process_index == 0 else -1.0)
    with GatheredParameters(first), torch.no_grad():
        result["kept"] = first.detach().clone()
        first.fill_(9.0)  # no modifier_rank: discarded on exit
    with GatheredParameters([first]):
        result["discarded"] = first.detach().clone()
    return result


@requires("deepspeed")
@pytest.mark.distributed
@pytest.mark.usefixtures("deepspeed_preloaded")
def test_zero3_parameters_are_whole_inside_and_modifier_rank_changes_reach_every_process():
    expected = make_transformer().state_dict()
    for rank, result in enumerate(run_distributed(_zero3_gathered, 2, timeout=180)):
        assert set(result["inside"]) == {name for name in expected if name != "scale"}
        assert all(size == 0 for size in result["outside"].values()), rank  # partitioned away
        assert all(size == 0 for size in result["outside_again"].values()), rank
        for name, value in result["inside"].items():
            assert value.shape == expected[name].shape and torch.equal(value, expected[name]), (rank, name)
        assert torch.equal(result["kept"], torch.full((32, 8), 7.0)), rank  # rank 0's value everywhere
        assert torch.equal(result["discarded"], torch.full((32, 8), 7.0)), rank


def _data_parallel_change() -> list[float]:
    from lockstep import Accelerator
    from lockstep.utils import GatheredParameters

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(make_transformer())
    weight = accelerator.unwrap_model(model).embed.weight
    with GatheredParameters(model.parameters(), modifier_rank=0), torch.no_grad():
        weight.fill_(float(accelerator.process_index))
    return weight.flatten().tolist()


@pytest.mark.distributed
def test_without_zero3_nothing_is_gathered_or_broadcast():
    """Under DDP the context does nothing: each process keeps its own change (no broadcast from rank 0)."""
    on_rank_0, on_rank_1 = run_distributed(_data_parallel_change, 2)
    assert set(on_rank_0) == {0.0} and set(on_rank_1) == {1.0}


def test_one_process_yields_the_parameters_as_they_are_without_importing_deepspeed(monkeypatch):
    from lockstep.utils import GatheredParameters

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # any `import deepspeed` now raises ImportError
    model = make_transformer()
    weight = model.embed.weight
    before = weight.detach().clone()
    with GatheredParameters(model.parameters(), modifier_rank=0, enabled=True):
        assert model.embed.weight is weight and torch.equal(weight, before)
        with torch.no_grad():
            weight.add_(1.0)
    with GatheredParameters(weight):
        assert torch.equal(weight, before + 1.0)  # the change stays: nothing was partitioned or restored
