"""Tensor parallelism for a peft model (LoRA adapters): the model's own plan, applied to the layers the adapters
wrap and to the adapter matrices with them, in torch's ``parallelize_module`` styles.

For a layer the plan splits column-wise (its outputs: ``q_proj``, ``up_proj``, ...) the adapter's ``lora_B``
(rank -> outputs) is split column-wise with it, and ``lora_A`` (inputs -> rank) stays whole on every process: its
input is the layer's whole input, and the gradient of its output, a partial sum per process, is summed over the
``tp`` processes by the redistribution at ``lora_B``'s input (``DTensor.from_local``'s backward). For a layer the
plan splits row-wise (its inputs: ``o_proj``, ``down_proj``) ``lora_A`` is split row-wise with it (its partial
products summed like the layer's) and ``lora_B`` stays whole. The base layer under each adapter gets the plan's
style itself. The language-model head stays whole on every process (transformers gathers its split outputs
anyway). Only ``colwise`` and ``rowwise`` entries are translated; a plan with any other style is refused by name.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_adapter_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the peft ``model`` in place over ``tp_mesh`` by its base model's own plan (see the module)."""
    base = model.get_base_model()
    plan = dict(getattr(getattr(base, "config", None), "base_model_tp_plan", None) or {})
    if not plan:
        raise ValueError(
            f"ParallelismConfig(tp_size={tp_mesh.size()}) with a peft model of {type(base).__name__}: its config "
            "has no base_model_tp_plan, so lockstep does not know how to split it. Pass "
            "ParallelismConfig(tp_handler=TorchTensorParallelConfig(parallelize_plan=...)) naming the modules."
        )
    unknown = sorted({style for style in plan.values() if style not in _STYLES})
    if unknown:
        raise NotImplementedError(
            f"ParallelismConfig(tp_size={tp_mesh.size()}) with a peft model of {type(base).__name__}: its plan uses "
            f"{unknown}, and lockstep splits adapters along 'colwise' and 'rowwise' layers only (not built yet for "
            "the others). Train the adapters with DDP, FSDP2 or ZeRO instead."
        )
    inner = getattr(base, getattr(base, "base_model_prefix", ""), base)  # LlamaForCausalLM.model
    parallelize_module(inner, tp_mesh, _expanded_plan(inner, plan))


def _expanded_plan(inner: nn.Module, plan: dict[str, str]) -> dict[str, ParallelStyle]:
    """One entry per module to split: a plain layer by its style; an adapted layer's base layer by its style and
    the adapter matrix that splits with it (``lora_B`` column-wise, ``lora_A`` row-wise)."""
    expanded: dict[str, ParallelStyle] = {}
    for name, module in inner.named_modules():
        style = next((s for pattern, s in plan.items() if _matches(name, pattern)), None)
        if style is None:
            continue
        base_layer = getattr(module, "base_layer", None)
        if base_layer is None:
            expanded[name] = _STYLES[style]()
            continue
        expanded[f"{name}.base_layer"] = _STYLES[style]()
        split = module.lora_B if style == "colwise" else module.lora_A
        for adapter in split:
            expanded[f"{name}.{'lora_B' if style == 'colwise' else 'lora_A'}.{adapter}"] = _STYLES[style]()
    return expanded


def _matches(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(
        fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms, strict=True)
    )
