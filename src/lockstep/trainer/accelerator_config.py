"""``TrainingArguments.accelerator_config``: the Accelerator's data settings, as transformers'
``AcceleratorConfig``.

``TrainingArguments`` turns a dict, JSON text or the path of a JSON file into this object when it is built,
as transformers does, so ``args.accelerator_config.even_batches`` reads a setting.

Example:
    >>> config = AcceleratorConfig.from_value({"even_batches": False})
    >>> config.even_batches, config.split_batches
    (False, False)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lockstep.trainer import _argument_parsers


@dataclass(kw_only=True)
class AcceleratorConfig:
    """The Accelerator settings a ``Trainer`` can be given (transformers' ``AcceleratorConfig`` fields that
    lockstep builds)."""

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

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
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
