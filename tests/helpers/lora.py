"""A tiny Llama with LoRA adapters (peft) trained through the Accelerator, for the LoRA tests.

peft is not one of lockstep's dependencies (it imports the accelerate package): the workers put the folders of
:func:`tests.helpers.reference.peft_pythonpath` first on ``sys.path`` before importing it, so that only these
forked processes, never the test process, see accelerate.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.helpers.tiny_llama import token_data

TARGETS = ["q_proj", "v_proj"]
SAMPLES, GLOBAL_BATCH, ACCUMULATION = 32, 8, 2


def use_peft(paths: list[str]) -> None:
    """Make peft (and the accelerate it imports) importable in this process."""
    sys.path[:0] = [path for path in paths if path not in sys.path]
    # peft 0.21 reads transformers' deprecated is_gradient_checkpointing (a FutureWarning of transformers 5)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)


def preload() -> None:
    """Import in the test process, before its workers fork, what every worker would otherwise import and build
    again (each worker paid ~10 s of CPU for it): transformers' Llama, lockstep's Accelerator and FSDP2
    backend, torch's distributed checkpoint, and transformers' table of checkpoint conversions (about 3 s of
    regular expressions, built on the first ``get_peft_model``). peft itself is left to the workers: it
    imports the accelerate package, which this process must not hold for the test files that follow. The
    global random state is left as it was."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    import lockstep.backends.fsdp.checkpoint  # noqa: F401
    from lockstep import Accelerator  # noqa: F401

    with torch.random.fork_rng():
        base_llama(0)
    get_checkpoint_conversion_mapping("llama")


def lora_llama(seed: int = 0, targets: list[str] | None = None) -> nn.Module:
    """The 2-layer tiny Llama of ``seed`` with LoRA (r=4) on its query and value projections."""
    from peft import LoraConfig, get_peft_model

    from tests.helpers.tiny_llama import make_llama

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets or TARGETS)
    return get_peft_model(make_llama(seed, layers=2), config)


def base_llama(seed: int = 0) -> nn.Module:
    from tests.helpers.tiny_llama import make_llama

    return make_llama(seed, layers=2)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor (gathered when sharded: every rank calls it), detached on the CPU."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters, whole, by name (a collective under FSDP2)."""
    return {name.removeprefix("module."): whole(p) for name, p in model.named_parameters() if p.requires_grad}


def loader(world_size: int) -> DataLoader:
    return DataLoader(token_data(SAMPLES), batch_size=GLOBAL_BATCH // world_size)


def train_epoch(accelerator: Any, model: nn.Module, optimizer: Any, data: Any) -> dict[str, list]:
    """One epoch with accumulation and clipping; the losses, the clipped norms, and the names of the parameters
    that had a gradient at each optimizer step."""
    losses, norms, with_grad = [], [], []
    for ids, labels in data:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=labels).loss
            accelerator.backward(loss)
            losses.append(float(accelerator.reduce(loss.detach(), "mean")))
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
                with_grad.append(
                    sorted(
                        n.removeprefix("module.") for n, p in model.named_parameters() if p.grad is not None
                    )
                )
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "with_grad": with_grad}


def folder_bytes(folder: str | os.PathLike[str]) -> int:
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def load_adapter(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """``PeftModel.from_pretrained`` on a freshly built tiny Llama of seed 0 (nothing shared with the model that
    was saved: the adapter comes from the folder alone); the adapter weights."""
    from peft import PeftModel

    with torch.random.fork_rng():  # building the base seeds the global generator
        model = PeftModel.from_pretrained(base_llama(0), str(folder))
    return {name: whole(p) for name, p in model.named_parameters() if "lora_" in name}


def reference_training(targets: list[str] | None = None) -> dict[str, Any]:
    """The same training written in plain PyTorch in one process, no Accelerator: the whole global batch,
    accumulation over ``ACCUMULATION`` micro-batches, gradients clipped to norm 1; the losses and the trained
    adapter (under the peft model's parameter names)."""
    model = lora_llama(0, targets)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for step, (ids, labels) in enumerate(loader(1)):
        loss = model(input_ids=ids, labels=labels).loss
        (loss / ACCUMULATION).backward()
        losses.append(float(loss.detach()))
        if (step + 1) % ACCUMULATION == 0:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return {"losses": losses, "adapter": adapter_weights(model)}


def message_of(action: Any) -> str:
    """The message of the exception ``action()`` raises ('' when it raises none)."""
    try:
        action()
    except Exception as error:  # the test pins the message
        return f"{type(error).__name__}: {error}"
    return ""
