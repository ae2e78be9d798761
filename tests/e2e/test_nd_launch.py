"""N-D parallelism from the launcher: ``--parallelism-config-*`` flags (both spellings) and the config file's
``parallelism_config:`` section reach the workers, and bad sizes fail before any process starts."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cli import REPO, lockstep
from tests.helpers.in_process_launch import launched_in_process
from tests.helpers.optional import requires

pytestmark = pytest.mark.distributed
SCRIPT = "tests/scripts/nd_launch_train.py"
ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
num_machines: 1
num_processes: 2
use_cpu: true
parallelism_config:
  parallelism_config_dp_replicate_size: 1
  parallelism_config_dp_shard_size: 1
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
  parallelism_config_cp_comm_strategy: allgather
"""


def _launch(tmp_path, name: str, *flags: str) -> dict:
    out = tmp_path / f"{name}.json"
    result = lockstep("launch", "--cpu", *flags, SCRIPT, str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def _matches(report: dict, expected: dict) -> None:
    assert report["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    diff = max(abs(a - b) for a, b in zip(report["params"], expected["params"], strict=True))
    assert diff <= 1e-6


# Each launch costs 15-25 s on the 2-core CI machine: one 1-process run is the reference of both tests, tensor
# parallelism comes from an Accelerate config file and context parallelism from flags (both spellings). The
# reference's launch is not what is tested: its worker forks from this process, with the launch's settings.
@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single") / "single.json"
    launched_in_process(["--cpu", "--num-processes", "1"], str(REPO / SCRIPT), [str(out)])
    return json.loads(out.read_text())


@requires("transformers")
def test_cp_flags_launch_two_processes_that_match_one_process(tmp_path, one_process):
    cp = _launch(
        tmp_path, "cp", "--num_processes", "2", "--use_parallelism_config", "--parallelism-config-cp-size", "2",
        "--parallelism_config_cp_comm_strategy", "alltoall",
    )  # fmt: skip
    assert one_process["mesh"] is None and cp["mesh"] == ["cp"] and cp["world"] == 2
    assert cp["cp_ranks"] == [0, 1] and cp["cp_comm_strategy"] == "alltoall"
    _matches(cp, one_process)


@requires("transformers")
def test_an_accelerate_parallelism_config_section_launches_unchanged(tmp_path, one_process):
    config = tmp_path / "tp.yaml"
    config.write_text(ACCELERATE_YAML)
    out = tmp_path / "tp.json"
    result = lockstep("launch", "--config-file", str(config), SCRIPT, str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mesh"] == ["tp"] and report["world"] == 2
    assert report["tp_size"] == 2 and report["tp_ranks"] == [0, 1]
    _matches(report, one_process)
    explained = lockstep("config", "explain", str(config), "--parallelism_config_tp_size", "2")
    assert explained.returncode == 0, explained.stderr
    assert "use_parallelism_config" in explained.stdout and "parallelism_config_tp_size" in explained.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--num-processes", "2", "--parallelism-config-tp-size", "4"],
            "ParallelismConfig settings: ParallelismConfig(dp_replicate_size=1, dp_shard_size=1, tp_size=4, "
            "cp_size=1, sp_size=1, pp_size=1) needs 1 x 1 x 4 x 1 x 1 x 1 = 4 processes, but this run has 2.",
        ),
        (["--num-processes", "2", "--parallelism-config-tp-size", "0"], "--parallelism-config-tp-size must be >= 1"),
        (
            ["--num-machines", "1:2", "--num-processes", "6", "--parallelism-config-tp-size", "2"],
            "ParallelismConfig settings: An elastic job on 3 processes cannot keep this layout: the model-parallel "
            "sizes (tp_size=2 = 2 processes per model replica) do not divide 3.",
        ),
        (["--parallelism_config_sp_size", "2"], "--parallelism_config_sp_size is not supported: DeepSpeed-Ulysses"),
    ],
)  # fmt: skip
def test_bad_parallelism_flags_exit_2_before_any_process_starts(args, message):
    result = lockstep("launch", "--cpu", *args, SCRIPT, "x")
    assert result.returncode == 2
    assert message in result.stderr


def test_an_unknown_parallelism_config_key_names_its_path(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(ACCELERATE_YAML.replace("parallelism_config_cp_size", "parallelism_config_pp_size"))
    result = lockstep("launch", "--config-file", str(config), SCRIPT, "x")
    assert result.returncode == 2
    assert "parallelism_config.parallelism_config_pp_size" in result.stderr
