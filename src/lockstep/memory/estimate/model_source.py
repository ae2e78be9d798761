"""Build the model to estimate on the meta device (no memory, no weights) and describe its size.

Three ways to name a model:

- a local folder with a transformers ``config.json`` (its ``architectures[0]`` class, else ``AutoModel``);
- ``module:factory`` or ``path/to/file.py:factory``: a function returning an ``nn.Module``;
- a transformers config class name with settings: ``BertConfig`` and ``{"hidden_size": 256, ...}``.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.errors import UsageError
from lockstep.memory.estimate.formulas import TransformerShape

FORMS = (
    "a folder with a transformers config.json, 'module:factory' / 'file.py:factory' (a function returning "
    "an nn.Module), or a transformers config class name such as BertConfig"
)


@dataclass(frozen=True)
class ModelDescription:
    """What the estimate needs to know about a model.

    Attributes:
        source: what the user passed.
        model_class: the built module's class name.
        trainable_parameters: elements of parameters with ``requires_grad`` (tied weights counted once).
        frozen_parameters: elements of the other parameters.
        transformer: the shape the activation formula needs, or None when it is unknown.
        unknown_activations_reason: why activations are unknown (when ``transformer`` is None).
    """

    source: str
    model_class: str
    trainable_parameters: int
    frozen_parameters: int
    transformer: TransformerShape | None
    unknown_activations_reason: str = ""
    tensor_parallel_parameters: int = 0
    """Elements that tensor parallelism splits: the weights (and column-split biases) of the modules the
    model's own plan names; 0 without a plan."""
    adapters: str | None = None
    """The LoRA adapters counted as the trainable parameters (``--lora-r``), described; None without."""
    num_experts: tuple[int, ...] = ()
    """The experts of each mixture-of-experts block expert parallelism recognises, in module order; empty
    without such blocks."""
    expert_parameters: int = 0
    """Elements of those blocks' expert parameters (all experts): what ``--ep-size`` shards."""

    @property
    def num_parameters(self) -> int:
        return self.trainable_parameters + self.frozen_parameters


def describe_model(
    source: str | None,
    *,
    config_class: str | None = None,
    settings: dict[str, Any] | None = None,
    model_class: str | None = None,
) -> ModelDescription:
    """Build the model named by ``source`` (or ``config_class``) on the meta device and describe it.

    Args:
        source: a folder with ``config.json``, ``module:factory``, ``file.py:factory``, or a config class name.
        config_class: a transformers config class name (instead of ``source``).
        settings: config fields to set (``hidden_size=256``...); not allowed with a factory.
        model_class: the transformers model class (``AutoModelForCausalLM``, ``BertForMaskedLM``...) to build
            from a config instead of its ``architectures`` entry / ``AutoModel``.

    Raises:
        UsageError: when the model cannot be found or built (the message says which form was understood).
    """
    return describe_module(
        *build_model(source, config_class=config_class, settings=settings, model_class=model_class)
    )


def build_model(
    source: str | None,
    *,
    config_class: str | None = None,
    settings: dict[str, Any] | None = None,
    model_class: str | None = None,
) -> tuple[str, nn.Module]:
    """What :func:`describe_model` describes: (the source as named, the model on the meta device)."""
    settings = settings or {}
    if (source is None) == (config_class is None):
        raise UsageError(
            f"give exactly one model: {FORMS} (got model={source!r}, --config-class={config_class!r})."
        )
    if config_class is not None:
        config = _config_from_class(config_class, settings)
        return config_class, _build_transformers(config, model_class)
    assert source is not None
    if Path(source).is_dir():
        config = _config_from_folder(Path(source), settings)
        return source, _build_transformers(config, model_class)
    if ":" in source:
        if settings or model_class:
            raise UsageError(
                f"--set and --model-class apply to transformers configs, not to the factory {source!r}."
            )
        return source, _build_from_factory(source)
    if source.endswith("Config") and source.isidentifier():
        return source, _build_transformers(_config_from_class(source, settings), model_class)
    if Path(source).exists():
        raise UsageError(f"{source!r} is a file, not a model folder: give {FORMS}.")
    raise UsageError(
        f"no model {source!r}: it is not a folder, not 'module:factory' and not a config class. Give {FORMS}."
    )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "estimating a transformers model needs transformers: pip install transformers"
        ) from None
    return transformers


