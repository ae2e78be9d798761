"""lockstep in a Ray Train worker: Ray's variables are recognised, Ray's device is used, and a worker group
without a matching torch process group is refused before training.

Ray itself is faked here (a ``ray.train`` module whose context names the worker group's size); the real
Ray run, with a killed worker and an exact resume, is tests/e2e/test_ray_train_restart.py. The process
groups are real (a group of one process on an in-memory store).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist

from lockstep import _env
from lockstep.integrations import ray_train
from lockstep.state import PartialState, _pick_device

RAY_WORKER = {"RAY_RAYLET_PID": "4242", "RAY_JOB_ID": "01000000"}


def _fake_ray_train(monkeypatch, workers: int | None) -> None:
    """Put a ``ray.train`` in sys.modules whose context says ``workers`` (None: outside a training function)."""

    def get_context() -> types.SimpleNamespace:
        if workers is None:
            raise RuntimeError("`get_context` cannot be used outside of a Ray Train training function.")
        return types.SimpleNamespace(get_world_size=lambda: workers)

    monkeypatch.setitem(sys.modules, "ray.train", types.SimpleNamespace(get_context=get_context))


@pytest.fixture
def in_ray_worker(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_TORCH_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in RAY_WORKER.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ray_trains_variables_are_read_as_ray():
    env = {
        **RAY_WORKER,
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "33469",
    }
    cluster = _env.read_cluster_environment(env)
    assert cluster == _env.ClusterEnvironment(
        source="ray",
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        master_addr="10.0.0.7",
        master_port=33469,
    )
    assert cluster.uses_env_rendezvous
    without_ray = {name: value for name, value in env.items() if name not in RAY_WORKER}
    assert _env.read_cluster_environment(without_ray).source == "torchrun"


def test_the_device_ray_names_is_used_unless_cpu_is_asked_for(monkeypatch):
    cluster = _env.ClusterEnvironment(source="ray", rank=1, local_rank=1, world_size=2, local_world_size=2)
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cuda:3")
    assert _pick_device(cluster, cpu=False) == torch.device("cuda", 3)
    assert _pick_device(cluster, cpu=True) == torch.device("cpu")
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "gpu7")
    with pytest.raises(ValueError, match=r"ACCELERATE_TORCH_DEVICE='gpu7' is not a torch device\. Name one"):
        _pick_device(cluster, cpu=False)


def test_a_partial_state_takes_the_device_from_accelerate_torch_device(monkeypatch):
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "meta")  # the one non-CPU device every machine has
    assert PartialState().device == torch.device("meta")


def test_a_ray_worker_group_without_a_process_group_is_refused(monkeypatch, in_ray_worker):
    _fake_ray_train(monkeypatch, workers=2)
    with pytest.raises(
        RuntimeError,
        match=r"in a Ray Train worker group of 2 workers, but no torch process group exists in this worker: "
        r"each worker would train alone as rank 0.*ray\.train\.torch\.TorchTrainer",
    ):
        PartialState()


def test_a_process_group_of_another_size_than_rays_worker_group_is_refused(
    monkeypatch, in_ray_worker, group_of_one
):
    _fake_ray_train(monkeypatch, workers=2)
    with pytest.raises(
        RuntimeError,
        match=r"worker group of 2 workers, but the torch process group has 1 processes \(rank 0\)",
    ):
        PartialState()


def test_rays_own_group_is_joined(monkeypatch, in_ray_worker, group_of_one):
    _fake_ray_train(monkeypatch, workers=1)
    state = PartialState()
    assert (state.num_processes, state.process_index, state.backend) == (1, 0, "gloo")
    assert dist.is_initialized()  # the group it found, not one of its own


@pytest.mark.parametrize(
    ("workers", "environment"),
    [
        (None, RAY_WORKER),  # Ray's driver or a plain task: no training function, no worker group
        (1, RAY_WORKER),  # a worker group of one trains alone anyway
        (2, {}),  # a process Ray did not start (a torchrun worker that imports ray.train)
    ],
)
def test_outside_a_ray_worker_group_nothing_is_asked(monkeypatch, workers, environment):
    monkeypatch.delenv("RAY_RAYLET_PID", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    _fake_ray_train(monkeypatch, workers)
    ray_train.check_process_group()
    assert PartialState().num_processes == 1


def test_nothing_is_asked_when_ray_train_was_never_imported(monkeypatch, in_ray_worker):
    monkeypatch.delitem(sys.modules, "ray.train", raising=False)
    assert ray_train.worker_group_size() is None
