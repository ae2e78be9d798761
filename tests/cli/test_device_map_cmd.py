"""``lockstep device-map MODEL_DIR --max-memory ...``: the plan a model would get, without loading it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import lockstep_in_process

pytest.importorskip("transformers")


@pytest.fixture
def model_dir(tmp_path):
    from tests.helpers.llama import tiny_llama_config

    config = tiny_llama_config(num_hidden_layers=6, tie_word_embeddings=True)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)  # a config only: no weight file exists
    return tmp_path


def test_prints_the_plan_as_a_table(model_dir):
    # 6 decoder layers of 36.25 KiB; 120000 B (117.19 KiB) less the largest layer leaves 80.94 KiB for the
    # CPU: the embedding (8 KiB, with the head tied to it) and layers 0 and 1 (72.5 KiB)
    done = lockstep_in_process("device-map", str(model_dir), "--max-memory", "cpu=120000")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"Model: LlamaForCausalLM from {model_dir}; no-split blocks: LlamaDecoderLayer",
        "module             | size      | device",
        "-------------------+-----------+-------",
        "model.embed_tokens | 8.00 KiB  | cpu",
        "model.layers.0     | 36.25 KiB | cpu",
        "model.layers.1     | 36.25 KiB | cpu",
        "model.layers.2     | 36.25 KiB | disk",
        "model.layers.3     | 36.25 KiB | disk",
        "model.layers.4     | 36.25 KiB | disk",
        "model.layers.5     | 36.25 KiB | disk",
        "model.norm         | 128 B     | disk",
        "model.rotary_emb   | 32 B      | disk",
        "lm_head            | 0 B       | cpu",
        "total on cpu: 80.50 KiB; on disk: 145.16 KiB",
    ]


def test_json_and_dtype(model_dir):
    done = lockstep_in_process(
        "device-map", str(model_dir), "--max-memory", "cpu=1GiB", "--dtype", "bf16", "--json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"device_map": {"": "cpu"}, "sizes": {"": 231072 // 2}}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-memory", "cpu=lots"], "--max-memory 'cpu=lots': 'lots' is not a size"),
        (["--max-memory", "gpu=1GB"], "--max-memory 'gpu=1GB' is invalid: write DEVICE=SIZE"),
        (
            ["--max-memory", "cpu=10KB"],
            "the largest block that cannot be split, 'model.layers.0' (36.25 KiB)",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(model_dir, args, message):
    done = lockstep_in_process("device-map", str(model_dir), *args)
    assert done.returncode == 2 and message in done.stderr and done.stdout == ""


def test_a_folder_without_a_config(tmp_path):
    done = lockstep_in_process("device-map", str(tmp_path), "--max-memory", "cpu=1GB")
    assert done.returncode == 2 and "has no config.json" in done.stderr