def _config_from_folder(folder: Path, settings: dict[str, Any]) -> Any:
    path = folder / "config.json"
    if not path.is_file():
        raise UsageError(f"the folder {str(folder)!r} has no config.json: give {FORMS}.")
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise UsageError(f"{str(path)!r} is not valid JSON: {error}.") from None
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raise UsageError(f"transformers cannot read {str(path)!r}: {error}") from None
    return _apply_settings(config, settings)


def _config_from_class(name: str, settings: dict[str, Any]) -> Any:
    transformers = _transformers()
    config_type = getattr(transformers, name, None)
    if not (isinstance(config_type, type) and issubclass(config_type, transformers.PretrainedConfig)):
        raise UsageError(
            f"--config-class {name!r} is not a transformers config class: use a name such as BertConfig, "
            "GPT2Config or LlamaConfig."
        )
    _apply_settings(config_type(), settings)  # checks the names against the default config
    # then built with them, so that fields derived in __init__ follow (LlamaConfig's head_dim from hidden_size)
    return config_type(**settings)


def _apply_settings(config: Any, settings: dict[str, Any]) -> Any:
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    for key, value in settings.items():
        if key not in known:
            raise UsageError(
                f"--set {key}={value!r}: {type(config).__name__} has no field {key!r}. "
                f"Fields include: {', '.join(sorted(k for k in known if not k.startswith('_'))[:40])}."
            )
        setattr(config, key, value)
    return config


def build_model_from_folder(folder: str | Path, model_class: str | None = None) -> nn.Module:
    """The transformers model of ``folder``'s ``config.json``, built on the meta device (no weights read).

    Args:
        folder: a local folder holding ``config.json``.
        model_class: the transformers class to build (default: the config's ``architectures[0]``, else
            ``AutoModel``).

    Raises:
        UsageError: no such folder or config, or transformers cannot build it.
    """
    if not Path(folder).is_dir():
        raise UsageError(f"{str(folder)!r} is not a folder: give a folder with a transformers config.json.")
    return _build_transformers(_config_from_folder(Path(folder), {}), model_class)


def _build_transformers(config: Any, model_class: str | None) -> nn.Module:
    transformers = _transformers()
    class_name = model_class or ((getattr(config, "architectures", None) or [None])[0]) or "AutoModel"
    model_type = getattr(transformers, class_name, None)
    if model_type is None:
        raise UsageError(
            f"transformers has no model class {class_name!r}: pass --model-class, e.g. AutoModel."
        )
    try:
        with torch.device("meta"):
            if class_name.startswith("Auto"):
                model = model_type.from_config(config)
            else:
                model = model_type(config)
    except (ValueError, TypeError, AttributeError, RuntimeError) as error:
        raise UsageError(
            f"cannot build {class_name} from this config: {type(error).__name__}: {error}"
        ) from None
    return model


def _import_factory(path: str) -> Any:
    module_name, _, function_name = path.rpartition(":")
    if not module_name or not function_name.isidentifier():
        raise UsageError(f"{path!r} is not 'module:factory': give e.g. 'mypackage.models:build_model'.")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or spec.loader is None or not Path(module_name).is_file():
                raise UsageError(f"no Python file {module_name!r} (from {path!r}).")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")  # like `python -m`: modules in the current folder are found
            module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"cannot import {module_name!r} (from {path!r}): {error}") from None
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise UsageError(f"{module_name!r} has no function {function_name!r} (from {path!r}).")
    return factory


def _build_from_factory(path: str) -> nn.Module:
    factory = _import_factory(path)
    try:
        with torch.device("meta"):
            model = factory()
    except UsageError:
        raise
    except Exception as error:
        raise UsageError(
            f"{path} failed on the meta device ({type(error).__name__}: {error}). The factory is called with "
            "no arguments under torch.device('meta'); avoid loading weights or moving tensors to a device in it."
        ) from None
    if not isinstance(model, nn.Module):
        raise UsageError(f"{path} returned {type(model).__name__}, not an nn.Module.")
    return model


