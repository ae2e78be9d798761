"""Tensor parallelism: turning a plan into torch's ``parallelize_module`` call on the ``tp`` mesh.

A plan maps module-name patterns (``*`` matches one name part, as in ``parallelize_module``) to a style:
``"colwise"`` (``ColwiseParallel``), ``"rowwise"`` (``RowwiseParallel``), ``"sequence_parallel"``
(``SequenceParallel``) or any torch ``ParallelStyle``. It comes from ``TorchTensorParallelConfig.parallelize_plan``;
a model transformers already sharded (``from_pretrained(tp_plan="auto", device_mesh=...)``) is taken as it is.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    >>> check_plan(model, {"0": "colwise", "5": "rowwise"})
    Traceback (most recent call last):
    ValueError: TorchTensorParallelConfig(parallelize_plan=...) names '5', which matches no module of Sequential. Its modules are: 0 (Linear), 1 (ReLU), 2 (Linear).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence_parallel": SequenceParallel}
_LISTED = 30


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``model`` was sharded already (a parameter is a DTensor on a mesh with a ``tp`` dimension,
    as transformers' ``from_pretrained(tp_plan="auto", device_mesh=...)`` leaves it)."""
    return any(
        isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in model.parameters()
    )


def _matches(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(
        fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms, strict=True)
    )


def check_plan(model: nn.Module, plan: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` listing the model's modules when a pattern of ``plan`` matches none."""
    names = [name for name, _ in model.named_modules() if name]
    for pattern in plan:
        if not any(_matches(name, pattern) for name in names):
            modules = dict(model.named_modules())
            listed = ", ".join(f"{n} ({type(modules[n]).__name__})" for n in names[:_LISTED])
            more = f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else ""
            raise ValueError(
                f"TorchTensorParallelConfig(parallelize_plan=...) names {pattern!r}, which matches no module of "
                f"{type(model).__name__}. Its modules are: {listed}{more}."
            )


def check_heads(model: nn.Module, tp_size: int) -> None:
    """A transformers model's attention heads (and key/value heads) must split evenly over ``tp_size``."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, field, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ValueError(
                f"tp_size={tp_size} does not divide {type(model).__name__}'s {field}={heads}: tensor parallelism "
                f"gives each process whole attention heads. Choose a tp_size that divides {heads}."
            )


def _style(value: Any) -> ParallelStyle:
    return _STYLES[value]() if isinstance(value, str) else value


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, Any] | None) -> None:
    """Shard ``model`` in place over ``tp_mesh`` with ``plan`` (a model sharded already is left alone)."""
    if _adapters_split_by_lockstep(model, tp_mesh, plan):
        return
    if is_tensor_parallel(model):
        if plan:
            raise ValueError(
                f"{type(model).__name__} is sharded over a tp mesh already (loaded with tp_plan='auto'), and "
                "TorchTensorParallelConfig sets a parallelize_plan too. Drop one of them."
            )
        return
    if not plan and getattr(model, "tp_plan", None):
        _apply_model_plan(model, tp_mesh)
        return
    if not plan:
        raise ValueError(
            f"ParallelismConfig(tp_size={tp_mesh.size()}) needs a tensor-parallel plan for "
            f"{type(model).__name__}: pass ParallelismConfig(tp_handler=TorchTensorParallelConfig("
            "parallelize_plan={'layers.*.up': 'colwise', 'layers.*.down': 'rowwise', ...})), or load a "
            "transformers model with from_pretrained(..., tp_plan='auto', device_mesh=accelerator.torch_device_mesh['tp'])."
        )
    check_plan(model, plan)
    check_heads(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, {pattern: _style(style) for pattern, style in plan.items()})


def _adapters_split_by_lockstep(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, Any] | None
) -> bool:
    """A peft model (LoRA adapters) without a plan of the user's: split with its adapters by lockstep
    (``adapter_tensor_parallel``); True when done. One transformers split before the adapters were added
    (``from_pretrained(tp_plan="auto")`` then ``get_peft_model``) is refused: trained that way on 2 processes the
    adapters ended elsewhere than one process's (sum of |adapter| 54.54 against 52.69 after 4 AdamW steps)."""
    from lockstep.integrations.peft import is_peft_model

    if not is_peft_model(model) or plan:
        return False
    if is_tensor_parallel(model):
        raise NotImplementedError(
            f"ParallelismConfig(tp_size={tp_mesh.size()}): this peft model's base was split over the tp mesh "
            "(e.g. by from_pretrained(tp_plan='auto')) before get_peft_model added the adapters, which does not "
            "train like one process. Load the base whole, apply get_peft_model, and let accelerator.prepare() "
            "split the base and its adapters together."
        )
    from lockstep.backends.nd.adapter_tensor_parallel import apply_adapter_tensor_parallel

    check_heads(model, tp_mesh.size())
    apply_adapter_tensor_parallel(model, tp_mesh)
    return True


def _apply_model_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard a transformers model with its own plan (``base_model_tp_plan``), as ``from_pretrained(tp_plan=
    "auto")`` does: transformers resolves the plan for ``tp_size`` and installs its DTensor layers."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    check_heads(model, tp_mesh.size())
    tp_plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp_mesh.size()))  # type: ignore[operator]
    apply_tensor_parallelism(model, tp_mesh, tp_plan)
