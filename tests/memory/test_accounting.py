"""Memory accounting: bytes of unique storages in parameters, gradients and optimizer state."""

import pytest
import torch
from torch import nn

from lockstep import Accelerator
from lockstep.memory.accounting import account_memory
from tests.helpers.multiprocess import run_distributed


def _train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 32)).sum().backward()
    optimizer.step()


def test_adamw_holds_four_plus_four_plus_eight_bytes_per_parameter():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    n = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    before = account_memory(model, optimizer)
    assert (before.num_parameters, before.parameter_bytes, before.gradient_bytes) == (n, 4 * n, 0)
    assert before.optimizer_state_bytes == 0
    _train_one_step(model, optimizer)
    after = account_memory(model, [optimizer])
    steps = 4 * 4  # one fp32 "step" scalar per parameter tensor
    assert (after.gradient_bytes, after.optimizer_state_bytes) == (4 * n, 8 * n + steps)
    assert after.model_state_bytes == 16 * n + steps
    assert after.peak_rss_bytes > 50 * 2**20  # torch alone is far above 50 MiB
    as_dict = after.as_dict()
    assert as_dict["model_state_bytes"] == after.model_state_bytes and as_dict["peak_device_bytes"] is None


def test_tied_weights_and_views_count_once_and_bf16_counts_two_bytes():
    embedding = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = embedding.weight  # tied, as in language models
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    assert account_memory(model).parameter_bytes == 100 * 16 * 4
    view_model = nn.Module()
    base = torch.zeros(10, 10)
    view_model.a = nn.Parameter(base[:5])
    view_model.b = nn.Parameter(base[5:])  # two views into one 400-byte storage
    assert account_memory(view_model).parameter_bytes == 400
    assert account_memory(nn.Linear(10, 10).to(torch.bfloat16)).parameter_bytes == 110 * 2
    assert account_memory(nn.Linear(10, 10, device="meta")).parameter_bytes == 0


def _prepared_ddp_account(gradient_as_bucket_view: bool) -> dict:
    from lockstep import DistributedDataParallelKwargs

    kwargs = DistributedDataParallelKwargs(gradient_as_bucket_view=gradient_as_bucket_view)
    accelerator = Accelerator(kwargs_handlers=[kwargs])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(4, 32)).sum())
    optimizer.step()
    return account_memory(model, optimizer).as_dict()


@pytest.mark.distributed
def test_prepared_ddp_model_and_optimizer_on_two_processes():
    n = 32 * 256 + 256 + 256 * 8 + 8
    for bucket_view in (False, True):
        rank0, rank1 = run_distributed(_prepared_ddp_account, 2, bucket_view)
        assert rank0 == {**rank1, "peak_rss_bytes": rank0["peak_rss_bytes"]}
        assert rank0["num_parameters"] == n and rank0["parameter_bytes"] == 4 * n
        # As bucket views the gradients share DDP's flat bucket storage: counted once, at its full size.
        assert rank0["gradient_bytes"] == 4 * n
        assert rank0["optimizer_state_bytes"] == 8 * n + 4 * 4
