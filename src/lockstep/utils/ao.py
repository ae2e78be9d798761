"""``accelerate.utils.ao``: importable, not supported (FP8 training through torchao; lockstep has no FP8
backend).

Calling these functions raises ``NotImplementedError``; use ``mixed_precision="bf16"`` (or ``"fp16"``).
"""

from lockstep.utils.unsupported import (
    convert_model_to_fp8_ao,
    filter_first_and_last_linear_layers,
    has_ao_layers,
)

__all__ = ["convert_model_to_fp8_ao", "filter_first_and_last_linear_layers", "has_ao_layers"]
