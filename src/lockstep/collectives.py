"""Collectives on nested structures: gather, gather_object, broadcast, reduce, pad_across_processes.

Every function accepts a tensor or a nested list / tuple / namedtuple / dict of tensors and keeps the
structure. With one process they do no communication: ``gather`` and ``gather_object`` return their
input unchanged, ``broadcast`` returns it as is, ``reduce`` returns a (scaled) copy.

``gather``, ``gather_object``, ``reduce`` and ``gather_for_metrics`` take an optional ``group`` (a torch
``ProcessGroup``): they then run among its processes only. The Accelerator passes its data-parallel group
when processes of one model replica (tensor parallelism) hold the same samples, so that each sample is
counted once.

Tensors travel on the device the process group's backend needs (CPU for gloo, the current GPU for nccl)
and come back on the device they were on.

In debug mode (``LOCKSTEP_DEBUG=1`` or ``PartialState(debug=True)``) every rank first tells the others
which operation it is about to run and the shapes and dtypes of its tensors; when they disagree, every
rank raises :class:`DistributedOperationException` naming each rank's shapes, instead of hanging or failing
deep inside torch. Outside debug mode this check costs nothing.

Example:
    >>> import torch
    >>> gather({"logits": torch.ones(2, 3)})["logits"].shape  # one process: unchanged
    torch.Size([2, 3])
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lockstep._nested import leaves, recursively_apply, slice_batch
from lockstep.errors import CannotPadNestedTensorWarning, DistributedOperationException
from lockstep.state import PartialState

REDUCTIONS = ("sum", "mean", "max", "min", "none")
"""The ``reduction`` values :func:`reduce` accepts: Accelerate's four, ``"min"``, and lockstep's ``"none"``."""

# The all_reduce op behind each reduction that communicates ("mean" is a sum divided afterwards).
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}

# Device types each backend can run collectives on; anything else is moved to the backend's own device.
_BACKEND_DEVICES = {"gloo": {"cpu", "cuda"}, "nccl": {"cuda"}, "xccl": {"xpu"}, "mpi": {"cpu"}}
_BACKEND_HOME = {"gloo": "cpu", "mpi": "cpu", "nccl": "cuda", "xccl": "xpu"}


# -- topology --------------------------------------------------------------------------------------
def _state() -> PartialState:
    return PartialState()


def _where(state: PartialState) -> str:
    return f"rank {state.process_index} of world size {state.num_processes}"


def _group_size(state: PartialState, group: dist.ProcessGroup | None) -> int:
    """How many processes a collective over ``group`` (None: every process) runs among."""
    if group is None or state.num_processes <= 1:
        return state.num_processes
    return dist.get_world_size(group)


def _check_source(op: str, from_process: int, state: PartialState) -> None:
    if not 0 <= from_process < state.num_processes:
        raise ValueError(
            f"{op}(from_process={from_process}) on {_where(state)} is invalid: it must be a rank between 0 "
            f"and {state.num_processes - 1}."
        )


# -- devices ---------------------------------------------------------------------------------------
def _backend_devices() -> dict[str, str]:
    """Map device type -> backend name for the default group (``cpu:gloo,cuda:nccl`` style included)."""
    backend = str(dist.get_backend())
    if ":" in backend:
        return dict(pair.split(":", 1) for pair in backend.split(","))
    return {device: backend for device in _BACKEND_DEVICES.get(backend, ())} or {"*": backend}


def _comm_device(device: torch.device) -> torch.device:
    """The device a tensor that lives on ``device`` must be on for the default group's backend."""
    supported = _backend_devices()
    if device.type in supported or "*" in supported:
        return device
    home = _BACKEND_HOME.get(next(iter(supported.values())), "cpu")
    if home == "cpu":
        return torch.device("cpu")
    return torch.device(home, getattr(torch, home).current_device())


