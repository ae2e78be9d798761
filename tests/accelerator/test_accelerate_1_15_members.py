"""Accelerate 1.15's Accelerator members that lockstep added for issue 15 (item 1): gradient sync on demand,
the profiler, the topology questions, the dataloader and handler attributes, the device-map check, and the
members of features not built yet (DeepSpeed, ParallelismConfig, FP8, LOMO)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lockstep import (
    Accelerator,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    ProfileKwargs,
)
from lockstep.backends import capabilities as backend_capabilities
from lockstep.config import topology
from lockstep.config.kwargs import FP8BackendType
from tests.helpers.multiprocess import run_distributed

INPUTS = {0: [1.0, 2.0, 3.0, 4.0], 1: [5.0, 6.0, 7.0, 8.0]}
# loss = sum(W x) / 4 (accumulation steps) per micro-step; two micro-steps accumulated, averaged over ranks
SYNCED = [1.5, 2.0, 2.5, 3.0]


# -- trigger_sync_in_backward --------------------------------------------------------------------------
def _full_grad(parameter: nn.Parameter) -> list[list[float]] | None:
    grad = parameter.grad
    if grad is None:
        return None
    if hasattr(grad, "full_tensor"):
        grad = grad.full_tensor()
    return grad.tolist()


def _trigger_sync(sharded: bool) -> dict:
    plugin = FullyShardedDataParallelPlugin() if sharded else None
    accelerator = Accelerator(gradient_accumulation_steps=4, fsdp_plugin=plugin)
    model = nn.Linear(4, 2, bias=False)
    nn.init.ones_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.tensor([INPUTS[accelerator.process_index]])
    grads = []
    for micro_step in range(3):
        with accelerator.accumulate(model):
            loss = model(x).sum()  # the forward runs under no_sync: no step synchronises by itself
            if micro_step == 1:
                with accelerator.trigger_sync_in_backward(model):
                    accelerator.backward(loss)
            else:
                accelerator.backward(loss)
            grads.append(_full_grad(next(model.parameters())))
            assert not accelerator.sync_gradients
    return {"grads": grads, "is_fsdp2": accelerator.is_fsdp2, "multi_device": accelerator.multi_device}


@pytest.mark.distributed
def test_trigger_sync_in_backward_synchronises_one_ddp_micro_step():
    rank0, rank1 = run_distributed(_trigger_sync, 2, False)
    # micro-step 0: local gradients only (x / 4 on each rank)
    assert rank0["grads"][0] == [[0.25, 0.5, 0.75, 1.0]] * 2
    assert rank1["grads"][0] == [[1.25, 1.5, 1.75, 2.0]] * 2
    # micro-step 1, triggered: both micro-steps' gradients, averaged over the ranks
    assert rank0["grads"][1] == rank1["grads"][1] == [SYNCED] * 2
    # micro-step 2: no_sync again (the trigger restored it): each rank adds its own x / 4
    assert rank0["grads"][2] == [[1.75, 2.5, 3.25, 4.0]] * 2
    assert rank1["grads"][2] == [[2.75, 3.5, 4.25, 5.0]] * 2
    assert (rank0["is_fsdp2"], rank0["multi_device"]) == (False, False)  # DDP on CPUs, as Accelerate says


@pytest.mark.distributed
def test_trigger_sync_in_backward_reduce_scatters_one_fsdp2_micro_step():
    rank0, rank1 = run_distributed(_trigger_sync, 2, True)
    for rank in (rank0, rank1):
        assert rank["grads"][0] is None  # FSDP2 keeps unsynchronised gradients to itself
        assert rank["grads"][1] == [SYNCED] * 2
        assert rank["grads"][2] == [SYNCED] * 2  # the next micro-step does not reduce-scatter again
        assert (rank["is_fsdp2"], rank["multi_device"]) == (True, False)


def _trigger_with_unused_parameter_search() -> str:
    accelerator = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    model = accelerator.prepare(nn.Linear(4, 2))
    try:
        accelerator.trigger_sync_in_backward(model)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.distributed
def test_trigger_sync_in_backward_refuses_ddp_searching_for_unused_parameters():
    for message in run_distributed(_trigger_with_unused_parameter_search, 2):
        assert (
            "cannot synchronise a DDP model built with DistributedDataParallelKwargs(find_unused_p" in message
        )


def test_trigger_sync_in_backward_is_a_no_op_on_one_process():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = accelerator.prepare(nn.Linear(4, 1, bias=False))
    with accelerator.accumulate(model):
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(model(torch.ones(1, 4)).sum())
    assert model.weight.grad.tolist() == [[0.5] * 4]


# -- profile ------------------------------------------------------------------------------------------
def _matmuls(steps: int = 1) -> None:
    for _ in range(steps):
        torch.ones(16, 8) @ torch.ones(8, 4)


def _mm_events(prof: torch.profiler.profile) -> list:
    return [event for event in prof.key_averages(group_by_input_shape=True) if event.key == "aten::mm"]


def test_profile_records_with_the_handler_given_or_configured_or_the_defaults():
    accelerator = Accelerator(
        cpu=True, kwargs_handlers=[ProfileKwargs(activities=["cpu"], record_shapes=True, with_flops=True)]
    )
    assert accelerator.profile_handler.record_shapes
    with accelerator.profile() as prof:
        _matmuls()
    (mm,) = _mm_events(prof)
    assert mm.input_shapes[:2] == [[16, 8], [8, 4]]
    assert mm.flops == 2 * 16 * 8 * 4
    with accelerator.profile(ProfileKwargs(activities=["cpu"])) as prof:  # an explicit handler wins
        _matmuls()
    (mm,) = _mm_events(prof)
    assert mm.input_shapes == [] and mm.flops == 0
    with Accelerator(cpu=True).profile() as prof:  # torch's defaults
        _matmuls(3)
    assert sum(event.count for event in _mm_events(prof)) == 3


def test_profile_follows_the_schedule_and_calls_on_trace_ready():
    windows = []
    handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"skip_first": 1, "wait": 1, "warmup": 1, "active": 2, "repeat": 1},
        on_trace_ready=lambda prof: windows.append((prof.step_num, len(_mm_events(prof)))),
    )
    with Accelerator(cpu=True).profile(handler) as prof:
        for step in range(8):
            _matmuls(step + 1)  # step s runs s + 1 products: the active steps are 3 and 4
            prof.step()
    assert windows == [(5, 1)]
    assert sum(event.count for event in _mm_events(prof)) == 4 + 5


def test_profile_records_memory():
    with Accelerator(cpu=True).profile(ProfileKwargs(activities=["cpu"], profile_memory=True)) as prof:
        torch.zeros(256, 256)
    (zeros,) = [event for event in prof.key_averages() if event.key == "aten::empty"]
    assert zeros.cpu_memory_usage == 256 * 256 * 4


def _trace_per_rank(folder: str) -> list[str]:
    accelerator = Accelerator()
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=folder)):
        _matmuls(accelerator.process_index + 1)
    return sorted(os.listdir(folder))  # after the barrier: every rank's trace is there


@pytest.mark.distributed
def test_profile_writes_one_chrome_trace_per_rank(tmp_path):
    listings = run_distributed(_trace_per_rank, 2, str(tmp_path))
    assert listings == [["profile_0.json", "profile_1.json"]] * 2
    for rank in (0, 1):
        events = json.loads((tmp_path / f"profile_{rank}.json").read_text())["traceEvents"]
        assert sum(event.get("name") == "aten::mm" for event in events) == rank + 1


def test_profile_without_a_recorded_step_says_how_to_schedule(tmp_path):
    handler = ProfileKwargs(
        activities=["cpu"],
        schedule_option={"wait": 5, "warmup": 1, "active": 1},
        output_trace_dir=str(tmp_path),
    )
    with pytest.raises(RuntimeError, match=r"nothing was recorded.*call prof.step\(\) after each step"):
        with Accelerator(cpu=True).profile(handler) as prof:
            prof.step()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"activities": ["gpu"]}, ValueError, r"'gpu' is not a profiler activity. Use cpu, cuda, xpu"),
        ({"schedule_option": {"wait": 1, "active": 1}}, ValueError, "warmup missing"),
        ({"schedule_option": {"wait": 1, "warmup": 0, "active": 1, "cycles": 2}}, ValueError, "unknown keys"),
        (
            {"schedule_option": {"wait": -1, "warmup": 0, "active": 1}},
            ValueError,
            "wait must be an integer >= 0",
        ),
        ({"schedule_option": {"wait": 0, "warmup": 0, "active": 0}}, ValueError, "active must be >= 1"),
        ({"on_trace_ready": "print"}, TypeError, "pass a function that takes the profiler"),
    ],
)
def test_profile_kwargs_reject_bad_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        ProfileKwargs(**kwargs)


def test_profile_kwargs_accept_torch_activities_and_need_the_device():
    handler = ProfileKwargs(activities=[torch.profiler.ProfilerActivity.CPU, "CPU"])
    assert handler.activities == ["cpu", "cpu"]
    if not torch.xpu.is_available():
        with pytest.raises(ValueError, match="there is no xpu device on this machine"):
            ProfileKwargs(activities=["xpu"]).build()


# -- topology, settings and handler attributes --------------------------------------------------------
@pytest.mark.parametrize(
    ("distributed_type", "multi_device", "fsdp2"),
    [
        ("NO", False, False),
        ("MULTI_CPU", False, False),
        ("MULTI_GPU", True, False),
        ("MULTI_XPU", True, False),
        ("MULTI_MPS", True, False),
        ("FSDP", False, True),
        (None, False, False),
    ],
)
def test_topology_answers_what_accelerate_asks(distributed_type, multi_device, fsdp2):
    assert topology.is_multi_device(distributed_type) is multi_device
    assert topology.is_fsdp2(distributed_type) is fsdp2


def _who_saves() -> tuple:
    accelerator = Accelerator()
    return (
        accelerator.should_save_model,
        accelerator.multi_device,
        accelerator.is_composable_parallelism_enabled,
    )


@pytest.mark.distributed
def test_should_save_model_is_the_local_main_process():
    assert run_distributed(_who_saves, 2) == [(True, False, False), (False, False, False)]


def test_one_process_answers_like_accelerate_without_plugins():
    accelerator = Accelerator(cpu=True)
    assert (accelerator.multi_device, accelerator.is_fsdp2, accelerator.should_save_model) == (
        False,
        False,
        True,
    )
    assert accelerator.is_composable_parallelism_enabled is False


def test_handlers_and_log_with_are_readable_as_in_accelerate():
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    profile = ProfileKwargs(with_stack=True)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[ddp, profile], log_with="jsonl", project_dir="runs")
    assert accelerator.ddp_handler is ddp and accelerator.profile_handler is profile
    assert (accelerator.scaler_handler, accelerator.init_handler, accelerator.autocast_handler) == (None,) * 3
    assert [str(spec) for spec in accelerator.log_with] == ["jsonl"]
    with pytest.raises(ValueError, match="more than one ProfileKwargs"):
        Accelerator(cpu=True, kwargs_handlers=[ProfileKwargs(), ProfileKwargs()])


def test_use_stateful_dataloader_reads_the_dataloader_configuration():
    pytest.importorskip("torchdata.stateful_dataloader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    assert Accelerator(cpu=True).use_stateful_dataloader is False
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    assert accelerator.use_stateful_dataloader is True
    loader = accelerator.prepare(DataLoader(list(range(8)), batch_size=4))
    assert isinstance(loader, StatefulDataLoader)


# -- device maps --------------------------------------------------------------------------------------
def _dispatched(entries: int) -> nn.Module:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.hf_device_map = {"0": 0, "1": 1} if entries == 2 else {"": 0}
    return model


def test_verify_device_map_sees_a_model_spread_over_devices():
    accelerator = Accelerator(cpu=True)
    assert accelerator.verify_device_map(_dispatched(2)) is True
    assert accelerator.verify_device_map(_dispatched(1)) is False
    nested = nn.Sequential(_dispatched(2))
    assert accelerator.verify_device_map(nested) is True
    assert accelerator.verify_device_map(nn.Linear(2, 2)) is False


def test_prepare_leaves_a_dispatched_model_where_its_device_map_put_it():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_dispatched(2))  # moving meta weights to the CPU would raise
    assert model[0].weight.is_meta
    with pytest.raises(NotImplementedError, match="meta"):
        accelerator.prepare(_dispatched(1))  # a one-device map is moved like any model


def _prepare_dispatched() -> None:
    Accelerator().prepare(_dispatched(2))


@pytest.mark.distributed
def test_a_dispatched_model_cannot_be_prepared_on_several_processes():
    with pytest.raises(
        AssertionError, match=r"Cannot prepare Sequential for MULTI_CPU training on 2 process"
    ):
        run_distributed(_prepare_dispatched, 2)


# -- features not built yet ---------------------------------------------------------------------------
def test_deepspeed_and_parallelism_members_answer_as_accelerate_without_them(caplog):
    accelerator = Accelerator(cpu=True)
    assert (accelerator.deepspeed_plugin, accelerator.parallelism_config, accelerator.torch_device_mesh) == (
        None,
        None,
        None,
    )
    assert accelerator.fp8_backend is FP8BackendType.NO and accelerator.fp8_backend == "NO"
    assert (accelerator.fp8_enabled, accelerator.has_fp8_handler, accelerator.has_lomo_optimizer) == (
        False,
    ) * 3
    loader = DataLoader(list(range(4)))
    assert accelerator.deepspeed_ulysses_dl_adapter(loader, nn.Linear(1, 1)) is loader
    backend_capabilities._warned.discard("maybe_context_parallel")
    buffers = [torch.arange(6).view(1, 6)]
    with caplog.at_level(logging.WARNING, logger="lockstep.backends"):
        for _ in range(2):
            with accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1]):
                ran = True
    assert ran and buffers[0].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert [r.message for r in caplog.records].count(
        "maybe_context_parallel() has no effect: context parallelism is not enabled, so the buffers are not "
        "split along the sequence. Pass Accelerator(parallelism_config=ParallelismConfig(cp_size=N)) to split "
        "them over N processes."
    ) == 1


@pytest.mark.parametrize(
    ("member", "size"),
    [
        ("tensor_parallel_rank", "tp_size"),
        ("data_parallel_rank", "dp_replicate_size"),
        ("data_parallel_shard_rank", "dp_shard_size"),
        ("context_parallel_rank", "cp_size"),
        ("pipeline_parallel_rank", "pp_size"),
    ],
)
def test_mesh_ranks_without_a_parallelism_config_raise_runtime_error_as_accelerate(member, size):
    accelerator = Accelerator(cpu=True)
    with pytest.raises(
        RuntimeError, match=rf"Accelerator.{member}: .* is not configured. .*ParallelismConfig\({size}="
    ):
        getattr(accelerator, member)


def test_lomo_optimizers_are_refused_clearly():
    accelerator = Accelerator(cpu=True)
    with pytest.raises(NotImplementedError, match=r"lomo_backward\(\) is not supported: LOMO optimizers"):
        accelerator.lomo_backward(torch.tensor(1.0), 0.1)
    lomo = type("Lomo", (torch.optim.SGD,), {"__module__": "lomo_optim.lomo"})
    model = nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match="Cannot prepare Lomo: LOMO optimizers"):
        accelerator.prepare(model, lomo(model.parameters(), lr=0.1))
