"""The launch config file: Accelerate's default_config.yaml schema, loaded, checked and written."""

from pathlib import Path

import pytest
import yaml

from lockstep.config.enums import DistributedType, PrecisionType
from lockstep.config.file import (
    ClusterConfig,
    ConfigFileError,
    default_config_path,
    load_config_file,
    save_config_file,
)

# What `accelerate config` writes for one machine with two GPUs (Accelerate's documented example).
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

ACCELERATE_FSDP2 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_offload: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
"""

ACCELERATE_DEEPSPEED = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 1
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
use_cpu: false
"""

ACCELERATE_MULTI_CPU = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
downcast_bf16: 'no'
ipex_config:
  ipex: false
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29500
main_training_function: main
mixed_precision: 'no'
mpirun_config:
  mpirun_ccl: '1'
  mpirun_hostfile: /home/user/hostfile
num_machines: 4
num_processes: 16
rdzv_backend: c10d
same_network: false
use_cpu: true
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_accelerate_multi_gpu_file_loads_and_warns_once_about_tpu_keys(tmp_path):
    path = write(tmp_path, ACCELERATE_MULTI_GPU)
    with pytest.warns(UserWarning) as caught:
        config = load_config_file(path)
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f"{path}: ignoring tpu_env, tpu_use_cluster, tpu_use_sudo: these configure TPU pods, SageMaker or IPEX, "
        "which lockstep does not drive."
    )
    assert config.distributed_type is DistributedType.MULTI_GPU
    assert config.mixed_precision is PrecisionType.FP16
    assert (config.num_processes, config.num_machines, config.machine_rank) == (2, 1, 0)
    assert (config.gpu_ids, config.downcast_bf16, config.same_network, config.use_cpu) == (
        "all",
        False,
        True,
        False,
    )
    assert (config.main_process_ip, config.main_process_port, config.gradient_accumulation_steps) == (
        None,
    ) * 3
    assert config.fsdp_config == {} and config.dynamo_config == {}


def test_accelerate_fsdp2_file_loads(tmp_path):
    config = load_config_file(write(tmp_path, ACCELERATE_FSDP2))
    assert config.distributed_type is DistributedType.FSDP
    assert config.mixed_precision == "bf16"
    assert config.num_processes == 4
    assert config.fsdp_config == {
        "fsdp_activation_checkpointing": False,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_cpu_offload": False,
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False,
        "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_version": 2,
    }


def test_accelerate_deepspeed_file_loads(tmp_path):
    config = load_config_file(write(tmp_path, ACCELERATE_DEEPSPEED))
    assert config.distributed_type is DistributedType.DEEPSPEED
    assert config.deepspeed_config == {
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "none",
        "zero3_init_flag": True,
        "zero3_save_16bit_model": True,
        "zero_stage": 3,
    }


def test_accelerate_multi_cpu_file_loads_and_ignores_ipex(tmp_path):
    path = write(tmp_path, ACCELERATE_MULTI_CPU)
    with pytest.warns(UserWarning, match=r"cfg.yaml: ignoring ipex_config: these configure"):
        config = load_config_file(path)
    assert config.distributed_type is DistributedType.MULTI_CPU
    assert (config.num_processes, config.num_machines, config.machine_rank) == (16, 4, 1)
    assert (config.main_process_ip, config.main_process_port, config.rdzv_backend) == (
        "10.0.0.1",
        29500,
        "c10d",
    )
    assert (config.use_cpu, config.same_network, config.mixed_precision) == (True, False, PrecisionType.NO)
    assert config.mpirun_config == {"mpirun_ccl": "1", "mpirun_hostfile": "/home/user/hostfile"}


