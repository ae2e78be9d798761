"""Regional compilation (``compile_regions``, ``compile_regions_fsdp2``, ``TorchDynamoPlugin(
use_regional_compilation=True)``): repeated blocks are compiled once and reused, the results equal eager
ones, and the prepared model keeps its parameter names; plus the model inspection helpers next to them."""

from __future__ import annotations

import types
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lockstep import Accelerator, FullyShardedDataParallelPlugin
from lockstep.utils import (
    TorchDynamoPlugin,
    compile_regions,
    compile_regions_deepspeed,
    compile_regions_fsdp2,
    extract_model_from_parallel,
    get_model_tp_size,
    has_compiled_regions,
    is_compiled_module,
    model_has_dtensor,
)
from tests.helpers.fsdp_models import TinyTransformer
from tests.helpers.multiprocess import run_distributed

# Dynamo reads .grad of a block's (non-leaf) input while tracing; torch hides the warning that raises from
# its log, but pytest's "error" filter turns it into an exception first. Users never see it.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor is being accessed:UserWarning"
)


def counting_backend() -> tuple[Callable[..., Any], list[int]]:
    """A torch.compile backend that runs the graph eagerly and counts the graphs it was given (a new
    function each time: dynamo caches compiled code per backend)."""
    graphs: list[int] = []

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(len(graph.graph.nodes))
        return graph.forward

    return backend, graphs


def tiny_model(depth: int = 4) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(depth=depth)


INPUT = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


# -- compile_regions ---------------------------------------------------------------------------------------
def test_compile_regions_compiles_one_block_for_all_and_the_rest_apart():
    model = tiny_model(depth=4)
    expected = model(INPUT)
    backend, graphs = counting_backend()
    compiled = compile_regions(model, backend=backend)
    assert torch.equal(compiled(INPUT), expected)
    # embed, one TinyDecoderLayer graph reused by the four layers, head
    assert len(graphs) == 3
    assert [type(block).__name__ for block in compiled.layers] == ["OptimizedModule"] * 4
    assert is_compiled_module(compiled.embed) and is_compiled_module(compiled.head)
    whole_backend, whole = counting_backend()
    torch.compile(tiny_model(depth=4), backend=whole_backend)(INPUT)
    assert len(whole) == 1 and whole[0] > max(graphs)  # the whole model is one bigger graph


def test_compile_regions_shares_parameters_and_leaves_the_original_model_alone():
    model = tiny_model()
    compiled = compile_regions(model, backend="eager")
    assert compiled is not model and compiled.__dict__["_orig_mod"] is model
    assert not any(is_compiled_module(m) for m in model.modules())  # the original's children are unchanged
    assert {id(p) for p in compiled.parameters()} == {id(p) for p in model.parameters()}
    assert "layers.0._orig_mod.up.weight" in compiled.state_dict()  # as with torch.compile's wrappers
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model
    assert extract_model_from_parallel(compiled) is compiled
    assert extract_model_from_parallel(nn.DataParallel(compiled), keep_torch_compile=False) is model


def test_compile_regions_without_repeated_blocks_compiles_the_whole_module():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))  # a Sequential is not a list of blocks
    compiled = compile_regions(model, backend="eager")
    assert is_compiled_module(compiled) and compiled._orig_mod is model


def test_compile_regions_rebinds_forward_methods_bound_to_the_original():
    model = tiny_model()
    calls: list[nn.Module] = []

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        calls.append(self)
        return type(self).forward(self, x)

    model.forward = types.MethodType(forward, model)  # a wrapper bound to the instance (as Accelerate's)
    backend, graphs = counting_backend()
    compiled = compile_regions(model, backend=backend)
    compiled(INPUT)
    assert calls == [compiled] and len(graphs) == 3  # the copy ran, through its compiled blocks


def test_compile_regions_in_place_keeps_identity_and_names():
    model = tiny_model()
    names = list(model.state_dict())
    expected = model(INPUT)
    backend, graphs = counting_backend()
    assert compile_regions_fsdp2(model, backend=backend) is model
    assert list(model.state_dict()) == names and torch.equal(model(INPUT), expected)
    # One graph for the four layers; embed and head are torch.nn.Linear, whose in-place compiled call dynamo
    # leaves to eager (it does not trace frames of torch's own modules), as with Accelerate's helper.
    assert len(graphs) == 1 and has_compiled_regions(model)
    other = tiny_model()
    assert compile_regions_deepspeed(other, backend="eager") is None and has_compiled_regions(other)


def test_has_compiled_regions():
    model = tiny_model()
    assert not has_compiled_regions(model)
    assert has_compiled_regions(compile_regions(model, backend="eager"))
    assert has_compiled_regions(torch.compile(model, backend="eager"))  # the wrapper itself counts
    assert not has_compiled_regions(torch.compile(nn.Linear(1, 1), backend="eager")._orig_mod)
    leaf = nn.Linear(1, 1)
    leaf.compile(backend="eager")
    assert not has_compiled_regions(leaf)  # a module without children has no regions, as in Accelerate


