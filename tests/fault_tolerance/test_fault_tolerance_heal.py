"""A replica group killed mid-run is relaunched, heals from a live peer through torchft (no checkpoint) and
rejoins: one launch of 3 groups (tests/helpers/ft_heal_worker.py) around a lighthouse started here, checked
several ways. The reference is written by hand: each committed step's gradients of the participating groups
on the sample ids they logged, averaged, clipped, then an SGD-with-momentum step at the schedule's rate.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import ft_heal_worker as worker
from tests.helpers.deadlines import scaled, wait_for
from tests.helpers.ft_lighthouse import lighthouse_process

pytest.importorskip("torchft")
ROOT = Path(__file__).resolve().parents[2]
GROUPS, STEPS, SEED, RELAUNCH_SEED = 3, 1200, 0, 7
"""Steps of the run: no group waits for another, so the survivors train on while the relaunched group starts
(a few seconds, more under load), and it joins them long before they finish."""
KILL_AFTER = random.Random(25).choice([1, 2])


def _start(folder: Path, name: str, group: int, lighthouse: str, seed: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    arguments = [
        str(group),
        str(GROUPS),
        lighthouse,
        str(STEPS),
        str(folder / f"{name}.pt"),
        str(seed),
        *("--pause", "0"),
    ]
    with open(folder / f"{name}.err", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.ft_heal_worker", *arguments],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


def _lines(folder: Path, name: str) -> list[dict]:
    path = folder / f"{name}.pt.steps"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait_for_step(
    folder: Path, name: str, process: subprocess.Popen, step: int, timeout: float = 60
) -> None:
    def committed() -> bool:
        if any(line["step"] >= step and line["committed"] for line in _lines(folder, name)):
            return True
        if process.poll() is not None:
            raise AssertionError(
                f"{name} exited {process.returncode}:\n{(folder / f'{name}.err').read_text()[-3000:]}"
            )
        return False

    wait_for(committed, timeout, f"{name} committing step {step}")


@contextlib.contextmanager
def _killed_and_relaunched(folder: Path) -> Iterator[dict]:
    """Groups 0-2 train; group 2 is SIGKILLed after step KILL_AFTER and started again with another seed."""
    lighthouse = lighthouse_process(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=10_000)
    processes: dict[str, subprocess.Popen] = {}
    with lighthouse as (_, address):
        try:
            for group in range(GROUPS):
                processes[f"group{group}"] = _start(folder, f"group{group}", group, address, SEED)
            _wait_for_step(folder, "group2", processes["group2"], KILL_AFTER)
            processes["group2"].send_signal(signal.SIGKILL)
            assert processes["group2"].wait(timeout=scaled(10)) == -signal.SIGKILL
            _wait_for_step(
                folder, "group0", processes["group0"], KILL_AFTER + 1
            )  # the survivors step on without it
            processes["relaunched"] = _start(folder, "relaunched", 2, address, RELAUNCH_SEED)
            results = {}
            for name in ("group0", "group1", "relaunched"):
                code = processes[name].wait(timeout=scaled(120))
                assert code == 0, f"{name} exited {code}:\n{(folder / f'{name}.err').read_text()[-3000:]}"
                results[name] = {**torch.load(folder / f"{name}.pt"), "lines": _lines(folder, name)}
            results["first_life"] = {"pid": processes["group2"].pid, "lines": _lines(folder, "group2")}
            results["relaunched"]["stderr"] = (folder / "relaunched.err").read_text()
            results["pids"] = {name: process.pid for name, process in processes.items()}
            yield results
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
                process.wait()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    with _killed_and_relaunched(tmp_path_factory.mktemp("ft_heal")) as results:
        yield results


EPOCH = worker.epoch_batches(GROUPS, STEPS)


def _committed(lines: list[dict]) -> dict[int, dict]:
    return worker.committed_lines(lines)


def _step_batches(line: dict) -> list[int]:
    """The global batches a committed step used: its participants' ranks from the position on."""
    return worker.step_batches(line, line["participants"])


def _replay(lines: list[dict]) -> dict[str, torch.Tensor]:
    return worker.replay(lines, seed=SEED, epoch=EPOCH)


