"""The GatheredForward capability: what the Seq2SeqTrainer asks before generating (synced_gpus, the root's
parameters gathered), instead of isinstance checks on FSDPModule and probes of the DeepSpeed plugin."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from lockstep import Accelerator, FullyShardedDataParallelPlugin
from lockstep.backends import GatheredForward
from tests.helpers.fsdp_models import make_transformer
from tests.helpers.multiprocess import run_distributed


def _fsdp_answers(world: int) -> dict:
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = accelerator.prepare(make_transformer())
    gathered = accelerator.capability(GatheredForward)
    assert gathered is not None
    sharded_before = all(isinstance(p, DTensor) for p in model.parameters())
    with gathered.root_parameters_gathered(model):
        some_whole_inside = any(not isinstance(p, DTensor) for p in model.parameters())
    plain = torch.nn.Linear(2, 2)
    with gathered.root_parameters_gathered(plain):  # not sharded: nothing to gather
        pass
    return {
        "model": gathered.gathers_in_forward(model),
        "plain": gathered.gathers_in_forward(plain),
        "sharded_before": sharded_before,
        "some_whole_inside": some_whole_inside,
        "sharded_after": all(isinstance(p, DTensor) for p in model.parameters()),
    }


@pytest.mark.distributed
def test_fsdp_models_gather_in_forward_and_the_root_is_gathered_meanwhile():
    for answers in run_distributed(_fsdp_answers, 2, 2):
        assert answers == {
            "model": True,
            "plain": False,
            "sharded_before": True,
            "some_whole_inside": True,
            "sharded_after": True,
        }


def test_one_process_without_sharding_has_no_gathered_forward():
    assert Accelerator(cpu=True).capability(GatheredForward) is None
