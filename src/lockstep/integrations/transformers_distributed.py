"""Models transformers distributed itself at load time (``from_pretrained(..., distributed_config=...)``).

transformers 5 can shard a model while loading it: ``DistributedConfig(tp_size=..., fsdp_size=...,
dp_replicate_size=..., ep_size=..., pp_size=...)`` applies its own tensor-parallel plan, its own FSDP2
(``fully_shard`` over an ``fsdp`` mesh dimension) and its own expert parallelism, and records the config as
``model.config.distributed_config``. lockstep takes a model split by transformers' tensor-parallel plan alone
(``tp_plan="auto"`` on lockstep's ``tp`` mesh: :mod:`lockstep.backends.nd.tensor_parallel`). A model that
transformers also sharded over data-parallel ranks, over experts or over pipeline stages is refused by
:func:`check_not_sharded_by_transformers` before anything is wrapped: its parameters are already DTensors on
transformers' own mesh, and DDP or lockstep's FSDP2 would fail deep inside torch ("got mixed torch.Tensor and
DTensor") or shard it twice. The message names the :class:`~lockstep.ParallelismConfig` that gives the same
layout when lockstep builds it from the plain model.

This module imports neither torch nor transformers.

Example:
    >>> layout = {"tp_size": 1, "fsdp_size": 2, "dp_replicate_size": 1, "ep_size": 2, "pp_size": 1}
    >>> sizes_beyond_tensor_parallel(layout)
    {'dp_shard_size': 2, 'ep_size': 2}
    >>> parallelism_config_text({"tp_size": 2, "fsdp_size": 2})
    'ParallelismConfig(dp_shard_size=2, tp_size=2)'
"""

from __future__ import annotations

from typing import Any

_LOCKSTEP_NAMES = {  # transformers' DistributedConfig field -> ParallelismConfig field, in its order
    "dp_replicate_size": "dp_replicate_size",
    "fsdp_size": "dp_shard_size",
    "tp_size": "tp_size",
    "ep_size": "ep_size",
    "pp_size": "pp_size",
}


def distributed_config_of(model: Any) -> dict[str, Any] | None:
    """The model's ``config.distributed_config`` as a dict (a ``DistributedConfig``, or a dict read back
    from a saved ``config.json``), or None when it has none."""
    found = getattr(getattr(model, "config", None), "distributed_config", None)
    if found is None:
        return None
    if isinstance(found, dict):
        return dict(found)
    if hasattr(found, "to_dict"):
        return dict(found.to_dict())
    return dict(vars(found))


def _size(layout: dict[str, Any], name: str) -> int:
    value = layout.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def sizes_beyond_tensor_parallel(layout: dict[str, Any]) -> dict[str, int]:
    """The sizes above 1 of ``layout`` (a ``distributed_config`` dict) other than tensor parallelism, under
    ``ParallelismConfig``'s names; empty for a model split by tensor parallelism alone."""
    return {
        ours: _size(layout, theirs)
        for theirs, ours in _LOCKSTEP_NAMES.items()
        if theirs != "tp_size" and _size(layout, theirs) > 1
    }


def parallelism_config_text(layout: dict[str, Any]) -> str:
    """``ParallelismConfig(...)`` with the sizes above 1 of ``layout``, under lockstep's names."""
    sizes = ", ".join(
        f"{ours}={_size(layout, theirs)}"
        for theirs, ours in _LOCKSTEP_NAMES.items()
        if _size(layout, theirs) > 1
    )
    return f"ParallelismConfig({sizes})"


def check_not_sharded_by_transformers(model: Any) -> None:
    """Refuse a model transformers sharded at load time over more than its tensor-parallel plan.

    Raises:
        ValueError: ``model.config.distributed_config`` asks for FSDP, HSDP, expert or pipeline parallelism
            (a size above 1 besides ``tp_size``).
    """
    layout = distributed_config_of(model)
    if layout is None or not sizes_beyond_tensor_parallel(layout):
        return
    name = type(model).__name__
    if name.startswith("FSDP"):  # fully_shard made the class FSDP<name>, a subclass of the model's own
        name = next((c.__name__ for c in type(model).__mro__[1:] if c.__name__ == name[4:]), name)
    given = ", ".join(f"{name}={_size(layout, name)}" for name in _LOCKSTEP_NAMES if _size(layout, name) > 1)
    wanted = parallelism_config_text(layout)
    raise ValueError(
        f"{name} was loaded with from_pretrained(..., distributed_config=DistributedConfig({given})): "
        "transformers sharded it itself (its own FSDP2, expert or pipeline split, on its own device mesh), and "
        "lockstep does not train a model sharded that way. Load the model without distributed_config (one full "
        f"copy per process) and give lockstep the layout: Accelerator(parallelism_config={wanted}), or "
        f"TrainingArguments(parallelism_config={wanted}) for the Trainer. A model split by a tensor-parallel plan "
        "alone (tp_plan='auto', device_mesh=accelerator.torch_device_mesh['tp']) is taken as it is."
    )
