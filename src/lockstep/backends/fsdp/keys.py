"""The FSDP vocabulary: every ``fsdp_config`` key, in one table next to ``FullyShardedDataParallelPlugin``.

:data:`FSDP_KEYS` is the only place where an FSDP key is spelled. Derived from it:

* the config file's ``fsdp_config`` check (``lockstep.config.file.section_keys``, through the spec);
* ``FullyShardedDataParallelPlugin.from_config_section`` (:func:`plugin_kwargs`);
* the ``lockstep launch --fsdp-*`` flags, their help and the conversion of their text
  (``lockstep.cli.launch_flags``), the FSDP1 ones among them too;
* the Trainer's ``fsdp_config`` (transformers' spelling: with or without the ``fsdp_`` prefix, plus
  aliases; FSDP1-only keys dropped) in :mod:`lockstep.backends.fsdp.trainer_options`;
* the comparison of the Trainer's settings with the launcher's (:func:`plugin_fields`).

This module must not import torch.

Example:
    >>> plugin_kwargs({"fsdp_transformer_layer_cls_to_wrap": "Block", "fsdp_offload_params": True})
    {'transformer_cls_names_to_wrap': 'Block', 'cpu_offload': True}
    >>> plugin_fields({"fsdp_reshard_after_forward": "SHARD_GRAD_OP", "fsdp_transformer_layer_cls_to_wrap": "A,B"})
    {'reshard_after_forward': False, 'transformer_cls_names_to_wrap': ['A', 'B']}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lockstep.config import checks
from lockstep.config.keys import SettingKey, by_spelling, field_values, lookup, section_kwargs

PREFIX = "fsdp_"
"""The prefix of the config file's FSDP keys; name-based mappings accept every key without it, too."""
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
"""The ``auto_wrap_policy`` names."""
FSDP1_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
"""The FSDP1 sharding strategies that FSDP2 expresses, as ``reshard_after_forward``."""
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
"""The ``state_dict_type`` names FSDP2 has: FSDP1's ``LOCAL_STATE_DICT`` is refused, as Accelerate 1.15
refuses it under FSDP2 (lockstep runs FSDP2 whatever ``fsdp_version`` says)."""
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")


def _reshard_flag(value: bool | str, key: str) -> bool:
    """A checked ``reshard_after_forward`` (a bool, or an FSDP1 strategy name) as the plugin's bool."""
    if isinstance(value, bool):
        return value
    if value in FSDP1_RESHARD:
        return FSDP1_RESHARD[value]
    raise ValueError(f"{key} must be true or false (or FULL_SHARD / SHARD_GRAD_OP), got {value!r}")


def state_dict_type(value: Any, key: str) -> str:
    """A checked ``state_dict_type`` (any case, or torch's enum member) as its name: the config file's key
    and the plugin's field both go through here, so that they accept and refuse the same values.

    Example:
        >>> state_dict_type("full_state_dict", "fsdp_state_dict_type")
        'FULL_STATE_DICT'
    """
    text = value if isinstance(value, str) else getattr(value, "name", value)
    if str(text).strip().upper() == "LOCAL_STATE_DICT":
        raise ValueError(
            f"{key} is {value!r}, which is not supported: LOCAL_STATE_DICT is FSDP1's, and lockstep runs "
            "FSDP2, which has none (Accelerate refuses it under FSDP2 too). Use SHARDED_STATE_DICT (each "
            "process saves its shards) or FULL_STATE_DICT (one whole state dict)."
        )
    return checks.choice(*STATE_DICT_TYPES)(value, key)


def _name_list(value: str | list[str], key: str) -> list[str]:
    """Checked class names (``'A,B'``, ``'A B'``, ``['A', 'B,C']``) as a list of names."""
    del key
    items = [value] if isinstance(value, str) else value
    return [name for item in items for name in item.replace(",", " ").split()]