def _to_comm(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(_comm_device(tensor.device)).contiguous()


# -- debug-mode verification -----------------------------------------------------------------------
def _describe(data: Any) -> tuple[list[tuple[int, ...]], list[str]]:
    # Nested tensors have no fixed shape (reading it raises); pad_across_processes leaves them alone.
    tensors = [t for t in leaves(data) if not t.is_nested]
    return [tuple(t.shape) for t in tensors], [str(t.dtype) for t in tensors]


def _per_rank(values: Sequence[Any]) -> str:
    return ", ".join(f"rank {rank} has {value}" for rank, value in enumerate(values))


def _mismatch(
    op: str, reports: list[tuple[str, list[tuple[int, ...]], list[str]]], *, same_shapes: bool
) -> str | None:
    """Why the ranks' reports disagree, or None when they agree."""
    ops = [report[0] for report in reports]
    if len(set(ops)) > 1:
        called = ", ".join(f"rank {rank} called {name}" for rank, name in enumerate(ops))
        return f"{op}: ranks called different collectives: {called}"
    shapes = [report[1] for report in reports]
    ndims = [[len(shape) for shape in rank_shapes] for rank_shapes in shapes]
    if (same_shapes and any(s != shapes[0] for s in shapes)) or any(n != ndims[0] for n in ndims):
        return f"{op}: shapes differ across ranks (world size {len(reports)}): {_per_rank(shapes)}"
    dtypes = [report[2] for report in reports]
    if any(d != dtypes[0] for d in dtypes):
        return f"{op}: dtypes differ across ranks (world size {len(reports)}): {_per_rank(dtypes)}"
    return None


def _verify(
    op: str,
    data: Any,
    state: PartialState,
    *,
    same_shapes: bool = True,
    group: dist.ProcessGroup | None = None,
) -> None:
    """In debug mode, make sure every rank runs ``op`` on tensors of the same shapes and dtypes.

    Args:
        op: the public name of the collective.
        data: this rank's (nested) tensors; None for object collectives.
        state: the process state.
        same_shapes: compare full shapes; when False only the number of tensors and of dimensions.
        group: the processes ``op`` runs among (None: every process).
    """
    if not state.debug:
        return
    reports: list[Any] = [None] * _group_size(state, group)
    dist.all_gather_object(reports, (op, *_describe(data)), group=group)
    problem = _mismatch(op, reports, same_shapes=same_shapes)
    if problem is not None:
        raise DistributedOperationException(
            f"{problem}. Raised on {_where(state)}. Every rank must run the same collectives in the same "
            "order on tensors of the same shapes and dtypes (pad_across_processes() evens out dim 0)."
        )


def _require_tensors(op: str, data: Any, state: PartialState) -> None:
    def check(leaf: Any) -> None:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{op}() on {_where(state)} got a {type(leaf).__name__} inside its input; only tensors "
                "nested in lists, tuples and dicts are supported. Use gather_object() for other objects."
            )

    recursively_apply(check, data, test_type=lambda _: True)


def _prepare(op: str, data: Any, *, same_shapes: bool = True, group: dist.ProcessGroup | None = None) -> int:
    """How many processes ``op`` runs among (after validating ``data``); 1 means no communication."""
    state = _state()
    size = _group_size(state, group)
    if size <= 1:
        return 1
    _require_tensors(op, data, state)
    _verify(op, data, state, same_shapes=same_shapes, group=group)
    return size


# -- gather ----------------------------------------------------------------------------------------
def _gather_one(
    tensor: torch.Tensor, world_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    local = _to_comm(tensor if tensor.dim() > 0 else tensor[None])
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=0).to(tensor.device)


def gather(tensor: Any, *, group: dist.ProcessGroup | None = None) -> Any:
    """Gather tensors from every process and concatenate them along dim 0, in rank order.

    0-dim tensors become 1-D (one value per process). Every rank must pass tensors of the same shapes;
    use :func:`pad_across_processes` first when dim 0 differs.

    Args:
        tensor: a tensor or a nested list / tuple / dict of tensors.
        group: gather among this process group's processes only (None: every process).

    Returns:
        The same structure with every tensor replaced by the concatenation over processes. With one
        process the input itself.

    Example:
        >>> import torch
        >>> gather(torch.tensor([1, 2]))  # on 2 processes rank 1 passing [3, 4] gives tensor([1, 2, 3, 4])
        tensor([1, 2])
    """
    size = _prepare("gather", tensor, group=group)
    if size <= 1:
        return tensor
    return recursively_apply(_gather_one, tensor, size, group)


