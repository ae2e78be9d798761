"""Hang diagnosis: the collective record, the watchdog, the one-line summary and the launcher's report.

The end-to-end tests run the real ``lockstep launch`` (and torchrun) on tests/scripts/hang_worker.py,
whose rank 1 skips an all_reduce or sleeps forever; the job must stop with exit code 124 within a
minute, print one line naming rank 1 and the operation, and leave per-rank files holding the stacks.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lockstep import HangDetectionKwargs, _env
from lockstep.diagnostics import HANG_EXIT_CODE, RankReport, summarize
from lockstep.diagnostics.hang_summary import format_ranks, hang_line
from lockstep.diagnostics.settings import resolve_plan
from lockstep.launcher.elastic import report_failures
from tests.helpers.cli import REPO, SCRIPTS, cli_env, lockstep
from tests.helpers.deadlines import scaled
from tests.helpers.in_process_launch import launched_in_process
from tests.helpers.multiprocess import run_distributed
from tests.helpers.ports import TORCHRUN_STANDALONE
from tests.helpers.rank_output import rank_log_flags, rank_stdout

WORKER = SCRIPTS / "hang_worker.py"
LINES = {
    marker: number
    for number, text in enumerate(WORKER.read_text().splitlines(), start=1)
    for marker in ("ALL_REDUCE_HERE", "BARRIER_HERE", "SLEEPS_HERE", "BACKWARD_HERE")
    if marker in text
}


def _entry(op: str, seq: int, site: str, **extra: object) -> dict:
    return {"op": op, "seq": seq, "site": site, **extra}


# -- the summary, from synthetic reports ------------------------------------------------------------
def test_summary_puts_the_rank_that_is_behind_first():
    reports = [
        RankReport(rank=0, in_flight=_entry("barrier", 58, "train.py:50")),
        RankReport(rank=1, in_flight=_entry("all_reduce", 57, "train.py:42")),
        RankReport(rank=2, in_flight=_entry("barrier", 58, "train.py:50")),
    ]
    assert summarize(reports, 3) == (
        "rank 1 is waiting in all_reduce #57 (train.py:42); ranks 0, 2 are waiting in barrier #58 (train.py:50)"
    )


def test_summary_names_a_rank_outside_any_collective_first():
    reports = [
        RankReport(rank=0, in_flight=_entry("all_reduce", 6, "train.py:43", error="RuntimeError: Timed out")),
        RankReport(
            rank=1, location="train.py:38 in <module>", last_done=_entry("all_reduce", 5, "train.py:43")
        ),
    ]
    assert summarize(reports, 2) == (
        "rank 1 is not in a collective, at train.py:38 in <module> (its last collective, all_reduce #5, "
        "finished); rank 0 is waiting in all_reduce #6 (train.py:43), timed out"
    )


def test_summary_of_a_disagreement_labels_lockstep_calls_and_debug_checks():
    reports = [
        RankReport(rank=0, in_flight=_entry("all_reduce", 8, "train.py:30")),
        RankReport(rank=1, in_flight=_entry("barrier", 8, "train.py:33", api="wait_for_everyone")),
        RankReport(
            rank=2, in_flight=_entry("all_gather_object", 8, "t.py:9", api="reduce", debug_check=True)
        ),
        RankReport(rank=3, in_flight=_entry("all_reduce", 8, "train.py:30", group="5")),
    ]
    assert summarize(reports, 4) == (
        "rank 0 is waiting in all_reduce #8 (train.py:30); "
        "rank 1 is waiting in barrier #8 from lockstep wait_for_everyone (train.py:33); "
        "rank 2 is waiting in all_gather_object #8 from lockstep reduce (debug check) (t.py:9); "
        "rank 3 is waiting in all_reduce #8 on group 5 (train.py:30)"
    )


def test_summary_lists_ranks_that_did_not_report_and_compresses_ranges():
    waiting = _entry("all_reduce", 3, "a.py:1")
    reports = [RankReport(rank=r, in_flight=waiting) for r in (0, 1, 2, 3, 5)]
    assert summarize(reports, 8) == (
        "ranks 0-3, 5 are waiting in all_reduce #3 (a.py:1); ranks 4, 6-7 did not report "
        "(dead, or stuck outside Python)"
    )
    assert format_ranks([7]) == "rank 7"
    assert summarize([], 1) == "rank 0 did not report (dead, or stuck outside Python)"


def test_summary_of_a_timeout_inside_torch_and_where_frames_point():
    from lockstep.diagnostics.stacks import describe_frames, traceback_location

    reports = [
        RankReport(rank=0, location="t.py:12 in <module>, in torch's backward", unrecorded_timeout=True),
        RankReport(rank=1, location="t.py:10 in <module>"),
    ]
    assert summarize(reports, 2) == (
        "rank 1 is not in a collective, at t.py:10 in <module>; "
        "rank 0 is timed out in a collective torch issued itself, at t.py:12 in <module>, in torch's backward"
    )

    def fails() -> None:
        torch.zeros(2).view(3)  # RAISES_HERE

    with pytest.raises(RuntimeError) as caught:
        fails()
    here = Path(__file__).name
    assert traceback_location(caught.value) == f"{here}:{_line_of('RAISES_HERE')} in fails"
    assert describe_frames([]) is None


def test_report_round_trips_through_plain_data_and_the_line_names_the_folder():
    report = RankReport(rank=1, reason="r", location="x.py:1 in f", steps=4, host="h", pid=9)
    assert RankReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    line = hang_line("no step for 10 s", "rank 1 is ...", "/runs/a/lockstep_hang")
    assert line == (
        "lockstep: hang detected (no step for 10 s): rank 1 is .... "
        "Stacks and last collectives of each rank: /runs/a/lockstep_hang/rank_<r>.txt"
    )


def test_text_dump_lists_the_record_the_stacks_and_torchs_flight_recorder():
    from lockstep.diagnostics.dump import render_text

    entry = _entry("all_reduce", 6, "t.py:43", group="", shapes=[[2]], dtypes=["float32"])
    entry.update(state="running", seconds=10.25, api=None, error=None)
    recorder = [
        {"profiling_name": "gloo:all_reduce", "collective_seq_id": i, "input_sizes": [[4]]} for i in range(70)
    ]
    report = RankReport(rank=0, reason="why", in_flight=entry, location="t.py:43 in <module>", steps=5)
    text = render_text(report, 2, [entry], 'Thread 1 "MainThread" (main):\n  File "t.py", line 43', recorder)
    assert "lockstep hang report: rank 0 of 2" in text and "reason: why" in text
    assert "in collective: all_reduce #6 at t.py:43 for 10.2 s" in text
    assert (
        "  all_reduce #6                running     10.250  t.py:43                      [2]:float32" in text
    )
    assert 'Thread 1 "MainThread" (main):' in text
    assert "torch flight recorder, last 64 of 70 entries" in text
    assert "gloo:all_reduce seq 69 sizes [[4]]" in text and "seq 5 sizes" not in text


# -- settings ---------------------------------------------------------------------------------------
def test_env_variable_parsing():
    assert _env.hang_timeout({}) is None
    assert _env.hang_timeout({"LOCKSTEP_HANG_TIMEOUT": "10"}) == 10.0
    assert _env.hang_timeout({"LOCKSTEP_HANG_TIMEOUT": "off"}) is False
    assert _env.hang_timeout({"LOCKSTEP_HANG_TIMEOUT": "0"}) is False
    with pytest.raises(ValueError, match=r"LOCKSTEP_HANG_TIMEOUT='ten' is invalid: give the hang window"):
        _env.hang_timeout({"LOCKSTEP_HANG_TIMEOUT": "ten"})


def test_plan_precedence_window_and_switches():
    automatic = resolve_plan(None, None, "/runs/a")
    assert automatic is not None and automatic.timeout is None
    assert automatic.dump_dir == "/runs/a/lockstep_hang"
    assert automatic.window(None) == 900.0  # the floor before any step time is known
    assert automatic.window(0.5) == 900.0
    assert automatic.window(100.0) == 2000.0  # 20 median steps
    assert resolve_plan(None, 10.0, None).window(100.0) == 10.0  # LOCKSTEP_HANG_TIMEOUT
    assert resolve_plan(HangDetectionKwargs(timeout=30), 10.0, None).timeout == 30  # explicit wins
    assert resolve_plan(None, False, None) is None  # LOCKSTEP_HANG_TIMEOUT=off
    assert resolve_plan(HangDetectionKwargs(enabled=False), 10.0, None) is None
    assert resolve_plan(HangDetectionKwargs(enabled=True), False, None) is not None
    assert resolve_plan(HangDetectionKwargs(dump_dir="/x"), None, "/runs/a").dump_dir == "/x"
    assert resolve_plan(None, None, None).dump_dir.endswith("/lockstep_hang")


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match=r"HangDetectionKwargs\(timeout=0\) is invalid: it must be > 0"):
        HangDetectionKwargs(timeout=0)
    with pytest.raises(TypeError, match=r"HangDetectionKwargs\(min_timeout='5'\) must be a finite number"):
        HangDetectionKwargs(min_timeout="5")
    with pytest.raises(ValueError, match=r"HangDetectionKwargs\(history=0\) is invalid"):
        HangDetectionKwargs(history=0)


def test_only_communication_errors_can_start_a_diagnosis():
    from lockstep.diagnostics.watchdog import HangWatchdog, is_collective_timeout, is_communication_error

    gloo_timeout = RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")
    assert is_collective_timeout(gloo_timeout)
    assert not is_collective_timeout(ValueError("bad batch"))
    assert is_communication_error(RuntimeError("[gloo/pair.cc:534] Connection closed by peer"))
    assert not is_communication_error(ValueError("bad batch"))
    watchdog = HangWatchdog(resolve_plan(None, 10.0, None), rank=0, world_size=2, exchange=None)
    assert watchdog.on_error(ValueError("bad batch")) is None  # returns: the user's error propagates
    assert watchdog.on_error(RuntimeError("Connection closed by peer")) is None  # nobody announced a hang


# -- the launcher's report --------------------------------------------------------------------------
def _failure(rank: int, message: dict | None, exitcode: int = HANG_EXIT_CODE) -> SimpleNamespace:
    return SimpleNamespace(
        exitcode=exitcode,
        local_rank=rank,
        pid=100 + rank,
        timestamp=0,
        error_file_data={"message": message} if message else {},
        signal_name=lambda: "SIGTERM",
    )


def test_launcher_prints_the_hang_summary_once(capsys):
    def record(printer: bool) -> dict:
        info = {"lockstep_hang": {"summary": "lockstep: hang detected (x): rank 1 is y", "printer": printer}}
        return {"message": "HangDetected: ...", "extraInfo": info}

    code = report_failures({0: _failure(0, record(True)), 1: _failure(1, record(False))})
    assert code == HANG_EXIT_CODE
    assert capsys.readouterr().err.splitlines() == [
        "lockstep launch: hang detected (x): rank 1 is y",
        "lockstep launch: the workers were stopped (exit code 124).",
    ]


def test_launcher_reports_ordinary_failures_as_before(capsys):
    message = {"message": "ValueError: bad", "extraInfo": {"lockstep_location": "t.py:3"}}
    assert report_failures({1: _failure(1, message, exitcode=1)}) == 1
    assert "rank 1 (local rank 1, pid 101) failed with exit code 1: ValueError: bad (t.py:3)" in (
        capsys.readouterr().err
    )


# -- the record, in real process groups ---------------------------------------------------------------
def _record_collectives() -> list[dict]:
    import torch.distributed as dist

    from lockstep import Accelerator
    from lockstep.diagnostics import active_watchdog, collective_log

    accelerator = Accelerator(kwargs_handlers=[HangDetectionKwargs(timeout=60)])
    watchdog = active_watchdog.current()
    assert watchdog is not None and collective_log.installed()
    dist.all_reduce(torch.ones(2, 3))  # DIRECT
    accelerator.reduce(torch.ones(4, dtype=torch.int64))  # VIA_LOCKSTEP
    accelerator.wait_for_everyone()  # VIA_BARRIER
    entries = [entry.to_dict(0.0, 0.0) for entry in watchdog.log.snapshot()]
    original = dist.all_reduce.__wrapped__
    accelerator.end_training()
    assert active_watchdog.current() is None and not collective_log.installed()
    assert dist.all_reduce is original  # torch's own function is back
    return entries


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(number for number, text in enumerate(lines, start=1) if f"# {marker}" in text)


@pytest.mark.distributed
@pytest.mark.parametrize("debug", [False, True])
def test_record_holds_direct_and_lockstep_collectives(debug):
    env = {"LOCKSTEP_DEBUG": "1"} if debug else {}
    entries = run_distributed(_record_collectives, 2, env=env)
    simplified = [
        [(e["op"], e["seq"], e["site"], e["api"], e["debug_check"], e["state"]) for e in rank]
        for rank in entries
    ]
    here = Path(__file__).name
    direct = ("all_reduce", 1, f"{here}:{_line_of('DIRECT')}", None, False, "done")
    reduce = ("all_reduce", 2 + debug, f"{here}:{_line_of('VIA_LOCKSTEP')}", "reduce", False, "done")
    barrier = ("barrier", 3 + debug, f"{here}:{_line_of('VIA_BARRIER')}", "wait_for_everyone", False, "done")
    check = ("all_gather_object", 2, f"{here}:{_line_of('VIA_LOCKSTEP')}", "reduce", True, "done")
    expected = [direct, check, reduce, barrier] if debug else [direct, reduce, barrier]
    assert simplified == [expected, expected]
    assert entries[1][0]["shapes"] == [[2, 3]] and entries[1][0]["dtypes"] == ["float32"]
    assert entries[1][-2]["shapes"] == [[4]] and entries[1][-2]["dtypes"] == ["int64"]


def _watchdog_checks() -> tuple[str | None, str | None, str | None, str | None]:
    from lockstep.diagnostics.exchange import PeerExchange
    from lockstep.diagnostics.watchdog import HangWatchdog
    from lockstep.state import PartialState

    state = PartialState()
    plan = resolve_plan(HangDetectionKwargs(timeout=0.3), None, None)
    exchange = PeerExchange.for_default_group()
    watchdog = HangWatchdog(plan, rank=state.process_index, world_size=2, exchange=exchange)  # not started
    time.sleep(0.5)
    before_first_step = watchdog.check()  # not armed before the first optimizer step
    watchdog.note_step()
    fresh = watchdog.check()
    time.sleep(0.5)
    stale = watchdog.check()
    state.wait_for_everyone()
    if state.process_index == 0:
        exchange.raise_flag("rank 0 says so")
    state.wait_for_everyone()
    announced = watchdog.check() if state.process_index == 1 else None
    return before_first_step, fresh, stale, announced


@pytest.mark.distributed
def test_watchdog_is_armed_by_the_first_step_fires_after_the_window_and_hears_peers():
    results = run_distributed(_watchdog_checks, 2)
    for rank, (before, fresh, stale, _) in enumerate(results):
        assert before is None and fresh is None
        assert stale is not None
        assert stale.startswith(f"no optimizer step or collective completed on rank {rank} for ")
    assert results[1][3] == "rank 0 says so"


# -- end to end -------------------------------------------------------------------------------------
WINDOW = 10
"""The hang window the end-to-end runs give the product (``LOCKSTEP_HANG_TIMEOUT=10``, gloo's 10 s timeout):
the number they check, never scaled."""
REPORTING = 20
"""What the machine may take on top of the window to gather the reports and exit, on an idle machine: the
tests allow it times the load factor (two ranks' stack dumps on a loaded 2-core machine)."""


def _launch(mode: str, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run the worker; returns the result and the seconds from the last completed step to the exit
    (start-up, slow on a loaded 2-core machine, does not count)."""
    logs = tmp_path / "logs"
    result = lockstep(
        "launch", *rank_log_flags(logs), "--num-processes", "2", str(WORKER), mode, str(tmp_path),
        timeout=180, env=cli_env(**env),
    )  # fmt: skip
    return result, time.time() - _last_step_time(logs)


def _last_step_time(logs: Path) -> float:
    """The time of the last step either rank printed, read from each rank's own output."""
    stdout = rank_stdout(logs)
    steps = [float(stamp) for stamp in re.findall(r"^STEP \d+ \d+ (\d+\.\d{3})$", stdout, re.MULTILINE)]
    assert steps, stdout
    return max(steps)


def _hang_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "hang detected" in line]


def _assert_dumps(tmp_path: Path, summary: str) -> None:
    folder = tmp_path / "lockstep_hang"
    for rank in (0, 1):
        text = (folder / f"rank_{rank}.txt").read_text()
        assert f"rank {rank} of 2" in text
        assert "Python stacks of all threads" in text and "Thread " in text
        assert "hang_worker.py" in text and "lockstep-hang-watchdog" in text
        data = json.loads((folder / f"rank_{rank}.json").read_text())
        assert data["report"]["rank"] == rank and data["collectives"]
    assert (folder / "summary.txt").read_text().strip() == "lockstep: " + summary.removeprefix(
        "lockstep launch: "
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_skipping_an_all_reduce_is_reported(tmp_path):
    result, seconds = _launch("skip", tmp_path, LOCKSTEP_HANG_TIMEOUT="10")
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    assert seconds < WINDOW + scaled(REPORTING)  # the product's window, then the reports
    [line] = _hang_lines(result.stderr)
    assert line.startswith(
        "lockstep launch: hang detected (no optimizer step or collective completed on rank "
    )
    assert (
        f"rank 0 is waiting in all_reduce #8 (hang_worker.py:{LINES['ALL_REDUCE_HERE']}); "
        f"rank 1 is waiting in barrier #8 from lockstep wait_for_everyone (hang_worker.py:{LINES['BARRIER_HERE']})"
    ) in line
    _assert_dumps(tmp_path, line)
    rank1 = (tmp_path / "lockstep_hang" / "rank_1.txt").read_text()
    assert "accelerator.wait_for_everyone()  # BARRIER_HERE" in rank1  # the main thread's stack
    assert "all_reduce #7                done" in rank1 and "barrier #8                   running" in rank1


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_sleeping_forever_is_reported(tmp_path):
    result, seconds = _launch("sleep", tmp_path, LOCKSTEP_HANG_TIMEOUT="10")
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    assert seconds < WINDOW + scaled(REPORTING)  # the product's window, then the reports
    [line] = _hang_lines(result.stderr)
    assert (
        f"rank 1 is not in a collective, at hang_worker.py:{LINES['SLEEPS_HERE']} in <module> (its last "
        f"collective, all_reduce #5, finished); rank 0 is waiting in all_reduce #6 "
        f"(hang_worker.py:{LINES['ALL_REDUCE_HERE']})"
    ) in line
    _assert_dumps(tmp_path, line)
    assert "time.sleep(3600)  # SLEEPS_HERE" in (tmp_path / "lockstep_hang" / "rank_1.txt").read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_process_group_timeout_gives_the_same_summary(tmp_path):
    # The watchdog stays at its automatic window (15 minutes); gloo's 10 s timeout fires first.
    result, seconds = _launch("pg-timeout", tmp_path)
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    assert seconds < WINDOW + scaled(REPORTING)  # the product's window, then the reports
    [line] = _hang_lines(result.stderr)
    assert "(all_reduce #6 on rank 0 hit the process-group timeout)" in line
    assert f"rank 1 is not in a collective, at hang_worker.py:{LINES['SLEEPS_HERE']} in <module>" in line
    assert (
        f"rank 0 is waiting in all_reduce #6 (hang_worker.py:{LINES['ALL_REDUCE_HERE']}), timed out" in line
    )
    assert "Timed out waiting" not in result.stderr  # no bare gloo text
    _assert_dumps(tmp_path, line)


@pytest.mark.slow
@pytest.mark.distributed
def test_timeout_inside_ddp_backward_gives_the_summary(tmp_path):
    result, seconds = _launch("ddp-timeout", tmp_path)
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    assert seconds < WINDOW + scaled(REPORTING)
    [line] = _hang_lines(result.stderr)
    assert "(a collective torch issued on rank 0 hit the process-group timeout)" in line
    assert (
        f"rank 0 is timed out in a collective torch issued itself, at hang_worker.py:{LINES['BACKWARD_HERE']} "
        "in <module>, in torch's "
    ) in line
    assert "rank 1 is not in a collective, at hang_worker.py:" in line
    _assert_dumps(tmp_path, line)


@pytest.mark.slow
def test_under_torchrun_rank_zero_prints_the_one_line(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += [*TORCHRUN_STANDALONE, *rank_log_flags(tmp_path / "logs"), str(WORKER), "sleep", str(tmp_path)]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=scaled(180),
        cwd=REPO,
        env=cli_env(LOCKSTEP_HANG_TIMEOUT="10"),
    )
    assert time.time() - _last_step_time(tmp_path / "logs") < WINDOW + scaled(REPORTING)
    assert result.returncode != 0
    [line] = _hang_lines(result.stderr)
    assert line.startswith("lockstep: hang detected (") and "rank 1 is not in a collective" in line
    assert (tmp_path / "lockstep_hang" / "rank_1.txt").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_debug_mode_reports_a_mismatch_at_once_and_a_clean_run_leaves_no_dump(tmp_path):
    result, _ = _launch("debug", tmp_path / "debug", LOCKSTEP_DEBUG="1", LOCKSTEP_HANG_TIMEOUT="10")
    assert result.returncode == 1, result.stderr
    assert (
        "reduce: shapes differ across ranks (world size 2): rank 0 has [(2,)], rank 1 has [(5,)]"
        in result.stderr
    )
    assert not _hang_lines(result.stderr) and not (tmp_path / "debug" / "lockstep_hang").exists()
    # the clean run's launch is not what is tested: its workers fork from this process (a worker that fails
    # fails the test)
    clean = launched_in_process(
        ["--num-processes", "2"],
        str(WORKER),
        ["clean", str(tmp_path / "clean")],
        timeout=60,
        LOCKSTEP_HANG_TIMEOUT="10",
    )
    assert len(re.findall(r"STEP \d+ \d+ ", "".join(clean))) == 16
    assert not (tmp_path / "clean" / "lockstep_hang").exists()
