"""Walking nested batches: dicts, lists, tuples, namedtuples and mapping types such as BatchEncoding."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_fields")


def is_torch_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.Tensor`` (the default ``test_type`` of :func:`recursively_apply`)."""
    return isinstance(tensor, torch.Tensor)


def honor_type(original: Any, items: Any) -> Any:
    """Build a sequence of the same type as ``original`` (namedtuples included) from ``items``."""
    if is_namedtuple(original):
        return type(original)(*list(items))
    return type(original)(items)


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func`` to every leaf of ``data`` that passes ``test_type``, keeping the structure.

    Leaves of other types are returned unchanged, or raise a TypeError with ``error_on_other_type``.
    """
    if isinstance(data, (tuple, list)):
        return honor_type(
            data,
            (
                recursively_apply(
                    func, o, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
                )
                for o in data
            ),
        )
    if isinstance(data, Mapping):
        items = {
            k: recursively_apply(
                func, v, *args, test_type=test_type, error_on_other_type=error_on_other_type, **kwargs
            )
            for k, v in data.items()
        }
        try:
            return type(data)(items)
        except TypeError:  # mapping types without a dict constructor
            return items
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        # Accelerate's message, word for word (its tests compare it), then what to do.
        raise TypeError(
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. Only nested "
            f"list/tuple/dicts of objects that are valid for `{getattr(test_type, '__name__', test_type)}` "
            "should be passed."
        )
    return data


def leaves(data: Any) -> list[torch.Tensor]:
    """Every tensor in ``data``, depth first."""
    found: list[torch.Tensor] = []
    recursively_apply(lambda t: found.append(t), data)
    return found


def send_to_device(data: Any, device: torch.device | str, *, non_blocking: bool = False) -> Any:
    """Move every tensor (and every object with a ``.to`` method such as BatchEncoding) to ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, (tuple, list)):
        return honor_type(data, (send_to_device(o, device, non_blocking=non_blocking) for o in data))
    if isinstance(data, Mapping):
        moved = {k: send_to_device(v, device, non_blocking=non_blocking) for k, v in data.items()}
        try:
            return type(data)(moved)
        except TypeError:
            return moved
    if hasattr(data, "to") and callable(data.to) and not isinstance(data, torch.nn.Module):
        try:
            return data.to(device, non_blocking=non_blocking)
        except TypeError:
            return data.to(device)
    return data


def find_batch_size(data: Any) -> int | None:
    """The size of the first dimension of the first tensor in ``data`` (None when there is no tensor)."""
    for tensor in leaves(data):
        return int(tensor.shape[0]) if tensor.dim() > 0 else 1
    return None


def slice_batch(data: Any, index: slice) -> Any:
    """Slice every tensor (and every list) in a batch along its first dimension."""
    if isinstance(data, torch.Tensor):
        return data[index]
    if (
        isinstance(data, (tuple, list))
        and not is_namedtuple(data)
        and not any(isinstance(o, (torch.Tensor, Mapping, list, tuple)) for o in data)
    ):
        return type(data)(data[index])  # a list of samples (e.g. strings)
    if isinstance(data, (tuple, list)):
        return honor_type(data, (slice_batch(o, index) for o in data))
    if isinstance(data, Mapping):
        sliced = {k: slice_batch(v, index) for k, v in data.items()}
        try:
            return type(data)(sliced)
        except TypeError:
            return sliced
    return data


def concatenate(data: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate a list of batches of the same structure along ``dim``, as ``accelerate.utils.concatenate``.

    Tensors are concatenated with :func:`torch.cat`; lists, tuples (namedtuples too) and dicts are walked
    position by position and key by key, so a list is a structure here, never a list of samples. Other
    items cannot be concatenated: a single batch is returned as it is (its lists and dicts rebuilt), and
    several batches holding them raise a TypeError, as in Accelerate. Batches of different lengths or
    keys raise a ValueError (Accelerate fails with an IndexError or KeyError, or drops the extra items).

    Args:
        data: the batches, a list or tuple of tensors or of nested lists / tuples / dicts of tensors.
        dim: the dimension along which tensors are concatenated.

    Returns:
        One batch of the same structure.

    Raises:
        TypeError: when ``data`` is not a list or tuple, or when several batches hold something other
            than tensors at the same place.
        ValueError: when ``data`` is empty, or when its batches differ in length or keys.

    Example:
        >>> import torch
        >>> concatenate([{"x": torch.zeros(1, 2)}, {"x": torch.ones(2, 2)}])["x"].shape
        torch.Size([3, 2])
        >>> concatenate([[1, "a"]])  # one batch: returned as it is
        [1, 'a']
    """
    if not isinstance(data, (list, tuple)):
        raise TypeError(
            f"concatenate() needs a list of batches, got a {type(data).__name__}. Wrap a single batch in a "
            "list: concatenate([batch])."
        )
    if not data:
        raise ValueError("concatenate([]) got no batches: pass a list holding at least one batch.")
    first = data[0]
    if isinstance(first, (tuple, list)):
        _check_same("lengths", data, [len(d) if isinstance(d, (tuple, list)) else None for d in data])
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        _check_same("keys", data, [set(d) if isinstance(d, Mapping) else None for d in data])
        merged = {k: concatenate([d[k] for d in data], dim=dim) for k in first}
        try:
            return type(first)(merged)
        except TypeError:  # mapping types without a dict constructor
            return merged
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(
        f"concatenate() can only concatenate tensors, but got {len(data)} batches holding a "
        f"{type(first).__name__} ({first!r:.60}) at the same place. Collect such values with "
        "gather_object() or in a Python list; a single batch is returned as it is."
    )


def _check_same(what: str, data: Sequence[Any], values: list[Any]) -> None:
    """Raise when the batches' ``values`` (their lengths or key sets) differ."""
    if any(value != values[0] for value in values):
        layouts = ", ".join(f"batch {i} has {_layout(batch)}" for i, batch in enumerate(data))
        raise ValueError(
            f"concatenate() needs batches of the same structure, but their {what} differ: {layouts}. "
            "Give every batch the same items."
        )


def _layout(batch: Any) -> str:
    if isinstance(batch, (tuple, list)):
        return f"{len(batch)} items"
    if isinstance(batch, Mapping):
        return f"keys {list(batch)}"
    return f"a {type(batch).__name__}"


def concatenate_batches(batches: list[Any]) -> Any:
    """Concatenate batches of the same structure along the first dimension."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches, dim=0)
    if (
        isinstance(first, (tuple, list))
        and not is_namedtuple(first)
        and not any(isinstance(o, (torch.Tensor, Mapping, list, tuple)) for o in first)
    ):
        return type(first)(item for batch in batches for item in batch)
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate_batches([b[i] for b in batches]) for i in range(len(first))))
    if isinstance(first, Mapping):
        merged = {k: concatenate_batches([b[k] for b in batches]) for k in first}
        try:
            return type(first)(merged)
        except TypeError:
            return merged
    raise TypeError(f"Cannot concatenate batches of type {type(first).__name__}.")
