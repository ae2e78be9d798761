"""What a configured ``distributed_type`` means, asked of the backend that runs it.

The launcher, the config wizard, the Accelerator's settings and the Trainer ask these functions instead
of comparing ``DistributedType`` members themselves. Everything about a type a backend runs (its section,
its plugin, what Accelerate's public properties answer: ``multi_device``, ``is_fsdp2``) comes from that
backend's own spec (:mod:`lockstep.config.backend_specs`, ``type_facts``); this module keeps only the types
no backend of this version runs.

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

from lockstep.config.backend_specs import TypeFacts, spec_for_distributed_type
from lockstep.config.enums import DistributedType
from lockstep.errors import UsageError

_NOT_BUILT: dict[DistributedType, tuple[str | None, str]] = {
    DistributedType.MEGATRON_LM: ("megatron_lm_config", "the Megatron-LM backend"),
    DistributedType.XLA: (None, "TPUs (XLA)"),
}
"""The types no backend of this version runs: their config section (None: none), and what is missing."""
_DATA_PARALLEL = {True: DistributedType.MULTI_CPU, False: DistributedType.MULTI_GPU}


def _member(distributed_type: str | DistributedType | None) -> DistributedType | None:
    """The member a type names; None for no type and unknown names (checked_distributed_type rejects them)."""
    if distributed_type is None:
        return None
    try:
        return DistributedType.parse(distributed_type, argument="distributed_type")
    except ValueError:
        return None


def _facts(distributed_type: str | DistributedType | None) -> TypeFacts:
    """What the backend that runs ``distributed_type`` declares of it (its spec's ``type_facts``)."""
    member = _member(distributed_type)
    spec = spec_for_distributed_type(member) if member is not None else None
    return spec.type_facts.get(member, _NO_FACTS) if spec is not None and member is not None else _NO_FACTS


_NO_FACTS = TypeFacts()


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
    if chosen in _NOT_BUILT:
        missing = _NOT_BUILT[chosen][1]
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
    spec = spec_for_distributed_type(distributed_type)
    if spec is not None:
        return spec.config_section
    member = _member(distributed_type)
    return _NOT_BUILT[member][0] if member in _NOT_BUILT else None


def is_multi_device(distributed_type: str | DistributedType | None) -> bool:
    """Whether ``distributed_type`` is data parallel over accelerator devices, one per process (MULTI_GPU,
    MULTI_XPU, MULTI_MPS): what Accelerate's ``Accelerator.multi_device`` asks. Data parallel on CPUs and
    sharded types are not."""
    return _facts(distributed_type).multi_device


def is_fsdp2(distributed_type: str | DistributedType | None) -> bool:
    """Whether ``distributed_type`` shards the model with FSDP2 (Accelerate's ``is_fsdp2``: in lockstep,
    FSDP is always FSDP2)."""
    return _facts(distributed_type).fsdp2


def is_deepspeed(distributed_type: str | DistributedType | None) -> bool:
    """Whether ``distributed_type`` is DEEPSPEED: what
    Accelerate's ``deepspeed_required`` and ``AcceleratorState.deepspeed_plugin`` ask."""
    return _facts(distributed_type).deepspeed


def check_device_agreement(distributed_type: str | DistributedType | None, *, use_cpu: bool) -> None:
    """Raise when a GPU-only type (``--multi-gpu``) is combined with ``--cpu``."""
    if use_cpu and _facts(distributed_type).gpu_only:
        raise UsageError("--multi-gpu and --cpu contradict each other; pick one.")


def data_parallel_type(*, processes: int, cpu: bool) -> DistributedType:
    """What the config wizard writes for ``processes`` plain data-parallel processes: NO for one process,
    else MULTI_CPU or MULTI_GPU."""
    return _DATA_PARALLEL[cpu] if processes > 1 else DistributedType.NO
