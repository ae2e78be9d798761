"""Plugins: settings objects that switch on a feature of the Accelerator.

:data:`DYNAMO_KEYS` is the vocabulary of the config file's ``dynamo_config`` section, next to
:class:`TorchDynamoPlugin` (see :mod:`lockstep.config.keys`). Every key is also a ``lockstep launch``
flag (``--dynamo-mode``, ``--dynamo-use-fullgraph``, ...); :func:`dynamo_fields` turns a section into the
plugin's keyword arguments, which is how the launcher's settings reach the workers' plugin.

Example:
    >>> dynamo_fields({"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune", "dynamo_use_dynamic": "true"})
    {'mode': 'max-autotune', 'dynamic': True}
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lockstep import _env
from lockstep.config import checks
from lockstep.config.enums import DynamoBackend
from lockstep.config.keys import SettingKey, by_spelling, field_values

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The ``torch.compile`` modes."""


@dataclass(kw_only=True)
class GradientAccumulationPlugin:
    """How ``Accelerator.accumulate`` accumulates gradients.

    Example:
        >>> plugin = GradientAccumulationPlugin(num_steps=4, sync_with_dataloader=True)
    """

    num_steps: int | None = None
    """Number of micro-batches per optimizer step."""
    adjust_scheduler: bool = True
    """Count scheduler steps as if every micro-batch were a step (keeps warm-up lengths in batches)."""
    sync_with_dataloader: bool = True
    """Force a gradient sync (and an optimizer step) on the last batch of the dataloader."""
    sync_each_batch: bool = False
    """All-reduce gradients on every micro-batch (more communication, less memory)."""

    def __post_init__(self) -> None:
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or self.num_steps < 1):
            raise ValueError(
                f"GradientAccumulationPlugin(num_steps={self.num_steps!r}) is invalid: it must be an integer >= 1."
            )

    def to_kwargs(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "adjust_scheduler": self.adjust_scheduler,
            "sync_with_dataloader": self.sync_with_dataloader,
            "sync_each_batch": self.sync_each_batch,
        }


