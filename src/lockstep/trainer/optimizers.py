"""The Trainer's optimizers (``optim``), without weight decay on biases and normalization layers.

The menu is what torch alone provides, with transformers' names: ``adamw_torch``, ``adamw_torch_fused``
(the default), ``adafactor`` (torch's ``Adafactor``), ``sgd``, ``adagrad``, ``rmsprop``; ``optim_args``
adds the keys each takes (:data:`lockstep.trainer._optimizer_menu.OPTIM_ARGS`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from lockstep.trainer._optimizer_menu import optimizer_kwargs

if TYPE_CHECKING:
    from lockstep.trainer.arguments import TrainingArguments

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
# transformers models define their own norm classes (T5LayerNorm, LlamaRMSNorm, ...).
_NORM_NAME = re.compile(r"norm", re.IGNORECASE)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or bool(_NORM_NAME.search(type(module).__name__))


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that get weight decay: all but biases and normalization-layer weights."""
    excluded: set[str] = set()
    for module_name, module in model.named_modules():
        if _is_norm(module):
            prefix = f"{module_name}." if module_name else ""
            excluded.update(f"{prefix}{name}" for name, _ in module.named_parameters(recurse=False))
    return [
        name for name, _ in model.named_parameters() if name not in excluded and not name.endswith("bias")
    ]


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups of trainable parameters: with ``weight_decay``, and without."""
    decay = set(decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def create_optimizer(model: nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    """``args.optim`` over :func:`parameter_groups` with the arguments' learning rate (and betas for Adam)."""
    groups = parameter_groups(model, args.weight_decay)
    if not groups:
        raise ValueError(
            f"{type(model).__name__} has no trainable parameters (every requires_grad is False): nothing to train."
        )
    extra = optimizer_kwargs(args.optim, args.optim_args)
    lr = args.learning_rate
    if args.optim in ("adamw_torch", "adamw_torch_fused"):
        betas = (args.adam_beta1, args.adam_beta2)
        fused = True if args.optim == "adamw_torch_fused" else None
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=args.adam_epsilon, fused=fused)
    if args.optim == "adafactor":
        return torch.optim.Adafactor(groups, lr=lr, **extra)
    cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}[args.optim]
    # The groups carry their own weight_decay; an optim_args weight_decay only sets the default.
    return cls(groups, lr=lr, **extra)
