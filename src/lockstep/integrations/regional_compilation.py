"""Regional compilation: ``torch.compile`` each repeated block (a transformer's layers) instead of the whole
model, so that the compiler traces one block and reuses it for the others (its cache), which cuts the cold
start of a large model from minutes to seconds. The recipe is PyTorch's
(https://pytorch.org/tutorials/recipes/regional_compilation.html) and Accelerate's ``compile_regions``.

A *repeated block* is an ``nn.ModuleList`` whose entries are all of one class. Every such list is compiled
entry by entry; the modules beside it (embeddings, the head) are compiled one by one; a model without any
such list is compiled whole.

Two ways, as in Accelerate:

* :func:`compile_regions` returns a new top-level module whose blocks are ``torch.compile`` wrappers
  (``OptimizedModule``) around the original blocks; the original model is untouched and reachable as
  ``new.__dict__["_orig_mod"]``, and the parameters are shared.
* :func:`compile_regions_in_place` calls ``nn.Module.compile`` on the same modules: nothing is wrapped, the
  model keeps its identity, its parameter names and any forward wrapper, and hooks added to it later (FSDP2's
  ``fully_shard``) still run. The backends use this one for ``TorchDynamoPlugin(use_regional_compilation=True)``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

__all__ = [
    "compile_regions",
    "compile_regions_in_place",
    "has_repeated_blocks",
    "is_compiled_in_place",
    "is_repeated_blocks",
]


def _block_class(block: nn.Module) -> type:
    """The class of a block, seen through an activation-checkpoint or offload wrapper (``every_<k>`` wraps
    only some blocks of a list)."""
    return type(getattr(block, "_checkpoint_wrapped_module", block))


def is_repeated_blocks(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.ModuleList`` of one or more modules of a single class (activation
    wrappers count as the block they wrap)."""
    return (
        isinstance(module, nn.ModuleList)
        and len(module) > 0
        and all(_same_class(_block_class(block), _block_class(module[0])) for block in module)
    )


def _same_class(one: type, other: type) -> bool:
    # either way round: fully_shard swaps a unit's class for a subclass (FSDP<Block>), and under every_<k> the
    # unsharded block inside a wrapper keeps the plain class
    return issubclass(one, other) or issubclass(other, one)


def has_repeated_blocks(module: nn.Module) -> bool:
    """Whether ``module`` or any module below it is a list of repeated blocks."""
    return any(is_repeated_blocks(sub) for sub in module.modules())


def _copy_without_children(module: nn.Module) -> nn.Module:
    """A new instance sharing ``module``'s state (parameters, buffers, hooks) but with no children yet.

    Methods bound to ``module`` in its instance dictionary (a forward wrapped by ``MethodType``, as
    Accelerate's mixed precision does) are bound to the copy, so that calling the copy runs the copy's
    (compiled) children rather than the original's.
    """
    copy = type(module).__new__(type(module))
    copy.__dict__.update(module.__dict__)
    copy._modules = {}
    for name, value in module.__dict__.items():
        if isinstance(value, types.MethodType) and value.__self__ is module:
            copy.__dict__[name] = types.MethodType(value.__func__, copy)
    return copy


def _compile_copies(module: nn.Module, compile_kwargs: dict[str, Any]) -> nn.Module:
    if is_repeated_blocks(module):
        return nn.ModuleList(torch.compile(block, **compile_kwargs) for block in module)
    if has_repeated_blocks(module):
        copy = _copy_without_children(module)
        for name, child in module.named_children():
            copy.add_module(name, _compile_copies(child, compile_kwargs))
        return copy
    return torch.compile(module, **compile_kwargs)  # type: ignore[return-value]


def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile ``module``'s repeated blocks one by one (and the modules beside them); the whole module when
    it has none. Use it like ``torch.compile``; compile before ``Accelerator.prepare``.

    Args:
        module: the model.
        **compile_kwargs: passed to every ``torch.compile`` call (``backend``, ``mode``, ``fullgraph``...).

    Returns:
        A new module with compiled regions, sharing the parameters; ``new.__dict__["_orig_mod"]`` is
        ``module`` itself, which ``unwrap_model``/``extract_model_from_parallel(keep_torch_compile=False)``
        give back.

    Example:
        >>> model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 1))
        >>> compiled = compile_regions(model, backend="eager")
        >>> [type(block).__name__ for block in compiled[0]], type(compiled[1]).__name__
        (['OptimizedModule', 'OptimizedModule', 'OptimizedModule'], 'OptimizedModule')
        >>> compiled.__dict__["_orig_mod"] is model and compiled[0][0]._orig_mod is model[0][0]
        True
    """
    compiled = _compile_copies(module, compile_kwargs)
    if "_orig_mod" not in compiled.__dict__:
        compiled.__dict__["_orig_mod"] = module  # a plain attribute, not a child: unwrapping finds it
    return compiled


def compile_regions_in_place(module: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Like :func:`compile_regions`, but with ``nn.Module.compile`` on the same modules: ``module`` itself is
    changed and returned (no wrapper, same parameter names).

    Example:
        >>> model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4) for _ in range(2)]), nn.Linear(4, 1))
        >>> compile_regions_in_place(model, backend="eager") is model
        True
        >>> [is_compiled_in_place(m) for m in (model[0][0], model[0][1], model[1], model)]
        [True, True, True, False]
    """
    if is_repeated_blocks(module):
        for block in module:
            block.compile(**compile_kwargs)
    elif has_repeated_blocks(module):
        for child in module.children():
            compile_regions_in_place(child, **compile_kwargs)
    else:
        module.compile(**compile_kwargs)
    return module


def is_compiled_in_place(module: nn.Module) -> bool:
    """Whether ``nn.Module.compile`` was called on ``module``."""
    return getattr(module, "_compiled_call_impl", None) is not None
