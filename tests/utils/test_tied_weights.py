"""``ensure_weights_retied``: a ``param_init_fn`` that materializes a meta model module by module keeps the
weights transformers lists as tied tied (without it, each module gets its own copy)."""

from __future__ import annotations

import torch
from torch import nn

from lockstep.utils import ensure_weights_retied
from lockstep.utils.fsdp_utils import ensure_weights_retied as from_submodule


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight, as in GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.body = nn.Linear(3, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight


def meta_model(tied_keys: object) -> TiedLM:
    with torch.device("meta"):
        model = TiedLM()
    if tied_keys is not None:
        model._tied_weights_keys = tied_keys
    return model


def materialize(module: nn.Module) -> nn.Module:
    return module.to_empty(device="cpu", recurse=False)


def run(init: object, model: nn.Module) -> None:
    for module in model.modules():  # every module on its own, as FSDP's param_init_fn is applied
        init(module)  # type: ignore[operator]


def test_without_the_wrapper_the_tie_is_lost():
    model = meta_model(["head.weight"])
    run(materialize, model)
    assert model.head.weight is not model.embed.weight


def test_the_wrapper_ties_again_for_both_spellings_of_tied_weights_keys():
    for keys in (["head.weight"], {"head.weight": "embed.weight"}):  # transformers < 5, >= 5
        model = meta_model(keys)
        run(ensure_weights_retied(materialize, model, torch.device("cpu")), model)
        assert model.head.weight is model.embed.weight, keys
        assert model.embed.weight.device.type == "cpu" and isinstance(model.head.weight, nn.Parameter)
        assert model.body.weight is not model.embed.weight and model.body.weight.device.type == "cpu"
        assert [name for name, _ in model.named_parameters()] == ["embed.weight", "body.weight", "body.bias"]


def test_without_tied_keys_the_function_is_returned_as_is():
    assert ensure_weights_retied(materialize, meta_model(None), "cpu") is materialize
    assert ensure_weights_retied(materialize, meta_model([]), "cpu") is materialize
    assert from_submodule is ensure_weights_retied


def test_a_param_init_fn_returning_none_is_accepted():
    model = meta_model(["head.weight"])

    def in_place(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=False)

    run(ensure_weights_retied(in_place, model, "cpu"), model)
    assert model.head.weight is model.embed.weight and model.head.weight.device.type == "cpu"
