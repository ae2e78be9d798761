"""Issue 32, item 1: transformers' ``HfArgumentParser`` reads lockstep's ``TrainingArguments``: every field
set from a command line, ``parse_dict``, ``parse_json_file`` and ``parse_yaml_file``, with the installed
transformers (5.x) and with transformers 4.x (the reference environment's ``transformers-4.x`` folder)."""

import json

import pytest

from tests.helpers.reference import run_with_transformers4
from tests.trainer import hf_parser_check

transformers = pytest.importorskip("transformers")


def test_installed_transformers_parser_sets_every_field():
    report = hf_parser_check.run()
    assert report["failures"] == {}
    assert report["fields"] == 116
    assert report["transformers"] == transformers.__version__


def test_transformers_4_parser_sets_every_field():
    done = run_with_transformers4("tests.trainer.hf_parser_check")
    report = json.loads(done.stdout)
    assert report["transformers"].startswith("4."), report["transformers"]
    assert report["failures"] == {}


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
