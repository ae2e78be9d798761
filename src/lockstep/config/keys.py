"""Configuration vocabularies: one :class:`SettingKey` per key, in one table next to its dataclass.

A table is a tuple of :class:`SettingKey`. It is the only place where a section's key names are written,
together with the dataclass field each key sets, the check of its value, its help text, whether
``lockstep launch`` offers it as a flag, and its other spellings. Everything else is derived from the
table with the functions below: the config file's section check (:func:`file_keys`), the launch flags
(:func:`flag_keys`, :attr:`SettingKey.flag_spellings`), the names accepted where settings are given by
name, such as the Trainer's ``fsdp_config`` (:func:`by_spelling`), and the dataclass keyword arguments of
a section (:func:`section_kwargs`, :func:`field_values`).

The tables: ``FSDP_KEYS`` (:mod:`lockstep.backends.fsdp.keys`), ``DYNAMO_KEYS``
(:mod:`lockstep.config.plugins`) and ``DEEPSPEED_KEYS`` (:mod:`lockstep.backends.deepspeed.keys`).

This module must not import torch: the command line reads the tables at start-up.

Example:
    >>> from lockstep.config import checks
    >>> table = (
    ...     SettingKey(key="fsdp_min_num_params", field="min_num_params", check=checks.int_range(0),
    ...                help="parameter threshold of SIZE_BASED_WRAP", flag=True),
    ... )
    >>> table[0].flag_spellings
    ('--fsdp-min-num-params', '--fsdp_min_num_params')
    >>> section_kwargs(by_spelling(table, "fsdp_"), {"fsdp_min_num_params": 10}, prefix="fsdp_",
    ...                where="fsdp_config", owner="FullyShardedDataParallelPlugin")
    {'min_num_params': 10}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Check = Callable[[Any, str], Any]
"""Turns a raw value at a key path into its normalized form, or raises ValueError naming the path."""


@dataclass(frozen=True, kw_only=True)
class SettingKey:
    """One key of a configuration section, with everything that is derived from it.

    Example:
        >>> from lockstep.config import checks
        >>> SettingKey(key="dynamo_use_dynamic", field="dynamic", check=checks.boolean,
        ...            help="trace with dynamic shapes").check("yes", "dynamo_config.dynamo_use_dynamic")
        True
    """

    key: str
    """The key as the config file section spells it, e.g. ``fsdp_transformer_layer_cls_to_wrap``."""
    field: str | None
    """The dataclass field the key sets, e.g. ``transformer_cls_names_to_wrap``; None for a key that is
    accepted and has no field (it is read by the launcher, or ignored)."""
    check: Check
    """Checks and normalizes a value (see :mod:`lockstep.config.checks`); the config file, the launch flag
    and the Trainer's mapping all use it."""
    help: str
    """One line for people: the ``--help`` of the launch flag and the documentation of the file key."""
    flag: bool = False
    """Whether ``lockstep launch`` offers the key as a flag (``--fsdp-min-num-params``, and the key itself
    with underscores, as Accelerate spells it)."""
    switch: bool = False
    """Whether the flag takes no value and giving it means true, as Accelerate's ``store_true`` flags do
    (``--dynamo-use-fullgraph``); False for flags that take ``true``/``false`` (``--fsdp-offload-params true``)."""
    file: bool = True
    """Whether the config file section takes the key; False for keys only given by name (the Trainer's
    ``fsdp_config`` knows ``ignored_modules``, which a YAML file cannot express)."""
    legacy: bool = False
    """A setting of the engine this one replaces (FSDP1 under FSDP2), accepted for compatibility: the
    dataclass warns about it (or translates it), and name-based mappings such as the Trainer's drop it with
    one warning."""
    aliases: tuple[str, ...] = ()
    """Other spellings accepted where settings are given by name (transformers' ``fsdp_config``), e.g.
    ``transformer_cls_names_to_wrap``; the config file takes only :attr:`key`."""
    to_field: Check | None = None
    """Turns a checked value into the field's form where the file keeps another one (the FSDP1 strategy
    names under ``fsdp_reshard_after_forward`` into a bool); None when the checked value is the field's."""

    def __post_init__(self) -> None:
        if self.flag and not self.file:
            raise ValueError(
                f"SettingKey(key={self.key!r}) is a launch flag but not a file key: a flag sets the file's key, "
                "so pass file=True or flag=False."
            )
        if self.switch and not self.flag:
            raise ValueError(
                f"SettingKey(key={self.key!r}) is a switch but not a launch flag: pass flag=True."
            )

    @property
    def flag_spellings(self) -> tuple[str, str]:
        """The launch flag, dashed and as Accelerate spells it: ``('--fsdp-version', '--fsdp_version')``."""
        return f"--{self.key.replace('_', '-')}", f"--{self.key}"

    def spellings(self, prefix: str) -> tuple[str, ...]:
        """The key without ``prefix``, then its aliases: the names a name-based mapping accepts."""
        return (self.key.removeprefix(prefix), *self.aliases)

    def field_value(self, value: Any, path: str) -> Any:
        """``value`` checked and in the field's form (see :attr:`to_field`); errors name ``path``."""
        checked = self.check(value, path)
        return checked if self.to_field is None else self.to_field(checked, path)


