"""Freeing memory and finding a batch size that fits.

:func:`find_executable_batch_size` retries a training function with 0.9 times the batch size (Accelerate's
factor: 128, 115, 103, ...) whenever it runs
out of memory. In a process group the ranks agree after every attempt (one small all-reduce), so that when
any rank runs out of memory all of them retry with the same smaller batch size, and when any rank fails
for another reason the others stop too instead of waiting for it forever.
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lockstep.collectives import reduce

R = TypeVar("R")

# Messages of out-of-memory errors that arrive as plain RuntimeErrors.
_OOM_MESSAGES = (
    " out of memory",  # CUDA, HIP, XPU
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's way of running out of workspace
    "DefaultCPUAllocator: can't allocate memory",  # CPU
    "not enough memory",  # CPU on Windows, some allocators
    "PT_DEVMEM Allocation failed",  # HPU
)

_OK, _OOM, _FAILED = 0, 1, 2
DEFAULT_REDUCTION = 0.9
"""The batch size is multiplied by this after an out-of-memory error (Accelerate 1.15's factor)."""


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Return cached accelerator memory to the device (and collect garbage first when asked).

    Args:
        garbage_collection: run :func:`gc.collect` first so that unreachable tensors are freed.

    Example:
        >>> clear_device_cache(garbage_collection=True)
    """
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """Drop references to ``objects``, collect garbage and empty the accelerator caches.

    The caller's own names still point at the objects: assign the result back to them.

    Args:
        *objects: models, optimizers, tensors... to let go of.

    Returns:
        A list of as many ``None`` as objects were passed.

    Example:
        >>> import torch
        >>> a, b = torch.ones(1000), torch.ones(1000)
        >>> a, b = release_memory(a, b)
        >>> a is None and b is None
        True
    """
    released: list[Any] = list(objects)
    for index in range(len(released)):
        released[index] = None
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` means "out of memory", so a smaller batch size may succeed.

    Args:
        exception: the exception a training attempt raised.

    Returns:
        True for :class:`torch.OutOfMemoryError`, :class:`MemoryError`, and RuntimeErrors whose message
        is one of the known out-of-memory messages (CUDA, cuDNN, the CPU allocator, HPU).

    Example:
        >>> should_reduce_batch_size(RuntimeError("DefaultCPUAllocator: can't allocate memory: ..."))
        True
    """
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exception, RuntimeError) and exception.args and isinstance(exception.args[0], str):
        return any(message in exception.args[0] for message in _OOM_MESSAGES)
    return False


@dataclass
class _Attempt:
    """The outcome of running the function once at one batch size."""

    status: int
    result: Any = None
    error: Exception | None = None


def _attempt(function: Callable[..., Any], batch_size: int, args: tuple, kwargs: dict) -> _Attempt:
    try:
        return _Attempt(_OK, result=function(batch_size, *args, **kwargs))
    except Exception as error:
        return _Attempt(_OOM if should_reduce_batch_size(error) else _FAILED, error=error)


