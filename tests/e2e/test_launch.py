"""End-to-end tests of `lockstep launch` and `lockstep test`, running the real command."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.cli import REPO, SCRIPTS, cli_env, lockstep, lockstep_popen
from tests.helpers.deadlines import scaled, wait_for
from tests.helpers.ports import TORCHRUN_STANDALONE, reserved_port
from tests.helpers.rank_output import rank_log_flags, rank_stdout
from tests.helpers.soak import soak_runs
from tests.helpers.training import reference_training

pytestmark = pytest.mark.distributed


def _reports(stdout: str) -> list[dict]:
    """The ``REPORT`` lines of report_env.py, by rank: pass :func:`rank_stdout`, each rank's own file."""
    return sorted(
        (json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("REPORT ")),
        key=lambda r: r["rank"],
    )


def test_two_cpu_processes_form_one_group_and_get_the_settings(tmp_path):
    result = lockstep(
        "launch",
        *rank_log_flags(tmp_path),
        "--num_processes",
        "2",
        "--mixed-precision",
        "bf16",
        "--gradient_accumulation_steps",
        "3",
        str(SCRIPTS / "report_env.py"),
        "--lr",
        "0.1",
    )
    assert result.returncode == 0, result.stderr
    reports = _reports(rank_stdout(tmp_path))
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world"] == 2 and r["type"] == "MULTI_CPU" for r in reports)
    assert all(r["mixed_precision"] == "bf16" and r["accumulation"] == 3 for r in reports)
    assert all(r["argv"] == ["--lr", "0.1"] for r in reports)
    expected_threads = str(max(1, os.cpu_count() // 2))
    assert all(r["threads"] == expected_threads for r in reports)


def test_module_launch_keeps_the_users_thread_setting(tmp_path):
    # One launch checks both (each launch costs seconds of imports on the 2-core CI machine).
    result = lockstep(
        "launch",
        *rank_log_flags(tmp_path),
        *("--num-processes", "2", "-m", "tests.scripts.report_env"),
        env=cli_env(OMP_NUM_THREADS="3"),
    )
    assert result.returncode == 0, result.stderr
    reports = _reports(rank_stdout(tmp_path))
    assert [r["world"] for r in reports] == [2, 2]
    assert [r["threads"] for r in reports] == ["3", "3"]


def test_lockstep_test_runs_every_check():
    result = lockstep("test", "--num-processes", "2", "--cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every rank reported in (2 process(es)" in result.stdout
    assert "6 passed, 0 failed" in result.stdout


def test_worker_exception_is_reported_with_its_rank(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        "from lockstep import Accelerator\n"
        "accelerator = Accelerator()\n"
        "if accelerator.process_index == 1:\n"
        "    raise ValueError('bad batch on rank one')\n"
        "accelerator.wait_for_everyone()\n"
    )
    result = lockstep("launch", "--num-processes", "2", str(script))
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("lockstep launch:")]
    assert lines, result.stderr[-3000:]
    first = lines[0]
    assert first.startswith("lockstep launch: rank 1 (local rank 1")
    assert "failed with exit code 1: ValueError: bad batch on rank one (boom.py:4)" in first


def _wait_until_ready(folder, ranks: tuple[int, ...], seconds: float = 60) -> None:
    """Wait for wait_for_signal.py's ``ready_<rank>`` files (each holds that worker's pid)."""
    wait_for(
        lambda: all((folder / f"ready_{r}").exists() for r in ranks),
        seconds,
        f"the ready files of ranks {ranks}",
        interval=0.1,
    )


def test_killed_worker_is_reported_within_seconds(tmp_path):
    launcher = lockstep_popen(
        "launch", "--num-processes", "2", str(SCRIPTS / "wait_for_signal.py"), str(tmp_path)
    )
    _wait_until_ready(tmp_path, ranks=(1,))
    os.kill(int((tmp_path / "ready_1").read_text()), signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = launcher.communicate(timeout=scaled(60))
    assert time.monotonic() - killed_at < scaled(15)  # at once: no rendezvous or collective timeout
    assert launcher.returncode == 137
    assert "rank 1 (local rank 1" in stderr and "was killed by SIGKILL" in stderr


def test_sigterm_to_the_launcher_reaches_every_worker(tmp_path):
    launcher = lockstep_popen(
        "launch", "--num-processes", "2", str(SCRIPTS / "wait_for_signal.py"), str(tmp_path)
    )
    _wait_until_ready(tmp_path, ranks=(0, 1))
    launcher.send_signal(signal.SIGTERM)
    launcher.communicate(timeout=scaled(60))
    assert launcher.returncode == 143
    assert sorted(p.name for p in tmp_path.glob("term_*")) == ["term_0", "term_1"]


def test_workers_of_a_launcher_killed_with_sigkill_get_sigterm_and_end(tmp_path):
    """Nothing can forward a signal from a SIGKILLed launcher: the kernel sends its workers SIGTERM."""
    launcher = lockstep_popen(
        "launch", "--num-processes", "2", str(SCRIPTS / "wait_for_signal.py"), str(tmp_path)
    )
    _wait_until_ready(tmp_path, ranks=(0, 1))
    workers = [int((tmp_path / f"ready_{r}").read_text()) for r in range(2)]
    launcher.kill()
    launcher.communicate(timeout=scaled(60))
    deadline = time.monotonic() + scaled(15)
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers), "a worker outlived its killed launcher"
    assert sorted(p.name for p in tmp_path.glob("term_*")) == ["term_0", "term_1"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped by init) is not running
        return stat.read().split(") ", 1)[1][0] != "Z"


def _train_on_two_machines(rdzv_backend: str) -> list[float]:
    port = str(reserved_port())  # machine 1 is told the port before machine 0 binds it
    launchers = [
        lockstep_popen(
            "launch",
            "--num-machines",
            "2",
            "--machine-rank",
            str(rank),
            "--num-processes",
            "2",
            "--main-process-ip",
            "127.0.0.1",
            "--main-process-port",
            port,
            "--rdzv-backend",
            rdzv_backend,
            str(SCRIPTS / "multinode_train.py"),
        )
        for rank in range(2)
    ]
    outputs = [launcher.communicate(timeout=scaled(180)) for launcher in launchers]
    for launcher, (_, stderr) in zip(launchers, outputs):
        assert launcher.returncode == 0, stderr
    line = next(line for line in outputs[0][0].splitlines() if line.startswith("PARAMS "))
    return json.loads(line[7:])


@pytest.mark.parametrize("rdzv_backend", ["static", "c10d"])
def test_two_machines_over_loopback_match_one_process(rdzv_backend):
    params = torch.tensor(_train_on_two_machines(rdzv_backend))
    expected = reference_training(48, 8, 2)
    assert (params - expected).abs().max().item() < 1e-6


@pytest.mark.slow
def test_restart_after_a_crash_works_every_time():
    outcomes = []
    for _ in range(soak_runs(1)):
        result = lockstep(
            "launch", "--num-processes", "2", "--max-restarts", "1", str(SCRIPTS / "crash_once.py")
        )
        restarted = "attempt 1 sum 3" in result.stdout
        said = "a worker failed; restarting all workers of this machine (restart 1 of 1)" in result.stderr
        outcomes.append((result.returncode, restarted and said, result.stderr[-500:]))
    assert all(code == 0 and restarted for code, restarted, _ in outcomes), outcomes


@pytest.mark.parametrize(
    "launcher",
    [["torch.distributed.run"], ["torch.distributed.launch", "--use_env"]],
    ids=["torchrun", "torch.distributed.launch --use_env"],
)
def test_plain_torch_launchers_run_a_lockstep_script(launcher, tmp_path):
    command = [sys.executable, "-m", *launcher, "--nproc_per_node", "2", *TORCHRUN_STANDALONE]
    command += rank_log_flags(tmp_path)  # torchrun's flags too
    result = subprocess.run(
        [*command, str(SCRIPTS / "report_env.py")],
        capture_output=True,
        text=True,
        timeout=scaled(180),
        env=cli_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert [(r["rank"], r["world"], r["type"]) for r in _reports(rank_stdout(tmp_path))] == [
        (0, 2, "MULTI_CPU"),
        (1, 2, "MULTI_CPU"),
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-processes", "0", "x.py"], "--num-processes 0 is invalid: it must be >= 1."),
        (
            ["--num-machines", "2", "--machine-rank", "2", "--num-processes", "2", "x.py"],
            "--machine-rank 2 is invalid with --num-machines 2",
        ),
        (
            ["--num-machines", "2", "--num-processes", "3", "x.py"],
            "must be a multiple of the number of machines",
        ),
        (["--num-processes", "2", "missing_script.py"], "script 'missing_script.py' does not exist."),
        (["--config-file", "no/such/file.yaml", "x.py"], "--config-file 'no/such/file.yaml' does not exist."),
        (["--rdzv-backend", "etcd", "x.py"], "--rdzv-backend 'etcd' is invalid: use 'static' or 'c10d'."),
        (
            ["--mixed-precision", "fp32", "x.py"],
            "--mixed-precision='fp32' is invalid: it must be one of 'no', 'fp16'",
        ),
        (["--use-deepspeed", "--zero-stage", "5", "x.py"], "--zero-stage must be between 0 and 3, got 5"),
        (
            ["--num-processes", "two", "x.py"],
            "argument --num-processes/--num_processes: invalid int value: 'two'",
        ),
        (["--frobnicate", "x.py"], "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(args, message):
    result = lockstep("launch", *args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_config_file_is_named(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("num_processes: two\n")
    result = lockstep("launch", "--config-file", str(config), "x.py", timeout=60)
    assert result.returncode == 2
    assert str(config) in result.stderr and "num_processes" in result.stderr
    assert "Traceback" not in result.stderr
