"""Setting groups (:mod:`lockstep.config.setting_specs`): the N-D layout's section, switch, flags and check
are read through the same table as the backends' and layers', and a group registered in code is a section of
the config file and of the launch at once."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from lockstep.cli.launch_flags import add_launch_flags, given_flags
from lockstep.config import checks
from lockstep.config.backend_specs import sectioned_specs
from lockstep.config.file import ClusterConfig, section_keys
from lockstep.config.keys import SettingKey
from lockstep.config.parallelism import ParallelismConfig
from lockstep.config.parallelism_keys import LAYOUT, PARALLELISM_KEYS
from lockstep.config.setting_specs import SettingSpec, register_setting_spec, unregister_setting_spec
from lockstep.errors import UsageError
from lockstep.launcher.settings import resolve


def _settings(*argv: str, file_config: ClusterConfig | None = None):
    parser = argparse.ArgumentParser()
    add_launch_flags(parser)
    return resolve(given_flags(parser.parse_args(["--cpu", *argv])), file_config, "cfg.yaml")


def test_the_layout_is_read_through_the_table_of_sections():
    specs = sectioned_specs()
    assert specs[-1] is LAYOUT and LAYOUT.config_section == "parallelism_config"
    assert (
        LAYOUT.enable_flag == "use_parallelism_config" and LAYOUT.accelerator_argument == "parallelism_config"
    )
    assert LAYOUT.trainer_argument is None  # TrainingArguments(parallelism_config=...) is a field of its own
    assert list(section_keys()["parallelism_config"]) == [entry.key for entry in PARALLELISM_KEYS]
    built = LAYOUT.plugin_from_section({"parallelism_config_tp_size": 2})
    assert isinstance(built, ParallelismConfig) and built.tp_size == 2


def test_the_switch_is_on_when_the_section_is_given_and_the_workers_get_none_when_off():
    off = _settings()
    assert off.use_parallelism_config is False and off.worker_settings()["parallelism_config"] is None
    assert ("use_parallelism_config", False, "default") in off.explain()
    on = _settings("--use_parallelism_config")
    assert on.use_parallelism_config is True and on.worker_settings()["parallelism_config"] == {}
    sized = _settings("--num-processes", "2", "--parallelism-config-tp-size", "2")
    assert sized.worker_settings()["parallelism_config"] == {"parallelism_config_tp_size": 2}
    assert ("use_parallelism_config", True, "flag") in sized.explain()
    empty_file = ClusterConfig(distributed_type="MULTI_CPU", num_processes=2, parallelism_config={})
    assert _settings(file_config=empty_file).worker_settings()["parallelism_config"] is None
    file = ClusterConfig(
        distributed_type="MULTI_CPU", num_processes=2, parallelism_config={"parallelism_config_tp_size": 2}
    )
    from_file = _settings(file_config=file)
    assert from_file.use_parallelism_config is True
    assert from_file.worker_settings()["parallelism_config"] == {"parallelism_config_tp_size": 2}
    assert file.summary().endswith("device mesh tp=2")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--num-processes", "2", "--parallelism-config-tp-size", "4"],
            "ParallelismConfig settings: ParallelismConfig(dp_replicate_size=1, dp_shard_size=1, tp_size=4, "
            "cp_size=1, sp_size=1, pp_size=1) needs 1 x 1 x 4 x 1 x 1 x 1 = 4 processes, but this run has 2.",
        ),
        (
            ["--num-machines", "1:2", "--num-processes", "6", "--parallelism-config-tp-size", "2"],
            "ParallelismConfig settings: An elastic job on 3 processes cannot keep this layout",
        ),
        (
            ["--use-deepspeed", "--use-parallelism-config", "--num-processes", "2"],
            "--use-parallelism-config with DeepSpeed is not built",
        ),
    ],
)  # fmt: skip
def test_the_layouts_check_runs_before_any_process_starts(argv, message):
    with pytest.raises(UsageError) as raised:
        _settings(*argv)
    assert str(raised.value).startswith(message)


def test_a_group_registered_in_code_is_a_section_of_the_file_and_the_launch():
    spec = register_setting_spec(
        SettingSpec(
            name="doc_group",
            config_section="doc_group_config",
            enable_flag="use_doc_group",
            keys=(SettingKey(key="doc_size", field="size", check=checks.int_range(1), help="a size"),),
        )
    )
    try:
        assert (
            register_setting_spec(spec) is spec
        )  # the same group again (its module imported twice): no change
        with pytest.raises(ValueError, match="A setting group named 'doc_group' is registered already"):
            register_setting_spec(dataclasses.replace(spec, summary="another group"))
        config = ClusterConfig(doc_group_config={"doc_size": 3})
        assert config.doc_group_config == {"doc_size": 3}
        launched = resolve({"use_cpu": True}, config, "cfg.yaml")
        assert launched.use_doc_group is True
        assert launched.worker_settings()["doc_group_config"] == {"doc_size": 3}
        assert resolve({"use_cpu": True}).worker_settings()["doc_group_config"] is None
    finally:
        unregister_setting_spec("doc_group")
    assert "doc_group_config" not in section_keys()
