"""``TrainingArguments.fsdp`` / ``fsdp_config`` (transformers' spelling) to FSDP plugin settings.

transformers describes FSDP with a list of options (``"full_shard auto_wrap offload"``) plus a config
dict whose keys may carry an ``fsdp_`` prefix. lockstep's :class:`FullyShardedDataParallelPlugin` uses
Accelerate's field names. This module is the mapping between the two, named by the FSDP spec
(:func:`normalize_arguments` is its ``trainer_normalize``, :func:`plugin_for_arguments` its
``trainer_plugin``); it imports nothing heavy until a plugin is built. The
``fsdp_config`` names, the field each one sets and the check of its value come from the key table
(:data:`lockstep.backends.fsdp.keys.FSDP_KEYS`): every key with or without the ``fsdp_`` prefix, and its
aliases; FSDP1-only keys are accepted and dropped with one warning.

Example:
    >>> fsdp_plugin_kwargs(["full_shard", "auto_wrap"], {"transformer_layer_cls_to_wrap": ["BertLayer"]})
    {'fsdp_version': 2, 'reshard_after_forward': True, 'cpu_offload': False, 'auto_wrap_policy': 'TRANSFORMER_BASED_WRAP', 'transformer_cls_names_to_wrap': ['BertLayer']}
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lockstep.backends.fsdp.keys import PREFIX, SPELLINGS, fsdp_key, plugin_fields
from lockstep.config.argument_values import load_json_dict, name_list
from lockstep.config.keys import SettingKey

logger = logging.getLogger("lockstep.trainer")

SHARDING_OPTIONS = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
MODIFIER_OPTIONS = ("offload", "auto_wrap")
FSDP_OPTIONS = SHARDING_OPTIONS + MODIFIER_OPTIONS

KNOWN_CONFIG_KEYS = frozenset(SPELLINGS)
"""``fsdp_config`` keys (without the prefix) that the mapping understands, from the key table."""
_XLA_KEYS = ("xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings")


def normalize_arguments(args: Any) -> None:
    """``fsdp`` as a checked option list and ``fsdp_config`` as a dict without prefixes, in place; as in
    transformers, without FSDP they stay None (or as given)."""
    if args.fsdp:
        args.fsdp = parse_fsdp_options(args.fsdp)
    if args.fsdp_config is not None:
        args.fsdp_config = normalize_fsdp_config(load_json_dict(args.fsdp_config, argument="fsdp_config"))


def plugin_for_arguments(args: Any, model: Any, launched: dict[str, Any] | None) -> Any:
    """The FSDP plugin for ``args.fsdp`` and ``fsdp_config`` (None without ``fsdp``), checked against the
    launcher's ``fsdp_config`` section when the launcher chose FSDP too (``launched``).

    Raises:
        ValueError: a setting the arguments and the launcher's section both name, with different values;
            FSDP's activation checkpointing (the arguments' or the launcher's) with ``gradient_checkpointing``.
    """
    if not args.fsdp:
        if args.fsdp_config:
            logger.warning("TrainingArguments(fsdp_config=...) is ignored: fsdp is empty, so FSDP is off.")
        if launched is not None:  # FSDP comes from the launcher alone
            _check_activation_checkpointing(args, plugin_fields(launched))
        return None
    if launched is not None:
        _check_agreement(args, launched)
    from lockstep.backends.fsdp.plugin import FullyShardedDataParallelPlugin

    no_split = getattr(model, "_no_split_modules", None) if model is not None else None
    kwargs = fsdp_plugin_kwargs(args.fsdp, args.fsdp_config, no_split)
    _check_activation_checkpointing(args, kwargs)
    return FullyShardedDataParallelPlugin(**kwargs)


def _check_activation_checkpointing(args: Any, fields: dict[str, Any]) -> None:
    if args.gradient_checkpointing and fields.get("activation_checkpointing"):
        raise ValueError(
            "TrainingArguments(gradient_checkpointing=True) and fsdp_config activation_checkpointing=True both "
            "recompute activations, which is redundant and breaks FSDP's backward. Use fsdp_config "
            "activation_checkpointing for FSDP models and turn gradient_checkpointing off."
        )


def _check_agreement(args: Any, launched: dict[str, Any]) -> None:
    """Giving ``fsdp``/``fsdp_config`` when the launcher's config selected FSDP is allowed only when every
    setting they name agrees with the launcher's."""
    ours = fsdp_plugin_kwargs(args.fsdp, args.fsdp_config, no_split_modules=["?"])
    theirs = plugin_fields(launched)
    conflicts = [
        f"{key}: arguments {ours.get(key)!r}, launcher config {value!r}"
        for key, value in sorted(theirs.items())
        if key in ours and ours[key] != value
    ]
    if conflicts:
        raise ValueError(
            "TrainingArguments(fsdp/fsdp_config) contradict the launcher's FSDP config ("
            + "; ".join(conflicts)
            + "). The launcher's config already enables FSDP: drop fsdp/fsdp_config from the arguments, or make "
            "them agree."
        )


