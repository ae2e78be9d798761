"""FSDP selected from the launcher: Accelerate's YAML file unchanged, --use-fsdp flags, bad input."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import lockstep

pytestmark = pytest.mark.distributed

ISSUE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_cpu_offload: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_activation_checkpointing: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: TinyDecoderLayer
mixed_precision: bf16
num_machines: 1
num_processes: 4
"""
SCRIPT = "tests/scripts/fsdp_yaml_train.py"


@pytest.mark.slow
def test_accelerate_fsdp_yaml_runs_through_launch(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(ISSUE_YAML)
    out = tmp_path / "report.json"
    result = lockstep("launch", "--config-file", str(config), SCRIPT, str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["world"] == 4 and report["distributed_type"] == "FSDP"
    assert report["mixed_precision"] == "bf16"
    assert report["sharded_units"] == 4  # three TinyDecoderLayer units and the root


def test_use_fsdp_flags_select_fsdp(tmp_path):
    out = tmp_path / "report.json"
    result = lockstep(
        "launch", "--num-processes", "2", "--use-fsdp", "--fsdp-auto-wrap-policy", "NO_WRAP", SCRIPT, str(out)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["distributed_type"] == "FSDP" and report["sharded_units"] == 1


def test_bad_fsdp_flags_exit_2(tmp_path):
    result = lockstep("launch", "--num-processes", "2", "--fsdp-auto-wrap-policy", "EVERYTHING", SCRIPT, "x")
    assert result.returncode == 2 and "EVERYTHING" in result.stderr
    result = lockstep("launch", "--use-fsdp", "--use-deepspeed", SCRIPT, "x")
    assert result.returncode == 2 and "cannot be combined" in result.stderr
    result = lockstep("launch", "--use-fsdp", "--fsdp-state-dict-type", "LOCAL_STATE_DICT", SCRIPT, "x")
    # refused by the flag's check, as the config file's key and the plugin refuse it
    assert result.returncode == 2
    assert "--fsdp-state-dict-type is 'LOCAL_STATE_DICT', which is not supported" in result.stderr


def test_config_explain_shows_the_fsdp_settings(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(ISSUE_YAML)
    result = lockstep("config", "explain", str(config), "--fsdp-state-dict-type", "FULL_STATE_DICT")
    assert result.returncode == 0, result.stderr
    assert "FULL_STATE_DICT" in result.stdout and "TinyDecoderLayer" in result.stdout