def file_keys(table: Iterable[SettingKey]) -> dict[str, SettingKey]:
    """The keys a config file section takes, by key (what the file's section check knows)."""
    return {entry.key: entry for entry in table if entry.file}


def flag_keys(table: Iterable[SettingKey]) -> dict[str, SettingKey]:
    """The keys ``lockstep launch`` offers as flags, by key (the flag's argparse ``dest``), in table order."""
    return {entry.key: entry for entry in table if entry.flag}


def by_spelling(table: Iterable[SettingKey], prefix: str) -> dict[str, SettingKey]:
    """Every spelling without ``prefix`` (each key's, then its aliases) -> its key.

    Raises:
        ValueError: two keys share a spelling (a defect of the table).
    """
    result: dict[str, SettingKey] = {}
    for entry in table:
        for name in entry.spellings(prefix):
            if name in result:
                raise ValueError(
                    f"{name!r} spells both {result[name].key} and {entry.key}; give each key its own."
                )
            result[name] = entry
    return result


def lookup(spellings: Mapping[str, SettingKey], name: str, prefix: str) -> SettingKey | None:
    """The key that ``name`` spells, with or without ``prefix`` (None if no key of the table)."""
    return spellings.get(name.removeprefix(prefix))


def section_kwargs(
    spellings: Mapping[str, SettingKey], section: Mapping[str, Any], *, prefix: str, where: str, owner: str
) -> dict[str, Any]:
    """The dataclass keyword arguments a section sets: each key (in any spelling) renamed to its field.

    Values are passed as given, for the dataclass to check; None values and keys without a field are left
    out.

    Args:
        spellings: the table by spelling (see :func:`by_spelling`).
        section: the section, e.g. a config file's ``fsdp_config``.
        prefix: the prefix the section's keys may carry, e.g. ``fsdp_``.
        where: the section's name in error messages, e.g. ``fsdp_config``.
        owner: the dataclass's name in error messages.

    Raises:
        ValueError: a key of no setting of the table.
    """
    kwargs: dict[str, Any] = {}
    for key, value in section.items():
        entry = lookup(spellings, key, prefix)
        if entry is None:
            raise ValueError(f"{where}.{key} is not a setting of {owner}.")
        if value is not None and entry.field is not None:
            kwargs[entry.field] = value
    return kwargs


def field_values(
    spellings: Mapping[str, SettingKey], section: Mapping[str, Any], *, prefix: str, where: str
) -> dict[str, Any]:
    """The fields a section sets, checked and in the fields' form, for comparing settings without the dataclass.

    Legacy keys, keys without a field and None values are left out; when two keys set one field, the later
    wins (as in :func:`section_kwargs`).

    Raises:
        ValueError: a key of no setting of the table, or a value its check rejects (naming ``where.key``).
    """
    fields: dict[str, Any] = {}
    for key, value in section.items():
        entry = lookup(spellings, key, prefix)
        if entry is None:
            raise ValueError(f"{where}.{key} is not a known key (known: {', '.join(sorted(spellings))})")
        if value is not None and entry.field is not None and not entry.legacy:
            fields[entry.field] = entry.field_value(value, f"{where}.{key}")
    return fields
