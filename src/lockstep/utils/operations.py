"""``accelerate.utils.operations``: walking, moving, slicing, converting and communicating nested tensors.

Every function takes a tensor or a nested list / tuple / namedtuple / dict of tensors and keeps the
structure. The collectives (``gather``, ``broadcast``, ``reduce``, ``pad_across_processes`` ...) are
:mod:`lockstep.collectives`'s; the walkers are :mod:`lockstep._nested`'s. This module adds the rest of
Accelerate's operations on top of them.

Differences from Accelerate, on purpose:

- :func:`find_batch_size` returns ``None`` when the data holds no tensor (Accelerate raises), and reads
  the first tensor depth first, skipping other values; :func:`ignorant_find_batch_size` is the same.
- :func:`pad_input_tensors` pads to the next multiple of ``num_processes`` (Accelerate's arithmetic can
  miss the multiple, e.g. 6 rows on 4 processes become 9).

Example:
    >>> import torch
    >>> batch = {"x": torch.arange(6).reshape(3, 2), "y": [torch.ones(3, dtype=torch.bfloat16)]}
    >>> listify(slice_tensors(batch, slice(0, 2)))
    {'x': [[0, 1], [2, 3]], 'y': [[1.0, 1.0]]}
    >>> convert_to_fp32(batch)["y"][0].dtype
    torch.float32
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from lockstep._nested import (
    concatenate,
    find_batch_size,
    honor_type,
    is_namedtuple,
    is_torch_tensor,
    recursively_apply,
)
from lockstep._nested import send_to_device as _send_to_device
from lockstep.collectives import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
)
from lockstep.errors import CannotPadNestedTensorWarning, DistributedOperationException
from lockstep.state import PartialState
from lockstep.utils.dataclasses import TensorInformation

__all__ = [
    "CannotPadNestedTensorWarning",
    "ConvertOutputsToFp32",
    "DistributedOperationException",
    "GatheredParameters",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "get_data_structure",
    "get_shape",
    "honor_type",
    "ignorant_find_batch_size",
    "initialize_tensors",
    "is_namedtuple",
    "is_tensor_information",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "pad_input_tensors",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
]


def is_tensor_information(tensor_info: Any) -> bool:
    """Whether ``tensor_info`` is a :class:`~lockstep.utils.dataclasses.TensorInformation`."""
    return isinstance(tensor_info, TensorInformation)


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | Sequence[str] | None = None,
) -> Any:
    """Move every tensor (and every object with a ``.to`` method, such as ``BatchEncoding``) to ``device``.

    Args:
        tensor: a tensor or a nested list / tuple / dict of them.
        device: where to move them.
        non_blocking: ask for an asynchronous copy (effective from pinned memory to a GPU).
        skip_keys: a key, or keys, of dicts whose values stay where they are, at any depth.

    Returns:
        The same structure with the tensors on ``device``.

    Example:
        >>> import torch
        >>> moved = send_to_device({"x": torch.ones(1), "ids": torch.ones(1)}, "meta", skip_keys="ids")
        >>> moved["x"].device, moved["ids"].device
        (device(type='meta'), device(type='cpu'))
    """
    if skip_keys is None:
        return _send_to_device(tensor, device, non_blocking=non_blocking)
    skipped = {skip_keys} if isinstance(skip_keys, str) else set(skip_keys)
    if isinstance(tensor, (tuple, list)):
        return honor_type(tensor, (send_to_device(t, device, non_blocking, skip_keys) for t in tensor))
    if isinstance(tensor, Mapping):
        moved = {
            k: v if k in skipped else send_to_device(v, device, non_blocking, skip_keys)
            for k, v in tensor.items()
        }
        try:
            return type(tensor)(moved)
        except TypeError:  # mapping types without a dict constructor
            return moved
    return _send_to_device(tensor, device, non_blocking=non_blocking)


def get_data_structure(data: Any) -> Any:
    """The same structure with every tensor replaced by its :class:`TensorInformation` (shape and dtype).

    Example:
        >>> import torch
        >>> get_data_structure({"x": torch.zeros(2, dtype=torch.int8)})
        {'x': TensorInformation(shape=torch.Size([2]), dtype=torch.int8)}
    """
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data: Any) -> Any:
    """The same structure with every tensor replaced by its shape as a list of ints."""
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors (uninitialized values) for every :class:`TensorInformation` in ``data_structure``.

    Example:
        >>> import torch
        >>> initialize_tensors([TensorInformation(shape=torch.Size([2, 3]), dtype=torch.float16)])[0].shape
        torch.Size([2, 3])
    """
    return recursively_apply(
        lambda info: torch.empty(*info.shape, dtype=info.dtype),
        data_structure,
        test_type=is_tensor_information,
    )


