"""The key tables: one entry per configuration key, and everything that is derived from them.

FSDP_KEYS (next to FullyShardedDataParallelPlugin) gives the config file's fsdp_config check,
``from_config_section``, the ``lockstep launch --fsdp-*`` flags and the Trainer's ``fsdp_config`` mapping;
DYNAMO_KEYS and DEEPSPEED_KEYS give their file sections (and ``--dynamo-backend``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys

import pytest

from lockstep.backends.deepspeed.keys import DEEPSPEED_KEYS
from lockstep.backends.fsdp import keys as fsdp_keys
from lockstep.backends.fsdp import trainer_options as fsdp_options
from lockstep.backends.fsdp.keys import FSDP_KEYS, plugin_fields, plugin_kwargs
from lockstep.backends.fsdp.plugin import _FSDP1_ONLY, FullyShardedDataParallelPlugin
from lockstep.backends.fsdp.trainer_options import config_fields, normalize_fsdp_config
from lockstep.cli import launch_cmd
from lockstep.cli._unsupported_flags import REFUSED_DEST
from lockstep.cli.launch_cmd import BACKEND_FLAGS, add_launch_flags, given_flags, table_flags
from lockstep.config import checks, file
from lockstep.config.file import ClusterConfig
from lockstep.config.keys import SettingKey, by_spelling, file_keys, flag_keys, section_kwargs
from lockstep.config.plugins import DYNAMO_KEYS, TorchDynamoPlugin
from lockstep.errors import UsageError
from tests.helpers.cli import cli_env

FSDP_FLAG_NAMES = [
    "--fsdp-version",
    "--fsdp-auto-wrap-policy",
    "--fsdp-transformer-layer-cls-to-wrap",
    "--fsdp-min-num-params",
    "--fsdp-state-dict-type",
    "--fsdp-reshard-after-forward",
    "--fsdp-offload-params",
    "--fsdp-cpu-ram-efficient-loading",
    "--fsdp-activation-checkpointing",
    "--fsdp-sharding-strategy",
    "--fsdp-backward-prefetch",
    "--fsdp-forward-prefetch",
    "--fsdp-use-orig-params",
    "--fsdp-sync-module-states",
]
"""Accelerate's FSDP launch flags: those FSDP2 uses, then the FSDP1 ones it accepts, in --help order."""

# Every fsdp_config key of the file: (YAML value, plugin field, the plugin's value after loading).
FILE_SAMPLES = {
    "fsdp_version": ("2", "fsdp_version", 2),
    "fsdp_auto_wrap_policy": ("size_based_wrap", "auto_wrap_policy", "SIZE_BASED_WRAP"),
    "fsdp_transformer_layer_cls_to_wrap": (
        "Block, Embed",
        "transformer_cls_names_to_wrap",
        ["Block", "Embed"],
    ),
    "fsdp_min_num_params": ("1e3", "min_num_params", 1000),
    "fsdp_state_dict_type": ("full_state_dict", "state_dict_type", "FULL_STATE_DICT"),
    "fsdp_reshard_after_forward": ("SHARD_GRAD_OP", "reshard_after_forward", False),
    "fsdp_offload_params": ("yes", "cpu_offload", True),
    "fsdp_cpu_ram_efficient_loading": (True, "cpu_ram_efficient_loading", True),
    "fsdp_activation_checkpointing": ("on", "activation_checkpointing", True),
    "fsdp_cpu_offload": (1, "cpu_offload", True),
    "fsdp_sharding_strategy": (2, "reshard_after_forward", False),  # Accelerate < 0.20: 2 is SHARD_GRAD_OP
    "fsdp_backward_prefetch": ("backward_pre", "backward_prefetch", "BACKWARD_PRE"),
    "fsdp_backward_prefetch_policy": ("BACKWARD_POST", "backward_prefetch", "BACKWARD_POST"),
    "fsdp_forward_prefetch": ("true", "forward_prefetch", True),
    "fsdp_use_orig_params": ("true", "use_orig_params", True),
    "fsdp_sync_module_states": ("true", "sync_module_states", True),
}
# The plugin warns about these (FSDP2 has no such option); sharding_strategy it translates instead.
WARNED = {"fsdp_backward_prefetch", "fsdp_backward_prefetch_policy", "fsdp_forward_prefetch"}
WARNED |= {"fsdp_use_orig_params", "fsdp_sync_module_states"}

