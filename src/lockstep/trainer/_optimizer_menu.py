"""The ``optim`` names: those built on torch alone, those that need another package, and ``optim_args``.

Torch-free, so that ``TrainingArguments`` can check a choice when it is constructed; the optimizers
themselves are built in :mod:`lockstep.trainer.optimizers`.
"""

from __future__ import annotations

from lockstep.trainer import _argument_parsers

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
"""The ``optim`` choices built on torch alone."""

_BNB = "bitsandbytes"
NEEDS_PACKAGE: dict[str, str] = {
    "adamw_torch_xla": "torch_xla",
    "adamw_torch_npu_fused": "torch_npu",
    "adamw_anyprecision": "torchdistx",
    "adamw_torch_4bit": "torchao",
    "adamw_torch_8bit": "torchao",
    "ademamix": _BNB,
    "adamw_bnb_8bit": _BNB,
    "adamw_8bit": _BNB,
    "ademamix_8bit": _BNB,
    "lion_8bit": _BNB,
    "lion_32bit": _BNB,
    "paged_adamw_32bit": _BNB,
    "paged_adamw_8bit": _BNB,
    "paged_ademamix_32bit": _BNB,
    "paged_ademamix_8bit": _BNB,
    "paged_lion_32bit": _BNB,
    "paged_lion_8bit": _BNB,
    "rmsprop_bnb": _BNB,
    "rmsprop_bnb_8bit": _BNB,
    "rmsprop_bnb_32bit": _BNB,
    "galore_adamw": "galore-torch",
    "galore_adamw_8bit": "galore-torch",
    "galore_adafactor": "galore-torch",
    "galore_adamw_layerwise": "galore-torch",
    "galore_adamw_8bit_layerwise": "galore-torch",
    "galore_adafactor_layerwise": "galore-torch",
    "lomo": "lomo-optim",
    "adalomo": "lomo-optim",
    "grokadamw": "grokadamw",
    "schedule_free_radam": "schedulefree",
    "schedule_free_adamw": "schedulefree",
    "schedule_free_sgd": "schedulefree",
    "apollo_adamw": "apollo-torch",
    "apollo_adamw_layerwise": "apollo-torch",
    "stable_adamw": "torch-optimi",
}
"""transformers' other ``optim`` names and the package (pip name) each needs."""

_FLOAT, _BOOL = "float", "bool"
OPTIM_ARGS: dict[str, dict[str, str]] = {
    "adamw_torch": {},
    "adamw_torch_fused": {},
    "adafactor": {"beta2_decay": _FLOAT, "d": _FLOAT},
    "sgd": {"momentum": _FLOAT, "dampening": _FLOAT, "weight_decay": _FLOAT, "nesterov": _BOOL},
    "adagrad": {"lr_decay": _FLOAT, "weight_decay": _FLOAT, "eps": _FLOAT},
    "rmsprop": {
        "momentum": _FLOAT,
        "alpha": _FLOAT,
        "eps": _FLOAT,
        "weight_decay": _FLOAT,
        "centered": _BOOL,
    },
}
"""The ``optim_args`` keys each built optimizer takes, and their kinds (transformers' keys)."""


def check_optim(value: object) -> str:
    """``value`` lower-cased if lockstep builds it; a clear error (with the pip line) otherwise."""
    name = value.strip().lower() if isinstance(value, str) else value
    if name in NEEDS_PACKAGE:
        package = NEEDS_PACKAGE[name]  # type: ignore[index]
        raise NotImplementedError(
            f"TrainingArguments(optim={value!r}) is not built in lockstep: it needs {package} "
            f"(pip install {package}), which lockstep does not wire. Build that optimizer yourself and pass "
            f"Trainer(optimizers=(optimizer, None)), or use one of {', '.join(OPTIMIZERS)}."
        )
    return _argument_parsers.check_choice(value, OPTIMIZERS, argument="optim")


def parse_optim_args(text: str | None) -> dict[str, str]:
    """``"momentum=0.9,nesterov=true"`` as ``{"momentum": "0.9", "nesterov": "true"}``."""
    if not text:
        return {}
    if not isinstance(text, str):
        raise TypeError(
            f"TrainingArguments(optim_args={text!r}) is invalid: pass a string such as 'momentum=0.9,nesterov=true'."
        )
    parsed: dict[str, str] = {}
    for item in text.replace(" ", "").split(","):
        key, sep, raw = item.partition("=")
        if not sep or not key or not raw:
            raise ValueError(
                f"TrainingArguments(optim_args={text!r}) is invalid: {item!r} is not key=value. Write "
                "'key=value,key=value', e.g. 'momentum=0.9,nesterov=true'."
            )
        parsed[key] = raw
    return parsed


def optimizer_kwargs(optim: str, text: str | None) -> dict[str, float | bool]:
    """The keyword arguments ``optim_args`` gives optimizer ``optim``, converted and checked."""
    known = OPTIM_ARGS[optim]
    kwargs: dict[str, float | bool] = {}
    for key, raw in parse_optim_args(text).items():
        if key not in known:
            takes = ", ".join(known) or "no optim_args (use adam_beta1, adam_beta2, adam_epsilon)"
            raise ValueError(
                f"TrainingArguments(optim={optim!r}, optim_args={text!r}): {key!r} is not an argument of this "
                f"optimizer; it takes {takes}."
            )
        if known[key] == _BOOL:
            kwargs[key] = raw.lower() in ("true", "1", "yes")
            continue
        try:
            kwargs[key] = float(raw)
        except ValueError:
            raise ValueError(
                f"TrainingArguments(optim_args={text!r}): {key}={raw!r} is not a number."
            ) from None
    return kwargs
