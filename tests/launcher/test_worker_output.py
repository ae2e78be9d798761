"""Workers write their output a whole line at a time: the lines of ranks that share the launcher's pipe
never merge, and a line arrives as soon as it ends."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

import pytest

from lockstep.launcher import _worker, preloaded
from tests.helpers.cli import cli_env, lockstep

pytestmark = pytest.mark.distributed

LINES = 3000
SCRIPT = f"""
import os
import sys
import torch  # so that a preloaded launch forks the workers from its server

rank = os.environ["RANK"]
for i in range({LINES}):
    print(f"LINE {{rank}} {{i:04d}} " + "x" * 60)
    if i % 500 == 0:
        print(f"PROGRESS {{rank}} {{i}}", end="\\r", file=sys.stderr)
print("UNENDED " + rank, end="")
"""
WHOLE = re.compile(r"LINE [01] \d{4} x{60}")


@pytest.mark.parametrize("preload", [False, True], ids=["fresh-interpreters", "preloaded"])
def test_two_ranks_printing_thousands_of_lines_never_merge_one(tmp_path: Path, preload: bool) -> None:
    """Unbuffered, as ``python -u`` workers were: 860 to 3,864 of the 6,000 lines merged in two runs."""
    script = tmp_path / "prints.py"
    script.write_text(SCRIPT)
    env = cli_env(**({preloaded.PRELOAD_WORKERS: "1"} if preload else {}))
    env.pop("PYTHONUNBUFFERED", None)
    result = lockstep("launch", "--num-processes", "2", "--cpu", str(script), env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ends = re.findall(r"UNENDED [01]", result.stdout)  # text without an end is written at exit
    assert sorted(ends) == ["UNENDED 0", "UNENDED 1"]
    lines = [line for line in re.sub("UNENDED [01]", "", result.stdout).splitlines() if line]
    merged = [line for line in lines if not WHOLE.fullmatch(line)]
    assert not merged, f"{len(merged)} merged lines, e.g. {merged[:2]}"
    assert len(lines) == 2 * LINES
    for rank in "01":  # each rank's lines in its order
        assert [line[7:11] for line in lines if line.startswith(f"LINE {rank}")] == [
            f"{i:04d}" for i in range(LINES)
        ]
        assert f"PROGRESS {rank} 2500" in result.stderr  # (text mode reads its "\r" as a line end)


def test_a_line_is_written_in_one_piece_when_it_ends_and_a_carriage_return_sends_a_partial_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    stream = io.TextIOWrapper(io.FileIO(write_end, "w"), encoding="utf-8", write_through=True)
    monkeypatch.setattr(sys, "stdout", stream)
    _worker.print_whole_lines()

    def written() -> bytes:
        with contextlib.suppress(BlockingIOError):
            return os.read(read_end, 4096)
        return b""

    try:
        print("partial", end="")
        assert written() == b""  # unbuffered, this was b"partial"
        print(" and its end")
        assert written() == b"partial and its end\n"  # one write: nothing of another rank's can come between
        print("progress 50%", end="\r")
        assert written() == b"progress 50%\r"
        print("flushed", end="", flush=True)
        assert written() == b"flushed"
    finally:
        stream.close()
        os.close(read_end)
