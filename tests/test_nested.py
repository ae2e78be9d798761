"""``lockstep.utils.concatenate``: the results and errors of Accelerate's ``concatenate``, pinned."""

from __future__ import annotations

import re
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

import lockstep.utils
from lockstep._nested import concatenate

Pair = namedtuple("Pair", ["a", "b"])


def test_utils_exports_this_concatenate() -> None:
    assert lockstep.utils.concatenate is concatenate


def test_tensors_are_concatenated_along_dim_inside_any_structure() -> None:
    batches = [
        {"x": torch.zeros(1, 2), "pair": Pair(torch.tensor([1]), [torch.tensor([[1, 2]])])},
        {"x": torch.ones(2, 2), "pair": Pair(torch.tensor([2, 3]), [torch.tensor([[3, 4]])])},
    ]
    merged = concatenate(batches)
    assert merged["x"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert type(merged["pair"]) is Pair and merged["pair"].a.tolist() == [1, 2, 3]
    assert merged["pair"].b[0].tolist() == [[1, 2], [3, 4]]
    assert concatenate((torch.zeros(2, 1), torch.ones(2, 2)), dim=1).tolist() == [[0, 1, 1], [0, 1, 1]]


def test_keys_may_come_in_any_order_and_the_first_batch_type_is_kept() -> None:
    merged = concatenate(
        [OrderedDict(a=torch.ones(1), b=torch.zeros(1)), {"b": torch.ones(1), "a": torch.ones(1)}]
    )
    assert type(merged) is OrderedDict and list(merged) == ["a", "b"]
    assert (merged["a"].tolist(), merged["b"].tolist()) == ([1.0, 1.0], [0.0, 1.0])


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([5], 5),
        (("text",), "text"),
        ([None], None),
        ([[1, 2]], [1, 2]),
        ([[[1, 2], [3]]], [[1, 2], [3]]),
        ([(1, "a")], (1, "a")),
        ([{"a": 1, "b": [2.5, "x"]}], {"a": 1, "b": [2.5, "x"]}),
        ([Pair(1, {"k": "v"})], Pair(1, {"k": "v"})),
    ],
)
def test_a_single_batch_of_other_items_is_returned_as_it_is(data: list[Any], expected: Any) -> None:
    result = concatenate(data)
    assert result == expected and type(result) is type(expected)


def test_a_single_batch_keeps_its_tensors_next_to_other_items() -> None:
    merged = concatenate([{"ids": torch.tensor([1, 2]), "names": ["a", "b"]}])
    assert merged["ids"].tolist() == [1, 2] and merged["names"] == ["a", "b"]


@pytest.mark.parametrize(
    ("data", "kind", "shown"),
    [
        ([1, 2], "int", "1"),
        ([[1, 2], [3, 4]], "int", "1"),  # a list is a structure, never a list of samples
        ([["a"], ["b"]], "str", "'a'"),
        ([{"a": 1.5}, {"a": 2.5}], "float", "1.5"),
        ([{"a": [1, 2]}, {"a": [3, 4]}], "int", "1"),
        ([[torch.ones(1), "x"], [torch.ones(1), "y"]], "str", "'x'"),
        ([None, None], "NoneType", "None"),
    ],
)
def test_several_batches_of_other_items_are_a_type_error(data: list[Any], kind: str, shown: str) -> None:
    message = (
        f"concatenate() can only concatenate tensors, but got 2 batches holding a {kind} ({shown}) at the "
        "same place. Collect such values with gather_object() or in a Python list; a single batch is "
        "returned as it is."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        concatenate(data)


def test_long_items_are_cut_in_the_message() -> None:
    with pytest.raises(
        TypeError, match=r"holding a str \('xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\) at"
    ):
        concatenate(["x" * 500, "y"])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            [[torch.ones(1)], [torch.ones(1), torch.ones(1)]],
            "concatenate() needs batches of the same structure, but their lengths differ: batch 0 has 1 "
            "items, batch 1 has 2 items. Give every batch the same items.",
        ),
        (
            [{"a": torch.ones(1)}, {"b": torch.ones(1)}],
            "concatenate() needs batches of the same structure, but their keys differ: batch 0 has keys "
            "['a'], batch 1 has keys ['b']. Give every batch the same items.",
        ),
        (
            [{"a": torch.ones(1)}, torch.ones(1)],
            "concatenate() needs batches of the same structure, but their keys differ: batch 0 has keys "
            "['a'], batch 1 has a Tensor. Give every batch the same items.",
        ),
        ([], "concatenate([]) got no batches: pass a list holding at least one batch."),
    ],
)
def test_batches_that_do_not_match_are_a_value_error(data: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        concatenate(data)


def test_data_must_be_a_list_of_batches() -> None:
    with pytest.raises(
        TypeError,
        match=re.escape("concatenate() needs a list of batches, got a dict. Wrap a single batch in a list"),
    ):
        concatenate({"x": torch.ones(1)})  # type: ignore[arg-type]


@pytest.mark.filterwarnings(
    "ignore:To copy construct from a tensor"
)  # torch.tensor(tensor), as Accelerate's test
def test_recursively_apply_error_keeps_accelerates_message() -> None:
    """Accelerate's test_honor_type compares this message word for word."""
    with pytest.raises(TypeError) as raised:
        lockstep.utils.recursively_apply(torch.tensor, (torch.tensor(1), 1), error_on_other_type=True)
    assert str(raised.value) == (
        "Unsupported types (<class 'int'>) passed to `tensor`. Only nested list/tuple/dicts of objects that are "
        "valid for `is_torch_tensor` should be passed."
    )
