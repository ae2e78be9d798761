"""A per-rank record of the last collectives, fed by thin wrappers on ``torch.distributed``'s functions.

:func:`install` replaces ``torch.distributed.all_reduce``, ``barrier``, ... (the functions on the
``torch.distributed`` module object) with wrappers that note the operation, a per-group sequence
number, the input shapes and dtypes, the user's call site (the first frame outside lockstep, torch and
the standard library) and whether the call returned. lockstep's own collectives (``lockstep.collectives``,
``wait_for_everyone``) call these module functions, so they are recorded too, labelled with the lockstep
function the user called. :func:`uninstall` puts the originals back.

Not seen: collectives that torch issues from C++ (DDP's gradient all-reduce, ``_broadcast_coalesced``)
and functions bound by ``from torch.distributed import all_reduce`` before :func:`install` ran. torch's
flight recorder (``TORCH_FR_BUFFER_SIZE``) sees the C++ ones; the hang dump includes it when enabled.

A recorded call costs about a microsecond (see ``bench/collective_log_overhead.py``).
"""

from __future__ import annotations

import collections
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

# name -> (index of the input tensor argument or None, its keyword, always asynchronous)
_OPS: dict[str, tuple[int | None, str | None, bool]] = {
    "all_reduce": (0, "tensor", False),
    "all_gather": (1, "tensor", False),
    "all_gather_into_tensor": (1, "input_tensor", False),
    "all_gather_object": (None, None, False),
    "broadcast": (0, "tensor", False),
    "broadcast_object_list": (None, None, False),
    "reduce": (0, "tensor", False),
    "reduce_scatter": (1, "input_list", False),
    "reduce_scatter_tensor": (1, "input", False),
    "all_to_all": (1, "input_tensor_list", False),
    "all_to_all_single": (1, "input", False),
    "gather": (0, "tensor", False),
    "gather_object": (None, None, False),
    "scatter": (0, "tensor", False),
    "scatter_object_list": (None, None, False),
    "barrier": (None, None, False),
    "monitored_barrier": (None, None, False),
    "send": (0, "tensor", False),
    "recv": (0, "tensor", False),
}
# isend/irecv stay torch's own: dist.P2POp (which torch.distributed.pipelining builds from dist.isend and
# dist.irecv) refuses any other function ("Invalid ``op``"), so a wrapper would break every pipeline.

_LOCKSTEP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIRS = tuple(
    {os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")}
)
_USER, _LOCKSTEP, _LIBRARY = 0, 1, 2
_file_kinds: dict[str, int] = {}


def file_kind(filename: str) -> int:
    """Whether a code file is the user's (0), lockstep's (1) or torch's / the standard library's (2)."""
    kind = _file_kinds.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_LOCKSTEP_DIR):
            kind = _LOCKSTEP
        elif path.startswith(_TORCH_DIR) or path.startswith(_STDLIB_DIRS) or filename.startswith("<frozen"):
            kind = _LIBRARY
        else:
            kind = _USER
        _file_kinds[filename] = kind
    return kind


def call_site(frame: FrameType | None) -> tuple[Any, int, str | None, bool]:
    """Walk out of lockstep, torch and the standard library to the user's frame.

    Returns ``(code object, line, lockstep function, debug check)``: the lockstep function is the
    outermost public lockstep function on the way (``reduce``, ``wait_for_everyone``), None for a direct
    torch.distributed call; ``debug check`` says the call is debug mode's shape check. When no user frame
    exists (e.g. at interpreter exit) the innermost frame stands in.
    """
    api: str | None = None
    debug_check = False
    innermost = frame
    kinds = _file_kinds
    while frame is not None:
        code = frame.f_code
        kind = kinds.get(code.co_filename)
        if kind is None:
            kind = file_kind(code.co_filename)
        if kind == _USER:
            return code, frame.f_lineno, api, debug_check
        if kind == _LOCKSTEP:
            name = code.co_name
            if name == "_verify":
                debug_check = True
            elif name[0] != "_":
                api = name
        frame = frame.f_back
    if innermost is None:
        return None, 0, api, debug_check
    return innermost.f_code, innermost.f_lineno, api, debug_check