def describe_module(source: str, model: nn.Module) -> ModelDescription:
    parameters = list(model.parameters())  # unique: tied weights appear once
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    frozen = sum(p.numel() for p in parameters if not p.requires_grad)
    shape, reason = transformer_shape(getattr(model, "config", None), has_lm_head=_has_lm_head(model))
    return ModelDescription(
        source=source,
        model_class=type(model).__name__,
        trainable_parameters=trainable,
        frozen_parameters=frozen,
        transformer=shape,
        unknown_activations_reason=reason,
        tensor_parallel_parameters=tensor_parallel_elements(model),
        **_experts(model),
    )


def _experts(model: nn.Module) -> dict[str, Any]:
    """``num_experts`` and ``expert_parameters`` of a mixture-of-experts model (what expert parallelism
    recognises in it: :func:`lockstep.layers.expert_parallel.count_experts`); nothing for another model."""
    from lockstep.layers.expert_parallel import MoEModelNotSupportedError, count_experts, recognised_blocks

    names = recognised_blocks()
    if not any(type(module).__name__ in names for module in model.modules()):
        return {}
    try:
        count = count_experts(model)
    except MoEModelNotSupportedError:  # a recognised block that is not fused: expert parallelism refuses it
        return {}
    return {"num_experts": tuple(count.num_experts.values()), "expert_parameters": count.expert_parameters}


def tensor_parallel_elements(model: nn.Module) -> int:
    """Elements of the parameters a tensor-parallel plan splits, by the model's own plan (transformers' resolved
    ``_tp_plan``, which adds the embeddings and LM head, else ``config.base_model_tp_plan``): every module whose
    name ends with a pattern (``layers.*.mlp.up_proj``) has its weight split, and its bias too when the style
    is column-wise."""
    plan = getattr(model, "_tp_plan", None) or getattr(
        getattr(model, "config", None), "base_model_tp_plan", None
    )
    plan = plan if isinstance(plan, dict) else {}
    total = 0
    for name, module in model.named_modules():
        style = next((style for pattern, style in plan.items() if _ends_with(name, pattern)), None)
        if style is None:
            continue
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        total += weight.numel() if isinstance(weight, torch.Tensor) else 0
        if isinstance(bias, torch.Tensor) and str(style).startswith("colwise"):
            total += bias.numel()
    return total


def _ends_with(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) >= len(atoms) and all(
        fnmatch.fnmatchcase(p, a) for p, a in zip(parts[-len(atoms) :], atoms, strict=True)
    )


def _has_lm_head(model: nn.Module) -> bool:
    """Whether the model ends in vocabulary logits (transformers' ``get_output_embeddings``)."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    try:
        return callable(get_output_embeddings) and get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False


def transformer_shape(config: Any, *, has_lm_head: bool = False) -> tuple[TransformerShape | None, str]:
    """The activation formula's inputs from a transformers config, or None and the reason.

    The vocabulary size is kept only for models with an LM head (whose logits are activations too).
    """
    if config is None or not hasattr(config, "to_dict"):
        return None, "not a transformers model: no formula fits an arbitrary module"
    if getattr(config, "is_encoder_decoder", False):
        return None, "encoder-decoder models are not covered by the formula"
    fields = {
        name: getattr(config, name, None)
        for name in ("num_hidden_layers", "hidden_size", "num_attention_heads")
    }
    missing = [name for name, value in fields.items() if not isinstance(value, int)]
    if missing:
        return None, f"the config has no {', '.join(missing)}"
    hidden = fields["hidden_size"]
    intermediate = next(
        (
            value
            for name in ("intermediate_size", "n_inner", "ffn_dim", "d_ff")
            if isinstance(value := getattr(config, name, None), int)
        ),
        4 * hidden,
    )
    vocab = getattr(config, "vocab_size", None)
    return (
        TransformerShape(
            num_layers=fields["num_hidden_layers"],
            hidden_size=hidden,
            num_heads=fields["num_attention_heads"],
            intermediate_size=intermediate,
            vocab_size=vocab if has_lm_head and isinstance(vocab, int) else None,
        ),
        "",
    )
