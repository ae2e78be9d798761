"""Keeping tied weights tied while a ``param_init_fn`` re-allocates a model's parameters module by module.

Materializing a model built on the meta device (``to_empty``, or a custom ``param_init_fn`` as FSDP's
``sync_module_states`` path runs it on every module) gives each module fresh tensors, so an embedding and
an output head that shared one weight end up with two. :func:`ensure_weights_retied` (Accelerate's name, in
``accelerate.utils.fsdp_utils``) wraps such a function so that the tie survives.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["ensure_weights_retied"]

ParamInitFn = Callable[[nn.Module], Any]


def _tied_names(model: nn.Module) -> list[str]:
    """The names transformers lists as tied: a list (transformers < 5) or a ``{target: source}`` dict."""
    tied = getattr(model, "_tied_weights_keys", None)
    if not tied:
        return []
    if isinstance(tied, dict):
        return [*tied, *tied.values()]
    return list(tied) if isinstance(tied, Iterable) else []


def ensure_weights_retied(
    param_init_fn: ParamInitFn, model: nn.Module, device: torch.device | str
) -> ParamInitFn:
    """Wrap ``param_init_fn`` so that parameters tied in ``model`` are tied again after it runs.

    The tied parameters are the ones ``model._tied_weights_keys`` names (transformers' attribute). When a
    module holding one of them is initialized, the first new tensor made for it is kept, and every later
    module that held the same parameter gets that tensor instead of its own. Without ``_tied_weights_keys``,
    ``param_init_fn`` is returned as it is.

    Args:
        param_init_fn: called with each module; it re-allocates the module's own parameters and returns the
            module (or None).
        model: the whole model, before initialization.
        device: where the parameters are materialized (kept for Accelerate's signature; ``param_init_fn``
            decides).

    Example:
        >>> with torch.device("meta"):
        ...     model = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
        >>> model[1].weight = model[0].weight
        >>> model._tied_weights_keys = ["1.weight"]
        >>> init = ensure_weights_retied(lambda m: m.to_empty(device="cpu", recurse=False), model, "cpu")
        >>> for module in model.modules():
        ...     _ = init(module)
        >>> model[1].weight is model[0].weight, model[0].weight.device.type
        (True, 'cpu')
    """
    names = _tied_names(model)
    if not names:
        return param_init_fn
    # id(parameter before initialization) -> the parameter that replaces it (the first one made)
    replacements: dict[int, nn.Parameter | None] = {}
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        replacements[id(getattr(model.get_submodule(owner_name), leaf))] = None

    def param_init_fn_tied_param(module: nn.Module) -> nn.Module:
        to_tie: defaultdict[int, list[str]] = defaultdict(list)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in replacements:
                to_tie[id(param)].append(name)
        module = param_init_fn(module) or module
        for key, param_names in to_tie.items():
            for param_name in param_names:
                kept = replacements[key]
                if kept is None:
                    replacements[key] = getattr(module, param_name)
                else:
                    setattr(module, param_name, kept)
        return module

    return param_init_fn_tied_param
