"""``prepare_pippy``: pipelined inference on real 2-process gloo groups, against the unsplit model.

Each worker builds the model from a seed, splits it over the 2 processes with ``prepare_pippy`` and runs
batches through it; the test builds the same model in this process and compares the outputs (the bar:
1e-6, absolute; the measured largest difference is printed). The error cases run on 2 processes too,
because the batch checks happen at call time and must raise on every process alike.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lockstep import prepare_pippy
from lockstep.backends.pp.split import resolve_split_points
from tests.helpers.llama import tiny_llama_config
from tests.helpers.multiprocess import reset_lockstep_state, run_distributed
from tests.helpers.optional import requires

TOLERANCE = 1e-6
WIDTH, BLOCKS, BATCH = 16, 4, 8


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)])


def _llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4, use_cache=False)).eval()


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed))


def _token_ids() -> torch.Tensor:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(3))


def _infer() -> dict:
    results: dict = {}
    x = _inputs(1)
    model = prepare_pippy(_mlp(), example_args=(x,))  # auto split, 2 micro-batches, outputs on the last rank
    with torch.no_grad():
        results["mlp"] = model(x)
        results["mlp_small"] = model(x[:5])  # 5 samples: padded to 8 for the stages, the outputs cut back
    results["mlp_points"] = model.hf_split_points
    results["schedule"] = type(model.pippy_stage).__name__
    results["stage_parameters"] = sum(p.numel() for p in model.forward.pipelined.parameters())
    model = prepare_pippy(_mlp(), split_points=["3"], example_args=(x,), num_chunks=4, gather_output=True)
    results["gathered"] = model(x)  # no torch.no_grad(): pipelined calls never build a graph
    results["gathered_points"] = model.hf_split_points
    return results


def _infer_llama() -> dict:
    ids = _token_ids()
    llama = prepare_pippy(
        _llama(),
        no_split_module_classes=["LlamaDecoderLayer"],
        example_kwargs={"input_ids": ids},
        gather_output=True,
    )
    with torch.no_grad():
        # the first rank reads the inputs; the last may call without them
        logits = llama(input_ids=ids) if torch.distributed.get_rank() == 0 else llama()
    return {"logits": logits, "points": llama.hf_split_points}


@pytest.mark.distributed
def test_prepare_pippy_outputs_equal_the_unsplit_model():
    results = run_distributed(_infer, 2, timeout=120)
    x = _inputs(1)
    with torch.no_grad():
        expected, expected_small = _mlp()(x), _mlp()(x[:5])
    first, last = results
    assert first["mlp"] is None and first["mlp_small"] is None  # gather_output=False: the last rank only
    differences = {
        "mlp": (last["mlp"] - expected).abs().max().item(),
        "mlp_small": (last["mlp_small"] - expected_small).abs().max().item(),
        "gathered": max((r["gathered"] - expected).abs().max().item() for r in results),
    }
    print("largest differences from the unsplit model:", differences)
    assert last["mlp_small"].shape == (5, WIDTH)
    assert all(difference <= TOLERANCE for difference in differences.values()), differences
    assert not results[0]["gathered"].requires_grad
    assert first["mlp_points"] == last["mlp_points"] == ["2"]  # 4 equal blocks: 2 per process
    assert first["stage_parameters"] == last["stage_parameters"] == 2 * (WIDTH * WIDTH + WIDTH)
    assert first["gathered_points"] == ["3"] and first["schedule"] == "ScheduleGPipe"


@pytest.mark.distributed
@requires("transformers")
def test_a_tiny_llama_split_by_prepare_pippy_gives_the_unsplit_logits_on_every_rank():
    results = run_distributed(_infer_llama, 2, timeout=120)
    ids = _token_ids()
    with torch.no_grad():
        expected = _llama()(input_ids=ids).logits
    difference = max((r["logits"] - expected).abs().max().item() for r in results)
    print("largest difference from the unsplit logits:", difference)
    assert results[0]["logits"].shape == (4, 8, 64) and difference <= TOLERANCE
    assert results[0]["points"] == ["model.layers.2"]  # between decoder layers, never inside one


def _message(call) -> str:
    try:
        call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


class _Layer(nn.Module):
    """A block holding a list of experts: the longest list of repeated modules lies inside each layer."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(expert(x) for expert in self.experts) / len(self.experts)


