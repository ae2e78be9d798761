"""``ParallelismConfig`` and its handlers: Accelerate's fields, defaults, derived names and errors (no processes)."""

from __future__ import annotations

import re

import pytest
from torch import nn

from lockstep import Accelerator, ParallelismConfig
from lockstep.accelerator.settings import resolve_parallelism
from lockstep.backends.nd.tensor_parallel import check_heads, check_plan
from lockstep.config.parallelism import TorchContextParallelConfig, TorchTensorParallelConfig


def test_defaults_are_ones_and_the_dimension_names_follow_accelerate():
    config = ParallelismConfig()
    assert (
        config.dp_replicate_size,
        config.dp_shard_size,
        config.tp_size,
        config.cp_size,
        config.sp_size,
    ) == (
        1,
        1,
        1,
        1,
        1,
    )
    assert config.active_mesh_dims == [] and config.tp_handler is None
    hsdp_tp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2, cp_size=2)
    assert (
        hsdp_tp.total_size == 16 and hsdp_tp.data_parallel_size == 4 and hsdp_tp.non_data_parallel_size == 4
    )
    assert hsdp_tp._get_mesh() == (("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2))
    assert hsdp_tp.dp_dim_names == ["dp_replicate", "dp_shard"]
    assert hsdp_tp.non_dp_dim_names == ["tp", "cp"]
    assert hsdp_tp.dp_shard_cp_dim_names == ["dp_shard", "cp"]
    assert hsdp_tp.dp_cp_dim_names == ["dp_replicate", "dp_shard", "cp"]
    assert hsdp_tp.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]
    assert isinstance(hsdp_tp.tp_handler, TorchTensorParallelConfig)
    assert hsdp_tp.cp_handler == TorchContextParallelConfig(cp_comm_strategy="allgather")


def test_sizes_default_to_the_parallelism_config_environment(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "3")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall")
    config = ParallelismConfig(cp_size=2)
    assert (config.tp_size, config.dp_shard_size) == (2, 3)
    assert config.cp_handler.cp_comm_strategy == "alltoall"
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_TP_SIZE='two' is invalid"):
        ParallelismConfig()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"tp_size": 0},
            ValueError,
            r"ParallelismConfig\(tp_size=0\) is invalid: every size must be an integer >= 1",
        ),
        ({"dp_shard_size": 1.5}, ValueError, r"dp_shard_size=1.5\) is invalid"),
        (
            {"dp_replicate_size": 2, "tp_size": 2},
            ValueError,
            "does not compose with replicated data parallelism",
        ),
        ({"cp_size": 2, "sp_size": 2}, ValueError, "set one of them to 1"),
        ({"cp_backend": "ring"}, ValueError, r"cp_backend='ring'\) is invalid"),
        (
            {"tp_size": 2, "tp_handler": object()},
            TypeError,
            "tp_handler=...\\) must be a TorchTensorParallelConfig",
        ),
    ],
)
def test_bad_layouts_are_refused_with_what_was_passed(kwargs, error, message):
    with pytest.raises(error, match=message):
        ParallelismConfig(**kwargs)


def test_handlers_check_their_settings():
    with pytest.raises(
        ValueError, match=r"cp_comm_strategy='ring'\) is invalid: it must be one of 'allgather'"
    ):
        TorchContextParallelConfig(cp_comm_strategy="ring")
    with pytest.raises(ValueError, match=r"\{'up': 'diagonal'\}\) is invalid: a style is one of 'colwise'"):
        TorchTensorParallelConfig(parallelize_plan={"up": "diagonal"})
    with pytest.raises(NotImplementedError, match="enable_async_tp=True\\) is not built yet"):
        TorchTensorParallelConfig(enable_async_tp=True)


def test_sizes_must_multiply_to_the_number_of_processes():
    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    with pytest.raises(
        ValueError,
        match=r"ParallelismConfig\(dp_replicate_size=1, dp_shard_size=2, tp_size=2, cp_size=1, sp_size=1, pp_size=1\) needs "
        r"1 x 2 x 2 x 1 x 1 x 1 = 4 processes, but this run has 2. Choose sizes whose product is 2",
    ):
        config.validate_world_size(2)
    ones = ParallelismConfig()
    ones.validate_world_size(3)  # all ones on N processes: plain data parallelism, as in Accelerate
    assert ones.dp_replicate_size == 3 and ones.active_mesh_dims == ["dp_replicate"]


