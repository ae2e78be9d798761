"""A model transformers shards itself (``from_pretrained(tp_plan="auto", device_mesh=...)``) trains under lockstep's
tensor parallelism like one process.

transformers refuses ``tp_plan`` unless the accelerate package is importable, and lockstep's test environment does not
install it (lockstep never depends on it): the launched processes get the accelerate package of the reference
environment (``tests/helpers/reference.py``; ``LOCKSTEP_REFERENCE_PYTHONPATH`` overrides it), and only they see it.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.cli import SCRIPTS, cli_env, lockstep
from tests.helpers.llama import tiny_llama_config
from tests.helpers.optional import requires
from tests.helpers.reference import accelerate_pythonpath


def _run(model_dir: str, out: str, processes: int, reference: str) -> dict:
    env = cli_env(PYTHONPATH=os.pathsep.join([reference, cli_env()["PYTHONPATH"]]))
    done = lockstep(
        "launch",
        "--num-processes",
        str(processes),
        str(SCRIPTS / "tp_plan_auto_train.py"),
        model_dir,
        out,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


@requires("transformers")
@pytest.mark.distributed
def test_a_llama_sharded_by_transformers_tp_plan_auto_trains_like_one_process(tmp_path):
    from transformers import LlamaForCausalLM

    reference = accelerate_pythonpath()
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(str(tmp_path / "llama"))
    expected = _run(str(tmp_path / "llama"), str(tmp_path / "one.pt"), 1, reference)
    result = _run(str(tmp_path / "llama"), str(tmp_path / "tp2.pt"), 2, reference)
    assert expected["q_proj"] is None and result["q_proj"] == ["Shard(dim=0)"]
    assert len(result["losses"]) == 6 and len(result["norms"]) == 3
    assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert result["norms"] == pytest.approx(expected["norms"], rel=1e-5)
    assert (result["params"] - expected["params"]).abs().max().item() <= 1e-5


@requires("transformers")
@pytest.mark.distributed
def test_a_moe_model_transformers_sharded_with_fsdp_and_experts_is_refused_naming_the_parallelism_config(
    tmp_path,
):
    """transformers 5's ``distributed_config=DistributedConfig(fsdp_size=2, ep_size=2)`` loads the model as its
    own FSDP2 and expert parallelism did it: ``prepare`` refuses it by name, before DDP fails inside torch
    ("got mixed torch.Tensor and DTensor", what it did before the check)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    reference = accelerate_pythonpath()
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(str(tmp_path / "moe"))
    env = cli_env(PYTHONPATH=os.pathsep.join([reference, cli_env()["PYTHONPATH"]]))
    done = lockstep(
        "launch",
        "--num-processes",
        "2",
        str(SCRIPTS / "distributed_config_prepare.py"),
        str(tmp_path / "moe"),
        env=env,
        timeout=300,
    )
    assert done.returncode != 0
    assert (
        "Qwen3MoeForCausalLM was loaded with from_pretrained(..., distributed_config=DistributedConfig("
        "fsdp_size=2, ep_size=2))" in done.stderr
    ), done.stderr[-3000:]
    assert "Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, ep_size=2))" in done.stderr
    assert "mixed torch.Tensor and DTensor" not in done.stderr
