"""``join_uneven_inputs`` with a model that is not DDP warns and runs the block without torch's ``Join``,
as Accelerate does where joining is not supported (torch's ``Join`` fails on objects without a join hook),
with Accelerate's warning (checked against the real Accelerate: 2 processes, its sentence is the message)."""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch
import torch.distributed.algorithms.join as join_module

from lockstep import Accelerator
from tests.helpers.multiprocess import run_distributed
from tests.helpers.reference import run_reference


def _join_worker() -> dict[str, Any]:
    joins: list[int] = []
    real_join = join_module.Join

    class RecordingJoin(real_join):  # type: ignore[misc, valid-type]
        def __init__(self, joinables: list[Any], *args: Any, **kwargs: Any) -> None:
            joins.append(len(joinables))
            super().__init__(joinables, *args, **kwargs)

    join_module.Join = RecordingJoin
    try:
        accelerator = Accelerator(cpu=True)
        plain = torch.nn.Linear(2, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with accelerator.join_uneven_inputs([plain]):
                ran = True
        out: dict[str, Any] = {
            "ran": ran,
            "joins_plain": list(joins),
            "warnings": [str(w.message) for w in caught],
        }
        ddp = accelerator.prepare(torch.nn.Linear(2, 2))
        with accelerator.join_uneven_inputs([ddp]):
            ddp(torch.ones(1, 2)).sum().backward()
        out["joins_ddp"] = list(joins)
        return out
    finally:
        join_module.Join = real_join


ACCELERATE_WARNING = """
import json, warnings
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

accelerator = Accelerator(cpu=True)
accelerator.state.distributed_type = DistributedType.FSDP  # a type Accelerate does not join (its own test)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with accelerator.join_uneven_inputs([torch.nn.Linear(2, 2)]):
        pass
print(json.dumps([(w.category.__name__, str(w.message)) for w in caught]))
"""


def test_a_model_that_is_not_ddp_warns_as_accelerate_does_and_is_not_joined(tmp_path) -> None:
    theirs = json.loads(run_reference(ACCELERATE_WARNING, folder=tmp_path).stdout.strip().splitlines()[-1])
    assert len(theirs) == 1 and theirs[0][0] == "UserWarning", theirs
    sentence = theirs[0][1]  # "Joining uneven inputs is only supported for multi-GPU training, ..."
    assert "only supported for multi-GPU" in sentence  # what Accelerate's own test looks for
    for out in run_distributed(_join_worker, 2, timeout=60):
        assert out["ran"] is True and out["joins_plain"] == []
        assert len(out["warnings"]) == 1
        # Accelerate's sentence first, then what was given and what to do
        assert out["warnings"][0].startswith(
            f"{sentence.rstrip('.')}: it got Linear, which is not a DistributedDataParallel model (nor another "
            "torch Joinable); lockstep joins DDP models, on GPUs and on CPUs."
        ), (out["warnings"][0], sentence)
        assert out["joins_ddp"] == [1]  # a DDP model still goes through torch's Join
