"""One installed distribution adds a backend, a layer, a cluster environment, a checkpoint storage and a
tracker through its entry points, each found on the first use of its kind; the installed distributions are read once
per ``sys.path`` for every kind together, and a broken one is reported without stopping lockstep."""

from __future__ import annotations

import logging
from importlib import metadata
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator, entry_points
from lockstep.checkpoint.storage import registry as storage_registry
from lockstep.clusters import registry as cluster_registry
from lockstep.clusters.registry import cluster_environments, unregister_cluster_environment
from lockstep.config import backend_specs, layer_specs
from lockstep.tracking import LOGGER_TYPE_TO_CLASS
from lockstep.tracking import registry as tracker_registry
from tests.checkpoint.vault_storage import VaultStorage
from tests.plugins.lab_extensions import LabTracker
from tests.plugins.step_veto import StepVeto

ENTRY_POINTS = """\
[lockstep.backends]
lab = tests.plugins.lab_extensions:LAB_BACKEND

[lockstep.layers]
step_veto = tests.plugins.step_veto:SPEC

[lockstep.cluster_environments]
lab = tests.plugins.lab_cluster:LabCluster

[lockstep.storages]
vault = tests.checkpoint.vault_storage:VaultStorage

[lockstep.trackers]
lab-tracker = tests.plugins.lab_extensions:LabTracker
"""


def _install(site: Path, name: str, entry_points_txt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution ``name`` on ``sys.path`` declaring ``entry_points_txt``, as pip would leave it."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points_txt)
    monkeypatch.syspath_prepend(str(site))


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Every kind's registry as a fresh process has it (built-ins only, entry points not read yet)."""
    monkeypatch.setattr(backend_specs.BACKENDS, "discovered", False)
    monkeypatch.setattr(layer_specs.LAYERS, "discovered", False)
    monkeypatch.setattr(cluster_registry.CLUSTERS, "discovered", False)
    monkeypatch.setattr(
        storage_registry,
        "_REGISTRY",
        storage_registry._Registry(factories=dict(storage_registry._REGISTRY.factories)),
    )
    monkeypatch.setattr(tracker_registry, "_installed", set())
    monkeypatch.setattr(VaultStorage, "root", tmp_path / "vault")
    monkeypatch.setattr(VaultStorage, "calls", [])
    yield
    backend_specs.unregister_backend_spec("lab-backend")
    layer_specs.unregister_layer("step_veto")
    unregister_cluster_environment("lab")
    LOGGER_TYPE_TO_CLASS.pop("lab-tracker", None)


def test_one_distribution_adds_every_kind_of_extension(registries, tmp_path, monkeypatch):
    assert "lab-tracker" not in tracker_registry.tracker_choices()
    _install(tmp_path / "site", "lab-extensions", ENTRY_POINTS, monkeypatch)

    assert "lab-backend" in [spec.name for spec in backend_specs.backend_specs()]
    assert "lab" in [cluster.name for cluster in cluster_environments()]
    assert isinstance(storage_registry.storage_for("vault://run"), VaultStorage)
    assert "lab-tracker" in tracker_registry.tracker_choices()
    assert "step_veto" in [spec.name for spec in layer_specs.layer_specs()]

    # A user names the installed tracker, and asks for the installed layer by its keyword.
    accelerator = Accelerator(cpu=True, log_with="lab-tracker", step_veto=StepVeto(veto_step=1))
    accelerator.init_trackers("run")
    accelerator.log({"loss": 0.5}, step=3)
    tracker = accelerator.get_tracker("lab-tracker", unwrap=False)
    assert isinstance(tracker, LabTracker) and tracker.logged == [(3, {"loss": 0.5})]
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    skipped = []
    for _ in range(2):  # the layer discards the first step and applies the second
        accelerator.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
    assert skipped == [True, False]
    accelerator.end_training()


def test_the_installed_distributions_are_read_once_per_sys_path(tmp_path, monkeypatch):
    reads = []
    real = metadata.entry_points

    def counted(*args, **kwargs):
        reads.append(args or kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(metadata, "entry_points", counted)
    monkeypatch.setattr(entry_points, "_read", None)
    for group in ("lockstep.backends", "lockstep.storages", "lockstep.trackers", "lockstep.backends"):
        entry_points.installed_entry_points(group)
    assert len(reads) == 1  # every group from one reading
    _install(tmp_path / "site", "lab-extensions", ENTRY_POINTS, monkeypatch)
    assert [e.name for e in entry_points.installed_entry_points("lockstep.trackers")] == ["lab-tracker"]
    assert len(reads) == 2  # a folder added to sys.path is read


def test_a_broken_installation_is_reported_and_lockstep_goes_on(registries, tmp_path, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise OSError("unreadable METADATA")

    monkeypatch.setattr(metadata, "entry_points", broken)
    monkeypatch.setattr(entry_points, "_read", None)
    with caplog.at_level(logging.WARNING, logger="lockstep"):
        assert entry_points.installed_entry_points("lockstep.trackers") == []
    assert "Could not read the installed packages' lockstep entry points: unreadable METADATA" in caplog.text
    assert "jsonl" in tracker_registry.tracker_choices()


def test_a_tracker_entry_point_that_names_no_tracker_is_skipped_with_a_warning(
    registries, tmp_path, monkeypatch
):
    _install(
        tmp_path / "site",
        "broken-trackers",
        "[lockstep.trackers]\nnot-one = tests.plugins.lab_extensions:NotATracker\n"
        "lab-tracker = tests.plugins.lab_extensions:LabTracker\n",
        monkeypatch,
    )
    with pytest.warns(
        UserWarning,
        match=r"The tracker 'not-one' an installed package declares \(lockstep\.trackers "
        r"entry point tests\.plugins\.lab_extensions:NotATracker\) is not registered: ",
    ):
        choices = tracker_registry.tracker_choices()
    assert "lab-tracker" in choices and "not-one" not in choices
