"""``save_state(durable="background")``: the call returns once the files are written; fsync, manifest,
rename, ``latest`` and rotation happen on a background thread; the checkpoint counts only once committed;
a failed commit reaches the training loop at the next ``should_stop`` (or ``save_state``) on every rank."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from lockstep import Accelerator, ProjectConfiguration
from lockstep.checkpoint import CheckpointError, layout, load_model_files
from tests.helpers.cli import REPO, SCRIPTS, cli_env
from tests.helpers.multiprocess import run_distributed


def _training(project_dir: Path) -> tuple[Accelerator, torch.nn.Module]:
    project = ProjectConfiguration(project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=1)
    accelerator = Accelerator(project_config=project)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(3, 8)).sum())
    optimizer.step()
    return accelerator, model


def _gate_the_manifest(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The commit waits at the manifest until the returned event is set."""
    release, real = threading.Event(), layout.write_manifest

    def gated(*args, **kwargs):
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(layout, "write_manifest", gated)
    return release


def _full_disk_at_the_manifest(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _checks_until_raised(accelerator: Accelerator) -> list[str]:
    """The training loop's ``should_stop`` checks (every rank the same number) until one raises."""
    for _ in range(250):
        try:
            assert accelerator.should_stop is False
        except CheckpointError as error:
            return [str(error)]
        threading.Event().wait(0.02)
    return []


def test_the_call_returns_before_the_commit_and_the_checkpoint_counts_only_once_committed(
    tmp_path, monkeypatch
):
    accelerator, _ = _training(tmp_path)
    accelerator.save_state()
    release = _gate_the_manifest(monkeypatch)
    folder = Path(accelerator.save_state(durable="background"))
    root = tmp_path / "checkpoints"
    # written and in place (as the peers' saves leave them), not sealed: not a checkpoint yet, the previous
    # one is the newest valid one and rotation (total_limit=1) has not touched it
    assert (folder / "model.safetensors").is_file() and not (folder / layout.MANIFEST_NAME).exists()
    with pytest.warns(UserWarning, match="Skipped 1 newer checkpoint"):
        assert layout.newest_valid_checkpoint(root) == root / "checkpoint_0"
    assert (root / "latest").read_text() == "checkpoint_0\n"
    release.set()
    accelerator.wait_for_checkpoint()
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "latest"]
    assert layout.verify(folder).files.keys() >= {"model.safetensors", "optimizer.bin", "random_states_0.pkl"}
    assert (root / "latest").read_text() == "checkpoint_1\n"


def test_a_failed_commit_is_raised_at_the_next_should_stop_and_loses_nothing(tmp_path, monkeypatch):
    accelerator, model = _training(tmp_path)
    accelerator.save_state()
    saved = model.weight.detach().clone()
    monkeypatch.setattr(layout, "write_manifest", _full_disk_at_the_manifest)
    accelerator.save_state(durable="background")  # the files are written; the commit fails in the thread
    errors = _checks_until_raised(accelerator)
    assert len(errors) == 1 and errors[0].startswith(
        "The previous asynchronous checkpoint save failed: Saving the checkpoint "
        f"{tmp_path}/checkpoints/checkpoint_1 ran out of disk space (OSError: [Errno 28] No space left on device)"
    )
    assert accelerator.should_stop is False  # raised once
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0", "latest"]
    with torch.no_grad():
        model.weight.zero_()
    accelerator.load_state()
    assert torch.equal(model.weight.detach(), saved)


def test_durable_names_its_choices():
    accelerator = Accelerator()
    with pytest.raises(
        ValueError, match=r"save_state\(durable='fast'\) is invalid: it must be one of 'sync', "
    ):
        accelerator.save_state("unused", durable="fast")


def _commit_fails_on_the_main_process(folder: str) -> list[str]:
    accelerator, _ = _training(Path(folder))
    if accelerator.is_main_process:
        layout.write_manifest = _full_disk_at_the_manifest  # this forked process only
    accelerator.save_state(durable="background")
    errors = _checks_until_raised(accelerator)
    accelerator.save_state(durable="background")  # fails again: load_state raises it on every rank
    try:
        accelerator.load_state()
    except CheckpointError as error:
        errors.append(str(error))
    return errors


