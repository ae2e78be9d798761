"""LoRA adapters (peft) under DeepSpeed ZeRO-2 and ZeRO-3: 2 processes train like one process with only the
adapters trainable (peft and accelerate from the reference environment, as in ``test_lora.py``). Measured: the
adapters agree with one process within 1.4e-7 under ZeRO-2, 1.6e-7 under ZeRO-3 (AdamW, 2 optimizer steps,
accumulation 2). ``save_state`` leaves the frozen base out (DeepSpeed's ``exclude_frozen_parameters``) and
``load_state`` resumes bitwise; the base's fingerprint taken from ZeRO-3's partitions equals the whole one's.

One group of two workers does it all: each first trains the same model in plain PyTorch on the whole global
batch (the one-process reference, no process group involved), then through the Accelerator with DeepSpeed.
"""

from __future__ import annotations

import json
from pathlib import Path
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


def _epoch(accelerator: Any, model: torch.nn.Module, optimizer: Any, data: Any) -> list[float]:
    losses = []
    for ids, labels in data:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=labels).loss
            accelerator.backward(loss)
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            optimizer.step()
            optimizer.zero_grad()
    return losses


def _train(stage: int, out: Path) -> dict[str, Any]:
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
    result: dict[str, Any] = {"losses": _epoch(accelerator, model, optimizer, data)}
    result["adapter"] = _adapter(model, stage)
    accelerator.save_state(str(out))
    result["record"] = json.loads((out / "frozen_base.json").read_text())["models"]["0"]
    result["files"] = {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    result["after"] = (_epoch(accelerator, model, optimizer, data), _adapter(model, stage))
    _perturb(model, stage)
    accelerator.load_state(str(out))
    result["resumed"] = (_epoch(accelerator, model, optimizer, data), _adapter(model, stage))
    return result


def _perturb(model: torch.nn.Module, stage: int) -> None:
    import deepspeed

    trainable = [p for p in model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(trainable, modifier_rank=0, enabled=stage == 3), torch.no_grad():
        for p in trainable:
            p.add_(1.0)


def _adapter(model: torch.nn.Module, stage: int) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if stage != 3:
        return {name: p.detach().clone() for name, p in named}
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {name: p.detach().clone() for name, p in named}


def _reference_then_zero(paths: list[str], stages: tuple[int, ...], out: str) -> dict[Any, dict[str, Any]]:
    from lockstep.checkpoint.frozen_base import fingerprint

    lora.use_peft(paths)
    results: dict[Any, dict[str, Any]] = {"one process": lora.reference_training()}
    results["one process"]["base"] = fingerprint(lora.lora_llama(0))
    for stage in stages:
        results[stage] = _train(stage, Path(out) / f"zero{stage}")
        reset_lockstep_state()  # the process group stays: the next stage's Accelerator takes it
    results["trainer zero3"] = _trainer_zero3(Path(out) / "trainer_zero3")
    reset_lockstep_state()
    return results


ZERO3 = {
    "zero_optimization": {"stage": 3},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


def _trainer_zero3(out: Path) -> dict[str, Any]:
    """lockstep.Trainer with TrainingArguments(deepspeed=<ZeRO-3>): checkpoint-4, checkpoint-8 and save_model
    hold peft's adapter folder, gathered from both processes' partitions."""
    import contextlib
    import io

    from lockstep import Trainer, TrainingArguments
    from tests.reference import _peft_trainer_run as shared

    model = shared.lora_model()
    settings = {**shared.SETTINGS, "activation_checkpointing": False, "deepspeed": ZERO3}
    arguments = TrainingArguments(output_dir=str(out), **settings)
    trainer = Trainer(model=model, args=arguments, train_dataset=shared.Tokens())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
        trainer.save_model(str(out / "final"))
    found: dict[str, Any] = {"adapter": _adapter(trainer.model_wrapped, 3)}  # a collective
    found["files"] = shared.listing(out / "checkpoint-8")
    found["partitioned"] = [
        tuple(p.shape) for p in trainer.model_wrapped.module.parameters() if p.requires_grad
    ]
    reset_lockstep_state()  # a model built from here on is an ordinary one, not a ZeRO-3 partition
    found["loaded"] = {name: lora.load_adapter(out / name) for name in ("checkpoint-8", "final")}
    return found


STAGES = (2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[Any, dict[str, Any]]:
    paths = peft_pythonpath()
    lora.preload()
    out = str(tmp_path_factory.mktemp("lora_zero"))
    return run_distributed(_reference_then_zero, 2, paths, STAGES, out, timeout=300)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_trains_the_adapters_like_one_process(runs, stage):
    expected, adapter = runs["one process"], runs[stage]["adapter"]
    assert sorted(adapter) == sorted(expected["adapter"]) and len(adapter) == 8
    difference = max(float((adapter[n] - expected["adapter"][n]).abs().max()) for n in adapter)
    print(f"ZeRO-{stage}: max |adapter - one process| = {difference:.3g}")
    assert difference <= 1e-6
    assert runs[stage]["losses"] == pytest.approx(expected["losses"], abs=1e-5)


@pytest.mark.parametrize("stage", STAGES)
def test_zero_checkpoints_leave_the_frozen_base_out_and_resume_exactly(runs, stage):
    result = runs[stage]
    losses, adapter = result["after"]
    assert result["resumed"][0] == losses
    assert all(torch.equal(result["resumed"][1][name], adapter[name]) for name in adapter)
    assert result["record"]["saved"] == sorted(adapter)
    # the base's fingerprint taken from ZeRO-3's partitions equals the one of the whole weights in one process
    base = runs["one process"]["base"]
    assert sorted(result["record"]["frozen"]) == sorted(base) and len(base) == 21
    for name, expected in base.items():
        saved = result["record"]["frozen"][name]
        assert saved[:2] == expected[:2] and saved[2:] == pytest.approx(expected[2:], rel=1e-9), name
    files = result["files"]
    model_states = sum(size for name, size in files.items() if name.endswith("model_states.pt"))
    print(f"ZeRO-{stage}: checkpoint {sum(files.values())} B, model states {model_states} B: {files}")
    assert model_states <= MODEL_STATES_BYTES[stage]


# Measured (DeepSpeed's exclude_frozen_parameters): the module's files were 114,465 B (ZeRO-2) and 2 x 72,213 B
# (ZeRO-3: every rank its fragments of the frozen base) with the base; 13,081 B and 2 x 11,199 B without it.
# The whole checkpoints: 207,024 -> 109,885 B (ZeRO-2), 235,989 -> 118,143 B (ZeRO-3), 41 kB of which are
# DeepSpeed's zero_to_fp32.py and zero_to_torch.py scripts.
MODEL_STATES_BYTES = {2: 14_000, 3: 23_000}


def test_trainer_under_zero3_writes_the_gathered_adapter_folder(runs):
    """Under ZeRO-3 each process holds a partition of every adapter matrix (an empty placeholder as the
    parameter): the adapter folders are gathered from both, and peft loads them to the trained adapter."""
    found = runs["trainer zero3"]
    assert set(found["partitioned"]) == {(0,)}  # the parameters themselves are ZeRO-3 placeholders
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(found["files"])
    trained = {name.removeprefix("module."): tensor for name, tensor in found["adapter"].items()}
    for folder, loaded in found["loaded"].items():
        assert len(loaded) == len(trained) == 8, folder
        for name, tensor in loaded.items():
            assert torch.equal(tensor, trained[name]), (folder, name)
