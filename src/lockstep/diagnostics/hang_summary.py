"""Turning every rank's report into one line: who waits in which collective, and who is elsewhere.

Pure functions on plain data (no torch, no process group), so that they can be tested on synthetic
reports and used by the launcher.

Example:
    >>> waiting = {"op": "all_reduce", "seq": 57, "site": "train.py:42"}
    >>> barrier = {"op": "barrier", "seq": 58, "site": "train.py:50", "api": "wait_for_everyone"}
    >>> summarize([RankReport(rank=0, in_flight=barrier), RankReport(rank=1, in_flight=waiting)], 2)
    'rank 1 is waiting in all_reduce #57 (train.py:42); rank 0 is waiting in barrier #58 from lockstep wait_for_everyone (train.py:50)'
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

HANG_EXIT_CODE = 124
"""Exit code of every rank stopped by the hang watchdog (as GNU ``timeout`` uses)."""
MARKER = "HangDetected"
"""Start of the message each rank records for the launcher."""


@dataclass
class RankReport:
    """What one rank says about itself when a hang is diagnosed.

    Attributes:
        rank: the global rank.
        reason: why this rank started the diagnosis (or joined another rank's).
        in_flight: the collective its main thread is blocked in (a collective log entry as a dict), if any.
        last_done: the last collective its main thread finished, if any.
        location: where its main thread is in the user's code (``train.py:20 in main``).
        steps: optimizer steps completed so far.
        seconds_since_progress: seconds since the last completed step or collective.
        unrecorded_timeout: a collective torch issued itself (e.g. DDP's gradient all-reduce, not in the
            record) hit the process-group timeout at ``location``.
        host: the machine's name.
        pid: the process id.
    """

    rank: int
    reason: str = ""
    in_flight: dict[str, Any] | None = None
    last_done: dict[str, Any] | None = None
    location: str | None = None
    steps: int = 0
    seconds_since_progress: float | None = None
    unrecorded_timeout: bool = False
    host: str = ""
    pid: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankReport:
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**known)


def collective_label(entry: dict[str, Any]) -> str:
    """``all_reduce #57`` (``on group 3`` for a non-default group)."""
    group = f" on group {entry['group']}" if entry.get("group") else ""
    return f"{entry['op']} #{entry['seq']}{group}"


def _via(entry: dict[str, Any]) -> str:
    if not entry.get("api"):
        return ""
    return f" from lockstep {entry['api']}" + (" (debug check)" if entry.get("debug_check") else "")


def _failure(entry: dict[str, Any]) -> str:
    error = entry.get("error")
    if not error:
        return ""
    if "timed out" in error.lower() or "timeout" in error.lower():
        return ", timed out"
    return f", failed with {error[:120]}"


def _state(report: RankReport) -> tuple[tuple[Any, ...], str, str]:
    """(grouping key, verb phrase, phrase) of one rank."""
    entry = report.in_flight
    if entry is not None:
        key = ("in", entry["op"], entry["seq"], entry.get("group"), entry.get("site"), entry.get("api"))
        text = (
            f"waiting in {collective_label(entry)}{_via(entry)} ({entry.get('site', '?')}){_failure(entry)}"
        )
        return key, "in", text
    where = report.location or "an unknown place"
    if report.unrecorded_timeout:
        return ("torch", report.location), "in", f"timed out in a collective torch issued itself, at {where}"
    last = report.last_done
    tail = f" (its last collective, {collective_label(last)}, finished)" if last else ""
    return ("out", report.location), "out", f"not in a collective, at {where}{tail}"


def format_ranks(ranks: list[int]) -> str:
    """``rank 1`` / ``ranks 0, 2-5``."""
    ranks = sorted(ranks)
    runs: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        runs.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def summarize(reports: list[RankReport], world_size: int) -> str:
    """One line naming where every rank is, the likely culprits first.

    Ranks outside any collective come first (the others wait for them), then groups of ranks in the same
    collective, the ones with the lowest sequence number (furthest behind) first, smaller groups before
    larger ones; ranks that sent no report come last.

    Args:
        reports: the reports that arrived (at most one per rank).
        world_size: the number of ranks in the job.
    """
    groups: dict[tuple[Any, ...], tuple[str, str, list[int], int]] = {}
    for report in reports:
        key, kind, text = _state(report)
        seq = report.in_flight["seq"] if report.in_flight else -1
        if key not in groups:
            groups[key] = (kind, text, [], seq)
        groups[key][2].append(report.rank)

    def order(item: tuple[str, str, list[int], int]) -> tuple[int, int, int, int]:
        kind, _, ranks, seq = item
        return (0 if kind == "out" else 1, seq, len(ranks), min(ranks))

    parts = []
    for _, text, ranks, _ in sorted(groups.values(), key=order):
        verb = "is" if len(ranks) == 1 else "are"
        parts.append(f"{format_ranks(ranks)} {verb} {text}")
    missing = sorted(set(range(world_size)) - {report.rank for report in reports})
    if missing:
        parts.append(f"{format_ranks(missing)} did not report (dead, or stuck outside Python)")
    return "; ".join(parts) if parts else "no rank reported"


def hang_line(reason: str, summary: str, dump_dir: str) -> str:
    """The one line printed for a hang."""
    return (
        f"lockstep: hang detected ({reason}): {summary}. "
        f"Stacks and last collectives of each rank: {dump_dir}/rank_<r>.txt"
    )