# Every name transformers' fsdp_config may use (without the prefix): (value, plugin field, mapped value);
# None for FSDP1-only keys, which the mapping drops.
TRAINER_SAMPLES = {
    "version": ("2", ("fsdp_version", 2)),
    "auto_wrap_policy": ("no_wrap", ("auto_wrap_policy", "NO_WRAP")),
    "transformer_layer_cls_to_wrap": ("Block, Embed", ("transformer_cls_names_to_wrap", ["Block", "Embed"])),
    "transformer_cls_names_to_wrap": (["Block"], ("transformer_cls_names_to_wrap", ["Block"])),
    "min_num_params": ("1e3", ("min_num_params", 1000)),
    "state_dict_type": ("full_state_dict", ("state_dict_type", "FULL_STATE_DICT")),
    "reshard_after_forward": ("FULL_SHARD", ("reshard_after_forward", True)),
    "offload_params": ("yes", ("cpu_offload", True)),
    "cpu_offload": (1, ("cpu_offload", True)),
    "cpu_ram_efficient_loading": ("true", ("cpu_ram_efficient_loading", True)),
    "activation_checkpointing": ("0", ("activation_checkpointing", False)),
    "ignored_modules": ("^head$", ("ignored_modules", "^head$")),
    "sharding_strategy": ("FULL_SHARD", None),
    "backward_prefetch": ("BACKWARD_PRE", None),
    "backward_prefetch_policy": ("BACKWARD_PRE", None),
    "forward_prefetch": (True, None),
    "limit_all_gathers": (True, None),
    "use_orig_params": (True, None),
    "sync_module_states": (True, None),
}


def _launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_launch_flags(parser)
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


# --- the shape ----------------------------------------------------------------------------------------


def test_a_setting_key_is_frozen_and_takes_keywords_only():
    entry = SettingKey(key="x_y", field="y", check=checks.boolean, help="a setting")
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.help = "changed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        SettingKey("x_y", "y", checks.boolean, "a setting")  # type: ignore[misc]
    assert (entry.flag, entry.file, entry.legacy, entry.aliases, entry.to_field) == (
        False,
        True,
        False,
        (),
        None,
    )
    assert entry.flag_spellings == ("--x-y", "--x_y")
    with pytest.raises(ValueError, match=r"^SettingKey\(key='x_y'\) is a launch flag but not a file key"):
        SettingKey(key="x_y", field="y", check=checks.boolean, help="a setting", flag=True, file=False)


def test_a_spelling_names_one_key():
    first = SettingKey(key="fsdp_a", field="a", check=checks.boolean, help="a")
    second = SettingKey(key="fsdp_b", field="b", check=checks.boolean, help="b", aliases=("a",))
    with pytest.raises(ValueError, match=r"^'a' spells both fsdp_a and fsdp_b; give each key its own\.$"):
        by_spelling((first, second), "fsdp_")


def test_every_entry_has_a_one_line_help_and_a_unique_key():
    for table in (FSDP_KEYS, DYNAMO_KEYS, DEEPSPEED_KEYS):
        keys = [entry.key for entry in table]
        assert len(keys) == len(set(keys))
        for entry in table:
            assert entry.help and "\n" not in entry.help and len(entry.help) <= 100, entry.key
            assert entry.help == entry.help.strip() and not entry.help.endswith("."), entry.key


# --- FSDP: the table against the plugin ---------------------------------------------------------------


def test_every_field_the_fsdp_table_names_is_a_plugin_field():
    plugin_fields_ = {item.name for item in dataclasses.fields(FullyShardedDataParallelPlugin)}
    named = {entry.field for entry in FSDP_KEYS}
    assert None not in named
    assert named <= plugin_fields_, named - plugin_fields_
    # Fields no key sets: objects a YAML file cannot express.
    assert plugin_fields_ - named == {
        "mixed_precision_policy",
        "state_dict_config",
        "optim_state_dict_config",
        "param_init_fn",
    }


def test_the_plugins_fsdp1_fields_come_from_the_table_in_warning_order():
    assert fsdp_keys.LEGACY_FIELDS == (
        "sharding_strategy",
        "backward_prefetch",
        "forward_prefetch",
        "limit_all_gathers",
        "use_orig_params",
        "sync_module_states",
    )
    assert _FSDP1_ONLY == (*fsdp_keys.LEGACY_FIELDS, "state_dict_config", "optim_state_dict_config")


