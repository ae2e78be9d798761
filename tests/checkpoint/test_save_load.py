"""Checkpoint files: torn saves, corruption, unsafe pickles, rotation, naming, hooks, save_model."""

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import CheckpointError, UnsafeCheckpointError, load_model_files
from tests.helpers.cli import REPO, SCRIPTS, cli_env


def _accelerator(project_dir=None, **config) -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer]:
    project = ProjectConfiguration(project_dir=project_dir, **config) if project_dir else None
    accelerator = Accelerator(project_config=project)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(3, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()
    return accelerator, model, optimizer


@pytest.mark.parametrize("point", ["staging", "shared", "manifest", "commit"])
def test_kill_during_a_save_never_breaks_load_state(tmp_path, point):
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "save_and_die.py"), str(tmp_path), point],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=REPO,
    )
    assert result.returncode == -9, result.stderr
    accelerator, model, _ = _accelerator(tmp_path, automatic_checkpoint_naming=True)
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state()
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith("."))
    saved = {
        name: load_model_files(tmp_path / "checkpoints" / name)["weight"]
        for name in checkpoints
        if name != "latest"
    }
    if point == "commit":  # renamed into place: complete and loadable, the pointer just did not move
        assert "checkpoint_1" in checkpoints
        assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "checkpoint_0"
        assert torch.equal(model.weight, saved["checkpoint_1"])
        assert torch.equal(saved["checkpoint_1"], saved["checkpoint_0"] + 1.0)
    else:
        assert checkpoints == ["checkpoint_0", "latest"]
        assert torch.equal(model.weight, saved["checkpoint_0"])
    assert accelerator.project_configuration.iteration == (2 if point == "commit" else 1)


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    accelerator, _, _ = _accelerator(tmp_path, automatic_checkpoint_naming=True)
    accelerator.save_state()
    accelerator.save_state()
    optimizer_file = tmp_path / "checkpoints" / "checkpoint_1" / "optimizer.bin"
    data = bytearray(optimizer_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern
    optimizer_file.write_bytes(bytes(data))
    with pytest.warns(
        UserWarning, match=r"Skipped 1 newer checkpoint.*checkpoint_1: optimizer.bin is corrupt"
    ):
        accelerator.load_state()
    with pytest.raises(
        CheckpointError, match=r"checkpoint_1: optimizer.bin is corrupt \(its xxh3_128 checksum"
    ):
        accelerator.load_state(str(tmp_path / "checkpoints" / "checkpoint_1"))


def _two_checkpoints_the_newest_corrupt(accelerator: Accelerator, model: torch.nn.Module, root: Path):
    """checkpoint_0, then checkpoint_1 of other weights with one flipped byte in its weights file (the
    file still parses; one weight is wrong); returns checkpoint_0's weight. Only the main process corrupts:
    it is the one that verifies checksums, and the others must agree with it."""
    accelerator.save_state()
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    accelerator.save_state()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        weights = root / "checkpoints" / "checkpoint_1" / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-4] ^= 0xFF  # inside the last tensor's bytes
        weights.write_bytes(bytes(data))
    accelerator.wait_for_everyone()
    return before


def test_checksums_verified_while_reading_still_fall_back_over_what_was_read(tmp_path):
    """Checksums are verified on a thread while the checkpoint is read (issue 29, item 2): a corrupt newest
    checkpoint is read first, then the previous one is loaded over it, so nothing of the corrupt one is left;
    named explicitly, it is an error that says the objects now hold corrupt contents."""
    accelerator, model, _ = _accelerator(tmp_path, automatic_checkpoint_naming=True)
    before = _two_checkpoints_the_newest_corrupt(accelerator, model, tmp_path)
    with pytest.warns(
        UserWarning, match=r"Skipped 1 newer checkpoint.*checkpoint_1: model.safetensors is corrupt"
    ):
        accelerator.load_state()
    assert torch.equal(model.weight, before)  # checkpoint_0's, not checkpoint_1's corrupt read
    assert accelerator.project_configuration.iteration == 1
    with pytest.raises(
        CheckpointError, match=r"model.safetensors is corrupt.*load another checkpoint before"
    ):
        accelerator.load_state(str(tmp_path / "checkpoints" / "checkpoint_1"))


