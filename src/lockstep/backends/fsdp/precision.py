"""FSDP's precision: the Accelerator's autocast forward plus the ``MixedPrecisionPolicy`` derived from it.

One :class:`FSDPPrecision` answers both questions for a sharded model: the forward runs under the same
autocast context as every other backend's, and ``fully_shard`` gets a policy with parameters in the
training dtype (bf16/fp16) and gradients reduced in fp32, unless the plugin names its own policy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from lockstep.precision import Precision

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


class FSDPPrecision(Precision):
    """Autocast and gradient scaling as :class:`~lockstep.precision.Precision`, plus the sharding policy."""

    def policy(self, configured: Any = None) -> MixedPrecisionPolicy:
        """The ``MixedPrecisionPolicy`` to shard with.

        Args:
            configured: the plugin's ``mixed_precision_policy``: a ``MixedPrecisionPolicy``, a dict of its
                fields (dtype names allowed), or None to derive it from this precision.
        """
        if isinstance(configured, MixedPrecisionPolicy):
            return configured
        if isinstance(configured, dict):
            return MixedPrecisionPolicy(**{key: _dtype(key, value) for key, value in configured.items()})
        if configured is not None:
            raise ValueError(
                f"FullyShardedDataParallelPlugin(mixed_precision_policy={configured!r}) is invalid: pass a "
                "torch.distributed.fsdp.MixedPrecisionPolicy, a dict of its fields, or None."
            )
        if self.dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)


def _dtype(key: str, value: Any) -> Any:
    if key == "cast_forward_inputs" or value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower()]
    raise ValueError(
        f"mixed_precision_policy['{key}']={value!r} is invalid: use a torch dtype or one of "
        f"{', '.join(_DTYPE_NAMES)}."
    )
