"""Importing DeepSpeed the way lockstep runs it: on lockstep's process group, without the JIT builds that
training never uses, with the environment it reads.

Example:
    >>> deepspeed_missing_message()
    "DeepSpeed is not installed: pip install 'lockstep[deepspeed]' (or pip install deepspeed)."
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from types import ModuleType
from typing import Any

# torch 2.13 deprecates the collectives DeepSpeed's ZeRO calls; the warning is about DeepSpeed's code, not
# the user's, and is raised on every step.
_DEEPSPEED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def deepspeed_missing_message() -> str:
    return "DeepSpeed is not installed: pip install 'lockstep[deepspeed]' (or pip install deepspeed)."


def is_deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def import_deepspeed(*, device_type: str, local_rank: int) -> ModuleType:
    """``deepspeed``, set up to run on this process's device and lockstep's process group.

    * ``DS_ACCELERATOR`` names the device type, so DeepSpeed neither probes for one nor warns;
    * ``LOCAL_RANK`` is set when the launcher did not (DeepSpeed reads it; the notebook launcher has none);
    * the shared-memory collective op is marked unavailable: DeepSpeed would otherwise JIT-compile it
      (about 100 s on a CPU machine) at every engine start, and training over gloo or NCCL never uses it.

    Raises:
        ModuleNotFoundError: DeepSpeed is not installed (the message names the pip line).
    """
    if not is_deepspeed_installed():
        raise ModuleNotFoundError(deepspeed_missing_message())
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if device_type == "cpu" else device_type)
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    warnings.filterwarnings("ignore", message=_DEEPSPEED_COLLECTIVES, category=FutureWarning)
    with warnings.catch_warnings():
        # DeepSpeed's imports reach torch modules that warn about their own deprecated decorators (in
        # torch.utils.mkldnn, through ZeRO's optimizer check); they say nothing about the user's code, and
        # under -W error they would stop the first step. Import them once, quietly.
        warnings.simplefilter("ignore", DeprecationWarning)
        import deepspeed
        import deepspeed.ops
        import deepspeed.runtime.zero.utils

        with contextlib.suppress(ImportError):
            import deepspeed.runtime.zero.muon.muon_optimizer

    compatible: dict[str, Any] = deepspeed.ops.__compatible_ops__
    compatible["deepspeed_shm_comm"] = False
    return deepspeed


def check_fp16_supported(deepspeed: ModuleType) -> None:
    """Raise before any work when fp16 is asked for on a device DeepSpeed cannot train fp16 on."""
    accelerator = deepspeed.accelerator.get_accelerator()
    if not accelerator.is_fp16_supported():
        raise ValueError(
            f"DeepSpeed cannot train in fp16 on this device ({accelerator.device_name()}): on a CPU it needs the "
            "avx512_fp16 instructions. Use mixed_precision='bf16' (or no mixed precision)."
        )