def ignorant_find_batch_size(data: Any) -> int | None:
    """The batch size of ``data``, or ``None`` when it holds no tensor (see :func:`find_batch_size`)."""
    return find_batch_size(data)


def listify(data: Any) -> Any:
    """Turn every tensor into (nested) Python lists of numbers; bf16 goes through fp32, which NumPy lacks.

    Example:
        >>> import torch
        >>> listify({"loss": torch.tensor(0.5, dtype=torch.bfloat16), "ids": torch.tensor([1, 2])})
        {'loss': 0.5, 'ids': [1, 2]}
    """

    def to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.to(torch.float32)
        return tensor.tolist()

    return recursively_apply(to_list, data)


def slice_tensors(
    data: Any, tensor_slice: slice, process_index: int | None = None, num_processes: int | None = None
) -> Any:
    """Index every tensor in ``data`` with ``tensor_slice`` (along dim 0 for a plain slice).

    ``process_index`` and ``num_processes`` are accepted for Accelerate's signature and unused there too.

    Example:
        >>> import torch
        >>> slice_tensors({"x": torch.arange(4)}, slice(1, 3))
        {'x': tensor([1, 2])}
    """
    return recursively_apply(lambda tensor: tensor[tensor_slice], data)


def convert_to_fp32(tensor: Any) -> Any:
    """Cast every fp16 and bf16 tensor in a nested structure to fp32; other values are left as they are.

    Example:
        >>> import torch
        >>> out = convert_to_fp32({"logits": torch.ones(1, dtype=torch.float16), "ids": torch.ones(1, dtype=torch.long)})
        >>> out["logits"].dtype, out["ids"].dtype
        (torch.float32, torch.int64)
    """

    def is_half(value: Any) -> bool:
        return isinstance(getattr(value, "dtype", None), torch.dtype) and value.dtype in (
            torch.float16,
            torch.bfloat16,
        )

    return recursively_apply(lambda value: value.float(), tensor, test_type=is_half)


