"""LoRA adapters (peft) under DeepSpeed ZeRO-2 and ZeRO-3: 2 processes train like one process with only the
adapters trainable (peft and accelerate from the reference environment, as in ``test_lora.py``). Measured: the
adapters agree with one process within 1.4e-7 under ZeRO-2, 1.6e-7 under ZeRO-3 (AdamW, 2 optimizer steps,
accumulation 2).

One group of two workers does it all: each first trains the same model in plain PyTorch on the whole global
batch (the one-process reference, no process group involved), then through the Accelerator with DeepSpeed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers import lora
from tests.helpers.multiprocess import reset_lockstep_state, run_distributed
from tests.helpers.optional import requires
from tests.helpers.reference import peft_pythonpath

pytestmark = [
    requires("transformers", "deepspeed"),
    pytest.mark.distributed,
    pytest.mark.usefixtures("deepspeed_preloaded"),
]


def _train(stage: int) -> dict[str, Any]:
    from lockstep import Accelerator
    from lockstep.utils import DeepSpeedPlugin

    # Built before the Accelerator: under ZeRO-3 a model built after it is built inside deepspeed.zero.Init
    # (zero3_init_flag defaults to True, as in Accelerate), whose random initial weights differ from a plain
    # build's (the base's too, with or without adapters; the same on every process), so it could not be
    # compared with the one-process reference.
    model = lora.lora_llama(0)
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_clipping=1.0)
    accelerator = Accelerator(gradient_accumulation_steps=lora.ACCUMULATION, deepspeed_plugin=plugin)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, lora.loader(accelerator.num_processes))
    losses = []
    for ids, labels in data:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=labels).loss
            accelerator.backward(loss)
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "adapter": _adapter(model, stage)}


def _adapter(model: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if stage != 3:
        return {name: p.detach().clone() for name, p in named}
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {name: p.detach().clone() for name, p in named}


def _reference_then_zero(paths: list[str], stages: tuple[int, ...]) -> dict[Any, dict[str, Any]]:
    lora.use_peft(paths)
    results: dict[Any, dict[str, Any]] = {"one process": lora.reference_training()}
    for stage in stages:
        results[stage] = _train(stage)
        reset_lockstep_state()  # the process group stays: the next stage's Accelerator takes it
    return results


STAGES = (2, 3)


@pytest.fixture(scope="module")
def runs() -> dict[Any, dict[str, Any]]:
    paths = peft_pythonpath()
    lora.preload()
    return run_distributed(_reference_then_zero, 2, paths, STAGES, timeout=300)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_trains_the_adapters_like_one_process(runs, stage):
    expected, adapter = runs["one process"], runs[stage]["adapter"]
    assert sorted(adapter) == sorted(expected["adapter"]) and len(adapter) == 8
    difference = max(float((adapter[n] - expected["adapter"][n]).abs().max()) for n in adapter)
    print(f"ZeRO-{stage}: max |adapter - one process| = {difference:.3g}")
    assert difference <= 1e-6
    assert runs[stage]["losses"] == pytest.approx(expected["losses"], abs=1e-5)
