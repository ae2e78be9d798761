"""Which submodules become FSDP units: the wrap policies of ``FullyShardedDataParallelPlugin``.

Units are returned children-first (post-order), the order in which ``fully_shard`` must be applied;
the root module is never among them (it is always sharded last, as the outermost unit).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

from torch import nn

from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin
from lockstep.memory.activation_policy import apply_activation_policy

logger = logging.getLogger("lockstep.fsdp")


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def wrap_class_names(model: nn.Module, plugin: FullyShardedDataParallelPlugin) -> list[str]:
    """The layer classes ``TRANSFORMER_BASED_WRAP`` wraps: the plugin's, else the model's ``_no_split_modules``."""
    names = list(plugin.transformer_cls_names_to_wrap or [])  # type: ignore[arg-type]
    if not names:
        names = list(getattr(model, "_no_split_modules", None) or [])
    return names


def _by_class_name(model: nn.Module, names: list[str]) -> list[nn.Module]:
    present = sorted({type(m).__name__ for m in model.modules()})
    missing = [name for name in names if name not in present]
    if missing:
        raise ValueError(
            f"FSDP auto_wrap_policy=TRANSFORMER_BASED_WRAP: no module of class {', '.join(missing)} exists in "
            f"{type(model).__name__}. Its module classes are: {', '.join(present)}. Set "
            "transformer_cls_names_to_wrap (fsdp_transformer_layer_cls_to_wrap in the config file) to the "
            "repeated layer class, e.g. the decoder block."
        )
    wanted = set(names)
    return [m for m in _post_order(model) if m is not model and type(m).__name__ in wanted]


def _by_size(model: nn.Module, threshold: int) -> list[nn.Module]:
    units: list[nn.Module] = []

    def unwrapped_params(module: nn.Module) -> int:
        total = sum(p.numel() for p in module.parameters(recurse=False))
        total += sum(unwrapped_params(child) for child in module.children())
        if module is not model and total >= threshold and total > 0:
            units.append(module)
            return 0
        return total

    unwrapped_params(model)
    return units


def _by_callable(model: nn.Module, policy: Callable[[nn.Module], bool]) -> list[nn.Module]:
    return [m for m in _post_order(model) if m is not model and policy(m)]


def select_units(model: nn.Module, plugin: FullyShardedDataParallelPlugin) -> list[nn.Module]:
    """The submodules to shard as their own units, children first."""
    policy = plugin.auto_wrap_policy
    if callable(policy):
        return _by_callable(model, policy)
    if policy == "SIZE_BASED_WRAP":
        return _by_size(model, plugin.size_threshold)
    if policy == "TRANSFORMER_BASED_WRAP":
        names = wrap_class_names(model, plugin)
        if names:
            return _by_class_name(model, names)
        logger.info(
            "FSDP TRANSFORMER_BASED_WRAP: %s names no layer classes (no transformer_cls_names_to_wrap and no "
            "_no_split_modules), so the whole model is one unit.",
            type(model).__name__,
        )
    return []


def ignored_parameters(model: nn.Module, ignored: object) -> set[nn.Parameter]:
    """Parameters of ``ignored_modules`` (module objects, or a regular expression over module names)."""
    if ignored is None:
        return set()
    if isinstance(ignored, str):
        pattern = re.compile(ignored)
        modules = [m for name, m in model.named_modules() if name and pattern.search(name)]
        if not modules:
            raise ValueError(
                f"FSDP ignored_modules={ignored!r} matches no module name of {type(model).__name__}; names look "
                f"like {', '.join(n for n, _ in list(model.named_modules())[1:6])}."
            )
    else:
        modules = list(ignored)  # type: ignore[call-overload]
        owned = {id(m) for m in model.modules()}
        foreign = [type(m).__name__ for m in modules if id(m) not in owned]
        if foreign:
            raise ValueError(
                f"FSDP ignored_modules holds modules that are not part of {type(model).__name__}: {foreign}."
            )
    return {p for m in modules for p in m.parameters()}


def checkpoint_activations(
    model: nn.Module, units: list[nn.Module], plugin: FullyShardedDataParallelPlugin
) -> list[nn.Module]:
    """Apply the plugin's activation policy to the units; returns the units, each wrapped one replaced by its
    wrapper (which then becomes the FSDP unit, so that FSDP's hooks run outside the recomputed region)."""
    policy = plugin.activation_policy
    if not units:
        raise ValueError(
            f"FSDP activation_checkpointing={plugin.activation_checkpointing!r} needs layers to checkpoint, but "
            f"the wrap policy selects no submodule of {type(model).__name__}. Set auto_wrap_policy (e.g. "
            "TRANSFORMER_BASED_WRAP with transformer_cls_names_to_wrap) so that the repeated layers become units."
        )
    return apply_activation_policy(model, units, policy)