@pytest.mark.parametrize(
    ("sizes", "world", "after", "change"),
    [
        ({"dp_shard_size": 2, "tp_size": 2}, 2, (1, 1, 2), "dp_shard_size 2 -> 1 (tp_size=2 kept)"),
        ({"dp_shard_size": 2, "tp_size": 2}, 8, (1, 4, 2), "dp_shard_size 2 -> 4 (tp_size=2 kept)"),
        ({"tp_size": 2}, 6, (3, 1, 2), "dp_replicate_size 1 -> 3 (tp_size=2 kept)"),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, 6, (3, 2, 1), "dp_replicate_size 2 -> 3"),
        ({"dp_shard_size": 3, "cp_size": 2}, 6, (1, 3, 1), ""),
    ],
)  # fmt: skip
def test_an_elastic_job_fits_the_data_parallel_sizes_to_the_world(sizes, world, after, change):
    config = ParallelismConfig(**sizes)
    assert config.fit_data_parallel(world) == change
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == after
    config.validate_world_size(world)


@pytest.mark.parametrize(
    ("sizes", "world", "message"),
    [
        ({"tp_size": 2}, 3, "the model-parallel sizes (tp_size=2 = 2 processes per model replica) do not divide 3"),
        ({"tp_size": 2, "cp_size": 2}, 6, "(tp_size=2 x cp_size=2 = 4 processes per model replica) do not divide 6"),
        ({"dp_replicate_size": 2, "dp_shard_size": 2}, 3, "3 data-parallel ranks, "
         "which HSDP's dp_shard_size=2 does not divide"),
    ],
)  # fmt: skip
def test_an_elastic_job_refuses_a_world_its_layout_cannot_divide(sizes, world, message):
    config = ParallelismConfig(**sizes)
    with pytest.raises(ValueError, match=re.escape(message)):
        config.validate_world_size(world, elastic=True)
    with pytest.raises(ValueError, match=f"needs .* processes, but this run has {world}"):
        ParallelismConfig(**sizes).validate_world_size(world)  # not elastic: Accelerate's check


def test_the_accelerator_refuses_a_layout_for_another_world_size():
    with pytest.raises(ValueError, match=r"needs 1 x 1 x 2 x 1 x 1 x 1 = 2 processes, but this run has 1"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))


def test_sequence_parallelism_and_deepspeed_with_a_layout_are_not_built():
    with pytest.raises(NotImplementedError, match=r"ParallelismConfig\(sp_size=2\) is not built yet"):
        resolve_parallelism(ParallelismConfig(sp_size=2), None, {})
    with pytest.raises(NotImplementedError, match="deepspeed_plugin=...\\) is not built yet"):
        resolve_parallelism(ParallelismConfig(), object(), {})


def test_the_launchers_section_and_the_environment_switch_build_a_config(monkeypatch):
    section = {
        "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": "2",
        "parallelism_config_cp_size": 2,
        "parallelism_config_cp_comm_strategy": "alltoall",
    }
    config = resolve_parallelism(None, None, {"parallelism_config": section})
    assert (config.dp_shard_size, config.tp_size, config.cp_size) == (2, 2, 2)
    assert config.cp_handler.cp_comm_strategy == "alltoall"
    assert resolve_parallelism(None, None, {}) is None
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    accelerator = Accelerator(cpu=True)
    assert isinstance(accelerator.parallelism_config, ParallelismConfig)
    assert accelerator.torch_device_mesh is None  # every size 1 on one process: no mesh
    assert accelerator.tensor_parallel_rank == 0 and accelerator.data_parallel_shard_rank == 0


def test_a_plan_naming_a_missing_module_lists_the_modules():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    check_plan(model, {"0": "colwise", "*": "rowwise"})  # patterns that match pass
    with pytest.raises(
        ValueError,
        match=r"names 'layers.\*.up', which matches no module of Sequential. Its modules are: 0 \(Linear\), "
        r"1 \(ReLU\), 2 \(Linear\)\.",
    ):
        check_plan(model, {"layers.*.up": "colwise"})


def test_tp_size_must_divide_the_attention_heads():
    class Config:
        num_attention_heads, num_key_value_heads = 4, 2

    model = nn.Linear(2, 2)
    model.config = Config()  # type: ignore[assignment]
    check_heads(model, 2)
    with pytest.raises(ValueError, match="tp_size=4 does not divide Linear's num_key_value_heads=2"):
        check_heads(model, 4)