@pytest.mark.parametrize("key", sorted(FILE_SAMPLES))
def test_every_file_key_loads_through_from_config_section(key):
    raw, field, expected = FILE_SAMPLES[key]
    section = ClusterConfig.from_dict({"distributed_type": "FSDP", "fsdp_config": {key: raw}}).fsdp_config
    if key in WARNED:
        with pytest.warns(UserWarning, match=r"FSDP1 settings; FSDP2 has no such option and ignores them"):
            plugin = FullyShardedDataParallelPlugin.from_config_section(section)
    else:
        plugin = FullyShardedDataParallelPlugin.from_config_section(section)
    assert getattr(plugin, field) == expected


def test_the_samples_cover_every_file_key():
    assert set(FILE_SAMPLES) == set(file.section_keys()["fsdp_config"])


def test_from_config_section_takes_every_spelling_and_names_unknown_keys():
    assert plugin_kwargs({"fsdp_cpu_offload": True, "cpu_offload": False, "fsdp_min_num_params": None}) == {
        "cpu_offload": False
    }
    plugin = FullyShardedDataParallelPlugin.from_config_section(
        {"version": 2, "transformer_cls_names_to_wrap": ["A"], "fsdp_ignored_modules": "^head$"}
    )
    assert (plugin.fsdp_version, plugin.transformer_cls_names_to_wrap, plugin.ignored_modules) == (
        2,
        ["A"],
        "^head$",
    )
    with pytest.raises(
        ValueError, match=r"^fsdp_config\.fsdp_versoin is not a setting of FullyShardedDataParallelPlugin\.$"
    ):
        FullyShardedDataParallelPlugin.from_config_section({"fsdp_versoin": 2})


def test_plugin_fields_are_checked_and_in_the_plugins_form():
    section = {
        "fsdp_reshard_after_forward": "SHARD_GRAD_OP",
        "fsdp_transformer_layer_cls_to_wrap": "A, B",
        "fsdp_min_num_params": "1e3",
        "fsdp_sharding_strategy": "FULL_SHARD",  # FSDP1-only: not compared
        "fsdp_version": None,
    }
    assert plugin_fields(section) == {
        "reshard_after_forward": False,
        "transformer_cls_names_to_wrap": ["A", "B"],
        "min_num_params": 1000,
    }
    with pytest.raises(
        ValueError, match=r"^fsdp_config\.fsdp_reshard_after_forward must be true or false \(or "
    ):
        plugin_fields({"fsdp_reshard_after_forward": "NO_SHARD"})
    with pytest.raises(ValueError, match=r"^fsdp_config\.fsdp_nope is not a known key \(known: activation_"):
        plugin_fields({"fsdp_nope": 1})


# --- FSDP: the config file ----------------------------------------------------------------------------


def test_the_file_section_is_the_tables_file_keys():
    assert file.section_keys()["fsdp_config"] == file_keys(FSDP_KEYS)
    assert file.section_keys()["fsdp_config"]["fsdp_offload_params"] is next(
        entry for entry in FSDP_KEYS if entry.key == "fsdp_offload_params"
    )
    # Keys only a name-based mapping knows are not file keys.
    assert {"fsdp_ignored_modules", "fsdp_limit_all_gathers"}.isdisjoint(file.section_keys()["fsdp_config"])
    assert len(file.section_keys()["fsdp_config"]) == 16
    assert file.ConfigKey is SettingKey


# --- FSDP: the launch flags ---------------------------------------------------------------------------


def test_every_fsdp_flag_is_a_table_key_and_every_flag_key_is_a_flag():
    options = _options(_launch_parser())
    dashed = [o for o, action in options.items() if o.startswith("--fsdp-") and action.dest != REFUSED_DEST]
    assert dashed == FSDP_FLAG_NAMES
    assert [entry.flag_spellings[0] for entry in BACKEND_FLAGS["fsdp_config"].values()] == FSDP_FLAG_NAMES
    for name, entry in BACKEND_FLAGS["fsdp_config"].items():
        action = options[entry.flag_spellings[0]]
        assert action.dest == name and entry.flag_spellings[1] in action.option_strings
        assert action.help == f"FSDP: {entry.help}"
        assert name in file.section_keys()["fsdp_config"]  # a flag sets a file key


def test_the_dynamo_backend_flag_comes_from_the_dynamo_table():
    action = _options(_launch_parser())["--dynamo-backend"]
    assert action.option_strings == ["--dynamo-backend", "--dynamo_backend"]
    assert action.dest == "dynamo_backend"
    assert action.help == "torch.compile backend (no, eager, inductor, ...)"
    assert list(flag_keys(DYNAMO_KEYS)) == [entry.key for entry in DYNAMO_KEYS]  # every dynamo key is a flag


