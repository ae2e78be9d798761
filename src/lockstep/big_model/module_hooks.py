"""Hooks that wrap a module's ``forward``: :class:`ModelHook`, :class:`SequentialHook` and attaching them.

A hook is one object stored on the module as ``module._hf_hook`` (Accelerate's attribute, which
transformers and diffusers read); the module's original ``forward`` is kept as ``module._old_forward``
and replaced by one that runs ``pre_forward`` -> the original forward -> ``post_forward``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
]


class ModelHook:
    """What a hook can do around a module's forward; every method does nothing by default.

    Attributes:
        no_grad: run the wrapped forward under ``torch.no_grad()``.

    Example:
        >>> class Double(ModelHook):
        ...     def post_forward(self, module, output):
        ...         return output * 2
        >>> layer = add_hook_to_module(torch.nn.Identity(), Double())
        >>> layer(torch.ones(1))
        tensor([2.])
    """

    no_grad = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called once when the hook is attached; returns the module (possibly changed)."""
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Called before the forward with its inputs; returns the ``(args, kwargs)`` the forward receives."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after the forward with its output; returns what the module returns."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; undoes what ``init_hook`` did where it matters."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run one after another, in the order given (``pre_forward`` and ``post_forward`` alike).

    Example:
        >>> hook = SequentialHook(ModelHook(), ModelHook())
        >>> len(hook.hooks)
        2
    """

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(
        self, module: nn.Module, *args: Any, **kwargs: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.detach_hook(module)
        return module


def _hooked_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    hook: ModelHook = module._hf_hook  # type: ignore[assignment]
    args, kwargs = hook.pre_forward(module, *args, **kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = module._old_forward(*args, **kwargs)  # type: ignore[operator]
    else:
        output = module._old_forward(*args, **kwargs)  # type: ignore[operator]
    return hook.post_forward(module, output)


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module``: its forward now runs through the hook, and ``hook.init_hook`` is called.

    Args:
        module: the module.
        hook: the hook.
        append: keep a hook already attached and run ``hook`` after it (a :class:`SequentialHook`);
            otherwise an attached hook is replaced (without its ``detach_hook`` being called).

    Returns:
        The module (the one ``init_hook`` returned).

    Example:
        >>> layer = add_hook_to_module(torch.nn.Linear(1, 1), ModelHook())
        >>> type(layer._hf_hook).__name__, hasattr(layer, "_old_forward")
        ('ModelHook', True)
    """
    if append and getattr(module, "_hf_hook", None) is not None:
        previous = module._hf_hook
        remove_hook_from_module(module)
        hook = SequentialHook(previous, hook)
    if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
        original = module._old_forward  # replacing a hook: wrap the original forward, not the hooked one
    else:
        original = module.forward
        module._old_forward = original
    module = hook.init_hook(module)
    module._hf_hook = hook
    forward = functools.update_wrapper(functools.partial(_hooked_forward, module), original)
    if "GraphModuleImpl" in str(type(module)):
        # torch.fx graph modules are called through their class's forward
        module.__class__.forward = forward  # type: ignore[method-assign]
    else:
        module.forward = forward  # type: ignore[method-assign]
    return module


def _is_own_forward(module: nn.Module, forward: Any) -> bool:
    return (
        getattr(forward, "__self__", None) is module
        and getattr(forward, "__func__", None) is type(module).forward
    )


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` (calling its ``detach_hook``) and give it back its original forward.

    Args:
        module: the module.
        recurse: also remove the hooks of every submodule.

    Example:
        >>> layer = add_hook_to_module(torch.nn.Linear(1, 1), ModelHook())
        >>> layer = remove_hook_from_module(layer)
        >>> hasattr(layer, "_hf_hook"), "forward" in vars(layer)
        (False, False)
    """
    if hasattr(module, "_hf_hook"):
        module._hf_hook.detach_hook(module)
        delattr(module, "_hf_hook")
    if hasattr(module, "_old_forward"):
        original = module._old_forward
        if "GraphModuleImpl" in str(type(module)):
            module.__class__.forward = getattr(original, "__func__", original)
        elif _is_own_forward(module, original):
            vars(module).pop("forward", None)  # the class's forward again, without a reference cycle
        else:
            module.forward = original  # type: ignore[method-assign]
        delattr(module, "_old_forward")
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of every submodule of ``module`` (not of ``module`` itself)."""
    for child in module.children():
        remove_hook_from_module(child)
        remove_hook_from_submodules(child)
