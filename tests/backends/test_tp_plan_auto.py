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
