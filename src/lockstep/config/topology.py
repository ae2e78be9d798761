"""What a configured ``distributed_type`` means: the one table of distributed types outside the backend
registry.

The launcher, the config wizard, the Accelerator's settings and the Trainer ask these functions instead
of comparing ``DistributedType`` members themselves. What a backend's type configures (its section, its
plugin) comes from the backend's own spec (:mod:`lockstep.config.backend_specs`); this table keeps what
Accelerate's public properties ask of a type (``multi_device``, ``is_fsdp2``) and the types not built.

This module must not import torch: ``lockstep launch`` and ``lockstep config`` read it at start-up.

Example:
    >>> data_parallel_type(processes=2, cpu=True)
    <DistributedType.MULTI_CPU: 'MULTI_CPU'>
    >>> config_section("FSDP")
    'fsdp_config'
    >>> is_multi_device("MULTI_GPU"), is_multi_device("MULTI_CPU")
    (True, False)
    >>> is_fsdp2("FSDP")
    True
    >>> checked_distributed_type("XLA")
    Traceback (most recent call last):
    lockstep.errors.UsageError: distributed_type XLA is not supported yet: TPUs (XLA) is not part of this version of lockstep. Use MULTI_CPU or MULTI_GPU (DDP).
"""

from __future__ import annotations

from dataclasses import dataclass

from lockstep.config.enums import DistributedType
from lockstep.errors import UsageError


@dataclass(frozen=True)
class _Kind:
    section: str | None = None
    """The config section that configures it (``fsdp_config`` for FSDP)."""
    not_built: str | None = None
    """What is missing, for types this version of lockstep does not run."""
    gpu_only: bool = False
    multi_device: bool = False
    """Data parallel with one accelerator device per process (Accelerate's ``Accelerator.multi_device``)."""
    fsdp2: bool = False
    """The model is sharded with FSDP2 (``fully_shard``); lockstep's FSDP is always FSDP2."""


_KINDS: dict[DistributedType, _Kind] = {
    DistributedType.FSDP: _Kind(fsdp2=True),
    DistributedType.MEGATRON_LM: _Kind(section="megatron_lm_config", not_built="the Megatron-LM backend"),
    DistributedType.XLA: _Kind(not_built="TPUs (XLA)"),
    DistributedType.MULTI_GPU: _Kind(gpu_only=True, multi_device=True),
    DistributedType.MULTI_XPU: _Kind(multi_device=True),
    DistributedType.MULTI_MPS: _Kind(multi_device=True),
}
_DATA_PARALLEL = {True: DistributedType.MULTI_CPU, False: DistributedType.MULTI_GPU}


def _kind(distributed_type: str | DistributedType | None) -> _Kind:
    """The row of a distributed type; unknown names have none (checked_distributed_type rejects them)."""
    try:
        member = DistributedType.parse(distributed_type, argument="distributed_type")
    except ValueError:
        return _Kind()
    return _KINDS.get(member, _Kind())


def checked_distributed_type(requested: str | DistributedType | None) -> DistributedType | None:
    """The requested ``distributed_type`` as a member (None stays None).

    Raises:
        UsageError: an unknown type, or one this version of lockstep does not run.
    """
    if requested is None:
        return None
    try:
        chosen = DistributedType.parse(requested, argument="distributed_type")
    except ValueError as error:
        raise UsageError(str(error)) from None
    missing = _kind(chosen).not_built
    if missing is not None:
        raise UsageError(
            f"distributed_type {chosen.value} is not supported yet: {missing} is not part of this version of "
            "lockstep. Use MULTI_CPU or MULTI_GPU (DDP)."
        )
    return chosen


def is_plain(distributed_type: str | DistributedType | None) -> bool:
    """Whether nothing beyond the process count was asked for (no type, or NO): the launcher then derives
    data parallel on CPUs or GPUs for more than one process."""
    return distributed_type is None or DistributedType.parse(
        distributed_type, argument="distributed_type"
    ) in (DistributedType.NO,)


def config_section(distributed_type: str | DistributedType | None) -> str | None:
    """The config file section that configures ``distributed_type`` (``fsdp_config`` for FSDP, from the
    backend's spec; ``megatron_lm_config`` for a type not built), or None."""
    from lockstep.config.backend_specs import spec_for_distributed_type

    spec = spec_for_distributed_type(distributed_type)
    return spec.config_section if spec is not None else _kind(distributed_type).section


def is_multi_device(distributed_type: str | DistributedType | None) -> bool:
    """Whether ``distributed_type`` is data parallel over accelerator devices, one per process (MULTI_GPU,
    MULTI_XPU, MULTI_MPS): what Accelerate's ``Accelerator.multi_device`` asks. Data parallel on CPUs and
    sharded types are not."""
    return _kind(distributed_type).multi_device


def is_fsdp2(distributed_type: str | DistributedType | None) -> bool:
    """Whether ``distributed_type`` shards the model with FSDP2 (Accelerate's ``is_fsdp2``: in lockstep,
    FSDP is always FSDP2)."""
    return _kind(distributed_type).fsdp2


def is_deepspeed(distributed_type: str | DistributedType | None) -> bool:
    """Whether ``distributed_type`` is DEEPSPEED: what
    Accelerate's ``deepspeed_required`` and ``AcceleratorState.deepspeed_plugin`` ask."""
    return distributed_type is not None and (
        DistributedType.parse(distributed_type, argument="distributed_type") is DistributedType.DEEPSPEED
    )


def check_device_agreement(distributed_type: str | DistributedType | None, *, use_cpu: bool) -> None:
    """Raise when a GPU-only type (``--multi-gpu``) is combined with ``--cpu``."""
    if use_cpu and _kind(distributed_type).gpu_only:
        raise UsageError("--multi-gpu and --cpu contradict each other; pick one.")


def data_parallel_type(*, processes: int, cpu: bool) -> DistributedType:
    """What the config wizard writes for ``processes`` plain data-parallel processes: NO for one process,
    else MULTI_CPU or MULTI_GPU."""
    return _DATA_PARALLEL[cpu] if processes > 1 else DistributedType.NO
