"""The training step on real process groups: accumulation without all-reduce, fp16 skips, schedulers."""

import pytest
import torch
from torch import nn

from lockstep import Accelerator, GradScalerKwargs
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import flat_params, loader, loss_fn, make_model


def _count_allreduces(accumulation: int, batches: int) -> tuple[int, list[bool]]:
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, loader(batches * 2 * 2, 2))
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        tensor = bucket.buffer().div_(torch.distributed.get_world_size())
        return torch.distributed.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    model.register_comm_hook(None, counting_hook)
    sync_flags = []
    for batch in train_dl:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, batch))
            sync_flags.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    return len(calls), sync_flags


@pytest.mark.distributed
def test_accumulation_skips_allreduce_on_micro_steps():
    (count, flags), _ = run_distributed(_count_allreduces, 2, 2, 8)
    assert flags == [False, True] * 4
    assert count == 4  # one bucket per synchronised backward, none on micro-steps


@pytest.mark.distributed
def test_last_batch_of_the_loader_always_synchronises():
    (count, flags), _ = run_distributed(_count_allreduces, 2, 2, 5)
    assert flags == [False, True, False, True, True]
    assert count == 3


@pytest.mark.distributed
def test_no_accumulation_synchronises_every_step():
    (count, flags), _ = run_distributed(_count_allreduces, 2, 1, 4)
    assert flags == [True] * 4 and count == 4


def _scheduler_steps(split: bool) -> list[float]:
    from lockstep import DataLoaderConfiguration

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=split))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    lrs = []
    for _ in range(2):
        accelerator.backward(loss_fn(model, (torch.randn(4, 6), torch.randn(4, 1))))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


@pytest.mark.distributed
def test_prepared_scheduler_steps_num_processes_times_unless_split():
    not_split, _ = run_distributed(_scheduler_steps, 2, False)
    assert not_split == [1 / 3, 1 / 5]  # two scheduler steps per optimizer step
    split, _ = run_distributed(_scheduler_steps, 2, True)
    assert split == [1 / 2, 1 / 3]


def _clip_norm() -> tuple[float, float]:
    accelerator = Accelerator()
    model = accelerator.prepare(make_model())
    x = torch.arange(24.0).reshape(4, 6) / 10 + accelerator.process_index
    y = torch.ones(4, 1)
    accelerator.backward(loss_fn(model, (x, y)))
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.5)
    clipped = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
    return norm.item(), clipped


@pytest.mark.distributed
def test_clip_grad_norm_uses_the_global_gradient():
    results = run_distributed(_clip_norm, 2)
    reference = make_model()
    x = torch.cat([torch.arange(24.0).reshape(4, 6) / 10 + r for r in range(2)])
    nn.functional.mse_loss(reference(x), torch.ones(8, 1)).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()]).norm().item()
    for norm, clipped in results:
        assert abs(norm - expected) < 1e-5
        assert abs(clipped - 0.5) < 1e-5


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = flat_params(model)
    loss = model(torch.full((2, 6), 1e4)).sum() * 1e4
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped
    assert torch.equal(flat_params(model), before)
    assert scheduler.get_last_lr() == [0.1]
    assert accelerator.scaler.get_scale() == 512.0
    optimizer.zero_grad()
    accelerator.backward(loss_fn(model, (torch.randn(2, 6), torch.randn(2, 1))))
    optimizer.step()
    scheduler.step()
    assert not accelerator.optimizer_step_was_skipped
    assert not torch.equal(flat_params(model), before)
    assert scheduler.get_last_lr() == [0.05]


def test_autocast_outputs_are_fp32_and_unwrap_removes_the_wrapper():
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(make_model())
    assert model(torch.randn(3, 6)).dtype == torch.float32
    with accelerator.autocast():
        assert nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.bfloat16
    inner = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert "forward" not in inner.__dict__
    assert type(inner) is nn.Sequential


def _ddp_with_compile() -> tuple[str, str, str]:
    accelerator = Accelerator(dynamo_backend="eager")
    model = accelerator.prepare(make_model())
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    return type(model).__name__, type(model.module).__name__, type(unwrapped).__name__


@pytest.mark.distributed
def test_dynamo_compiles_before_the_ddp_wrap():
    result, _ = run_distributed(_ddp_with_compile, 2)
    assert result == ("DistributedDataParallel", "OptimizedModule", "Sequential")
