"""The DeepSpeed paths that JIT-compile C++ extensions: optimizer offload to the CPU (DeepSpeed's CPU Adam
replaces a torch AdamW, as in Accelerate) and a config AdamW without torch_adam (FusedAdam). Each build takes
minutes, so these run only with LOCKSTEP_JIT_TESTS=1; the extensions are cached in
~/.cache/lockstep/torch_extensions (TORCH_EXTENSIONS_DIR) so a second run starts at once.

    LOCKSTEP_JIT_TESTS=1 .venv/bin/python -m pytest -m jit tests/backends/test_deepspeed_jit.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.backends.test_deepspeed import AUTO_ADAMW, LENGTH, PER_PROCESS, _train
from tests.helpers.fsdp_models import reference_run
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires

pytestmark = [
    requires("deepspeed"),
    pytest.mark.distributed,
    pytest.mark.jit,
    pytest.mark.skipif(
        os.environ.get("LOCKSTEP_JIT_TESTS") != "1", reason="builds C++ extensions: set LOCKSTEP_JIT_TESTS=1"
    ),
]
EXTENSIONS = {"TORCH_EXTENSIONS_DIR": str(Path.home() / ".cache" / "lockstep" / "torch_extensions")}


def _offloaded(stage: int) -> dict:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin
    from tests.helpers.fsdp_models import data_loader, loss_of, make_transformer

    plugin = DeepSpeedPlugin(zero_stage=stage, offload_optimizer_device="cpu", gradient_clipping=0.0)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model = make_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, data_loader(LENGTH, PER_PROCESS))
    for _ in range(2):
        for batch in loader:
            accelerator.backward(loss_of(model, batch))
            optimizer.step()
            optimizer.zero_grad()
    return {
        "optimizer": type(model.optimizer.optimizer).__name__,
        "params": torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]),
    }


def test_optimizer_offload_swaps_in_deepspeeds_cpu_adam_and_trains_like_adamw():
    expected, _ = reference_run(LENGTH, PER_PROCESS * 2, adamw=True)
    results = run_distributed(_offloaded, 2, 2, timeout=900, env=EXTENSIONS)
    for result in results:
        assert result["optimizer"] == "DeepSpeedCPUAdam"
        torch.testing.assert_close(result["params"], expected, rtol=0, atol=1e-4)


def test_a_config_adamw_without_torch_adam_builds_deepspeeds_fused_adam():
    config = {**AUTO_ADAMW, "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    expected, _ = reference_run(LENGTH, PER_PROCESS * 2, adamw=True)
    results = run_distributed(_train, 2, 2, {"config": config}, timeout=900, env=EXTENSIONS)
    for result in results:
        torch.testing.assert_close(result["params"], expected, rtol=0, atol=1e-4)
