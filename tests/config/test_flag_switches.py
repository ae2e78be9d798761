"""Switch flags (Accelerate's ``store_true`` flags such as ``--dynamo-use-fullgraph``) come from the key
table like the flags that take a value, and the DeepSpeed and FSDP1 flags are table flags too."""

from __future__ import annotations

import argparse
import json

import pytest

from lockstep.backends.deepspeed.keys import DEEPSPEED_KEYS
from lockstep.backends.fsdp.keys import FSDP_KEYS
from lockstep.cli.launch_flags import DYNAMO_FLAGS, given_flags, table_flags
from lockstep.config import checks
from lockstep.config.file import ClusterConfig, load_config_file, save_config_file
from lockstep.config.keys import SettingKey, flag_keys
from lockstep.config.plugins import DYNAMO_KEYS, dynamo_fields
from lockstep.errors import UsageError


def test_a_switch_is_a_store_true_flag_and_must_be_a_flag():
    switch = SettingKey(
        key="x_fast", field="fast", check=checks.boolean, help="go fast", flag=True, switch=True
    )
    assert table_flags([switch]) == [
        (("--x-fast", "--x_fast"), {"dest": "x_fast", "help": "go fast", "action": "store_true"})
    ]
    with pytest.raises(ValueError, match=r"SettingKey\(key='x_fast'\) is a switch but not a launch flag"):
        SettingKey(key="x_fast", field="fast", check=checks.boolean, help="go fast", switch=True)


def test_the_dynamo_switches_are_accelerates_store_true_flags():
    assert [entry.key for entry in DYNAMO_KEYS if entry.switch] == [
        "dynamo_use_fullgraph",
        "dynamo_use_dynamic",
        "dynamo_use_regional_compilation",
    ]
    # --dynamo-backend is a setting of its own; the other flags set the dynamo_config section.
    assert list(DYNAMO_FLAGS) == [entry.key for entry in DYNAMO_KEYS[1:]]
    parser = argparse.ArgumentParser()
    for spellings, kwargs in table_flags(DYNAMO_KEYS):
        parser.add_argument(*spellings, default=argparse.SUPPRESS, **kwargs)
    args = parser.parse_args(
        ["--dynamo_use_fullgraph", "--dynamo-mode", "Default", "--dynamo-backend", "eager"]
    )
    assert given_flags(args) == {
        "dynamo_backend": "eager",
        "dynamo_config": {"dynamo_use_fullgraph": True, "dynamo_mode": "default"},
    }


def test_dynamo_fields_name_the_plugin_and_reject_bad_values():
    assert dynamo_fields({"dynamo_use_fullgraph": False, "dynamo_use_regional_compilation": "yes"}) == {
        "fullgraph": False,
        "use_regional_compilation": True,
    }
    with pytest.raises(ValueError, match=r"^dynamo_config\.dynamo_nope is not a known key"):
        dynamo_fields({"dynamo_nope": 1})


def test_deepspeed_and_fsdp1_flags_come_from_their_tables():
    assert [entry.flag_spellings[1] for entry in flag_keys(DEEPSPEED_KEYS).values()][:2] == [
        "--deepspeed_config_file",
        "--zero_stage",
    ]
    legacy = [entry.key for entry in FSDP_KEYS if entry.legacy and entry.flag]
    assert legacy == [
        "fsdp_sharding_strategy",
        "fsdp_backward_prefetch",
        "fsdp_forward_prefetch",
        "fsdp_use_orig_params",
        "fsdp_sync_module_states",
    ]
    parser = argparse.ArgumentParser()
    for spellings, kwargs in table_flags(FSDP_KEYS):
        parser.add_argument(*spellings, default=argparse.SUPPRESS, **kwargs)
    assert given_flags(parser.parse_args(["--fsdp_sharding_strategy", "2"]))["fsdp_config"] == {
        "fsdp_sharding_strategy": "SHARD_GRAD_OP"
    }
    with pytest.raises(UsageError, match=r"^--fsdp-backward-prefetch must be one of BACKWARD_PRE, "):
        given_flags(parser.parse_args(["--fsdp-backward-prefetch", "SOMETIMES"]))


def test_a_json_config_file_is_written_as_json(tmp_path):
    config = ClusterConfig(distributed_type="MULTI_CPU", num_processes=2)
    path = save_config_file(config, tmp_path / "cluster.json")
    assert json.loads(path.read_text())["distributed_type"] == "MULTI_CPU"
    assert load_config_file(path) == config
