"""``DeepSpeedPlugin``: Accelerate's fields and defaults, and the DeepSpeed JSON config they make.

A plugin holds one DeepSpeed config (``deepspeed_config``, a dict in DeepSpeed's own JSON schema). Given
``hf_ds_config`` (a path, a dict or base64-encoded JSON) that config is used as written; otherwise it is
built from the plugin's fields (``zero_stage``, offload devices, ...), which default to the variables
``lockstep launch`` sets from the config file (``ACCELERATE_DEEPSPEED_*``, Accelerate's names), as in
Accelerate. Values written ``"auto"`` are filled at ``prepare`` from the dataloaders, the model and the
Accelerator (:mod:`lockstep.backends.deepspeed.auto`) with :meth:`DeepSpeedPlugin.fill_match`.

This module imports neither torch nor deepspeed.

Example:
    >>> plugin = DeepSpeedPlugin(zero_stage=3, gradient_accumulation_steps=2, gradient_clipping=1.0)
    >>> plugin.deepspeed_config["zero_optimization"]["stage"], plugin.get_value("gradient_clipping")
    (3, 1.0)
    >>> plugin.is_auto("train_micro_batch_size_per_gpu")
    True
"""

from __future__ import annotations

import base64
import copy
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ZERO_STAGES = (0, 1, 2, 3)
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def load_deepspeed_config(source: Any, *, argument: str = "hf_ds_config") -> dict[str, Any]:
    """A DeepSpeed config as a dict, from a dict, a JSON file's path, JSON text or base64-encoded JSON.

    Raises:
        ValueError: the source is none of these, naming what was given.
    """
    config = getattr(source, "config", source)  # an object holding a config (Accelerate's HfDeepSpeedConfig)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, str | os.PathLike):
        text = str(config)
        if Path(text).is_file():
            try:
                return _as_dict(json.loads(Path(text).read_text()), f"{argument}={text!r}")
            except json.JSONDecodeError as error:
                raise ValueError(f"{argument}: {text} is not valid JSON ({error}); fix the file.") from None
        for decode in (lambda t: t, lambda t: base64.urlsafe_b64decode(t).decode()):
            try:
                return _as_dict(json.loads(decode(text)), f"{argument}")
            except (ValueError, UnicodeDecodeError):
                continue
    raise ValueError(
        f"{argument}={source!r} is not a DeepSpeed config: pass a dict, the path of an existing JSON file, JSON "
        "text or base64-encoded JSON."
    )


def _as_dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(
            f"{where} holds a JSON {type(value).__name__}, not an object: a DeepSpeed config is a dict."
        )
    return value


def str_to_bool(value: str) -> bool:
    return str(value).strip().lower() in ("y", "yes", "t", "true", "on", "1")


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _auto_or_number(value: Any, cast: type) -> Any:
    if value == "auto" or value is None:
        return value
    return cast(value)