# -- through the Accelerator ---------------------------------------------------------------------------------
def _train(plugin: TorchDynamoPlugin | None, sharded: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallelPlugin() if sharded else None
    accelerator = Accelerator(dynamo_plugin=plugin, fsdp_plugin=fsdp, mixed_precision="bf16")
    model = TinyTransformer(depth=3)
    names = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        batch = torch.randn(4, 5, 8, generator=generator)
        share = batch.chunk(accelerator.num_processes)[accelerator.process_index]
        loss = prepared(share).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    unwrapped = accelerator.unwrap_model(prepared)
    return {
        "losses": losses,
        "compiled": has_compiled_regions(prepared),
        "blocks_in_place": all(layer._compiled_call_impl is not None for layer in unwrapped.layers),
        "same_model": unwrapped is model,
        "same_names": list(unwrapped.state_dict()) == names,
        "sharded": model_has_dtensor(unwrapped),
        "state_plugin": accelerator.state.dynamo_plugin is plugin if plugin else None,
    }


def test_the_plugin_compiles_the_blocks_in_place_with_the_same_losses():
    plain = _train(None)
    regional = _train(TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    assert regional["losses"] == plain["losses"]  # eager backend under bf16 autocast: bitwise
    assert regional["compiled"] and regional["blocks_in_place"] and not plain["compiled"]
    assert regional["same_model"] and regional["same_names"] and regional["state_plugin"]


def test_regional_compilation_of_an_fsdp2_model_on_two_processes():
    plain = run_distributed(_train, 2, None, True)
    regional = run_distributed(
        _train, 2, TorchDynamoPlugin(backend="eager", use_regional_compilation=True), True
    )
    assert [r["losses"] for r in regional] == [p["losses"] for p in plain]
    assert all(r["compiled"] and r["blocks_in_place"] and r["sharded"] and r["same_names"] for r in regional)
    assert not any(p["compiled"] for p in plain)


def _graphs_and_gradients(policy: str) -> dict[str, Any]:
    """FSDP2 on this rank, eager then compiled per block with ``aot_eager`` (forward and backward graphs
    traced by AOT autograd, run without inductor): the graphs dynamo made and every parameter's gradient."""
    from torch._dynamo.utils import counters

    from tests.helpers.multiprocess import reset_lockstep_state

    result: dict[str, Any] = {}
    for name, plugin in (
        ("eager", None),
        ("regional", TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)),
    ):
        reset_lockstep_state()
        torch._dynamo.reset()
        counters.clear()
        fsdp = FullyShardedDataParallelPlugin(activation_checkpointing=policy)
        accelerator = Accelerator(dynamo_plugin=plugin, fsdp_plugin=fsdp)
        torch.manual_seed(0)
        model = accelerator.prepare(TinyTransformer(depth=4))
        batch = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1 + accelerator.process_index))
        output = model(batch)
        accelerator.backward(output.pow(2).mean())
        result[name] = {
            "output": output.detach(),
            "grads": [p.grad.full_tensor() for p in model.parameters()],
            "graphs": (counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]),
            "compiled": [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None)],
        }
    return result


@pytest.mark.parametrize(("policy", "graphs"), [("none", (1, 5)), ("full", (1, 2)), ("every_2", (2, 7))])
def test_fsdp2_regional_compilation_makes_one_graph_per_block_class_and_matches_eager(policy, graphs):
    """4 FSDP2-sharded decoder layers: one graph for all of them, holding the layer's 5 operators (norm, up,
    tanh, down, add), or the checkpoint of the layer when each is activation-checkpointed (every_2: one graph
    for the plain layers and one for the checkpointed ones); the embedding and
    the head (torch.nn.Linear, whose frames dynamo leaves to eager) add none. The blocks are compiled, not the
    model (whose compiled forward would break at every FSDP hook and also end with one layer graph). Outputs
    and gradients within 1e-5 of eager."""
    for rank in run_distributed(_graphs_and_gradients, 2, policy, timeout=180):
        eager, regional = rank["eager"], rank["regional"]
        assert eager["graphs"] == (0, 0) and regional["graphs"] == graphs
        assert eager["compiled"] == [] and regional["compiled"] == [
            "embed",
            *[f"layers.{i}" for i in range(4)],
            "head",
        ]
        torch.testing.assert_close(regional["output"], eager["output"], atol=1e-5, rtol=1e-5)
        for got, want in zip(regional["grads"], eager["grads"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- model inspection ------------------------------------------------------------------------------------------
def test_model_has_dtensor_is_false_for_plain_parameters():
    assert model_has_dtensor(tiny_model()) is False  # the True case: the FSDP2 test above


@pytest.mark.parametrize(
    ("tp_size", "config", "expected"),
    [
        (None, None, None),
        (2, None, 2),  # transformers < 5 records it on the model
        (None, SimpleNamespace(distributed_config=SimpleNamespace(tp_size=4)), 4),  # transformers >= 5
        (None, SimpleNamespace(distributed_config={"tp_size": 8}), 8),  # a config read back from JSON
        (None, SimpleNamespace(distributed_config=None), None),
    ],
)
def test_get_model_tp_size(tp_size, config, expected):
    model = nn.Linear(1, 1)
    model.tp_size = tp_size
    if config is not None:
        model.config = config
    assert get_model_tp_size(model) == expected
