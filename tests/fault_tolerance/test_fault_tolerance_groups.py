"""Replica groups of two processes each, FSDP2 (then DDP) inside every group, torchft across them: a process of group 1
is SIGKILLed mid-run, the launcher restarts group 1 (``--max-restarts 1``), its two new processes heal from
group 0's (rank r from rank r, each its own shard) and rejoin, while group 0 keeps its processes and steps on
alone. Two ``lockstep launch`` runs (tests/helpers/ft_group_worker.py) around a lighthouse started here.
The reference is the hand-written replay of tests/helpers/ft_heal_worker.py over the logged steps: each
committed step on the average of the global batches its readers (every process of every participating
group) read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import ft_group_worker
from tests.helpers import ft_heal_worker as worker
from tests.helpers.cli import cli_env
from tests.helpers.deadlines import scaled, wait_for
from tests.helpers.ft_lighthouse import lighthouse_process

pytest.importorskip("torchft")
ROOT = Path(__file__).resolve().parents[2]
GROUPS, PROCESSES, SEED, RELAUNCH_SEED = 2, 2, 0, 7
STEPS = {"fsdp2": 1500, "ddp": 3000}
"""Steps of the run, by layout: no group waits for another, so group 0 steps on alone while group 1's launch
restarts it and the restarted group rejoins before group 0 finishes. Measured in a CI run (2 cores, load from
other tests): group 0 took 12 s for 1,500 DDP steps after the kill, and the restart 12 s to reach its quorum,
too late; 3,000 DDP steps leave it as long again (idle: 51 s for the DDP run). An FSDP2 step costs about
twice a DDP step, so 1,500 give it the same time."""
KILL_AFTER = 2
"""Group 1's rank 1 is killed once it committed this step."""


def _epoch(steps: int) -> int:
    """The global batches of an epoch of the run's loader."""
    return worker.epoch_batches(GROUPS * PROCESSES, steps)


def _launch(
    folder: Path, group: int, lighthouse: str, layout: list[str], steps: int, *flags: str
) -> subprocess.Popen:
    command = [
        *("launch", "--cpu", "--num-processes", str(PROCESSES), *layout, *flags),
        *("--fault-tolerance", "--replica-group", str(group), "--num-replica-groups", str(GROUPS)),
        *("--lighthouse", lighthouse, "--quorum-timeout", "20"),
        *(
            str(ROOT / "tests/helpers/ft_group_worker.py"),
            str(steps),
            str(folder),
            str(SEED),
            str(RELAUNCH_SEED),
        ),
    ]
    with open(folder / f"launch{group}.err", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "lockstep.cli.main", *command],
            cwd=folder,  # where a failing run's reports go
            env=cli_env(OMP_NUM_THREADS="1"),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


def _lines(folder: Path, name: str) -> list[dict]:
    """The lines ``name`` wrote so far (a line still being written is left for the next read)."""
    path = folder / f"{name}.steps"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def _committed_step(folder: Path, name: str, launch: subprocess.Popen, step: int) -> dict:
    """The line of ``name``'s first committed iteration at ``step`` or later, once written."""

    def committed() -> dict | None:
        found = [line for line in _lines(folder, name) if line["step"] >= step and line["committed"]]
        if found:
            return found[0]
        if launch.poll() is not None:
            steps = folder / f"{name}.steps"
            raise AssertionError(
                f"group {name[1]} exited {launch.returncode} before {name} committed step {step}; its steps: "
                f"{steps.read_text() if steps.is_file() else None}\n{(folder / f'launch{name[1]}.err').read_text()[-3000:]}"
            )
        return None

    return wait_for(committed, 90, f"{name} committing step {step}")


