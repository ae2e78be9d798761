"""``lockstep to-fsdp2``: an FSDP1 config file converted to FSDP2, as ``accelerate to-fsdp2`` converts it."""

from __future__ import annotations

import pytest
import yaml

from lockstep.backends.fsdp.to_fsdp2 import convert_to_fsdp2
from lockstep.cli.main import main
from lockstep.config.file import load_config_file

# As `accelerate config` wrote an FSDP1 file.
FSDP1_FILE = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
mixed_precision: bf16
num_processes: 2
tpu_use_cluster: false
"""
FSDP2_SECTION = {
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_offload_params": False,
    "fsdp_reshard_after_forward": False,
    "fsdp_state_dict_type": "SHARDED_STATE_DICT",
    "fsdp_transformer_layer_cls_to_wrap": "BertLayer",
    "fsdp_version": 2,
}


def test_an_fsdp1_file_is_converted_and_every_change_is_named(tmp_path, capsys):
    source, output = tmp_path / "fsdp1.yaml", tmp_path / "fsdp2.yaml"
    source.write_text(FSDP1_FILE)
    assert main(["to-fsdp2", "--config_file", str(source), "--output_file", str(output)]) == 0
    converted = yaml.safe_load(output.read_text())
    assert converted["fsdp_config"] == FSDP2_SECTION
    # Every other key is kept as written, including those lockstep ignores; the input is not touched.
    assert {k: v for k, v in converted.items() if k != "fsdp_config"} == {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": "bf16",
        "num_processes": 2,
        "tpu_use_cluster": False,
    }
    assert source.read_text() == FSDP1_FILE
    out, err = capsys.readouterr()
    assert out == f"Converted {source} -> {output}\n"
    assert err.splitlines() == [
        "lockstep to-fsdp2: removed fsdp_backward_prefetch: FSDP2 has no such setting",
        "lockstep to-fsdp2: removed fsdp_forward_prefetch: FSDP2 has no such setting",
        "lockstep to-fsdp2: fsdp_sharding_strategy SHARD_GRAD_OP became fsdp_reshard_after_forward: false",
        "lockstep to-fsdp2: removed fsdp_sync_module_states: FSDP2 has no such setting",
        "lockstep to-fsdp2: removed fsdp_use_orig_params: FSDP2 has no such setting",
    ]
    with pytest.warns(UserWarning, match="ignoring tpu_use_cluster"):
        assert load_config_file(output).fsdp_config == FSDP2_SECTION  # lockstep loads the result


def test_overwrite_converts_in_place_and_a_second_run_changes_nothing(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(FSDP1_FILE)
    assert main(["to-fsdp2", "--config-file", str(path), "--overwrite"]) == 0
    assert yaml.safe_load(path.read_text())["fsdp_config"] == FSDP2_SECTION
    capsys.readouterr()
    assert main(["to-fsdp2", "--config-file", str(path), "--overwrite"]) == 0
    out, err = capsys.readouterr()
    assert out == f"Copied unchanged {path} -> {path}\n"
    assert "already says fsdp_version: 2, so nothing was converted" in err
    assert yaml.safe_load(path.read_text())["fsdp_config"] == FSDP2_SECTION


@pytest.mark.parametrize(
    ("strategy", "reshard"),
    [
        ("FULL_SHARD", True),
        ("HYBRID_SHARD", True),
        ("HYBRID_SHARD_ZERO2", False),
        ("NO_SHARD", False),
        (2, False),
    ],
)
def test_every_sharding_strategy_maps_as_in_accelerate(strategy, reshard):
    section = convert_to_fsdp2({"fsdp_config": {"fsdp_sharding_strategy": strategy}}).config["fsdp_config"]
    assert section == {"fsdp_reshard_after_forward": reshard, "fsdp_version": 2}
    # An FSDP1 name written under the FSDP2 key (as newer Accelerate wrote FSDP1 files) becomes its bool too.
    if isinstance(strategy, str):
        section = convert_to_fsdp2({"fsdp_config": {"fsdp_reshard_after_forward": strategy}}).config[
            "fsdp_config"
        ]
        assert section["fsdp_reshard_after_forward"] is reshard


def test_a_file_without_fsdp_is_copied_unchanged(tmp_path, capsys):
    source, output = tmp_path / "ddp.yaml", tmp_path / "out.yaml"
    source.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n")
    assert main(["to-fsdp2", "--config-file", str(source), "--output-file", str(output)]) == 0
    assert yaml.safe_load(output.read_text()) == {"distributed_type": "MULTI_CPU", "num_processes": 2}
    assert "no fsdp_config section: nothing to convert" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (None, ["--overwrite"], "--config-file '{source}' does not exist."),
        ("", ["--overwrite"], "{source} is empty: there is nothing to convert."),
        ("- a\n- b\n", ["--overwrite"], "{source} must hold a mapping of settings, got list."),
        (FSDP1_FILE, [], "pass --output-file OUT, or --overwrite to convert the file in place."),
        (
            FSDP1_FILE,
            ["--output-file", "{output}"],
            "{output} already exists; pass --overwrite to replace it.",
        ),
        (
            "fsdp_config:\n  fsdp_sharding_strategy: EVERYWHERE\n",
            ["--overwrite"],
            "{source}: fsdp_config.fsdp_sharding_strategy must be one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
            "HYBRID_SHARD, HYBRID_SHARD_ZERO2, got 'EVERYWHERE'; nothing was written.",
        ),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, content, extra, message):
    source, output = tmp_path / "in.yaml", tmp_path / "out.yaml"
    output.write_text("kept: true\n")
    if content is not None:
        source.write_text(content)
    argv = ["to-fsdp2", "--config-file", str(source), *(arg.format(output=output) for arg in extra)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"lockstep to-fsdp2: error: {message.format(source=source, output=output)}\n"
    assert output.read_text() == "kept: true\n"
    assert (source.read_text() if content is not None else None) == content
