"""The lighthouse is lost while 2 replica groups train (each saving its state after every committed step):
both stop with lockstep's error naming the lighthouse within a bounded time; a restart of everything (a new
lighthouse, both groups with another seed) resumes with ``resume_from_latest_checkpoint()`` and ends where
an uninterrupted run ends (a hand-written replay). Workers: tests/helpers/ft_heal_worker.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ft_heal_worker as worker
from tests.helpers.deadlines import scaled, wait_for
from tests.helpers.ft_lighthouse import lighthouse_process

pytest.importorskip("torchft")
ROOT = Path(__file__).resolve().parents[2]
GROUPS, STEPS, STOP_AFTER, SEED, RESTART_SEED = 2, 7, 3, 0, 7
TIMEOUT = 3.0
"""FaultToleranceConfig(timeout=...) of the groups: a lost lighthouse stops them within this (and the step
they were in)."""


def _start(folder: Path, name: str, group: int, lighthouse: str, seed: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    arguments = [str(group), str(GROUPS), lighthouse, str(STEPS), str(folder / f"{name}.pt"), str(seed)]
    options = ["--timeout", str(TIMEOUT), "--project", str(folder / f"project{group}")]
    with open(folder / f"{name}.err", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.ft_heal_worker", *arguments, *options],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


def _committed(folder: Path, name: str) -> int:
    path = folder / f"{name}.pt.steps"
    lines = path.read_text().splitlines() if path.is_file() else []
    return sum('"committed": true' in line for line in lines)


def _expected_ids(group: int, step: int) -> list[int]:
    """Both groups take part in every step: step ``s`` reads global batches 2s and 2s + 1 of the data."""
    return worker.batch_ids((GROUPS * step + group) % worker.epoch_batches(GROUPS, STEPS))


def _replay(steps: int) -> dict[str, torch.Tensor]:
    """An uninterrupted run: every step averages both groups' batches, clips, steps SGD with momentum at
    the StepLR rate of that step."""
    model = worker.model(SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=worker.LR, momentum=worker.MOMENTUM)
    for step in range(steps):
        grads = []
        for group in range(GROUPS):
            model.zero_grad()
            worker.loss_of(model, torch.tensor(_expected_ids(group, step))).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for index, parameter in enumerate(model.parameters()):
            parameter.grad = (grads[0][index] + grads[1][index]) / GROUPS
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), worker.MAX_NORM)
        optimizer.param_groups[0]["lr"] = worker.LR * worker.GAMMA**step
        optimizer.step()
    return model.state_dict()


def _wait_for_commits(folder: Path, processes: list[subprocess.Popen], count: int) -> None:
    def committed() -> bool:
        for group, process in enumerate(processes):
            if process.poll() is not None:
                err = (folder / f"first{group}.err").read_text()[-3000:]
                raise AssertionError(f"group {group} exited {process.returncode}:\n{err}")
        return min(_committed(folder, f"first{g}") for g in range(GROUPS)) >= count

    wait_for(committed, 60, f"the groups committing {count} steps")


def test_a_lost_lighthouse_stops_the_groups_and_a_restart_resumes_exactly(tmp_path: Path) -> None:
    with lighthouse_process(min_replicas=GROUPS) as (lighthouse, address):
        first = [_start(tmp_path, f"first{g}", g, address, SEED) for g in range(GROUPS)]
        try:
            _wait_for_commits(tmp_path, first, STOP_AFTER)
            lighthouse.kill()
            killed = time.monotonic()
            codes = [process.wait(timeout=scaled(60)) for process in first]
            stopped = time.monotonic() - killed
        finally:
            for process in first:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    assert codes == [1] * GROUPS
    # the quorum's timeout (the product's number), then the step in flight and the exit; never a hang
    assert stopped < TIMEOUT + scaled(10)
    stops = [(tmp_path / f"first{g}.pt.error").read_text().split("\n", 1) for g in range(GROUPS)]
    for _, message in stops:
        assert f"got no quorum from the torchft lighthouse at {address} within 3 s" in message
    stop_step = int(stops[0][0])
    assert stop_step >= STOP_AFTER and all(int(step) == stop_step for step, _ in stops)

    with lighthouse_process(min_replicas=GROUPS) as (_, address):
        second = [_start(tmp_path, f"second{g}", g, address, RESTART_SEED) for g in range(GROUPS)]
        try:
            codes = [process.wait(timeout=scaled(120)) for process in second]
        finally:
            for process in second:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    errors = [(tmp_path / f"second{g}.err").read_text()[-3000:] for g in range(GROUPS)]
    assert codes == [0] * GROUPS, errors
    results = [torch.load(tmp_path / f"second{g}.pt") for g in range(GROUPS)]
    for group, result in enumerate(results):
        assert result["resumed"] is not None and result["resumed_at"] == stop_step
        lines = (tmp_path / f"second{group}.pt.steps").read_text().splitlines()
        assert len(lines) == STEPS - stop_step  # it continued, it did not start over
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value), name
    expected = _replay(STEPS)
    for name, value in expected.items():
        assert torch.equal(results[0]["weights"][name], value), name
