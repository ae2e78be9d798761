"""``PartialState().debug = True`` (and ``AcceleratorState``) turns the operation checker on at run time.

Accelerate's own ``test_op_checker`` sets ``state.debug`` on a running state and expects mismatched shapes
in ``pad_across_processes``, ``reduce`` and ``broadcast`` to raise ``DistributedOperationException``.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.collectives import DistributedOperationException, broadcast, pad_across_processes, reduce
from lockstep.state import AcceleratorState, PartialState
from tests.helpers.multiprocess import run_distributed


def _error(fn: Any, data: Any, **kwargs: Any) -> str:
    try:
        fn(data, **kwargs)
    except DistributedOperationException as error:
        return str(error)
    return "no error"


def _checker_worker() -> dict[str, Any]:
    state = PartialState()
    rank = state.process_index
    out: dict[str, Any] = {"debug_at_start": state.debug}
    ragged = {"tensor": torch.ones(1, 5 + rank)}  # pad_across_processes evens this out: legal
    out["pad_off"] = pad_across_processes(ragged, dim=1)["tensor"].shape[1]
    state.debug = True
    out["seen_by_accelerator_state"] = AcceleratorState().debug
    # Accelerate's test_op_checker data: rank 1 has one dimension more
    first = torch.tensor([[0.0, 1, 2, 3, 4]])
    pad_data = {"tensor": first if rank == 0 else torch.tensor([[[0.0, 1, 2, 3, 4, 5]]])}
    out["pad"] = _error(pad_across_processes, pad_data, dim=0)
    other = {"tensor": first if rank == 0 else torch.tensor([[[0.0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]])}
    out["reduce"] = _error(reduce, other)
    out["broadcast"] = _error(broadcast, other)
    out["pad_ragged_on"] = pad_across_processes(ragged, dim=1)["tensor"].shape[1]  # still legal in debug mode
    AcceleratorState().debug = False
    out["debug_after"] = PartialState().debug
    out["reduce_off"] = reduce({"tensor": torch.ones(2)})["tensor"].tolist()
    return out


def test_setting_debug_turns_the_operation_checker_on_and_off() -> None:
    for out in run_distributed(_checker_worker, 2, timeout=60):
        assert out["debug_at_start"] is False
        assert out["pad_off"] == 6 and out["pad_ragged_on"] == 6
        assert out["seen_by_accelerator_state"] is True
        assert out["pad"].startswith(
            "pad_across_processes: shapes differ across ranks (world size 2): rank 0 has [(1, 5)], "
            "rank 1 has [(1, 1, 6)]"
        )
        for op in ("reduce", "broadcast"):
            assert out[op].startswith(
                f"{op}: shapes differ across ranks (world size 2): rank 0 has [(1, 5)], rank 1 has [(1, 2, 5)]"
            )
        assert out["debug_after"] is False
        assert out["reduce_off"] == [1.0, 1.0]
