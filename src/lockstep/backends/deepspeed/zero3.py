"""Building models under ZeRO-3: sharded at construction, and mixture-of-experts leaves.

``zero3_init_flag`` tells transformers (through its own ``HfDeepSpeedConfig``, which ``from_pretrained``
consults) to build models already partitioned with ``deepspeed.zero.Init``; for a model of your own,
:func:`zero3_init` is that context::

    with zero3_init(accelerator.deepspeed_plugin):
        model = MyModel()            # each process holds only its partition of every parameter
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol


class ZeroThreeSettings(Protocol):
    """What building under ZeRO-3 reads of a :class:`~lockstep.backends.deepspeed.plugin.DeepSpeedPlugin`.

    A protocol rather than the plugin class, so that this module sits below the plugin, which calls it:
    no import circle, not even for type checking.
    """

    deepspeed_config: dict[str, Any]
    zero3_init_flag: bool | None
    transformer_moe_cls_names: str | None

    @property
    def stage(self) -> int: ...

    def is_zero3(self) -> bool: ...

    def is_offload(self) -> bool: ...

    def is_zero3_init_enabled(self) -> bool: ...

    def get_value(self, ds_key_long: str, default: Any = None) -> Any: ...


_transformers_configs: list[Any] = []
"""transformers keeps only a weak reference to the config that switches ZeRO-3 construction on."""


class _ConfigForTransformers:
    """What transformers asks of the DeepSpeed config it holds a weak reference to (its own
    ``HfDeepSpeedConfig`` requires Accelerate to be installed, so lockstep hands it this instead)."""

    def __init__(self, plugin: ZeroThreeSettings) -> None:
        self.config = _without_auto(plugin.deepspeed_config)
        self._plugin = plugin

    def is_zero3(self) -> bool:
        return self._plugin.is_zero3()

    def is_offload(self) -> bool:
        return self._plugin.is_offload()

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        return self._plugin.get_value(ds_key_long, default)


def tell_transformers(plugin: ZeroThreeSettings) -> None:
    """Switch transformers' ZeRO-3 construction on (``zero3_init_flag``) or off; no-op without transformers."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        return
    _transformers_configs.clear()
    if plugin.is_zero3_init_enabled():
        view = _ConfigForTransformers(plugin)
        _transformers_configs.append(view)
        hf_deepspeed.set_hf_deepspeed_config(view)
    else:
        hf_deepspeed.unset_hf_deepspeed_config()


@contextlib.contextmanager
def zero3_init_context(plugin: ZeroThreeSettings, *, enable: bool) -> Iterator[None]:
    """Accelerate's ``zero3_init_context_manager``: inside, transformers builds models sharded when
    ``enable`` (and not when not), whatever the plugin's ``zero3_init_flag``."""
    previous = plugin.zero3_init_flag
    plugin.zero3_init_flag = enable and plugin.is_zero3()
    tell_transformers(plugin)
    try:
        yield
    finally:
        plugin.zero3_init_flag = previous
        tell_transformers(plugin)


def zero3_init(plugin: ZeroThreeSettings) -> contextlib.AbstractContextManager:
    """A context in which ``nn.Module`` construction partitions every parameter across processes
    (``deepspeed.zero.Init``); for ZeRO-3 only.

    Raises:
        ValueError: the plugin's stage is not 3.
    """
    if not plugin.is_zero3():
        raise ValueError(
            f"zero3_init() builds models partitioned for ZeRO-3, and the DeepSpeed config is stage {plugin.stage}. "
            "Use zero_stage=3, or build the model normally."
        )
    import deepspeed

    return deepspeed.zero.Init(config_dict_or_path=_without_auto(plugin.deepspeed_config))


def _without_auto(config: dict[str, Any]) -> dict[str, Any]:
    """The config for construction-time partitioning: its ``"auto"`` values (not known before ``prepare``)
    left out at every level, and a placeholder micro batch (DeepSpeed's config parser requires one; building
    a model does not use it)."""

    def strip(node: dict[str, Any]) -> dict[str, Any]:
        return {k: strip(v) if isinstance(v, dict) else v for k, v in node.items() if v != "auto"}

    stripped = strip(config)
    if "train_batch_size" not in stripped and "train_micro_batch_size_per_gpu" not in stripped:
        stripped["train_micro_batch_size_per_gpu"] = 1
    return stripped


def set_moe_leaves(plugin: ZeroThreeSettings, model: Any) -> None:
    """Make the ``transformer_moe_cls_names`` layers ZeRO-3 leaf modules (gathered as a whole).

    Raises:
        ValueError: a named class is not in the model.
    """
    if not plugin.is_zero3() or not plugin.transformer_moe_cls_names:
        return
    names = [name.strip() for name in plugin.transformer_moe_cls_names.split(",") if name.strip()]
    classes = {type(module).__name__: type(module) for module in model.modules()}
    missing = [name for name in names if name not in classes]
    if missing:
        raise ValueError(
            f"transformer_moe_cls_names names {', '.join(missing)}, which {type(model).__name__} does not contain. "
            f"Its layer classes include: {', '.join(sorted(classes)[:20])}."
        )
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [classes[name] for name in names])
