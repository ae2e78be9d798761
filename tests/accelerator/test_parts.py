"""The parts the Accelerator composes, each built and tested on its own (no Accelerator)."""

from __future__ import annotations

import pytest
import torch

from lockstep.accelerator.accumulation import GradientAccumulation
from lockstep.accelerator.optimizer import AcceleratedOptimizer
from lockstep.accelerator.prepared import PreparedObjects
from lockstep.accelerator.process_view import ProcessView
from lockstep.accelerator.trackers import Trackers
from lockstep.config.plugins import GradientAccumulationPlugin
from lockstep.config.project import ProjectConfiguration
from lockstep.state import GradientState, PartialState
from lockstep.tracking.base import GeneralTracker


class _Recorder(GeneralTracker):
    name = "recorder"

    def __init__(self) -> None:
        self.values: list[tuple[int | None, dict]] = []
        self.finished = False

    @property
    def tracker(self) -> list:
        return self.values

    def log(self, values, step=None, **kwargs):
        self.values.append((step, dict(values)))

    def finish(self):
        self.finished = True


def _optimizer() -> AcceleratedOptimizer:
    return AcceleratedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))


def test_prepared_objects_match_schedulers_to_their_optimizers():
    prepared = PreparedObjects()
    first, second = _optimizer(), _optimizer()
    prepared.optimizers += [first, second]
    scheduler = torch.optim.lr_scheduler.StepLR(second.optimizer, step_size=1)
    assert prepared.optimizers_of(scheduler) == [second]
    unrelated = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), 1)
    assert prepared.optimizers_of(unrelated) == [first, second]  # names none: follows them all


def test_prepared_objects_register_and_forget():
    prepared = PreparedObjects()
    with pytest.raises(ValueError, match=r"invalid:\n\t- Item at index 1, `int`\nregister_for_checkpointing"):
        prepared.register_for_checkpointing((torch.nn.Linear(1, 1), 3))
    model = torch.nn.Linear(1, 1)
    prepared.register_for_checkpointing((model,))
    prepared.models.append(model)
    prepared.optimizers.append(_optimizer())
    assert prepared.has_model(model) and not prepared.has_model(torch.nn.Linear(1, 1))
    prepared.forget_prepared()
    assert prepared.models == [] and prepared.optimizers == [] and prepared.custom == [model]


def test_accumulation_synchronises_every_n_micro_batches_and_at_the_end_of_the_loader():
    state = GradientState(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    accumulation = GradientAccumulation(state)
    syncs = []
    for _ in range(4):
        accumulation.advance()
        syncs.append(state.sync_gradients)
    assert syncs == [False, False, True, False] and accumulation.step == 4

    class _EndedLoader:
        end_of_dataloader = True
        remainder = -1

    state._add_dataloader(_EndedLoader())
    accumulation.advance()  # the loader ended: synchronise now, and start the next cycle at 0
    assert state.sync_gradients and accumulation.step == 0


def test_trackers_start_log_and_finish_on_their_own():
    recorder = _Recorder()
    trackers = Trackers(recorder, project=ProjectConfiguration(), is_main_process=True)
    assert not trackers.active
    trackers.start("run")
    trackers.log({"loss": 0.5}, step=3)
    assert trackers.active and trackers.get("recorder", unwrap=True) == [(3, {"loss": 0.5})]
    with pytest.raises(ValueError, match=r"get_tracker\('csv'\): no such tracker was configured"):
        trackers.get("csv")
    trackers.finish()
    assert recorder.finished and trackers.started == []


def test_process_view_needs_only_a_process_state():
    view = ProcessView(PartialState(cpu=True))
    assert (view.num_processes, view.process_index, view.is_main_process) == (1, 0, True)
    assert view.device == torch.device("cpu")
    calls = []
    view.on_main_process(lambda: calls.append("main"))()
    with view.main_process_first():
        calls.append("inside")
    view.wait_for_everyone()
    assert calls == ["main", "inside"]
    with pytest.raises(ValueError, match="join_uneven_inputs\\(even_batches=...\\) is not supported"):
        with view.join_uneven_inputs([], even_batches=True):
            pass


def test_settings_changed_after_construction_apply_to_later_calls(tmp_path):
    from lockstep import Accelerator

    accelerator = Accelerator(log_with="jsonl")
    accelerator.project_configuration.set_directories(str(tmp_path))  # folders set after the constructor
    accelerator.init_trackers("run")
    accelerator.log({"loss": 1.0}, step=1)
    accelerator.end_training()
    assert (tmp_path / "run" / "metrics.jsonl").is_file()

    accelerator = Accelerator()
    accelerator.step_scheduler_with_optimizer = False
    accelerator.device_placement = False
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = accelerator.prepare_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    assert scheduler.step_with_optimizer is False
    assert accelerator.prepare_optimizer(optimizer).device_placement is False


def test_prepare_goes_through_the_prepare_methods_a_subclass_overrides():
    from lockstep import Accelerator

    class Tagging(Accelerator):
        def prepare_model(self, model, device_placement=None, evaluation_mode=False):
            model.tagged = True
            return super().prepare_model(model, device_placement, evaluation_mode)

    model = Tagging().prepare(torch.nn.Linear(2, 2))
    assert model.tagged is True
