"""What a configured ``distributed_type`` means is declared by the backend that runs it (its spec's
``type_facts``) and read through lockstep.config.topology: every member's answers, pinned."""

from __future__ import annotations

import pytest

from lockstep.config import topology
from lockstep.config.backend_specs import BackendSpec, TypeFacts, spec_for_distributed_type
from lockstep.config.enums import DistributedType
from lockstep.errors import UsageError

# member -> (multi_device, fsdp2, deepspeed, refused with --cpu, config section); None: not built here.
EXPECTED = {
    "NO": (False, False, False, False, None),
    "MULTI_CPU": (False, False, False, False, None),
    "MULTI_GPU": (True, False, False, True, None),
    "MULTI_XPU": (True, False, False, False, None),
    "MULTI_MPS": (True, False, False, False, None),
    "FSDP": (False, True, False, False, "fsdp_config"),
    "DEEPSPEED": (False, False, True, False, "deepspeed_config"),
}


@pytest.mark.parametrize("member", list(DistributedType))
def test_each_distributed_type_answers_what_its_backend_declares(member: DistributedType) -> None:
    if member.value not in EXPECTED:
        spec = spec_for_distributed_type(member)
        assert spec is None or not spec.type_facts, member  # a type not pinned here declares nothing
        return
    multi_device, fsdp2, deepspeed, gpu_only, section = EXPECTED[member.value]
    assert topology.is_multi_device(member) is multi_device
    assert topology.is_fsdp2(member) is fsdp2
    assert topology.is_deepspeed(member) is deepspeed
    assert topology.config_section(member) == section
    if gpu_only:
        with pytest.raises(UsageError, match="--multi-gpu and --cpu contradict each other"):
            topology.check_device_agreement(member, use_cpu=True)
    else:
        topology.check_device_agreement(member, use_cpu=True)


def test_types_no_backend_runs_are_refused_and_keep_their_section() -> None:
    assert topology.config_section("MEGATRON_LM") == "megatron_lm_config"
    with pytest.raises(UsageError, match="Megatron-LM backend is not part of this version"):
        topology.checked_distributed_type("MEGATRON_LM")
    assert not topology.is_multi_device("XLA") and not topology.is_fsdp2(None)
    assert not topology.is_multi_device("NOT_A_TYPE")


def test_the_facts_are_the_specs() -> None:
    """A backend spec that declares another answer changes what the type means (there is no second table)."""
    spec = spec_for_distributed_type("MULTI_XPU")
    assert isinstance(spec, BackendSpec)
    declared = spec.type_facts
    changed = {**declared, DistributedType.MULTI_XPU: TypeFacts(multi_device=False, gpu_only=True)}
    object.__setattr__(spec, "type_facts", changed)  # the spec is frozen: as if the backend declared it
    try:
        assert not topology.is_multi_device("MULTI_XPU")
        with pytest.raises(UsageError):
            topology.check_device_agreement("MULTI_XPU", use_cpu=True)
    finally:
        object.__setattr__(spec, "type_facts", declared)
    assert topology.is_multi_device("MULTI_XPU")
