"""The string enums: members, parsing, and the deprecated ``DistributedType.TPU``."""

import json

import pytest

from lockstep import DistributedType
from lockstep.config.enums import PrecisionType


def test_tpu_is_accelerates_deprecated_spelling_of_xla():
    # transformers' *_no_trainer.py examples test `accelerator.distributed_type == DistributedType.TPU`.
    with pytest.warns(
        FutureWarning, match=r"The `TPU` of .*DistributedType.* is deprecated .* use the `XLA`"
    ):
        tpu = DistributedType.TPU
    assert tpu is DistributedType.XLA
    with pytest.warns(FutureWarning):
        assert DistributedType.MULTI_CPU != DistributedType.TPU


def test_the_deprecated_name_is_not_a_member():
    assert "TPU" not in DistributedType.__members__
    assert [member.value for member in DistributedType][-1] == "MEGATRON_LM"
    with pytest.raises(ValueError, match=r"distributed_type='TPU' is invalid: it must be one of 'NO', "):
        DistributedType.parse("TPU", argument="distributed_type")


def test_members_are_strings_that_serialize_as_their_value():
    assert DistributedType.parse("multi_cpu", argument="distributed_type") is DistributedType.MULTI_CPU
    assert json.dumps({"type": DistributedType.FSDP, "precision": PrecisionType.BF16}) == (
        '{"type": "FSDP", "precision": "bf16"}'
    )
    assert str(DistributedType.NO) == "NO"
