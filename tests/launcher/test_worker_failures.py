"""Naming the root cause when several forked workers failed (units over real error files)."""

import json
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from lockstep.launcher.failures import WorkerFailedError, with_every_recorded_failure


def _record(path, message: str, when: float, pid: int) -> str:
    path.mkdir(parents=True)
    info = {"py_callstack": "", "timestamp": str(int(when)), "lockstep_time": when, "lockstep_pid": pid}
    (path / "error.json").write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    return str(path / "error.json")


def test_every_rank_that_recorded_an_error_is_reported_and_the_earliest_comes_first(tmp_path):
    now = time.time()
    attempt = tmp_path / "run" / "attempt_0"
    later = _record(attempt / "0", "RuntimeError: Connection closed by peer", now + 0.05, 101)
    _record(attempt / "1", "KeyError: 'label'", now, 102)
    (attempt / "2").mkdir()  # a rank the agent stopped before it recorded anything
    reported = {4: ProcessFailure(local_rank=0, pid=101, exitcode=1, error_file=later)}  # machine 2 of 2x2

    failures = with_every_recorded_failure(reported)

    assert sorted(failures) == [4, 5]
    assert failures[5].pid == 102 and failures[5].local_rank == 1
    error = WorkerFailedError("training_function", failures)
    assert error.get_first_failure()[0] == 5
    assert (
        str(error)
        .splitlines()[1]
        .startswith("rank 5 (local rank 1, pid 102) failed with exit code 1: KeyError")
    )


def test_a_failure_without_an_error_file_is_kept_as_reported(tmp_path):
    import os

    reported = {0: ProcessFailure(local_rank=0, pid=7, exitcode=-9, error_file=os.devnull)}
    assert with_every_recorded_failure(reported) == reported
    assert "killed by SIGKILL" in str(WorkerFailedError("f", reported))


def test_a_rank_the_agent_stopped_comes_after_the_cause_even_when_its_record_is_older(tmp_path):
    """A forked worker inherits the agent's SIGTERM handler; torch records that stop with whole seconds."""
    now = time.time()
    attempt = tmp_path / "run" / "attempt_0"
    stopped = attempt / "0"
    stopped.mkdir(parents=True)
    info = {"py_callstack": "", "timestamp": str(int(now))}  # torch's record: no lockstep fields
    message = {"message": "SignalException: Process 7087 got signal: 15", "extraInfo": info}
    (stopped / "error.json").write_text(json.dumps({"message": message}))
    cause = _record(attempt / "1", "KeyError: 'label'", now + 0.5, 102)
    reported = {
        0: ProcessFailure(local_rank=0, pid=101, exitcode=1, error_file=str(stopped / "error.json")),
        1: ProcessFailure(local_rank=1, pid=102, exitcode=1, error_file=cause),
    }
    error = WorkerFailedError("training_function", reported)
    assert error.get_first_failure()[0] == 1
    assert str(error).splitlines()[1].startswith("rank 1 (local rank 1, pid 102)")


def test_a_record_cut_off_by_the_agents_stop_leaves_no_half_written_error_file(tmp_path, monkeypatch):
    """The agent stops the other ranks (SIGTERM, raised in a forked worker as torch's SignalException) while
    one may be writing its record; torch's agent raises on a half-written file instead of reporting the
    failures, so the record is written whole or not at all."""
    import pytest
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from lockstep.launcher import _worker

    path = tmp_path / "attempt_0" / "0" / "error.json"
    path.parent.mkdir(parents=True)
    monkeypatch.setenv(_worker.ERROR_FILE_ENV, str(path))

    written = Path.write_text

    def stopped_halfway(self, text, *args, **kwargs):
        written(self, text[:20])
        raise SignalException("Process 1 got signal: 15", sigval=15)

    monkeypatch.setattr(Path, "write_text", stopped_halfway)
    with pytest.raises(SignalException):
        _worker.write_error_file(ValueError("bad batch"))
    assert not path.exists()
    monkeypatch.undo()
    monkeypatch.setenv(_worker.ERROR_FILE_ENV, str(path))
    _worker.write_error_file(ValueError("bad batch"))
    assert json.loads(path.read_text())["message"]["message"] == "ValueError: bad batch"
    assert sorted(p.name for p in path.parent.iterdir() if not p.name.startswith(".")) == ["error.json"]


def test_another_ranks_unreadable_record_is_left_out_instead_of_failing_the_report(tmp_path):
    now = time.time()
    attempt = tmp_path / "run" / "attempt_0"
    cause = _record(attempt / "0", "KeyError: 'label'", now, 101)
    (attempt / "1").mkdir()
    (attempt / "1" / "error.json").write_text('{"message": {"mess')  # not lockstep's: written in pieces
    reported = {0: ProcessFailure(local_rank=0, pid=101, exitcode=1, error_file=cause)}
    assert with_every_recorded_failure(reported) == reported
