"""Models with adapters from ``peft`` (LoRA): recognised, saved as peft saves them, and guarded.

peft is never imported here: a model is a peft model only when the user built it, so peft is already in
``sys.modules`` (importing it would import the accelerate package, which lockstep never does). The functions
that need peft's own code (its adapter state dict, its adapter folder) are only reached with a peft model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

_MERGERS = ("merge_and_unload", "merge_adapter")


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` (not unwrapped) is a ``peft.PeftModel``, without importing peft."""
    peft = sys.modules.get("peft")
    peft_model = getattr(peft, "PeftModel", None)
    return isinstance(peft_model, type) and isinstance(model, peft_model)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The active adapter's tensors under peft's names (``...q_proj.lora_A.weight``: no adapter name), as
    ``get_peft_model_state_dict`` gives them; DTensor shards under FSDP2 (nothing is gathered)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=model.active_adapter)


def gathered_adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (the adapter) under the model's names, whole, as CPU copies (every process
    calls it together: a sharded DTensor or a DeepSpeed ZeRO-3 partition is gathered)."""
    from torch.distributed.tensor import DTensor

    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_tensor") for _, p in named):  # ZeRO-3: deepspeed is imported already
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {name: p.detach().to("cpu", copy=True) for name, p in named}
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
        for name, p in named
    }


def load_adapter_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> Any:
    """Copy ``state_dict`` (peft's names, as :func:`adapter_state_dict`) into the active adapter."""
    from peft import set_peft_model_state_dict

    return set_peft_model_state_dict(model, state_dict, adapter_name=model.active_adapter)


def save_adapter_folder(
    model: nn.Module, state_dict: dict[str, torch.Tensor], directory: str | Path, safe_serialization: bool
) -> None:
    """Write ``adapter_config.json`` and the adapter's weights (``adapter_model.safetensors``) into
    ``directory`` from ``state_dict``, the model's whole weights gathered on this process (peft keeps the
    adapter's): the folder ``PeftModel.from_pretrained(base, directory)`` reads."""
    model.save_pretrained(str(directory), state_dict=state_dict, safe_serialization=safe_serialization)


def check_adapters_not_added_after_prepare(model: nn.Module, prepared: Sequence[nn.Module]) -> None:
    """Refuse a peft model wrapped around a model ``prepare`` returned already (or one that DDP or FSDP
    wrapped): its adapter parameters were created after the backend distributed the model, so they are
    neither synchronised nor sharded, and no prepared optimizer holds them."""
    if not is_peft_model(model):
        return
    inner = model.get_base_model()
    from lockstep.backends.wrappers import is_distributed_module

    wrapped = [m for m in inner.modules() if any(m is p for p in prepared) or is_distributed_module(m)]
    if wrapped:
        raise RuntimeError(
            f"prepare() got a peft model whose base model ({type(wrapped[0]).__name__}) was prepared already: "
            "get_peft_model(...) was applied after accelerator.prepare(...), so the adapter parameters it added "
            "are not synchronised or sharded across processes, and the prepared optimizer does not hold them. "
            "Apply get_peft_model to the plain model first, then pass the peft model and an optimizer over its "
            "trainable parameters to accelerator.prepare()."
        )


def guard_sharded(model: nn.Module, how: str) -> None:
    """On a peft model whose weights are sharded (``how``: e.g. "FSDP2"): make ``merge_and_unload`` and
    ``merge_adapter`` raise a clear error instead of merging into one process's shard, and ``save_pretrained``
    without a ``state_dict`` raise one instead of failing inside safetensors on the shards."""
    if not is_peft_model(model):
        return
    # Instance attributes: they shadow peft's methods on this one prepared object only.
    for name in _MERGERS:
        object.__setattr__(model, name, _refusal(name, how))
    object.__setattr__(model, "save_pretrained", _gathered_save(model.save_pretrained, how))


def _refusal(name: str, how: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{name}() on a peft model prepared with {how} is refused: each process holds only a shard of "
            "the base weights, so the adapters cannot be merged into them in place. Save the adapter "
            "(accelerator.save_model(model, dir) on every process), then in one process load the whole base "
            "model, PeftModel.from_pretrained(base, dir).merge_and_unload()."
        )

    return refuse


def _gathered_save(save_pretrained: Callable[..., Any], how: str) -> Callable[..., Any]:
    def save(save_directory: str, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None:
            raise RuntimeError(
                f"save_pretrained({save_directory!r}) on a peft model prepared with {how}: its weights are "
                "shards, one per process, and would be written as they are. Call accelerator.save_model(model, "
                "dir) on every process, or pass state_dict=accelerator.get_state_dict(model) (called on every "
                "process; it gathers the whole weights on the main process)."
            )
        return save_pretrained(save_directory, *args, **kwargs)

    return save