@dataclass
class DeepSpeedPlugin:
    """Train with DeepSpeed ZeRO (needs ``pip install 'lockstep[deepspeed]'``).

    Args:
        hf_ds_config: a DeepSpeed config (dict, JSON file path, JSON text or base64 JSON); when given, the
            fields below except ``zero3_init_flag`` and ``is_train_batch_min`` are not used.
        gradient_accumulation_steps: micro-batches per optimizer step, or ``"auto"`` (the Accelerator's).
        gradient_clipping: clip the global gradient norm to this, or ``"auto"``.
        zero_stage: 0 (off), 1 (optimizer states), 2 (and gradients), 3 (and parameters); default 2.
        is_train_batch_min: with several dataloaders, the micro batch is the smallest batch size (else the
            largest).
        offload_optimizer_device, offload_param_device: ``"none"``, ``"cpu"`` or ``"nvme"``.
        offload_optimizer_nvme_path, offload_param_nvme_path: NVMe folders.
        zero3_init_flag: build models already sharded (``deepspeed.zero.Init``); ZeRO-3 only.
        zero3_save_16bit_model: ZeRO-3: gather the whole 16-bit model when saving it.
        transformer_moe_cls_names: comma-separated mixture-of-experts layer class names (ZeRO-3 leaves).
        enable_msamp, msamp_opt_level: MS-AMP FP8; not supported by lockstep (an error when enabled).
    """

    hf_ds_config: Any = None
    gradient_accumulation_steps: int | str | None = None
    gradient_clipping: float | str | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None
    enable_msamp: bool | None = None
    msamp_opt_level: str | None = None
    deepspeed_config: dict[str, Any] = field(init=False, repr=False, default_factory=dict)
    """The DeepSpeed config the engine is built with ("auto" values filled at ``prepare``)."""

    def __post_init__(self) -> None:
        explicit = {name: getattr(self, name) for name in _JSON_PATHS if getattr(self, name) is not None}
        self._fill_field_defaults()
        if self.enable_msamp:
            raise NotImplementedError(
                "DeepSpeedPlugin(enable_msamp=True): MS-AMP FP8 training is not supported by lockstep. Leave "
                "enable_msamp unset and train in bf16."
            )
        if self.hf_ds_config is None:
            self.hf_ds_config = _env("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if isinstance(self.hf_ds_config, str) and self.hf_ds_config == "none":
            self.deepspeed_config = self._config_from_fields()
        else:
            self.deepspeed_config = load_deepspeed_config(self.hf_ds_config)
            self._merge_explicit_fields(explicit)
            self.deepspeed_config.setdefault("gradient_accumulation_steps", 1)
            if "zero_optimization" not in self.deepspeed_config:
                raise ValueError(
                    "The DeepSpeed config has no zero_optimization section: add one, e.g. "
                    '"zero_optimization": {"stage": 2}.'
                )
        self._check_stage()
        # DeepSpeed's own progress lines every N steps would interleave with the user's output.
        self.deepspeed_config["steps_per_print"] = float("inf")
        if self.zero3_init_flag is None:
            self.zero3_init_flag = str_to_bool(_env("ACCELERATE_DEEPSPEED_ZERO3_INIT", str(self.is_zero3())))
        if self.zero3_init_flag and not self.is_zero3():
            warnings.warn(
                "DeepSpeedPlugin(zero3_init_flag=True) applies to ZeRO stage 3 only; it is switched off for stage "
                f"{self.stage}.",
                stacklevel=3,
            )
            self.zero3_init_flag = False
        self._selected = False

    def _fill_field_defaults(self) -> None:
        """Fields left None take the launcher's variables, else Accelerate's defaults."""
        if self.gradient_accumulation_steps is None:
            steps = _env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
            self.gradient_accumulation_steps = int(steps) if steps.isdigit() else steps
        if self.gradient_clipping is None:
            self.gradient_clipping = _auto_or_number(_env("ACCELERATE_GRADIENT_CLIPPING", "auto"), float)
        if self.zero_stage is None:
            self.zero_stage = int(_env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
        if self.offload_optimizer_device is None:
            self.offload_optimizer_device = _env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
        if self.offload_param_device is None:
            self.offload_param_device = _env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
        if self.offload_optimizer_nvme_path is None:
            self.offload_optimizer_nvme_path = _env(
                "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", "none"
            )
        if self.offload_param_nvme_path is None:
            self.offload_param_nvme_path = _env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "none")
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = str_to_bool(
                _env("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false")
            )
        if self.transformer_moe_cls_names is None:
            self.transformer_moe_cls_names = os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES")

    def _config_from_fields(self) -> dict[str, Any]:
        for name in ("offload_optimizer_device", "offload_param_device"):
            value = getattr(self, name)
            if value not in _OFFLOAD_DEVICES:
                raise ValueError(
                    f"DeepSpeedPlugin({name}={value!r}) is invalid: use one of {', '.join(_OFFLOAD_DEVICES)}."
                )
        zero: dict[str, Any] = {
            "stage": self.zero_stage,
            "offload_optimizer": _offload(self.offload_optimizer_device, self.offload_optimizer_nvme_path),
            "offload_param": _offload(self.offload_param_device, self.offload_param_nvme_path),
            "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
        }
        config: dict[str, Any] = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "zero_optimization": zero,
        }
        if self.gradient_clipping is not None:
            # Written even when 0: DeepSpeed's own default clips at 1.0, and 0 means "do not clip".
            config["gradient_clipping"] = self.gradient_clipping
        return config

    def _merge_explicit_fields(self, explicit: dict[str, Any]) -> None:
        """Fields given together with a JSON config fill what it leaves out or sets to "auto"; a field that
        contradicts a value it sets is an error naming both (Accelerate ignores such fields)."""
        conflicts = []
        for name, value in explicit.items():
            path = _JSON_PATHS[name]
            written = self.get_value(path)
            if written is None or written == "auto":
                if value != "auto":
                    _set_path(self.deepspeed_config, path, value)
            elif written != value:
                conflicts.append(f"{name}={value!r} against {path}={written!r}")
        if conflicts:
            source = (
                repr(self.hf_ds_config)
                if isinstance(self.hf_ds_config, str | os.PathLike)
                else "(hf_ds_config)"
            )
            raise ValueError(
                f"The DeepSpeed config {source} and the other DeepSpeed settings disagree: "
                + "; ".join(conflicts)
                + '. Set each value in one place (or write "auto" in the JSON config).'
            )

    def _check_stage(self) -> None:
        stage = self.get_value("zero_optimization.stage", 0)
        if stage not in ZERO_STAGES:
            raise ValueError(
                f"ZeRO stage {stage!r} is invalid: DeepSpeed has stages 0 (off), 1 (optimizer states), 2 (and "
                "gradients) and 3 (and parameters)."
            )

    # -- reading the config --------------------------------------------------------------------------
    @property
    def stage(self) -> int:
        """The ZeRO stage of the config."""
        return int(self.get_value("zero_optimization.stage", 0))

    def is_zero3(self) -> bool:
        return self.stage == 3

    def _node(self, ds_key_long: str) -> tuple[dict[str, Any] | None, str]:
        config: Any = self.deepspeed_config
        *parents, key = ds_key_long.split(".")
        for parent in parents:
            config = config.get(parent) if isinstance(config, dict) else None
            if config is None:
                return None, key
        return (config if isinstance(config, dict) else None), key

    def get_value(self, ds_key_long: str, default: Any = None) -> Any:
        """The value at a dotted key (``"zero_optimization.stage"``), or ``default``."""
        node, key = self._node(ds_key_long)
        return default if node is None else node.get(key, default)

    def is_auto(self, ds_key_long: str) -> bool:
        """Whether the value at a dotted key is ``"auto"``."""
        return self.get_value(ds_key_long) == "auto"

    def is_offload(self) -> bool:
        """Whether optimizer states or parameters are offloaded to CPU or NVMe."""
        return any(
            self.get_value(f"zero_optimization.{part}.device", "none") not in ("none", None)
            for part in ("offload_optimizer", "offload_param")
        )

    # -- filling "auto" ------------------------------------------------------------------------------
    def fill_match(
        self, ds_key_long: str, mismatches: list[str] | None = None, must_match: bool = True, **kwargs: Any
    ) -> None:
        """Replace ``"auto"`` at ``ds_key_long`` with ``kwargs[ds_key_long]``; with ``must_match``, record a
        value that differs from the one given in ``mismatches``.

        Raises:
            ValueError: the value is ``"auto"`` and nothing was given to fill it with.
        """
        node, key = self._node(ds_key_long)
        if node is None:
            return
        if node.get(key) == "auto":
            if ds_key_long not in kwargs:
                raise ValueError(
                    f'The DeepSpeed config sets {ds_key_long} to "auto", and lockstep has nothing to fill it from. '
                    f"Write a value for {ds_key_long} in the DeepSpeed config."
                )
            node[key] = kwargs[ds_key_long]
            return
        if must_match and mismatches is not None and ds_key_long in kwargs:
            if node.get(key) is not None and node[key] != kwargs[ds_key_long]:
                mismatches.append(
                    f"- {ds_key_long}: DeepSpeed config {node[key]!r}, arguments {kwargs[ds_key_long]!r}"
                )

    def deepspeed_config_process(
        self,
        prefix: str = "",
        mismatches: list[str] | None = None,
        config: dict[str, Any] | None = None,
        must_match: bool = True,
        **kwargs: Any,
    ) -> None:
        """Fill every ``"auto"`` of the config from ``kwargs`` (dotted keys); with ``must_match``, every value
        that differs from ``kwargs`` is an error listing them all."""
        found: list[str] = [] if mismatches is None else mismatches
        for key in list(_leaf_keys(self.deepspeed_config if config is None else config, prefix)):
            self.fill_match(key, found, must_match=must_match, **kwargs)
        if found and mismatches is None:
            raise ValueError(
                "These DeepSpeed config values contradict the arguments:\n"
                + "\n".join(found)
                + '\nMake them agree, or write "auto" in the DeepSpeed config to take the arguments\' values.'
            )

    def set_mixed_precision(self, mixed_precision: str) -> None:
        """Switch the config's fp16 or bf16 section on for ``mixed_precision`` ("no", "fp16", "bf16").

        Raises:
            ValueError: the config switches on the other 16-bit type.
        """
        config = self.deepspeed_config
        if mixed_precision == "fp8":
            raise NotImplementedError(
                "mixed_precision='fp8' with DeepSpeed is not supported by lockstep; use bf16."
            )
        if mixed_precision in ("fp16", "bf16"):
            other = "bf16" if mixed_precision == "fp16" else "fp16"
            if str(config.get(other, {}).get("enabled", False)).lower() == "true":
                raise ValueError(
                    f"mixed_precision={mixed_precision!r} contradicts the DeepSpeed config, which enables {other}. "
                    "Use the same precision in both, or leave mixed_precision out."
                )
            config.setdefault(mixed_precision, {"enabled": True})
        for dtype in ("fp16", "bf16"):
            config.setdefault(dtype, {"enabled": False})
        values = {"fp16.enabled": mixed_precision == "fp16", "bf16.enabled": mixed_precision == "bf16"}
        self.fill_match("fp16.enabled", must_match=False, **values)
        self.fill_match("bf16.enabled", must_match=False, **values)

    def mixed_precision_of_config(self) -> str:
        """``"fp16"``, ``"bf16"`` or ``"no"``: what the config itself switches on."""
        for dtype in ("bf16", "fp16"):
            if str(self.get_value(f"{dtype}.enabled", False)).lower() == "true":
                return dtype
        return "no"

    # -- ZeRO-3 construction -------------------------------------------------------------------------
    def is_zero3_init_enabled(self) -> bool:
        return bool(self.zero3_init_flag)

    def zero3_init_context_manager(self, enable: bool = False) -> Any:
        """A context in which models are built already sharded (``deepspeed.zero.Init``) when ``enable``, or
        in which transformers' ``from_pretrained`` does not shard at init when not (Accelerate's meaning)."""
        from lockstep.backends.deepspeed.zero3 import zero3_init_context

        return zero3_init_context(self, enable=enable)

    def set_deepspeed_weakref(self) -> None:
        """Tell transformers that ZeRO-3 is on, so that ``from_pretrained`` builds models sharded."""
        from lockstep.backends.deepspeed.zero3 import tell_transformers

        tell_transformers(self)

    def set_moe_leaf_modules(self, model: Any) -> None:
        """Make the ``transformer_moe_cls_names`` layers ZeRO-3 leaf modules (gathered whole)."""
        from lockstep.backends.deepspeed.zero3 import set_moe_leaves

        set_moe_leaves(self, model)

    # -- several plugins --------------------------------------------------------------------------
    def select(self, _from_accelerator_state: bool = False) -> None:
        """Make this plugin the active one (use ``AcceleratorState().select_deepspeed_plugin(name)``)."""
        if not _from_accelerator_state:
            raise ValueError(
                "DeepSpeedPlugin.select() is called by AcceleratorState().select_deepspeed_plugin(name); call that."
            )
        self._selected = True

    def _unselect(self) -> None:
        self._selected = False

    @property
    def selected(self) -> bool:
        return self._selected


_JSON_PATHS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}
"""The plugin fields that set a value of the DeepSpeed JSON config, and where."""


def _set_path(config: dict[str, Any], path: str, value: Any) -> None:
    *parents, key = path.split(".")
    for parent in parents:
        config = config.setdefault(parent, {})
    config[key] = value


def _offload(device: str, nvme_path: str | None) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def _leaf_keys(config: Mapping[str, Any], prefix: str) -> Iterator[str]:
    for key, value in config.items():
        if isinstance(value, Mapping):
            yield from _leaf_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def get_active_deepspeed_plugin(state: Any) -> DeepSpeedPlugin:
    """The active DeepSpeed plugin of an ``AcceleratorState``.

    Raises:
        ValueError: DeepSpeed is not in use.
    """
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError(
            "DeepSpeed is not in use, so there is no active DeepSpeed plugin: pass Accelerator(deepspeed_plugin=...) "
            "or launch with distributed_type: DEEPSPEED."
        )
    return plugin
