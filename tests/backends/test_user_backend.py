"""A backend and a tracker written in user code (this module, not ``src/``), registered through the public
extension points, train 2 processes through prepare, backward, accumulate, clip_grad_norm_, save_state and
load_state bitwise like the built-in DDP path, and are picked up by ``lockstep launch``.

The backend is data parallelism by hand: rank 0's weights broadcast at wrap time, gradients all-reduced
and divided by the world size after each synchronising backward (what DDP does with its buckets).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lockstep import Accelerator
from lockstep.backends import Backend, register_backend, select_backend, unregister_backend
from lockstep.backends.capabilities import TrainingStateTransfer
from lockstep.config.enums import DistributedType
from lockstep.tracking import GeneralTracker, register_tracker_class, registry
from tests.helpers.multiprocess import run_distributed
from tests.helpers.training import flat_params, loader, loss_fn, make_model

REPO = Path(__file__).resolve().parents[2]
STEPS_PER_EPOCH, EPOCHS = 6, 2


@dataclass
class HandAllReducePlugin:
    """Selects :class:`HandAllReduceBackend` when given in ``Accelerator(kwargs_handlers=[...])``."""

    divide_after: bool = True


class HandAllReduceBackend(Backend):
    """Data parallel by hand: broadcast at wrap, all-reduce gradients after each synchronising backward."""

    distributed_type = DistributedType.MULTI_CPU

    def __init__(self, state: Any, *, precision: Any, dynamo_plugin: Any = None) -> None:
        super().__init__(state, precision=precision, dynamo_plugin=dynamo_plugin)
        self.models: list[nn.Module] = []
        self.synchronising = True
        self.all_reduces = 0

    def wrap_model(self, model: nn.Module) -> nn.Module:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
        self.models.append(model)
        return model

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        super().backward(loss, **kwargs)
        if not self.synchronising:
            return
        for model in self.models:
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter.grad.div_(self.state.num_processes)
                    dist.all_reduce(parameter.grad)
                    self.all_reduces += 1

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self.synchronising = False
        try:
            yield
        finally:
            self.synchronising = True


class StepSumTracker(GeneralTracker):
    """Keeps every logged value (its list is read back by the test)."""

    name = "step-sum"
    requires_logging_directory = False
    logged: list[tuple[int | None, dict[str, Any]]] = []

    def __init__(self, run_name: str, **kwargs: Any) -> None:
        self.run_name = run_name

    @property
    def tracker(self) -> Any:
        return self.logged

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        return None

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.logged.append((step, dict(values)))


def register_user_parts() -> None:
    register_backend("hand-all-reduce", plugin_type=HandAllReducePlugin, replace=True)(HandAllReduceBackend)
    register_tracker_class(StepSumTracker)


@pytest.fixture
def user_parts() -> Iterator[None]:
    saved = dict(registry.LOGGER_TYPE_TO_CLASS)
    register_user_parts()
    yield
    unregister_backend("hand-all-reduce")
    registry.LOGGER_TYPE_TO_CLASS.clear()
    registry.LOGGER_TYPE_TO_CLASS.update(saved)


def _train(accelerator: Accelerator, model: nn.Module, optimizer: Any, batches: Any, epochs: range) -> None:
    for epoch in epochs:
        for step, batch in enumerate(batches):
            with accelerator.accumulate(model):
                loss = loss_fn(model, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
            accelerator.log({"loss": loss.item()}, step=epoch * STEPS_PER_EPOCH + step)


def _run(user: bool, folder: str) -> dict[str, Any]:
    """Train one epoch, save, then a new Accelerator (different starting weights) loads and trains one more."""
    results: dict[str, Any] = {}
    for attempt in ("first", "resumed"):
        accelerator = Accelerator(
            gradient_accumulation_steps=2,
            kwargs_handlers=[HandAllReducePlugin()] if user else [],
            log_with="step-sum" if user else None,
        )
        if user:
            accelerator.init_trackers("user-backend")
        model = make_model(seed=0 if attempt == "first" else 99)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        batches = loader(4 * STEPS_PER_EPOCH * 2, 4)
        model, optimizer, batches = accelerator.prepare(model, optimizer, batches)
        if attempt == "first":
            _train(accelerator, model, optimizer, batches, range(1))
            accelerator.save_state(folder)
        else:
            accelerator.load_state(folder)
            optimizer_state = optimizer.state_dict()["state"]
            results["resumed_step"] = int(optimizer_state[0]["step"]) if optimizer_state else 0
            results["loaded"] = flat_params(accelerator.unwrap_model(model))
            _train(accelerator, model, optimizer, batches, range(1, EPOCHS))
        results[attempt] = flat_params(accelerator.unwrap_model(model))
        results[f"{attempt}_backend"] = type(accelerator.backend).__name__
        results["all_reduces"] = getattr(accelerator.backend, "all_reduces", None)
        accelerator.end_training()
    results["logged"] = list(StepSumTracker.logged)
    return results


def _both(tmp: str) -> dict[str, Any]:
    return {"ddp": _run(False, f"{tmp}/ddp"), "user": _run(True, f"{tmp}/user")}


def test_a_user_backend_and_tracker_train_and_resume_bitwise_like_ddp(tmp_path, user_parts):
    ranks = run_distributed(_both, 2, str(tmp_path), timeout=180)
    for rank in ranks:
        ddp, user = rank["ddp"], rank["user"]
        assert (ddp["first_backend"], user["first_backend"]) == ("DDPBackend", "HandAllReduceBackend")
        assert user["all_reduces"] > 0
        assert user["resumed_step"] == ddp["resumed_step"] == STEPS_PER_EPOCH // 2  # optimizer steps restored
        assert torch.equal(user["loaded"], user["first"])  # the resumed run started from other weights
        assert torch.equal(user["first"], ddp["first"])
        assert torch.equal(user["resumed"], ddp["resumed"])
        assert not torch.equal(user["first"], user["resumed"])
    assert torch.equal(ranks[0]["user"]["resumed"], ranks[1]["user"]["resumed"])
    logged = ranks[0]["user"]["logged"]
    assert [step for step, _ in logged] == list(range(EPOCHS * STEPS_PER_EPOCH))
    assert ranks[1]["user"]["logged"] == []  # trackers log on the main process only


def test_a_registered_backend_is_chosen_only_by_its_plugin_and_offers_only_its_capabilities(user_parts):
    from lockstep.state import PartialState

    state = PartialState(cpu=True)
    assert type(select_backend(state)).__name__ == "SingleProcessBackend"
    chosen = select_backend(state, plugins=(HandAllReducePlugin(),))
    assert type(chosen) is HandAllReduceBackend
    assert chosen.capability(TrainingStateTransfer) is None
    assert select_backend(state).capability(TrainingStateTransfer) is not None


def test_register_backend_refuses_what_is_not_a_backend():
    with pytest.raises(TypeError, match=r"decorates a subclass of lockstep.backends.Backend"):
        register_backend("not-one", plugin_type=HandAllReducePlugin)(HandAllReducePlugin)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"plugin_type=...\) takes a class"):
        register_backend("not-one", plugin_type=HandAllReducePlugin())  # type: ignore[arg-type]


def test_a_taken_name_is_refused_unless_replaced(user_parts):
    with pytest.raises(ValueError, match=r"A backend named 'hand-all-reduce' is registered already"):
        register_backend("hand-all-reduce", plugin_type=HandAllReducePlugin)(HandAllReduceBackend)


def _script_main() -> None:
    """``lockstep launch`` runs this file: the user's script registers its parts and trains."""
    register_user_parts()
    folder = sys.argv[1]
    result = _run(True, folder)
    if int(os.environ["RANK"]) == 0:
        print(f"backend {result['first_backend']} resumed at {result['resumed_step']}")
        print("checksum", float(result["resumed"].double().sum()))


@pytest.mark.slow
@pytest.mark.distributed
def test_lockstep_launch_runs_a_script_that_registers_its_own_backend(tmp_path, user_parts):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "lockstep.cli.main",
            "launch",
            "--num-processes",
            "2",
            __file__,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert f"backend HandAllReduceBackend resumed at {STEPS_PER_EPOCH // 2}" in launched.stdout
    expected = run_distributed(_both, 2, str(tmp_path / "in-process"), timeout=180)[0]["ddp"]["resumed"]
    checksum = float(launched.stdout.split("checksum")[-1].split()[0])
    assert checksum == float(expected.double().sum())


if __name__ == "__main__":
    _script_main()