def test_two_processes_both_raise_a_failed_commit_at_the_same_should_stop(tmp_path):
    results = run_distributed(_commit_fails_on_the_main_process, 2, str(tmp_path), timeout=60)
    folder = f"{tmp_path}/checkpoints/checkpoint_0"
    assert results[0][0].startswith(
        f"The previous asynchronous checkpoint save failed: Saving the checkpoint {folder} (process 0 of 2) ran "
        "out of disk space (OSError: [Errno 28] No space left on device)"
    )
    assert results[1][0].startswith(
        "The previous asynchronous checkpoint save failed on 1 of 2 processes: rank 0: CheckpointError: "
        f"The previous asynchronous checkpoint save failed: Saving the checkpoint {folder} (process 0 of 2) "
        "ran out of disk space"
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == []
    assert len(results[0]) == len(results[1]) == 2
    assert (
        "Saving the checkpoint" in results[0][1]
        and "checkpoint_1 (process 0 of 2) ran out of" in results[0][1]
    )
    assert results[1][1].startswith("The previous asynchronous checkpoint save failed on 1 of 2 processes: ")


def test_kill_9_at_20_random_moments_of_the_background_commit_leaves_the_new_or_the_previous(tmp_path):
    """tests/scripts/kill_background_commit.py: 20 forked children killed at seeded moments over 1.5 times
    the commit's length; after each, the newest valid checkpoint loads and holds its own weights."""
    script = SCRIPTS / "kill_background_commit.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "20", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(OMP_NUM_THREADS="1"),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    outcomes = [kill["outcome"] for kill in result["kills"]]
    assert len(outcomes) == 20 and set(outcomes) <= {"new", "previous"}, outcomes
    delays = [kill["delay"] for kill in result["kills"]]
    assert min(delays) < result["commit_seconds"] < max(delays)  # moments inside and after the commit


def test_the_default_save_returns_before_the_commit_and_wait_for_everyone_settles_it(tmp_path, monkeypatch):
    """``durable="background"`` is the default: ``save_state`` returns with the files in place and the seal
    (manifest) still gated; ``wait_for_everyone`` (Accelerate's idiom after a save) returns only once the
    folder is committed."""
    accelerator, _ = _training(tmp_path)
    release = _gate_the_manifest(monkeypatch)
    folder = Path(accelerator.save_state())
    assert not (folder / layout.MANIFEST_NAME).exists() and (folder / "optimizer.bin").is_file()
    threading.Timer(0.3, release.set).start()
    accelerator.wait_for_everyone()
    assert layout.verify(folder).step == accelerator.step
    assert (folder.parent / "latest").read_text() == "checkpoint_0\n"


def _save_then_look_from_the_other_rank(folder: str) -> list[str]:
    accelerator, _ = _training(Path(folder))
    if accelerator.is_main_process:  # the main process commits: make its commit take a while
        real = layout.write_manifest

        def slow(*args, **kwargs):
            threading.Event().wait(0.5)
            return real(*args, **kwargs)

        layout.write_manifest = slow  # this forked process only
    saved = Path(accelerator.save_state())
    at_return = sorted(path.name for path in saved.iterdir())
    accelerator.wait_for_everyone()
    return [at_return, sorted(path.name for path in saved.iterdir())]


def test_every_rank_finds_the_files_when_save_returns_and_the_manifest_after_wait_for_everyone(tmp_path):
    results = run_distributed(_save_then_look_from_the_other_rank, 2, str(tmp_path), timeout=60)
    files = ["accelerator_state.json", "model.safetensors", "optimizer.bin"]
    for at_return, after_wait in results:
        assert set(files) <= set(at_return) and layout.MANIFEST_NAME not in at_return, results
        assert set(after_wait) == set(at_return) | {layout.MANIFEST_NAME}, results


def test_saving_over_an_existing_folder_commits_before_returning(tmp_path):
    """The new files cannot be shown in place of a committed checkpoint before they are durable without
    risking both to a crash: such a save commits before it returns, even by default."""
    accelerator = Accelerator()  # no automatic naming: save_state(folder) writes folder itself
    model = torch.nn.Linear(8, 4)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    folder = tmp_path / "explicit"
    accelerator.save_state(folder)
    accelerator.wait_for_everyone()
    with torch.no_grad():
        model.weight.add_(1.0)
    accelerator.save_state(folder)
    assert layout.verify(folder).files.keys() >= {"model.safetensors"}
    assert torch.equal(load_model_files(folder)["weight"], model.weight.detach())


def test_a_failed_seal_removes_the_published_folder_and_keeps_the_previous(tmp_path, monkeypatch):
    accelerator, _ = _training(tmp_path)
    accelerator.save_state()
    monkeypatch.setattr(layout, "write_manifest", _full_disk_at_the_manifest)
    accelerator.save_state()
    with pytest.raises(CheckpointError, match="ran out of disk space"):
        accelerator.wait_for_everyone()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0", "latest"]
    assert layout.newest_valid_checkpoint(root) == root / "checkpoint_0"


def test_no_file_is_fsynced_on_the_training_thread_and_every_file_is_in_the_background(tmp_path, monkeypatch):
    """The weights were fsynced on the training thread (save_model_files' own fsync) while the other files
    waited for the commit: on a 302 MB checkpoint the stall of a background-durable save was 0.36 s against
    0.34 s for a synchronous one; 0.22-0.28 s with the weights' fsync left to the commit too."""
    accelerator, _ = _training(tmp_path)
    calls: list[tuple[str, str]] = []
    real = os.fsync

    def recorded(fd: int) -> None:
        calls.append((threading.current_thread().name, os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    folder = Path(accelerator.save_state(durable="background"))
    on_the_training_thread = [name for thread, name in calls if thread == threading.current_thread().name]
    accelerator.wait_for_checkpoint()
    assert on_the_training_thread == []  # (other threads: an earlier test's commit may still be running)
    fsynced = {name for thread, name in calls if thread != threading.main_thread().name}
    assert {path.name for path in folder.iterdir() if path.is_file()} - {layout.MANIFEST_NAME} <= fsynced
    assert "model.safetensors" in fsynced and folder.name in fsynced