def _corrupt_newest_then_load(project_dir: str) -> dict:
    accelerator, wrapped, _ = _accelerator(project_dir, automatic_checkpoint_naming=True)
    model = accelerator.unwrap_model(wrapped)  # DDP on two processes
    before = _two_checkpoints_the_newest_corrupt(accelerator, model, Path(project_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accelerator.load_state()
    fell_back = torch.equal(model.weight, before)
    try:
        accelerator.load_state(str(Path(project_dir) / "checkpoints" / "checkpoint_1"))
        explicit = "loaded"
    except CheckpointError as error:
        explicit = str(error)
    return {"fell_back": fell_back, "explicit": explicit}


def test_two_processes_agree_on_a_checksum_found_corrupt_while_reading(tmp_path):
    from tests.helpers.multiprocess import run_distributed

    for result in run_distributed(_corrupt_newest_then_load, 2, str(tmp_path), timeout=90):
        assert result["fell_back"], result
        assert "model.safetensors is corrupt" in result["explicit"], result


def _rewrite_manifest_with_sha256(folder: Path) -> None:
    """Make ``folder``'s manifest look like one written before XXH3-128 (SHA-256 entries)."""
    from lockstep.checkpoint.layout import sha256_of

    manifest = json.loads((folder / "manifest.json").read_text())
    for name, facts in manifest["files"].items():
        manifest["files"][name] = {"size": facts["size"], "sha256": sha256_of(folder / name)}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_of_sha256_checksums_still_loads_and_still_catches_corruption(tmp_path):
    accelerator, model, _ = _accelerator()
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert all(set(facts) == {"size", "xxh3_128"} for facts in manifest["files"].values())
    _rewrite_manifest_with_sha256(folder)
    saved = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state(str(folder))
    assert torch.equal(model.weight, saved)
    optimizer_file = folder / "optimizer.bin"
    data = bytearray(optimizer_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    optimizer_file.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"optimizer.bin is corrupt \(its sha256 checksum does not match"
    ):
        accelerator.load_state(str(folder))


def test_a_manifest_entry_without_a_known_checksum_is_refused_by_name(tmp_path):
    accelerator, _, _ = _accelerator()
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["optimizer.bin"] = {"size": manifest["files"]["optimizer.bin"]["size"], "blake9": "00"}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"optimizer.bin records no checksum lockstep knows \(it has"):
        accelerator.load_state(str(folder))


def test_truncated_and_missing_files_are_named(tmp_path):
    accelerator, _, _ = _accelerator()
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(
        CheckpointError, match=r"model.safetensors has \d+ bytes but the manifest says \d+ \(truncated\?\)"
    ):
        accelerator.load_state(str(folder))
    weights.unlink()
    with pytest.raises(CheckpointError, match="is missing model.safetensors, which its manifest lists"):
        accelerator.load_state(str(folder))
    (folder / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json: the save that wrote it did not finish"):
        accelerator.load_state(str(folder))


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = Path("/tmp/lockstep_unsafe_payload_ran")


def test_malicious_pickle_is_refused_and_does_not_run(tmp_path):
    MARKER.unlink(missing_ok=True)
    accelerator, _, _ = _accelerator()
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    optimizer_file = folder / "optimizer.bin"
    optimizer_file.write_bytes(pickle.dumps({"state": _Payload()}))
    manifest = json.loads((folder / "manifest.json").read_text())  # a forger can update the manifest too
    from lockstep.checkpoint.layout import file_facts

    manifest["files"]["optimizer.bin"] = file_facts(optimizer_file)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        UnsafeCheckpointError, match="optimizer.bin holds Python objects that cannot be loaded safely"
    ):
        accelerator.load_state(str(folder))
    assert not MARKER.exists()


def test_rotation_keeps_the_newest_and_moves_the_pointer(tmp_path):
    accelerator, _, _ = _accelerator(tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    saved = [Path(accelerator.save_state()).name for _ in range(4)]
    assert saved == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_2", "checkpoint_3", "latest"]
    assert (root / "latest").read_text().strip() == "checkpoint_3"


def test_relative_project_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    accelerator, model, _ = _accelerator("runs/relative", automatic_checkpoint_naming=True)
    assert accelerator.save_state() == os.path.join("runs/relative", "checkpoints", "checkpoint_0")
    expected = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state()
    assert torch.equal(model.weight, expected)
    assert (tmp_path / "runs" / "relative" / "checkpoints" / "checkpoint_0" / "manifest.json").is_file()


def test_save_state_needs_a_folder():
    accelerator, _, _ = _accelerator()
    with pytest.raises(ValueError, match="save_state\\(\\) needs output_dir="):
        accelerator.save_state()
    with pytest.raises(ValueError, match="load_state\\(\\) needs input_dir="):
        accelerator.load_state()


def test_register_for_checkpointing_names_bad_items():
    accelerator, _, _ = _accelerator()
    with pytest.raises(ValueError) as raised:
        accelerator.register_for_checkpointing(torch.nn.Linear(1, 1), 3, "x")
    assert str(raised.value) == (
        "All `objects` must include a `state_dict` and `load_state_dict` function to be stored. The following "
        "inputs are invalid:\n\t- Item at index 1, `int`\n\t- Item at index 2, `str`\n"
        "register_for_checkpointing() saves and loads each object through its state_dict() and "
        "load_state_dict(): wrap these in a class that provides both (a model or optimizer passed to prepare() "
        "is saved without registering it)."
    )


def test_register_for_checkpointing_error_has_accelerate_wording():
    """Accelerate's test_invalid_registration: two tensors, then a model and an optimizer."""
    accelerator, _, _ = _accelerator()
    net = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError) as raised:
        accelerator.register_for_checkpointing(
            torch.tensor([1, 2, 3]), torch.tensor([2, 3, 4]), net, torch.optim.Adam(net.parameters())
        )
    message = str(raised.value)
    assert "Item at index 0, `Tensor`" in message and "Item at index 1, `Tensor`" in message
    assert "Item at index 2" not in message and "Item at index 3" not in message


def test_unsafe_registered_state_is_refused_at_save(tmp_path):
    class Holder:
        def state_dict(self):
            return {"callback": print}

        def load_state_dict(self, state):
            pass

    accelerator, _, _ = _accelerator()
    accelerator.register_for_checkpointing(Holder())
    with pytest.raises(ValueError, match=r"registered object 0.state_dict\(\)\['callback'\] is a builtins"):
        accelerator.save_state(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_hooks_see_models_and_may_take_over(tmp_path):
    accelerator, _model, _ = _accelerator()
    calls = []

    def save_hook(models, weights, output_dir):
        # output_dir is the folder being written, renamed into place when the save commits
        calls.append(("save", len(models), len(weights), Path(output_dir).name, Path(output_dir).is_dir()))
        weights.pop()  # this hook saves the model itself

    def load_hook(models, input_dir):
        calls.append(("load", len(models), Path(input_dir).name))
        models.pop()

    handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    assert not (folder / "model.safetensors").exists()
    accelerator.load_state(str(folder))
    assert calls == [("save", 1, 1, "ckpt", True), ("load", 1, "ckpt")]
    handle.remove()
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert len(calls) == 2 and (folder / "model.safetensors").exists()


def test_save_model_writes_loadable_shards(tmp_path):
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
    accelerator.save_model(model, str(tmp_path / "export"), max_shard_size="10KB")
    files = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert files == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    loaded = load_model_files(tmp_path / "export")
    for key, value in accelerator.get_state_dict(model).items():
        assert torch.equal(loaded[key], value)


def test_no_warning_when_everything_is_valid(tmp_path):
    accelerator, _, _ = _accelerator(tmp_path, automatic_checkpoint_naming=True)
    accelerator.save_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accelerator.load_state()


def test_async_save_reports_its_stall_and_commits(tmp_path):
    accelerator, model, _ = _accelerator(tmp_path, automatic_checkpoint_naming=True)
    folder = accelerator.save_state(async_save=True)
    with torch.no_grad():  # training goes on: the snapshot must not see this
        model.weight.add_(100.0)
    accelerator.wait_for_checkpoint()
    report = accelerator.last_save_report
    assert report.asynchronous and report.folder == folder and report.nbytes > 0 and report.stall_seconds >= 0
    saved = load_model_files(Path(folder))["weight"]
    assert torch.equal(saved + 100.0, model.weight.detach())
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "checkpoint_0"


def test_a_failed_background_save_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    import lockstep.checkpoint.training_state as files

    def broken(*args, **kwargs):
        raise OSError("disk full")

    accelerator, _, _ = _accelerator(tmp_path, automatic_checkpoint_naming=True)
    monkeypatch.setattr(files, "save_model_files", broken)
    accelerator.save_state(async_save=True)
    with pytest.raises(RuntimeError, match="previous asynchronous checkpoint save failed: disk full"):
        accelerator.wait_for_checkpoint()
    assert not (tmp_path / "checkpoints" / "checkpoint_0").exists()
    accelerator.wait_for_checkpoint()  # the error is reported once