def gather_object(object: Any, *, group: dist.ProcessGroup | None = None) -> Any:
    """Gather a list of picklable objects from every process and flatten the lists in rank order.

    Args:
        object: a list (or tuple) of picklable objects.
        group: gather among this process group's processes only (None: every process).

    Returns:
        One list holding every process's items, rank 0's first. With one process the input itself.

    Raises:
        TypeError: with more than one process, when ``object`` is not a list or tuple.

    Example:
        >>> gather_object(["a", "b"])  # on 2 processes rank 1 passing ["c"] gives ['a', 'b', 'c']
        ['a', 'b']
    """
    state = _state()
    size = _group_size(state, group)
    if size <= 1:
        return object
    if not isinstance(object, (list, tuple)):
        raise TypeError(
            f"gather_object() on {_where(state)} needs a list or tuple of objects, got a "
            f"{type(object).__name__}; wrap a single object in a list: gather_object([obj])."
        )
    _verify("gather_object", None, state, group=group)
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, object, group=group)
    return [item for rank_items in gathered for item in rank_items]


# -- broadcast -------------------------------------------------------------------------------------
def _broadcast_one(tensor: torch.Tensor, src: int) -> torch.Tensor:
    buffer = _to_comm(tensor)
    dist.broadcast(buffer, src=src)
    if buffer is not tensor:  # a moved or made-contiguous copy: write the result back in place
        tensor.copy_(buffer)
    return tensor


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copy the tensors of process ``from_process`` into every other process's tensors, in place.

    Args:
        tensor: a tensor or a nested structure of tensors, of the same shapes on every process.
        from_process: the rank whose values everybody receives.

    Returns:
        ``tensor`` itself, now holding ``from_process``'s values.

    Example:
        >>> import torch
        >>> broadcast(torch.zeros(2), from_process=0)  # every rank now holds rank 0's values
        tensor([0., 0.])
    """
    state = _state()
    if state.num_processes > 1:
        _check_source("broadcast", from_process, state)
    if _prepare("broadcast", tensor) <= 1:
        return tensor
    return recursively_apply(_broadcast_one, tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of ``object_list`` with those of process ``from_process``, in place.

    Args:
        object_list: a list of picklable objects, of the same length on every process.
        from_process: the rank whose objects everybody receives.

    Returns:
        ``object_list`` itself.

    Example:
        >>> broadcast_object_list([{"seed": 1234}])  # every rank now holds rank 0's dict
        [{'seed': 1234}]
    """
    state = _state()
    if state.num_processes <= 1:
        return object_list
    _check_source("broadcast_object_list", from_process, state)
    _verify("broadcast_object_list", None, state)
    dist.broadcast_object_list(object_list, src=from_process)
    return object_list