@dataclass(kw_only=True)
class TorchDynamoPlugin:
    """``torch.compile`` settings. The model is compiled before it is wrapped for DDP.

    A field left unset (None) is read, as in Accelerate, from the variable ``accelerate launch`` sets for its
    ``dynamo_config`` key (``ACCELERATE_DYNAMO_BACKEND``, ``ACCELERATE_DYNAMO_MODE``,
    ``ACCELERATE_DYNAMO_USE_FULLGRAPH``, ``ACCELERATE_DYNAMO_USE_DYNAMIC``,
    ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION``), else takes lockstep's default: no backend, no mode,
    ``fullgraph=False``, ``dynamic=None``, no options, no regional compilation.

    Example:
        >>> plugin = TorchDynamoPlugin(backend="inductor", mode="max-autotune")
    """

    backend: DynamoBackend | str | None = None
    """Compiler backend (``no`` disables compilation)."""
    mode: str | None = None
    """``default``, ``reduce-overhead``, ``max-autotune`` or ``max-autotune-no-cudagraphs``."""
    fullgraph: bool | None = None
    """Compile the whole model as one graph: a graph break is an error instead of a fallback to Python."""
    dynamic: bool | None = None
    """Trace with dynamic shapes (True), static shapes (False), or let torch decide (None)."""
    options: dict[str, Any] | None = None
    """Options for the backend (``torch.compile(options=...)``)."""
    disable: bool = False
    use_regional_compilation: bool | None = None
    """Compile each repeated block (every ``nn.ModuleList`` of same-class modules, e.g. transformer layers)
    and the modules beside it separately instead of the whole model: the compiler traces one block and
    reuses it, so a deep model compiles much faster (Accelerate's regional compilation). lockstep compiles
    the blocks in place (``nn.Module.compile``): the prepared model keeps its parameter names."""

    def __post_init__(self) -> None:
        for entry in DYNAMO_KEYS:  # unset fields: accelerate launch's variables, as Accelerate reads them
            if getattr(self, entry.field) is None:
                variable, raw = _env.accelerate_variable(entry.key)
                if raw is not None:
                    setattr(self, entry.field, entry.field_value(raw, variable))
        for name, default in _UNSET.items():
            if getattr(self, name) is None:
                setattr(self, name, copy.deepcopy(default))
        self.backend = DynamoBackend.parse(self.backend, argument="TorchDynamoPlugin(backend=...)")
        modes = (None, *COMPILE_MODES)
        if self.mode not in modes:
            raise ValueError(f"TorchDynamoPlugin(mode={self.mode!r}) is invalid: it must be one of {modes}.")

    @property
    def enabled(self) -> bool:
        return self.backend != DynamoBackend.NO and not self.disable

    def to_dict(self) -> dict[str, Any]:
        """Every field, the backend as its lower-case name (Accelerate's format)."""
        values = copy.deepcopy({f.name: getattr(self, f.name) for f in fields(self)})
        values["backend"] = self.backend.value.lower()
        return values

    def to_kwargs(self) -> dict[str, Any]:
        """The fields whose value differs from the default (what a plugin built without arguments and without
        the environment's variables holds), as Accelerate's kwargs handlers return them; like Accelerate,
        without ``use_regional_compilation``, which is no ``torch.compile`` argument.

        Example:
            >>> TorchDynamoPlugin(backend="inductor", mode="max-autotune").to_kwargs()
            {'backend': 'inductor', 'mode': 'max-autotune'}
        """
        default = {f.name: _UNSET.get(f.name, f.default) for f in fields(self)}
        default["backend"] = DynamoBackend.NO.value.lower()
        kwargs = {key: value for key, value in self.to_dict().items() if default[key] != value}
        kwargs.pop("use_regional_compilation", None)
        return kwargs

    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile``."""
        kwargs: dict[str, Any] = {"backend": self.backend.value, "fullgraph": self.fullgraph}
        if self.mode is not None:
            kwargs["mode"] = self.mode
        if self.dynamic is not None:
            kwargs["dynamic"] = self.dynamic
        if self.options:
            kwargs["options"] = self.options
        return kwargs


DYNAMO_KEYS: tuple[SettingKey, ...] = (
    SettingKey(
        key="dynamo_backend",
        field="backend",
        check=checks.dynamo_backend,
        help="torch.compile backend (no, eager, inductor, ...)",
        flag=True,
    ),
    SettingKey(
        key="dynamo_mode",
        field="mode",
        check=checks.choice(*COMPILE_MODES),
        help="torch.compile mode: default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs",
        flag=True,
    ),
    SettingKey(
        key="dynamo_use_fullgraph",
        field="fullgraph",
        check=checks.boolean,
        help="compile the whole model as one graph (an error on graph breaks)",
        flag=True,
        switch=True,
    ),
    SettingKey(
        key="dynamo_use_dynamic",
        field="dynamic",
        check=checks.boolean,
        help="trace with dynamic shapes",
        flag=True,
        switch=True,
    ),
    SettingKey(
        key="dynamo_use_regional_compilation",
        field="use_regional_compilation",
        check=checks.boolean,
        help="compile each repeated block (e.g. transformer layers) separately, reusing the compiled code",
        flag=True,
        switch=True,
    ),
)
"""Every ``dynamo_config`` key: file key -> TorchDynamoPlugin field -> check -> help -> launch flag.

``--dynamo-backend`` sets the launcher's ``dynamo_backend`` directly (Accelerate's flag); the other flags
set the launcher's ``dynamo_config`` section, as the file's keys do.
"""

_UNSET: dict[str, Any] = {
    "backend": DynamoBackend.NO,
    "fullgraph": False,
    "options": {},
    "use_regional_compilation": False,
}
"""What a :class:`TorchDynamoPlugin` field left unset (and not set by the environment) becomes; ``mode`` and
``dynamic`` stay None (torch's defaults)."""

DYNAMO_PREFIX = "dynamo_"
"""The prefix of the ``dynamo_config`` keys."""
DYNAMO_SPELLINGS: dict[str, SettingKey] = by_spelling(DYNAMO_KEYS, DYNAMO_PREFIX)
"""Every dynamo key without the prefix -> the key."""


def dynamo_fields(section: Mapping[str, Any], *, where: str = "dynamo_config") -> dict[str, Any]:
    """The :class:`TorchDynamoPlugin` fields a ``dynamo_config`` section sets besides the backend, checked.

    The backend is left out: the launcher hands it down on its own (``dynamo_backend``), so that
    ``TorchDynamoPlugin(backend=backend, **dynamo_fields(section))`` builds the plugin.

    Raises:
        ValueError: an unknown key, or a value its check rejects (naming ``where.key``).
    """
    values = field_values(DYNAMO_SPELLINGS, section, prefix=DYNAMO_PREFIX, where=where)
    values.pop("backend", None)
    return values
