"""Peak FLOP/s of known accelerators, per compute dtype, for model FLOPs utilisation (MFU).

Figures are the vendors' *dense* peaks (datasheets quote tensor-core figures "with sparsity", twice the
dense ones; those are halved here), for one device. MFU is achieved model FLOP/s divided by this peak.
A device not in the table, a MIG slice (whose share of the chip is not known here) and the CPU have no
peak: MFU is then not reported unless ``ThroughputKwargs(peak_flops=...)`` gives one.

Example:
    >>> peak_flops_per_second("NVIDIA H100 80GB HBM3", "bf16")
    989400000000000.0
    >>> peak_flops_per_second("NVIDIA A100-SXM4-40GB", "fp32")
    19500000000000.0
    >>> peak_flops_per_second("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16") is None
    True
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

COMPUTE_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""The names :func:`peak_flops_per_second` accepts: plain fp32, fp32 matmuls on TF32 tensor cores, ..."""

_T = 1e12

# name pattern (regular expression on the lower-cased device name) -> {compute dtype: dense FLOP/s}.
# Order matters: the first pattern that matches wins, so variants come before the plain model name.
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    # NVIDIA Blackwell (HGX B200 datasheet, per GPU)
    (r"\bb200\b", {"tf32": 1100 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T, "fp8": 4500 * _T}),
    # NVIDIA Hopper (H100/H200 datasheets). The SXM parts report as e.g. "NVIDIA H100 80GB HBM3".
    (
        r"\bh100\b.*\bnvl\b",
        {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T, "fp8": 1670.5 * _T},
    ),
    (
        r"\bh100\b.*\bpcie\b",
        {"fp32": 51.2 * _T, "tf32": 378 * _T, "bf16": 756 * _T, "fp16": 756 * _T, "fp8": 1513 * _T},
    ),
    (
        r"\bh200\b.*\bnvl\b",
        {"fp32": 60 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T, "fp8": 1670.5 * _T},
    ),
    (
        r"\b(g?h100|g?h200|h800)\b",
        {"fp32": 66.9 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp8": 1978.9 * _T},
    ),
    # NVIDIA Ampere (A100 datasheet: SXM and PCIe, 40 and 80 GB, share the compute figures)
    (r"\b(a100|a800)\b", {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T}),
    (r"\ba40\b", {"fp32": 37.4 * _T, "tf32": 74.8 * _T, "bf16": 149.7 * _T, "fp16": 149.7 * _T}),
    # A10G: AWS's variant of the A10; NVIDIA publishes no separate sheet, so the A10's figures are used.
    (r"\ba10g?\b", {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125 * _T, "fp16": 125 * _T}),
    (r"\brtx a6000\b", {"fp32": 38.7 * _T, "tf32": 77.4 * _T, "bf16": 154.8 * _T, "fp16": 154.8 * _T}),
    # NVIDIA Ada
    (r"\bl40s\b", {"fp32": 91.6 * _T, "tf32": 183 * _T, "bf16": 362 * _T, "fp16": 362 * _T, "fp8": 733 * _T}),
    (r"\bl40\b", {"fp32": 90.5 * _T, "tf32": 90.5 * _T, "bf16": 181 * _T, "fp16": 181 * _T, "fp8": 362 * _T}),
    (r"\bl4\b", {"fp32": 30.3 * _T, "tf32": 60 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242.5 * _T}),
    (r"\brtx 4090\b", {"fp32": 82.6 * _T, "tf32": 82.6 * _T, "bf16": 165.2 * _T, "fp16": 165.2 * _T}),
    # NVIDIA Volta and Turing: no bfloat16 tensor cores, so no bf16 peak.
    (r"\bv100s\b", {"fp32": 16.4 * _T, "fp16": 130 * _T}),
    (r"\bv100\b.*\bpcie\b", {"fp32": 14 * _T, "fp16": 112 * _T}),
    (r"\bv100\b", {"fp32": 15.7 * _T, "fp16": 125 * _T}),
    (r"\bt4\b", {"fp32": 8.1 * _T, "fp16": 65 * _T}),
    # AMD Instinct (ROCm builds of torch report these names through torch.cuda)
    (
        r"\bmi3(00|25)x\b",
        {
            "fp32": 163.4 * _T,
            "tf32": 653.7 * _T,
            "bf16": 1307.4 * _T,
            "fp16": 1307.4 * _T,
            "fp8": 2614.9 * _T,
        },
    ),
    (r"\bmi250x?\b", {"fp32": 95.7 * _T, "bf16": 383 * _T, "fp16": 383 * _T}),
)


def peak_flops_per_second(device_name: str, compute_dtype: str) -> float | None:
    """The dense peak FLOP/s of one ``device_name`` in ``compute_dtype``, or None when not known.

    Args:
        device_name: the name ``torch.cuda.get_device_name()`` reports (case does not matter).
        compute_dtype: one of :data:`COMPUTE_DTYPES`.
    """
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"peak_flops_per_second(compute_dtype={compute_dtype!r}) is invalid: use one of {COMPUTE_DTYPES}."
        )
    name = device_name.lower()
    if re.search(r"\bmig\b", name):
        return None  # a slice of the chip: its share of the peak is not known here
    for pattern, peaks in _PEAKS:
        if re.search(pattern, name):
            return peaks.get(compute_dtype)
    return None


def compute_dtype_name(mixed_precision: str, param_dtype: torch.dtype | None) -> str:
    """The dtype matmuls run in: the mixed-precision dtype, else the parameters' (fp32 may use TF32).

    Args:
        mixed_precision: the Accelerator's ``mixed_precision`` (``"no"``, ``"fp16"``, ``"bf16"``, ``"fp8"``).
        param_dtype: dtype of the model's floating-point parameters (None when unknown).
    """
    if mixed_precision in ("fp16", "bf16", "fp8"):
        return mixed_precision
    if param_dtype == torch.bfloat16:
        return "bf16"
    if param_dtype == torch.float16:
        return "fp16"
    tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def device_peak_flops(
    device: torch.device, compute_dtype: str, device_name: Callable[[torch.device], str] | None = None
) -> float | None:
    """The peak FLOP/s of ``device`` in ``compute_dtype``: from the table for CUDA devices, else None.

    Args:
        device: the training device.
        compute_dtype: one of :data:`COMPUTE_DTYPES`.
        device_name: how to name a CUDA device (``torch.cuda.get_device_name`` by default).
    """
    if device.type != "cuda":
        return None
    name = (device_name or torch.cuda.get_device_name)(device)
    return peak_flops_per_second(name, compute_dtype)
