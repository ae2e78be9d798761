"""FSDP2 with ``fsdp_cpu_ram_efficient_loading: true`` (the config file users copy) and ``from_pretrained``, on
the oldest transformers lockstep supports (4.40) and on the installed one (5.24).

transformers 4.x loads the pretrained weights on local rank 0 only when Accelerate's two variables say so
(``ACCELERATE_USE_FSDP``, ``FSDP_CPU_RAM_EFFICIENT_LOADING``), and that path needs the accelerate package:
announced where accelerate is absent, ``from_pretrained`` failed on every rank with "Using
low_cpu_mem_usage=True or a device_map requires Accelerate". lockstep now announces it only where the
installed transformers can honour it; elsewhere every process reads the weights and lockstep still sends the
main process's weights to the others at ``prepare`` (``sync_module_states``), so training is the same.
transformers 5 needs no accelerate for it (and, at 5.24, still reads the file on every process: the
announcement only spares the others the initialisation of weights the file lacks). Both runs are compared
with the same script under DDP.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import cli_env, lockstep
from tests.helpers.reference import transformers_overlay

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = "tests/scripts/pretrained_fsdp_train.py"
FSDP2_FILE = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_cpu_ram_efficient_loading: true
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
mixed_precision: 'no'
num_machines: 1
num_processes: 2
"""
SAVE_MODEL = """
import sys, torch
from transformers import BertConfig, BertForSequenceClassification
torch.manual_seed(0)
config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=37, max_position_embeddings=32, num_labels=2)
BertForSequenceClassification(config).save_pretrained(sys.argv[1])
"""
# FSDP2 and DDP reduce the gradients in another order; 4 AdamW steps at lr 1e-3 from the same weights.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    env = cli_env(PYTHONPATH=transformers_overlay("4.40.2"))  # written by the oldest, read by both
    done = subprocess.run(
        [sys.executable, "-c", SAVE_MODEL, str(folder)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def _train(model_dir: Path, out: Path, overlay: str | None, fsdp: bool) -> dict:
    out.mkdir()
    args = ["launch", "--num-processes", "2"]
    if fsdp:
        (out / "fsdp2.yaml").write_text(FSDP2_FILE)
        args += ["--config-file", str(out / "fsdp2.yaml")]
    env = cli_env()
    if overlay:
        env["PYTHONPATH"] = overlay + ":" + env["PYTHONPATH"]
    result = lockstep(*args, SCRIPT, str(model_dir), str(out), env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = [json.loads((out / f"loaded_{rank}.json").read_text()) for rank in (0, 1)]
    kind = json.loads((out / "state.json").read_text())["distributed_type"]
    return {"loaded": loaded, "type": kind, "weights": torch.load(out / "final.pt")}


@pytest.fixture(scope="module")
def ddp_run(model_dir, tmp_path_factory) -> dict:
    """The same script under DDP with transformers 4.40.2: the reference of both FSDP2 runs (one launch)."""
    run = _train(
        model_dir, tmp_path_factory.mktemp("ddp") / "ddp", transformers_overlay("4.40.2"), fsdp=False
    )
    assert run["type"] == "MULTI_CPU"
    return run


def _assert_close(run: dict, reference: dict) -> None:
    assert run["weights"].keys() == reference["weights"].keys()
    worst = max((run["weights"][k] - reference["weights"][k]).abs().max().item() for k in run["weights"])
    assert worst < TOLERANCE, worst


def test_transformers_4_without_accelerate_loads_on_every_process_and_matches_ddp(
    model_dir, ddp_run, tmp_path
):
    fsdp = _train(model_dir, tmp_path / "fsdp", transformers_overlay("4.40.2"), fsdp=True)
    assert fsdp["type"] == "FSDP"
    for rank in fsdp["loaded"]:
        assert rank["transformers"] == "4.40.2"
        assert rank["rank0_loading_announced"] not in {"true", "True"}  # 4.40 would need accelerate for it
        assert rank["read_from_file"] == rank["parameters"]
    _assert_close(fsdp, ddp_run)


def test_transformers_5_is_told_and_matches_ddp(model_dir, ddp_run, tmp_path):
    fsdp = _train(model_dir, tmp_path / "fsdp", None, fsdp=True)
    main, other = fsdp["loaded"]
    assert main["transformers"].startswith("5.") and main["rank0_loading_announced"] in {"true", "True"}
    assert main["read_from_file"] == main["parameters"]
    # transformers 5.24 reads the file on every process all the same: the announcement only spares the
    # others' initialisation of weights missing from the file (modeling_utils' _initialize_missing_keys).
    assert other["read_from_file"] == other["parameters"]
    assert fsdp["type"] == "FSDP"
    _assert_close(fsdp, ddp_run)
