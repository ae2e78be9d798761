"""A layer written outside ``src/`` (tests/plugins/step_veto.py), installed through its entry point
(``lockstep.layers``), is asked for with every word users have, and hooks the step of a 2-process run: its
launch switch and flags, its config-file section, its ``Accelerator`` keyword and its ``TrainingArguments``
field, with no edit to ``src/lockstep``. In every run the vetoed step leaves the weights as they were (and
``optimizer_step_was_skipped`` is True there), every other step changes them, and each rank's hook is asked
once per step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.cli import REPO, SCRIPTS, cli_env, lockstep
from tests.helpers.rank_output import rank_log_flags, rank_stdout

pytestmark = pytest.mark.distributed

STEPS = 6


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine where the step-veto plugin is an installed distribution."""
    info = tmp_path / "site" / "lockstep_step_veto-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lockstep-step-veto\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lockstep.layers]\nstep_veto = tests.plugins.step_veto:SPEC\n")
    return cli_env(PYTHONPATH=f"{info.parent}{os.pathsep}{REPO}")


def _lines(stdout: str) -> list[dict]:
    found = [json.loads(line.split("LAYER ", 1)[1]) for line in stdout.splitlines() if "LAYER " in line]
    return sorted(found, key=lambda line: line["rank"])


def _report(path: Path) -> dict[int, list[tuple[int, bool]]]:
    by_rank: dict[int, list[tuple[int, bool]]] = {}
    for line in path.read_text().splitlines():
        rank, step, applied = line.split()
        by_rank.setdefault(int(rank), []).append((int(step), applied == "True"))
    return by_rank


def _expect_veto(result, report: Path, vetoed: int, *, steps: int = STEPS) -> None:
    """``report`` is the layer's file; the ``LAYER`` lines are read from each rank's own output, in the
    ``logs`` folder beside it (:func:`rank_log_flags`)."""
    assert result.returncode == 0, result.stderr[-3000:]
    asked = [(step, step != vetoed) for step in range(1, steps + 1)]
    assert _report(report) == {0: asked, 1: asked}
    changed = [step != vetoed for step in range(1, steps + 1)]
    lines = _lines(rank_stdout(report.parent / "logs"))
    for line in lines:
        assert line["changed"] == changed
        if "skipped" in line:
            assert line["skipped"] == [not applied for applied in changed]
    assert len(lines) == 2


def test_the_layer_is_listed_and_its_flags_are_offered(env: dict[str, str]) -> None:
    listed = lockstep("env", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "step_veto" in listed.stdout and "Accelerator(step_veto=...)" in listed.stdout
    helped = lockstep("launch", "--help", env=env)
    assert "--step-veto" in helped.stdout and "--veto-step" in helped.stdout


def test_a_config_file_section_turns_it_on(env: dict[str, str], tmp_path: Path) -> None:
    report = tmp_path / "report"
    config = tmp_path / "config.yaml"
    config.write_text(
        "distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
        f"step_veto_config:\n  veto_step: 3\n  veto_report: {report}\n"
    )
    result = lockstep(
        "launch", *rank_log_flags(tmp_path / "logs"), "--config-file", str(config),
        str(SCRIPTS / "layer_loop.py"), "-", env=env,
    )  # fmt: skip
    _expect_veto(result, report, vetoed=3)


def test_launch_flags_turn_it_on_and_its_check_runs_before_any_process(
    env: dict[str, str], tmp_path: Path
) -> None:
    refused = lockstep("launch", "--cpu", "--num-processes", "2", "--step-veto", "layer_loop.py", env=env)
    assert refused.returncode == 2 and "--step-veto needs --veto-step N" in refused.stderr
    report = tmp_path / "report"
    result = lockstep(
        "launch", *rank_log_flags(tmp_path / "logs"), "--cpu", "--num-processes", "2", "--step-veto",
        "--veto-step", "5", "--veto-report",
        str(report), str(SCRIPTS / "layer_loop.py"), "-", env=env,
    )  # fmt: skip
    _expect_veto(result, report, vetoed=5)


def test_the_accelerator_keyword_turns_it_on(env: dict[str, str], tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = lockstep(
        "launch",
        *rank_log_flags(tmp_path / "logs"),
        *("--cpu", "--num-processes", "2", str(SCRIPTS / "layer_loop.py"), str(report), "keyword"),
        env=env,
    )
    _expect_veto(result, report, vetoed=2)


def test_the_trainer_field_turns_it_on(env: dict[str, str], tmp_path: Path) -> None:
    report = tmp_path / "report"
    result = lockstep(
        "launch", *rank_log_flags(tmp_path / "logs"), "--cpu", "--num-processes", "2",
        str(SCRIPTS / "layer_trainer.py"), str(tmp_path / "out"),
        str(report), env=env,
    )  # fmt: skip
    _expect_veto(result, report, vetoed=3)
