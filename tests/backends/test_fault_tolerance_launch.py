"""``lockstep launch --fault-tolerance`` and its config-file section and Trainer field: bad input refused with
exit code 2 before any process starts, and for real, two launches (one replica group each) of which the first
starts torchft's lighthouse and the second joins it with ``--lighthouse ADDR``; the script builds a plain
``Accelerator()``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lockstep.cli.main import main
from lockstep.trainer.accelerator_factory import fault_tolerance_for
from lockstep.trainer.arguments import TrainingArguments
from tests.helpers.cli import REPO, cli_env, lockstep

SCRIPT = """
import json
import torch
from torch.utils.data import DataLoader
from lockstep import Accelerator

torch.set_num_threads(1)
accelerator = Accelerator()
backend = accelerator.backend
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
report = {"backend": type(backend).__name__, "group": backend.config.replica_group,
          "lighthouse": backend.config.lighthouse, "steps": backend.committed_steps, "ids": ids,
          "weight": model.weight.detach().flatten().tolist()}
print("REPORT " + json.dumps(report), flush=True)
backend.close()
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
        ([*GROUP, "--replica-group", "0", "--use-fsdp"], "with FSDP is not supported yet"),
        ([*GROUP, "--replica-group", "0", "--num-processes", "2"], "a replica group is one process so far"),
        ([*GROUP, "--replica-group", "x"], "--replica-group must be an integer, got 'x'"),
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
    try:
        deadline, address = time.monotonic() + 60, None
        while address is None:
            found = re.search(r"started the torchft lighthouse at (\S+)", first_err.read_text())
            address = found.group(1) if found else None
            assert first.poll() is None, first_err.read_text()[-3000:]
            assert time.monotonic() < deadline, "the first launch printed no lighthouse address in 60 s"
            time.sleep(0.05)
        second = lockstep("launch", *GROUP, "--replica-group", "1", "--lighthouse", address, str(script))
        assert second.returncode == 0, second.stderr[-3000:]
        assert first.wait(timeout=120) == 0, first_err.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    reports = _reports((tmp_path / "first.out").read_text()) + _reports(second.stdout)
    assert [r["group"] for r in reports] == [0, 1]
    assert all(r["backend"] == "FaultTolerantBackend" and r["lighthouse"] == address for r in reports)
    assert all(r["steps"] == 3 for r in reports)
    ids = sorted(i for r in reports for batch in r["ids"] for i in batch)
    assert ids == list(range(12))  # the two groups shared each step's batches: 3 steps x 2 groups x 2
    assert reports[0]["weight"] == reports[1]["weight"]  # averaged gradients: one model
    assert not torch.equal(torch.tensor(reports[0]["weight"]), torch.zeros(4))
