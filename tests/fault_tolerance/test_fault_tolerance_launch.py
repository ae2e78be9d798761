"""``lockstep launch --fault-tolerance`` and its config-file section and Trainer field: bad input refused with
exit code 2 before any process starts, and for real, two launches (one replica group each) of which the first
starts torchft's lighthouse and the second joins it with ``--lighthouse ADDR``; the script builds a plain
``Accelerator()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lockstep.cli.main import main
from lockstep.config.backend_specs import add_on_arguments
from lockstep.trainer.arguments import TrainingArguments
from tests.helpers.cli import REPO, cli_env, lockstep
from tests.helpers.deadlines import scaled, wait_for
from tests.helpers.ft_lighthouse import lighthouse_process

SCRIPT = """
import json
import torch
from torch.utils.data import DataLoader
from lockstep import Accelerator
from lockstep.backends import LiveRecovery

torch.set_num_threads(1)
accelerator = Accelerator()
layer = accelerator.capability(LiveRecovery)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = DataLoader(torch.arange(40), batch_size=2)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
ids = []
for step, batch in zip(range(3), data):
    inputs = torch.stack([torch.randn(4, generator=torch.Generator().manual_seed(int(i))) for i in batch])
    accelerator.backward(model(inputs).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    ids.append(batch.tolist())
report = {"layer": type(layer).__name__, "group": layer.config.replica_group,
          "lighthouse": layer.config.lighthouse, "steps": layer.committed_steps, "ids": ids,
          "weight": model.weight.detach().flatten().tolist()}
print("REPORT " + json.dumps(report), flush=True)
layer.close()
"""
GROUP = ["--fault-tolerance", "--num-replica-groups", "2", "--cpu"]
FIRST = ["--replica-group", "0", "--min-replicas", "2", "--lighthouse-port", "0"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fault-tolerance"], "needs --replica-group"),
        (["--replica-group", "2", "--num-replica-groups", "2"], "groups are numbered 0 to 1"),
        (["--replica-group", "0", "--num-replica-groups", "2", "--min-replicas", "3"], "min_replicas=3"),
        ([*GROUP, "--replica-group", "0", "--quorum-timeout", "0"], "positive, finite"),
        ([*GROUP, "--replica-group", "0", "--use-deepspeed"], "with DeepSpeed is not supported yet"),
        ([*GROUP, "--replica-group", "x"], "a replica group's number (>= 0), or 'all' to start every group"),
        ([*GROUP, "--replica-group", "all", "--num-machines", "2"], "and --num-machines is 2"),
        ([*GROUP, "--replica-group", "all", "--main-process-port", "29501"], "--main-process-port (29501)"),
    ],
)
def test_bad_fault_tolerance_flags_exit_2_with_the_reason(
    flags: list[str], message: str, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.touch()
    assert main(["launch", *flags, str(script)]) == 2
    assert message in capsys.readouterr().err


def test_the_config_file_section_is_checked_like_the_flags(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    script, config = tmp_path / "train.py", tmp_path / "ft.yaml"
    script.touch()
    config.write_text(
        "fault_tolerance_config:\n  replica_group: 0\n  num_replica_groups: 1\n  min_replicas: 2\n"
    )
    assert main(["launch", "--config-file", str(config), str(script)]) == 2
    assert "min_replicas=2, num_replica_groups=1" in capsys.readouterr().err


def fault_tolerance_for(args: TrainingArguments) -> Any:
    """The ``Accelerator(fault_tolerance=...)`` the Trainer passes for ``args``."""
    return add_on_arguments(lambda field: getattr(args, field))["fault_tolerance"]


def test_the_trainer_field_takes_the_sections_keys() -> None:
    pytest.importorskip("torchft")
    section = {"replica_group": 1, "num_replica_groups": 2, "lighthouse": "http://h:1", "quorum_timeout": 5}
    config = fault_tolerance_for(TrainingArguments(output_dir="out", fault_tolerance=section))
    assert (config.replica_group, config.num_replica_groups, config.lighthouse, config.timeout) == (
        1,
        2,
        "http://h:1",
        5.0,
    )
    text = '{"replica_group": 0, "num_replica_groups": 1}'
    assert (
        fault_tolerance_for(TrainingArguments(output_dir="out", fault_tolerance=text)).num_replica_groups == 1
    )
    with pytest.raises(ValueError, match="has no key 'replica'; its keys: replica_group"):
        fault_tolerance_for(TrainingArguments(output_dir="out", fault_tolerance={"replica": 0}))
    with pytest.raises(ValueError, match="replica_group='all' starts every group from `lockstep launch`"):
        section = {"replica_group": "all", "num_replica_groups": 2}
        fault_tolerance_for(TrainingArguments(output_dir="out", fault_tolerance=section))


def _reports(text: str) -> list[dict]:
    return [json.loads(line.split("REPORT ", 1)[1]) for line in text.splitlines() if "REPORT " in line]


def test_one_launch_starts_the_lighthouse_and_another_joins_it(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    first_err = tmp_path / "first.err"
    with open(first_err, "w") as err, open(tmp_path / "first.out", "w") as out:
        first = subprocess.Popen(
            [sys.executable, "-m", "lockstep.cli.main", "launch", *GROUP, *FIRST, str(script)],
            stdout=out,
            stderr=err,
            env=cli_env(),
            cwd=REPO,
        )

    def lighthouse_address() -> str | None:
        assert first.poll() is None, first_err.read_text()[-3000:]
        found = re.search(r"started the torchft lighthouse at (\S+)", first_err.read_text())
        return found.group(1) if found else None

    try:
        address = wait_for(lighthouse_address, 60, "the first launch printing its lighthouse address")
        second = lockstep("launch", *GROUP, "--replica-group", "1", "--lighthouse", address, str(script))
        assert second.returncode == 0, second.stderr[-3000:]
        assert first.wait(timeout=scaled(120)) == 0, first_err.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    reports = _reports((tmp_path / "first.out").read_text()) + _reports(second.stdout)
    assert [r["group"] for r in reports] == [0, 1]
    assert all(r["layer"] == "FaultTolerance" and r["lighthouse"] == address for r in reports)
    assert all(r["steps"] == 3 for r in reports)
    ids = sorted(i for r in reports for batch in r["ids"] for i in batch)
    assert ids == list(range(12))  # the two groups shared each step's batches: 3 steps x 2 groups x 2
    assert reports[0]["weight"] == reports[1]["weight"]  # averaged gradients: one model
    assert not torch.equal(torch.tensor(reports[0]["weight"]), torch.zeros(4))


def test_a_group_of_two_processes_without_a_quorum_says_so_and_writes_no_hang_report(tmp_path: Path) -> None:
    """A group of two processes whose quorum never forms (the lighthouse waits for 2 groups; 1 starts) ends
    with the quorum error (exit 1), not a hang report: the error's text says "timeout", which lockstep's hang
    diagnosis would otherwise take for a collective's."""
    pytest.importorskip("torchft")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with lighthouse_process(min_replicas=2) as (_, address):
        flags = [
            "--num-processes",
            "2",
            "--replica-group",
            "0",
            "--lighthouse",
            address,
            "--quorum-timeout",
            "2",
        ]
        result = subprocess.run(
            [sys.executable, "-m", "lockstep.cli.main", "launch", *GROUP, *flags, str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env=cli_env(),
            cwd=tmp_path,
        )
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"got no quorum from the torchft lighthouse at {address} within 2 s" in result.stderr
    assert "hang detected" not in result.stderr and not (tmp_path / "lockstep_hang").exists()


def test_one_launch_runs_every_group_on_this_machine(tmp_path: Path) -> None:
    """``--replica-group all``: one command starts the lighthouse and both groups, which share each step's
    batches and end with one model."""
    pytest.importorskip("torchft")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    every = ["--replica-group", "all", "--min-replicas", "2", "--lighthouse-port", "0"]
    result = lockstep("launch", *GROUP, *every, str(script), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"started replica groups 0-1 \(pids \d+, \d+\), each a launch of its own", result.stderr)
    reports = sorted(_reports(result.stdout), key=lambda report: report["group"])
    assert [r["group"] for r in reports] == [0, 1] and all(r["steps"] == 3 for r in reports)
    assert reports[0]["lighthouse"] == reports[1]["lighthouse"]
    assert sorted(i for r in reports for batch in r["ids"] for i in batch) == list(range(12))
    assert reports[0]["weight"] == reports[1]["weight"]


WAITING_SCRIPT = SCRIPT.replace(
    "layer.close()", "print('WAITING', flush=True)\n__import__('time').sleep(120)"
)
"""Trains, reports, then waits (it never asks should_stop, so SIGTERM ends it)."""


def test_a_stop_signal_reaches_every_group_of_one_launch(tmp_path: Path) -> None:
    """SIGTERM to a ``--replica-group all`` launch is passed on to both groups' launches, which stop their
    workers: the launch ends with 143 within seconds, and no group's launch is left running."""
    pytest.importorskip("torchft")
    script = tmp_path / "train.py"
    script.write_text(WAITING_SCRIPT)
    every = ["--replica-group", "all", "--min-replicas", "2", "--lighthouse-port", "0"]
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout, open(tmp_path / "err.txt", "w") as stderr:
        launch = subprocess.Popen(
            [sys.executable, "-m", "lockstep.cli.main", "launch", *GROUP, *every, str(script)],
            stdout=stdout,
            stderr=stderr,
            env=cli_env(),
            cwd=tmp_path,
        )
    pids: list[int] = []

    def both_wait() -> bool:  # both groups trained and wait
        assert launch.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
        return out.read_text().count("WAITING") >= 2

    try:
        wait_for(both_wait, 90, "the groups finishing their training", interval=0.05)
        pids = [int(p) for p in re.findall(r"\(pids (\d+), (\d+)\)", (tmp_path / "err.txt").read_text())[0]]
        launch.send_signal(signal.SIGTERM)
        assert launch.wait(timeout=scaled(60)) == 143, (tmp_path / "err.txt").read_text()[-3000:]
        for pid in pids:  # the groups' launches are gone (the launch waited for them)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        for pid in pids:  # each group's launch leads a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    err = (tmp_path / "err.txt").read_text()
    assert err.count("received SIGTERM; the workers were stopped") == 2


def test_every_group_on_one_machine_shares_out_the_cores_unless_the_threads_are_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from lockstep.layers.fault_tolerance import all_groups

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    two_each = SimpleNamespace(processes_per_machine=2, num_cpu_threads_per_process=None)
    assert all_groups._threads_per_process(2, two_each) == 4  # 16 cores over 2 groups x 2 processes
    assert all_groups._threads_per_process(3, SimpleNamespace(processes_per_machine=8)) == 1
    assert all_groups._threads_per_process(2, SimpleNamespace(num_cpu_threads_per_process=3)) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert all_groups._threads_per_process(2, two_each) is None  # the environment's, as for one group