# A recorded call is a plain list (cheap to build on the hot path); CollectiveEntry reads it.
_OP, _SEQ, _GROUP, _SHAPES, _DTYPES, _SITE, _THREAD, _STARTED, _ENDED, _ERROR, _ASYNC = range(11)


class CollectiveEntry:
    """A read-only view of one recorded call. ``ended`` is None while it runs (and for async calls)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[Any]) -> None:
        self._raw = raw

    op = property(lambda self: self._raw[_OP])
    seq = property(lambda self: self._raw[_SEQ])
    thread = property(lambda self: self._raw[_THREAD])
    started = property(lambda self: self._raw[_STARTED])
    ended = property(lambda self: self._raw[_ENDED])
    error = property(lambda self: self._raw[_ERROR])
    is_async = property(lambda self: self._raw[_ASYNC])

    @property
    def group_name(self) -> str:
        """Empty for the default group, else the group's name."""
        group = self._raw[_GROUP]
        if group is None or group is dist.GroupMember.WORLD:
            return ""
        return str(getattr(group, "group_name", "?"))

    @property
    def site(self) -> str:
        """``train.py:42``."""
        code, line, _, _ = self._raw[_SITE]
        return f"{os.path.basename(code.co_filename) if code else '?'}:{line}"

    @property
    def api(self) -> str | None:
        return self._raw[_SITE][2]

    def state(self) -> str:
        if self.is_async:
            return "async"
        if self.error:
            return "failed"
        return "running" if self.ended is None else "done"

    def to_dict(self, now: float, wall_offset: float) -> dict[str, Any]:
        """Plain data for reports and files (``wall_offset`` turns monotonic times into epoch seconds)."""
        code, line, api, debug_check = self._raw[_SITE]
        ended = self.ended
        return {
            "op": self.op,
            "seq": self.seq,
            "group": self.group_name,
            "shapes": [list(shape) for shape in self._raw[_SHAPES]],
            "dtypes": [str(dtype).replace("torch.", "") for dtype in self._raw[_DTYPES]],
            "site": self.site,
            "file": code.co_filename if code else "?",
            "function": code.co_name if code else "?",
            "line": line,
            "api": api,
            "debug_check": debug_check,
            "state": self.state(),
            "started_at": self.started + wall_offset,
            "seconds": (ended if ended is not None else now) - self.started,
            "error": self.error,
            "thread": self.thread,
        }


_MAX_SHAPES = 8
_EMPTY: tuple[Any, ...] = ()