FSDP_KEYS: tuple[SettingKey, ...] = (
    # Launch flags first, in the order `lockstep launch --help` lists them.
    SettingKey(
        key="fsdp_version",
        field="fsdp_version",
        check=checks.int_range(1, 2),
        help="2 (fully_shard, per-parameter sharding); 1 is accepted and runs on FSDP2",
        flag=True,
    ),
    SettingKey(
        key="fsdp_auto_wrap_policy",
        field="auto_wrap_policy",
        check=checks.choice(*WRAP_POLICIES),
        help="which submodules become FSDP units: TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP",
        flag=True,
    ),
    SettingKey(
        key="fsdp_transformer_layer_cls_to_wrap",
        field="transformer_cls_names_to_wrap",
        check=checks.class_names,
        help="comma-separated layer classes to wrap with TRANSFORMER_BASED_WRAP, e.g. LlamaDecoderLayer",
        flag=True,
        aliases=("transformer_cls_names_to_wrap",),
        to_field=_name_list,
    ),
    SettingKey(
        key="fsdp_min_num_params",
        field="min_num_params",
        check=checks.int_range(0),
        help="parameter threshold of SIZE_BASED_WRAP: the smallest module it wraps",
        flag=True,
    ),
    SettingKey(
        key="fsdp_state_dict_type",
        field="state_dict_type",
        check=state_dict_type,
        help="how checkpoints store the model: SHARDED_STATE_DICT or FULL_STATE_DICT",
        flag=True,
    ),
    SettingKey(
        key="fsdp_reshard_after_forward",
        field="reshard_after_forward",
        check=checks.reshard_after_forward,
        help="free gathered parameters after forward: true or false (FULL_SHARD / SHARD_GRAD_OP also work)",
        flag=True,
        to_field=_reshard_flag,
    ),
    SettingKey(
        key="fsdp_offload_params",
        field="cpu_offload",
        check=checks.boolean,
        help="keep parameters and gradients on the CPU between uses (true or false)",
        flag=True,
    ),
    SettingKey(
        key="fsdp_cpu_ram_efficient_loading",
        field="cpu_ram_efficient_loading",
        check=checks.boolean,
        help="load weights on the main process only, then send each process its shards (true or false)",
        flag=True,
    ),
    SettingKey(
        key="fsdp_activation_checkpointing",
        field="activation_checkpointing",
        check=checks.activation_policy,
        help="recompute wrapped layers' activations: true, false, every_<k>, op (selective) or offload (to CPU)",
        flag=True,
    ),
    SettingKey(
        key="fsdp_cpu_offload",
        field="cpu_offload",
        check=checks.boolean,
        help="the same as fsdp_offload_params (Accelerate writes both)",
    ),
    SettingKey(
        key="fsdp_ignored_modules",
        field="ignored_modules",
        check=checks.as_given,
        help="modules left unsharded: a regular expression of module names, or the modules",
        file=False,
    ),
    # FSDP1-only settings, in the order the plugin warns about them; Accelerate's launch flags among them
    # are accepted (the plugin translates the sharding strategy and warns about the rest).
    SettingKey(
        key="fsdp_sharding_strategy",
        field="sharding_strategy",
        check=checks.sharding_strategy,
        help="FSDP1 sharding strategy, e.g. FULL_SHARD; the plugin turns it into reshard_after_forward",
        flag=True,
        legacy=True,
    ),
    SettingKey(
        key="fsdp_backward_prefetch",
        field="backward_prefetch",
        check=checks.choice(*_PREFETCH),
        help="FSDP1: when to gather the next unit in backward; FSDP2 ignores it",
        flag=True,
        legacy=True,
    ),
    SettingKey(
        key="fsdp_backward_prefetch_policy",
        field="backward_prefetch",
        check=checks.choice(*_PREFETCH),
        help="old name of fsdp_backward_prefetch",
        legacy=True,
    ),
    SettingKey(
        key="fsdp_forward_prefetch",
        field="forward_prefetch",
        check=checks.boolean,
        help="FSDP1: gather the next unit during forward; FSDP2 ignores it",
        flag=True,
        legacy=True,
    ),
    SettingKey(
        key="fsdp_limit_all_gathers",
        field="limit_all_gathers",
        check=checks.boolean,
        help="FSDP1: rate-limit all-gathers; FSDP2 ignores it",
        file=False,
        legacy=True,
    ),
    SettingKey(
        key="fsdp_use_orig_params",
        field="use_orig_params",
        check=checks.boolean,
        help="FSDP1: keep the original parameters visible to the optimizer; FSDP2 always does",
        flag=True,
        legacy=True,
    ),
    SettingKey(
        key="fsdp_sync_module_states",
        field="sync_module_states",
        check=checks.boolean,
        help="FSDP1: broadcast rank 0's weights when wrapping; FSDP2 ignores it",
        flag=True,
        legacy=True,
    ),
)
"""Every FSDP key: file key -> plugin field -> check -> help -> launch flag -> other spellings."""

SPELLINGS: dict[str, SettingKey] = by_spelling(FSDP_KEYS, PREFIX)
"""Every key's names without the ``fsdp_`` prefix, and the aliases -> the key."""
LEGACY_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(e.field for e in FSDP_KEYS if e.legacy and e.field))
"""The plugin fields that only FSDP1 had, in table order."""


def fsdp_key(name: str) -> SettingKey | None:
    """The key that ``name`` spells (file key, without the prefix, or an alias); None if no FSDP key."""
    return lookup(SPELLINGS, name, PREFIX)


def plugin_kwargs(section: Mapping[str, Any]) -> dict[str, Any]:
    """``FullyShardedDataParallelPlugin`` keyword arguments of an ``fsdp_config`` section (values as given).

    Raises:
        ValueError: a key of no FSDP setting.
    """
    return section_kwargs(
        SPELLINGS, section, prefix=PREFIX, where="fsdp_config", owner="FullyShardedDataParallelPlugin"
    )


def plugin_fields(section: Mapping[str, Any], *, where: str = "fsdp_config") -> dict[str, Any]:
    """The plugin fields an ``fsdp_config`` section sets, checked and in the plugin's form.

    FSDP1-only keys and None values are left out. For comparing settings without building a plugin, e.g.
    the Trainer's with the launcher's.

    Raises:
        ValueError: an unknown key, or a value its check rejects (naming ``where.key``).
    """
    return field_values(SPELLINGS, section, prefix=PREFIX, where=where)
