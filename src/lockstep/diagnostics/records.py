"""The error record a rank stopped by the hang watchdog leaves for torch's elastic agent.

``lockstep launch`` reads it back (see ``lockstep.launcher.elastic``) and prints the summary once,
instead of one "failed" line per rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lockstep import _env
from lockstep.diagnostics.dump import write_atomically
from lockstep.diagnostics.hang_summary import MARKER


def write_error_record(line: str, *, printer: bool, location: str, dump_dir: str) -> None:
    """Write torch's error-file format with the hang summary (no-op outside the elastic agent)."""
    path = _env.elastic_error_file()
    if not path:
        return
    record = {
        "message": {
            "message": f"{MARKER}: {line}",
            "extraInfo": {
                "py_callstack": "",
                "timestamp": str(int(time.time())),
                "lockstep_time": time.time(),
                "lockstep_location": location,
                "lockstep_hang": {"summary": line, "printer": printer, "dump_dir": dump_dir},
            },
        }
    }
    write_whole(path, record)  # on failure: the summary is printed and in the dump folder anyway


def write_whole(path: str, record: dict[str, Any]) -> bool:
    """Write ``record`` as JSON to ``path`` with :func:`~lockstep.diagnostics.dump.write_atomically`;
    whether it was written.

    When a rank fails, torch's agent stops the others (SIGTERM, raised in a worker as torch's
    ``SignalException``, possibly in the middle of writing its record), then parses every stopped rank's
    record; on half a record it raises instead of reporting the failures (torch 2.13).
    """
    try:
        write_atomically(Path(path), json.dumps(record))
    except OSError:
        return False
    return True


def hang_record(failure_message: object) -> dict | None:
    """The ``lockstep_hang`` part of a recorded failure message, if it was a hang."""
    if not isinstance(failure_message, dict):
        return None
    info = failure_message.get("extraInfo")
    hang = info.get("lockstep_hang") if isinstance(info, dict) else None
    return hang if isinstance(hang, dict) else None