def parse_fsdp_options(value: Any) -> list[str]:
    """``"full_shard auto_wrap"``, ``["full_shard", "offload"]``, ``""`` or None as a checked option list."""
    if value is True:
        return ["full_shard"]
    if value is False or value is None:
        return []
    options = [o.lower() for o in name_list(value, argument="fsdp")]
    unknown = [o for o in options if o not in FSDP_OPTIONS]
    if unknown:
        raise ValueError(
            f"TrainingArguments(fsdp={value!r}) is invalid: {', '.join(map(repr, unknown))} is not an FSDP option. "
            f"Combine one of {', '.join(SHARDING_OPTIONS)} with {' and/or '.join(MODIFIER_OPTIONS)}."
        )
    sharding = [o for o in options if o in SHARDING_OPTIONS]
    if len(set(sharding)) > 1:
        raise ValueError(
            f"TrainingArguments(fsdp={value!r}) is invalid: it names {len(set(sharding))} sharding strategies "
            f"({', '.join(sharding)}); choose one."
        )
    return list(dict.fromkeys(options))


def normalize_fsdp_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """Strip the ``fsdp_`` prefix from every key and reject keys FSDP does not know."""
    normalized: dict[str, Any] = {}
    for key, value in (config or {}).items():
        name = key.removeprefix(PREFIX)
        if name in _XLA_KEYS:
            raise NotImplementedError(
                f"TrainingArguments(fsdp_config) key {key!r}: FSDP on XLA/TPU is not supported by lockstep."
            )
        if name not in SPELLINGS:
            raise ValueError(
                f"TrainingArguments(fsdp_config) has an unknown key {key!r}. Known keys (with or without the "
                f"'fsdp_' prefix): {', '.join(sorted(SPELLINGS))}."
            )
        if name in normalized:
            raise ValueError(
                f"TrainingArguments(fsdp_config) gives {name!r} twice (with and without the 'fsdp_' prefix); "
                "keep one."
            )
        normalized[name] = value
    return normalized


