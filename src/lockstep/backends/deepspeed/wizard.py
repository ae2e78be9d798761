"""The DeepSpeed questions of ``lockstep config`` (the ones Accelerate's wizard asks), answered into a
``deepspeed_config`` section.

This module must not import torch (the wizard runs without it).
"""

from __future__ import annotations

from typing import Any

from lockstep.config.answers import Ask, parse_choice, parse_int, parse_text, parse_yes_no

_DEVICES = ("none", "cpu", "nvme")


def ask_deepspeed_section(ask: Ask) -> dict[str, Any]:
    """A JSON config file, or the ZeRO stage, offload devices, ZeRO-3 options and gradient clipping."""
    section: dict[str, Any] = {}
    config_file = ask("DeepSpeed JSON config file (none: answer the questions instead)?", "none", parse_text)
    if config_file is not None:
        section["deepspeed_config_file"] = config_file
        return section
    section["zero_stage"] = ask("ZeRO stage (0, 1, 2, 3)?", "2", parse_int(0, 3))
    section["offload_optimizer_device"] = ask(
        "Offload the optimizer state to (none, cpu, nvme)?", "none", parse_choice(_DEVICES)
    )
    if section["zero_stage"] == 3:
        section["offload_param_device"] = ask(
            "Offload the parameters to (none, cpu, nvme)?", "none", parse_choice(_DEVICES)
        )
        section["zero3_init_flag"] = ask(
            "Build models already partitioned (zero3_init_flag, yes/no)?", "yes", parse_yes_no
        )
        section["zero3_save_16bit_model"] = ask(
            "Gather the whole 16-bit model when saving it (yes/no)?", "no", parse_yes_no
        )
    section["gradient_clipping"] = ask("Clip the gradient norm to (0: do not clip)?", "1.0", float)
    return section