def test_flag_text_is_checked_by_the_keys_check():
    args = _launch_parser().parse_args(
        [
            "--fsdp-reshard-after-forward",
            "false",
            "--fsdp_min_num_params",
            "1e3",
            "--fsdp-auto-wrap-policy",
            "size_based_wrap",
            "--fsdp-transformer-layer-cls-to-wrap",
            "A,B",
            "--fsdp-version",
            "2",
        ]
    )
    assert given_flags(args) == {
        "fsdp_config": {
            "fsdp_reshard_after_forward": False,
            "fsdp_min_num_params": 1000,
            "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "A,B",
            "fsdp_version": 2,
        },
        "distributed_type": "FSDP",
    }
    bad = _launch_parser().parse_args(["--fsdp-offload-params", "maybe"])
    with pytest.raises(UsageError, match=r"^--fsdp-offload-params must be true or false, got 'maybe'$"):
        given_flags(bad)
    bad = _launch_parser().parse_args(["--fsdp-version", "3"])
    with pytest.raises(UsageError, match=r"^--fsdp-version must be between 1 and 2, got 3$"):
        given_flags(bad)


# --- FSDP: the Trainer's fsdp_config ------------------------------------------------------------------


def test_the_trainer_samples_cover_every_spelling():
    assert set(TRAINER_SAMPLES) == set(fsdp_keys.SPELLINGS) == fsdp_options.KNOWN_CONFIG_KEYS
    assert len(TRAINER_SAMPLES) == 19


@pytest.mark.parametrize("prefix", ["", "fsdp_"])
@pytest.mark.parametrize("name", sorted(TRAINER_SAMPLES))
def test_the_trainer_mapping_takes_every_spelling_with_and_without_the_prefix(name, prefix, caplog):
    value, expected = TRAINER_SAMPLES[name]
    normalized = normalize_fsdp_config({prefix + name: value})
    assert normalized == {name: value}
    with caplog.at_level(logging.WARNING, logger="lockstep.trainer"):
        fields = config_fields(normalized)
    if expected is None:
        assert fields == {}
        assert f"fsdp_config keys ['{name}'] only apply to FSDP1 and are ignored" in caplog.text
    else:
        assert fields == dict([expected])
        assert caplog.text == ""


def test_the_trainer_mapping_uses_the_tables_checks():
    with pytest.raises(
        ValueError,
        match=r"^fsdp_config\.activation_checkpointing must be true, false or an activation policy "
        r"\(none, full, every_<k>, op, offload\), got 'maybe'$",
    ):
        config_fields({"activation_checkpointing": "maybe"})
    with pytest.raises(
        ValueError, match=r"^fsdp_config\.auto_wrap_policy must be one of TRANSFORMER_BASED_WRAP, "
    ):
        config_fields({"auto_wrap_policy": "EVERYTHING"})
    with pytest.raises(ValueError, match=r"sets cpu_offload twice with different values \(True and False\)"):
        config_fields({"offload_params": True, "cpu_offload": "false"})
    assert config_fields({"offload_params": "true", "cpu_offload": True}) == {"cpu_offload": True}
    assert config_fields({"min_num_params": None, "transformer_layer_cls_to_wrap": ""}) == {}
    with pytest.raises(
        ValueError, match=r"unknown key 'fsdp_nope'\. Known keys .*: activation_checkpointing, "
    ):
        normalize_fsdp_config({"fsdp_nope": 1})


# --- derived, not spelled twice -----------------------------------------------------------------------

NEW_KEY = SettingKey(
    key="fsdp_new_knob",
    field="new_knob",
    check=checks.boolean,
    help="a knob added to the table",
    flag=True,
    aliases=("knob",),
)


def test_a_key_added_to_a_table_reaches_file_flags_and_names():
    table = (*FSDP_KEYS, NEW_KEY)
    section = checks.section(file_keys(table))
    assert section({"fsdp_new_knob": "yes"}, "fsdp_config") == {"fsdp_new_knob": True}
    assert table_flags(table, label="FSDP")[-1] == (
        ("--fsdp-new-knob", "--fsdp_new_knob"),
        {"dest": "fsdp_new_knob", "help": "FSDP: a knob added to the table"},
    )
    spellings = by_spelling(table, "fsdp_")
    assert spellings["new_knob"] is NEW_KEY and spellings["knob"] is NEW_KEY
    kwargs = section_kwargs(
        spellings, {"fsdp_new_knob": True, "knob": False}, prefix="fsdp_", where="fsdp_config", owner="P"
    )
    assert kwargs == {"new_knob": False}