@contextlib.contextmanager
def _one_process_killed(folder: Path, layout: list[str], steps: int) -> Iterator[dict]:
    with lighthouse_process(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=10_000) as (
        _,
        address,
    ):
        launches: dict[int, subprocess.Popen] = {}
        try:
            launches[0] = _launch(folder, 0, address, layout, steps)
            launches[1] = _launch(folder, 1, address, layout, steps, "--max-restarts", "1")
            victim = _committed_step(folder, "g1a0r1", launches[1], KILL_AFTER)["pid"]
            os.kill(victim, signal.SIGKILL)
            killed = time.time()
            for group, launch in launches.items():
                code = launch.wait(timeout=scaled(180))
                assert code == 0, (
                    f"group {group} exited {code}:\n{(folder / f'launch{group}.err').read_text()[-4000:]}"
                )
            survivor, restarted = _lines(folder, "g0a0r0"), _lines(folder, "g1a1r0")
            assert restarted, (  # its restart came after group 0's last step: the run was too short here
                f"group 1's restart trained no step: killed at {killed:.2f}, group 0 ended at "
                f"{survivor[-1]['time']:.2f}:\n{(folder / 'launch1.err').read_text()[-3000:]}"
            )
            yield {
                "steps": steps,
                "victim": victim,
                "lines": {path.stem: _lines(folder, path.stem) for path in folder.glob("*.steps")},
                "records": {path.stem: torch.load(path) for path in folder.glob("*.pt")},
                "stderr": {group: (folder / f"launch{group}.err").read_text() for group in launches},
            }
        finally:
            for launch in launches.values():
                if launch.poll() is None:
                    launch.kill()
                launch.wait()


