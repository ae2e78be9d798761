"""Tests that parse what several ranks printed read each rank's own file (issue 44, item 7): ranks sharing the
launcher's pipe can cut each other's lines."""

from __future__ import annotations

import pytest

from tests.helpers.rank_output import rank_log_flags, rank_outputs, rank_stdout


def test_each_ranks_file_is_read_whole_by_launch_attempt_and_rank(tmp_path):
    for run, attempt, rank, text in [
        ("lockstep-2_b", 0, 0, "B0\n"),
        ("lockstep-1_a", 1, 1, "A1 attempt 1\n"),
        ("lockstep-1_a", 0, 1, "A1"),  # no newline at the end: a rank that died mid-line
        ("lockstep-1_a", 0, 0, "A0\nA0 again\n"),
    ]:
        folder = tmp_path / run / f"attempt_{attempt}" / str(rank)
        folder.mkdir(parents=True)
        (folder / "stdout.log").write_text(text)
        (folder / "stderr.log").write_text("not read\n")
    found = [(out.run, out.attempt, out.local_rank) for out in rank_outputs(tmp_path)]
    assert found == [
        ("lockstep-1_a", 0, 0),
        ("lockstep-1_a", 0, 1),
        ("lockstep-1_a", 1, 1),
        ("lockstep-2_b", 0, 0),
    ]
    assert rank_stdout(tmp_path).splitlines() == ["A0", "A0 again", "A1", "A1 attempt 1", "B0"]


def test_a_launch_without_the_flags_is_named():
    assert rank_log_flags("logs") == ["--tee", "1", "--log-dir", "logs"]
    with pytest.raises(
        AssertionError, match=r"no rank wrote output under /nowhere: launch with \['--tee', '1'"
    ):
        rank_outputs("/nowhere")