# -- reduce ----------------------------------------------------------------------------------------
def _reduce_one(
    tensor: torch.Tensor,
    reduction: str,
    scale: float,
    world_size: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``world_size`` is 1 when nothing is to be communicated (one process, or ``"none"``)."""
    result = tensor.clone()
    if world_size > 1:
        buffer = _to_comm(result)
        dist.all_reduce(buffer, op=_REDUCE_OPS[reduction], group=group)
        result = buffer.to(tensor.device)
        if reduction == "mean":
            result = result / world_size
    return result * scale if scale != 1.0 else result


def reduce(
    tensor: Any, reduction: str = "mean", scale: float = 1.0, *, group: dist.ProcessGroup | None = None
) -> Any:
    """Reduce tensors across processes; every process gets the result.

    ``"sum"``, ``"mean"`` and ``"max"`` are Accelerate's; ``"min"`` is the element-wise minimum
    (Accelerate documents no ``"min"`` and sums instead). ``reduction="none"`` differs from Accelerate on
    purpose: Accelerate's ``"none"`` silently sums across processes, ours does no communication and
    returns this process's own values (times ``scale``). An unknown ``reduction`` is an error (Accelerate
    sums). ``scale`` multiplies the result of every reduction (Accelerate applies it on XLA only). A
    ``"mean"`` of integer tensors is returned as floating point; ``"max"`` and ``"min"`` keep the dtype.

    Args:
        tensor: a tensor or a nested structure of tensors, of the same shapes on every process.
        reduction: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` (element-wise across processes) or
            ``"none"``.
        scale: a factor applied after the reduction.
        group: reduce among this process group's processes only (None: every process).

    Returns:
        New tensors in the same structure (the input is not modified).

    Raises:
        ValueError: for an unknown ``reduction``.

    Example:
        >>> import torch
        >>> reduce(torch.tensor([2.0]), reduction="sum")  # on 2 processes with [2.] and [4.]: tensor([6.])
        tensor([2.])
        >>> reduce(torch.tensor([2.0, 5.0]), reduction="max")  # with [4., 1.] on rank 1: tensor([4., 5.])
        tensor([2., 5.])
    """
    state = _state()
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduce(reduction={reduction!r}) on {_where(state)} is invalid: it is not a known reduction. "
            f"Choose one of {', '.join(map(repr, REDUCTIONS))}."
        )
    _require_tensors("reduce", tensor, state)
    world_size = 1 if reduction == "none" else _group_size(state, group)
    if world_size > 1:
        _verify("reduce", tensor, state, group=group)
    return recursively_apply(_reduce_one, tensor, reduction, scale, world_size, group)


# -- padding ---------------------------------------------------------------------------------------
def _pad_one(tensor: torch.Tensor, dim: int, size: int, pad_index: int, pad_first: bool) -> torch.Tensor:
    old = tensor.shape[dim]
    if size == old:
        return tensor
    new_shape = list(tensor.shape)
    new_shape[dim] = size
    padded = tensor.new_full(new_shape, pad_index)
    start = size - old if pad_first else 0
    padded.narrow(dim, start, old).copy_(tensor)
    return padded


def _largest_sizes(tensors: list[torch.Tensor], dims: list[int | None], world_size: int) -> list[int]:
    """For each tensor, the largest size in its dim across processes (one all_gather in total)."""
    device = _comm_device(torch.device("cpu"))
    mine = torch.tensor([t.shape[d] if d is not None else 0 for t, d in zip(tensors, dims)], device=device)
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(parts, mine)
    return torch.stack(parts).amax(dim=0).tolist()


def _warn_nested(tensors: list[torch.Tensor]) -> None:
    """Warn once per nested tensor: it has no size in ``dim`` to pad to (Accelerate warns the same)."""
    for tensor in tensors:
        if tensor.is_nested:
            warnings.warn(
                f"pad_across_processes() cannot pad nested tensors without more information: got a nested "
                f"{tensor.dim()}-d {tensor.dtype} tensor (torch.nested), whose components differ in size. "
                "Leaving it unprocessed. To pad it, turn it into a regular tensor first with "
                "tensor.to_padded_tensor(pad_index).",
                CannotPadNestedTensorWarning,
                stacklevel=3,
            )


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad every tensor in dimension ``dim`` to the largest size that dimension has on any process.

    Tensors with fewer than ``dim + 1`` dimensions are returned unchanged, as Accelerate does. So are
    nested tensors (``torch.nested``), with a :class:`~lockstep.errors.CannotPadNestedTensorWarning`, on any
    number of processes, as Accelerate does.

    Args:
        tensor: a tensor or a nested structure of tensors.
        dim: the dimension to pad (negative values count from the end).
        pad_index: the value of the padding.
        pad_first: pad at the start instead of the end (e.g. for left-padded generations).

    Returns:
        The same structure with padded tensors (tensors already at the largest size are returned as is).

    Warns:
        CannotPadNestedTensorWarning: for each nested tensor in ``tensor``.

    Example:
        >>> import torch
        >>> pad_across_processes(torch.ones(2))  # with rank 1 holding 3 values: tensor([1., 1., 0.])
        tensor([1., 1.])
    """
    _warn_nested(leaves(tensor))
    size = _prepare("pad_across_processes", tensor, same_shapes=False)
    if size <= 1:
        return tensor
    tensors = leaves(tensor)
    dims = [None if t.is_nested else _normalize_dim(dim, t.dim()) for t in tensors]
    if not tensors:
        return tensor
    sizes = iter(zip(_largest_sizes(tensors, dims, size), dims))

    def pad(leaf: torch.Tensor) -> torch.Tensor:
        size, leaf_dim = next(sizes)
        return leaf if leaf_dim is None else _pad_one(leaf, leaf_dim, size, pad_index, pad_first)

    return recursively_apply(pad, tensor)


def _normalize_dim(dim: int, ndim: int) -> int | None:
    if dim >= ndim or dim < -ndim:
        return None
    return dim + ndim if dim < 0 else dim


# -- gather_for_metrics support --------------------------------------------------------------------
def gather_for_metrics_truncate(data: Any, remainder: int, *, from_gather_object: bool = False) -> Any:
    """Drop the duplicated samples a distributed sampler added to the last batch after gathering.

    Args:
        data: the result of :func:`gather` (tensors, nested) or of :func:`gather_object` (a flat list).
        remainder: how many real samples the last global batch holds. ``-1`` (unknown) and ``0`` (the
            data set divides evenly) leave ``data`` unchanged, as Accelerate's ``gather_for_metrics`` does.
        from_gather_object: ``data`` is a flat list of samples from :func:`gather_object`; it is cut as a
            list, whatever its items are.

    Returns:
        ``data`` with every tensor (and every list of samples) cut to its first ``remainder`` entries.

    Example:
        >>> import torch
        >>> gather_for_metrics_truncate({"pred": torch.arange(4)}, remainder=3)
        {'pred': tensor([0, 1, 2])}
    """
    if remainder <= 0:
        return data
    if from_gather_object:
        return data[:remainder]
    return slice_batch(data, slice(0, remainder))


def gather_for_metrics(
    input_data: Any,
    gradient_state: Any,
    use_gather_object: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Gather like :func:`gather`, then drop the samples repeated to even out the last batch.

    Args:
        input_data: tensors (nested structures too) or any picklable values of this rank.
        gradient_state: the process's ``GradientState``, which knows whether the prepared loader being
            iterated is at its end and how many real samples its last global batch holds.
        use_gather_object: gather as Python objects even when ``input_data`` holds only tensors.
        group: gather among the processes of this group (the data-parallel replicas) only; DTensor
            values (a vocabulary-sharded logits tensor) are made whole first.
    """
    input_data = recursively_apply(_whole, input_data)
    tensors_only = all(isinstance(x, torch.Tensor) for x in _flat_values(input_data))
    as_objects = use_gather_object or not tensors_only
    if as_objects:
        data = gather_object(input_data if isinstance(input_data, list) else [input_data], group=group)
    else:
        data = gather(input_data, group=group)
    if not gradient_state.end_of_dataloader:
        return data
    return gather_for_metrics_truncate(data, gradient_state.remainder, from_gather_object=as_objects)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (each process of its mesh holds part of it); other tensors unchanged."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _flat_values(data: Any) -> list[Any]:
    if isinstance(data, dict):
        return [v for value in data.values() for v in _flat_values(value)]
    if isinstance(data, (list, tuple)):
        return [v for value in data for v in _flat_values(value)]
    return [data]


__all__ = [
    "REDUCTIONS",
    "CannotPadNestedTensorWarning",
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_for_metrics",
    "gather_for_metrics_truncate",
    "gather_object",
    "pad_across_processes",
    "reduce",
]
