"""Issue 32, item 1: transformers' ``HfArgumentParser`` reads lockstep's ``TrainingArguments``: every field
set from a command line, ``parse_dict``, ``parse_json_file`` and ``parse_yaml_file``, with the installed
transformers (5.x) and with transformers 4.x (the reference environment's ``transformers-4.x`` folder)."""

import json

import pytest

from tests.helpers.reference import TRANSFORMERS_4, run_with_transformers
from tests.trainer import hf_parser_check

transformers = pytest.importorskip("transformers")


def test_installed_transformers_parser_sets_every_field():
    report = hf_parser_check.run()
    assert report["failures"] == {}
    assert (
        report["fields"] == 125
    )  # with lockstep's activation_checkpointing_policy, fault_tolerance, elastic_..., loss_type
    assert report["transformers"] == transformers.__version__
    assert report["optim"] == ["adamw_torch_fused", "adamw_torch_fused"]  # transformers 5.24, torch >= 2.8


@pytest.mark.parametrize("version", TRANSFORMERS_4)
def test_transformers_4_parser_sets_every_field_and_defaults_follow_it(version):
    """Item 3 too: under transformers 4.x, lockstep's default optim is that version's."""
    report = json.loads(run_with_transformers("tests.trainer.hf_parser_check", version).stdout)
    assert report["transformers"] == version
    assert report["failures"] == {}
    theirs, ours = report["optim"]
    assert ours == theirs
    assert ours == ("adamw_torch" if report["transformers"] < "4.54" else "adamw_torch_fused")


def test_the_issue_example_parses_three_dataclasses(tmp_path):
    """The first line of transformers' example scripts, with one of their argument dataclasses."""
    from dataclasses import dataclass, field

    from lockstep import TrainingArguments

    @dataclass
    class ModelArguments:
        model_name_or_path: str = field(default="tiny", metadata={"help": "model"})

    parser = transformers.HfArgumentParser((ModelArguments, TrainingArguments))
    model_args, args = parser.parse_args_into_dataclasses(
        ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--report_to", "none", "--fsdp", ""],
        look_for_args_file=False,
    )
    assert (model_args.model_name_or_path, args.output_dir, args.report_to, args.fsdp) == (
        "m",
        str(tmp_path),
        [],
        "",
    )


def test_without_transformers_the_defaults_are_5_24s(monkeypatch):
    from importlib import metadata

    from lockstep.trainer import _transformers_version as versions

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(versions.metadata, "version", not_installed)
    assert versions.transformers_version() == (5, 24)
    assert versions.default_optim(versions.transformers_version(), (2, 13)) == "adamw_torch_fused"
    assert versions.default_optim((4, 53), (2, 13)) == "adamw_torch"
    assert versions.default_optim((5, 24), None) == "adamw_torch"
