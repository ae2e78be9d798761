"""DeepSpeed under `lockstep launch`: a preempted run resumes and a killed rank restarts to exactly the
weights of an uninterrupted run (ZeRO-2), started from an Accelerate config file; the launcher's DeepSpeed
flags and config keys.

The resumed attempt is seeded differently (other initial weights, dropout and data order): starting over, or
a load that restores nothing, cannot reach the uninterrupted run's weights, and the step it resumed at is
checked exactly."""

import json

import pytest

from tests.helpers.cli import SCRIPTS, lockstep
from tests.helpers.in_process_launch import launched_in_process
from tests.helpers.optional import requires
from tests.helpers.resume import final_params, preempt_then_kill

pytestmark = [pytest.mark.distributed, requires("deepspeed")]

SCRIPT = str(SCRIPTS / "resumable_train.py")

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


# Each DeepSpeed launch costs 15-20 s of CPU per process on the 2-core CI machine, so one job goes through
# both interruptions: started from an Accelerate config file (`accelerate config`'s ZeRO-2 on CPU), preempted,
# then resumed with flags, a rank killed and restarted; the uninterrupted run it must match runs in workers
# forked from this process, with DeepSpeed imported once. ZeRO-2 saves and loads through the same DeepSpeed
# checkpoint path as ZeRO-3; tests/backends/test_deepspeed_checkpoint.py resumes ZeRO-3 in process and
# tests/trainer/test_trainer_deepspeed.py through the Trainer.
@pytest.mark.slow
@pytest.mark.usefixtures("deepspeed_preloaded")
def test_an_accelerate_config_file_run_is_preempted_resumed_and_restarted_to_the_uninterrupted_weights(
    tmp_path,
):
    config = tmp_path / "default_config.yaml"
    config.write_text(ACCELERATE_DEEPSPEED_YAML)
    project = tmp_path / "run"
    project.mkdir()
    flags = ["--num-processes", "2", "--zero-stage", "2"]
    from_file = ["launch", "--config-file", str(config)]
    first, stdout = preempt_then_kill("zero-2", from_file, ["launch", *flags], SCRIPT, project)
    assert "attempt 0 world 2" in first and "attempt 0 distributed DEEPSPEED zero 2" in first, first[-2000:]
    assert "attempt 1 distributed DEEPSPEED zero 2" in stdout, stdout[-2000:]
    straight = tmp_path / "straight"
    straight.mkdir()
    reference = launched_in_process(flags, SCRIPT, [str(straight)], DS_ACCELERATOR="cpu")
    assert final_params(stdout) == final_params(reference[0])


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
