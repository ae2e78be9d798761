"""LocalSGD on 2 and 3 real processes against a hand-written reference that simulates every rank in one.

Each rank trains a tiny model with SGD on its own batches, without gradient all-reduce; every
``local_sgd_steps`` steps (and when the ``with`` block ends) the parameters become their mean over the
ranks. The reference does exactly that with one model per rank in one process.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from lockstep import Accelerator, FullyShardedDataParallelPlugin
from lockstep.backends.capabilities import JointPreparation, PipelineSchedule
from lockstep.local_sgd import LocalSGD
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import FEATURES, flat_params, make_model

LR = 0.1
BATCH = 4


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: every rank its own data, drawn alike here and in the reference."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    y = (x.sum(dim=1, keepdim=True) * (rank + 1)).tanh()  # ranks pull towards different targets
    return x, y


def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> None:
    x, y = batch
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def reference(world: int, steps: int, local_sgd_steps: int | None, *, final_sync: bool) -> list[torch.Tensor]:
    """Every rank's flat parameters after ``steps`` local steps, averaged every ``local_sgd_steps``."""
    models = [make_model() for _ in range(world)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    for step in range(1, steps + 1):
        for rank in range(world):
            _sgd_step(models[rank], optimizers[rank], _batch(rank, step))
        if local_sgd_steps is not None and step % local_sgd_steps == 0:
            _average(models)
    if final_sync:
        _average(models)
    return [flat_params(m) for m in models]


def _average(models: list[nn.Module]) -> None:
    with torch.no_grad():
        for params in zip(*(m.parameters() for m in models), strict=True):
            mean = torch.stack([p for p in params]).mean(dim=0)
            for p in params:
                p.copy_(mean)


# -- the workers ----------------------------------------------------------------------------------------
def _train(steps: int, local_sgd_steps: int | None, enabled: bool, use_context: bool) -> dict:
    accelerator = Accelerator()
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    averaged_at: list[int] = []
    local_sgd = LocalSGD(
        accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps, enabled=enabled
    )
    _record_averages(local_sgd, averaged_at)
    rank = accelerator.process_index
    # Without the block, step() still averages (Accelerate allows it) and DDP keeps syncing gradients.
    with local_sgd if use_context else contextlib.nullcontext():
        for step in range(1, steps + 1):
            with accelerator.accumulate(model):  # as in Accelerate's example: it must not re-enable sync
                x, y = _batch(rank, step)
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
    return {
        "params": flat_params(model),
        "averaged_at": averaged_at,
        "num_steps": local_sgd.num_steps,
        "enabled": local_sgd.enabled,
    }


def _record_averages(local_sgd: LocalSGD, averaged_at: list[int]) -> None:
    """Wrap the instance's averaging so that the worker reports the step count at each call."""
    average = local_sgd._sync_and_avg_model_params

    def recording() -> None:
        averaged_at.append(local_sgd.num_steps)
        average()

    local_sgd._sync_and_avg_model_params = recording  # type: ignore[method-assign]


def _assert_close(results: list[dict], expected: list[torch.Tensor]) -> None:
    for rank, result in enumerate(results):
        assert (result["params"] - expected[rank]).abs().max().item() <= 1e-6, f"rank {rank}"


# -- the tests ------------------------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_parameters_are_averaged_every_local_sgd_steps_as_the_reference(world):
    results = run_distributed(_train, world, 7, 3, True, True)
    expected = reference(world, 7, 3, final_sync=True)
    _assert_close(results, expected)
    for result in results:
        assert result["enabled"] and result["num_steps"] == 7
        assert result["averaged_at"] == [3, 6, 7]  # every third step, then the block's end
        assert torch.equal(result["params"], results[0]["params"])  # the final average: one model
    # The averages mattered: without them the ranks differ, and averaging every step gives other weights.
    unaveraged = reference(world, 7, None, final_sync=False)
    assert (unaveraged[0] - unaveraged[1]).abs().max().item() > 1e-3
    assert (reference(world, 7, 1, final_sync=True)[0] - expected[0]).abs().max().item() > 1e-4


@pytest.mark.distributed
def test_averages_happen_on_exactly_the_expected_steps_and_once_more_on_exit():
    # 6 steps with local_sgd_steps=2: averages after 2, 4, 6 and on exit (a no-op on equal replicas).
    results = run_distributed(_train, 2, 6, 2, True, True)
    _assert_close(results, reference(2, 6, 2, final_sync=True))
    assert results[0]["averaged_at"] == [2, 4, 6, 6]


@pytest.mark.distributed
def test_disabled_means_no_averaging_and_ddp_syncs_gradients_as_usual():
    results = run_distributed(_train, 2, 5, 2, False, True)
    # Disabled, the DDP model all-reduces gradients as usual: every rank takes the mean-gradient step,
    # which for SGD from equal weights is the reference averaged after every step.
    _assert_close(results, reference(2, 5, 1, final_sync=False))
    assert [r["averaged_at"] for r in results] == [[], []]
    assert [(r["enabled"], r["num_steps"]) for r in results] == [(False, 5), (False, 5)]
    assert torch.equal(results[0]["params"], results[1]["params"])


def _train_disabled_without_ddp(steps: int) -> torch.Tensor:
    accelerator = Accelerator()
    model = make_model()  # not prepared: no gradient all-reduce at all
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=None, enabled=False) as local_sgd:
        for step in range(1, steps + 1):
            _sgd_step(model, optimizer, _batch(accelerator.process_index, step))
            local_sgd.step()
    return flat_params(model)


