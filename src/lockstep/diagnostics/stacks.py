"""Python stacks of every thread of this process, and where a thread is in the user's code."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

from lockstep.diagnostics.collective_log import file_kind

_USER, _LIBRARY = 0, 2


def format_all_threads() -> str:
    """Every thread's stack, innermost call last, the main thread first."""
    frames = sys._current_frames()
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    order = sorted(frames, key=lambda ident: (ident != main, names.get(ident, ""), ident))
    parts = []
    for ident in order:
        name = names.get(ident, "unknown")
        lines = "".join(traceback.format_stack(frames[ident]))
        parts.append(f'Thread {ident} "{name}"{" (main)" if ident == main else ""}:\n{lines}')
    return "\n".join(parts)


def user_location(thread_id: int | None = None) -> str | None:
    """Where a thread (default: the main thread) is: ``train.py:42 in train_step``, the innermost frame
    that is neither lockstep's, torch's nor the standard library's, followed by the innermost torch or
    standard-library frame below it when there is one (``, in torch's _engine_run_backward``).
    None when the thread has no user frame."""
    thread_id = threading.main_thread().ident if thread_id is None else thread_id
    frame = sys._current_frames().get(thread_id)  # type: ignore[arg-type]
    frames = []
    while frame is not None:
        frames.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return describe_frames(frames)


def traceback_location(error: BaseException) -> str | None:
    """Like :func:`user_location`, for where ``error`` was raised."""
    frames = [(frame.f_code, line) for frame, line in _walk(error.__traceback__)]
    return describe_frames(frames)


def _walk(tb: Any) -> list[tuple[Any, int]]:
    """The traceback's frames, innermost first."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames[::-1]


def describe_frames(frames: list[tuple[Any, int]]) -> str | None:
    """Describe a stack given as ``(code, line)`` pairs, innermost first."""
    inner: str | None = None
    for code, line in frames:
        kind = file_kind(code.co_filename)
        if kind == _USER:
            where = f"{os.path.basename(code.co_filename)}:{line} in {code.co_name}"
            return where + (f", in {inner}" if inner else "")
        if kind == _LIBRARY and inner is None:
            owner = "torch's" if "torch" in code.co_filename else os.path.basename(code.co_filename)
            inner = f"{owner} {code.co_name}"
    return None
