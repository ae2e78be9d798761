"""Cutting a model into pipeline stages: where (split points), how (torch's tracer), and which rank holds which.

Split points are module names where a stage begins. ``"auto"`` picks the model's longest list of repeated
blocks (``nn.ModuleList``/``nn.Sequential`` children of one class, e.g. a decoder's layers) and cuts it so
that each stage holds about the same number of parameters (the parameters before the blocks count for the
first stage, those after for the last). The model is then traced once with an example micro-batch by
``torch.distributed.pipelining.pipeline`` and cut at those modules; each stage is a ``GraphModule`` whose
parameters are the model's own ``Parameter`` objects under their original names.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    >>> resolve_split_points(model, "auto", 2)
    ['2']
    >>> resolve_split_points(model, ["5"], 2)
    Traceback (most recent call last):
    ValueError: TorchPipelineParallelConfig(split_points=['5']) names '5', which is no module of Sequential. Its modules are: 0 (Linear), 1 (Linear), 2 (Linear), 3 (Linear).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from lockstep.backends.pp.transformers_models import check_shared_parameters, tracing_options

_LISTED = 30
_CONFIG = "TorchPipelineParallelConfig"


def _module_listing(model: nn.Module) -> str:
    modules = [(name, module) for name, module in model.named_modules() if name]
    listed = ", ".join(f"{name} ({type(module).__name__})" for name, module in modules[:_LISTED])
    more = f", ... ({len(modules) - _LISTED} more)" if len(modules) > _LISTED else ""
    return f"{listed}{more}"


def repeated_blocks(
    model: nn.Module, *, no_split: Collection[str] = (), caller: str = _CONFIG
) -> tuple[str, list[nn.Module]]:
    """The name and children of the model's longest list of same-class blocks (ties: the largest).

    Lists that lie inside a module whose class name is in ``no_split`` are skipped (cutting between their
    items would cut that module), so with ``no_split=["DecoderLayer"]`` a list of experts inside each
    layer is never chosen over the list of layers.
    """
    best: tuple[int, int, str, list[nn.Module]] | None = None
    protected: list[str] = []  # names of modules of a no-split class, outermost first
    for name, module in model.named_modules():
        if _inside(name, protected):
            continue
        if type(module).__name__ in no_split:
            protected.append(name)
            continue
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 2:
            continue
        children = list(module.children())
        if len({type(child) for child in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        key = (len(children), size)
        if best is None or key > best[:2]:
            best = (len(children), size, name, children)
    if best is None:
        kept = f" outside modules of the classes {sorted(no_split)}" if no_split else ""
        raise ValueError(
            f"{caller}(split_points='auto') found no list of repeated blocks{kept} in "
            f"{type(model).__name__} to cut into stages. Name the modules where a stage begins: "
            f"split_points=[...]. Its modules are: {_module_listing(model)}."
        )
    return best[2], best[3]


def _inside(name: str, prefixes: Sequence[str]) -> bool:
    """Whether the module ``name`` is one of ``prefixes`` or lies below one of them."""
    return any(prefix == "" or name == prefix or name.startswith(f"{prefix}.") for prefix in prefixes)


def _auto_split_points(
    model: nn.Module, num_stages: int, *, no_split: Collection[str], caller: str, stages_from: str
) -> list[str]:
    name, blocks = repeated_blocks(model, no_split=no_split, caller=caller)
    if num_stages > len(blocks):
        raise ValueError(
            f"Cannot cut {type(model).__name__} into {num_stages} pipeline stages: its repeated blocks "
            f"({name}) number {len(blocks)}. Use fewer stages ({stages_from}) or name the split points."
        )
    weights = [sum(p.numel() for p in block.parameters()) for block in blocks]
    block_params = {id(p) for block in blocks for p in block.parameters()}
    total = sum(p.numel() for p in model.parameters())
    before = _parameters_before(model, blocks[0], block_params)
    cumulative, starts = before, []  # cumulative[j]: parameters before block j
    for weight in weights:
        starts.append(cumulative)
        cumulative += weight
    points: list[int] = []
    for k in range(1, num_stages):
        target = k * total / num_stages
        low = points[-1] + 1 if points else 1
        high = len(blocks) - (num_stages - k)  # leave one block for each later stage
        points.append(min(range(low, high + 1), key=lambda j: abs(starts[j] - target)))
    prefix = f"{name}." if name else ""
    return [f"{prefix}{j}" for j in points]


def _parameters_before(model: nn.Module, first_block: nn.Module, block_params: set[int]) -> int:
    """Parameters registered before the first block (embeddings): an approximation of forward order."""
    count = 0
    for module in model.modules():
        if module is first_block:
            break
        count += sum(p.numel() for p in module.parameters(recurse=False) if id(p) not in block_params)
    return count


def resolve_split_points(
    model: nn.Module,
    split_points: Sequence[str] | str,
    num_stages: int,
    *,
    no_split: Collection[str] = (),
    caller: str = _CONFIG,
    stages_from: str = "pp_size x stages_per_rank",
) -> list[str]:
    """The module names where stages 1..n-1 begin, checked against ``model``.

    Args:
        model: the whole model.
        split_points: ``"auto"`` or module names.
        num_stages: how many stages the pipeline needs.
        no_split: class names of modules no stage boundary may fall inside.
        caller: the API the split points were given to, for the error messages.
        stages_from: what sets the number of stages, for the error messages.
    """
    if split_points == "auto":
        if num_stages == 1:
            return []
        return _auto_split_points(
            model, num_stages, no_split=no_split, caller=caller, stages_from=stages_from
        )
    points = list(split_points)
    names = {name for name, _ in model.named_modules() if name}
    for point in points:
        if point not in names:
            raise ValueError(
                f"{caller}(split_points={points!r}) names {point!r}, which is no module of "
                f"{type(model).__name__}. Its modules are: {_module_listing(model)}."
            )
    _check_not_inside(model, points, no_split, caller)
    if len(points) + 1 != num_stages:
        raise ValueError(
            f"{caller}(split_points={points!r}) cuts the model into {len(points) + 1} stages, "
            f"but the layout needs {num_stages} ({stages_from}). Give {num_stages - 1} split points."
        )
    return points


def _check_not_inside(model: nn.Module, points: list[str], no_split: Collection[str], caller: str) -> None:
    """A split point strictly inside a module of a ``no_split`` class is an error naming that module."""
    protected = [name for name, module in model.named_modules() if type(module).__name__ in no_split]
    for point in points:
        for name in protected:
            if point != name and _inside(point, [name]):
                kind = type(model.get_submodule(name)).__name__
                raise ValueError(
                    f"{caller}(split_points={points!r}) cuts inside {name!r} ({kind}) at {point!r}, but "
                    f"no_split_module_classes={sorted(no_split)} keeps {kind} modules whole. Split at "
                    f"{name!r} or at another module outside it."
                )


def trace_stages(
    model: nn.Module,
    example_microbatch: tuple[Any, ...],
    split_points: list[str],
    example_kwargs: dict[str, Any] | None = None,
) -> list[nn.Module]:
    """Every stage module of ``model`` cut at ``split_points``, traced once on ``example_microbatch``
    (positional inputs) and ``example_kwargs`` (keyword inputs, the first stage then takes them by name);
    a transformers model as :mod:`.transformers_models` says."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    with warnings.catch_warnings(), tracing_options(model):
        # torch's own tracer still uses a deprecated pytree spelling (torch 2.13)
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        pipe = pipeline(
            model,
            mb_args=example_microbatch,
            mb_kwargs=example_kwargs or None,
            split_spec=dict.fromkeys(split_points, SplitPoint.BEGINNING),
        )
    if pipe.num_stages != len(split_points) + 1:
        raise ValueError(
            f"Tracing {type(model).__name__} cut it into {pipe.num_stages} stages, not {len(split_points) + 1}: "
            f"a split point in {split_points} is not called in the forward pass (or called twice)."
        )
    modules = [pipe.get_stage_module(index) for index in range(pipe.num_stages)]
    check_shared_parameters(model, modules, split_points)
    return modules


def first_microbatch(values: Any, microbatches: int, device: torch.device) -> Any:
    """The first of ``microbatches`` equal slices of every batch tensor in ``values`` (any nesting), on
    ``device``: what the tracer runs the model on. Tensors without a batch dimension pass whole."""
    from torch.utils._pytree import tree_map

    def first(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() > 0:
            value = value[: value.shape[0] // microbatches]
        return value.to(device)

    return tree_map(first, values)


def stage_indices(pp_rank: int, pp_size: int, stages_per_rank: int, layout: str) -> list[int]:
    """The stages rank ``pp_rank`` holds: ``"loop"`` (``s % pp_size == pp_rank``) or ``"v"`` (rank r holds r and
    2p-1-r, for two stages per rank), as torch's schedules place them.

    Example:
        >>> stage_indices(0, 2, 2, "loop"), stage_indices(0, 2, 2, "v")
        ([0, 2], [0, 3])
    """
    if layout == "v":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + pp_size * k for k in range(stages_per_rank)]
