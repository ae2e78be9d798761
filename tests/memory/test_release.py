"""find_executable_batch_size, release_memory and the out-of-memory classifier."""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import pytest
import torch

from lockstep.memory import find_executable_batch_size, release_memory, should_reduce_batch_size
from lockstep.state import PartialState
from tests.helpers.multiprocess import run_distributed

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity)"


def _halve(batch_size: int) -> int:
    return batch_size // 2


def test_multiplies_by_accelerates_factor_after_each_out_of_memory_error() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size: int, model: str, *, lr: float) -> tuple[int, str, float]:
        tried.append(batch_size)
        if batch_size > 100:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return batch_size, model, lr

    assert train("mlp", lr=0.1) == (92, "mlp", 0.1)
    assert tried == [128, 115, 103, 92]  # int(size * 0.9), as Accelerate 1.15
    assert train("mlp", lr=0.1) == (92, "mlp", 0.1)  # the size found is kept, as in Accelerate
    assert tried == [128, 115, 103, 92, 92]


def test_the_decorator_form_keeps_a_custom_reduction() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda size: size // 4)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 8:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return batch_size

    assert train() == 4 and tried == [64, 16, 4]


def test_real_cpu_allocation_failure_is_retried() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=_halve)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 16:
            torch.empty(2**50)  # 4 PiB: the CPU allocator refuses at once
        return batch_size

    assert train() == 16
    assert tried == [64, 32, 16]


def test_other_errors_propagate_without_retry() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=32)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        raise ValueError("bad labels")

    with pytest.raises(ValueError, match="bad labels"):
        train()
    assert tried == [32]


def test_reaching_zero_is_an_error() -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    with pytest.raises(RuntimeError, match=r"^No executable batch size found, reached zero\.$"):
        train()
    assert tried == [8, 7, 6, 5, 4, 3, 2, 1]  # int(1 * 0.9) == 0


@pytest.mark.parametrize(
    ("reduce_fn", "expected"),
    [(lambda: 5, [40, 5]), (lambda size: size - 15, [40, 25, 10])],
)
def test_custom_reduction(reduce_fn: Any, expected: list[int]) -> None:
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=40, reduce_batch_size_fn=reduce_fn)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 10:
            raise torch.OutOfMemoryError(CUDA_OOM)
        return batch_size

    assert train() == expected[-1]
    assert tried == expected


def test_passing_the_batch_size_is_a_type_error() -> None:
    @find_executable_batch_size(starting_batch_size=8)
    def train(batch_size: int, model: str) -> int:
        return batch_size

    with pytest.raises(TypeError, match=r"supplies it as the first argument\. Remove it: train\('mlp'\)\.$"):
        train(16, "mlp")
    with pytest.raises(TypeError, match=r"Remove it: train\(model='mlp'\)\.$"):
        train(batch_size=16, model="mlp")
    assert list(inspect.signature(train).parameters) == ["model"]
    assert train("mlp") == 8


def test_function_without_a_batch_size_parameter_is_a_type_error() -> None:
    @find_executable_batch_size
    def train() -> None:
        return None

    with pytest.raises(
        TypeError, match=r"its first parameter must be the batch size: def train\(batch_size, \.\.\.\)"
    ):
        train()


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (torch.OutOfMemoryError("anything"), True),
        (MemoryError(), True),
        (RuntimeError(CUDA_OOM), True),
        (RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."), True),
        (RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"), False),
        (ValueError("CUDA out of memory."), False),
    ],
)
def test_should_reduce_batch_size(error: BaseException, expected: bool) -> None:
    assert should_reduce_batch_size(error) is expected


def test_release_memory_drops_references() -> None:
    model, tensor = torch.nn.Linear(2, 2), torch.ones(3)
    model_ref, tensor_ref = weakref.ref(model), weakref.ref(tensor)
    model, tensor = release_memory(model, tensor)
    assert (model, tensor) == (None, None)
    assert model_ref() is None and tensor_ref() is None


def _agreement_worker() -> dict[str, Any]:
    state = PartialState()
    rank = state.process_index
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=128, reduce_batch_size_fn=_halve)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if batch_size > 64 or (rank == 1 and batch_size == 64):
            raise torch.OutOfMemoryError(CUDA_OOM)
        return batch_size

    @find_executable_batch_size(starting_batch_size=16)
    def broken(batch_size: int) -> int:
        if rank == 1:
            raise KeyError("missing column")
        return batch_size

    try:
        broken()
        failure = "no error"
    except Exception as error:
        failure = f"{type(error).__name__}: {error}"
    return {"found": train(), "tried": tried, "failure": failure}


@pytest.mark.distributed
def test_all_ranks_retry_together_when_one_runs_out_of_memory() -> None:
    results = run_distributed(_agreement_worker, 2, timeout=30)
    assert [(r["found"], r["tried"]) for r in results] == [(32, [128, 64, 32]), (32, [128, 64, 32])]
    assert results[1]["failure"] == "KeyError: 'missing column'"
    assert results[0]["failure"] == (
        "RuntimeError: find_executable_batch_size: rank(s) [1] of world size 2 failed at batch size 16 "
        "with an error that is not out-of-memory, so rank 0 stops too. See the failing rank's traceback."
    )


def _cpu_allocation_agreement_worker() -> dict[str, Any]:
    rank = PartialState().process_index
    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=_halve)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        if rank == 0 and batch_size > 32:
            bytearray(2**60)  # Python's own MemoryError: malloc refuses 1 EiB at once
        if rank == 1 and batch_size > 16:
            torch.empty(
                2**50
            )  # the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory")
        return batch_size

    return {"found": train(), "tried": tried}


@pytest.mark.distributed
def test_real_cpu_allocation_failures_on_different_ranks_make_all_ranks_retry_together() -> None:
    # Rank 0 fits at 32 but rank 1 only at 16: both must end at 16 having tried the same sizes.
    results = run_distributed(_cpu_allocation_agreement_worker, 2, timeout=30)
    assert results == [{"found": 16, "tried": [64, 32, 16]}] * 2