def config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The plugin fields that a normalized ``fsdp_config`` sets explicitly (FSDP1-only keys dropped).

    Each value is checked by its key's check (as in a config file) and put in the plugin's form; an empty
    value (None, ``""``, ``[]``) leaves its field unset.
    """
    entries = {name: _entry(name) for name in config}
    ignored = [name for name, entry in entries.items() if entry.legacy]
    if ignored:
        logger.warning(
            "fsdp_config keys %s only apply to FSDP1 and are ignored: lockstep shards with FSDP2.", ignored
        )
    fields: dict[str, Any] = {}
    for name, value in config.items():
        entry = entries[name]
        if entry.legacy or entry.field is None or _is_empty(value):
            continue
        value = entry.field_value(value, f"fsdp_config.{name}")
        if entry.field in fields and fields[entry.field] != value:
            raise ValueError(
                f"TrainingArguments(fsdp_config) sets {entry.field} twice with different values "
                f"({fields[entry.field]!r} and {value!r}); keep one key."
            )
        fields[entry.field] = value
    return fields


def _entry(name: str) -> SettingKey:
    entry = fsdp_key(name)
    if entry is None:  # normalize_fsdp_config rejects unknown keys first
        raise ValueError(f"fsdp_config.{name} is not a known key (known: {', '.join(sorted(SPELLINGS))})")
    return entry


def _is_empty(value: Any) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return value is None or (isinstance(value, list | tuple) and not value)


def fsdp_plugin_kwargs(
    options: Sequence[str], config: dict[str, Any] | None, no_split_modules: Sequence[str] | None = None
) -> dict[str, Any]:
    """The ``FullyShardedDataParallelPlugin`` keyword arguments for ``fsdp`` options plus ``fsdp_config``.

    Args:
        options: the parsed ``fsdp`` options (see :func:`parse_fsdp_options`); empty means no FSDP.
        config: ``fsdp_config`` (keys with or without the ``fsdp_`` prefix).
        no_split_modules: the model's ``_no_split_modules`` (transformers models list their layer
            classes there); used by ``auto_wrap`` when ``fsdp_config`` names no layer classes.

    Returns:
        The plugin's fields; an empty dict when ``options`` is empty.
    """
    if not options:
        return {}
    options = parse_fsdp_options(list(options))
    fields = config_fields(normalize_fsdp_config(config))
    sharding = next((o for o in options if o in SHARDING_OPTIONS), "full_shard")
    if sharding in ("hybrid_shard", "hybrid_shard_zero2"):
        raise NotImplementedError(
            f"TrainingArguments(fsdp={sharding!r}) is not supported yet: hybrid sharding needs a 2-D device mesh, "
            "which lockstep does not build. Use 'full_shard' or 'shard_grad_op'."
        )
    if sharding == "no_shard":
        raise ValueError(
            "TrainingArguments(fsdp='no_shard') is not supported: FSDP2 always shards. Leave fsdp empty to "
            "train with DDP, which is what 'no_shard' means."
        )
    reshard = sharding == "full_shard"
    if fields.get("reshard_after_forward", reshard) != reshard:
        raise ValueError(
            f"TrainingArguments(fsdp={sharding!r}) means reshard_after_forward={reshard}, but fsdp_config sets "
            f"reshard_after_forward={fields['reshard_after_forward']}; drop one of them."
        )
    result: dict[str, Any] = {"fsdp_version": fields.pop("fsdp_version", 2), "reshard_after_forward": reshard}
    fields.pop("reshard_after_forward", None)
    result["cpu_offload"] = fields.pop("cpu_offload", False) or "offload" in options
    result.update(_wrap_policy(options, fields, no_split_modules))
    result.update(fields)
    return result


def _wrap_policy(
    options: Sequence[str], fields: dict[str, Any], no_split_modules: Sequence[str] | None
) -> dict[str, Any]:
    names = fields.pop("transformer_cls_names_to_wrap", None)
    min_params = fields.pop("min_num_params", None)
    policy = fields.pop("auto_wrap_policy", None)
    if names and min_params:
        raise ValueError(
            "fsdp_config sets both transformer_layer_cls_to_wrap and min_num_params; they choose different wrap "
            "policies (by layer class, by size). Keep one."
        )
    if policy is None and "auto_wrap" not in options:
        if names or min_params:
            raise ValueError(
                "fsdp_config names layers to wrap (transformer_layer_cls_to_wrap or min_num_params) but fsdp has no "
                "'auto_wrap' option, so nothing would be wrapped. Add 'auto_wrap' to fsdp."
            )
        return {"auto_wrap_policy": "NO_WRAP"}
    if policy is None:
        policy = "SIZE_BASED_WRAP" if min_params else "TRANSFORMER_BASED_WRAP"
    if policy == "TRANSFORMER_BASED_WRAP":
        names = names or list(no_split_modules or [])
        if not names:
            raise ValueError(
                "fsdp 'auto_wrap' wraps transformer layers, but neither fsdp_config.transformer_layer_cls_to_wrap "
                "nor the model's _no_split_modules names a layer class. Set transformer_layer_cls_to_wrap "
                "(e.g. ['BertLayer']) or min_num_params."
            )
        return {"auto_wrap_policy": policy, "transformer_cls_names_to_wrap": list(names)}
    if policy == "SIZE_BASED_WRAP":
        return {"auto_wrap_policy": policy, "min_num_params": int(min_params or 100_000_000)}
    return {"auto_wrap_policy": policy}
