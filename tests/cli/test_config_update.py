"""``lockstep config update``: an older config file rewritten in the current schema, on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lockstep.cli.main import main

# As an older `accelerate config` wrote it: fp16 as a bool, a top-level dynamo_backend, TPU keys, num_processes
# -1 for "decide at launch".
OLD_FILE = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
fp16: true
dynamo_backend: INDUCTOR
machine_rank: 0
num_machines: 1
num_processes: -1
tpu_use_cluster: false
use_cpu: false
"""
UPDATED = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "distributed_type": "MULTI_GPU",
    "downcast_bf16": False,
    "dynamo_config": {"dynamo_backend": "INDUCTOR"},
    "enable_cpu_affinity": False,
    "machine_rank": 0,
    "main_training_function": "main",
    "mixed_precision": "fp16",
    "num_machines": 1,
    "rdzv_backend": "static",
    "same_network": True,
    "use_cpu": False,
}


def test_an_old_file_is_rewritten_with_defaults_filled_in(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text(OLD_FILE)
    assert main(["config", "update", "--config_file", str(path)]) == 0
    assert yaml.safe_load(path.read_text()) == UPDATED
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"Updated {path}: MULTI_GPU, launcher decides the processes on 1 machine, mixed precision fp16, "
        "torch.compile inductor",
        "  added (defaults): debug, downcast_bf16, dynamo_config, enable_cpu_affinity, main_training_function, "
        "mixed_precision, rdzv_backend, same_network",
        "  removed (renamed, ignored or unset): dynamo_backend, fp16, num_processes, tpu_use_cluster",
    ]
    assert "lockstep config update: warning: " in err and "ignoring tpu_use_cluster" in err
    # Updating again changes nothing: the file is in the current schema.
    assert main(["config", "update", "--config-file", str(path)]) == 0
    assert yaml.safe_load(path.read_text()) == UPDATED
    assert capsys.readouterr().out.splitlines()[1:] == []


def test_a_json_file_stays_json_and_the_default_file_is_the_default(tmp_path, monkeypatch, capsys):
    path = tmp_path / "home" / "default_config.yaml"
    path.parent.mkdir()
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    monkeypatch.setenv("LOCKSTEP_HOME", str(path.parent))
    assert main(["config", "update"]) == 0
    assert yaml.safe_load(path.read_text())["same_network"] is True
    as_json = tmp_path / "cluster.json"
    as_json.write_text(json.dumps({"distributed_type": "MULTI_CPU", "num_processes": 4}))
    assert main(["config", "update", "--config-file", str(as_json)]) == 0
    assert json.loads(as_json.read_text())["num_processes"] == 4
    capsys.readouterr()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no config file at {path}: check the path."),
        ("num_processes: two\n", "{path}: num_processes must be an integer, got 'two'; nothing was written."),
        ("frobnicate: 1\n", "{path}: frobnicate is not a known key"),
    ],
)
def test_bad_input_exits_2_and_leaves_the_file_alone(tmp_path, capsys, content, message):
    path = tmp_path / "bad.yaml"
    if content is not None:
        path.write_text(content)
    assert main(["config", "update", "--config-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lockstep config: error: {message.format(path=path)}")
    assert (path.read_text() if content is not None else None) == content


def test_no_default_file_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCKSTEP_HOME", str(tmp_path / "empty"))
    assert main(["config", "update"]) == 2
    expected = f"no config file at {Path(tmp_path / 'empty' / 'default_config.yaml')}: pass --config-file"
    assert expected in capsys.readouterr().err