def test_the_survivors_keep_their_processes_and_every_step(run: dict) -> None:
    assert run["group0"]["pid"] == run["pids"]["group0"] and run["group1"]["pid"] == run["pids"]["group1"]
    lines = run["group0"]["lines"]
    same = ("step", "committed", "participants", "epoch", "consumed")
    assert [{k: line[k] for k in same} for line in run["group1"]["lines"]] == [
        {k: line[k] for k in same} for line in lines
    ]  # one quorum, one commit decision, one data position per step on both
    committed = [line["step"] for line in lines if line["committed"]]
    assert committed == list(range(STEPS))
    assert lines[0]["participants"] == GROUPS and lines[-1]["participants"] == GROUPS
    assert any(line["participants"] == 2 for line in lines)  # while group 2 was gone


def test_every_sample_of_the_epoch_is_used_once_by_a_committed_step(run: dict) -> None:
    """The logged positions tile the epochs (each committed step takes the next global batches, one per
    participant; a step that did not commit takes none and its batches are read again), and every line any
    group logged for a committed step read one of that step's batches, at its own rank."""
    steps = _committed(run["group0"]["lines"])
    epoch, consumed, used = 0, 0, {}
    for step in range(STEPS):
        line = steps[step]
        assert (line["epoch"], line["consumed"]) == (epoch, consumed), step
        for batch in _step_batches(line):
            used.setdefault(line["epoch"], []).append(batch)
        consumed += line["participants"]
        if consumed >= EPOCH:
            epoch, consumed = epoch + 1, 0
    assert sorted(b for b in used[0] if b < EPOCH) == list(range(EPOCH))  # epoch 0, each batch exactly once
    assert epoch >= 1 and sorted(used.get(1, [])) == list(range(len(used.get(1, []))))  # epoch 1's start
    everyone = [run[name]["lines"] for name in ("group0", "group1", "relaunched")] + [
        run["first_life"]["lines"]
    ]
    for lines in everyone:
        for line in lines:
            if not line["committed"]:
                continue
            expected = steps[line["step"]]
            assert (line["epoch"], line["consumed"]) == (expected["epoch"], expected["consumed"])
            assert line["batch"] == line["consumed"] + line["rank"] and line["rank"] < line["participants"]
            assert line["ids"] == worker.batch_ids(line["batch"] % EPOCH)
            assert line["padded"] == (line["batch"] >= EPOCH)
    for step, line in steps.items():  # the participants of each step read distinct batches
        ranks = [
            other["rank"]
            for lines in everyone
            for other in lines
            if other["committed"] and other["step"] == step
        ]
        assert len(ranks) == len(set(ranks)) <= line["participants"]
    survivors = run["group0"]["lines"]
    for before, after in itertools.pairwise(survivors):
        if not before["committed"]:  # its samples were not consumed: the next step reads from the same place
            assert (after["epoch"], after["consumed"]) == (before["epoch"], before["consumed"])


def test_the_relaunched_group_healed_from_a_live_peer(run: dict) -> None:
    heal, lines = run["relaunched"]["heal"], run["relaunched"]["lines"]
    assert heal is not None and heal["replica_group"] in (0, 1)
    assert heal["pid"] == run["pids"][f"group{heal['replica_group']}"]
    joined = lines[0]["step"]
    assert heal["step"] == joined > KILL_AFTER  # it started at the peer's step, not at 0
    line = f"replica group 2 healed from replica group {heal['replica_group']} (pid {heal['pid']}) at step {joined}"
    assert line in run["relaunched"]["stderr"]
    assert all(line["participants"] == GROUPS for line in lines)
    # Its loader continued where its peers stood: the same steps at the same data positions.
    survivors = run["group0"]["lines"]
    rejoin = next(
        i for i, line in enumerate(survivors) if line["step"] == joined and line["participants"] == 3
    )
    position = ("step", "epoch", "consumed", "committed")
    assert [{k: line[k] for k in position} for line in lines] == [
        {k: line[k] for k in position} for line in survivors[rejoin:]
    ]
    assert run["first_life"]["lines"][0]["step"] == 0  # the lost group had trained from the start


def test_all_groups_end_bitwise_equal_and_match_the_replay(run: dict) -> None:
    weights = [run[name]["weights"] for name in ("group0", "group1", "relaunched")]
    for name, value in weights[0].items():
        for other in weights[1:]:
            assert torch.equal(other[name], value), name
    expected = _replay(run["group0"]["lines"])
    for name, value in expected.items():
        # three-way sums in gloo's ring order differ from the replay's order by rounding only
        torch.testing.assert_close(weights[0][name], value, rtol=0, atol=1e-6)
    unhealed = worker.model(RELAUNCH_SEED).state_dict()
    assert not torch.equal(unhealed["weight"], worker.model(SEED).state_dict()["weight"])
