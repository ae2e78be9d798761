"""Layers are step hooks (issue 44, item 2): one list the Accelerator owns and gives to what it prepares."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep import Accelerator
from lockstep.step_hooks import StepHook, StepHooks
from tests.helpers.multiprocess import run_distributed


class Recorder(StepHook):
    """Writes every moment it sees into ``events``; vetoes the steps whose number is in ``veto``."""

    def __init__(self, name: str, events: list[str], veto: frozenset[int] = frozenset()) -> None:
        self.name, self.events, self.veto = name, events, veto
        self.steps = 0

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self.events.append(f"{self.name} batch")
            yield batch

    @contextlib.contextmanager
    def around_backward(self) -> Iterator[None]:
        self.events.append(f"{self.name} backward(")
        yield
        self.events.append(f"{self.name} )backward")

    @contextlib.contextmanager
    def around_optimizer_step(self, optimizer: object) -> Iterator[None]:
        self.steps += 1
        self.events.append(f"{self.name} step(")
        yield
        self.events.append(f"{self.name} )step")

    def commit(self, optimizer: object) -> bool:
        self.events.append(f"{self.name} commit")
        return self.steps not in self.veto


class OnlyCommits(StepHook):
    def __init__(self) -> None:
        self.asked = 0

    def commit(self, optimizer: object) -> bool:
        self.asked += 1
        return True


def test_contexts_nest_in_the_order_hooks_were_added_and_unwind_on_errors():
    events: list[str] = []
    hooks = StepHooks([Recorder("a", events), Recorder("b", events)])
    with pytest.raises(RuntimeError, match="inside"), hooks.around_optimizer_step(object()):
        events.append("the step")
        raise RuntimeError("inside")
    assert events == ["a step(", "b step(", "the step"]  # contextmanager exits do not run after a raise
    events.clear()
    with hooks.around_backward():
        events.append("backward")
    assert events == ["a backward(", "b backward(", "backward", "b )backward", "a )backward"]


def test_only_hooks_that_override_a_moment_are_run_for_it():
    only = OnlyCommits()
    hooks = StepHooks([only])
    batches = iter([1, 2])
    assert hooks.batches(batches) is batches  # nothing wraps the batches
    assert hooks.around_optimizer_step(object()) is hooks.around_backward()  # the shared do-nothing context
    assert hooks.decides_commits and hooks.commit(object()) and only.asked == 1
    assert StepHooks([Recorder("a", [])]).decides_commits  # Recorder answers commit too
    assert not StepHooks().decides_commits


def test_every_hook_is_asked_whether_the_step_is_applied_also_after_a_veto():
    only = OnlyCommits()
    hooks = StepHooks([Recorder("veto", [], veto=frozenset({0})), only])
    assert hooks.commit(object()) is False and only.asked == 1


def test_a_hook_must_be_a_step_hook_and_added_once():
    hooks = StepHooks()
    with pytest.raises(
        TypeError, match=r"add_step_hook\(<object .*\) is invalid: a step hook is an instance"
    ):
        hooks.add(object())  # type: ignore[arg-type]
    hook = OnlyCommits()
    hooks.add(hook)
    with pytest.raises(ValueError, match="this hook runs already; add it once"):
        hooks.add(hook)
    hooks.remove(hook)
    assert list(hooks) == [] and hooks.commit(object()) and not hooks.decides_commits


def _prepared(accelerator: Accelerator) -> tuple[nn.Module, Any, Any, DataLoader]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(torch.ones(6, 2), batch_size=2)
    return accelerator.prepare(model, optimizer, scheduler, loader)


def test_the_accelerator_runs_an_added_hook_around_each_step_and_a_veto_discards_the_step():
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler, loader = _prepared(accelerator)
    events: list[str] = []
    accelerator.add_step_hook(Recorder("layer", events, veto=frozenset({2})))  # after prepare: acts too
    lrs, skipped, changed = [], [], []
    for batch in loader:
        before = model.weight.detach().clone()
        accelerator.backward(model(batch).sum())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
        skipped.append(accelerator.optimizer_step_was_skipped)
        changed.append(not torch.equal(model.weight, before))
    assert skipped == [False, True, False]
    assert changed == [True, False, True]  # the vetoed step was not applied
    assert lrs == [0.05, 0.05, 0.025]  # and left the scheduler where it was
    one_step = [
        "layer batch",
        "layer backward(",
        "layer )backward",
        "layer step(",
        "layer commit",
        "layer )step",
    ]
    assert events == one_step * 3
    assert optimizer._step_hooks is accelerator._step_hooks and loader._step_hooks is accelerator._step_hooks


def test_a_closure_is_refused_where_a_hook_decides_the_commit():
    accelerator = Accelerator(cpu=True)
    _, optimizer, _, _ = _prepared(accelerator)
    accelerator.add_step_hook(OnlyCommits())
    with pytest.raises(
        ValueError, match=r"step\(closure\) cannot run under step hooks .*\(OnlyCommits; e\.g\."
    ):
        optimizer.step(lambda: 0.0)


def test_a_loader_that_skips_batches_runs_the_hooks_of_the_loader_it_continues():
    accelerator = Accelerator(cpu=True)
    _, _, _, loader = _prepared(accelerator)
    events: list[str] = []
    accelerator.add_step_hook(Recorder("layer", events))
    assert [batch.shape[0] for batch in accelerator.skip_first_batches(loader, 2)] == [2]
    assert events == ["layer batch"]


def test_micro_steps_of_accumulation_run_no_optimizer_step_hook():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
    model, optimizer, _, loader = _prepared(accelerator)
    hook = Recorder("layer", [])
    accelerator.add_step_hook(hook)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(batch).sum())
            optimizer.step()
    assert hook.steps == 1


def _watchdog_steps() -> tuple[int, int]:
    from lockstep.diagnostics import HangDetectionKwargs, active_watchdog

    accelerator = Accelerator(kwargs_handlers=[HangDetectionKwargs(timeout=60)])
    model, optimizer, _, loader = _prepared(accelerator)
    watchdog = active_watchdog.current()
    assert watchdog is not None
    before = watchdog.steps
    for batch in loader:
        accelerator.backward(model(batch).sum())
        optimizer.step()
    counted = watchdog.steps - before
    hooks = len(accelerator._step_hooks)
    accelerator.end_training()
    return counted, hooks


@pytest.mark.distributed
def test_the_hang_watchdog_counts_each_optimizer_step_through_its_step_hook():
    assert run_distributed(_watchdog_steps, 2, timeout=120) == [(2, 1), (2, 1)]  # 3 batches of 2 over 2 ranks
