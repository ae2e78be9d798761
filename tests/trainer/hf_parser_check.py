"""Sets every field of lockstep's ``TrainingArguments`` through transformers' ``HfArgumentParser``.

Four ways per field: a command line (``parse_args_into_dataclasses``), ``parse_dict``, ``parse_json_file`` and
``parse_yaml_file``. Each parsed object must equal ``TrainingArguments(**same values)`` on that field and
differ from the default arguments (so the value did arrive); a field lockstep does not build must raise its
``NotImplementedError`` (which shows the parser handed the value over).

Run by ``tests/trainer/test_hf_argparser.py`` in-process with the installed transformers, and as
``python -m tests.trainer.hf_parser_check`` under another transformers (``PYTHONPATH=<transformers>:src``):
it prints one JSON object, ``{"transformers": version, "fields": n, "failures": {...}, "optim": [transformers'
default, lockstep's default]}``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from lockstep import TrainingArguments
from lockstep.trainer._field_status import _NOT_BUILT

# field -> (command-line tokens after --field, the same value as JSON/YAML/dict holds it)
VALUES: dict[str, tuple[list[str], Any]] = {
    "output_dir": (["runs/x"], "runs/x"),
    "logging_dir": (["logs"], "logs"),
    "run_name": (["r1"], "r1"),
    "num_train_epochs": (["2.5"], 2.5),
    "max_steps": (["7"], 7),
    "lr_scheduler_type": (["cosine"], "cosine"),
    "lr_scheduler_kwargs": (['{"num_cycles": 2}'], {"num_cycles": 2}),
    "warmup_steps": (["0.1"], 0.1),
    "warmup_ratio": (["0.5"], 0.5),
    "optim": (["sgd"], "sgd"),
    "optim_args": (["momentum=0.9"], "momentum=0.9"),
    "optim_target_modules": (["q_proj"], ["q_proj"]),
    "adam_beta1": (["0.8"], 0.8),
    "adam_beta2": (["0.99"], 0.99),
    "adam_epsilon": (["1e-6"], 1e-6),
    "max_grad_norm": (["0.5"], 0.5),
    "label_smoothing_factor": (["0.1"], 0.1),
    "activation_checkpointing_kwargs": (['{"use_reentrant": true}'], {"use_reentrant": True}),
    "gradient_checkpointing_kwargs": (['{"use_reentrant": true}'], {"use_reentrant": True}),
    "activation_checkpointing_policy": (["every_2"], "every_2"),
    "liger_kernel_config": (None, {"rope": True}),  # transformers' parser cannot read a dict-only field
    "tf32": (["false"], False),  # True needs an Ampere GPU
    "torch_compile_backend": (["eager"], "eager"),
    "torch_compile_mode": (["default"], "default"),
    "neftune_noise_alpha": (["5.0"], 5.0),
    "logging_strategy": (["epoch"], "epoch"),
    "include_num_input_tokens_seen": (["true"], "non_padding"),  # the parser reads this field as a bool
    "log_level": (["info"], "info"),
    "log_level_replica": (["error"], "error"),
    "report_to": (["jsonl"], ["jsonl"]),
    "project": (["p"], "p"),
    "trackio_static_space_id": (["s"], "s"),
    "eval_strategy": (["epoch"], "epoch"),
    "evaluation_strategy": (["epoch"], "epoch"),
    "include_for_metrics": (["inputs", "loss"], ["inputs", "loss"]),
    "save_strategy": (["epoch"], "epoch"),
    "hub_strategy": (["end"], "end"),
    "metric_for_best_model": (["accuracy"], "accuracy"),
    "accelerator_config": (['{"even_batches": false}'], {"even_batches": False}),
    "parallelism_config": (['{"tp_size": 1, "dp_shard_size": 1}'], {"tp_size": 1, "dp_shard_size": 1}),
    "dataloader_multiprocessing_context": (["spawn"], "spawn"),
    "label_names": (["start", "end"], ["start", "end"]),
    "train_sampling_strategy": (["sequential"], "sequential"),
    "loss_type": (["chunked_nll"], "chunked_nll"),
    "ddp_backend": (["gloo"], "gloo"),
    "fsdp": (["full_shard auto_wrap"], "full_shard auto_wrap"),
    "fsdp_config": (['{"min_num_params": 10}'], {"min_num_params": 10}),
    "deepspeed": (['{"train_micro_batch_size_per_gpu": 2}'], {"train_micro_batch_size_per_gpu": 2}),
    "debug": (["underflow_overflow"], "underflow_overflow"),
    "resume_from_checkpoint": (["runs/x/checkpoint-2"], "runs/x/checkpoint-2"),
}
"""Values for the fields whose type alone does not give one."""

NEEDS: dict[str, dict[str, Any]] = {
    "dataloader_prefetch_factor": {"dataloader_num_workers": 1},
    "dataloader_persistent_workers": {"dataloader_num_workers": 1},
    "load_best_model_at_end": {"eval_strategy": "steps", "eval_steps": 5, "save_steps": 10},
    "fsdp_config": {"fsdp": "full_shard"},
    "lr_scheduler_kwargs": {"lr_scheduler_type": "cosine"},
    "optim_args": {"optim": "sgd"},
}
"""Other fields a value needs to be valid."""


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def sample(f: dataclasses.Field) -> tuple[list[str] | None, Any]:
    """A non-default value of field ``f``: (command-line tokens, or None where no parser reads one; value)."""
    if f.name in VALUES:
        return VALUES[f.name]
    default = _default(f)
    if isinstance(default, bool) or (default is None and "bool" in str(f.type)):
        return (["false"], False) if default else (["true"], True)
    if isinstance(default, (int, float)) or (
        default is None and ("int" in str(f.type) or "float" in str(f.type))
    ):
        return (["3"], 3)
    if isinstance(default, str) or (default is None and "str" in str(f.type)):
        return (["x"], "x")
    raise AssertionError(f"hf_parser_check: add a value for TrainingArguments.{f.name} to VALUES")


def _outcome(build: Any) -> Any:
    """What building the arguments gives: the object, or ``("refused", message)``."""
    try:
        return build()
    except NotImplementedError as error:
        return ("refused", str(error))


def _same(value: Any, expected: Any) -> bool:
    return repr(value) == repr(expected) or (type(value) is not bool and value == expected)


def check_field(parser: Any, f: dataclasses.Field, folder: Path) -> list[str]:
    """The ways ``f`` could not be set (empty when every way works)."""
    import yaml

    tokens, value = sample(f)
    needs = NEEDS.get(f.name, {})
    values = {**needs, f.name: value}
    try:
        expected = _outcome(lambda: TrainingArguments(**values))
    except (ValueError, TypeError) as error:
        return [f"TrainingArguments(**{values!r}) itself fails: {error}"]
    not_built = f.name in _NOT_BUILT
    argv = [token for name, v in needs.items() for token in (f"--{name}", str(v))]
    (folder / "a.json").write_text(json.dumps(values), encoding="utf-8")
    (folder / "a.yaml").write_text(yaml.safe_dump(values), encoding="utf-8")
    ways = {
        "parse_dict": lambda: parser.parse_dict(values)[0],
        "parse_json_file": lambda: parser.parse_json_file(str(folder / "a.json"))[0],
        "parse_yaml_file": lambda: parser.parse_yaml_file(str(folder / "a.yaml"))[0],
    }
    if tokens is not None:
        cli = [*argv, f"--{f.name}", *tokens]
        ways["command line"] = lambda: parser.parse_args_into_dataclasses(cli, look_for_args_file=False)[0]
    failures = []
    for way, build in ways.items():
        try:
            got = _outcome(build)
        except (Exception, SystemExit) as error:  # reported, with the field and the way
            failures.append(f"{way}: {type(error).__name__}: {error}")
            continue
        if not_built:
            if not (isinstance(got, tuple) and f"({f.name}=" in got[1]):
                failures.append(f"{way}: expected the not-built refusal, got {got!r}")
        elif isinstance(got, tuple) or isinstance(expected, tuple):
            failures.append(f"{way}: got {got!r}, expected {expected!r}")
        elif cli_reads_differently(f.name, way):
            continue
        elif not _same(getattr(got, f.name), getattr(expected, f.name)):
            failures.append(f"{way}: {getattr(got, f.name)!r} != {getattr(expected, f.name)!r}")
    return failures


def cli_reads_differently(name: str, way: str) -> bool:
    """transformers' parser reads include_num_input_tokens_seen as a bool on the command line."""
    return name == "include_num_input_tokens_seen" and way == "command line"


def run() -> dict[str, Any]:
    """Check every field with the importable transformers; returns the report."""
    import transformers
    from transformers import HfArgumentParser

    parser = HfArgumentParser(TrainingArguments)
    failures = {}
    fields = [f for f in dataclasses.fields(TrainingArguments) if f.init]
    with tempfile.TemporaryDirectory() as folder:
        for f in fields:
            problems = check_field(parser, f, Path(folder))
            if problems:
                failures[f.name] = problems
    # A flag alone sets a bool field, and --no_<field> clears one that defaults to True (transformers' forms).
    flags = parser.parse_args_into_dataclasses(
        ["--bf16", "--no_remove_unused_columns"], look_for_args_file=False
    )
    if (flags[0].bf16, flags[0].remove_unused_columns) != (True, False):
        failures["flags"] = [
            "--bf16 --no_remove_unused_columns did not set bf16=True, remove_unused_columns=False"
        ]
    optim = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}["optim"]
    return {
        "transformers": transformers.__version__,
        "fields": len(fields),
        "failures": failures,
        "optim": [getattr(optim, "value", optim), TrainingArguments().optim],
    }


if __name__ == "__main__":
    json.dump(run(), sys.stdout)