@pytest.mark.distributed
def test_disabled_leaves_independent_replicas_apart():
    # Replicas that train on their own are left to diverge: nothing averages them, not even the exit.
    results = run_distributed(_train_disabled_without_ddp, 2, 4)
    expected = reference(2, 4, None, final_sync=False)
    for rank in range(2):
        assert torch.equal(results[rank], expected[rank])
    assert (results[0] - results[1]).abs().max().item() > 1e-3


@pytest.mark.distributed
def test_step_without_the_block_averages_but_keeps_gradients_synced():
    # Outside the with block DDP all-reduces gradients, so all ranks take the mean-gradient step (the
    # reference averages the ranks' parameters after every step, which is the same for plain SGD).
    results = run_distributed(_train, 2, 4, 2, True, False)
    _assert_close(results, reference(2, 4, 1, final_sync=False))
    assert results[0]["averaged_at"] == [2, 4]  # no block, no final average


def _exception_in_block() -> dict:
    accelerator = Accelerator()
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    averaged_at: list[int] = []
    local_sgd = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=5)
    _record_averages(local_sgd, averaged_at)
    with pytest.raises(RuntimeError, match="stop"), local_sgd:
        inside = model.require_backward_grad_sync
        _sgd_step(model, optimizer, _batch(accelerator.process_index, 1))
        local_sgd.step()
        raise RuntimeError("stop")
    return {
        "inside": inside,
        "after": model.require_backward_grad_sync,
        "averaged_at": averaged_at,
        "bad_steps": [_bad_steps(accelerator, model, steps) for steps in (0, None, 2.0)],
    }


def _bad_steps(accelerator: Accelerator, model: nn.Module, steps: object) -> str:
    try:
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=steps)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.distributed
def test_an_exception_skips_the_final_average_and_bad_local_sgd_steps_are_refused():
    results = run_distributed(_exception_in_block, 2)
    assert [(r["inside"], r["after"], r["averaged_at"]) for r in results] == [(False, True, [])] * 2
    zero, none, float_steps = results[0]["bad_steps"]
    assert zero.startswith("ValueError: LocalSGD(local_sgd_steps=0) is invalid: it must be >= 1")
    assert "Pass 1 to average after every step, or enabled=False" in zero
    assert none.startswith("TypeError: LocalSGD(local_sgd_steps=None) is invalid: it must be an int")
    assert float_steps.startswith("TypeError: LocalSGD(local_sgd_steps=2.0) is invalid: it must be an int")


def _one_process_is_a_no_op() -> tuple:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(make_model())
    local_sgd = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=1)
    before = flat_params(model)
    with local_sgd:
        local_sgd.step()
    return local_sgd.enabled, local_sgd.num_steps, torch.equal(before, flat_params(model))


def test_on_one_process_it_is_disabled():
    assert _one_process_is_a_no_op() == (False, 1, True)


# -- wrong uses -----------------------------------------------------------------------------------------
def test_a_model_that_is_not_a_module_is_refused():
    accelerator = Accelerator(cpu=True)
    with pytest.raises(TypeError, match=r"LocalSGD\(model=dict\) is invalid: it must be the torch.nn.Module"):
        LocalSGD(accelerator=accelerator, model={}, local_sgd_steps=2)  # type: ignore[arg-type]


def _fsdp_refusal() -> str:
    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    model = accelerator.prepare(make_model())
    try:
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2, enabled=False)
    except NotImplementedError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_sharded_parameters_are_refused_naming_what_was_passed():
    message = run_distributed(_fsdp_refusal, 2)[0]
    assert message.startswith(
        "LocalSGD(model=FSDPSequential) on an Accelerator with distributed_type=FSDP is not supported: "
        "parameter '0.weight' is a DTensor, not a plain tensor (sharded over processes by FSDP or tensor "
        "parallelism)."
    ), message


class _FakeAccelerator:
    """Only what LocalSGD asks of an Accelerator: a unit-test stand-in for the backends too slow to start
    here (DeepSpeed builds native code on first use)."""

    def __init__(self, kind: type, distributed_type: str) -> None:
        self.kind = kind
        self.distributed_type = distributed_type
        self.num_processes = 2

    def capability(self, kind: type) -> object | None:
        return object() if kind is self.kind else None


@pytest.mark.parametrize(
    ("kind", "distributed_type", "reason"),
    [
        (JointPreparation, "DEEPSPEED", "the model and its optimizer are one engine that keeps its own copy"),
        (PipelineSchedule, "MULTI_CPU", "each process holds a different stage of the model"),
    ],
)
def test_engines_and_pipeline_stages_are_refused_by_capability(kind, distributed_type, reason):
    accelerator = _FakeAccelerator(kind, distributed_type)
    with pytest.raises(NotImplementedError) as caught:
        LocalSGD(accelerator=accelerator, model=make_model(), local_sgd_steps=2)  # type: ignore[arg-type]
    assert str(caught.value).startswith(
        f"LocalSGD(model=Sequential) on an Accelerator with distributed_type={distributed_type} is not "
        f"supported: {reason}"
    )