def _describe(data: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    if isinstance(data, (list, tuple)):
        tensors = [t for t in data[:_MAX_SHAPES] if isinstance(t, torch.Tensor)]
        return tuple(t.shape for t in tensors), tuple(t.dtype for t in tensors)
    return _EMPTY, _EMPTY


class CollectiveLog:
    """The last ``capacity`` collectives of this process, oldest first.

    Args:
        capacity: how many entries to keep.
        on_error: called as ``on_error(entry, error)`` when a recorded collective raises (before the
            error propagates); the hang watchdog uses it to turn process-group timeouts into a report.
    """

    def __init__(
        self, capacity: int, on_error: Callable[[CollectiveEntry, BaseException], None] | None = None
    ) -> None:
        self.entries: collections.deque[list[Any]] = collections.deque(maxlen=capacity)
        self.on_error = on_error
        self.last_finished = time.monotonic()
        self.main_thread = threading.main_thread().ident
        self._sequence: dict[int, int] = {}

    def fail(self, entry: list[Any], error: BaseException) -> None:
        text = str(error).strip()
        entry[_ERROR] = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
        if self.on_error is not None:
            self.on_error(CollectiveEntry(entry), error)

    def snapshot(self) -> list[CollectiveEntry]:
        return [CollectiveEntry(raw) for raw in list(self.entries)]

    def in_flight(self, thread: int | None = None) -> CollectiveEntry | None:
        """The newest call of ``thread`` (default: the main thread) that has not returned."""
        thread = self.main_thread if thread is None else thread
        for entry in reversed(self.snapshot()):
            if entry.thread == thread and not entry.is_async:
                return entry if entry.ended is None else None
        return None

    def last_done(self, thread: int | None = None) -> CollectiveEntry | None:
        thread = self.main_thread if thread is None else thread
        for entry in reversed(self.snapshot()):
            if entry.thread == thread and entry.ended is not None:
                return entry
        return None


_get_ident = threading.get_ident
_monotonic = time.monotonic

# -- installing the wrappers -----------------------------------------------------------------------
_originals: dict[str, Callable[..., Any]] = {}
_installed_for: list[CollectiveLog] = []
_lock = threading.Lock()
_ABSENT = 1 << 30  # an argument index no call reaches


def _wrap(name: str, original: Callable[..., Any], log: CollectiveLog) -> Callable[..., Any]:
    import inspect

    data_index, data_name, always_async = _OPS[name]
    parameters = list(inspect.signature(original).parameters)
    group_index = parameters.index("group") if "group" in parameters else _ABSENT
    async_index = parameters.index("async_op") if "async_op" in parameters else _ABSENT
    data_index = _ABSENT if data_index is None else data_index
    getframe = sys._getframe

    entries, sequence, kinds = log.entries, log._sequence, _file_kinds
    tensor_type = torch.Tensor

    # The hot path: everything inlined (about a microsecond on an idle core; see bench/).
    def recorded(*args: Any, **kwargs: Any) -> Any:
        count = len(args)
        group = args[group_index] if group_index < count else None
        data = args[data_index] if data_index < count else None
        is_async = always_async or (async_index < count and bool(args[async_index]))
        if kwargs:
            group = kwargs.get("group", group)
            data = kwargs.get(data_name, data) if data_name else data
            is_async = is_async or bool(kwargs.get("async_op", False))
        key = 0 if group is None else id(group)
        seq = sequence[key] = sequence.get(key, 0) + 1
        if isinstance(data, tensor_type):
            shapes, dtypes = (data.shape,), (data.dtype,)
        elif data is None:
            shapes = dtypes = _EMPTY
        else:
            shapes, dtypes = _describe(data)
        frame = getframe(1)
        code = frame.f_code
        site = (
            (code, frame.f_lineno, None, False) if kinds.get(code.co_filename) == _USER else call_site(frame)
        )
        entry = [name, seq, group, shapes, dtypes, site, _get_ident(), _monotonic(), None, None, is_async]
        entries.append(entry)
        try:
            result = original(*args, **kwargs)
        except BaseException as error:
            log.fail(entry, error)
            raise
        if not is_async:
            entry[_ENDED] = log.last_finished = _monotonic()
        return result

    recorded.__wrapped__ = original  # type: ignore[attr-defined]
    recorded.__name__ = getattr(original, "__name__", name)
    recorded.__doc__ = original.__doc__
    recorded._lockstep_recorded = True  # type: ignore[attr-defined]
    return recorded


def install(log: CollectiveLog) -> None:
    """Record every ``torch.distributed`` collective into ``log`` (replacing an earlier installation)."""
    with _lock:
        _restore()
        for name in _OPS:
            original = getattr(dist, name, None)
            if original is None:
                continue
            _originals[name] = original
            setattr(dist, name, _wrap(name, original, log))
        _installed_for.append(log)


def uninstall(log: CollectiveLog | None = None) -> None:
    """Put torch's own functions back (leaving alone any that someone else replaced since).

    Args:
        log: only uninstall when the wrappers record into this log (None: whatever is installed).
    """
    with _lock:
        if log is None or (_installed_for and _installed_for[-1] is log):
            _restore()


def _restore() -> None:
    for name, original in _originals.items():
        if getattr(getattr(dist, name, None), "_lockstep_recorded", False):
            setattr(dist, name, original)
    _originals.clear()
    _installed_for.clear()


def installed() -> bool:
    return bool(_originals)
