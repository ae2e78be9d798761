"""The device and package questions added from Accelerate 1.15 (``get_current_device_type``,
``check_cuda_fp8_capability``, ``set_numa_affinity``, ``is_rocm_available`` and the other probes) answer
truthfully on this machine and, through fakes, on the hardware it lacks; ``torchao_required`` and
``deepspeed_required`` guard functions as Accelerate's do."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from lockstep import Accelerator
from lockstep.state import AcceleratorState
from lockstep.utils import environment as env
from lockstep.utils import imports


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: object) -> types.ModuleType:
    """Install ``name`` (and its parent packages) in ``sys.modules`` for the test."""
    module = types.ModuleType(name)
    for key, value in attributes.items():
        setattr(module, key, value)
    parts = name.split(".")
    for depth in range(1, len(parts)):
        parent = ".".join(parts[:depth])
        if parent not in sys.modules:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, name, module)
    return module


# -- on this machine (no accelerator, none of the vendor packages) -----------------------------------------
def test_this_cpu_machine_is_described_truthfully():
    assert env.get_current_device_type() == ("cpu", "MULTI_CPU")
    assert env.check_cuda_fp8_capability() is False
    assert imports.is_rocm_available() is (torch.version.hip is not None) is False
    assert imports.is_xccl_available() is False  # a CPU build of torch has no XCCL
    probes = [
        imports.is_amdsmi_available,
        imports.is_bitsandbytes_multi_backend_available,
        imports.is_habana_gaudi1,
        imports.is_neuron_available,
        imports.is_sdaa_available,
        imports.is_transformer_engine_mxfp8_available,
    ]
    assert [probe() for probe in probes] == [False] * len(probes)


# -- the answers for hardware this machine lacks ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("available", "expected"),
    [
        ({"is_npu_available"}, ("npu", "MULTI_NPU")),
        ({"is_hpu_available", "is_xpu_available"}, ("hpu", "MULTI_HPU")),  # vendor plugins come first
        ({"cuda", "is_xpu_available"}, ("cuda", "MULTI_GPU")),
        ({"is_xpu_available"}, ("xpu", "MULTI_XPU")),
    ],
)
def test_get_current_device_type_in_accelerates_order(monkeypatch, available, expected):
    names = ["is_mlu_available", "is_sdaa_available", "is_musa_available", "is_npu_available"]
    for name in [*names, "is_hpu_available", "is_xpu_available"]:
        monkeypatch.setattr(imports, name, lambda *a, _n=name, **k: _n in available)
    seen = []

    def cuda_is_available() -> bool:
        seen.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
        return "cuda" in available

    monkeypatch.setattr(torch.cuda, "is_available", cuda_is_available)
    assert env.get_current_device_type() == expected
    assert set(seen) <= {"1"}  # CUDA is asked through NVML, which creates no context before a fork


@pytest.mark.parametrize(("capability", "expected"), [("9.0", True), ("8.9", True), ("8.6", False)])
def test_check_cuda_fp8_capability_reads_nvidia_smi(monkeypatch, capability, expected):
    monkeypatch.setattr(env, "_query_gpus", lambda field: {"compute_cap": [capability, "7.0"]}[field])
    assert env.check_cuda_fp8_capability() is expected  # the first GPU decides


def test_check_cuda_fp8_capability_falls_back_to_torch(monkeypatch):
    def no_smi(field: str) -> list[str]:
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(env, "_query_gpus", no_smi)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    assert env.check_cuda_fp8_capability() is True
    monkeypatch.setattr(env, "_query_gpus", lambda field: ["not a number"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert env.check_cuda_fp8_capability() is False


def test_set_numa_affinity_pins_to_the_cores_nvml_names(monkeypatch):
    env.set_numa_affinity.cache_clear()
    assert env.set_numa_affinity(0) is None  # no CUDA here: nothing happens, as in Accelerate
    pinned: list[list[int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(list(cores)))
    monkeypatch.setattr(os, "cpu_count", lambda: 96)
    masks = {1: [0b1010, 0b1]}  # GPU 1: cores 1 and 3 in the first word, core 64 in the second
    fake_module(
        monkeypatch,
        "pynvml",
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetCpuAffinity=lambda handle, words: masks[handle][:words],
    )
    env.set_numa_affinity.cache_clear()
    env.set_numa_affinity(1)
    env.set_numa_affinity(1)  # cached: pinned once
    assert pinned == [[1, 3, 64]]
    env.set_numa_affinity.cache_clear()


def test_set_numa_affinity_without_pynvml_says_what_to_install(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it raises ImportError
    env.set_numa_affinity.cache_clear()
    with pytest.raises(ImportError, match="pip install nvidia-ml-py"):
        env.set_numa_affinity(0)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(NotImplementedError, match="on ROCm GPUs is not supported by lockstep"):
        env.set_numa_affinity(2)
    env.set_numa_affinity.cache_clear()


def test_is_rocm_available_follows_the_torch_build(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert imports.is_rocm_available() is True


def test_vendor_and_library_probes_ask_the_installed_package(monkeypatch):
    monkeypatch.setattr(imports, "_installed", lambda module, *d: module in {"torch_sdaa", "amdsmi"})
    assert imports.is_sdaa_available() is True and imports.is_neuron_available() is False
    assert imports.is_amdsmi_available() is True
    monkeypatch.setattr(imports, "is_bnb_available", lambda *a: True)
    fake_module(monkeypatch, "bitsandbytes", features={"multi_backend"})
    assert imports.is_bitsandbytes_multi_backend_available() is True
    sys.modules["bitsandbytes"].features = set()
    assert imports.is_bitsandbytes_multi_backend_available() is False


def test_gaudi_and_mxfp8_probes_ask_the_vendor_packages(monkeypatch):
    device_type = types.SimpleNamespace(synDeviceGaudi=1, synDeviceGaudi2=2)
    experimental = fake_module(
        monkeypatch,
        "habana_frameworks.torch.utils.experimental",
        synDeviceType=device_type,
        _get_device_type=lambda: 1,
    )
    monkeypatch.setattr(imports, "is_hpu_available", lambda *a: True)
    assert imports.is_habana_gaudi1() is True
    experimental._get_device_type = lambda: 2
    assert imports.is_habana_gaudi1() is False
    support = {"answer": (True, "")}
    fp8 = types.SimpleNamespace(check_mxfp8_support=lambda: support["answer"])
    fake_module(monkeypatch, "transformer_engine.pytorch", fp8=fp8)
    monkeypatch.setattr(imports, "is_transformer_engine_available", lambda: True)
    assert imports.is_transformer_engine_mxfp8_available() is True
    support["answer"] = (False, "MXFP8 needs compute capability 10.0")
    assert imports.is_transformer_engine_mxfp8_available() is False


# -- decorators -------------------------------------------------------------------------------------------------
def test_torchao_required_guards_the_call(monkeypatch):
    @imports.torchao_required
    def quantize(model: str) -> str:
        """Quantize."""
        return f"quantized {model}"

    assert quantize.__name__ == "quantize" and quantize.__doc__ == "Quantize."
    monkeypatch.setattr(imports, "is_torchao_available", lambda: False)
    with pytest.raises(ImportError, match=r"quantize\(\) needs torchao, which is not installed: pip install"):
        quantize("m")
    monkeypatch.setattr(imports, "is_torchao_available", lambda: True)
    assert quantize("m") == "quantized m"


def test_deepspeed_required_passes_before_an_accelerator_and_refuses_after():
    @imports.deepspeed_required
    def zero_stage() -> int:
        return 3

    assert zero_stage() == 3  # no Accelerator yet: as in Accelerate, the call goes through
    Accelerator(cpu=True)
    with pytest.raises(
        ValueError, match=r"zero_stage\(\) needs DeepSpeed, and the Accelerator is set up for NO"
    ):
        zero_stage()
    AcceleratorState().distributed_type = "DEEPSPEED"  # what code may set, as in Accelerate
    assert zero_stage() == 3


def test_no_probe_starts_a_subprocess_it_does_not_need(monkeypatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a probe ran a command")

    monkeypatch.setattr(subprocess, "check_output", refuse)
    assert env.get_current_device_type() == ("cpu", "MULTI_CPU")
