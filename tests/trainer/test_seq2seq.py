"""``Seq2SeqTrainer`` and ``Seq2SeqTrainingArguments`` against transformers' (issue 32): a tiny T5 trained and
evaluated by generation (beam search) with both, on one and two processes, and with FSDP2 and ZeRO-3 on two.

The runs are ``tests/trainer/seq2seq_parity_run.py`` (both trainers in one interpreter, lockstep first).
Checked: every evaluation's metrics and loss, the predictions (generated ids) and the final weights equal
transformers'; every evaluation generates ``generation_max_length`` columns (the run's is shorter than an
answer, so it binds); on a prediction set that does not fill the last global batch lockstep returns each
example once and the metrics of a one-process pass over it, where transformers' Seq2SeqTrainer (which gathers
with ``accelerator.gather``) returns the filler rows too; FSDP2 generates what DDP generates.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.helpers.close_group_at_exit import RUNNER
from tests.helpers.reference import accelerate_pythonpath, run_module

pytest.importorskip("transformers")

MODULE = "tests.trainer.seq2seq_parity_run"
UNEVEN = 11  # seq2seq_parity_run.UNEVEN
GENERATION_MAX_LENGTH = 6  # seq2seq_parity_run.GENERATION_MAX_LENGTH


def _runs(folder: Path, processes: int, extra: str | None = None) -> dict[str, dict]:
    args = [str(folder), *([extra] if extra else [])]
    first = [
        accelerate_pythonpath()
    ]  # transformers' Seq2SeqTrainer needs accelerate; lockstep never imports it
    if processes > 1:
        torchrun = ["--standalone", f"--nproc-per-node={processes}", RUNNER, "-m", MODULE]
        done = run_module("torch.distributed.run", *torchrun, *args, first=first)
    else:
        done = run_module(MODULE, *args, first=first)
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"which"')]
    return {run["which"]: run for run in runs}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return _runs(tmp_path_factory.mktemp("seq2seq_one"), 1)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return _runs(tmp_path_factory.mktemp("seq2seq_two"), 2)


def _largest_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _assert_same_run(ours: dict, theirs: dict, weights: float) -> None:
    assert len(ours["evaluations"]) == len(theirs["evaluations"]) == 2  # eval_steps 8 of 16 steps
    # generation_max_length (seq2seq_parity_run.GENERATION_MAX_LENGTH) bounds what evaluation generates
    assert [e["eval_generated_length"] for e in ours["evaluations"]] == [GENERATION_MAX_LENGTH] * 2
    for mine, reference in zip(ours["evaluations"], theirs["evaluations"], strict=True):
        assert mine.keys() == reference.keys()
        for key, value in mine.items():
            assert value == pytest.approx(reference[key], abs=1e-6), key
    for key, value in ours["predict_metrics"].items():
        assert value == pytest.approx(theirs["predict_metrics"][key], abs=1e-6), key
    assert ours["predictions"] == theirs["predictions"]  # generated ids, padded to generate's max_length 20
    assert len(ours["predictions"]) == 16 and len(ours["predictions"][0]) == 20
    assert _largest_difference(ours["weights"], theirs["weights"]) <= weights


def test_one_process_generates_and_trains_as_transformers(one_process):
    _assert_same_run(one_process["lockstep"], one_process["transformers"], weights=0.0)  # bitwise


def test_two_processes_generate_and_train_as_transformers(two_processes):
    _assert_same_run(two_processes["lockstep"], two_processes["transformers"], weights=0.0)  # bitwise


def test_an_uneven_prediction_set_gives_each_example_once(two_processes):
    ours, theirs = two_processes["lockstep"], two_processes["transformers"]
    assert ours["uneven"]["predictions"] == ours["by_hand"]["predictions"]
    for key, value in ours["uneven"]["metrics"].items():
        assert value == pytest.approx(ours["by_hand"]["metrics"][key], abs=1e-6), key
    # transformers' Seq2SeqTrainer gathers without dropping the even_batches filler: 16 rows for 11 examples
    assert len(theirs["uneven"]["predictions"]) == 16
    assert theirs["uneven"]["predictions"][:UNEVEN] == ours["uneven"]["predictions"]


def test_fsdp2_generates_what_ddp_generates(two_processes, tmp_path):
    sharded = _runs(tmp_path, 2, json.dumps({"fsdp": "full_shard"}))["lockstep"]
    _assert_same_run(sharded, two_processes["lockstep"], weights=1e-6)
    assert sharded["uneven"]["predictions"] == sharded["by_hand"]["predictions"]


ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 3},
}


def test_zero3_generates_each_example_once_as_a_one_batch_pass(tmp_path):
    """Under DeepSpeed ZeRO-3 (parameters partitioned, gathered per submodule) the trainer's generation, with
    synced_gpus, equals one generate call over the whole uneven set on the same weights. (Both processes
    happened to generate to the same length here, so this does not show synced_gpus itself: without it this
    run also passed.)"""
    pytest.importorskip("deepspeed")
    run = _runs(tmp_path, 2, json.dumps({"deepspeed": ZERO3}))["lockstep"]
    assert [e["eval_generated_length"] for e in run["evaluations"]] == [GENERATION_MAX_LENGTH] * 2
    assert run["uneven"]["predictions"] == run["by_hand"]["predictions"]
    for key, value in run["uneven"]["metrics"].items():
        assert value == pytest.approx(run["by_hand"]["metrics"][key], abs=1e-6), key


# -- the arguments -------------------------------------------------------------------------------------
def test_arguments_parse_with_transformers_parser():
    from transformers import HfArgumentParser

    from lockstep import Seq2SeqTrainingArguments

    line = ["--output_dir", "out", "--predict_with_generate", "--generation_max_length", "16"]
    (args,) = HfArgumentParser(Seq2SeqTrainingArguments).parse_args_into_dataclasses(
        [*line, "--generation_num_beams", "3", "--sortish_sampler", "false"]
    )
    assert (args.predict_with_generate, args.generation_max_length, args.generation_num_beams) == (
        True,
        16,
        3,
    )
    assert args.to_dict()["generation_max_length"] == 16


@pytest.mark.parametrize(
    ("field", "value"),
    [("generation_max_length", 0), ("generation_num_beams", 0), ("generation_num_beams", 1.5)],
)
def test_bad_generation_settings_are_refused(field, value):
    from lockstep import Seq2SeqTrainingArguments

    with pytest.raises(ValueError, match=rf"{field}={value!r}\): give a whole number of at least 1"):
        Seq2SeqTrainingArguments(output_dir="out", **{field: value})


def test_sortish_sampler_warns_that_it_does_nothing(caplog):
    from lockstep import Seq2SeqTrainingArguments

    with caplog.at_level(logging.WARNING, logger="lockstep.trainer.seq2seq"):
        Seq2SeqTrainingArguments(output_dir="out", sortish_sampler=True)
    assert "sortish_sampler=True) has no effect" in caplog.text


def test_generation_config_loads_from_a_folder_a_file_or_an_object(tmp_path):
    from transformers import GenerationConfig

    from lockstep.trainer.seq2seq import load_generation_config

    GenerationConfig(max_length=7, num_beams=3).save_pretrained(tmp_path)
    assert load_generation_config(str(tmp_path)).num_beams == 3
    assert load_generation_config(tmp_path / "generation_config.json").max_length == 7
    original = GenerationConfig(max_length=5)
    copied = load_generation_config(original)
    assert copied.max_length == 5 and copied is not original
    with pytest.raises(ValueError, match=r"generation_config='.*missing'\): no such file or folder"):
        load_generation_config(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"got int; give a folder"):
        load_generation_config(3)
    with pytest.raises(ValueError, match="Fix these issues in generation_config="):
        load_generation_config(
            GenerationConfig(num_beams=1, length_penalty=2.0, do_sample=True, temperature=-1.0)
        )


def test_the_surface_matches_the_installed_transformers():
    """Every field transformers' Seq2SeqTrainingArguments adds, with its default; every method its
    Seq2SeqTrainer defines, with its parameter names (checked against the installed transformers)."""
    import dataclasses
    import inspect

    import transformers

    from lockstep import Seq2SeqTrainer, Seq2SeqTrainingArguments

    base = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    theirs = {f.name: f.default for f in dataclasses.fields(transformers.Seq2SeqTrainingArguments)}
    ours = {f.name: f.default for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    added = {name: default for name, default in theirs.items() if name not in base}
    assert added.keys() == {
        "sortish_sampler",
        "predict_with_generate",
        "generation_max_length",
        "generation_num_beams",
        "generation_config",
    }
    assert {name: ours[name] for name in added} == added
    for name, method in vars(transformers.Seq2SeqTrainer).items():
        if callable(method) or isinstance(method, staticmethod):
            if name.startswith("__") and name != "__init__":
                continue
            assert hasattr(Seq2SeqTrainer, name), name
            if name == "__init__":  # the Trainer's parameters (it passes them on), shown by its signature
                from lockstep import Trainer

                ours_init = inspect.signature(Seq2SeqTrainer.__init__).parameters
                assert list(ours_init) == list(inspect.signature(Trainer.__init__).parameters)
                assert {"model", "args", "processing_class", "compute_metrics"} <= set(ours_init)
                continue
            expected = list(inspect.signature(getattr(transformers.Seq2SeqTrainer, name)).parameters)
            assert list(inspect.signature(getattr(Seq2SeqTrainer, name)).parameters) == expected, name
