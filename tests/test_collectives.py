"""Collectives on nested structures, in real gloo groups of 2 and 3 processes and without a group."""

from __future__ import annotations

import re
import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist

import lockstep.utils
from lockstep.collectives import (
    CannotPadNestedTensorWarning,
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    gather,
    gather_for_metrics_truncate,
    gather_object,
    pad_across_processes,
    reduce,
)
from lockstep.state import PartialState
from tests.helpers.multiprocess import run_distributed

Pair = namedtuple("Pair", ["a", "b"])


def _count_object_gathers() -> list[int]:
    """Patch all_gather_object to count its calls (the debug check is made of them)."""
    calls = [0]
    original = dist.all_gather_object

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_gather_object = counting
    return calls


def _error(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _collectives_worker() -> dict[str, Any]:
    state = PartialState()
    calls = _count_object_gathers()
    rank, n = state.process_index, state.num_processes
    out: dict[str, Any] = {}
    nested = gather(
        {
            "x": torch.full((2, 3), float(rank)),
            "y": [Pair(torch.tensor([rank, 10 + rank]), torch.zeros(1, 1))],
        }
    )
    out["gather_x"] = nested["x"].tolist()
    out["gather_y_a"] = nested["y"][0].a.tolist()
    out["gather_y_type"] = type(nested["y"][0]).__name__
    out["gather_scalar"] = gather(torch.tensor(float(rank))).tolist()
    out["gather_transposed"] = gather(torch.arange(6).reshape(2, 3).T + rank).tolist()
    out["gather_object"] = gather_object([f"r{rank}"] * (rank + 1))
    out["gather_non_tensor"] = _error(gather, {"a": "text"})
    mine = torch.full((2,), float(rank))
    returned = broadcast({"t": mine}, from_process=n - 1)
    out["broadcast"], out["broadcast_in_place"] = mine.tolist(), returned["t"] is mine
    out["broadcast_bad_source"] = _error(broadcast, mine, from_process=n)
    objects = [rank, {"k": rank}]
    out["broadcast_objects"], out["broadcast_objects_same"] = (
        objects,
        broadcast_object_list(objects, 1) is objects,
    )
    value = torch.tensor([1.0 + rank, 2.0 * rank])
    out["sum"] = reduce(value, "sum").tolist()
    out["mean"] = reduce({"v": value}, "mean")["v"].tolist()
    out["none"] = reduce(value, "none", scale=3.0).tolist()
    out["sum_scaled"] = reduce(value, "sum", scale=0.5).tolist()
    out["int_mean"] = reduce(torch.tensor([rank]), "mean").tolist()
    out["value_untouched"] = value.tolist()
    out["pad"] = pad_across_processes(torch.ones(rank + 1, 2), pad_index=-1).tolist()
    out["pad_first"] = pad_across_processes([torch.full((1, rank + 1), 7)], dim=-1, pad_first=True)[
        0
    ].tolist()
    out["pad_1d_dim1"] = pad_across_processes(torch.ones(rank + 1), dim=1).tolist()
    out["object_gathers_outside_gather_object"] = calls[0] - 1
    return out


def _expected(n: int) -> dict[str, Any]:
    return {
        "gather_x": [[float(r)] * 3 for r in range(n) for _ in range(2)],
        "gather_y_a": [v for r in range(n) for v in (r, 10 + r)],
        "gather_y_type": "Pair",
        "gather_scalar": [float(r) for r in range(n)],
        "gather_transposed": [[c + r for c in row] for r in range(n) for row in [[0, 3], [1, 4], [2, 5]]],
        "gather_object": [f"r{r}" for r in range(n) for _ in range(r + 1)],
        "broadcast": [float(n - 1)] * 2,
        "broadcast_in_place": True,
        "broadcast_objects": [1, {"k": 1}],
        "broadcast_objects_same": True,
        "sum": [sum(1.0 + r for r in range(n)), sum(2.0 * r for r in range(n))],
        "mean": [sum(1.0 + r for r in range(n)) / n, sum(2.0 * r for r in range(n)) / n],
        "sum_scaled": [sum(1.0 + r for r in range(n)) / 2, sum(2.0 * r for r in range(n)) / 2],
        "int_mean": [sum(range(n)) / n],
        "object_gathers_outside_gather_object": 0,
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_in_a_real_group(world_size: int) -> None:
    results = run_distributed(_collectives_worker, world_size, timeout=60)
    expected = _expected(world_size)
    for rank, out in enumerate(results):
        for key in expected:
            assert out[key] == expected[key], (rank, key)
        assert out["none"] == [3.0 * (1.0 + rank), 3.0 * 2.0 * rank]  # this rank's own values, scaled
        assert out["value_untouched"] == [1.0 + rank, 2.0 * rank]
        assert out["pad"] == [[1.0, 1.0]] * (rank + 1) + [[-1.0, -1.0]] * (world_size - rank - 1)
        assert out["pad_first"] == [[0] * (world_size - rank - 1) + [7] * (rank + 1)]
        assert out["pad_1d_dim1"] == [1.0] * (rank + 1)  # dim out of range: unchanged, as in Accelerate
        assert out["gather_non_tensor"] == (
            f"TypeError: gather() on rank {rank} of world size {world_size} got a str inside its input; only "
            "tensors nested in lists, tuples and dicts are supported. Use gather_object() for other objects."
        )
        assert out["broadcast_bad_source"] == (
            f"ValueError: broadcast(from_process={world_size}) on rank {rank} of world size {world_size} is "
            f"invalid: it must be a rank between 0 and {world_size - 1}."
        )


def _debug_worker() -> dict[str, Any]:
    state = PartialState()
    calls = _count_object_gathers()
    rank = state.process_index
    out: dict[str, Any] = {"debug": state.debug}
    out["same_shapes"] = gather(torch.ones(2, 3)).shape[0]
    out["pad_allowed"] = pad_across_processes(torch.ones(rank + 1, 3)).shape[0]
    out["object_gathers_per_check"] = calls[0] / 2
    out["shapes"] = _error(gather, [torch.zeros(4 + rank, 3)])
    out["dtypes"] = _error(reduce, torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.int64), "sum")
    out["ndims"] = _error(pad_across_processes, torch.zeros([2] * (rank + 1)))
    if rank == 0:
        out["ops"] = _error(gather, torch.zeros(1))
    else:
        out["ops"] = _error(broadcast, torch.zeros(1))
    out["still_in_step"] = reduce(torch.tensor([1.0]), "sum").tolist()
    return out


@pytest.mark.distributed
def test_debug_mode_names_every_rank_shapes_instead_of_hanging() -> None:
    results = run_distributed(_debug_worker, 2, timeout=30, env={"LOCKSTEP_DEBUG": "1"})
    tail = (
        "Every rank must run the same collectives in the same order on tensors of the same shapes and dtypes"
    )
    for rank, out in enumerate(results):
        where = f"Raised on rank {rank} of world size 2. {tail}"
        assert out["debug"] is True
        assert (out["same_shapes"], out["pad_allowed"], out["object_gathers_per_check"]) == (4, 2, 1)
        assert out["shapes"] == (
            "DistributedOperationException: gather: shapes differ across ranks (world size 2): "
            f"rank 0 has [(4, 3)], rank 1 has [(5, 3)]. {where} (pad_across_processes() evens out dim 0)."
        )
        assert out["dtypes"].startswith(
            "DistributedOperationException: reduce: dtypes differ across ranks (world size 2): "
            f"rank 0 has ['torch.float32'], rank 1 has ['torch.int64']. {where}"
        )
        assert out["ndims"].startswith(
            "DistributedOperationException: pad_across_processes: shapes differ across ranks (world size 2): "
            "rank 0 has [(2,)], rank 1 has [(2, 2)]."
        )
        assert out["ops"].startswith(
            "DistributedOperationException: "
            + ("gather" if rank == 0 else "broadcast")
            + ": ranks called different collectives: rank 0 called gather, rank 1 called broadcast."
        )
        assert out["still_in_step"] == [2.0]


def test_debug_exception_is_a_runtime_error() -> None:
    assert issubclass(DistributedOperationException, RuntimeError)


def test_world_size_one_needs_no_process_group() -> None:
    state = PartialState(debug=True)
    assert (state.num_processes, dist.is_initialized()) == (1, False)
    data = {"x": torch.ones(2, 3), "s": torch.tensor(5.0)}
    assert gather(data) is data
    assert gather(torch.tensor(5.0)).dim() == 0  # unchanged, as Accelerate returns it
    objects = ["a", 1]
    assert gather_object(objects) is objects
    assert gather_object("not a list") == "not a list"
    assert broadcast(data, from_process=0) is data
    assert broadcast_object_list(objects) is objects
    assert pad_across_processes(data) is data
    value = torch.tensor([1.0, 4.0])
    for reduction in ("sum", "mean", "max", "min", "none"):
        reduced = reduce(value, reduction, scale=2.0)
        assert reduced.tolist() == [2.0, 8.0] and reduced is not value
    assert reduce(torch.tensor([3]), "mean").tolist() == [3]


@pytest.mark.parametrize("reduction", ["avg", "MAX", "prod"])
def test_reduce_rejects_unknown_reduction(reduction: str) -> None:
    with pytest.raises(
        ValueError,
        match=(
            rf"^reduce\(reduction='{reduction}'\) on rank 0 of world size 1 is invalid: it is not a known "
            r"reduction. Choose one of 'sum', 'mean', 'max', 'min', 'none'.$"
        ),
    ):
        reduce(torch.ones(1), reduction=reduction)


def _reductions_worker() -> dict[str, Any]:
    rank = PartialState().process_index
    # Each rank holds the larger value at some positions and the smaller at others.
    floats = torch.tensor([1.0, 5.0, -2.0]) if rank == 0 else torch.tensor([3.0, 2.0, -7.0])
    ints = torch.tensor([[4, 0]]) if rank == 0 else torch.tensor([[1, 9]])
    nested = {"f": floats, "rest": [Pair(ints, floats[:1])]}
    out: dict[str, Any] = {}
    for reduction in ("sum", "mean", "max", "min", "none"):
        reduced = reduce(nested, reduction)
        pair = reduced["rest"][0]
        out[reduction] = (reduced["f"].tolist(), pair.a.tolist(), pair.b.tolist(), type(pair).__name__)
        out[f"{reduction}_dtype"] = str(pair.a.dtype)
    out["max_scaled"] = reduce(floats, "max", scale=2.0).tolist()
    out["min_scaled"] = reduce(floats, "min", scale=0.5).tolist()
    out["input_untouched"] = (floats.tolist(), ints.tolist())
    return out


@pytest.mark.distributed
def test_every_reduction_in_a_real_group() -> None:
    results = run_distributed(_reductions_worker, 2, timeout=60)
    expected = {
        "sum": ([4.0, 7.0, -9.0], [[5, 9]], [4.0], "Pair"),
        "mean": ([2.0, 3.5, -4.5], [[2.5, 4.5]], [2.0], "Pair"),
        "max": ([3.0, 5.0, -2.0], [[4, 9]], [3.0], "Pair"),
        "min": ([1.0, 2.0, -7.0], [[1, 0]], [1.0], "Pair"),
        "max_scaled": [6.0, 10.0, -4.0],
        "min_scaled": [0.5, 1.0, -3.5],
        "mean_dtype": "torch.float32",
        "max_dtype": "torch.int64",
        "min_dtype": "torch.int64",
        "sum_dtype": "torch.int64",
    }
    own = [([1.0, 5.0, -2.0], [[4, 0]], [1.0], "Pair"), ([3.0, 2.0, -7.0], [[1, 9]], [3.0], "Pair")]
    for rank, out in enumerate(results):
        for key, value in expected.items():
            assert out[key] == value, (rank, key)
        assert out["none"] == own[rank]  # lockstep's "none": this rank's own values, no communication
        assert out["input_untouched"] == own[rank][:2]


def _nested_tensor(*lengths: int, layout: torch.layout = torch.jagged) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that the strided layout is a prototype
        warnings.filterwarnings("ignore", "The PyTorch API of nested tensors is in prototype stage")
        return torch.nested.nested_tensor([torch.ones(n, 2) for n in lengths], layout=layout)


NESTED_WARNING = (
    "pad_across_processes() cannot pad nested tensors without more information: got a nested 3-d "
    "torch.float32 tensor (torch.nested), whose components differ in size. Leaving it unprocessed. To pad "
    "it, turn it into a regular tensor first with tensor.to_padded_tensor(pad_index)."
)


@pytest.mark.parametrize("layout", [torch.jagged, torch.strided])
def test_pad_leaves_a_nested_tensor_alone_with_a_warning(layout: torch.layout) -> None:
    nested = _nested_tensor(1, 3, layout=layout)
    with pytest.warns(CannotPadNestedTensorWarning, match=f"^{re.escape(NESTED_WARNING)}$") as caught:
        assert pad_across_processes(nested, dim=1) is nested
    assert [w.filename for w in caught] == [__file__]  # points at the call, not at lockstep


def test_pad_warns_once_per_nested_tensor_in_a_structure() -> None:
    data = {"nested": [_nested_tensor(1, 2), _nested_tensor(3)], "plain": torch.ones(2)}
    with pytest.warns(CannotPadNestedTensorWarning) as caught:
        assert pad_across_processes(data) is data
    assert [str(w.message) for w in caught] == [NESTED_WARNING, NESTED_WARNING]


def test_cannot_pad_nested_tensor_warning_is_exported_like_accelerate() -> None:
    assert lockstep.utils.CannotPadNestedTensorWarning is CannotPadNestedTensorWarning
    assert issubclass(CannotPadNestedTensorWarning, UserWarning)
    assert "CannotPadNestedTensorWarning" in lockstep.utils.__all__


def _pad_nested_worker() -> dict[str, Any]:
    rank = PartialState().process_index
    nested = _nested_tensor(*range(1, rank + 3))  # rank 0: 2 components, rank 1: 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        padded = pad_across_processes({"n": nested, "t": torch.ones(rank + 1, 2)}, pad_index=-1)
    return {
        "warnings": [(w.category.__name__, str(w.message)) for w in caught],
        "nested_untouched": padded["n"] is nested,
        "t": padded["t"].tolist(),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("env", [{}, {"LOCKSTEP_DEBUG": "1"}], ids=["plain", "debug"])
def test_pad_skips_nested_tensors_and_pads_the_rest_in_a_real_group(env: dict[str, str]) -> None:
    results = run_distributed(_pad_nested_worker, 2, timeout=60, env=env)
    for rank, out in enumerate(results):
        assert out["warnings"] == [("CannotPadNestedTensorWarning", NESTED_WARNING)]
        assert out["nested_untouched"] is True
        assert out["t"] == [[1.0, 1.0]] * (rank + 1) + [[-1.0, -1.0]] * (1 - rank)


def test_reduce_rejects_non_tensor_leaves() -> None:
    with pytest.raises(TypeError, match="reduce\\(\\) on rank 0 of world size 1 got a str inside its input"):
        reduce({"a": "text"}, "sum")


def test_truncate_cuts_nested_tensors_and_sample_lists() -> None:
    data = {"pred": torch.arange(5), "pair": (torch.ones(5, 2), ["a", "b", "c", "d", "e"])}
    cut = gather_for_metrics_truncate(data, 3)
    assert cut["pred"].tolist() == [0, 1, 2]
    assert cut["pair"][0].shape == (3, 2) and cut["pair"][1] == ["a", "b", "c"]
    assert gather_for_metrics_truncate([torch.arange(4), torch.arange(4)], 2)[1].tolist() == [0, 1]


def test_truncate_gather_object_results_as_a_list() -> None:
    samples = [{"id": i} for i in range(5)]
    assert gather_for_metrics_truncate(samples, 2, from_gather_object=True) == [{"id": 0}, {"id": 1}]


@pytest.mark.parametrize("remainder", [-1, 0])
def test_truncate_leaves_data_alone_without_a_remainder(remainder: int) -> None:
    data = torch.arange(4)
    assert gather_for_metrics_truncate(data, remainder) is data
