"""``AcceleratorState`` has Accelerate 1.15's public members: the plugins the Accelerator uses, and the
DeepSpeed, Megatron-LM, tensor-parallel and IPEX members answering as Accelerate does without them."""

from __future__ import annotations

import inspect
import os

import pytest

from lockstep import Accelerator, AcceleratorState, FullyShardedDataParallelPlugin
from lockstep.utils import TorchDynamoPlugin

# Accelerate 1.15's public AcceleratorState members (methods, properties and the attributes it assigns).
ACCELERATE_MEMBERS = """
initialized mixed_precision use_distributed is_last_process is_main_process is_local_main_process
wait_for_everyone split_between_processes main_process_first local_main_process_first print
destroy_process_group fork_launched deepspeed_plugin get_deepspeed_plugin select_deepspeed_plugin is_fsdp2
deepspeed_plugins use_ipex dynamo_plugin fsdp_plugin megatron_lm_plugin torch_tp_plugin parallelism_config
device_mesh distributed_type device backend debug num_processes process_index local_process_index
""".split()


def test_every_accelerate_member_is_there():
    assert [name for name in ACCELERATE_MEMBERS if not hasattr(AcceleratorState, name)] == []


def test_without_the_features_the_members_answer_as_accelerate_does():
    accelerator = Accelerator(cpu=True)
    state = accelerator.state
    assert (state.deepspeed_plugin, state.deepspeed_plugins, state.megatron_lm_plugin) == (None, None, None)
    assert (state.torch_tp_plugin, state.parallelism_config, state.device_mesh) == (None, None, None)
    assert state.use_ipex is False and state.is_fsdp2 is False and state.fsdp_plugin is None
    assert isinstance(state.dynamo_plugin, TorchDynamoPlugin) and state.dynamo_plugin.backend.value == "no"
    assert AcceleratorState().deepspeed_plugin is None  # any instance: the state is shared


@pytest.mark.parametrize("method", ["get_deepspeed_plugin", "select_deepspeed_plugin"])
def test_choosing_a_deepspeed_plugin_without_deepspeed_says_so(method):
    state = Accelerator(cpu=True).state
    with pytest.raises(
        ValueError, match=r"No DeepSpeed plugin called 'student': this Accelerator does not use"
    ):
        getattr(state, method)("student")
    assert list(inspect.signature(getattr(AcceleratorState, method)).parameters) == ["self", "name"]


def test_the_plugins_the_accelerator_uses_are_the_states():
    fsdp = FullyShardedDataParallelPlugin()
    dynamo = TorchDynamoPlugin(backend="eager")
    accelerator = Accelerator(cpu=True, fsdp_plugin=fsdp, dynamo_plugin=dynamo)
    state = AcceleratorState()
    assert state.fsdp_plugin is fsdp and state.dynamo_plugin is dynamo and state.is_fsdp2 is True
    assert accelerator.is_fsdp2 is state.is_fsdp2


def test_is_set_up_once_an_accelerator_records_its_settings():
    assert AcceleratorState.is_set_up() is False
    AcceleratorState()  # the process topology alone sets nothing up
    assert AcceleratorState.is_set_up() is False
    Accelerator(cpu=True)
    assert AcceleratorState.is_set_up() is True


def test_fork_launched_says_whether_the_notebook_launcher_forked_this_process(monkeypatch):
    import torch.distributed.launcher.api as launcher_api

    from lockstep.launcher import notebook
    from lockstep.launcher.settings import LaunchSettings
    from lockstep.utils import patch_environment

    assert AcceleratorState().fork_launched is False
    with patch_environment(FORK_LAUNCHED="1"):
        assert AcceleratorState().fork_launched is True
    seen: list[str | None] = []

    def fake_elastic_launch(config: object, entry: object) -> object:
        return lambda *args: seen.append(os.environ.get("FORK_LAUNCHED"))

    monkeypatch.setattr(launcher_api, "elastic_launch", fake_elastic_launch)
    notebook._run_forked(print, (), LaunchSettings(num_processes=2), settings={})
    assert seen == ["1"] and "FORK_LAUNCHED" not in os.environ  # set for the workers only


def test_the_state_answers_what_accelerate_asks_of_its_distributed_type():
    """The one reader of the distributed-type table outside config/ (tests/test_architecture_spellings.py):
    the Accelerator's ``multi_device``/``is_fsdp2``, ``deepspeed_required`` and ``prepare`` ask the state."""
    state = AcceleratorState(cpu=True)
    assert (state.multi_device, state.is_fsdp2, state.uses_deepspeed, state.is_plain) == (
        False,
        False,
        False,
        True,
    )
    state.distributed_type = "DEEPSPEED"
    assert (state.multi_device, state.is_fsdp2, state.uses_deepspeed, state.is_plain) == (
        False,
        False,
        True,
        False,
    )
    state.distributed_type = "FSDP"
    assert (state.is_fsdp2, state.uses_deepspeed, state.is_plain) == (True, False, False)
    state.distributed_type = "MULTI_GPU"  # one process: not multi-device, as Accelerate's Accelerator says
    assert (state.multi_device, state.is_plain) == (False, False)
