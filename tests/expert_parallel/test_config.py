"""``ParallelismConfig(ep_size=...)``: its checks, its file key, and the compositions not built yet, each refused
by name before any collective."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lockstep import ParallelismConfig
from lockstep.config.layer_specs import layers_from_layout
from lockstep.config.parallelism_keys import LAYOUT, check_section, config_from_section
from lockstep.layers.expert_parallel import ExpertParallelNotBuiltError, ExpertShardingError
from lockstep.layers.expert_parallel._layer import expert_parallel_hooks
from tests.helpers.multiprocess import run_distributed
from tests.helpers.optional import requires


def test_ep_size_defaults_to_one_and_leaves_accelerate_s_repr_alone() -> None:
    config = ParallelismConfig()
    assert config.ep_size == 1 and "ep_size" not in repr(config)
    assert "ep_size=2" in repr(ParallelismConfig(ep_size=2))
    assert ParallelismConfig(ep_size=2).to_json()["ep_size"] == 2


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_ep_size_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(
        ValueError, match=rf"ParallelismConfig\(ep_size={value!r}\) is invalid: it must be an integer >= 1"
    ):
        ParallelismConfig(ep_size=value)


@pytest.mark.parametrize(
    "sizes",
    [
        {"dp_replicate_size": 2, "dp_shard_size": 2},
        {"dp_shard_size": 2, "tp_size": 2},
        {"dp_shard_size": 2, "cp_size": 2},
        {"pp_size": 2},
    ],
)
def test_compositions_not_built_yet_are_refused_by_name(sizes: dict[str, int]) -> None:
    passed = ", ".join(f"{name}={size}" for name, size in sizes.items())
    with pytest.raises(
        NotImplementedError, match=rf"ParallelismConfig\(ep_size=2, {passed}\) is not built yet: .*comes next"
    ):
        ParallelismConfig(ep_size=2, **sizes)


def test_fsdp2_dp_shard_size_composes() -> None:
    """``dp_shard_size`` alone (FSDP2) is built: ``tests/expert_parallel/test_fsdp.py``."""
    config = ParallelismConfig(dp_shard_size=4, ep_size=2)
    config.validate_world_size(4)
    assert (config.dp_shard_size, config.ep_size, config.total_size) == (4, 2, 4)
    with pytest.raises(
        ValueError, match=r"ParallelismConfig\(ep_size=4\) does not fit 2 data-parallel processes"
    ):
        ParallelismConfig(dp_shard_size=2, ep_size=4).validate_world_size(2)


def test_ep_size_must_divide_the_data_parallel_size() -> None:
    config = ParallelismConfig(ep_size=2)
    with pytest.raises(
        ValueError,
        match=r"ParallelismConfig\(ep_size=2\) does not fit 3 data-parallel processes: .* must divide 3",
    ):
        config.validate_world_size(3)
    ParallelismConfig(ep_size=2).validate_world_size(4)  # divides: accepted by the config


def test_the_file_key_and_the_launcher_s_check() -> None:
    assert config_from_section({"parallelism_config_ep_size": 2}).ep_size == 2
    assert "parallelism_config_ep_size" in LAYOUT.section_keys
    with pytest.raises(
        ValueError, match=r"ParallelismConfig settings: ParallelismConfig\(ep_size=2\) does not fit 3"
    ):
        check_section({"parallelism_config_ep_size": 2}, {"num_processes": 3, "num_machines": 1})
    # a section without the key (every Accelerate file) builds the layout it did before
    assert config_from_section({"parallelism_config_tp_size": 2}) == ParallelismConfig(tp_size=2)


def test_the_layout_turns_the_layer_on_only_with_ep_size_above_one() -> None:
    assert [spec.name for spec, _ in layers_from_layout(ParallelismConfig(ep_size=2))] == ["expert_parallel"]
    assert layers_from_layout(ParallelismConfig()) == [] and layers_from_layout(None) == []


def _accelerator(joint: object = None) -> SimpleNamespace:
    return SimpleNamespace(backend=SimpleNamespace(capability=lambda kind: joint), sync_gradients=True)


def test_deepspeed_is_refused_by_name() -> None:
    layout = ParallelismConfig(ep_size=2, dp_replicate_size=2)
    with pytest.raises(
        ExpertParallelNotBuiltError,
        match=r"ParallelismConfig\(ep_size=2\) with DeepSpeed is not built yet: .*next",
    ):
        expert_parallel_hooks(layout, _accelerator(joint=object()))


def test_experts_replicated_over_part_of_the_data_parallel_ranks_are_accepted() -> None:
    # ep_size smaller than the data-parallel size: the experts are replicated over dp / ep groups (built)
    (layer,) = expert_parallel_hooks(ParallelismConfig(ep_size=2, dp_replicate_size=4), _accelerator())
    assert layer._ep_size == 2
    assert len(expert_parallel_hooks(ParallelismConfig(ep_size=2, dp_replicate_size=2), _accelerator())) == 1
    with pytest.raises(
        ExpertShardingError, match=r"ParallelismConfig\(ep_size=2\) does not fit 3 data-parallel"
    ):
        expert_parallel_hooks(ParallelismConfig(ep_size=2, dp_replicate_size=3), _accelerator())


def _deepspeed_with_ep() -> str:
    from lockstep import Accelerator, DeepSpeedPlugin

    with pytest.raises(NotImplementedError) as refused:
        Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(zero_stage=2), parallelism_config=ParallelismConfig(ep_size=2)
        )
    return str(refused.value)


@requires("deepspeed")
def test_the_accelerator_refuses_ep_with_deepspeed_before_any_step() -> None:
    messages = run_distributed(_deepspeed_with_ep, 2, env={"LOCAL_RANK": "0"})
    for message in messages:
        assert "Accelerator(parallelism_config=..., deepspeed_plugin=...) is not built yet" in message
