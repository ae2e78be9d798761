"""N processes on per-process batch b equal one process on the global batch N*b (SGD, within 1e-6)."""

import pytest
import torch

from lockstep import Accelerator, DataLoaderConfiguration, GradScalerKwargs
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import flat_params, loader, loss_fn, make_model, reference_training

LENGTH, EPOCHS, SEED = 48, 3, 1234


def _train(world_size: int, per_process_batch: int, options: dict) -> list:
    config = DataLoaderConfiguration(
        split_batches=options.get("split", False),
        dispatch_batches=options.get("dispatch"),
        use_seedable_sampler=options.get("shuffle", False),
        data_seed=SEED,
    )
    accelerator = Accelerator(
        dataloader_config=config,
        gradient_accumulation_steps=options.get("accumulation", 1),
        mixed_precision=options.get("precision", "no"),
        # A small initial loss scale, so that no fp16 step is skipped for overflow (skips are tested elsewhere).
        kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)],
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = per_process_batch * world_size if options.get("split") else per_process_batch
    train_dl = loader(LENGTH, batch, shuffle=options.get("shuffle", False))
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    losses = []
    for epoch in range(EPOCHS):
        if hasattr(train_dl, "set_epoch"):
            train_dl.set_epoch(epoch)
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return flat_params(accelerator.unwrap_model(model))


def _check(world_size: int, per_process_batch: int, options: dict, tolerance: float = 1e-6) -> None:
    results = run_distributed(_train, world_size, world_size, per_process_batch, options)
    accumulation = options.get("accumulation", 1)
    expected = reference_training(
        LENGTH,
        per_process_batch * world_size * accumulation,
        EPOCHS,
        shuffle_seed=SEED if options.get("shuffle") else None,
        accumulation=accumulation,
    )
    for rank, params in enumerate(results):
        assert torch.equal(params, results[0]), f"rank {rank} diverged from rank 0"
    difference = (results[0] - expected).abs().max().item()
    assert difference <= tolerance, f"max parameter difference {difference:.3g} > {tolerance:g}"


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_parity_plain(world_size):
    _check(world_size, 4, {})


@pytest.mark.distributed
@pytest.mark.parametrize(
    "options",
    [
        {"shuffle": True},
        {"split": True, "shuffle": True},
        {"dispatch": True},
        {"dispatch": True, "split": True},
    ],
    ids=["shuffle", "split+shuffle", "dispatch", "dispatch+split"],
)
def test_ddp_parity_data_modes(options):
    _check(2, 4, options)


@pytest.mark.distributed
def test_ddp_parity_three_processes_split_shuffle():
    _check(3, 2, {"split": True, "shuffle": True})


@pytest.mark.distributed
def test_gradient_accumulation_equals_a_bigger_batch():
    _check(2, 2, {"accumulation": 2, "shuffle": True})


@pytest.mark.distributed
@pytest.mark.parametrize(("precision", "tolerance"), [("bf16", 5e-3), ("fp16", 1e-3)])
def test_mixed_precision_stays_close_to_fp32(precision, tolerance):
    _check(2, 4, {"precision": precision}, tolerance=tolerance)


def test_single_process_matches_reference():
    params = _train(1, 8, {"shuffle": True})
    expected = reference_training(LENGTH, 8, EPOCHS, shuffle_seed=SEED)
    assert (params - expected).abs().max().item() <= 1e-6
