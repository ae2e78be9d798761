"""``TrainingArguments.accelerator_config``: the Accelerator's data settings, as transformers'
``AcceleratorConfig``.

``TrainingArguments`` turns a dict, JSON text or the path of a JSON file into this object when it is built,
as transformers does, so ``args.accelerator_config.even_batches`` reads a setting.

Example:
    >>> config = AcceleratorConfig.from_value({"even_batches": False})
    >>> config.even_batches, config.split_batches
    (False, False)
    >>> AcceleratorConfig.from_value({"gradient_accumulation_kwargs": {"sync_each_batch": True}}).use_configured_state
    False
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lockstep.trainer import _argument_parsers

GRADIENT_ACCUMULATION_KEYS = ("num_steps", "adjust_scheduler", "sync_with_dataloader", "sync_each_batch")
"""The keys ``gradient_accumulation_kwargs`` takes: ``GradientAccumulationPlugin``'s fields, as in transformers."""


@dataclass(kw_only=True)
class AcceleratorConfig:
    """The Accelerator settings a ``Trainer`` can be given: transformers' ``AcceleratorConfig`` fields, with its
    defaults."""

    split_batches: bool = False
    """Cut each batch across the processes instead of giving every process a batch of its own."""
    dispatch_batches: bool | None = None
    """Read batches on the main process and send each process its slice (None: for iterable data)."""
    even_batches: bool = True
    """Repeat samples from the start so that every process gets as many batches."""
    use_seedable_sampler: bool = True
    """Shuffle with a sampler seeded by the data seed and the epoch (reproducible across runs)."""
    non_blocking: bool = False
    """Copy batches to the device asynchronously (needs ``dataloader_pin_memory``)."""
    gradient_accumulation_kwargs: dict[str, Any] | None = None
    """``GradientAccumulationPlugin`` settings: ``num_steps`` replaces ``gradient_accumulation_steps`` (which
    must then be 1), ``sync_each_batch=True`` all-reduces gradients on every micro-batch (less memory, more
    communication); ``adjust_scheduler`` and ``sync_with_dataloader`` are accepted and, as in transformers,
    have no effect (the Trainer accumulates and steps its scheduler itself)."""
    use_configured_state: bool = False
    """Use the process state (``Accelerator`` or ``PartialState``) the script created before the arguments set
    up the devices; without one that is an error. lockstep always shares an existing state, where
    transformers' False resets it."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "gradient_accumulation_kwargs":
                _check_accumulation_kwargs(value)
                continue
            allowed = (bool, type(None)) if f.name == "dispatch_batches" else (bool,)
            if not isinstance(value, allowed):
                raise ValueError(
                    f"TrainingArguments(accelerator_config) {f.name}={value!r} is invalid: it must be true or false"
                    + (" (or null)." if f.name == "dispatch_batches" else ".")
                )

    @classmethod
    def from_value(cls, value: Any) -> AcceleratorConfig:
        """An ``AcceleratorConfig`` from itself, None (the defaults), a dict, JSON text or a JSON file."""
        if isinstance(value, cls):
            return value
        if isinstance(value, type):
            raise TypeError(
                f"TrainingArguments(accelerator_config={value.__name__}) is invalid: it is a class. Pass an "
                f"instance ({value.__name__}()) or a dict."
            )
        loaded = _argument_parsers.load_json_dict(value, argument="accelerator_config") or {}
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(loaded) - set(known))
        if unknown:
            raise ValueError(
                f"TrainingArguments(accelerator_config) has unknown key(s) {unknown}; known keys: "
                f"{', '.join(known)}."
            )
        return cls(**loaded)

    @classmethod
    def from_json_file(cls, json_file: str) -> AcceleratorConfig:
        """Read the settings from a JSON file (transformers' constructor)."""
        return cls.from_value(str(json_file))

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plain dict."""
        return dataclasses.asdict(self)


def _check_accumulation_kwargs(value: Any) -> None:
    """``gradient_accumulation_kwargs``: None, or a dict of ``GradientAccumulationPlugin`` settings."""
    where = "TrainingArguments(accelerator_config) gradient_accumulation_kwargs"
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}={value!r} is invalid: it must be a dict (a JSON object) of {', '.join(GRADIENT_ACCUMULATION_KEYS)}."
        )
    unknown = sorted(set(value) - set(GRADIENT_ACCUMULATION_KEYS))
    if unknown:
        raise ValueError(
            f"{where} has unknown key(s) {unknown}; known keys: {', '.join(GRADIENT_ACCUMULATION_KEYS)}."
        )
    steps = value.get("num_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{where} num_steps={steps!r} is invalid: it must be an integer >= 1.")
    for key in GRADIENT_ACCUMULATION_KEYS[1:]:
        if key in value and not isinstance(value[key], bool):
            raise ValueError(f"{where} {key}={value[key]!r} is invalid: it must be true or false.")