def test_old_accelerate_spellings_are_upgraded():
    config = ClusterConfig.from_dict(
        {
            "distributed_type": "multi_gpu",
            "fp16": True,
            "dynamo_backend": "inductor",
            "num_processes": -1,
            "downcast_bf16": "yes",
            "gpu_ids": 0,
            "fsdp_config": {"fsdp_sharding_strategy": 1, "fsdp_min_num_params": "1e8"},
        }
    )
    assert config.distributed_type is DistributedType.MULTI_GPU
    assert config.mixed_precision is PrecisionType.FP16
    assert config.dynamo_config == {"dynamo_backend": "INDUCTOR"}
    assert (config.num_processes, config.downcast_bf16, config.gpu_ids) == (None, True, "0")
    assert config.fsdp_config == {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_min_num_params": 100_000_000}
    assert ClusterConfig.from_dict({"dynamo_backend": "NO"}).dynamo_config == {}


def test_save_then_load_gives_the_same_config(tmp_path):
    config = ClusterConfig(
        distributed_type="FSDP",
        mixed_precision="bf16",
        num_processes=8,
        num_machines=2,
        machine_rank=1,
        main_process_ip="node0",
        main_process_port=29501,
        gradient_accumulation_steps=4,
        dynamo_config={"dynamo_backend": "inductor", "dynamo_mode": "max-autotune"},
        fsdp_config={"fsdp_version": 2, "fsdp_transformer_layer_cls_to_wrap": ["Block", "Embed"]},
    )
    path = save_config_file(config, tmp_path / "new" / "folder" / "cfg.yaml")
    assert load_config_file(path) == config
    written = yaml.safe_load(path.read_text())
    assert written["distributed_type"] == "FSDP" and written["mixed_precision"] == "bf16"
    assert written["dynamo_config"] == {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune"}
    assert "deepspeed_config" not in written and "num_processes" in written
    assert list(tmp_path.glob("new/folder/*")) == [path]


def test_unset_values_are_left_out_of_the_file(tmp_path):
    path = save_config_file(ClusterConfig(), tmp_path / "cfg.yaml")
    written = yaml.safe_load(path.read_text())
    assert "num_processes" not in written and "gradient_accumulation_steps" not in written
    assert not any(key.endswith("_config") for key in written)
    assert load_config_file(path) == ClusterConfig()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_processes: two\n", r"cfg.yaml: num_processes must be an integer, got 'two'$"),
        ("fsdp_config: 3\n", r"cfg.yaml: fsdp_config must be a mapping of settings, got 3$"),
        (
            "fsdp_config:\n  fsdp_versoin: 2\n",
            r"cfg.yaml: fsdp_config.fsdp_versoin is not a known key \(known: fsdp_activation_checkpointing, ",
        ),
        (
            "dynamo_config:\n  backend: inductor\n",
            r"cfg.yaml: dynamo_config.backend is not a known key \(known: dynamo_",
        ),
        (
            "deepspeed_config:\n  stage: 2\n",
            r"cfg.yaml: deepspeed_config.stage is not a known key \(known: deepspeed_",
        ),
        (
            "num_proceses: 2\n",
            r"cfg.yaml: num_proceses is not a known key \(known: compute_environment, debug, ",
        ),
        ("use_cpu: maybe\n", r"cfg.yaml: use_cpu must be true or false, got 'maybe'$"),
        ("fp16: maybe\n", r"cfg.yaml: fp16 must be true or false, got 'maybe'$"),
        (
            "distributed_type: TPU\n",
            r"cfg.yaml: distributed_type must be one of NO, MULTI_CPU, .*, got 'TPU'$",
        ),
        (
            "mixed_precision: fp32\n",
            r"cfg.yaml: mixed_precision must be one of no, fp16, bf16, fp8, got 'fp32'$",
        ),
        (
            "num_machines: 2\nmachine_rank: 2\n",
            r"cfg.yaml: machine_rank must be < num_machines \(2\), got 2$",
        ),
        ("num_processes: 0\n", r"cfg.yaml: num_processes must be >= 1 \(or -1 to decide at launch\), got 0$"),
        ("num_machines: 0\n", r"cfg.yaml: num_machines must be >= 1, got 0$"),
        (
            "main_process_port: 70000\n",
            r"cfg.yaml: main_process_port must be between 1 and 65535, got 70000$",
        ),
        ("main_process_port: 0\n", r"cfg.yaml: main_process_port must be between 1 and 65535, got 0$"),
        ("gradient_accumulation_steps: 0\n", r"cfg.yaml: gradient_accumulation_steps must be >= 1, got 0$"),
        ("gpu_ids: first\n", r"cfg.yaml: gpu_ids must be 'all' or GPU numbers such as '0,1', got 'first'$"),
        (
            "rdzv_backend: carrier\n",
            r"cfg.yaml: rdzv_backend must be one of static, c10d, etcd, etcd-v2, got 'carrier'",
        ),
        (
            "distributed_type: MULTI_CPU\nnum_machines: 2\nnum_processes: 3\n",
            r"cfg.yaml: num_processes \(3\) must be a multiple of num_machines \(2\)",
        ),
        ("num_processes: 4\n", r"cfg.yaml: distributed_type NO runs one process, but num_processes is 4"),
        (
            "compute_environment: AMAZON_SAGEMAKER\nec2_instance_type: ml.p3.2xlarge\n",
            r"cfg.yaml: compute_environment AMAZON_SAGEMAKER is not supported",
        ),
        (
            "fsdp_config:\n  fsdp_auto_wrap_policy: EVERYTHING\n",
            r"fsdp_config.fsdp_auto_wrap_policy must be one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP",
        ),
        (
            "fsdp_config:\n  fsdp_state_dict_type: HALF\n",
            r"fsdp_config.fsdp_state_dict_type must be one of SHARDED_STATE_DICT, FULL_STATE_DICT, got 'HALF'",
        ),
        (  # refused as the plugin refuses it (and Accelerate under FSDP2), not accepted and failing later
            "fsdp_config:\n  fsdp_version: 2\n  fsdp_state_dict_type: LOCAL_STATE_DICT\n",
            r"fsdp_config.fsdp_state_dict_type is 'LOCAL_STATE_DICT', which is not supported: LOCAL_STATE_DICT is "
            r"FSDP1's, and lockstep runs FSDP2.*Use SHARDED_STATE_DICT",
        ),
        (
            "deepspeed_config:\n  zero_stage: 4\n",
            r"deepspeed_config.zero_stage must be between 0 and 3, got 4$",
        ),
        (
            "dynamo_config:\n  dynamo_use_dynamic: sometimes\n",
            r"dynamo_config.dynamo_use_dynamic must be true or",
        ),
    ],
)
def test_bad_values_name_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigFileError, match=message) as caught:
        load_config_file(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_unknown_keys_win_over_ignored_keys(tmp_path):
    # No warning is issued for a file that is rejected anyway.
    with pytest.raises(ConfigFileError, match=r"cfg.yaml: tpu_nmae is not a known key"):
        load_config_file(write(tmp_path, "tpu_name: pod\ntpu_nmae: pod\n"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_processes: [2\n", r"cfg.yaml: invalid YAML at line 2: expected ',' or ']'"),
        (
            "- MULTI_GPU\n",
            r"cfg.yaml: the file must hold a mapping of settings \(key: value lines\), got list$",
        ),
        ("", r"cfg.yaml: the file must hold a mapping of settings \(key: value lines\), got NoneType$"),
    ],
)
def test_unparsable_files_name_the_file(tmp_path, text, message):
    with pytest.raises(ConfigFileError, match=message):
        load_config_file(write(tmp_path, text))


def test_missing_and_unreadable_files_name_the_file(tmp_path):
    with pytest.raises(ConfigFileError, match=r"nope.yaml: no such config file. Run `lockstep config`"):
        load_config_file(tmp_path / "nope.yaml")
    with pytest.raises(
        ConfigFileError, match=rf"^{tmp_path}: cannot read the config file \(Is a directory\)"
    ):
        load_config_file(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"main_process_ip: caf\xe9\n")
    with pytest.raises(
        ConfigFileError, match=r"latin1.yaml: cannot read the config file \(it is not UTF-8 text\)"
    ):
        load_config_file(tmp_path / "latin1.yaml")


def test_constructor_checks_like_the_file():
    config = ClusterConfig(distributed_type="multi_cpu", num_processes="2", use_cpu="yes")
    assert (config.distributed_type, config.num_processes, config.use_cpu) == ("MULTI_CPU", 2, True)
    with pytest.raises(ConfigFileError, match=r"^ClusterConfig: num_machines must be >= 1, got 0$"):
        ClusterConfig(num_machines=0)
    with pytest.raises(ValueError, match=r"^<dict>: num_processes must be an integer, got 'two'$"):
        ClusterConfig.from_dict({"num_processes": "two"})


def test_null_values_take_the_default():
    config = ClusterConfig.from_dict({"mixed_precision": None, "num_machines": None, "fsdp_config": None})
    assert config == ClusterConfig()


def test_summary_is_one_line():
    config = ClusterConfig(distributed_type="MULTI_GPU", num_processes=2, mixed_precision="fp16")
    assert config.summary() == "MULTI_GPU, 2 processes on 1 machine, mixed precision fp16"
    config = ClusterConfig(
        use_cpu=True, gradient_accumulation_steps=4, dynamo_config={"dynamo_backend": "eager"}
    )
    assert config.summary() == (
        "NO, launcher decides the processes on 1 machine, mixed precision no, CPU only, "
        "gradient accumulation 4, torch.compile eager"
    )


def test_default_path_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LOCKSTEP_HOME", str(tmp_path / "lockstep_home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_config_path() == tmp_path / "lockstep_home" / "default_config.yaml"
    monkeypatch.delenv("LOCKSTEP_HOME")
    assert default_config_path() == tmp_path / "xdg" / "lockstep" / "default_config.yaml"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_config_path() == tmp_path / "home" / ".cache" / "lockstep" / "default_config.yaml"