@pytest.fixture(scope="module", params=["fsdp2", "ddp"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The run with FSDP2 inside each group, then with DDP."""
    layout = ["--use-fsdp"] if request.param == "fsdp2" else []
    folder = tmp_path_factory.mktemp(f"ft_groups_{request.param}")
    with _one_process_killed(folder, layout, STEPS[request.param]) as results:
        yield results


def test_group_0_keeps_its_processes_and_steps_alone_while_group_1_is_down(run: dict) -> None:
    lines, records = run["lines"], run["records"]
    assert sorted(records) == ["g0a0r0", "g0a0r1", "g1a1r0", "g1a1r1"]  # group 1's first life never finished
    for rank in range(PROCESSES):
        name = f"g0a0r{rank}"
        assert {line["pid"] for line in lines[name]} == {records[name]["pid"]}  # one process throughout
        assert [line["step"] for line in lines[name] if line["committed"]] == list(range(run["steps"]))
    participants = [line["participants"] for line in lines["g0a0r0"]]
    assert participants[0] == GROUPS and participants[-1] == GROUPS and 1 in participants
    assert run["victim"] in {line["pid"] for line in lines["g1a0r1"]}
    notice = "lockstep launch: a worker failed; restarting all workers of this machine (restart 1 of 1)."
    assert notice in run["stderr"][1] and "restarting" not in run["stderr"][0]


def test_each_restarted_process_healed_from_the_same_rank_of_group_0(run: dict) -> None:
    lines, records = run["lines"], run["records"]
    for rank in range(PROCESSES):
        heal = records[f"g1a1r{rank}"]["heal"]
        assert heal is not None and heal["replica_group"] == 0
        assert heal["pid"] == records[f"g0a0r{rank}"]["pid"]  # rank r's shard came from rank r
        joined = lines[f"g1a1r{rank}"][0]["step"]
        assert heal["step"] == joined > KILL_AFTER
    assert "replica group 1 healed from replica group 0" in run["stderr"][1]


def test_every_committed_step_read_distinct_batches_and_each_sample_of_the_epoch_once(run: dict) -> None:
    steps = worker.committed_lines(run["lines"]["g0a0r0"])
    committed: dict[int, dict[str, dict]] = {}  # step -> process name -> its committed line of that step
    for name, lines in run["lines"].items():
        for other in lines:
            if other["committed"]:
                committed.setdefault(other["step"], {})[name] = other
    epoch, consumed, used, dying, whole = 0, 0, [], [], _epoch(run["steps"])
    for step in range(run["steps"]):
        line = steps[step]
        assert (line["epoch"], line["consumed"]) == (epoch, consumed), step
        assert line["readers"] == line["participants"] * PROCESSES
        found = committed.get(step, {})
        expected = worker.step_batches(line, line["readers"])  # distinct, from the position on
        if len(found) < line["readers"]:
            _assert_the_step_group_1_died_in(run["lines"], step, found, line["readers"])
            dying.append(step)
            assert set(other["batch"] for other in found.values()) <= set(expected)
        else:  # every process of every participating group read one batch
            assert len(found) == line["readers"], step
            assert sorted(other["batch"] for other in found.values()) == expected, step
        for other in found.values():
            assert other["ids"] == worker.batch_ids(other["batch"] % whole)
        if epoch == 0:
            used += [b for b in expected if b < whole]
        consumed += line["readers"]
        if consumed >= whole:
            epoch, consumed = epoch + 1, 0
    assert sorted(used) == list(range(whole))  # epoch 0: every global batch exactly once
    assert epoch >= 1
    assert len(dying) <= 1, dying


def _assert_the_step_group_1_died_in(
    lines: dict[str, list[dict]], step: int, found: dict, readers: int
) -> None:
    """A committed step of group 0 that counts group 1's processes as readers, of which only some committed it:
    torchft's commit decision is each group's own, so group 0 committed the step with group 1's gradients
    averaged in while group 1's first life was being killed (before its processes agreed to commit, or before
    they wrote the line). That may hold only for the step group 1's first life died in: its missing readers
    are its processes, and none of them committed a later step."""
    first_life = [name for name in lines if name.startswith("g1a0")]
    assert readers - len(found) <= PROCESSES, (step, sorted(found))
    assert all(name.startswith("g0") or name in first_life for name in found), (step, sorted(found))
    assert all(f"g0a0r{rank}" in found for rank in range(PROCESSES)), (step, sorted(found))
    assert step > KILL_AFTER  # the victim committed KILL_AFTER and wrote its line before it was killed
    for name in first_life:
        committed = [other["step"] for other in lines[name] if other["committed"]]
        assert max(committed, default=-1) <= step, (name, step, committed)


def test_both_groups_end_bitwise_equal_and_match_the_replay(run: dict) -> None:
    first, restarted = run["records"]["g0a0r0"]["weights"], run["records"]["g1a1r0"]["weights"]
    for name, value in first.items():
        assert torch.equal(restarted[name], value), name
    expected = worker.replay(
        run["lines"]["g0a0r0"],
        seed=SEED,
        epoch=_epoch(run["steps"]),
        readers="readers",
        processes=PROCESSES,
        gamma=ft_group_worker.GAMMA,
    )
    for name, value in expected.items():
        torch.testing.assert_close(first[name], value, rtol=0, atol=1e-6)
    assert not torch.equal(worker.model(RELAUNCH_SEED).weight, worker.model(SEED).weight)


def test_each_group_evaluates_the_whole_set_and_gathers_each_sample_once(run: dict) -> None:
    """After training, every process of both groups (group 1's restarted ones too) reads an evaluation pass
    in eval mode: gather_for_metrics returns every sample once, in order, with the final model's outputs."""
    from tests.helpers.ft_group_worker import EVAL_SAMPLES

    final = [name for name in run["records"] if name.startswith(("g0a0", "g1a1"))]
    assert len(final) == GROUPS * PROCESSES
    net = worker.model(SEED)
    net.load_state_dict(run["records"]["g0a0r0"]["weights"])
    with torch.no_grad():
        expected = net(worker.inputs_of(torch.arange(EVAL_SAMPLES)))
    for name in final:
        evaluated = run["records"][name]["evaluated"]
        assert evaluated["ids"] == list(range(EVAL_SAMPLES)), name
        torch.testing.assert_close(evaluated["outputs"], expected, rtol=0, atol=1e-6)
