"""One LoRA fine-tuning run (peft) for lockstep.Trainer and transformers.Trainer alike: the tiny Llama of seed 0
with LoRA on q_proj/v_proj, activation checkpointing with reentrant checkpoints (the gradients reach the
adapters only through the input-require-grads hook on the frozen embeddings), 8 steps, a checkpoint at step 4,
the adapter saved at the end. Imports torch, transformers and peft only (the reference environment runs it
without pytest or lockstep)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tests.helpers.tiny_llama import make_llama, token_data

SETTINGS: dict[str, Any] = {
    "max_steps": 8,
    "per_device_train_batch_size": 4,
    "learning_rate": 0.01,
    "lr_scheduler_type": "linear",
    "logging_steps": 1,
    "save_strategy": "steps",
    "save_steps": 4,
    "seed": 0,
    "report_to": "none",
    "use_cpu": True,
    "disable_tqdm": True,
    "activation_checkpointing": True,
    "activation_checkpointing_kwargs": {"use_reentrant": True},
}


class Tokens(Dataset):
    """32 sequences of 16 tokens as ``{"input_ids", "labels"}`` (the model shifts the labels)."""

    def __init__(self) -> None:
        self.data = token_data(32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.data[index]
        return {"input_ids": ids, "labels": labels}


def lora_model() -> torch.nn.Module:
    """The tiny Llama of seed 0 (2 layers) with LoRA r=4 on its query and value projections."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(make_llama(0, layers=2), config)


def adapter(model: torch.nn.Module) -> dict[str, list[float]]:
    return {n: p.detach().flatten().tolist() for n, p in model.named_parameters() if p.requires_grad}


def base_sum(model: torch.nn.Module) -> float:
    """The sum of |w| over the frozen base (unchanged by training)."""
    return sum(float(p.detach().abs().double().sum()) for p in model.parameters() if not p.requires_grad)


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


NEFTUNE: dict[str, Any] = {"neftune_noise_alpha": 5.0, "max_steps": 4, "save_strategy": "no"}
"""The same run, shorter, with NEFTune's noise on the input embeddings in training."""


def run(
    trainer_cls: Any,
    args_cls: Any,
    output_dir: str,
    model: torch.nn.Module | None = None,
    settings: dict[str, Any] | None = None,
    **resume: Any,
) -> dict:
    """Train (or resume, with ``resume_from_checkpoint=...``) with :data:`SETTINGS` updated by ``settings``;
    the logged rates and losses, the trained adapter, the number of parameters the optimizer holds, and the
    files of ``checkpoint-4`` and of the final save."""
    model = model if model is not None else lora_model()
    before = base_sum(model)
    arguments = args_cls(output_dir=output_dir, **{**SETTINGS, **(settings or {})})
    trainer = trainer_cls(model=model, args=arguments, train_dataset=Tokens())
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train(**resume)
        trainer.save_model(str(Path(output_dir) / "final"))
    history = trainer.state.log_history
    return {
        "rates": [e["learning_rate"] for e in history if "learning_rate" in e],
        "losses": [e["loss"] for e in history if "loss" in e],
        "adapter": adapter(model),
        "optimized": sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]),
        "base unchanged": base_sum(model) == before,
        "checkpoint": listing(Path(output_dir) / "checkpoint-4"),
        "final": listing(Path(output_dir) / "final"),
    }
