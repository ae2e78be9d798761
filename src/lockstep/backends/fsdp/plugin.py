"""``FullyShardedDataParallelPlugin``: the settings of fully sharded training (FSDP2).

Field names follow Accelerate's plugin. Every setting is checked here, when the plugin is built, so that a
typo fails before any process group exists. lockstep runs FSDP2 (``torch.distributed.fsdp.fully_shard``)
only: ``fsdp_version=1`` is accepted and runs on FSDP2 with a one-time note, because FSDP1 full state dicts
with CPU offload crash torch 2.13 on CPU. Settings that exist only for FSDP1 are warned about once.

Example:
    >>> plugin = FullyShardedDataParallelPlugin(
    ...     auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap=["Block"]
    ... )
    >>> plugin.state_dict_type
    'SHARDED_STATE_DICT'
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockstep.backends.fsdp.keys import (
    FSDP1_RESHARD,
    LEGACY_FIELDS,
    WRAP_POLICIES,
    plugin_kwargs,
    state_dict_type,
)
from lockstep.config.activation_policy import ActivationPolicy, parse_activation_policy

if TYPE_CHECKING:  # torch is imported where it is used, so that the command line starts fast
    from torch import nn

logger = logging.getLogger("lockstep.fsdp")

_FSDP1_SHARDING = FSDP1_RESHARD
# The FSDP1-only keys of the table (lockstep.backends.fsdp.keys), and two FSDP1 fields no config file sets.
_FSDP1_ONLY = (*LEGACY_FIELDS, "state_dict_config", "optim_state_dict_config")
_DEFAULT_MIN_NUM_PARAMS = 100_000_000
"""torch's default threshold for size-based wrapping."""

_noted: set[str] = set()


def _note_once(key: str, message: str) -> None:
    if key not in _noted:
        _noted.add(key)
        logger.warning(message)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    text = getattr(value, "name", value)
    if isinstance(text, str) and text.strip().upper() in choices:
        return text.strip().upper()
    raise ValueError(
        f"FullyShardedDataParallelPlugin({name}={value!r}) is invalid: choose one of {', '.join(choices)}."
    )


def _class_names(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, Iterable) and all(isinstance(v, str) for v in value):
        return [v.strip() for v in value]
    raise ValueError(
        f"FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap={value!r}) is invalid: give class names "
        "as a list of strings or one comma-separated string, e.g. ['LlamaDecoderLayer']."
    )


