"""DeepSpeed under `lockstep launch`: a killed rank restarts and a preempted run resumes to exactly the
weights of an uninterrupted run (ZeRO-2); the launcher's DeepSpeed flags and config keys.

The resumed attempt is seeded differently (other initial weights, dropout and data order): starting over, or
a load that restores nothing, cannot reach the uninterrupted run's weights, and the step it resumed at is
checked exactly."""

import json
import signal
import time

import pytest

from tests.helpers.cli import SCRIPTS, lockstep, lockstep_popen
from tests.helpers.optional import requires
from tests.helpers.resume import Resumed, draw_step, final_params, last_checkpoint_before, resumed_lines

pytestmark = [pytest.mark.distributed, requires("deepspeed")]

SCRIPT = str(SCRIPTS / "resumable_train.py")
SAVE_EVERY = 3  # the script's default


def _zero(stage: int) -> list[str]:
    return ["launch", "--num-processes", "2", "--zero-stage", str(stage)]


# Each DeepSpeed launch costs 15-20 s on the 2-core CI machine, so the launches are shared: the uninterrupted
# run is started from an Accelerate config file (its test checks that), and the killed and preempted runs,
# started with flags, must reach its weights. Both stop ZeRO-2, which saves and loads through the same
# DeepSpeed checkpoint path as ZeRO-3; tests/backends/test_deepspeed_checkpoint.py resumes ZeRO-3 in process
# and tests/trainer/test_trainer_deepspeed.py through the Trainer.
@pytest.fixture(scope="module")
def accelerate_yaml_run(tmp_path_factory) -> tuple[str, list[float]]:
    folder = tmp_path_factory.mktemp("accelerate_yaml")
    config = folder / "default_config.yaml"
    config.write_text(ACCELERATE_DEEPSPEED_YAML)  # as `accelerate config` writes it for ZeRO-2 on CPU
    project = folder / "run"
    project.mkdir()
    result = lockstep("launch", "--config-file", str(config), SCRIPT, str(project))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, final_params(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2])
def test_a_killed_rank_restarts_and_matches_an_uninterrupted_run(tmp_path, accelerate_yaml_run, stage):
    die_at, drawn = draw_step(f"zero-{stage} killed rank", 4, 11)  # after the first checkpoint (step 3)
    result = lockstep(*_zero(stage), "--max-restarts", "1", SCRIPT, str(tmp_path), "--die-at", str(die_at))
    assert result.returncode == 0, f"{drawn}: {result.stderr[-3000:]}"
    resumed_at = last_checkpoint_before(die_at, SAVE_EVERY)
    folder = str(tmp_path / "checkpoints" / f"checkpoint_{resumed_at // SAVE_EVERY - 1}")
    assert resumed_lines(result.stdout) == [
        Resumed(attempt=0, seed=0, folder="None", step=0),
        Resumed(attempt=1, seed=1, folder=folder, step=resumed_at),
    ], f"{drawn}:\n{result.stdout[-3000:]}"
    assert final_params(result.stdout) == accelerate_yaml_run[1], drawn


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2])
def test_a_preempted_run_exits_143_and_resumes_exactly(tmp_path, accelerate_yaml_run, stage):
    stop_after, drawn = draw_step(f"zero-{stage} preemption", 2, 8)
    launcher = lockstep_popen(*_zero(stage), SCRIPT, str(tmp_path), "--step-delay", "0.2")
    progress = tmp_path / "progress"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        progress.exists() and int(progress.read_text() or 0) >= stop_after
    ):
        time.sleep(0.02)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, stderr[-3000:]
    stopped_at = int(progress.read_text())
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    result = lockstep(*_zero(stage), SCRIPT, str(tmp_path), "--seed", "1")
    assert result.returncode == 0, f"{drawn}: {result.stderr[-3000:]}"
    assert resumed_lines(result.stdout) == [
        Resumed(attempt=0, seed=1, folder=str(tmp_path / "checkpoints" / latest), step=stopped_at)
    ], f"{drawn}:\n{result.stdout[-3000:]}"
    assert final_params(result.stdout) == accelerate_yaml_run[1], drawn


def test_a_deepspeed_file_key_that_contradicts_the_json_config_is_refused(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    result = lockstep(
        "launch",
        "--num-processes",
        "2",
        "--deepspeed-config-file",
        str(config),
        "--zero_stage",
        "3",
        SCRIPT,
        "x",
    )
    assert result.returncode == 2
    assert "zero_stage=3 against zero_optimization.stage=2" in result.stderr
    assert "Traceback" not in result.stderr


def test_deepspeed_and_fsdp_flags_together_are_refused():
    result = lockstep("launch", "--use-fsdp", "--zero-stage", "2", SCRIPT, "x")
    assert result.returncode == 2 and "both choose how the model is distributed" in result.stderr


def test_an_unknown_zero_stage_is_refused_before_any_process_starts():
    result = lockstep("launch", "--num-processes", "2", "--use-deepspeed", "--zero-stage", "4", SCRIPT, "x")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--zero-stage must be between 0 and 3, got 4" in result.stderr


ACCELERATE_DEEPSPEED_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def test_an_accelerate_deepspeed_config_file_launches_unchanged(accelerate_yaml_run):
    """The file `accelerate config` writes for ZeRO-2 on CPU runs DeepSpeed ZeRO-2 on 2 processes; the runs
    started with flags above reach its weights exactly."""
    stdout, params = accelerate_yaml_run
    assert "attempt 0 world 2" in stdout and "attempt 0 distributed DEEPSPEED zero 2" in stdout, stdout[
        -2000:
    ]
    assert len(params) > 0
