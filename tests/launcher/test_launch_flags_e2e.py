"""Accelerate's launch flags, for real: two workers started by ``lockstep launch`` show each flag's effect."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest

from lockstep.launcher._worker import cpu_share
from tests.helpers.cli import lockstep
from tests.helpers.rank_output import rank_log_flags, rank_stdout

pytestmark = pytest.mark.distributed

REPORT_SCRIPT = """\
import json, os, sys
print("REPORT " + json.dumps({
    "rank": int(os.environ["RANK"]),
    "role": os.environ.get("ROLE_NAME"),
    "threads": os.environ.get("OMP_NUM_THREADS"),
    "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    "argv": sys.argv[1:],
}), flush=True)
"""


def _reports(stdout: str, prefix: str = "") -> list[dict]:
    """The REPORT lines, after a line prefix (a regular expression), by rank."""
    pattern = re.compile(rf"^{prefix}REPORT (.*)$")
    found = [json.loads(match.group(1)) for line in stdout.splitlines() if (match := pattern.match(line))]
    return sorted(found, key=lambda report: report["rank"])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity needs Linux")
def test_tee_log_dir_role_threads_and_cpu_affinity(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT_SCRIPT)
    logs = tmp_path / "logs"
    result = lockstep(
        "launch", "--num_processes", "2", "--tee", "3", "--log_dir", str(logs), "--role", "trainer",
        "--num_cpu_threads_per_process", "3", "--enable_cpu_affinity", "--rdzv_conf", "join_timeout=60",
        str(script), "--lr", "0.1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # --tee: the console lines come through torch's tail, prefixed with the role and the local rank.
    reports = _reports(result.stdout, prefix=r"\[trainer[01]\]:")
    assert len(reports) == 2 and all(report["argv"] == ["--lr", "0.1"] for report in reports)
    assert [(r["role"], r["threads"]) for r in reports] == [("trainer", "3"), ("trainer", "3")]
    assert _reports(result.stdout, prefix=r"\[trainer1\]:")[0]["rank"] == 1
    # --log_dir: each local rank's stdout is in its own file too.
    for rank in range(2):
        (log,) = logs.glob(f"*/attempt_0/{rank}/stdout.log")
        assert _reports(log.read_text()) == [reports[rank]]
    # --enable_cpu_affinity: each worker holds its own share of the launcher's cores.
    cores = sorted(os.sched_getaffinity(0))
    assert [report["cpus"] for report in reports] == [cpu_share(cores, rank, 2) for rank in range(2)]


def test_no_python_runs_the_target_as_a_program(tmp_path):
    program = tmp_path / "run.sh"
    program.write_text('#!/bin/sh\necho "PROGRAM rank $RANK of $WORLD_SIZE: $*"\n')
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    logs = tmp_path / "logs"
    result = lockstep(
        "launch", *rank_log_flags(logs), "--num-processes", "2", "--no_python", str(program), "a", "b"
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in rank_stdout(logs).splitlines() if line.startswith("PROGRAM")]
    assert lines == ["PROGRAM rank 0 of 2: a b", "PROGRAM rank 1 of 2: a b"]


def test_main_training_function_is_called_in_every_worker(tmp_path):
    script = tmp_path / "notebook_style.py"
    script.write_text(
        "import os, sys\n"
        "def main():\n"
        "    print(f\"CALLED {os.environ['RANK']} {__name__} {sys.argv[1:]}\", flush=True)\n"
        "if __name__ == '__main__':\n"
        "    raise SystemExit('the script ran as __main__')\n"
    )
    logs = tmp_path / "logs"
    result = lockstep(
        "launch",
        *rank_log_flags(logs),
        "--num-processes",
        "2",
        "--main_training_function",
        "main",
        str(script),
        "-x",
    )
    assert result.returncode == 0, result.stderr
    calls = [line for line in rank_stdout(logs).splitlines() if line.startswith("CALLED")]
    assert calls == ["CALLED 0 notebook_style ['-x']", "CALLED 1 notebook_style ['-x']"]


def test_quiet_prints_only_the_failing_rank(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        "import os, time\nif os.environ['RANK'] == '1':\n    raise ValueError('bad batch')\ntime.sleep(30)\n"
    )
    result = lockstep("launch", "--num-processes", "2", "-q", str(script))
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("lockstep launch:")]
    assert len(lines) == 1
    assert lines[0].startswith("lockstep launch: rank 1 (local rank 1")
    assert lines[0].endswith("failed with exit code 1: ValueError: bad batch (boom.py:3)")
