"""``accelerate.inference``: ``prepare_pippy``, pipelined inference on ``torch.distributed.pipelining``.

The model is cut into one stage per process (rank ``i`` runs stage ``i``) and every call runs torch's GPipe
schedule forward only: the batch is cut into ``num_chunks`` micro-batches that flow through the stages, so
all processes work at once on different micro-batches. The pieces are the pipeline-parallel training
backend's (:mod:`lockstep.backends.pp`): the same split points (``"auto"``: the longest list of repeated
blocks, cut evenly by parameter count), the same tracer and the same :class:`PipelinedModel` evaluation.

Example (on 2 processes, ``lockstep launch --num_processes 2 script.py``)::

    >>> model = prepare_pippy(model, example_args=(torch.zeros(8, 16),))  # doctest: +SKIP
    >>> with torch.no_grad():  # doctest: +SKIP
    ...     outputs = model(batch)  # the outputs on the last process, None on the others
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.backends.pp.model import PipelinedModel, mode_dependent_modules, pad_batch
from lockstep.backends.pp.split import first_microbatch, resolve_split_points, trace_stages
from lockstep.state import PartialState

__all__ = ["prepare_pippy"]

_FIRST_RANK = 0  # stage i runs on rank i


def prepare_pippy(
    model: nn.Module,
    split_points: str | Sequence[str] | None = "auto",
    no_split_module_classes: Sequence[str] | None = None,
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    num_chunks: int | None = None,
    gather_output: bool = False,
) -> nn.Module:
    """Split ``model`` over every process for pipelined inference; the model itself, whose calls run the pipeline.

    Needs a process group: launch with ``lockstep launch``/``torchrun`` (or build the ``Accelerator`` first).
    On one process there is nothing to split, and the model is returned as it is (``hf_split_points == []``).

    Args:
        model: the whole model, on every process (each runs its own stage only; the rest stays in memory, as
            in Accelerate).
        split_points: ``"auto"`` (the model's longest list of repeated blocks, cut so each process holds about
            the same number of parameters) or the names of the modules where stages 1, 2, ... begin.
        no_split_module_classes: class names of modules no stage boundary may fall inside: ``"auto"`` only
            cuts lists of blocks outside such modules, and an explicit split point inside one is an error.
        example_args: positional inputs, one batch as the model is called with: the model is traced once on
            its first micro-batch. The batch size is then fixed: smaller batches are padded (the outputs cut
            back), larger ones are an error.
        example_kwargs: keyword inputs, likewise; every call must pass the same names.
        num_chunks: micro-batches per batch (default: the number of processes). A batch that they do not
            divide is padded with copies of its last sample, and the outputs cut back.
        gather_output: also send the outputs to every process (by default only the last process, which runs
            the last stage, returns them; the others return None).

    Calls read the inputs on the first process only (the others may pass the same inputs, or none) and run
    without gradients. The outputs are the traced model's flattened outputs merged along the batch: a
    tensor, or a tuple of tensors (a transformers model returns its ``logits``, not a ``ModelOutput``), as
    with Accelerate. The model gets Accelerate's attributes ``hf_split_points`` (the split points used),
    ``pippy_stage`` (the torch ``ScheduleGPipe``) and ``_original_forward``.

    Example::

        >>> model = prepare_pippy(model, example_kwargs={"input_ids": ids}, gather_output=True)  # doctest: +SKIP
        >>> logits = model(input_ids=ids)  # doctest: +SKIP
    """
    state = PartialState()
    if state.num_processes == 1:
        model.hf_split_points = []
        return model
    world = state.num_processes
    chunks = _checked_chunks(num_chunks, world)
    no_split = _checked_no_split(model, no_split_module_classes)
    if split_points is None or (isinstance(split_points, str) and split_points != "auto"):
        raise ValueError(
            f"prepare_pippy(split_points={split_points!r}) is invalid: pass 'auto' or a list of module names "
            "where stages begin (e.g. ['layers.4'])."
        )
    args, kwargs, batch = _checked_example(model, example_args, example_kwargs)
    fixed = math.ceil(batch / chunks) * chunks
    if fixed != batch:
        args, kwargs = pad_batch((args, kwargs), batch, fixed)
    points = resolve_split_points(
        model,
        split_points,
        world,
        no_split=no_split,
        caller="prepare_pippy",
        stages_from="one per process: the number of processes",
    )
    device = next(model.parameters()).device
    micro_args, micro_kwargs = first_microbatch((args, kwargs), chunks, device)
    modules = trace_stages(model, micro_args, points, micro_kwargs)
    pipelined = _pipelined(model, modules[state.process_index], state, chunks, fixed)
    model._original_forward = model.forward
    model._original_call = model.__call__
    model.pippy_stage = pipelined.schedule
    model.hf_split_points = points
    model.forward = PipelinedForward(model, pipelined, len(args), sorted(kwargs), gather_output=gather_output)
    return model


def _pipelined(
    model: nn.Module, module: nn.Module, state: PartialState, chunks: int, batch_size: int
) -> PipelinedModel:
    """This process's stage, on its device, as a :class:`PipelinedModel` running GPipe over every process."""
    from torch.distributed.pipelining import ScheduleGPipe

    from lockstep.backends.pp.modes import BufferKeepingStage, copy_modes

    group = dist.group.WORLD
    assert group is not None
    rank, world = state.process_index, state.num_processes
    copy_modes(model, [module])
    stage = BufferKeepingStage(module.to(state.device), rank, world, state.device, group=group)
    return PipelinedModel(
        [stage],
        schedule_class=ScheduleGPipe,
        num_microbatches=chunks,
        persistent_keys=list(model.state_dict()),
        group=group,
        last_stage_rank=world - 1,
        training=model.training,
        mode_dependent=mode_dependent_modules(model),
        eval_batch_size=batch_size,
    )


