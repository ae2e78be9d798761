"""`lockstep config`, run for real in subprocesses with LOCKSTEP_HOME pointed at a temporary folder."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ACCELERATE_MULTI_GPU = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


def lockstep_config(home: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCKSTEP_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "lockstep.cli.main", "config", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        cwd=home.parent,
        timeout=120,
    )


def written(home: Path) -> dict:
    return yaml.safe_load((home / "default_config.yaml").read_text())


BASE = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "downcast_bf16": False,
    "enable_cpu_affinity": False,
    "machine_rank": 0,
    "main_training_function": "main",
    "num_machines": 1,
    "rdzv_backend": "static",
    "same_network": True,
}


def test_wizard_reads_piped_answers(home):
    # kind, machines, processes, sharding, precision, accumulation, dynamo backend
    result = lockstep_config(home, stdin="multi-cpu\n\n4\n\nbf16\n8\ninductor\n")
    assert result.returncode == 0, result.stderr
    assert f"Wrote {home / 'default_config.yaml'}: MULTI_CPU, 4 processes" in result.stdout
    assert written(home) == {
        **BASE,
        "distributed_type": "MULTI_CPU",
        "num_processes": 4,
        "use_cpu": True,
        "mixed_precision": "bf16",
        "gradient_accumulation_steps": 8,
        "dynamo_config": {"dynamo_backend": "INDUCTOR"},
    }


def test_wizard_asks_for_the_rendezvous_of_several_machines(home, tmp_path):
    target = tmp_path / "multi.yaml"
    answers = "1\n2\n1\n10.1.2.3\n29555\nc10d\nno\n8\n\nfp16\n\n"  # end of input: default dynamo backend
    result = lockstep_config(home, "--config_file", str(target), stdin=answers)
    assert result.returncode == 0, result.stderr
    assert not home.exists()
    assert yaml.safe_load(target.read_text()) == {
        **BASE,
        "distributed_type": "MULTI_CPU",
        "num_machines": 2,
        "machine_rank": 1,
        "main_process_ip": "10.1.2.3",
        "main_process_port": 29555,
        "rdzv_backend": "c10d",
        "same_network": False,
        "num_processes": 8,
        "use_cpu": True,
        "mixed_precision": "fp16",
    }


def test_wizard_asks_accelerates_deepspeed_questions_and_the_file_launches_checked(home):
    # kind, machines, processes, sharding, JSON file, stage, optimizer offload, parameter offload, zero3 init,
    # 16-bit save, clipping, precision, accumulation, dynamo backend
    answers = "multi-cpu\n\n2\ndeepspeed\n\n3\n\n\nno\nyes\n0.5\nbf16\n4\n\n"
    result = lockstep_config(home, stdin=answers)
    assert result.returncode == 0, result.stderr
    config = written(home)
    assert config["distributed_type"] == "DEEPSPEED" and "gradient_accumulation_steps" not in config
    assert config["deepspeed_config"] == {
        "zero_stage": 3,
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "zero3_init_flag": False,
        "zero3_save_16bit_model": True,
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 4,
    }
    explained = lockstep_config(home, "explain")
    assert explained.returncode == 0, explained.stderr
    assert "zero_stage" in explained.stdout and "DEEPSPEED" in explained.stdout


def test_wizard_asks_the_device_mesh_sizes_and_the_file_launches_checked(home):
    # kind, machines, processes, sharding, tp size (3 does not divide 8: asked again), cp size (the default
    # 1), FSDP shard size, precision, accumulation, dynamo backend
    answers = "multi-cpu\n\n8\nmesh\n3\n2\n\n2\n\n\n\n"
    result = lockstep_config(home, stdin=answers)
    assert result.returncode == 0, result.stderr
    assert "3 does not divide 8 processes" in result.stdout + result.stderr
    config = written(home)
    assert config["distributed_type"] == "MULTI_CPU"
    assert config["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2,
        "parallelism_config_cp_size": 1,
    }
    validated = lockstep_config(home, "validate", str(home / "default_config.yaml"))
    assert validated.returncode == 0, validated.stderr
    assert "device mesh dp_replicate=2 x dp_shard=2 x tp=2" in validated.stdout


def test_wizard_takes_every_default_at_end_of_input(home):
    result = lockstep_config(home, stdin="")
    assert result.returncode == 0, result.stderr
    assert written(home) == {
        **BASE,
        "distributed_type": "NO",
        "num_processes": 1,
        "use_cpu": False,
        "mixed_precision": "no",
    }


def test_wizard_asks_again_after_a_bad_answer(home):
    result = lockstep_config(home, stdin="quantum\nmulti-cpu\n\n3\n\nfp17\nfp16\n")
    assert result.returncode == 0, result.stderr
    assert "'quantum' is not one of: no, multi-cpu, multi-gpu. Try again." in result.stdout
    assert "'fp17' is not one of: no, fp16, bf16. Try again." in result.stdout
    config = written(home)
    assert (config["distributed_type"], config["num_processes"], config["mixed_precision"]) == (
        "MULTI_CPU",
        3,
        "fp16",
    )


def test_wizard_gives_up_after_three_bad_answers(home):
    result = lockstep_config(home, stdin="a\nb\nc\nmulti-cpu\n")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "lockstep config: error: no valid answer to 'Which kind of machine are you using "
        "(0: no distributed training, 1: multi-CPU, 2: multi-GPU)?' after 3 tries (last: 'c')."
    ]
    assert not home.exists()


def test_default_writes_a_file_for_this_machine_and_will_not_overwrite_it(home):
    result = lockstep_config(home, "default", "--cpu")
    assert result.returncode == 0, result.stderr
    two_cores = (os.cpu_count() or 1) >= 2
    assert written(home) == {
        **BASE,
        "distributed_type": "MULTI_CPU" if two_cores else "NO",
        "num_processes": 2 if two_cores else 1,
        "use_cpu": True,
        "mixed_precision": "no",
    }

    again = lockstep_config(home, "default", "--mixed-precision", "bf16")
    assert again.returncode == 2
    assert again.stderr.splitlines() == [
        f"lockstep config: error: {home / 'default_config.yaml'} already exists; pass --force to replace it, "
        "or --config-file to write elsewhere."
    ]
    assert written(home)["mixed_precision"] == "no"

    forced = lockstep_config(
        home, "default", "--force", "--cpu", "--num_processes", "3", "--mixed_precision", "bf16"
    )
    assert forced.returncode == 0, forced.stderr
    assert f"Replaced {home / 'default_config.yaml'}: MULTI_CPU, 3 processes" in forced.stdout
    assert (written(home)["num_processes"], written(home)["mixed_precision"]) == (3, "bf16")


def test_config_file_flag_works_before_and_after_the_action(home, tmp_path):
    before = lockstep_config(home, "--config-file", str(tmp_path / "a.yaml"), "default", "--cpu")
    after = lockstep_config(
        home, "default", "--cpu", "--num-processes", "1", "--config_file", str(tmp_path / "b.yaml")
    )
    assert (before.returncode, after.returncode) == (0, 0), before.stderr + after.stderr
    assert yaml.safe_load((tmp_path / "b.yaml").read_text())["distributed_type"] == "NO"
    assert (tmp_path / "a.yaml").is_file() and not home.exists()


def test_validate_accepts_an_accelerate_file_and_reports_ignored_keys(home, tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_MULTI_GPU)
    result = lockstep_config(home, "validate", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{path} is valid: MULTI_GPU, 2 processes on 1 machine, mixed precision fp16\n"
    assert result.stderr.splitlines() == [
        f"lockstep config: warning: {path}: ignoring tpu_env, tpu_use_cluster, tpu_use_sudo: these configure "
        "TPU pods, SageMaker or IPEX, which lockstep does not drive."
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("num_processes: two\n", "num_processes must be an integer, got 'two'"),
        (
            "fsdp_config:\n  fsdp_versoin: 2\n",
            "fsdp_config.fsdp_versoin is not a known key (known: fsdp_activation",
        ),
    ],
)
def test_validate_rejects_a_bad_file_in_one_line(home, tmp_path, text, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = lockstep_config(home, "validate", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"lockstep config: error: {path}: {problem}")
    assert "Traceback" not in result.stderr


def test_unknown_flag_is_a_usage_error(home):
    result = lockstep_config(home, "default", "--gpus", "2")
    assert result.returncode == 2
    assert "unrecognized arguments: --gpus 2" in result.stderr
    assert "Traceback" not in result.stderr
    assert not home.exists()


def test_round_trip_wizard_file_explain(home):
    """Answers -> default file -> `config explain` with a flag on top: every value and its source."""
    assert lockstep_config(home, stdin="multi-cpu\n\n4\n\nbf16\n8\neager\n").returncode == 0
    result = lockstep_config(home, "explain", "--mixed-precision", "fp16")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    file_source = f"(config file {home / 'default_config.yaml'})"
    assert result.stdout.splitlines()[0] == f"config file: {home / 'default_config.yaml'}"
    assert lines["num_processes"].split()[1] == "4" and lines["num_processes"].endswith(file_source)
    assert lines["gradient_accumulation_steps"].split()[1] == "8" and lines[
        "gradient_accumulation_steps"
    ].endswith(file_source)
    assert lines["dynamo_backend"].split()[1] == "eager" and lines["dynamo_backend"].endswith(file_source)
    assert lines["mixed_precision"].split()[1] == "fp16" and lines["mixed_precision"].endswith("(flag)")
    assert lines["max_restarts"].split()[1] == "0" and lines["max_restarts"].endswith("(default)")
    assert lines["distributed_type"].split()[1] == "MULTI_CPU"


def test_explain_rejects_bad_flags_in_one_line(home):
    result = lockstep_config(home, "explain", "--num-processes", "0")
    assert result.returncode == 2
    assert (
        "--num-processes 0 is invalid: it must be >= 1." in result.stderr and "Traceback" not in result.stderr
    )


def test_env_reports_versions_and_the_config(home):
    assert lockstep_config(home, "default", "--cpu", "--num-processes", "2").returncode == 0
    env = {**os.environ, "LOCKSTEP_HOME": str(home)}
    result = subprocess.run(
        [sys.executable, "-m", "lockstep.cli.main", "env"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    import torch

    import lockstep

    assert "- lockstep" in result.stdout and lockstep.__version__ in result.stdout
    assert torch.__version__ in result.stdout
    assert f"Config file       : {home / 'default_config.yaml'}" in result.stdout
    assert "distributed_type: MULTI_CPU" in result.stdout and "num_processes: 2" in result.stdout


def test_validate_checks_a_deepspeed_section_against_its_json_config(home, tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}}')
    config = tmp_path / "ds.yaml"
    config.write_text(
        f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n  zero_stage: 3\n"
        "distributed_type: DEEPSPEED\nnum_processes: 2\nuse_cpu: true\n"
    )
    result = lockstep_config(home, "validate", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "zero_stage=3 against zero_optimization.stage=2" in result.stderr
