"""Every implemented callable of Accelerate 1.15's API has Accelerate's signature, or the difference is listed.

``tests/accelerate_1_15_surface.json`` records each Accelerate callable's parameters (names, order, defaults as
``repr``), generated from the real package by ``dev/accelerate_api.py``. For every name
``src/lockstep/accelerate_api.json`` marks implemented, lockstep's object at the same path must take the same
parameter names in the same order, of the same kinds (positional or keyword, keyword-only, ``*args``) and with
the same defaults (annotations are not compared), or
the name must be in the file's ``signature_differences`` with the reason; a listed difference that no longer
differs fails too, so the list stays the true list. Accelerator methods are compared as called on an instance
(``self`` left out). Runs without Accelerate: it reads the committed JSON.

``python -m tests.test_api_signatures`` prints every difference.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest

import lockstep
from lockstep import Accelerator

PACKAGE = Path(lockstep.__file__).parent
DATA = json.loads((PACKAGE / "accelerate_api.json").read_text(encoding="utf-8"))
SURFACE = json.loads((Path(__file__).parent / "accelerate_1_15_surface.json").read_text(encoding="utf-8"))
LISTED: dict[str, str] = DATA["signature_differences"]
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")

Parameters = list[tuple[str, str, str | None]]


def parameters(signature: inspect.Signature) -> Parameters:
    """(name, kind, default repr or None) per parameter, as ``dev/accelerate_api.py`` records them."""
    return [
        (p.name, p.kind.name, None if p.default is p.empty else _ADDRESS.sub("", repr(p.default)))
        for p in signature.parameters.values()
    ]


def member_parameters(name: str) -> Parameters | None:
    """An Accelerator member's parameters as called on an instance; None for a property."""
    raw = inspect.getattr_static(Accelerator, name)
    if isinstance(raw, property):
        return None
    if isinstance(raw, staticmethod):
        return parameters(inspect.signature(raw.__func__))
    function = raw.__func__ if isinstance(raw, classmethod) else raw
    return parameters(inspect.signature(function))[1:]


def module_parameters(section: str, name: str) -> Parameters | None:
    value = getattr(importlib.import_module(DATA["sections"][section]["lockstep"]), name)
    if not callable(value):
        return None
    return parameters(inspect.signature(value))


def compared() -> dict[str, tuple[Parameters, Parameters | None]]:
    """``section.name`` -> (Accelerate's parameters, lockstep's), for every implemented callable."""
    pairs: dict[str, tuple[Parameters, Parameters | None]] = {}
    for section, names in SURFACE["sections"].items():
        for name, recorded in names.items():
            status = DATA["sections"][section]["names"][name].split(":", 1)[0]
            if status != "implemented" or recorded["signature"] is None:
                continue
            theirs = [(p_name, kind, default) for p_name, kind, default in recorded["signature"]]
            if section == "accelerator_members":
                ours = member_parameters(name)
            else:
                ours = module_parameters(section, name)
            pairs[f"{section}.{name}"] = (theirs, ours)
    return pairs


PAIRS = compared()


def test_the_comparison_covers_the_implemented_callables():
    assert len(PAIRS) == 320
    assert sum(key.startswith("accelerator_members.") for key in PAIRS) == 50


@pytest.mark.parametrize("key", sorted(PAIRS))
def test_the_signature_is_accelerates_or_the_difference_is_listed(key):
    theirs, ours = PAIRS[key]
    if key in LISTED:
        assert ours != theirs, f"{key} now has Accelerate's signature: remove it from signature_differences"
        assert len(LISTED[key]) > 30  # a reason, not a placeholder
    else:
        assert ours == theirs


def test_every_listed_difference_names_a_compared_callable():
    assert set(LISTED) <= set(PAIRS)
    assert len(LISTED) == 51  # 51st: prepare_data_loader(step_hooks=None), issue 44 item 2


def test_a_difference_is_caught():
    def accelerate_like(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
        return tensor

    def renamed(tensor: Any, how: str = "mean", scale: float = 1.0) -> Any:
        return tensor

    def new_default(tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return tensor

    reference = parameters(inspect.signature(accelerate_like))
    assert parameters(inspect.signature(renamed)) != reference
    assert parameters(inspect.signature(new_default)) != reference


# -- the parameters added to match Accelerate: honoured, or refused with a clear error -------------------
def test_str_to_bool_returns_booleans_with_to_bool():
    from lockstep.utils import str_to_bool

    assert (str_to_bool("Yes"), str_to_bool("off")) == (1, 0)
    assert (str_to_bool("Yes", to_bool=True), str_to_bool("off", to_bool=True)) == (True, False)
    assert type(str_to_bool("on", True)) is bool


def test_the_decorators_called_without_a_function_raise_accelerates_error():
    accelerator = Accelerator(cpu=True)
    for decorator in ("on_main_process", "on_local_main_process"):
        with pytest.raises(ValueError, match=rf"Accelerator\.{decorator}\(\) was called without a function"):
            getattr(accelerator, decorator)()
    assert accelerator.on_main_process(lambda: 7)() == 7


def test_prepare_data_loader_refuses_a_slice_function_and_a_mesh():
    from torch.utils.data import DataLoader

    from lockstep.data_loader import prepare_data_loader

    loader = DataLoader(range(8), batch_size=2)
    with pytest.raises(NotImplementedError, match=r"slice_fn_for_dispatch=<built-in function len>\) is not"):
        prepare_data_loader(loader, slice_fn_for_dispatch=len)
    with pytest.raises(
        NotImplementedError, match=r"torch_device_mesh=\.\.\.\) is not supported.*num_processes"
    ):
        prepare_data_loader(loader, torch_device_mesh=object())
    prepared = prepare_data_loader(loader, num_processes=2, process_index=1, slice_fn_for_dispatch=None)
    assert [batch.tolist() for batch in prepared] == [[2, 3], [6, 7]]


def test_save_and_load_state_refuse_accelerates_model_keyword_arguments(tmp_path):
    accelerator = Accelerator(cpu=True)
    with pytest.raises(NotImplementedError, match=r"save_state\(max_shard_size=\.\.\.\) is not supported"):
        accelerator.save_state(str(tmp_path / "a"), max_shard_size="1GB")
    with pytest.raises(NotImplementedError, match=r"load_state\(load_kwargs=\.\.\., strict=\.\.\.\) is not"):
        accelerator.load_state(str(tmp_path / "a"), load_kwargs={}, strict=False)
    assert not (tmp_path / "a").exists()


def differences() -> str:
    lines = []
    for key, (theirs, ours) in PAIRS.items():
        if ours != theirs:
            lines.append(f"{key}\n  accelerate: {theirs}\n  lockstep:   {ours}\n  listed: {LISTED.get(key)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(differences())