class PipelinedForward:
    """The ``forward`` ``prepare_pippy`` installs: every call is one forward-only run of the pipeline.

    Args:
        model: the user's model (its train/eval mode is checked against the traced one at each call).
        pipelined: this process's stage and schedule.
        num_args: how many positional inputs the model was traced with.
        kwarg_names: the keyword inputs it was traced with.
        gather_output: return the outputs on every process (else on the last only).
    """

    def __init__(
        self,
        model: nn.Module,
        pipelined: PipelinedModel,
        num_args: int,
        kwarg_names: list[str],
        *,
        gather_output: bool,
    ) -> None:
        self._model = model
        self.pipelined = pipelined
        self._num_args = num_args
        self._kwarg_names = kwarg_names
        self.gather_output = gather_output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first = self.pipelined.holds_first_stage
        size = self._shared_batch_size(args, kwargs)
        fixed = self.pipelined.eval_batch_size
        if size > fixed:
            raise ValueError(
                f"The pipelined model got a batch of {size} samples, but prepare_pippy traced it on batches of "
                f"{fixed} (example inputs padded to a multiple of num_chunks): the stages exchange micro-batches "
                "of that fixed shape. Smaller batches are padded; split larger ones, or call prepare_pippy "
                "with an example batch as large as the largest."
            )
        self.pipelined.train(self._model.training)
        if first:
            args, kwargs = _to_device((args, kwargs), self.pipelined.stage_device)
        return self.pipelined.eval_step(
            args if first else (),
            kwargs if first else {},
            batch_size=size,
            outputs_everywhere=self.gather_output,
        )

    def _shared_batch_size(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """The batch size the first process reads from its inputs, on every process; a problem with the
        inputs is raised on every process alike (rather than leaving the others waiting)."""
        found: list[Any] = [None]
        if self.pipelined.holds_first_stage:
            found[0] = self._batch_size_or_problem(args, kwargs)
        dist.broadcast_object_list(found, group=self.pipelined.group, group_src=_FIRST_RANK)
        if isinstance(found[0], str):
            raise ValueError(found[0])
        return found[0]

    def _batch_size_or_problem(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str:
        if len(args) != self._num_args or sorted(kwargs) != self._kwarg_names:
            return (
                f"The pipelined model got {len(args)} positional inputs and the keyword inputs "
                f"{sorted(kwargs)}, but prepare_pippy traced it with {self._num_args} and {self._kwarg_names}: "
                "the first stage takes exactly the inputs it was traced with. Call it like the example."
            )
        size = _batch_size((args, kwargs))
        if size is None:
            return "The pipelined model got no input tensor with a batch dimension: pass the model's inputs."
        return size


def _checked_chunks(num_chunks: int | None, world: int) -> int:
    if num_chunks is None:
        return world
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(
            f"prepare_pippy(num_chunks={num_chunks!r}) is invalid: it is the number of micro-batches each "
            f"batch is cut into, an int >= 1. Leave it out for one per process ({world})."
        )
    return num_chunks


def _checked_no_split(model: nn.Module, classes: Sequence[str] | None) -> frozenset[str]:
    if classes is None:
        return frozenset()
    if isinstance(classes, str) or not all(isinstance(name, str) for name in classes):
        raise TypeError(
            f"prepare_pippy(no_split_module_classes={classes!r}) must be a list of class names, e.g. "
            "['LlamaDecoderLayer']."
        )
    present = {type(module).__name__ for module in model.modules()}
    absent = sorted(set(classes) - present)
    if absent:
        warnings.warn(
            f"prepare_pippy(no_split_module_classes=...) names {absent}, which no module of "
            f"{type(model).__name__} is; they are ignored. Its classes are: {sorted(present)}.",
            UserWarning,
            stacklevel=3,
        )
    return frozenset(classes)


def _checked_example(
    model: nn.Module, example_args: Any, example_kwargs: dict[str, Any] | None
) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """The example inputs as a tuple and a dict, and their batch size."""
    if not isinstance(example_args, tuple | list):
        raise TypeError(
            f"prepare_pippy(example_args=...) must be a tuple of the model's positional inputs, got a "
            f"{type(example_args).__name__}. Wrap a single input: example_args=(inputs,)."
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(
            f"prepare_pippy(example_kwargs=...) must be a dict of the model's keyword inputs, got a "
            f"{type(example_kwargs).__name__}."
        )
    args, kwargs = tuple(example_args), dict(example_kwargs or {})
    size = _batch_size((args, kwargs))
    if size is None:
        raise ValueError(
            f"prepare_pippy traces {type(model).__name__} once to cut it into stages, and needs example inputs: "
            "pass example_args=(inputs,) or example_kwargs={'input_ids': ids}, one batch shaped like the "
            "batches the model will be called with (their first dimension is the batch)."
        )
    return args, kwargs, size


def _batch_size(values: Any) -> int | None:
    """The first dimension of the first tensor with one in ``values`` (any nesting)."""
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(values):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    return None


def _to_device(values: Any, device: torch.device) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda value: value.to(device) if isinstance(value, torch.Tensor) else value, values)