@dataclass(kw_only=True)
class FullyShardedDataParallelPlugin:
    """Shard parameters, gradients and optimizer state across processes with FSDP2.

    Pass it as ``Accelerator(fsdp_plugin=...)``, or select FSDP with ``distributed_type: FSDP`` and an
    ``fsdp_config`` section in the config file, or with ``lockstep launch --use-fsdp``.
    """

    fsdp_version: int = 2
    """2 (``fully_shard``). 1 is accepted and runs on FSDP2."""
    reshard_after_forward: bool | str = True
    """Free gathered parameters after forward (ZeRO-3); False keeps them until backward (ZeRO-2).
    The FSDP1 names ``FULL_SHARD`` / ``SHARD_GRAD_OP`` are understood."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory; the optimizer steps on CPU."""
    auto_wrap_policy: str | Callable[[nn.Module], bool] | None = "TRANSFORMER_BASED_WRAP"
    """Which submodules become their own FSDP unit: ``TRANSFORMER_BASED_WRAP`` (classes named in
    ``transformer_cls_names_to_wrap``, else the model's ``_no_split_modules``), ``SIZE_BASED_WRAP``
    (modules with at least ``min_num_params`` parameters), ``NO_WRAP`` (only the whole model), or a
    callable ``policy(module) -> bool``."""
    transformer_cls_names_to_wrap: list[str] | str | None = None
    """Class names for ``TRANSFORMER_BASED_WRAP`` (the config file's ``fsdp_transformer_layer_cls_to_wrap``)."""
    min_num_params: int | None = None
    """Parameter threshold for ``SIZE_BASED_WRAP`` (default 100M, as in torch)."""
    state_dict_type: str = "SHARDED_STATE_DICT"
    """How ``save_state`` stores the model and optimizers: ``SHARDED_STATE_DICT`` (every process writes its
    shards with torch.distributed.checkpoint, reshardable) or ``FULL_STATE_DICT`` (gathered on the main
    process into ordinary files)."""
    cpu_ram_efficient_loading: bool = False
    """Only the main process holds the pretrained weights; the others build the model on the meta device
    (or their copy is dropped there) and receive their shards from it."""
    activation_checkpointing: bool | str = False
    """What the wrapped layers keep for backward: True (``full``: recompute every layer), False (``none``),
    ``every_<k>`` (recompute every k-th layer), ``op`` (selective: keep matmul and attention outputs, recompute
    the cheap operators) or ``offload`` (keep activations in CPU memory). See
    :mod:`lockstep.memory.activation_policy`. ``full`` is stored as True and ``none`` as False."""
    mixed_precision_policy: Any = None
    """A ``torch.distributed.fsdp.MixedPrecisionPolicy``, a dict of its fields (dtype names allowed), or
    None to derive it from the Accelerator's ``mixed_precision``: bf16/fp16 parameters with fp32
    gradient reduction."""
    ignored_modules: Iterable[nn.Module] | str | None = None
    """Modules whose parameters are not sharded (they stay replicated and are not synchronised). A string
    is a regular expression matched against module names."""
    # FSDP1-only settings: accepted for compatibility, warned about once.
    sharding_strategy: str | None = None
    backward_prefetch: str | None = None
    forward_prefetch: bool | None = None
    limit_all_gathers: bool | None = None
    use_orig_params: bool | None = None
    sync_module_states: bool | None = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    """Applied to modules on the meta device by ``cpu_ram_efficient_loading`` on non-main processes
    (default: ``to_empty``; the weights are then overwritten by the main process's)."""

    def __post_init__(self) -> None:
        if self.fsdp_version not in (1, 2):
            raise ValueError(
                f"FullyShardedDataParallelPlugin(fsdp_version={self.fsdp_version!r}) is invalid: use 2 (FSDP2)."
            )
        if self.fsdp_version == 1:
            _note_once(
                "fsdp_version",
                "fsdp_version=1 runs on FSDP2 (fully_shard) in lockstep: FSDP1 full state dicts with CPU offload "
                "crash torch 2.13 on CPU. Set fsdp_version: 2 to silence this note.",
            )
        self.reshard_after_forward = self._resolve_reshard(self.reshard_after_forward)
        if self.sharding_strategy is not None:
            strategy = _choice("sharding_strategy", self.sharding_strategy, (*_FSDP1_SHARDING, "NO_SHARD"))
            if strategy == "NO_SHARD":
                raise ValueError(
                    "FullyShardedDataParallelPlugin(sharding_strategy='NO_SHARD') replicates the model: use DDP "
                    "(leave FSDP out) instead."
                )
            self.reshard_after_forward = _FSDP1_SHARDING[strategy]
        if not callable(self.auto_wrap_policy):
            self.auto_wrap_policy = _choice(
                "auto_wrap_policy", self.auto_wrap_policy or "NO_WRAP", WRAP_POLICIES
            )
        self.transformer_cls_names_to_wrap = _class_names(self.transformer_cls_names_to_wrap)
        if self.min_num_params is not None and (
            isinstance(self.min_num_params, bool)
            or not isinstance(self.min_num_params, int)
            or self.min_num_params < 0
        ):
            raise ValueError(
                f"FullyShardedDataParallelPlugin(min_num_params={self.min_num_params!r}) is invalid: it must be "
                "an integer >= 0."
            )
        self.state_dict_type = state_dict_type(
            self.state_dict_type, "FullyShardedDataParallelPlugin(state_dict_type)"
        )
        policy = parse_activation_policy(
            self.activation_checkpointing, owner="FullyShardedDataParallelPlugin(activation_checkpointing)"
        )
        self.activation_checkpointing = policy.name if policy.mode not in ("full", "none") else policy.enabled
        for name in ("cpu_offload", "cpu_ram_efficient_loading"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(
                    f"FullyShardedDataParallelPlugin({name}={value!r}) is invalid: use True or False."
                )
        self._warn_ignored_settings()

    @staticmethod
    def _resolve_reshard(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().upper() in _FSDP1_SHARDING:
            return _FSDP1_SHARDING[value.strip().upper()]
        raise ValueError(
            f"FullyShardedDataParallelPlugin(reshard_after_forward={value!r}) is invalid: use True (free "
            "parameters after forward), False, or the FSDP1 names FULL_SHARD / SHARD_GRAD_OP."
        )

    def _warn_ignored_settings(self) -> None:
        ignored = [name for name in _FSDP1_ONLY if getattr(self, name) not in (None, False)]
        ignored = [name for name in ignored if name != "sharding_strategy"]
        if ignored:
            warnings.warn(
                f"FullyShardedDataParallelPlugin: {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} "
                "FSDP1 settings; FSDP2 has no such option and ignores them.",
                UserWarning,
                stacklevel=3,
            )

    # -- derived settings -------------------------------------------------------------------------
    @property
    def activation_policy(self) -> ActivationPolicy:
        """:attr:`activation_checkpointing` as a policy object."""
        return parse_activation_policy(self.activation_checkpointing, owner="activation_checkpointing")

    @property
    def size_threshold(self) -> int:
        return _DEFAULT_MIN_NUM_PARAMS if self.min_num_params is None else self.min_num_params

    @classmethod
    def from_config_section(cls, section: Mapping[str, Any]) -> FullyShardedDataParallelPlugin:
        """Build the plugin from a config file's ``fsdp_config``.

        Keys are renamed to fields by the key table (:data:`lockstep.backends.fsdp.keys.FSDP_KEYS`); the
        ``fsdp_`` prefix is optional. None values are left out.

        Raises:
            ValueError: a key of no FSDP setting, or a value the plugin rejects.

        Example:
            >>> FullyShardedDataParallelPlugin.from_config_section(
            ...     {"fsdp_offload_params": True, "fsdp_auto_wrap_policy": "NO_WRAP"}
            ... ).cpu_offload
            True
        """
        return cls(**plugin_kwargs(section))
