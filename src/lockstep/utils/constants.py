"""``accelerate.utils.constants``: the file names of checkpoints and saved models, and a few tables.

The names are those lockstep's ``save_state`` and ``save_model`` write, which are Accelerate's (see
:mod:`lockstep.checkpoint.training_state` and :mod:`lockstep.checkpoint.model_files`).

Example:
    >>> SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME
    ('model.safetensors', 'pytorch_model.bin.index.json')
    >>> STR_OPERATION_TO_FUNC[">="](2, 1)
    True
"""

from __future__ import annotations

import operator

from lockstep.checkpoint.model_files import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)
from lockstep.config.kwargs import PROFILE_PATTERN_NAME

__all__ = [
    "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION",
    "MODEL_NAME",
    "OPTIMIZER_NAME",
    "PROFILE_PATTERN_NAME",
    "RNG_STATE_NAME",
    "SAFE_MODEL_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_PATTERN_NAME",
    "SAMPLER_NAME",
    "SCALER_NAME",
    "SCHEDULER_NAME",
    "STR_OPERATION_TO_FUNC",
    "TORCH_DISTRIBUTED_OPERATION_TYPES",
    "TORCH_LAUNCH_PARAMS",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_PATTERN_NAME",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
]

MODEL_NAME = "pytorch_model"
"""Stem of a model's ``.bin`` weights in a checkpoint."""
SAFE_MODEL_NAME = "model"
"""Stem of a model's safetensors weights in a checkpoint."""
OPTIMIZER_NAME = "optimizer"
"""Stem of the optimizer state files (``optimizer.bin``, ``optimizer_1.bin``...)."""
SCHEDULER_NAME = "scheduler"
"""Stem of the LR scheduler state files."""
SAMPLER_NAME = "sampler"
"""Stem of Accelerate's sampler state files."""
SCALER_NAME = "scaler.pt"
"""The fp16 GradScaler's state file."""
RNG_STATE_NAME = "random_states"
"""Stem of the per-rank random state files (``random_states_0.pkl``...)."""
WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin"
"""Name pattern of sharded ``.bin`` weights (``suffix`` is ``-00001-of-00002``)."""
SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors"
"""Name pattern of sharded safetensors weights."""

STR_OPERATION_TO_FUNC = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}
"""Comparison strings accepted by :func:`~lockstep.utils.versions.compare_versions`."""

TORCH_LAUNCH_PARAMS = [
    "nnodes",
    "nproc_per_node",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "standalone",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "role",
    "module",
    "m",
    "no_python",
    "run_path",
    "log_dir",
    "r",
    "redirects",
    "t",
    "tee",
    "node_rank",
    "master_addr",
    "master_port",
]
"""The options of ``torchrun``."""

TORCH_DISTRIBUTED_OPERATION_TYPES = ["MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_MPS", "FSDP", "DEEPSPEED"]
"""``DistributedType`` values whose collectives go through ``torch.distributed`` (lockstep's members)."""

XPU_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.4.0"
"""The first torch whose profiler records Intel XPU activity (``ProfileKwargs(activities=["xpu"])``)."""
MITA_PROFILING_AVAILABLE_PYTORCH_VERSION = "2.1.0"
"""The first torch whose profiler records MTIA activity (``activities=["mtia"]``)."""
