"""LoRA adapters in a memory estimate: the base frozen, the adapters the only trainable parameters.

peft's LoRA (``LoraConfig(r=R, target_modules=[...])``, no bias) adds to each targeted ``nn.Linear`` of
``in_features`` inputs and ``out_features`` outputs two matrices, ``lora_A`` (R x in) and ``lora_B`` (out x R):
``R * (in + out)`` trainable elements, while every weight of the base is frozen (parameters only: no gradient, no
optimizer state). Counted on the model built on the meta device, without peft.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from lockstep.errors import UsageError
from lockstep.memory.estimate.model_source import ModelDescription


@dataclass(frozen=True)
class LoraShape:
    """The adapters asked for: the rank and the names of the targeted linear layers (the last part of a
    module's name, as peft matches a list of ``target_modules``)."""

    rank: int
    targets: tuple[str, ...]


def with_lora(description: ModelDescription, model: nn.Module, lora: LoraShape) -> ModelDescription:
    """``description`` of ``model`` with its base frozen and LoRA adapters of ``lora`` trainable."""
    targeted = [
        module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in lora.targets
    ]
    if not targeted:
        linear = sorted(
            {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise UsageError(
            f"--lora-targets {','.join(lora.targets)} matches no linear layer of {description.model_class}; its "
            f"linear layers are named {', '.join(linear) or '(none)'}. Pass the names peft's target_modules would "
            "get, e.g. --lora-targets q_proj,v_proj."
        )
    adapters = sum(lora.rank * (m.in_features + m.out_features) for m in targeted)
    return dataclasses.replace(
        description,
        trainable_parameters=adapters,
        frozen_parameters=description.num_parameters,
        adapters=f"LoRA r={lora.rank} on {len(targeted)} layers ({', '.join(lora.targets)})",
    )
