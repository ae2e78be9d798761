"""Checkpoint storages are looked up by URL scheme: a storage registered in a test (by
``register_storage`` and by an installed package's ``lockstep.storages`` entry point) serves a real
``save_state``/``load_state`` round trip; an unknown scheme, a bad registration and a factory that builds
something else are refused with errors that say what to do."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import CheckpointError, register_storage, registered_storages, unregister_storage
from lockstep.checkpoint.storage import LocalStorage, registry, storage_for
from lockstep.trainer import _checkpoint_folders
from tests.checkpoint.vault_storage import VaultStorage


@pytest.fixture
def clean_registry(monkeypatch):
    """The registry as lockstep starts it (the built-ins only, entry points not read yet), restored after."""
    monkeypatch.setattr(
        registry, "_REGISTRY", registry._Registry(factories=dict(registry._REGISTRY.factories))
    )
    unregister_storage("vault")


@pytest.fixture
def vault(tmp_path, monkeypatch, clean_registry):
    monkeypatch.setattr(VaultStorage, "root", tmp_path / "vault")
    monkeypatch.setattr(VaultStorage, "calls", [])
    return tmp_path / "vault"


def _train_save_and_reload(project_dir: str) -> tuple[str, str | None]:
    accelerator = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True),
    )
    torch.manual_seed(0)
    model, optimizer = accelerator.prepare(
        nn.Linear(4, 2), torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1)
    )
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    accelerator.backward(model(torch.ones(3, 4)).sum())
    optimizer.step()
    saved_weight = model.weight.detach().clone()
    saved = accelerator.save_state()
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(saved)
    assert torch.equal(model.weight, saved_weight)
    return saved, accelerator.resume_from_latest_checkpoint()


def test_a_storage_registered_by_function_serves_save_state_and_load_state(vault):
    register_storage("vault", VaultStorage)
    saved, resumed = _train_save_and_reload("vault://run")
    assert saved == "vault://run/checkpoints/checkpoint_0" == resumed
    assert (vault / "run/checkpoints/checkpoint_0/manifest.json").is_file()  # committed through it
    assert VaultStorage.calls[:2] == ["probe", f"commit {saved}"]  # checked before training: not local
    assert f"read {saved}" in VaultStorage.calls
    assert "vault" in registered_storages()


def test_a_storage_installed_as_an_entry_point_is_found_on_first_use(vault, tmp_path, monkeypatch):
    site = tmp_path / "site"
    info = site / "lockstep_vault-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lockstep-vault\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[lockstep.storages]\nvault = tests.checkpoint.vault_storage:VaultStorage\n"
    )
    monkeypatch.syspath_prepend(str(site))
    assert sys.path[0] == str(site)
    saved, _ = _train_save_and_reload("vault://run")
    assert saved == "vault://run/checkpoints/checkpoint_0"
    assert (vault / "run/checkpoints/checkpoint_0/manifest.json").is_file()
    assert registry._REGISTRY.factories["vault"] is VaultStorage  # loaded once, then registered


def test_an_unknown_scheme_names_the_registered_ones(clean_registry):
    register_storage("vault", VaultStorage)
    with pytest.raises(ValueError) as raised:
        storage_for("nosuch://bucket/run")
    message = str(raised.value)
    assert "'nosuch://bucket/run' has the URL scheme nosuch://" in message
    assert "registered: file, vault" in message
    assert "register_storage('nosuch', factory)" in message and "'lockstep.storages'" in message
    with pytest.raises(ValueError, match=r"nosuch://, which no registered checkpoint storage"):
        Accelerator(cpu=True, project_dir="nosuch://bucket/run")


def test_bad_registrations_are_refused(clean_registry):
    with pytest.raises(ValueError, match=r"register_storage\('vault://', \.\.\.\) takes a URL scheme"):
        register_storage("vault://", VaultStorage)
    with pytest.raises(TypeError, match=r"takes a factory: a callable .* not a str"):
        register_storage("vault", "tests.checkpoint.vault_storage:VaultStorage")  # type: ignore[arg-type]
    register_storage("vault", VaultStorage)
    with pytest.raises(ValueError, match=r"registered for vault:// already .* replace=True"):
        register_storage("VAULT", VaultStorage)
    register_storage("vault", lambda location, options: "not a storage", replace=True)
    with pytest.raises(TypeError, match=r"vault:// .* built a str for 'vault://run'; it must return"):
        storage_for("vault://run")


def test_file_urls_are_local_folders_for_save_state(tmp_path):
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(nn.Linear(2, 2))
    saved = accelerator.save_state(f"file://{tmp_path}/ckpt")
    assert Path(saved) == tmp_path / "ckpt"
    assert (tmp_path / "ckpt" / "manifest.json").is_file()
    accelerator.load_state(f"file://{tmp_path}/ckpt")
    assert isinstance(storage_for(f"file://{tmp_path}"), LocalStorage)


def test_the_trainer_skips_a_local_checkpoint_without_a_manifest(tmp_path):
    """A folder with Accelerate's files and no manifest is a Trainer checkpoint whose save did not finish
    (``load_state`` accepts such a folder as Accelerate's; the Trainer's newest valid checkpoint does not)."""
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "model.safetensors").write_bytes(b"")
    assert _checkpoint_folders.newest_valid_checkpoint(str(tmp_path)) is None
    with pytest.raises(CheckpointError):
        storage_for(tmp_path).check(tmp_path / "checkpoint-3", accelerate_layout=False)
