"""Python stacks of every thread of this process, and where a thread is in the user's code."""

from __future__ import annotations

import os
import sys
import threading
import traceback

from lockstep.diagnostics.collective_log import file_kind

_USER = 0


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
    """``train.py:42 in train_step``: the innermost frame of ``thread_id`` (default: the main thread)
    that is neither lockstep's, torch's nor the standard library's; None when there is none."""
    thread_id = threading.main_thread().ident if thread_id is None else thread_id
    frame = sys._current_frames().get(thread_id)  # type: ignore[arg-type]
    while frame is not None:
        code = frame.f_code
        if file_kind(code.co_filename) == _USER:
            return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        frame = frame.f_back
    return None