class ConvertOutputsToFp32:
    """A callable around ``model_forward`` that returns its outputs with half-precision tensors in fp32.

    It refuses to be pickled (as Accelerate's): a model whose forward is wrapped must be unwrapped first
    (``accelerator.unwrap_model(model, keep_fp32_wrapper=False)``).

    Args:
        model_forward: the function (usually a model's ``forward``) whose outputs are converted.
    """

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> dict[str, Any]:
        raise pickle.PicklingError(
            "Cannot pickle a forward wrapped by convert_outputs_to_fp32: unwrap the model first with "
            "accelerator.unwrap_model(model, keep_fp32_wrapper=False)."
        )


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward function so that its fp16/bf16 outputs come back in fp32, as Accelerate's decorator.

    The returned function's ``__wrapped__`` is the :class:`ConvertOutputsToFp32` wrapper, so unwrapping
    helpers that follow ``__wrapped__`` find the original forward. To convert values rather than wrap a
    function, use :func:`convert_to_fp32`.

    Args:
        model_forward: a callable, usually ``model.forward``.

    Raises:
        TypeError: ``model_forward`` is not callable (e.g. a tensor or a dict of outputs).

    Example:
        >>> import torch
        >>> half = torch.nn.Linear(2, 2).half()
        >>> half.forward = convert_outputs_to_fp32(half.forward)
        >>> half(torch.ones(1, 2, dtype=torch.float16)).dtype
        torch.float32
    """
    if not callable(model_forward):
        raise TypeError(
            f"convert_outputs_to_fp32() wraps a function, got a {type(model_forward).__name__}. To convert "
            "tensors (or nested outputs) to fp32, call convert_to_fp32(outputs)."
        )
    wrapper = ConvertOutputsToFp32(model_forward)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return wrapper(*args, **kwargs)

    forward.__wrapped__ = wrapper  # type: ignore[attr-defined]
    return forward


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor in ``data`` (depth first), or ``None`` when it holds no tensor.

    Example:
        >>> import torch
        >>> find_device([1, {"x": torch.ones(1)}])
        device(type='cpu')
    """
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (tuple, list)):
        for item in data:
            device = find_device(item)
            if device is not None:
                return device
        return None
    return data.device if isinstance(data, torch.Tensor) else None


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad every tensor with zeros along ``dim`` to the next multiple of ``num_processes`` rows.

    Used to split an uneven batch between processes. A size that is already a multiple is left alone.

    Args:
        tensor: a tensor or a nested structure of tensors with ``batch_size`` rows along ``dim``.
        batch_size: the number of rows.
        num_processes: the multiple to reach.
        dim: the dimension to pad.

    Raises:
        ValueError: ``num_processes`` is below 1, or a tensor does not have ``batch_size`` rows.

    Example:
        >>> import torch
        >>> pad_input_tensors(torch.ones(3, 2), batch_size=3, num_processes=4).tolist()
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    """
    if num_processes < 1:
        raise ValueError(f"pad_input_tensors(num_processes={num_processes}) is invalid: it must be >= 1.")
    target = -(-batch_size // num_processes) * num_processes

    def pad(one: torch.Tensor) -> torch.Tensor:
        if one.shape[dim] != batch_size:
            raise ValueError(
                f"pad_input_tensors(batch_size={batch_size}) got a tensor of shape {tuple(one.shape)}, whose "
                f"dim {dim} has {one.shape[dim]} rows. Pass the number of rows the tensors have."
            )
        if target == batch_size:
            return one
        shape = list(one.shape)
        shape[dim] = target - batch_size
        return torch.cat([one, one.new_zeros(shape)], dim=dim)

    return recursively_apply(pad, tensor, error_on_other_type=True)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Give every process the tensor that exactly one process holds; the others pass ``None``.

    Unlike :func:`broadcast`, the receiving processes need not know the shape or dtype. The result is on
    this process's device (the holder keeps a copy on its tensor's device).

    Args:
        tensor: the tensor on one process, ``None`` on all others.

    Returns:
        A tensor equal to the holder's, on every process.

    Raises:
        ValueError: no process, or more than one, passed a tensor.

    Example:
        >>> import torch
        >>> copy_tensor_to_devices(torch.tensor([1, 2]))  # one process: a copy of its own tensor
        tensor([1, 2])
    """
    state = PartialState()
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"copy_tensor_to_devices() takes a tensor or None, got a {type(tensor).__name__}.")
    where = f"rank {state.process_index} of world size {state.num_processes}"
    if state.num_processes == 1:
        if tensor is None:
            raise ValueError(f"copy_tensor_to_devices(None) on {where}: no process passed a tensor to copy.")
        return tensor.clone()
    info = (tuple(tensor.shape), tensor.dtype) if tensor is not None else None
    holders = [(rank, item) for rank, item in enumerate(gather_object([info])) if item is not None]
    if len(holders) != 1:
        ranks = [rank for rank, _ in holders]
        raise ValueError(
            f"copy_tensor_to_devices() on {where} needs exactly one process to pass a tensor and the others "
            f"None, but {len(ranks)} passed one (ranks {ranks}). Use broadcast() to copy from one of several."
        )
    source, (shape, dtype) = holders[0]
    buffer = tensor.clone() if tensor is not None else torch.empty(shape, dtype=dtype)
    if tensor is None:
        buffer = buffer.to(state.device)
    return broadcast(buffer, from_process=source)


@contextlib.contextmanager
def GatheredParameters(
    params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True
) -> Iterator[None]:
    """Inside the block, DeepSpeed ZeRO-3's partitioned parameters are whole; anywhere else, nothing happens.

    Under ZeRO-3 each process keeps a slice of every parameter and the module's own parameters are empty;
    this context gathers them (DeepSpeed's ``deepspeed.zero.GatheredParameters``) and partitions them again
    on exit. With ``modifier_rank``, what that process changed inside the block is broadcast to every
    process on exit; with None, changes are discarded. Call it on every process. Parameters no ZeRO-3
    engine partitioned (one process, DDP, FSDP2, ZeRO 0-2) are whole already, and the context does nothing,
    as in Accelerate (FSDP2 parameters are DTensors: call ``full_tensor()`` on one to see it whole).

    Unlike Accelerate, which gathers only when the plugin's ``zero3_init_flag`` is set, this asks the
    parameters themselves (ZeRO-3 marks each with ``ds_id``), so that it gathers after ``prepare`` too.

    Args:
        params: a parameter, or an iterable of them (``model.parameters()``).
        modifier_rank: the process whose changes inside the block are kept, or None to discard them.
        fwd_module: the module whose forward is run inside the block, if any (DeepSpeed registers
            external parameters on it).
        enabled: False makes the context do nothing.

    Example:
        >>> weight = torch.nn.Linear(2, 2).weight
        >>> with GatheredParameters(weight, modifier_rank=0):  # no ZeRO-3: the parameter is whole already
        ...     tuple(weight.shape)
        (2, 2)
    """
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if not any(hasattr(param, "ds_id") for param in params):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(
        params, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled
    ):
        yield
