"""``join_uneven_inputs`` with a model that is not DDP warns and runs the block without torch's ``Join``,
as Accelerate does where joining is not supported (torch's ``Join`` fails on objects without a join hook)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.algorithms.join as join_module

from lockstep import Accelerator
from tests.helpers.multiprocess import run_distributed


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


def test_a_model_that_is_not_ddp_warns_and_is_not_joined() -> None:
    for out in run_distributed(_join_worker, 2, timeout=60):
        assert out["ran"] is True and out["joins_plain"] == []
        assert len(out["warnings"]) == 1
        assert out["warnings"][0].startswith(
            "join_uneven_inputs() got Linear, which is not a DistributedDataParallel model (nor another torch "
            "Joinable), so joining uneven inputs is not supported here and join_uneven_inputs has no effect."
        )
        assert out["joins_ddp"] == [1]  # a DDP model still goes through torch's Join
