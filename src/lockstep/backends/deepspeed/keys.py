"""The DeepSpeed vocabulary: every key of the config file's ``deepspeed_config`` section.

A file with ``distributed_type: DEEPSPEED`` trains with lockstep's DeepSpeed backend
(:mod:`lockstep.backends.deepspeed`). :data:`DEEPSPEED_KEYS` is the table the launcher's
``DeepSpeedPlugin`` is derived from (:mod:`lockstep.backends.deepspeed.section`); its fields name the fields
of Accelerate's ``DeepSpeedPlugin``, and keys read by DeepSpeed's own launcher (hostfile, multi-node
launcher) have none. See :mod:`lockstep.config.keys` for the shape. The keys that ``accelerate launch``
offers as flags are flags (``--zero-stage`` / ``--zero_stage``, ...), which ``lockstep launch`` accepts in
both spellings. ``gradient_accumulation_steps`` is not one: the launcher's own
``--gradient-accumulation-steps`` sets it for every backend.

This module must not import torch.
"""

from __future__ import annotations

from lockstep.config import checks
from lockstep.config.keys import SettingKey

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_MULTINODE_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh")

DEEPSPEED_KEYS: tuple[SettingKey, ...] = (
    SettingKey(
        key="deepspeed_config_file",
        field="hf_ds_config",
        check=checks.string,
        help="path of a DeepSpeed JSON config; replaces the keys below",
        flag=True,
    ),
    SettingKey(
        key="zero_stage",
        field="zero_stage",
        check=checks.int_range(0, 3),
        help="ZeRO stage: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters",
        flag=True,
    ),
    SettingKey(
        key="gradient_accumulation_steps",
        field="gradient_accumulation_steps",
        check=checks.auto_or(checks.int_range(1)),
        help="micro-batches per optimizer step, or auto",
    ),
    SettingKey(
        key="gradient_clipping",
        field="gradient_clipping",
        check=checks.auto_or(checks.non_negative_float),
        help="clip the global gradient norm to this, or auto",
        flag=True,
    ),
    SettingKey(
        key="offload_optimizer_device",
        field="offload_optimizer_device",
        check=checks.choice(*_OFFLOAD_DEVICES),
        help="where optimizer states live: none, cpu or nvme",
        flag=True,
    ),
    SettingKey(
        key="offload_param_device",
        field="offload_param_device",
        check=checks.choice(*_OFFLOAD_DEVICES),
        help="where parameters live (ZeRO-3): none, cpu or nvme",
        flag=True,
    ),
    SettingKey(
        key="offload_optimizer_nvme_path",
        field="offload_optimizer_nvme_path",
        check=checks.string,
        help="NVMe folder for offloaded optimizer states",
        flag=True,
    ),
    SettingKey(
        key="offload_param_nvme_path",
        field="offload_param_nvme_path",
        check=checks.string,
        help="NVMe folder for offloaded parameters",
        flag=True,
    ),
    SettingKey(
        key="zero3_init_flag",
        field="zero3_init_flag",
        check=checks.boolean,
        help="build the model already sharded (deepspeed.zero.Init)",
        flag=True,
    ),
    SettingKey(
        key="zero3_save_16bit_model",
        field="zero3_save_16bit_model",
        check=checks.boolean,
        help="ZeRO-3: also save the gathered 16-bit weights",
        flag=True,
    ),
    SettingKey(
        key="deepspeed_moe_layer_cls_names",
        field="transformer_moe_cls_names",
        check=checks.string,
        help="comma-separated mixture-of-experts layer classes",
        flag=True,
    ),
    SettingKey(
        key="deepspeed_multinode_launcher",
        field=None,
        check=checks.choice(*_MULTINODE_LAUNCHERS),
        help="how DeepSpeed starts the other machines (read by the launcher)",
        flag=True,
    ),
    SettingKey(
        key="deepspeed_hostfile",
        field=None,
        check=checks.string,
        help="hostfile listing machines and their slots (read by the launcher)",
        flag=True,
    ),
    SettingKey(
        key="deepspeed_exclusion_filter",
        field=None,
        check=checks.string,
        help="hosts or devices to leave out (read by the launcher)",
        flag=True,
    ),
    SettingKey(
        key="deepspeed_inclusion_filter",
        field=None,
        check=checks.string,
        help="hosts or devices to use (read by the launcher)",
        flag=True,
    ),
)
"""Every ``deepspeed_config`` key: file key -> DeepSpeedPlugin field (Accelerate's) -> check -> help."""
