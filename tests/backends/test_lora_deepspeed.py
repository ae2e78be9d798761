"""LoRA adapters (peft) under DeepSpeed ZeRO-2: 2 processes train like one process with only the adapters
trainable (peft and accelerate from the reference environment, as in ``test_lora.py``). Measured: the adapters
agree with one process within 1.4e-7 (AdamW, 2 optimizer steps, accumulation 2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import lora
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires
from tests.helpers.reference import peft_pythonpath

pytestmark = [
    requires("transformers", "deepspeed"),
    pytest.mark.distributed,
    pytest.mark.usefixtures("deepspeed_preloaded"),
]


def _train(paths: list[str], stage: int | None) -> dict[str, Any]:
    lora.use_peft(paths)
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    plugin = (
        {}
        if stage is None
        else {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1.0)}
    )
    accelerator = Accelerator(gradient_accumulation_steps=lora.ACCUMULATION, **plugin)
    model = lora.lora_llama(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, lora.loader(accelerator.num_processes))
    losses = []
    for ids, labels in data:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=labels).loss
            accelerator.backward(loss)
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            if stage is None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "adapter": _adapter(model, stage)}


def _adapter(model: torch.nn.Module, stage: int | None) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if stage != 3:
        return {name: p.detach().clone() for name, p in named}
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {name: p.detach().clone() for name, p in named}


# ZeRO-3 is not here yet: with the adapters, its first forward already differs from one process's (loss 4.1713 vs
# 4.1629) while the same Llama without adapters matches; see the branch's report.
@pytest.mark.parametrize("stage", [2])
def test_zero_trains_the_adapters_like_one_process(stage):
    paths = peft_pythonpath()
    expected = run_distributed(_train, 1, paths, None, timeout=120)[0]
    results = run_distributed(_train, 2, paths, stage, timeout=300)
    adapter = results[0]["adapter"]
    assert sorted(adapter) == sorted(expected["adapter"]) and len(adapter) == 8
    difference = max(float((adapter[n] - expected["adapter"][n]).abs().max()) for n in adapter)
    print(f"ZeRO-{stage}: max |adapter - one process| = {difference:.3g}")
    assert difference <= 1e-6
    assert results[0]["losses"] == pytest.approx(expected["losses"], abs=1e-5)
