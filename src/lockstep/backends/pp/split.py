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
from collections.abc import Sequence
from typing import Any

from torch import nn

_LISTED = 30


def _module_listing(model: nn.Module) -> str:
    modules = [(name, module) for name, module in model.named_modules() if name]
    listed = ", ".join(f"{name} ({type(module).__name__})" for name, module in modules[:_LISTED])
    more = f", ... ({len(modules) - _LISTED} more)" if len(modules) > _LISTED else ""
    return f"{listed}{more}"


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The name and children of the model's longest list of same-class blocks (ties: the largest)."""
    best: tuple[int, int, str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
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
        raise ValueError(
            f"TorchPipelineParallelConfig(split_points='auto') found no list of repeated blocks in "
            f"{type(model).__name__} to cut into stages. Name the modules where a stage begins: "
            f"split_points=[...]. Its modules are: {_module_listing(model)}."
        )
    return best[2], best[3]


def _auto_split_points(model: nn.Module, num_stages: int) -> list[str]:
    name, blocks = repeated_blocks(model)
    if num_stages > len(blocks):
        raise ValueError(
            f"Cannot cut {type(model).__name__} into {num_stages} pipeline stages: its repeated blocks "
            f"({name}) number {len(blocks)}. Use fewer stages (pp_size x stages_per_rank) or name the split points."
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


def resolve_split_points(model: nn.Module, split_points: Sequence[str] | str, num_stages: int) -> list[str]:
    """The module names where stages 1..n-1 begin, checked against ``model``."""
    if split_points == "auto":
        return _auto_split_points(model, num_stages) if num_stages > 1 else []
    points = list(split_points)
    names = {name for name, _ in model.named_modules() if name}
    for point in points:
        if point not in names:
            raise ValueError(
                f"TorchPipelineParallelConfig(split_points={points!r}) names {point!r}, which is no module of "
                f"{type(model).__name__}. Its modules are: {_module_listing(model)}."
            )
    if len(points) + 1 != num_stages:
        raise ValueError(
            f"TorchPipelineParallelConfig(split_points={points!r}) cuts the model into {len(points) + 1} stages, "
            f"but the layout needs {num_stages} (pp_size x stages_per_rank). Give {num_stages - 1} split points."
        )
    return points


def trace_stages(
    model: nn.Module, example_microbatch: tuple[Any, ...], split_points: list[str]
) -> list[nn.Module]:
    """Every stage module of ``model`` cut at ``split_points``, traced once on ``example_microbatch``."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    with warnings.catch_warnings():
        # torch's own tracer still uses a deprecated pytree spelling (torch 2.13)
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        pipe = pipeline(
            model, mb_args=example_microbatch, split_spec=dict.fromkeys(split_points, SplitPoint.BEGINNING)
        )
    if pipe.num_stages != len(split_points) + 1:
        raise ValueError(
            f"Tracing {type(model).__name__} cut it into {pipe.num_stages} stages, not {len(split_points) + 1}: "
            f"a split point in {split_points} is not called in the forward pass (or called twice)."
        )
    return [pipe.get_stage_module(index) for index in range(pipe.num_stages)]


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
