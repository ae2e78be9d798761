"""``accelerate.utils.transformer_engine``: importable, not supported (lockstep has no FP8 backend).

Calling these functions raises ``NotImplementedError``; use ``mixed_precision="bf16"`` (or ``"fp16"``).
"""

from lockstep.utils.unsupported import (
    apply_fp8_autowrap,
    contextual_fp8_autocast,
    convert_model,
    has_transformer_engine_layers,
)

__all__ = ["apply_fp8_autowrap", "contextual_fp8_autocast", "convert_model", "has_transformer_engine_layers"]
