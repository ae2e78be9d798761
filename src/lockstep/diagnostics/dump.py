"""Writing one rank's hang report: ``rank_<r>.txt`` for people, ``rank_<r>.json`` for tools."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lockstep.diagnostics.hang_summary import RankReport, collective_label

_RECORDER_LINES = 64
"""How many of torch's flight-recorder entries the text file lists (the JSON file holds them all)."""


def flight_recorder_entries() -> list[dict[str, Any]]:
    """torch's flight-recorder entries (empty unless ``TORCH_FR_BUFFER_SIZE`` was set before the group
    was created); they include the collectives torch issues from C++, such as DDP's gradient all-reduce."""
    try:
        from torch._C import _distributed_c10d

        raw = _distributed_c10d._dump_fr_trace_json(True, False)
        return list(json.loads(raw).get("entries", []))
    except Exception:  # an older torch, or no recorder: the dump goes without it
        return []


def _collective_rows(entries: list[dict[str, Any]]) -> list[str]:
    header = f"  {'collective':<28} {'state':<8} {'seconds':>9}  {'site':<28} shapes / dtypes"
    rows = [header]
    for entry in entries:
        via = f" [lockstep {entry['api']}{' debug check' if entry.get('debug_check') else ''}]"
        shapes = ", ".join(f"{list(s)}:{d}" for s, d in zip(entry["shapes"], entry["dtypes"])) or "-"
        rows.append(
            f"  {collective_label(entry):<28} {entry['state']:<8} {entry['seconds']:>9.3f}  "
            f"{entry['site']:<28} {shapes}{via if entry.get('api') else ''}"
            + (f"  error: {entry['error']}" if entry.get("error") else "")
        )
    return rows


def render_text(
    report: RankReport, world_size: int, entries: list[dict[str, Any]], stacks: str, recorder: list[dict]
) -> str:
    """The human-readable dump of one rank."""
    flight = report.in_flight
    lines = [
        f"lockstep hang report: rank {report.rank} of {world_size} (host {report.host}, pid {report.pid}), "
        f"written {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"reason: {report.reason}",
        f"optimizer steps completed: {report.steps}; seconds since the last step or collective: "
        + (f"{report.seconds_since_progress:.1f}" if report.seconds_since_progress is not None else "-"),
        "in collective: "
        + (
            f"{collective_label(flight)} at {flight['site']} for {flight['seconds']:.1f} s"
            if flight
            else "none"
        ),
        f"main thread at: {report.location or 'unknown'}",
        "",
        f"Last {len(entries)} collectives of this rank, oldest first (torch.distributed calls made from Python):",
        *_collective_rows(entries),
        "",
        "Python stacks of all threads (innermost call last):",
        stacks,
    ]
    if recorder:
        lines += [
            "",
            f"torch flight recorder, last {min(len(recorder), _RECORDER_LINES)} of {len(recorder)} entries "
            "(including collectives torch issues from C++):",
        ]
        lines += [
            f"  {e.get('profiling_name', '?')} seq {e.get('collective_seq_id', '?')} sizes {e.get('input_sizes')}"
            for e in recorder[-_RECORDER_LINES:]
        ]
    return "\n".join(lines) + "\n"


def write_dump(
    dump_dir: str,
    report: RankReport,
    world_size: int,
    entries: list[dict[str, Any]],
    stacks: str,
) -> Path:
    """Write ``rank_<r>.txt`` and ``rank_<r>.json`` into ``dump_dir``; returns the text file."""
    folder = Path(dump_dir)
    folder.mkdir(parents=True, exist_ok=True)
    recorder = flight_recorder_entries()
    text_path = folder / f"rank_{report.rank}.txt"
    write_atomically(text_path, render_text(report, world_size, entries, stacks, recorder))
    payload = {
        "report": report.to_dict(),
        "world_size": world_size,
        "collectives": entries,
        "stacks": stacks,
        "flight_recorder": recorder,
    }
    write_atomically(folder / f"rank_{report.rank}.json", json.dumps(payload, indent=1, default=str))
    return text_path


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a complete temporary file beside it is renamed over it
    (a reader never sees half of it, even when the writer is stopped midway).

    Raises:
        OSError: the file could not be written (the temporary file is removed).
    """
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        staging.write_text(text)
        os.replace(staging, path)
    except OSError:
        staging.unlink(missing_ok=True)
        raise