class _MixtureModel(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _errors() -> dict:
    x = _inputs(1)
    messages = {
        "missing": _message(lambda: prepare_pippy(_mlp(), split_points=["9"], example_args=(x,))),
        "no_example": _message(lambda: prepare_pippy(_mlp())),
        "tensor_example": _message(lambda: prepare_pippy(_mlp(), example_args=x)),
        "inside": _message(
            lambda: prepare_pippy(
                _MixtureModel(),
                split_points=["layers.1.experts.2"],
                no_split_module_classes=["_Layer"],
                example_args=(x,),
            )
        ),
        "nothing_to_cut": _message(
            lambda: prepare_pippy(_MixtureModel(1), no_split_module_classes=["_Layer"], example_args=(x,))
        ),
    }
    model = prepare_pippy(_mlp(), example_args=(x,), num_chunks=3)  # 8 samples: traced padded to 9
    with torch.no_grad():
        messages["larger"] = _message(lambda: model(torch.cat([x, x])))
        messages["renamed"] = _message(lambda: model(inputs=x))
        odd = model(x)  # 8 samples, 3 micro-batches: padded to 9
    messages["odd_shape"] = None if odd is None else tuple(odd.shape)
    messages["odd_difference"] = None if odd is None else (odd - _mlp()(x)).abs().max().item()
    return messages


@pytest.mark.distributed
def test_prepare_pippy_errors_are_clear_and_raised_on_every_process():
    results = run_distributed(_errors, 2, timeout=120)
    for messages in results:
        assert messages["missing"].startswith(
            "ValueError: prepare_pippy(split_points=['9']) names '9', which is no module of Sequential. "
            "Its modules are: 0 (Sequential), 0.0 (Linear), 0.1 (Tanh), 1 (Sequential)"
        )
        assert messages["no_example"].startswith(
            "ValueError: prepare_pippy traces Sequential once to cut it into stages, and needs example inputs: "
            "pass example_args=(inputs,) or example_kwargs="
        )
        assert messages["tensor_example"].startswith(
            "TypeError: prepare_pippy(example_args=...) must be a tuple of the model's positional inputs, got a "
            "Tensor. Wrap a single input: example_args=(inputs,)."
        )
        assert messages["inside"] == (
            "ValueError: prepare_pippy(split_points=['layers.1.experts.2']) cuts inside 'layers.1' (_Layer) at "
            "'layers.1.experts.2', but no_split_module_classes=['_Layer'] keeps _Layer modules whole. Split at "
            "'layers.1' or at another module outside it."
        )
        assert messages["nothing_to_cut"].startswith(
            "ValueError: prepare_pippy(split_points='auto') found no list of repeated blocks outside modules of "
            "the classes ['_Layer'] in _MixtureModel"
        )
        assert messages["larger"].startswith(
            "ValueError: The pipelined model got a batch of 16 samples, but prepare_pippy traced it on batches "
            "of 9 (example inputs padded to a multiple of num_chunks)"
        )
        assert messages["renamed"].startswith(
            "ValueError: The pipelined model got 0 positional inputs and the keyword inputs ['inputs'], but "
            "prepare_pippy traced it with 1 and []"
        )
    assert results[0]["odd_shape"] is None and results[1]["odd_shape"] == (BATCH, WIDTH)
    assert results[1]["odd_difference"] <= TOLERANCE


def test_auto_split_keeps_no_split_classes_whole_and_counts_stages():
    model = _MixtureModel()
    # Without the argument the longest list is a layer's experts: the cut would fall inside a layer.
    assert resolve_split_points(model, "auto", 2) == ["layers.0.experts.3"]
    assert resolve_split_points(model, "auto", 2, no_split=["_Layer"], caller="prepare_pippy") == ["layers.1"]
    with pytest.raises(ValueError, match=r"^Cannot cut _MixtureModel into 4 pipeline stages: its repeated "):
        resolve_split_points(
            model,
            "auto",
            4,
            no_split=["_Layer"],
            caller="prepare_pippy",
            stages_from="the number of processes",
        )


def test_on_one_process_the_model_is_returned_as_it_is():
    reset_lockstep_state()
    model = _mlp()
    x = _inputs(1)
    assert prepare_pippy(model, example_args=(x,)) is model
    assert model.hf_split_points == [] and "forward" not in vars(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), _mlp()(x))
    reset_lockstep_state()