def test_the_trainer_mapping_reads_the_table(monkeypatch):
    monkeypatch.setitem(fsdp_keys.SPELLINGS, "new_knob", NEW_KEY)
    monkeypatch.setitem(fsdp_keys.SPELLINGS, "knob", NEW_KEY)
    assert config_fields(normalize_fsdp_config({"fsdp_new_knob": "on"})) == {"new_knob": True}
    assert config_fields(normalize_fsdp_config({"knob": 0})) == {"new_knob": False}


def test_the_launch_flags_are_the_tables_flags():
    flags = launch_cmd.LAUNCH_FLAGS
    fsdp = table_flags(FSDP_KEYS, label="FSDP")
    start = flags.index(fsdp[0])
    assert flags[start : start + len(fsdp)] == fsdp
    assert table_flags(DYNAMO_KEYS)[0] in flags


# --- dynamo and DeepSpeed -----------------------------------------------------------------------------


def test_the_dynamo_section_is_derived_and_names_plugin_fields():
    assert file.DYNAMO_CONFIG_KEYS == file_keys(DYNAMO_KEYS)
    plugin = {item.name for item in dataclasses.fields(TorchDynamoPlugin)}
    assert {entry.key: entry.field for entry in DYNAMO_KEYS} == {
        "dynamo_backend": "backend",
        "dynamo_mode": "mode",
        "dynamo_use_fullgraph": "fullgraph",
        "dynamo_use_dynamic": "dynamic",
        "dynamo_use_regional_compilation": "use_regional_compilation",
    }
    assert {entry.field for entry in DYNAMO_KEYS} - {None} <= plugin
    assert ClusterConfig(
        dynamo_config={"dynamo_backend": "inductor", "dynamo_mode": "DEFAULT"}
    ).dynamo_config == {
        "dynamo_backend": "INDUCTOR",
        "dynamo_mode": "default",
    }


def test_the_deepspeed_section_is_derived_and_its_flags_are_accelerates():
    assert file.section_keys()["deepspeed_config"] == file_keys(DEEPSPEED_KEYS)
    # Every key but gradient_accumulation_steps (the launcher's own flag) is an Accelerate launch flag.
    assert len(DEEPSPEED_KEYS) == 15 and len(flag_keys(DEEPSPEED_KEYS)) == 14
    assert "gradient_accumulation_steps" not in flag_keys(DEEPSPEED_KEYS)
    launcher_only = [entry.key for entry in DEEPSPEED_KEYS if entry.field is None]
    assert launcher_only == [
        "deepspeed_multinode_launcher",
        "deepspeed_hostfile",
        "deepspeed_exclusion_filter",
        "deepspeed_inclusion_filter",
    ]
    with pytest.raises(
        ValueError, match=r"^<dict>: deepspeed_config\.zero_stage must be between 0 and 3, got 4$"
    ):
        ClusterConfig.from_dict({"deepspeed_config": {"zero_stage": 4}})


# --- the checks ---------------------------------------------------------------------------------------


def test_checks_take_what_yaml_json_and_python_give():
    assert checks.boolean("On", "k") is True and checks.boolean(0, "k") is False
    with pytest.raises(ValueError, match=r"^k must be true or false, got 2$"):
        checks.boolean(2, "k")
    assert checks.integer("1e8", "k") == 100_000_000
    with pytest.raises(ValueError, match=r"^k must be an integer, got 1\.5$"):
        checks.integer(1.5, "k")

    class Member:
        name = "FULL_STATE_DICT"

    assert checks.choice("SHARDED_STATE_DICT", "FULL_STATE_DICT")(Member(), "k") == "FULL_STATE_DICT"
    assert checks.class_names(("A", "B"), "k") == ["A", "B"]
    assert checks.reshard_after_forward("shard_grad_op", "k") == "SHARD_GRAD_OP"
    assert checks.sharding_strategy(1, "k") == "FULL_SHARD"


def test_the_vocabulary_modules_do_not_import_torch():
    probe = (
        "import sys\n"
        "import lockstep.config.keys, lockstep.config.checks, lockstep.backends.fsdp.keys\n"
        "import lockstep.backends.deepspeed.keys, lockstep.config.plugins, lockstep.config.file\n"
        "import lockstep.cli.launch_cmd\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
