"""Each rank's output read from its own file, for tests that parse what several ranks printed.

Ranks that share the launcher's stdout pipe write into it in pieces (a buffer flushed at 8 KiB, a pipe write
atomic only up to 4 KiB), so one rank's line can be cut by another's, and a test parsing the merged text
fails now and then. The launcher's own remedy, torchrun's: ``--tee 1 --log-dir DIR`` copies each rank's
stdout to ``DIR/<run>/attempt_<n>/<local rank>/stdout.log`` (the console keeps a prefixed copy). A test
passes :func:`rank_log_flags` to ``lockstep launch`` and reads :func:`rank_outputs` or :func:`rank_stdout`
instead of the launch's stdout. (``run_distributed`` needs none of this: it returns each rank's result.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def rank_log_flags(log_dir: Path | str) -> list[str]:
    """``lockstep launch`` flags that write each rank's stdout to its own file under ``log_dir``."""
    return ["--tee", "1", "--log-dir", str(log_dir)]


@dataclass(frozen=True)
class RankOutput:
    """What one rank of one launch attempt printed."""

    run: str
    """The launch's folder under the log dir (one per launcher: two "machines" have two)."""
    attempt: int
    local_rank: int
    text: str


def rank_outputs(log_dir: Path | str) -> list[RankOutput]:
    """Every rank's stdout under ``log_dir``, by launch, attempt and local rank.

    Raises:
        AssertionError: ``log_dir`` holds no rank's output (the launch was not given :func:`rank_log_flags`).
    """
    found = [
        RankOutput(
            run=path.parents[2].name,
            attempt=int(path.parents[1].name.removeprefix("attempt_")),
            local_rank=int(path.parent.name),
            text=path.read_text(encoding="utf-8", errors="replace"),
        )
        for path in Path(log_dir).glob("*/attempt_*/*/stdout.log")
    ]
    assert found, f"no rank wrote output under {log_dir}: launch with {rank_log_flags(log_dir)}"
    return sorted(found, key=lambda out: (out.run, out.attempt, out.local_rank))


def rank_stdout(log_dir: Path | str) -> str:
    """All ranks' stdout under ``log_dir``, one rank after another (whole lines, never interleaved)."""
    return "".join(out.text if out.text.endswith("\n") else out.text + "\n" for out in rank_outputs(log_dir))