def _statuses_of_all_ranks(status: int) -> list[int]:
    """Every rank's status, by rank: one all-reduce in a process group, just ``[status]`` otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [status]
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    flags[dist.get_rank()] = status
    return reduce(flags, reduction="sum").tolist()


def _raise_for_failures(attempt: _Attempt, statuses: list[int], batch_size: int) -> None:
    if attempt.error is not None and attempt.status == _FAILED:
        raise attempt.error
    failed = [rank for rank, status in enumerate(statuses) if status == _FAILED]
    if failed:
        raise RuntimeError(
            f"find_executable_batch_size: rank(s) {failed} of world size {len(statuses)} failed at batch "
            f"size {batch_size} with an error that is not out-of-memory, so rank {dist.get_rank()} stops "
            "too. See the failing rank's traceback."
        )


class _BatchSizeSearch:
    """Calls ``function(batch_size, ...)`` with smaller batch sizes until one fits on every rank."""

    def __init__(
        self, function: Callable[..., Any], starting_batch_size: int, reduce_fn: Callable[..., int] | None
    ) -> None:
        self.function = function
        self.batch_size = starting_batch_size
        self.reduce_fn = reduce_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _check_call(self.function, args, kwargs)
        clear_device_cache(garbage_collection=True)
        while True:
            if self.batch_size <= 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            attempt = _attempt(self.function, self.batch_size, args, kwargs)
            statuses = _statuses_of_all_ranks(attempt.status)
            _raise_for_failures(attempt, statuses, self.batch_size)
            if _OOM not in statuses:
                return attempt.result
            del attempt  # its traceback holds the frames (and tensors) of the failed attempt
            clear_device_cache(garbage_collection=True)
            self.batch_size = self._next_batch_size()

    def _next_batch_size(self) -> int:
        if self.reduce_fn is None:
            return int(self.batch_size * DEFAULT_REDUCTION)
        if _positional_parameters(self.reduce_fn):
            return int(self.reduce_fn(self.batch_size))
        return int(self.reduce_fn())


def _positional_parameters(function: Callable[..., Any]) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in inspect.signature(function).parameters.values() if p.kind in kinds]


def _check_call(function: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """Reject calls that pass the batch size themselves: the decorator supplies it."""
    name = getattr(function, "__name__", repr(function))
    parameters = inspect.signature(function).parameters
    positional = _positional_parameters(function)
    if not positional:
        raise TypeError(
            f"{name}() is decorated with find_executable_batch_size but takes no positional parameter; "
            f"its first parameter must be the batch size: def {name}(batch_size, ...)."
        )
    has_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values())
    first = positional[0].name
    if first in kwargs or (not has_varargs and len(args) + 1 > len(positional)):
        shown = ", ".join([*map(repr, args[1:]), *(f"{k}={v!r}" for k, v in kwargs.items() if k != first)])
        raise TypeError(
            f"The batch size was passed to {name}() when calling it, but find_executable_batch_size "
            f"supplies it as the first argument. Remove it: {name}({shown})."
        )


def find_executable_batch_size(
    function: Callable[..., R] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[..., int] | None = None,
) -> Any:
    """Decorator: call ``function(batch_size, ...)``, with 0.9 times the batch size after each out-of-memory
    error (128, 115, 103, 92, ...: Accelerate's factor).

    The decorated function receives the batch size as its first argument; call it without that argument.
    Errors that are not out-of-memory (see :func:`should_reduce_batch_size`) propagate unchanged. As in
    Accelerate, the batch size found is remembered: a second call starts from it. In a process group every
    rank must call the decorated function; all ranks retry together when any of them runs out of memory.

    Args:
        function: the function to decorate (omit it to pass the other arguments: ``@decorator(...)``).
        starting_batch_size: the first batch size to try.
        reduce_batch_size_fn: the next batch size after an out-of-memory error, called with no argument
            (Accelerate's convention) or with the current batch size if it takes a positional parameter.
            ``int(batch_size * 0.9)`` when None. Unlike Accelerate 1.15, the decorator form
            (``@find_executable_batch_size(reduce_batch_size_fn=...)``) keeps it.

    Returns:
        The decorated function (or a decorator when ``function`` is None).

    Raises:
        RuntimeError: ``No executable batch size found, reached zero.`` when every size failed.
        TypeError: when the batch size is passed to the decorated function.

    Example:
        >>> @find_executable_batch_size(starting_batch_size=64)
        ... def train(batch_size, model):
        ...     return batch_size  # build the dataloader with batch_size and train here
        >>> train("model")
        64
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    search = _BatchSizeSearch(function, starting_batch_size, reduce_batch_size_fn)

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        return search(*args, **kwargs)

    # Callers must not see batch_size: show the signature without it, and hide the original.
    signature = inspect.signature(function)
    decorator.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=list(signature.parameters.values())[1:]
    )
    del decorator.__wrapped__  # type: ignore[attr-defined]
    return decorator


__all__ = ["clear_device_cache", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]
